"""High-throughput dispatch, orchestrated along its phases: the layout exchange and the handle (one kernel,
``_dispatch_notify_kernel``: counts and send lists through the peers' meta areas, then the handle's
tensors), the transfer (pushed by the receive kernel itself, or the transport's ``_bulk_dispatch``), the
one host synchronisation (the counts, which the exchange kernel wrote into pinned host words, and the
error word's host mirror: no copy; none with ``num_worst_tokens``), and the receive (``gather``:
``recv_x`` in (source rank, token) order from local x and the staging slots).

A dispatch of one kind (shapes, dtypes, flags, Config, the 16-byte alignment of the caller's tensors)
is planned once (``dispatch_run`` / ``cached_dispatch_run``): its launches bound (``kernels/launch.Direct``),
every fixed argument resolved. A repeat then costs its output allocations, two launches (one for a
cached dispatch) and, without ``num_worst_tokens``, the synchronisation: no view, no scratch tensor,
no copy. ``Buffer`` keeps the plans' ``run`` per kind, as it keeps the low-latency calls'. A dispatch's
plan is a ``ht_dispatch_plan.DispatchPlan``; the layout's and the cached dispatch's are made here.

``HTDispatch`` is a mixin of a backend that provides the symmetric-memory state (``ptr_table``,
``flags_off``, meta and list offsets, counters, tickets, the launchers ``k``, ``_ht_layout``,
``_local``, ``_notify_views``, ``_check_error``, the pinned host words ``notify_host`` and their address
``p_host_counts``) and a transport (``_bulk_dispatch``, ``_fused_push``, ``_use_ce``, ``_join_ce``:
backends/nvlink_transfer.py).

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``, ``C``
channels, ``N`` received rows, ``G = H/128``.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import native
from ..kernels.ht_layout import chunking, scratch_words
from ..kernels.launch import Launcher
from ..layout import DispatchHandle
from ..native import ROWS, Outputs
from .base import DispatchArgs, DispatchResult
from .ht_dispatch_plan import DispatchPlan, Launch, bools, words
from .nvlink_params import (
    DRECV,
    DSEND,
    NC,
    T_DPUSH,
    T_GATHER,
    TIMER,
    TUNE,
    _aligned,
    _contiguous,
    _pow2,
    layout_launch,
    torch_to_tl,
)

_MAX_PLANS = 4096  # the token count is part of a kind: bounded, whatever the callers vary
# the receive's launch, its views of the rows and of is_token_in_rank (one launch a plan, as the exchange's)
_Launch, _words, _bools = Launch, words, bools

# the tensors of DispatchArgs, in the order a dispatch plan's run takes them
_DISPATCH_TENSORS = ("x", "x_scales", "topk_idx", "topk_weights", "num_tokens_per_rank", "is_token_in_rank",
                     "num_tokens_per_expert")


class HTDispatch:
    # ------------------------------------------------------------------ plans

    def _gather_plan(self, key, h: int, row_dtype: torch.dtype, t: int, lay: dict, g: int, k: int, lx: int,
                     push: bool, has_s: bool, has_topk: bool, counts=None, toks=None) -> _Launch:
        """The receive (gather) kernel's launch for one kind of dispatch: ``go(grid, x, [scales], [topk, w],
        [rank_prefix_matrix: cached], n_rows, out_x, [out_scales], [out_topk, out_w: not cached],
        out_src, [is_token_in_rank: push])``, the bracketed ones where the kind has them. A cached dispatch
        has no ``counts`` (the notify output: its handle's rank_prefix_matrix instead) nor ``toks``."""
        d_slot = lay["d_slot"]
        row = h * row_dtype.itemsize // 4  # int32 words per row
        stage_x = self._local(lay["dx"], d_slot, torch.int32)
        stage_s = self._local(lay["ds"], d_slot, torch.float32)
        stage_k = self._local(lay["dk"], d_slot, torch.int64)
        stage_w = self._local(lay["dw"], d_slot, torch.float32)
        r_, me = self.num_ranks, self.rank
        has_k = has_topk and k > 0
        cached = counts is None
        p = self.k["_dispatch_impl_kernel"].prepared(key, dict(
            PUSH=push, PUSH_RB=TUNE["push_rb"], PUSH_BLOCK=TUNE["push_block"], ELEM=torch_to_tl(torch.int32),
            PUSH_TOPK=push and has_k, CACHED=cached, IS_PREFIX=cached, HAS_SCALES=has_s,
            HAS_TOPK=has_topk and not cached, NC=NC, RB=TUNE["gather_rb"], BLOCK=TUNE["gather_block"],
            R_POW2=_pow2(r_), K_POW2=_pow2(k), G_POW2=_pow2(g), HAS_TIMER=TIMER, STAGES=TUNE["gather_stages"],
            num_warps=TUNE["gather_warps"]))
        args = dict(
            x_ptr=None, xs_ptr=stage_s, topk_ptr=stage_k, w_ptr=stage_w, row_elems=row, G=g, K=k, counts_ptr=counts,
            counts_stride=r_, me=me, R=r_, lo_expert=0 if cached else me * lx, L=lx,
            tok_ptr=self.p_nctr if cached else toks, src_lists_ptr=self.p_src_lists,
            src_lists_stride=self.src_lists.stride(0), n_rows=None,
            stage_ptr=stage_x, stage_src_elems=d_slot // 4, stage_s_ptr=stage_s, stage_s_src=d_slot // 4,
            stage_k_ptr=stage_k, stage_k_src=d_slot // 8, stage_w_ptr=stage_w, stage_w_src=d_slot // 4,
            out_x=None, out_s=stage_s, out_s_stride_row=g, out_s_stride_col=1, out_k=stage_k, out_w=stage_w,
            out_src=None, ptr_table=self.p_table, flags_off=self.flags_off, ctr_ptr=self.p_ctr[DRECV],
            ticket_ptr=self.p_tk[T_GATHER], err_ptr=self.p_err, timeout_ns=self._timeout_ns,
            is_in_ptr=self.p_err, T_send=t, push_off=lay["dx"], push_slot_bytes=d_slot, push_s_off=lay["ds"],
            push_k_off=lay["dk"], push_w_off=lay["dw"], send_ctr_ptr=self.p_ctr[DSEND],
            push_ticket_ptr=self.p_tk[T_DPUSH])
        # the per-call ones (the bracketed ones of the docstring where the kind has them), each with its view
        holes = dict(x_ptr=_words, **(dict(xs_ptr=None) if has_s else {}),
                     **(dict(topk_ptr=None, w_ptr=None) if has_topk else {}),
                     **(dict(counts_ptr=None) if cached else {}), n_rows=None, out_x=_words,
                     **(dict(out_s=None) if has_s else {}),
                     **(dict(out_k=None, out_w=None) if has_topk and not cached else {}), out_src=None,
                     **(dict(is_in_ptr=_bools) if push else {}))
        return _Launch.named(p, args, holes)

    def _gather_grid(self, push: bool, n_rows: int) -> int:
        """With the push every program must be resident at once (at most one per SM: a num_sms above the
        GPU's SM count would leave programs waiting on programs that cannot start); the Triton
        interpreter (CPU runs) runs programs one after another, so there the fused kernel is one program."""
        if push:
            return max(1, min(self.num_sms, self.sm_count) if TIMER else 1)
        rb = TUNE["gather_rb"]
        return max(1, min(self.num_sms, (n_rows + rb - 1) // rb))

    def fuses_layout(self, capturing: bool = False) -> bool:
        """Whether an ``ElasticBuffer`` dispatch plan computes the layout in its exchange kernel
        (``dispatch_run(..., fused_layout=True)``; ``Buffer`` never asks): for calls not being captured into a
        CUDA graph. Eager calls pay the host, and the fused layout is a launch fewer there (V2 contiguous
        no-sync dispatch 0.905x and 0.920x the host time of the unfused, one process, one H100); a graph's
        replays pay the GPU, where it cost ~0.7 us (DSv3 at world 1, one H100: BF16 120.4 -> 121.1 us, FP8
        93.8 -> 94.4)."""
        return not capturing and self._can_fuse_layout()

    def _can_fuse_layout(self) -> bool:
        return self.transfer == "sm" and self.num_ranks <= 64  # (the layout's rank bits)

    def dispatch_run(self, a: DispatchArgs, scratch_rows: int = 0, fused_layout: bool = False):
        """``run(x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
        num_tokens_per_expert) -> DispatchResult``, made once for every dispatch like ``a`` (same shapes,
        dtypes, flags, Config, 16-byte alignment of x, its scales, ids, weights and is_token_in_rank;
        contiguous tensors), or None where a call's launches depend on more (the copy engine's, by
        capture state): ``Buffer`` keeps it for the repeats.

        ``scratch_rows`` (``ElasticBuffer``'s dispatches, at least the rows a call can receive): the
        result's ``recv_topk_idx`` and the handle's channel matrices are the backend's scratch, written
        again by the next such call (:meth:`_scratch`), not fresh tensors: for a caller that only reads them
        before its next call (the V2 steps read the ids once, and no V2 call reads the channel matrices).

        ``fused_layout`` (``ElasticBuffer``, where :meth:`fuses_layout`): the exchange kernel computes the
        layout from ``topk_idx`` (``kernels/ht_layout.layout_tiles``), so ``run``'s three layout arguments are
        not read (None will do); the handle's ``is_token_in_rank`` is a fresh tensor of each call, the
        counts the plan's scratch. ``a``'s layout tensors are then only those of the first call."""
        run = self._dispatch_plan(a, scratch_rows, fused_layout and self._can_fuse_layout())
        return run if self.transfer == "sm" else None

    def _dispatch_plan(self, a: DispatchArgs, scratch_rows: int = 0, fused: bool = False):
        x, s, topk, w, is_in = a.x, a.x_scales, a.topk_idx, a.topk_weights, a.is_token_in_rank
        t, h = x.shape
        push = self._fused_push()
        ce = self.num_ranks > 1 and self._use_ce()
        key = ("d", t, h, x.dtype, None if s is None else s.shape[1], None if topk is None else topk.shape[1],
               a.num_tokens_per_expert.numel(), a.num_channels, a.num_sms, a.num_worst_tokens, a.expert_alignment,
               push, ce, scratch_rows, fused, _aligned(x, s, topk, w, None if fused else is_in))
        run = self._plans.get(key)
        if run is None:
            if len(self._plans) > _MAX_PLANS:
                self._plans.clear()
            run = self._plans[key] = self._make_dispatch(key, a, push, ce, scratch_rows, fused)
        return run

    def _scratch(self, what: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The backend's scratch ``what`` of ``shape``: made once and kept for the backend's life (a CUDA
        graph captured with it replays into it), shared by every plan that asks for it. Calls of one backend
        run in stream order (``streams.py``), as its staging does, so a call writes it after the last read."""
        got = self._scratches.get((what, shape, dtype))
        if got is None:
            got = self._scratches[(what, shape, dtype)] = torch.empty(shape, dtype=dtype, device=self.device)
        return got

    def _make_dispatch(self, key, a: DispatchArgs, push: bool, ce: bool, scratch_rows: int = 0, fused: bool = False):
        """The ``run`` of a new plan (:class:`ht_dispatch_plan.DispatchPlan`) for dispatches like ``a``."""
        return DispatchPlan(self, key, a, push, ce, scratch_rows, fused).run

    def dispatch(self, a: DispatchArgs) -> DispatchResult:
        self._check_error()
        is_in = a.is_token_in_rank
        ts = [_contiguous(getattr(a, n)) for n in _DISPATCH_TENSORS]
        if any(t is not getattr(a, n) for t, n in zip(ts, _DISPATCH_TENSORS)):
            a = dataclasses.replace(a, **dict(zip(_DISPATCH_TENSORS, ts)))
        res = self._dispatch_plan(a)(*ts)
        if a.is_token_in_rank is not is_in:  # the handle holds the caller's tensor, as DeepEP's does
            res = res._replace(handle=res.handle._replace(is_token_in_rank=is_in))
        return res

    def dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, scratch_counts: bool = False):
        """``layout.dispatch_layout`` in one launch (``kernels/ht_layout.py``), bit for bit: ``topk_idx
        int64[T, K]`` -> ``(num_tokens_per_rank int32[R], num_tokens_per_expert int32[E], is_token_in_rank
        bool[T, R])``. ``scratch_counts``: the two counts are the plan's own, written again by its next call
        (no allocation; for a caller that reads them only before then, as ``ElasticBuffer``'s dispatch)."""
        topk = _contiguous(topk_idx)
        t, k = topk.shape
        run = self._plans.get(("l", k, num_experts))
        if run is None:
            run = self._plans[("l", k, num_experts)] = self._make_layout(k, num_experts)
        return run(topk, t, scratch_counts)

    def _make_layout(self, k: int, e: int):
        """The layout kernel's run for top-k ``k`` and ``e`` experts: ``run(topk, t, scratch_counts)``, one launch
        on ``chunks * ng`` programs (``kernels/ht_layout.py``) with a scratch of its own, zeroed once (its
        tickets reset themselves), which also holds the counts ``scratch_counts`` returns. Made while a graph is captured, that zeroing is a node of the graph, run
        at its replays only: such a plan serves one call and leaves the plans (the next makes another)."""
        r_, dev = self.num_ranks, self.device
        ng, nr, consts = layout_launch(k, e, r_)
        tbe, cp2 = consts["TBE"], consts["CP2"]
        words = scratch_words(ng, cp2, r_, e)
        at = (words + 3) // 4 * 4  # the scratch counts (scratch_counts), each from a 16-byte boundary
        scratch = torch.zeros(at + (r_ + 3) // 4 * 4 + e, dtype=torch.int32, device=dev)
        captured = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
        # a graph captured with this plan replays into its scratch for the graph's life, also after the plans
        # are cleared (_MAX_PLANS) or this one leaves them: freed, its block could be handed to other tensors
        self._pinned.append(scratch)
        part, tickets = scratch[:cp2 * (r_ + e)], scratch[cp2 * (r_ + e):words]
        own = scratch[at:at + r_], scratch[at + (r_ + 3) // 4 * 4:]
        p = self.k["_layout_kernel"].prepared((k, e), dict(consts, num_warps=4))
        go = _Launch.named(p, dict(topk_ptr=None, T=None, S=None, K=k, E=e, L=e // r_, R=r_, per_rank_ptr=None,
                                   per_expert_ptr=None, in_rank_ptr=None, part_ptr=part, ticket_ptr=tickets, NR=nr,
                                   NG=ng),
                           dict(topk_ptr=None, T=None, S=None, per_rank_ptr=None, per_expert_ptr=None,
                                in_rank_ptr=_bools))

        specs = [((r_,), torch.int32), ((e,), torch.int32), ((ROWS, r_), torch.bool)]
        outs = Outputs(dev, specs, True) if native.wanted(dev) else None

        def make_chain():
            # the call's values: topk, T, the chunk size, the grid
            o = native.out
            one = native.const(1)
            st = go.step((native.num(3), one, one), (native.addr(0), native.num(1), native.num(2), o(0), o(1), o(2)))
            return None if st is None else native.Chain(dev, specs, native.num(1), [st], 4, stream=go.go.p.chain_stream(),
                                                        packed=range(3))

        # the outputs and the launch as one native.Chain call (after the first call bound the launch)
        chain = native.Later(outs is not None and outs.native and not captured, make_chain)

        def run(topk, t, scratch_counts=False):
            nch, s = chunking(t, tbe, cp2)
            ch = None if scratch_counts else chain.value
            if ch is not None:
                Launcher.launches += 1
                return ch(topk, t, s, nch * ng)
            if scratch_counts:
                per_rank, per_expert = own
                in_rank = torch.empty(t, r_, dtype=torch.bool, device=dev)
            elif outs is not None:
                per_rank, per_expert, in_rank = outs(t)
            else:
                per_rank = torch.empty(r_, dtype=torch.int32, device=dev)
                per_expert = torch.empty(e, dtype=torch.int32, device=dev)
                in_rank = torch.empty(t, r_, dtype=torch.bool, device=dev)
            go(nch * ng, topk, t, s, per_rank, per_expert, in_rank)
            if captured:
                self._plans.pop(("l", k, e), None)
            elif not scratch_counts:
                chain.ready()
            return per_rank, per_expert, in_rank

        return run

    def cached_dispatch_run(self, x, x_scales, handle: DispatchHandle, config=None):
        """``run(x, x_scales, handle) -> (recv_x, recv_x_scales)`` for every cached dispatch like this one
        (same shapes, dtypes, Config and alignment of x, its scales and the handle's tensors; contiguous),
        or None (as ``dispatch_run``)."""
        run = self._cached_plan(x, x_scales, handle, config)
        return run if self.transfer == "sm" else None

    def _cached_plan(self, x, x_scales, handle: DispatchHandle, config):
        t, h = x.shape
        push = self._fused_push()
        ce = self.num_ranks > 1 and self._use_ce()
        num_sms = config.num_sms if config is not None else None
        is_in, rpm, src = handle.is_token_in_rank, handle.rank_prefix_matrix, handle.recv_src_idx
        key = ("c", t, h, x.dtype, None if x_scales is None else x_scales.shape[1], num_sms, push, ce,
               _aligned(x, x_scales, rpm, src, is_in))
        run = self._plans.get(key)
        if run is None:
            if len(self._plans) > _MAX_PLANS:
                self._plans.clear()
            run = self._plans[key] = self._make_cached(key, x, x_scales, num_sms, push, ce)
        return run

    def _make_cached(self, key, x, x_scales, num_sms, push: bool, ce: bool):
        t, h = x.shape
        dev = self.device
        g = x_scales.shape[1] if x_scales is not None else 0
        has_s, x_dtype = x_scales is not None, x.dtype
        lay = self._ht_layout(t, h * x.element_size(), g, 0, h)
        gather = self._gather_plan(key, h, x_dtype, t, lay, g, 0, 0, push, has_s, False)
        err_view = self._err_view
        bulk = not push and self.num_ranks > 1
        specs = [((ROWS, h), x_dtype)] + ([((ROWS, g), torch.float32)] if has_s else [])

        def make_chain():
            # the call's values: x, scales, rank_prefix_matrix, the rows, recv_src_idx, is_token_in_rank, the grid
            a, o = native.addr, native.out
            one = native.const(1)
            st = gather.step((native.num(6), one, one), (a(0),) + ((a(1),) if has_s else ()) + (a(2), native.num(3), o(0))
                             + ((o(1),) if has_s else ()) + (a(4),) + ((a(5),) if push else ()))
            return None if st is None else native.Chain(dev, specs, native.num(3), [st], 7,
                                                        stream=gather.go.p.chain_stream())

        # the outputs and the gather as one native.Chain call (after the first call bound the launch), where
        # the call is only those: the fused push, or one rank
        chain = native.Later(not bulk and not ce and native.wanted(dev) and native.module() is not None,
                             make_chain)

        def run(x, scales, handle):
            if err_view[0]:
                self._check_error()
            self._call_sms = num_sms
            ch = chain.value
            if ch is not None:
                src = handle.recv_src_idx
                n_rows = src.shape[0]
                Launcher.launches += 1
                made = ch(x, scales, handle.rank_prefix_matrix, n_rows, src, handle.is_token_in_rank,
                          self._gather_grid(push, n_rows))
                return made[0], (made[1] if has_s else None)
            is_in = handle.is_token_in_rank
            if bulk:
                self._bulk_dispatch(_words(x), scales, None, None, lay)
            src = handle.recv_src_idx
            n_rows = src.shape[0]
            # (one or two tensors: torch.empty each costs less than a call of native.Outputs; s9 call 9: 1.03x)
            out_x = torch.empty(n_rows, h, dtype=x_dtype, device=dev)
            out_s = torch.empty(n_rows, g, dtype=torch.float32, device=dev) if has_s else None
            gather(self._gather_grid(push, n_rows), x, *((scales,) if has_s else ()), handle.rank_prefix_matrix,
                   n_rows, out_x, *((out_s,) if has_s else ()), src, *((is_in,) if push else ()))
            if ce:
                self._join_ce()
            chain.ready()
            return out_x, out_s

        return run

    def cached_dispatch(self, x, x_scales, handle: DispatchHandle, config=None):
        self._check_error()
        x, x_scales = _contiguous(x), _contiguous(x_scales)
        is_in, rpm, src = handle.is_token_in_rank, handle.rank_prefix_matrix, handle.recv_src_idx
        if not (is_in.is_contiguous() and rpm.is_contiguous() and src.is_contiguous()):
            handle = handle._replace(is_token_in_rank=is_in.contiguous(), rank_prefix_matrix=rpm.contiguous(),
                                     recv_src_idx=src.contiguous())
        return self._cached_plan(x, x_scales, handle, config)(x, x_scales, handle)
