"""High-throughput combine, orchestrated along its phases: the transfer (the transport's ``_combine_send``:
each rank's block of rows for owner ``i`` into ``i``'s combine staging), then the receive (``reduce``:
rank by rank, float32, plus bias, into ``bf16[T, H]``).

``HTCombine`` is a mixin of a backend that provides the symmetric-memory state and a transport (see
ht_dispatch.py).

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``R`` ranks.
"""

from __future__ import annotations

import torch

from ..layout import DispatchHandle
from ..kernels.launch import Direct
from .nvlink_params import CRECV, NC, T_REDUCE, TIMER, TUNE, _aligned, _pow2, reduce_stages


class HTCombine:
    def _reduce_launch(self, key, lay: dict, h: int, k: int, t: int, n_bias: int, has_w: bool):
        """The receive kernel's launch for combines of one kind (``key``): ``go(gx, gy, gz, x, send_head,
        rpm, w, rows, bias0, bias1, out, out_w)``, everything else fixed (``kernels/launch.Direct``), and
        the placeholder for an absent ``w`` / ``out_w``."""
        r_, me = self.num_ranks, self.rank
        stage_x = self._local(lay["cx"], lay["c_slot"], torch.bfloat16)
        stage_w = self._local(lay["cw"], lay["c_slot"], torch.float32)
        tb = TUNE["reduce_tb"]
        p = self.k["_reduce_kernel"].prepared((h, k, key[-1]), dict(  # (alignment: the kernel's own key)
            HAS_W=has_w, NUM_BIAS=n_bias, NC=NC, TB=tb, BLOCK=TUNE["reduce_block"], R_POW2=_pow2(r_),
            K_POW2=_pow2(k), HAS_TIMER=TIMER, STAGES=reduce_stages(_pow2(r_), tb, TUNE["reduce_block"]),
            num_warps=TUNE["reduce_warps"]))
        tmpl = (None, h, t, r_, me, None, None, stage_w.tensor, k, None,
                stage_x, lay["c_slot"] // 2, stage_w, lay["c_slot"] // 4,
                None, None, None, None,
                self.p_table, self.flags_off, self.p_ctr[CRECV], self.p_tk[T_REDUCE], self.p_err, self._timeout_ns)
        return Direct(p, tmpl, (0, 5, 6, 7, 9, 14, 15, 16, 17)), stage_w.tensor

    def combine(self, x, handle: DispatchHandle, topk_weights, bias, config=None):
        self._check_error()
        self._call_sms = config.num_sms if config is not None else None
        r_, me, dev = self.num_ranks, self.rank, self.device
        t = handle.is_token_in_rank.shape[0]
        h = x.shape[1]
        k = topk_weights.shape[1] if topk_weights is not None else 0
        lay = self._ht_layout(t, 0, 0, k, h)
        rpm = handle.rank_prefix_matrix
        x = x.contiguous()
        w = topk_weights.contiguous() if topk_weights is not None else None
        if r_ > 1:
            self._combine_send(x, w, k, h, rpm, getattr(rpm, "_epcomm_host_col", None), lay)
        out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
        out_w = torch.empty(t, k, dtype=torch.float32, device=dev) if w is not None else None
        send_head, rpm = handle.send_head.contiguous(), rpm.contiguous()
        b0 = bias[0].contiguous() if len(bias) > 0 else out
        b1 = bias[1].contiguous() if len(bias) > 1 else out
        key = (h, k, t, len(bias), w is not None, _aligned(x, send_head, rpm, w, b0, b1))
        go = self._reduce_launches.get(key)
        if go is None:
            if len(self._reduce_launches) > 4096:  # t is part of the key: bounded, whatever the callers vary
                self._reduce_launches.clear()
            go = self._reduce_launches[key] = self._reduce_launch(key, lay, h, k, t, len(bias), w is not None)
        go, stage_w = go
        tb = TUNE["reduce_tb"]
        go(max(1, min(self.num_sms, (t + tb - 1) // tb)), 1, 1, x, send_head, rpm,
           w if w is not None else stage_w, x.shape[0], b0, b1, out, out_w if out_w is not None else stage_w)
        self._join_ce()
        return out, out_w
