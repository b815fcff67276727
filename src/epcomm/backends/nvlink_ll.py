"""Low-latency mode of the nvlink backend: launches of kernels/ll.py over the LL region of the
symmetric buffer (``layout.LowLatencyBufferLayout``).

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``,
``M`` max tokens per rank.

Dispatch: send roles (program per (token, group of 128-channel blocks): FP8 cast, row to every rank
holding one of the token's experts, ids to every rank) and receive roles (program per (local expert,
source rank): its block of rows in token order after the blocks of lower ranks). Combine: weights roles
(each owner pushes its (expert id, weight) pairs to every rank), reduce roles (program per (source
token, channel split): ``Σ_k w·y`` in float32 over the experts held here, so each token crosses the link
once per rank) and receive roles (program per (token, channel block): the partial sums of the ranks
holding its experts, in rank order). Each operation is one kernel whose programs take those roles in
order (``_ll_dispatch_kernel``, ``_ll_combine_kernel``): without the hook one launch does the whole
operation; with ``return_recv_hook`` the call launches the same kernel with only the send roles and
returns, and ``hook()`` launches it again with only the receive roles, so no kernel stays resident in
between. A profile therefore shows one kernel name per operation, whose time covers all of it (DeepEP's
own LL test finds its kernels by the substrings ``dispatch`` and ``combine``). ``TUNE["fused_dispatch"]``
off launches the dispatch's roles as two kernels instead (``_ll_dispatch_send_kernel``,
``_ll_dispatch_recv_kernel``: less GPU time; see the TUNE table).
Every grid is sized by the shape, not by ``num_sms``; waits are per program, on the flags of the
ranks that program needs.

Parity: ``Buffer`` alternates the parity call by call; a CUDA graph replays the parities it
captured, and a captured dispatch + combine pair uses both areas, so replays stay safe. At most two
low-latency calls may be in flight (a third reuses the first one's area). The areas and flags
are laid out for one (M, H, E); ``Buffer`` asks for ``clean_low_latency_buffer`` before another.
"""

from __future__ import annotations

import torch

from ..kernels.launch import Direct, Ptr
from ..layout import LowLatencyHandle
from .base import LowLatencyCombineArgs, LowLatencyDispatchArgs
from .ll_calls import LowLatencyCalls, Plan, _Call, get_plan, launch_cell
from .nvlink_params import TIMER, _pow2

# local counters (int32 device memory): dispatch-receive level [2], combine weight level [2],
# combine-receive level [2]
_DLEVEL, _WLEVEL, _CLEVEL = 0, 2, 4
# ticket slots in the backend's ticket tensor
_T_DSEND, _T_DRECV, _T_CSEND, _T_CRECV = 4, 5, 6, 8  # _T_CSEND uses two consecutive slots
_T_ROLE, _T_CROLE = 9, 10  # the fused dispatch's and the fused combine's role tickets

# Launch parameters (measure a variant with EPCOMM_TUNE=ll.<key>=<value> epcomm bench).
TUNE = dict(send_warps=4, send_gc=8, recv_warps=4, recv_tb=128, recv_qb=4, recv_block=2048, recv_split=1,
            csend_warps=4, csend_block=1024, csend_programs=2048, crecv_warps=4, crecv_block=1024,
            fused_dispatch=True, both_qb=4, both_block=2048, both_sends=256, both_gc=0, both_warps=0)
# fused_dispatch: the dispatch one kernel, its programs taking the roles (see the module docstring; send_warps
# for every role); 0: separate send and receive kernels, which DeepEP's LL timing cannot attribute to one
# operation, but which take less GPU time (one H100, world 1, FP8, a graph of 8 dispatches: 128 tokens 19.0 us
# one kernel against 17.5 separate, 64 tokens 16.2 against 14.7, 1 token 11.2 against 10.3; 90d1d05). The
# combine is always one kernel (csend_warps for every role: a graph replay at world 1 on one H200, 128 tokens
# 26.4 us against 28.3 for three kernels, 1 token 12.9 against 15.4; e7a61af). both_qb / both_block: recv_qb /
# recv_block of a dispatch that sends and receives in one launch (the receive tile sets the registers of every
# program there); both_sends / both_gc / both_warps: its send programs (one_launch_sends; 0: chosen there)


def one_launch_sends(t: int, g: int) -> tuple[int, int]:
    """``(GC, warps)`` of the one-launch dispatch (no hook) of ``t`` tokens of ``g`` 128-channel groups.

    Its send roles share the kernel's registers with the receive roles (137 a thread on sm_90, a send-only
    program needs 25), so few programs are resident (3 an SM at 4 warps) and every program also takes the
    role ticket (one atomic on one word) and the send ticket (a system-scope acq_rel atomic on one word):
    with ``send_gc`` = 8 at 128 tokens that is 896 send programs in ~2.3 waves and 1152 serial role
    atomics, ~7 us more than the separate send and receive kernels on an H100. So each send program takes
    ``GC`` groups, doubled from ``send_gc`` (at most ``g`` rounded up to a power of two) until the send
    programs number at most ``TUNE["both_sends"]``; ``warps``: 8 where ``GC >= 16`` (a 16-32-group FP8 cast
    over 4 warps is too long a chain), else ``send_warps``. ``TUNE["both_gc"]`` / ``["both_warps"]`` set
    either (0: by this rule). Example: DSv3 (``g = 56``): 128 tokens (32, 8): 256 send programs; 64
    tokens (16, 8); 16 tokens and fewer (8, 4), as the separate send kernel."""
    gc, cap, top = TUNE["send_gc"], TUNE["both_sends"], _pow2(g)
    while cap > 0 and gc < top and max(t, 1) * ((g + gc - 1) // gc) > cap:
        gc *= 2
    gc = TUNE["both_gc"] or gc
    return gc, TUNE["both_warps"] or (8 if gc >= 16 else TUNE["send_warps"])


def _nothing() -> None:
    """The hook of a call that already received (one fused launch)."""


class LowLatencyEngine(LowLatencyCalls):
    backend_name = "nvlink"

    def __init__(self, nv):
        from ..kernels import ll
        from ..kernels.launch import Launcher

        self.nv = nv
        self.levels = torch.zeros(8, dtype=torch.int32, device=nv.device)
        self.tickets = torch.zeros(16, dtype=torch.int32, device=nv.device)
        self.sms = torch.cuda.get_device_properties(nv.device).multi_processor_count
        self._init_calls(nv.num_ranks, nv.device)  # ll_calls: the kinds of call, the outputs, M announced
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
        self.k_dfused = Launcher(ll._ll_dispatch_kernel)
        self.k_cfused = Launcher(ll._ll_combine_kernel)

    def _cell(self):
        """``launch_cell`` for this kind's launches: through a native chain where the native path is wanted
        (``native.wanted``, decided when a kind is made): a repeat's launch is one ``native.Chain`` call (its
        holes read in C++, the rest packed once) instead of Triton's launcher parsing every argument."""
        from .. import native

        dev = self.nv.device
        chain = dev if native.wanted(dev) else None
        return lambda d, gx, gy, gz: launch_cell(d, gx, gy, gz, chain)

    def _plan(self, m: int, h: int, e: int) -> Plan:
        return get_plan(self._plans, self.nv, m, h, e)  # signal words inside each parity's area

    # ------------------------------------------------------------------ dispatch

    def _dispatch_call(self, a: LowLatencyDispatchArgs, t: int, h: int, k: int, key: tuple) -> _Call:
        """Everything a dispatch of this kind needs but its per-call tensors: ``c.run(x, topk, cum, wst)``
        launches it (``x``, ``topk`` contiguous, of the shapes and alignment of the key)."""
        nv, cell = self.nv, self._cell()
        r_, me, m, e = nv.num_ranks, nv.rank, a.num_max_dispatch_tokens_per_rank, a.num_experts
        pl = self._plan(m, h, e)
        lay, lx, g, parity = pl.lay, pl.lx, pl.g, a.parity
        area, sig = pl.area[parity], pl.sig[parity]
        shrink = a.mask is not None
        mask = Ptr(a.mask) if shrink else self.p_err
        gc = TUNE["send_gc"]
        c = _Call()
        result, words, sc, recv_src, recv_range, recv_count = self._dispatch_outputs(pl, parity, a.use_fp8,
                                                                                   a.use_ue8m0)
        n_gb = (g + gc - 1) // gc
        c.m = m
        fused = TUNE["fused_dispatch"]
        has_cum = a.cumulative_local_expert_recv_stats is not None
        has_wst = a.dispatch_wait_recv_cost_stats is not None
        send_args = (h, g, k, me, r_, lx, e, m, self.p_table, area, lay.dispatch_src_bytes,
                     lay.dispatch_msg_bytes, sig, self.p_t[_T_DSEND], self.p_err, mask)
        # (out rows, scales, src info, layout range, count); the stats are holes (placeholders when absent)
        recv_out = (Ptr(words), Ptr(sc) if sc is not None else Ptr(recv_count), Ptr(recv_src),
                    Ptr(recv_range), Ptr(recv_count))
        cum_d, wst_d = Ptr(recv_count), Ptr(recv_range)  # in the statistics' places where a kind has none
        consts = dict(SHRINK=shrink, USE_FP8=a.use_fp8, UE8M0=a.use_ue8m0, HAS_CUM=has_cum, HAS_WAIT=has_wst,
                      TB=TUNE["recv_tb"], QB=TUNE["recv_qb"], BLOCK=TUNE["recv_block"],
                      G_POW2=max(_pow2(g), 4), HAS_TIMER=TIMER, K_POW2=_pow2(k))
        n_send = max(t, 1) * n_gb
        if fused:
            split = TUNE["recv_split"]
            fused_consts = dict(ROUND_SCALE=a.round_scale, GC=gc, R_POW2=_pow2(r_), SHRINK=shrink,
                                **{k_: v for k_, v in consts.items() if k_ != "SHRINK"},
                                num_warps=TUNE["send_warps"])
            tmpl = (None, None, t, *send_args, area + lay.slot_offset, *recv_out, None, None,
                    self.p_dlevel[parity], self.p_t[_T_DRECV], self.p_t[_T_ROLE], nv._timeout_ns, n_gb, n_send,
                    split)
            i_stats = 3 + len(send_args) + 1 + len(recv_out)  # x, topk, t, send_args, slot, outputs
            holes = (0, 1, i_stats, i_stats + 1)
            n_recv = lx * r_ * split
            i_nsend = len(tmpl) - 2
            if not a.hook:  # both roles in one kernel: its receive tile sets the send programs' registers too
                bgc, bwarps = one_launch_sends(t, g)
                b_gb = (g + bgc - 1) // bgc
                b_send = max(t, 1) * b_gb
                b_tmpl = (*tmpl[:i_nsend - 1], b_gb, b_send, split)
                go = cell(Direct(self.k_dfused.prepared(key, dict(fused_consts, ROLES=3, QB=TUNE["both_qb"],
                                                                         BLOCK=TUNE["both_block"], GC=bgc,
                                                                         num_warps=bwarps)),
                                        b_tmpl, holes), b_send + n_recv, 1, 1)

                def run(x, topk, cum, wst):
                    go[0](x, topk, cum_d if cum is None else cum, wst_d if wst is None else wst)
                    return result, _nothing

                c.run = run
                return c
            # the hook: the same kernel twice, every program a sender, then (hook()) every one a receiver,
            # each compiled for its roles only (one name in a profile)
            go = cell(Direct(self.k_dfused.prepared(key, dict(fused_consts, ROLES=1)), tmpl, holes), n_send,
                             1, 1)
            go_recv = cell(Direct(self.k_dfused.prepared(key, dict(fused_consts, ROLES=2)),
                                         (*tmpl[:i_nsend], 0, split), holes), n_recv, 1, 1)

            def run(x, topk, cum, wst):
                go[0](x, topk, cum_d, wst_d)
                cum = cum_d if cum is None else cum
                wst = wst_d if wst is None else wst
                return result, lambda: go_recv[0](x, topk, cum, wst)

            c.run = run
            return c
        send = cell(Direct(self.k_send.prepared(key, dict(USE_FP8=a.use_fp8, ROUND_SCALE=a.round_scale, GC=gc,
                                                                 K_POW2=_pow2(k), R_POW2=_pow2(r_), SHRINK=shrink,
                                                                 num_warps=TUNE["send_warps"])),
                                  (None, None, t, *send_args), (0, 1)), max(t, 1), n_gb, 1)
        head = (self.p_table, area, lay.dispatch_src_bytes, lay.dispatch_msg_bytes, sig, area + lay.slot_offset,
                me, r_, lx, m, h, g, k, *recv_out)
        recv = cell(Direct(self.k_recv.prepared(key, dict(consts, num_warps=TUNE["recv_warps"])),
                                  (*head, None, None, self.p_dlevel[parity], self.p_t[_T_DRECV], self.p_err,
                                   nv._timeout_ns, mask), (len(head), len(head) + 1)), lx, r_, TUNE["recv_split"])

        def receive_plain() -> None:
            recv[0](cum_d, wst_d)

        def run(x, topk, cum, wst):
            send[0](x, topk)
            if cum is None and wst is None:
                return result, receive_plain
            cum = cum_d if cum is None else cum
            wst = wst_d if wst is None else wst
            return result, lambda: recv[0](cum, wst)

        c.run = run
        return c

    def _announce(self, m: int) -> None:
        """Write M in a fixed place of the flag area: a rank with another M is named, not just timed out."""
        nv = self.nv
        r_ = nv.num_ranks
        nv.symm[nv.flags_off + 5 * r_ * 4:nv.flags_off + 6 * r_ * 4].view(torch.int32)[nv.rank].fill_(m)
        self._m_word = m

    # ------------------------------------------------------------------ combine

    def _combine_call(self, a: LowLatencyCombineArgs, m: int, h: int, e: int, t: int, k: int, d_parity: int,
                      key: tuple) -> _Call:
        """Everything a combine of this kind needs but its per-call tensors: ``c.run(y, topk, w, out,
        wst)`` launches it (``out`` None: the persistent output of this parity)."""
        nv, cell = self.nv, self._cell()
        r_, me = nv.num_ranks, nv.rank
        pl = self._plan(m, h, e)
        lay, lx, parity = pl.lay, pl.lx, a.parity
        d_area = pl.area[d_parity]
        area, sig = pl.area[parity], pl.sig[parity]
        shrink = a.mask is not None
        mask = Ptr(a.mask) if shrink else self.p_err
        blk = TUNE["csend_block"]
        splits = max(1, min((h + blk - 1) // blk, TUNE["csend_programs"] // (r_ * m)))
        cw = ((h + splits - 1) // splits + blk - 1) // blk * blk
        has_wait = a.combine_wait_recv_cost_stats is not None
        cb = TUNE["crecv_block"]
        c = _Call()
        own = self._combine_output(m, h, parity, t) if a.out is None else None
        # in the places of out and the wait statistics where a kind has none: this parity's output, the levels
        p_own, p_wait = Ptr(own) if own is not None else None, self.p_levels
        n_cs, n_cb = (h + cw - 1) // cw, (h + cb - 1) // cb
        n_w = max(t, 1)
        # the per-call tensors are holes: topk, weights, y, then out and the wait statistics
        w_head = (None, None, t, k, me, r_, m, self.p_table, area + lay.weights_offset, sig, self.p_t[_T_CSEND],
                  mask)
        r_tail = (h, lx, d_area, lay.dispatch_src_bytes, d_area + lay.slot_offset, area + lay.combine_offset, cw,
                  self.p_wlevel[parity], self.p_t[_T_CSEND + 1], self.p_err, nv._timeout_ns)
        recv_too = not a.hook
        n_red = r_ * m * n_cs
        grid = n_w + n_red + (n_w * n_cb if recv_too else 0)
        tmpl = (*w_head, None, *r_tail, None, None, self.p_clevel[parity], self.p_t[_T_CRECV],
                self.p_t[_T_CROLE], n_w, n_cs, n_red, n_cb)
        iy = len(w_head)
        io = iy + 1 + len(r_tail)
        holes = (0, 1, iy, io, io + 1)
        cconsts = dict(K_POW2=_pow2(k), R_POW2=_pow2(r_), BLOCK=cb, RBLOCK=blk, HAS_WAIT=has_wait,
                       HAS_TIMER=TIMER, SHRINK=shrink, DO_RECV=recv_too, num_warps=TUNE["csend_warps"])
        fused = cell(Direct(self.k_cfused.prepared(key, cconsts), tmpl, holes), grid, 1, 1)
        if recv_too:  # one launch does the whole combine

            def run(y, topk, w, out, wst):
                fused[0](topk, w, y, p_own if out is None else out, p_wait if wst is None else wst)
                return own if out is None else out, _nothing

            c.run = run
            return c
        # hook(): the same kernel, every program a receiver (no weights or reduce roles)
        fused_recv = cell(Direct(self.k_cfused.prepared(key, dict(cconsts, DO_RECV=True, RECV_ONLY=True)),
                                 (*tmpl[:-4], 0, n_cs, 0, n_cb), holes), n_w * n_cb, 1, 1)

        def run(y, topk, w, out, wst):
            o = p_own if out is None else out
            s = p_wait if wst is None else wst
            fused[0](topk, w, y, o, s)
            return own if out is None else out, lambda: fused_recv[0](topk, w, y, o, s)

        c.run = run
        return c

    def zero_copy_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        nv = self.nv
        pl = self._plan(handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        if pl.zero_copy is None:  # a view made once per shape
            start = nv.ll_off + pl.lay.zero_copy_offset
            n = pl.lx * nv.num_ranks * pl.m * pl.h * 2
            flat = nv.symm[start:start + n].view(torch.bfloat16)
            pl.zero_copy = flat.view(pl.lx, nv.num_ranks * pl.m, pl.h)
        return pl.zero_copy

    def clean(self) -> None:
        """Zero the LL region and the levels; every rank calls it together (then a barrier)."""
        nv = self.nv
        nv.barrier("clean_low_latency_buffer/before")  # (bounded by the deadline, as every host wait)
        nv.symm[nv.ll_off:nv.ll_off + nv.rdma_bytes].zero_()
        self.levels.zero_()
        self.tickets.zero_()
        nv.barrier("clean_low_latency_buffer/after")
