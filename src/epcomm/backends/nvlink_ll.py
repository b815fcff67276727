"""Low-latency mode of the nvlink backend: launches of kernels/ll.py over the LL region of the
symmetric buffer (``layout.LowLatencyBufferLayout``).

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``,
``M`` max tokens per rank.

Dispatch: a send kernel (program per (token, group of 128-channel blocks): FP8 cast, row to every
rank holding one of the token's experts, ids to every rank) and a receive kernel (program per
(local expert, source rank): its block of rows in token order after the blocks of lower ranks).
Combine: a weights kernel (each owner pushes its (expert id, weight) pairs to every rank), a reduce
kernel (program per (source token, channel split): ``Σ_k w·y`` in float32 over the experts held
here, so each token crosses the link once per rank) and a receive kernel (program per (token,
channel block): the partial sums of the ranks holding its experts, in rank order). Without the
hook the kernels run back to back (or, with ``TUNE["fused_dispatch"]`` / ``TUNE["fused_combine"]``,
as one launch whose programs take the kernels' roles in order); with ``return_recv_hook`` the call
launches the send side and returns, and ``hook()`` launches the receive kernel, so no kernel stays
resident in between.
Every grid is sized by the shape, not by ``num_sms``; waits are per program, on the flags of the
ranks that program needs.

Parity: ``Buffer`` alternates the parity call by call; a CUDA graph replays the parities it
captured, and a captured dispatch + combine pair uses both areas, so replays stay safe. At most two
low-latency calls may be in flight (a third reuses the first one's area). The areas and flags
are laid out for one (M, H, E); ``Buffer`` asks for ``clean_low_latency_buffer`` before another.
"""

from __future__ import annotations

import torch

from .. import layout
from ..layout import LowLatencyHandle
from .base import LowLatencyCombineArgs, LowLatencyDispatchArgs, LowLatencyDispatchResult
from .nvlink_params import TIMER, _pow2

# local counters (int32 device memory): dispatch-receive level [2], combine weight level [2],
# combine-receive level [2]
_DLEVEL, _WLEVEL, _CLEVEL = 0, 2, 4
# ticket slots in the backend's ticket tensor
_T_DSEND, _T_DRECV, _T_CSEND, _T_CRECV = 4, 5, 6, 8  # _T_CSEND uses two consecutive slots
_T_ROLE, _T_CROLE = 9, 10  # the fused dispatch's and the fused combine's role tickets

# Launch parameters (scripts/profile_ll.py sweeps them on the device machine).
TUNE = dict(send_warps=4, send_gc=8, recv_warps=4, recv_tb=128, recv_qb=4, recv_block=2048, recv_split=1,
            csend_warps=4, csend_block=1024, csend_programs=2048, crecv_warps=4, crecv_block=1024,
            fused_dispatch=False, fused_combine=False, local_ticket=True)
# fused_dispatch: without the hook, send and receive in one launch (kernels/ll.py
# _ll_dispatch_fused_kernel; send_warps for both roles); fused_combine: weights and reduce in one launch,
# with the receive too when there is no hook (_ll_combine_fused_kernel; csend_warps); both off until
# measured on a GPU; local_ticket: the receive kernels count their programs with a relaxed GPU-scope
# ticket (their last program only stores the next expected level) instead of a system-scope acq_rel one
# (one H200, one rank, 128 tokens, graph replays, same run: dispatch receive 12.9 -> 12.1 us, combine
# receive 8.7 -> 8.0 us; 1 token: 7.4 -> 7.2, 5.9 -> 5.5 us)


def _nothing() -> None:
    """The hook of a call that already received (one fused launch)."""


class _Plan:
    """What a low-latency call of one ``(M, H, E)`` needs besides its tensors, computed once: the
    layout, the offsets of both parities' areas and the kernels' integer arguments."""

    def __init__(self, nv, m: int, h: int, e: int, lay) -> None:
        r_ = nv.num_ranks
        self.m, self.h, self.e, self.lay = m, h, e, lay
        self.lx = e // r_
        self.g = (h + 127) // 128
        self.area = [nv.ll_off + lay.parity_offset(p) for p in (0, 1)]
        self.sig = [a + lay.signal_offset for a in self.area]


class LowLatencyEngine:
    def __init__(self, nv):
        from ..kernels import ll
        from ..kernels.launch import Launcher, Ptr

        self.nv = nv
        self.levels = torch.zeros(8, dtype=torch.int32, device=nv.device)
        self.tickets = torch.zeros(16, dtype=torch.int32, device=nv.device)
        self.sms = torch.cuda.get_device_properties(nv.device).multi_processor_count
        self._m_word = None  # the M last announced in the flag area (written when it changes)
        self._plans: dict = {}
        # persistent buffers as addresses, made once (a slice is a torch call per launch otherwise)
        lv, tk = self.levels, self.tickets
        self.p_table, self.p_err = Ptr(nv.ptr_table), Ptr(nv.err)
        self.p_dlevel = [Ptr(lv[_DLEVEL + p:]) for p in (0, 1)]
        self.p_wlevel = [Ptr(lv[_WLEVEL + p:]) for p in (0, 1)]
        self.p_clevel = [Ptr(lv[_CLEVEL + p:]) for p in (0, 1)]
        self.p_levels = Ptr(lv)
        self.p_t = {i: Ptr(tk[i:]) for i in (_T_DSEND, _T_DRECV, _T_CSEND, _T_CSEND + 1, _T_CRECV, _T_ROLE,
                                              _T_CROLE)}
        self.k_send = Launcher(ll._ll_dispatch_send_kernel)
        self.k_recv = Launcher(ll._ll_dispatch_recv_kernel)
        self.k_dfused = Launcher(ll._ll_dispatch_fused_kernel)
        self.k_weights = Launcher(ll._ll_combine_weights_kernel)
        self.k_reduce = Launcher(ll._ll_combine_reduce_kernel)
        self.k_crecv = Launcher(ll._ll_combine_recv_kernel)
        self.k_cfused = Launcher(ll._ll_combine_fused_kernel)

    def _plan(self, m: int, h: int, e: int) -> _Plan:
        p = self._plans.get((m, h, e))
        if p is None:
            lay = layout.low_latency_buffer_layout(m, h, self.nv.num_ranks, e)
            if lay.total > self.nv.rdma_bytes:
                raise ValueError(f"num_rdma_bytes={self.nv.rdma_bytes} is too small: M={m}, H={h}, E={e} need "
                                 f"{lay.total} (Buffer.get_low_latency_rdma_size_hint)")
            p = self._plans[(m, h, e)] = _Plan(self.nv, m, h, e, lay)
        return p

    def dispatch(self, a: LowLatencyDispatchArgs):
        nv = self.nv
        r_, me, dev = nv.num_ranks, nv.rank, nv.device
        m, e = a.num_max_dispatch_tokens_per_rank, a.num_experts
        x = a.x.contiguous()
        t, h = x.shape
        pl = self._plan(m, h, e)
        lay, lx, g, parity = pl.lay, pl.lx, pl.g, a.parity
        area, sig = pl.area[parity], pl.sig[parity]
        topk = a.topk_idx.contiguous()
        k = topk.shape[1]
        shrink = a.mask is not None
        mask = a.mask if shrink else self.p_err
        # announce M in a fixed place so a rank with another M is named, not just timed out
        if self._m_word != m:
            nv.symm[nv.flags_off + 5 * r_ * 4:nv.flags_off + 6 * r_ * 4].view(torch.int32)[me].fill_(m)
            self._m_word = m
        gc = TUNE["send_gc"]
        fused = TUNE["fused_dispatch"] and not a.hook
        # what the kernels' specialisation depends on besides the constexprs (kernels/launch.py)
        key = (m, h, e, k, parity, x.data_ptr() & 15 == 0, topk.data_ptr() & 15 == 0, shrink)
        if not fused:
            self.k_send(
                key, (max(t, 1), (g + gc - 1) // gc),
                x, topk, t, h, g, k, me, r_, lx, e, m, self.p_table, area, lay.dispatch_src_bytes,
                lay.dispatch_msg_bytes, sig, self.p_t[_T_DSEND], self.p_err, mask,
                USE_FP8=a.use_fp8, ROUND_SCALE=a.round_scale, GC=gc, K_POW2=_pow2(k), R_POW2=_pow2(r_),
                SHRINK=shrink, num_warps=TUNE["send_warps"],
            )
        rm = r_ * m
        # the receive kernels write the rows as int32 words: allocated as words, viewed as the payload
        if a.use_fp8:
            words = torch.empty(lx, rm, h // 4, dtype=torch.int32, device=dev)
            if a.use_ue8m0:
                sc_alloc = torch.empty(lx, (g + 3) // 4, rm, dtype=torch.int32, device=dev)
            else:
                sc_alloc = torch.empty(lx, g, rm, dtype=torch.float32, device=dev)
            recv_x = (words.view(torch.float8_e4m3fn), sc_alloc.transpose(1, 2))
        else:
            words = torch.empty(lx, rm, h // 2, dtype=torch.int32, device=dev)
            recv_x = words.view(torch.bfloat16)
            sc_alloc = None
        recv_src = torch.empty(lx, rm, dtype=torch.int32, device=dev)
        recv_range = torch.empty(lx, r_, dtype=torch.int64, device=dev)
        recv_count = torch.empty(lx, dtype=torch.int32, device=dev)
        handle = LowLatencyHandle(recv_src, recv_range, m, h, e)
        recv_src._epcomm_ll_parity = parity
        cum = a.cumulative_local_expert_recv_stats
        wst = a.dispatch_wait_recv_cost_stats
        recv_args = (words, sc_alloc if sc_alloc is not None else recv_count, recv_src, recv_range, recv_count,
                     cum if cum is not None else recv_count, wst if wst is not None else recv_range,
                     self.p_dlevel[parity])
        consts = dict(SHRINK=shrink, USE_FP8=a.use_fp8, UE8M0=a.use_ue8m0, HAS_CUM=cum is not None,
                      HAS_WAIT=wst is not None, TB=TUNE["recv_tb"], QB=TUNE["recv_qb"], BLOCK=TUNE["recv_block"],
                      G_POW2=max(_pow2(g), 4), HAS_TIMER=TIMER, K_POW2=_pow2(k), LOCAL_TICKET=TUNE["local_ticket"])

        if fused:
            n_gb, split = (g + gc - 1) // gc, TUNE["recv_split"]
            n_send = max(t, 1) * n_gb
            consts.pop("SHRINK")
            self.k_dfused(
                key, (n_send + lx * r_ * split,),
                x, topk, t, h, g, k, me, r_, lx, e, m, self.p_table, area, lay.dispatch_src_bytes,
                lay.dispatch_msg_bytes, sig, self.p_t[_T_DSEND], self.p_err, mask, area + lay.slot_offset,
                *recv_args, self.p_t[_T_DRECV], self.p_t[_T_ROLE], nv._timeout_ns, n_gb, n_send, split,
                ROUND_SCALE=a.round_scale, GC=gc, R_POW2=_pow2(r_), SHRINK=shrink, **consts,
                num_warps=TUNE["send_warps"],
            )
            return LowLatencyDispatchResult(recv_x, recv_count, handle), _nothing

        rkey = (m, h, e, k, parity, shrink)

        def receive() -> None:
            self.k_recv(
                rkey, (lx, r_, TUNE["recv_split"]),
                self.p_table, area, lay.dispatch_src_bytes, lay.dispatch_msg_bytes, sig, area + lay.slot_offset,
                me, r_, lx, m, h, g, k, *recv_args, self.p_t[_T_DRECV], self.p_err, nv._timeout_ns, mask,
                **consts, num_warps=TUNE["recv_warps"],
            )

        return LowLatencyDispatchResult(recv_x, recv_count, handle), receive

    def combine(self, a: LowLatencyCombineArgs):
        nv = self.nv
        r_, me, dev = nv.num_ranks, nv.rank, nv.device
        hd = a.handle
        m, h, e = hd.num_max_dispatch_tokens_per_rank, hd.hidden, hd.num_experts
        pl = self._plan(m, h, e)
        lay, lx, parity = pl.lay, pl.lx, a.parity
        d_parity = getattr(hd.recv_src_info, "_epcomm_ll_parity", None)
        if d_parity is None:
            raise ValueError("handle must come from this Buffer's low_latency_dispatch (nvlink backend)")
        d_area = pl.area[d_parity]
        area, sig = pl.area[parity], pl.sig[parity]
        y = a.x.contiguous()
        topk = a.topk_idx.contiguous()
        w = a.topk_weights.contiguous()
        t, k = topk.shape
        out = a.out if a.out is not None else torch.empty(t, h, dtype=torch.bfloat16, device=dev)
        shrink = a.mask is not None
        mask = a.mask if shrink else self.p_err
        blk = TUNE["csend_block"]
        splits = max(1, min((h + blk - 1) // blk, TUNE["csend_programs"] // (r_ * m)))
        cw = ((h + splits - 1) // splits + blk - 1) // blk * blk
        wst = a.combine_wait_recv_cost_stats
        wait = wst if wst is not None else self.p_levels
        cb = TUNE["crecv_block"]
        key = (m, h, e, k, parity, d_parity, y.data_ptr() & 15 == 0, topk.data_ptr() & 15 == 0,
               w.data_ptr() & 15 == 0, out.data_ptr() & 15 == 0, shrink)
        if TUNE["fused_combine"]:
            n_w, n_cs = max(t, 1), (h + cw - 1) // cw
            n_cb = (h + cb - 1) // cb
            recv_too = not a.hook
            self.k_cfused(
                key, (n_w + r_ * m * n_cs + (max(1, t) * n_cb if recv_too else 0),),
                topk, w, t, k, me, r_, m, self.p_table, area + lay.weights_offset, sig, self.p_t[_T_CSEND],
                mask, y, h, lx, d_area, lay.dispatch_src_bytes, d_area + lay.slot_offset, area + lay.combine_offset,
                cw, self.p_wlevel[parity], self.p_t[_T_CSEND + 1], self.p_err, nv._timeout_ns, out,
                wait, self.p_clevel[parity], self.p_t[_T_CRECV], self.p_t[_T_CROLE], n_w, n_cs, r_ * m * n_cs, n_cb,
                K_POW2=_pow2(k), R_POW2=_pow2(r_), BLOCK=cb, RBLOCK=blk, HAS_WAIT=wst is not None, HAS_TIMER=TIMER,
                SHRINK=shrink, DO_RECV=recv_too, LOCAL_TICKET=TUNE["local_ticket"],
                num_warps=TUNE["csend_warps"],
            )
            if recv_too:
                return out, _nothing
        else:
            self.k_weights(
                key, (max(t, 1),),
                topk, w, t, k, me, r_, m, self.p_table, area + lay.weights_offset, sig, self.p_t[_T_CSEND],
                mask, SHRINK=shrink, num_warps=1,
            )
            self.k_reduce(
                key, (r_ * m, (h + cw - 1) // cw),
                y, h, k, me, r_, lx, m, self.p_table, d_area, lay.dispatch_src_bytes,
                area + lay.weights_offset, d_area + lay.slot_offset, area + lay.combine_offset, sig, cw,
                self.p_wlevel[parity], self.p_t[_T_CSEND + 1], self.p_err, nv._timeout_ns, mask,
                K_POW2=_pow2(k), BLOCK=blk, HAS_TIMER=TIMER, SHRINK=shrink,
                num_warps=TUNE["csend_warps"],
            )

        def receive() -> None:
            self.k_crecv(
                key, (max(1, t), (h + cb - 1) // cb),
                topk, t, h, k, me, r_, lx, m, self.p_table, area + lay.combine_offset, sig, out,
                wait, self.p_clevel[parity], self.p_t[_T_CRECV], self.p_err, nv._timeout_ns, mask,
                K_POW2=_pow2(k), R_POW2=_pow2(r_), BLOCK=cb, HAS_WAIT=wst is not None,
                HAS_TIMER=TIMER, SHRINK=shrink, LOCAL_TICKET=TUNE["local_ticket"],
                num_warps=TUNE["crecv_warps"],
            )

        return out, receive

    def zero_copy_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        nv = self.nv
        m, h, e = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        lay = self._plan(m, h, e).lay
        lx = e // nv.num_ranks
        start = nv.ll_off + lay.zero_copy_offset
        n = lx * nv.num_ranks * m * h * 2
        return nv.symm[start:start + n].view(torch.bfloat16).view(lx, nv.num_ranks * m, h)

    def clean(self) -> None:
        """Zero the LL region and the levels; every rank calls it together (then a barrier)."""
        nv = self.nv
        torch.cuda.synchronize(nv.device)
        torch.distributed.barrier(group=nv.group)
        nv.symm[nv.ll_off:nv.ll_off + nv.rdma_bytes].zero_()
        self.levels.zero_()
        self.tickets.zero_()
        torch.cuda.synchronize(nv.device)
        torch.distributed.barrier(group=nv.group)
