"""Low-latency mode of the internode backend: per-expert messages straight to the destination rank,
across nodes through NVSHMEM puts, inside a node through plain stores (``allow_nvlink_for_low_latency_mode``).

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``,
``M`` max tokens per rank, ``N`` ranks per node.

The kernels: the send side is ``kernels/internode_ll.py`` (dispatch send, combine weights, combine
reduce: stores to direct ranks, NVSHMEM puts of staged bytes to the others), the receive side is
``kernels/ll.py``'s, unchanged but for ``SIG_STRIDE=8`` (NVSHMEM's uint64 signal words); the receive
kernels read local memory only. Buffer regions (``backends/internode.py``): the LL region laid out by
``layout.low_latency_buffer_layout`` (as nvlink; its int32 signal area is unused), then per parity
``3R`` uint64 signal words, the M table, the combine staging.

A call: dispatch = send kernel, then (at once, or in ``hook()``) receive kernel; combine = weights
kernel, reduce kernel, then the receive kernel. As in nvlink, each kind of call (shapes, dtypes, flags,
parity, alignment) is planned once (``_dispatch_call``, ``_combine_call``): its launches are
``kernels/launch.Direct`` with every fixed argument in place; the kinds, the persistent outputs and
the repeat path's ``dispatch_run`` / ``combine_run`` are ``ll_calls.LowLatencyCalls``', shared with nvlink.
"""

from __future__ import annotations

import torch

from ..kernels.launch import Direct, Launcher, Ptr
from ..layout import LowLatencyHandle
from .base import LowLatencyCombineArgs, LowLatencyDispatchArgs
from .ll_calls import LowLatencyCalls, Plan, _Call, get_plan

# local counters (int32): dispatch-receive level [2], combine weight level [2], combine-receive level [2]
_DLEVEL, _WLEVEL, _CLEVEL = 0, 2, 4
# ticket slots
_T_DSEND, _T_DRECV, _T_WEIGHTS, _T_REDUCE, _T_CRECV = 0, 1, 2, 3, 4

# Launch parameters (the nvlink LL engine's defaults; not measured over NVSHMEM yet).
TUNE = dict(send_warps=4, send_gc=8, recv_warps=4, recv_tb=128, recv_qb=4, recv_block=2048, csend_warps=4,
            csend_block=1024, csend_programs=2048, crecv_warps=4, crecv_block=1024)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class InternodeLowLatency(LowLatencyCalls):
    """The low-latency engine over an ``InternodeBackend`` ``be`` (its symmetric buffer, pointer table,
    error word, node size and switches)."""

    backend_name = "internode"

    def __init__(self, be) -> None:
        from ..kernels import internode_ll as il
        from ..kernels import ll, nvshmem

        self.be = be
        dev = be.device
        self.levels = torch.zeros(8, dtype=torch.int32, device=dev)
        self.tickets = torch.zeros(8, dtype=torch.int32, device=dev)
        lv, tk = self.levels, self.tickets
        self.p_table, self.p_err = Ptr(be.ptr_table), Ptr(be.err)
        self.p_dlevel = [Ptr(lv[_DLEVEL + p:]) for p in (0, 1)]
        self.p_wlevel = [Ptr(lv[_WLEVEL + p:]) for p in (0, 1)]
        self.p_clevel = [Ptr(lv[_CLEVEL + p:]) for p in (0, 1)]
        self.p_t = [Ptr(tk[i:]) for i in range(5)]
        sim = be.sim
        # the send side calls NVSHMEM: launched through requires_nvshmem on a GPU (nvshmem.nvshmem_kernel)
        self.k_send = Launcher(nvshmem.nvshmem_kernel(il._il_dispatch_send_kernel, sim))
        self.k_weights = Launcher(nvshmem.nvshmem_kernel(il._il_weights_kernel, sim))
        self.k_reduce = Launcher(nvshmem.nvshmem_kernel(il._il_reduce_kernel, sim))
        self.k_announce = Launcher(nvshmem.nvshmem_kernel(il._il_announce_kernel, sim))
        self.k_recv = Launcher(ll._ll_dispatch_recv_kernel)
        self.k_crecv = Launcher(ll._ll_combine_recv_kernel)
        self._plans: dict = {}
        self._init_calls(be.num_ranks, dev)  # ll_calls: the kinds of call, the outputs, M announced

    def _after_send(self) -> None:
        self.be.check_mirror()

    @property
    def _common(self) -> dict:
        be = self.be
        return dict(HAS_TIMER=not be.sim)

    def _plan(self, m: int, h: int, e: int) -> Plan:
        p = get_plan(self._plans, self.be, m, h, e, self.be.sig_off)  # signal words at the backend's sig_off
        assert self.be.num_ranks * m * h * 4 <= self.be.cstage_bytes, "combine staging smaller than one parity"
        return p

    def _announce(self, m: int) -> None:
        be = self.be
        self.k_announce(("announce",), (1,), self.p_table, be.rank, be.num_ranks, be.ranks_per_node, be.mtab_off,
                        m, NVL=be.nvl, SIM=be.sim)
        self._m_word = m

    # ------------------------------------------------------------------ dispatch

    def _dispatch_call(self, a: LowLatencyDispatchArgs, t: int, h: int, k: int, key: tuple) -> _Call:
        """Everything a dispatch of this kind needs but its per-call tensors: ``c.run(x, topk, cum, wst)``
        sends and returns ``(result, receive)``."""
        be = self.be
        r_, me, m, e = be.num_ranks, be.rank, a.num_max_dispatch_tokens_per_rank, a.num_experts
        pl = self._plan(m, h, e)
        lay, lx, g, parity = pl.lay, pl.lx, pl.g, a.parity
        area, sig = pl.area[parity], pl.sig[parity]
        shrink = a.mask is not None
        mask = Ptr(a.mask) if shrink else self.p_err
        result, words, sc, recv_src, recv_range, recv_count = self._dispatch_outputs(pl, parity, a.use_fp8,
                                                                                   a.use_ue8m0)
        gc = TUNE["send_gc"]
        n_gb = (g + gc - 1) // gc
        send = Direct(self.k_send.prepared(key, dict(
            USE_FP8=a.use_fp8, ROUND_SCALE=a.round_scale, GC=gc, R_POW2=_pow2(r_), SHRINK=shrink, NVL=be.nvl,
            SIM=be.sim, num_warps=TUNE["send_warps"])),
            (None, None, t, h, g, k, me, r_, lx, e, m, be.ranks_per_node, self.p_table, area,
             lay.dispatch_src_bytes, lay.dispatch_msg_bytes, sig, self.p_t[_T_DSEND], self.p_err, mask), (0, 1))
        has_cum = a.cumulative_local_expert_recv_stats is not None
        has_wst = a.dispatch_wait_recv_cost_stats is not None
        consts = dict(SHRINK=shrink, USE_FP8=a.use_fp8, UE8M0=a.use_ue8m0, HAS_CUM=has_cum, HAS_WAIT=has_wst,
                      TB=TUNE["recv_tb"], QB=TUNE["recv_qb"], BLOCK=TUNE["recv_block"], G_POW2=max(_pow2(g), 4),
                      K_POW2=_pow2(k), SIG_STRIDE=8, num_warps=TUNE["recv_warps"],
                      **self._common)
        head = (self.p_table, area, lay.dispatch_src_bytes, lay.dispatch_msg_bytes, sig, area + lay.slot_offset,
                me, r_, lx, m, h, g, k, Ptr(words), Ptr(recv_count if sc is None else sc), Ptr(recv_src),
                Ptr(recv_range), Ptr(recv_count))
        recv = Direct(self.k_recv.prepared(key, consts),
                      (*head, None, None, self.p_dlevel[parity], self.p_t[_T_DRECV], self.p_err, be.timeout_ns,
                       mask), (len(head), len(head) + 1))
        cum_dummy, wst_dummy = recv_count, recv_range
        sx, check = max(t, 1), be.check_mirror

        def receive_plain() -> None:
            recv(lx, r_, 1, cum_dummy, wst_dummy)
            check()

        def run(x, topk, cum, wst):
            send(sx, n_gb, 1, x, topk)
            if cum is None and wst is None:
                return result, receive_plain
            cum = cum_dummy if cum is None else cum
            wst = wst_dummy if wst is None else wst

            def receive() -> None:
                recv(lx, r_, 1, cum, wst)
                check()

            return result, receive

        c = _Call()
        c.m, c.run = m, run
        return c

    # ------------------------------------------------------------------ combine

    def _combine_call(self, a: LowLatencyCombineArgs, m: int, h: int, e: int, t: int, k: int, d_parity: int,
                      key: tuple) -> _Call:
        """Everything a combine of this kind needs but its per-call tensors: ``c.run(y, topk, w, out, wst)``
        sends (weights, then the partial sums) and returns ``(out, receive)``."""
        be = self.be
        r_, me = be.num_ranks, be.rank
        pl = self._plan(m, h, e)
        lay, lx, parity = pl.lay, pl.lx, a.parity
        d_area, area, sig = pl.area[d_parity], pl.area[parity], pl.sig[parity]
        shrink = a.mask is not None
        mask = Ptr(a.mask) if shrink else self.p_err
        blk = TUNE["csend_block"]
        splits = max(1, min((h + blk - 1) // blk, TUNE["csend_programs"] // (r_ * m)))
        cw = ((h + splits - 1) // splits + blk - 1) // blk * blk
        n_cs = (h + cw - 1) // cw
        cb = TUNE["crecv_block"]
        n_cb = (h + cb - 1) // cb
        own = self._combine_output(m, h, parity, t) if a.out is None else None
        n_w = max(t, 1)
        weights = Direct(self.k_weights.prepared(key, dict(SHRINK=shrink, NVL=be.nvl, SIM=be.sim, num_warps=1)),
                         (None, None, t, k, me, r_, m, be.ranks_per_node, self.p_table, area + lay.weights_offset,
                          sig, self.p_t[_T_WEIGHTS], mask), (0, 1))
        reduce = Direct(self.k_reduce.prepared(key, dict(
            K_POW2=_pow2(k), BLOCK=blk, SHRINK=shrink, NVL=be.nvl, SIM=be.sim, num_warps=TUNE["csend_warps"],
            **self._common)),
            (None, h, k, me, r_, lx, m, be.ranks_per_node, self.p_table, d_area, lay.dispatch_src_bytes,
             area + lay.weights_offset, d_area + lay.slot_offset, area + lay.combine_offset, be.cstage_off, sig, cw,
             self.p_wlevel[parity], self.p_t[_T_REDUCE], self.p_err, be.timeout_ns, mask), (0,))
        crecv = Direct(self.k_crecv.prepared(key, dict(
            K_POW2=_pow2(k), R_POW2=_pow2(r_), BLOCK=cb, HAS_WAIT=a.combine_wait_recv_cost_stats is not None,
            SHRINK=shrink, SIG_STRIDE=8, num_warps=TUNE["crecv_warps"], **self._common)),
            (None, t, h, k, me, r_, lx, m, self.p_table, area + lay.combine_offset, sig, None, None,
             self.p_clevel[parity], self.p_t[_T_CRECV], self.p_err, be.timeout_ns, mask), (0, 11, 12))
        wait_dummy, rx, check = self.levels, r_ * m, be.check_mirror

        def run(y, topk, w, out, wst):
            if out is None:
                out = own
            if wst is None:
                wst = wait_dummy
            weights(n_w, 1, 1, topk, w)
            reduce(rx, n_cs, 1, y)

            def receive() -> None:
                crecv(n_w, n_cb, 1, topk, out, wst)
                check()

            return out, receive

        c = _Call()
        c.run = run
        return c

    def zero_copy_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        be = self.be
        pl = self._plan(handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        if pl.zero_copy is None:
            start = be.ll_off + pl.lay.zero_copy_offset
            n = pl.lx * be.num_ranks * pl.m * pl.h * 2
            pl.zero_copy = be.symm[start:start + n].view(torch.bfloat16).view(pl.lx, be.num_ranks * pl.m, pl.h)
        return pl.zero_copy

    def clean(self) -> None:
        """Zero the LL region, the signal words and the levels; every rank calls it together."""
        be = self.be
        be.sync_and_barrier("clean_low_latency_buffer/before")
        be.symm[be.ll_off:be.mtab_off].zero_()
        self.levels.zero_()
        self.tickets.zero_()
        be.sync_and_barrier("clean_low_latency_buffer/after")
