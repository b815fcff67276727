"""High-throughput combine, orchestrated along its phases: the transfer (each rank's block of rows for owner
``i`` into ``i``'s combine staging) and the receive (``reduce``: rank by rank, float32, plus bias, into
``bf16[T, H]``). With the SM transfer both are one kernel (``_combine_kernel``: its programs push, then
reduce); with the copy engine (``EPCOMM_HT_TRANSFER=ce``, eager calls whose handle has its block bounds on the
host) the transport's ``_combine_send``, then ``_reduce_kernel``; one rank only reduces.

A combine of one kind (shapes, flags, Config, the 16-byte alignment of its tensors) is planned once
(``combine_run``): a repeat costs its output allocations and one launch. ``Buffer`` keeps the plans'
``run`` per kind.

``HTCombine`` is a mixin of a backend that provides the symmetric-memory state and a transport (see
ht_dispatch.py).

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``R`` ranks, ``N`` rows returned.
"""

from __future__ import annotations

import torch

from .. import native
from ..kernels.launch import Direct, Launcher
from ..layout import DispatchHandle
from ..native import Outputs
from .nvlink_params import (CRECV, CSEND, NC, T_CPUSH, T_REDUCE, TIMER, TUNE, _aligned, _contiguous, _pow2,
                            reduce_stages)

_MAX_PLANS = 4096  # the token count is part of a kind: bounded, whatever the callers vary


class HTCombine:
    def combine_run(self, x, handle: DispatchHandle, topk_weights, bias, config=None):
        """``run(x, handle, topk_weights, bias) -> (combined_x, combined_topk_weights)``, made once for every
        combine like this one (same shapes but x's row count, dtypes, Config, number of biases, alignment of
        x, weights, biases and the handle's ``send_head`` and ``rank_prefix_matrix``; contiguous tensors), or
        None where a call's launches depend on more (the copy engine's, by capture state and by whether the
        handle carries its block bounds on the host): ``Buffer`` keeps it for the repeats."""
        run = self._combine_plan(x, handle, topk_weights, bias, config)
        return run if self.transfer == "sm" else None

    def _combine_plan(self, x, handle: DispatchHandle, w, bias, config):
        t, h = handle.is_token_in_rank.shape[0], x.shape[1]
        k = w.shape[1] if w is not None else 0
        rpm = handle.rank_prefix_matrix
        ce = (self.num_ranks > 1 and getattr(rpm, "_epcomm_host_col", None) is not None and self._use_ce())
        fused = self.num_ranks > 1 and not ce
        num_sms = config.num_sms if config is not None else None
        key = ("cb", t, h, k, len(bias), w is not None, num_sms, ce, fused,
               _aligned(x, handle.send_head, rpm, w, *bias))
        run = self._plans.get(key)
        if run is None:
            if len(self._plans) > _MAX_PLANS:
                self._plans.clear()
            run = self._plans[key] = self._make_combine(key, t, h, k, len(bias), w is not None, num_sms, ce, fused)
        return run

    def _make_combine(self, key, t: int, h: int, k: int, n_bias: int, has_w: bool, num_sms, ce: bool,
                      fused: bool):
        r_, me, dev = self.num_ranks, self.rank, self.device
        lay = self._ht_layout(t, 0, 0, k, h)
        stage_x = self._local(lay["cx"], lay["c_slot"], torch.bfloat16)
        stage_w = self._local(lay["cw"], lay["c_slot"], torch.float32)
        tb = TUNE["reduce_tb"]
        consts = dict(HAS_W=has_w, NUM_BIAS=n_bias, NC=NC, TB=tb, BLOCK=TUNE["reduce_block"], R_POW2=_pow2(r_),
                      K_POW2=_pow2(k), HAS_TIMER=TIMER, STAGES=reduce_stages(_pow2(r_), tb, TUNE["reduce_block"]),
                      num_warps=TUNE["reduce_warps"])
        args = dict(x_ptr=None, H=h, T=t, R=r_, me=me, send_head_ptr=None, rpm_ptr=None, w_ptr=stage_w, K=k,
                    x_rows=None, stage_ptr=stage_x, stage_src_elems=lay["c_slot"] // 2, stage_w_ptr=stage_w,
                    stage_w_src=lay["c_slot"] // 4, bias0_ptr=stage_x, bias1_ptr=stage_x, out_ptr=None,
                    out_w_ptr=stage_w, ptr_table=self.p_table, flags_off=self.flags_off, ctr_ptr=self.p_ctr[CRECV],
                    ticket_ptr=self.p_tk[T_REDUCE], err_ptr=self.p_err, timeout_ns=self._timeout_ns)
        if fused:
            name = "_combine_kernel"
            consts.update(PUSH_RB=TUNE["cpush_rb"], PUSH_BLOCK=TUNE["cpush_block"])
            args.update(push_off=lay["cx"], push_src_bytes=lay["c_slot"], push_w_off=lay["cw"],
                        push_w_src_bytes=lay["c_slot"], send_ctr_ptr=self.p_ctr[CSEND], push_ticket_ptr=self.p_tk[T_CPUSH])
        else:
            name = "_reduce_kernel"
        holes = ("x_ptr", "send_head_ptr", "rpm_ptr") + (("w_ptr",) if has_w else ()) + ("x_rows",) \
            + ("bias0_ptr", "bias1_ptr")[:n_bias] + ("out_ptr",) + (("out_w_ptr",) if has_w else ())
        go = Direct.named(self.k[name].prepared(key, consts), args, holes)
        f32, bf16 = torch.float32, torch.bfloat16
        err_view = self._err_view
        specs = [((t, h), bf16)] + ([((t, k), f32)] if has_w else [])
        outs = Outputs(dev, specs, True) if native.wanted(dev) else None

        def make_chain():
            # the call's values: x, send_head, rank_prefix_matrix, w, its rows, two biases, the grid
            a, o = native.addr, native.out
            one = native.const(1)
            st = go.step((native.num(7), one, one), (a(0), a(1), a(2)) + ((a(3),) if has_w else ()) + (native.num(4),)
                         + (a(5), a(6))[:n_bias] + (o(0),) + ((o(1),) if has_w else ()))
            return None if st is None else native.Chain(dev, specs, native.const(0), [st], 8,
                                                        stream=go.p.chain_stream())

        # the outputs and the one launch as one native.Chain call (after the first call bound the launch),
        # where the call is only those: the fused push, or one rank
        chain = native.Later(outs is not None and outs.native and not ce and (fused or r_ == 1), make_chain)

        def grid_of():
            # every program of the fused kernel must be resident (one waits for rows others push; at most one
            # per SM); the Triton interpreter runs programs one after another, so there it is one program
            if fused:
                return max(1, min(self.num_sms, self.sm_count) if TIMER else 1)
            return max(1, min(self.num_sms, (t + tb - 1) // tb))

        def run(x, handle, w, bias):
            if err_view[0]:
                self._check_error()
            self._call_sms = num_sms
            rpm, send_head = handle.rank_prefix_matrix, handle.send_head
            n = x.shape[0]
            ch = chain.value
            if ch is not None:
                Launcher.launches += 1
                made = ch(x, send_head, rpm, w, n, *bias, *(None,) * (2 - n_bias), grid_of())
                return made[0], (made[1] if has_w else None)
            if not fused and r_ > 1:
                self._combine_send(x, w, k, h, rpm, getattr(rpm, "_epcomm_host_col", None), lay)
            if outs is not None:
                out, out_w = (*outs(), None)[:2]
            else:
                out = torch.empty(t, h, dtype=bf16, device=dev)
                out_w = torch.empty(t, k, dtype=f32, device=dev) if has_w else None
            go(grid_of(), 1, 1, x, send_head, rpm, *((w,) if has_w else ()), n, *bias, out,
               *((out_w,) if has_w else ()))
            if ce:
                self._join_ce()
            chain.ready()
            return out, out_w

        return run

    def combine(self, x, handle: DispatchHandle, topk_weights, bias, config=None):
        self._check_error()
        x, w = _contiguous(x), _contiguous(topk_weights)
        bias = tuple(_contiguous(b) for b in bias)
        rpm, sh = handle.rank_prefix_matrix, handle.send_head
        if not (rpm.is_contiguous() and sh.is_contiguous()):
            host_col = getattr(rpm, "_epcomm_host_col", None)
            rpm = rpm.contiguous()
            if host_col is not None:
                rpm._epcomm_host_col = host_col
            handle = handle._replace(rank_prefix_matrix=rpm, send_head=sh.contiguous())
        return self._combine_plan(x, handle, w, bias, config)(x, handle, w, bias)
