"""High-throughput dispatch, orchestrated along its phases: layout exchange (``notify``: counts and send
lists through the peers' meta areas, then the handle kernel), the transfer (the transport's
``_bulk_dispatch``, or the push fused into the receive), the one host synchronisation (counts and the
error word in one copy; none with ``num_worst_tokens``), and the receive (``gather``: ``recv_x`` in
(source rank, token) order from local x and the staging slots).

``HTDispatch`` is a mixin of a backend that provides the symmetric-memory state (``ptr_table``,
``flags_off``, meta and list offsets, counters, tickets, the launchers ``k``, ``_ht_layout``,
``_local``, ``_notify_views``, ``_check_error``) and a transport (``_bulk_dispatch``, ``_fused_push``,
``_join_ce``: backends/nvlink_transfer.py).

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``, ``C``
channels, ``N`` received rows, ``G = H/128``.
"""

from __future__ import annotations

import torch

from ..kernels.launch import Direct
from ..layout import DispatchHandle
from .base import DispatchArgs, DispatchResult, bad_expert_id
from .nvlink_params import (
    C_MAX,
    DRECV,
    DSEND,
    L_MAX,
    NC,
    T_DPUSH,
    T_GATHER,
    TIMER,
    TUNE,
    _aligned,
    _host_counts,
    _pow2,
    torch_to_tl,
)


class HTDispatch:
    def _gather_launch(self, key, x_words, lay: dict, g: int, k: int, lx: int, lo_expert: int, cached: bool,
                       is_prefix: bool, push: bool, has_k: bool, has_scales: bool, has_topk_out: bool):
        """The receive (gather) kernel's launch for dispatches of one kind (``key``), everything but the
        per-call tensors and counts fixed (``kernels/launch.Direct``): ``go(gx, gy, gz, x, scales, topk,
        w, counts, toks, rows, out_x, out_s, out_k, out_w, out_src, is_in, tokens)``; with the
        placeholders for absent float and top-k arguments."""
        row, d_slot = x_words.shape[1], lay["d_slot"]
        stage_x = self._local(lay["dx"], d_slot, x_words.dtype)
        stage_s = self._local(lay["ds"], d_slot, torch.float32)
        stage_k = self._local(lay["dk"], d_slot, torch.int64)
        stage_w = self._local(lay["dw"], d_slot, torch.float32)
        r_ = self.num_ranks
        p = self.k["_gather_kernel"].prepared(key, dict(
            PUSH=push, PUSH_RB=TUNE["push_rb"], PUSH_BLOCK=TUNE["push_block"], ELEM=torch_to_tl(x_words.dtype),
            PUSH_TOPK=push and has_k, CACHED=cached, IS_PREFIX=is_prefix, HAS_SCALES=has_scales,
            HAS_TOPK=has_topk_out, NC=NC, RB=TUNE["gather_rb"], BLOCK=TUNE["gather_block"], R_POW2=_pow2(r_),
            K_POW2=_pow2(k), G_POW2=_pow2(g), HAS_TIMER=TIMER, STAGES=TUNE["gather_stages"],
            ONE_LOAD=TUNE["gather_one_load"], PREFETCH=TUNE["gather_prefetch"], num_warps=TUNE["gather_warps"]))
        tmpl = (None, None, None, None, row, g, k, None, r_, self.rank, r_, lo_expert, lx, None,
                self.p_src_lists, self.src_lists.stride(0), None,
                stage_x, d_slot // x_words.element_size(), stage_s, d_slot // 4, stage_k, d_slot // 8, stage_w,
                d_slot // 4, None, None, g, 1, None, None, None,
                self.p_table, self.flags_off, self.p_ctr[DRECV], self.p_tk[T_GATHER], self.p_err, self._timeout_ns,
                None, None, lay["dx"], d_slot, lay["ds"], lay["dk"], lay["dw"], self.p_ctr[DSEND], self.p_tk[T_DPUSH])
        holes = (0, 1, 2, 3, 7, 13, 16, 25, 26, 29, 30, 31, 38, 39)
        return Direct(p, tmpl, holes), stage_s, stage_k

    def _gather(self, x_words, scales, topk, w, lay, counts, is_prefix: bool, n_rows: int, lo_expert: int,
                lx: int, out_src: torch.Tensor, cached: bool, g: int, k: int, toks: torch.Tensor | None,
                is_in: torch.Tensor):

        dev = self.device
        out_x = torch.empty(n_rows, x_words.shape[1], dtype=x_words.dtype, device=dev)
        out_s = out_k = out_w = None
        if scales is not None:
            out_s = torch.empty(n_rows, g, dtype=torch.float32, device=dev)
        if topk is not None and not cached:
            out_k = torch.empty(n_rows, k, dtype=torch.int64, device=dev)
            out_w = torch.empty(n_rows, k, dtype=torch.float32, device=dev)
        push = not cached and self._fused_push()
        has_k = topk is not None and topk.numel() > 0
        key = (x_words.shape[1], g, k, lx, lo_expert, cached, is_prefix, push, has_k, scales is None, topk is None,
               x_words.dtype, lay["dx"], lay["d_slot"], lay["ds"], lay["dk"], lay["dw"],
               _aligned(x_words, scales, topk, w, counts, is_in))
        go = self._gather_launches.get(key)
        if go is None:
            if len(self._gather_launches) > 4096:
                self._gather_launches.clear()
            go = self._gather_launches[key] = self._gather_launch(
                key, x_words, lay, g, k, lx, lo_expert, cached, is_prefix, push, has_k, scales is not None,
                out_k is not None)
        go, dummy_f, stage_k = go
        rb = TUNE["gather_rb"]
        # with the push every program must be resident at once (at most one per SM: a num_sms above the
        # GPU's SM count would leave programs waiting on programs that cannot start); the Triton
        # interpreter (CPU runs) runs programs one after another, so there the fused kernel is one program
        fused_grid = min(self.num_sms, self.sm_count) if TIMER else 1
        grid = max(1, fused_grid if push else min(self.num_sms, (n_rows + rb - 1) // rb))
        go(grid, 1, 1, x_words, scales if scales is not None else dummy_f, topk if topk is not None else stage_k,
           w if w is not None else dummy_f, counts, toks if toks is not None else self.p_nctr, n_rows, out_x,
           out_s if out_s is not None else dummy_f, out_k if out_k is not None else stage_k,
           out_w if out_w is not None else dummy_f, out_src, is_in.view(torch.int8) if push else self.p_err,
           x_words.shape[0])
        return out_x, out_s, out_k, out_w

    def dispatch(self, a: DispatchArgs) -> DispatchResult:

        self._check_error()
        self._call_sms = a.num_sms  # the call's Config.num_sms bounds every grid of the call
        r_, me, dev = self.num_ranks, self.rank, self.device
        t, h = a.x.shape
        e = a.num_tokens_per_expert.numel()
        lx = e // r_
        c = a.num_channels
        if lx > L_MAX or c > C_MAX:
            raise ValueError(f"the nvlink backend supports up to {L_MAX} local experts and {C_MAX} channels, "
                             f"got L={lx}, C={c}")
        k = a.topk_idx.shape[1] if a.topk_idx is not None else 0
        g = a.x_scales.shape[1] if a.x_scales is not None else 0
        x_words = a.x.view(torch.uint8).view(torch.int32) if a.x.element_size() == 1 else a.x.view(torch.int32)
        lay = self._ht_layout(t, x_words.shape[1] * 4, g, k, h)
        scales = a.x_scales.contiguous() if a.x_scales is not None else None
        topk = a.topk_idx.contiguous() if a.topk_idx is not None else None
        w = a.topk_weights.contiguous() if a.topk_weights is not None else None
        is_in = a.is_token_in_rank.contiguous()
        send_head_rel = torch.empty(t, r_, dtype=torch.int32, device=dev)
        cpm = torch.empty(r_, c, dtype=torch.int32, device=dev)
        counts, per_expert, chan, toks = self._notify_views(lx, c)
        per_chan = max((t + c - 1) // c, 1)

        ntpr, ntpe = a.num_tokens_per_rank, a.num_tokens_per_expert
        key = (lx, c, k, e, _aligned(is_in, ntpr, ntpe, topk))

        def notify():
            self.k["_notify_kernel"](
                key, (r_,),
                is_in.view(torch.int8), t, r_, me, ntpr, ntpe, lx, c, per_chan,
                self.p_table, self.flags_off, self.meta_off, self.meta_parity_bytes, self.meta_src_bytes,
                self.list_off, self.list_parity_bytes, self.list_src_bytes,
                self.p_nctr, send_head_rel, cpm, counts, per_expert, chan, toks, self.p_src_lists,
                self.src_lists.stride(0), self.p_err, self._timeout_ns,
                BLOCK=TUNE["notify_block"], R_POW2=_pow2(r_), DO_SEND=True, DO_RECV=True, HAS_TIMER=TIMER,
                num_warps=TUNE["notify_warps"],
            )

        bulk = dict(fused=True, synchronised=not a.num_worst_tokens)
        if TUNE["notify_first"]:
            # the exchange of counts runs while the host queues the copies (the synchronisation below then
            # waits less); the copies wait for the inputs only, through an event recorded before notify
            self._ready_event.record(self._current_stream())
            notify()
            self._bulk_dispatch(x_words, scales, topk, w, lay, is_in, ready=self._ready_event, **bulk)
        else:
            self._bulk_dispatch(x_words, scales, topk, w, lay, is_in, **bulk)
            notify()
        # The handle's tensors need only the notify outputs: their kernel is queued before the
        # synchronisation, so its launch is not on the host's path between the counts and the gather.
        rpm = torch.empty(r_, r_, dtype=torch.int32, device=dev)
        recv_cp = torch.empty(r_, c, dtype=torch.int32, device=dev)
        send_head = torch.empty(t, r_, dtype=torch.int32, device=dev)

        def handle_kernel():
            tb = 128
            self.k["_handle_kernel"](
                key, (max(1, min(self.num_sms, (t + tb - 1) // tb)),),
                counts, r_, chan, c, c, send_head_rel, t, r_, me, rpm, recv_cp, send_head, self.p_err,
                a.num_worst_tokens,
                topk if topk is not None else send_head, k, e, CHECK_WORST=bool(a.num_worst_tokens),
                R_POW2=_pow2(r_), C_POW2=_pow2(c), TB=tb, CHECK_TOPK=topk is not None, K_POW2=_pow2(k),
                num_warps=4)

        host_col = None
        bad_id = None
        if a.num_worst_tokens:
            # no host synchronisation: expert ids are checked by the handle kernel (error word)
            n_rows = a.num_worst_tokens
            lst = []
            handle_kernel()
        else:
            # The contract's one synchronisation: the counts and the error word (with the handle kernel's
            # check of the expert ids) come back in one copy; after it, a few NumPy operations on the pinned
            # words (no torch op per value).
            handle_kernel()
            dst, src = self._sync_copy
            dst.copy_(src, non_blocking=True)
            self._sync_event.record(self._current_stream())
            self._sync_event.synchronize()
            vals = self._notify_view
            bad_id = bad_expert_id(self, vals[self.err_at:self.err_at + 4].tolist())
            host_col, n_rows, lst = _host_counts(vals, r_, lx, me, a.expert_alignment)
        out_src = torch.empty(n_rows, dtype=torch.int32, device=dev)
        out_x, out_s, out_k, out_w = self._gather(x_words, scales, topk, w, lay, counts, False, n_rows,
                                                  me * lx, lx,
                                                  out_src, False, g, k, toks, is_in)
        self._join_ce()
        if bad_id is not None:
            # A bad expert id: every rank still finished this exchange (ids out of range were ignored
            # by the layout), so the Buffer stays in step; report the argument.
            raise ValueError(f"topk_idx holds expert id {bad_id}, outside [-1, {e}) for num_experts={e}")
        recv_x = out_x.view(torch.uint8).view(a.x.dtype) if a.x.element_size() == 1 else out_x.view(a.x.dtype)
        recv_x = recv_x.view(n_rows, h)
        handle = DispatchHandle(rpm, cpm, recv_cp, out_src, a.is_token_in_rank, send_head)
        if host_col is not None:
            # The combine's copy-engine path needs the block bounds on the host (rank_prefix_matrix[:, me]);
            # keep them on the handle.
            rpm._epcomm_host_col = host_col
        return DispatchResult(recv_x, out_s, out_k, out_w, lst, handle)

    def cached_dispatch(self, x, x_scales, handle: DispatchHandle, config=None):
        self._check_error()
        self._call_sms = config.num_sms if config is not None else None
        t, h = x.shape
        g = x_scales.shape[1] if x_scales is not None else 0
        x_words = x.view(torch.uint8).view(torch.int32) if x.element_size() == 1 else x.view(torch.int32)
        lay = self._ht_layout(t, x_words.shape[1] * 4, g, 0, h)
        scales = x_scales.contiguous() if x_scales is not None else None
        is_in = handle.is_token_in_rank.contiguous()
        self._bulk_dispatch(x_words, scales, None, None, lay, is_in)
        n_rows = handle.recv_src_idx.numel()
        out_x, out_s, _, _ = self._gather(x_words, scales, None, None, lay, handle.rank_prefix_matrix, True,
                                          n_rows,
                                          0, 0, handle.recv_src_idx, True, g, 0, None, is_in)
        self._join_ce()
        recv_x = out_x.view(torch.uint8).view(x.dtype) if x.element_size() == 1 else out_x.view(x.dtype)
        return recv_x.view(n_rows, h), out_s
