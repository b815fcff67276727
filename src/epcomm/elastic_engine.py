"""The steps of ``ElasticBuffer``'s dispatch and combine (DeepEP V2's API) on epcomm's one engine.

A dispatch is the backend's high-throughput dispatch (``Backend.dispatch`` / ``cached_dispatch``, the
same kernels ``Buffer.dispatch`` runs): rows arrive in source rank, then source token order, exact
(CPU sync) or padded to ``R*M`` rows (``num_worst_tokens``: no host wait, capturable where the backend's
is). What V2 adds is done here once for every backend: the payload (FP8 with opaque 4-byte scale packs
of any width travels as bytes), the handle's metadata, counts and prefix sums (``elastic_layout.recv_meta``),
the expanded layout and its scatter (``dispatch_copy_epilogue_impl``).

A combine sends each partial row back to its owner into a fixed slot (``Backend.return_rows``:
``combine_impl``), then reduces at the source in the order DeepEP fixes: float32, ``bias0 + bias1``
first, partials in top-k lane order at each rank's master lane, one BF16 rounding
(``combine_reduce_epilogue_impl``); an expanded combine first sums a token's local rows at the expert
rank (``allow_multiple_reduction``), or sends every (token, expert) row on its own.

Two implementations of the same steps, giving the same bytes: where the backend runs kernels (CUDA, or the
device backends under the Triton interpreter on CPU) a few Triton kernels (``backends/elastic_kernels.py``: the
host path makes a handful of torch calls and launches a call, and reads nothing back); elsewhere (the
reference backend on CPU) torch operations (``elastic_layout.py``), the reference.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``LE = E/R``,
``M`` = ``num_max_tokens_per_rank``, ``N`` contiguous rows, ``X`` expanded rows, ``P`` scale packs.
"""

from __future__ import annotations

import functools

import torch

from . import elastic_layout as EL
from . import elastic_chains as chains
from . import native
from .backends.base import DispatchArgs
from .config import Config
from .elastic_layout import Rows


class Steps:
    """What the V2 steps run on: the backend's plans and calls (``backend``), the V2 kernels where the
    backend runs kernels (``kernels``: ``backends/elastic_kernels.Kernels``; None: the torch operations of
    ``elastic_layout``, the reference), this rank, the ranks, the GPU's SM count (0 on CPU) and the
    dispatch ``Config`` of each ``num_sms`` (``configs``, filled as calls ask)."""

    def __init__(self, backend, kernels, rank: int, num_ranks: int, device_sms: int) -> None:
        self.backend, self.kernels = backend, kernels
        self.rank, self.num_ranks, self.device_sms = rank, num_ranks, device_sms
        self.configs: dict = {}


class Payload:
    """How a dispatch's ``x`` (and ``sf``, and top-k weights of a cached dispatch) travel: as the backend's
    own BF16 or FP8 + float32-per-128 rows when they are that (bytes unchanged: ``sf`` viewed as
    float32), else packed side by side as bytes in a BF16 row. ``rows=False``: the kind only (what a plan
    keeps: no rows made, no tensor kept; ``data`` and ``scales`` None)."""

    def __init__(self, x: torch.Tensor, sf: torch.Tensor | None, extra: torch.Tensor | None = None,
                 rows: bool = True):
        h = x.shape[1]
        self.x_dtype, self.h = x.dtype, h
        self.xb = h * self.x_dtype.itemsize  # bytes of x in a row
        self.sf_dtype = None if sf is None else sf.dtype
        self.p = 0 if sf is None else sf.shape[1]
        self.k = 0 if extra is None else extra.shape[1]
        direct_bf16 = sf is None and extra is None and x.dtype == torch.bfloat16 and h % 8 == 0
        direct_fp8 = (extra is None and sf is not None and x.dtype == torch.float8_e4m3fn and h % 128 == 0
                      and self.p == h // 128)
        self.packed = not (direct_bf16 or direct_fp8)
        # bytes of a received row (packed: the parts' bytes padded to 16, as elastic_layout.pack_rows pads them)
        self.width = EL.align(self.xb + 4 * self.p + 4 * self.k, 16) if self.packed else self.xb
        self.data = self.scales = None
        if not rows:  # (the kind: what take() needs of it)
            self.contiguous = x.is_contiguous() and (sf is None or sf.is_contiguous())
            self.sf32 = sf is None or sf.dtype == torch.float32
            return
        if not self.packed:
            self.data = x.contiguous()
            self.scales = None if sf is None else sf.contiguous().view(torch.float32)
        else:
            parts = [x] + ([sf.contiguous()] if sf is not None else []) + ([extra] if extra is not None else [])
            self.data = EL.pack_rows(parts).view(torch.bfloat16)

    def take(self, x: torch.Tensor, sf: torch.Tensor | None, extra: torch.Tensor | None = None):
        """A call's ``(payload, rows, scales)`` for this kind (``self`` made with ``rows=False`` from a call like
        it): rows that move as they are, without a ``Payload`` a call, else packed."""
        if self.packed:
            pay = Payload(x, sf, extra)
            return pay, pay.data, pay.scales
        if not self.contiguous:
            x, sf = x.contiguous(), None if sf is None else sf.contiguous()
        return self, x, sf if self.sf32 else sf.view(torch.float32)

    def unpack(self, recv_x: torch.Tensor, recv_scales: torch.Tensor | None, extra: bool = True):
        """The received rows -> ``(x, sf or None, extra or None)`` (``extra=False``: None, left in place)."""
        if not self.packed:  # (scales of the dtype given: as they are, no view)
            return recv_x, (recv_scales if recv_scales is None or recv_scales.dtype == self.sf_dtype else
                            recv_scales.view(self.sf_dtype)), None
        specs = [(self.x_dtype, self.h)]
        if self.p:
            specs.append((self.sf_dtype, self.p))
        if self.k and extra:
            specs.append((torch.float32, self.k))
        parts = EL.unpack_rows(recv_x.view(torch.uint8), specs)
        x = parts.pop(0)
        sf = parts.pop(0) if self.p else None
        return x, sf, parts.pop(0) if self.k and extra else None

    def weight_rows(self, recv_x: torch.Tensor):
        """Where the payload's own weights (``extra``) lie in the received rows (``Rows``), None without."""
        return Rows(recv_x, self.xb + 4 * self.p, self.width) if self.k else None

    def rows(self, recv_x: torch.Tensor, recv_scales: torch.Tensor | None, recv_w: torch.Tensor | None):
        """Where x, the scale packs and the weights (``recv_w [N, K]`` of the backend, or the payload's own)
        lie in the received rows, unpacked or not, as ``elastic_layout.Rows`` (no copy)."""
        if not self.packed:
            x, sf = Rows(recv_x, 0, self.xb), None if recv_scales is None else Rows(recv_scales, 0, 4 * self.p)
        else:
            x, sf = Rows(recv_x, 0, self.width), Rows(recv_x, self.xb, self.width) if self.p else None
        if recv_w is not None:
            return x, sf, Rows(recv_w, 0, 4 * recv_w.shape[1])
        return x, sf, self.weight_rows(recv_x)


class DispatchState:
    """What a dispatch leaves behind for its cached replays and its combine (private to the handle)."""

    def __init__(self, v1, local, gid, meta, source, num_rows, num_expanded, device_sms=0, num_topk=0):
        self.v1 = v1                      # the backend's DispatchHandle
        self.local = local                # int64[N, K] local expert ids (-1: not here, padding rows)
        self.gid = gid                    # int64[N] src_rank * M + src_token, -1 for padding rows
        self.meta = meta                  # int32[N, K+2] the handle's recv_src_metadata (columns 2..: slots)
        self.source = source              # int64[X] row * K + lane of each expanded row, -1 padding; or None
        self.num_rows = num_rows
        self.num_expanded = num_expanded
        self.device_sms = device_sms      # the copy epilogue's programs: 4 a SM
        self.num_topk = num_topk          # K (a cached call's host path reads no shape)

    _slots = None

    @property
    def slots(self) -> torch.Tensor:
        """``int32[N, K]``: the expanded row of each (row, lane), ``-1`` elsewhere (expanded dispatches); the
        view made once (a cached dispatch reads it each call)."""
        if self._slots is None:
            self._slots = self.meta[:, 2:]
        return self._slots


def dispatch_plan(v2, x, sf, topk_idx, topk_weights, num_experts, m, alignment, num_sms, expand, sync, zero_pad,
                  tma_sf, cum_stats, handle_copy, capturing: bool = False):
    """A fresh dispatch of this kind on ``v2``'s backend: ``run(x, sf, topk_idx, topk_weights, cum_stats,
    before_epilogue) -> (recv_x, recv_sf, recv_topk_idx, recv_topk_weights, the handle's fields (a tuple, in
    ``EPHandle``'s order after its kind), DispatchState)`` for every call like this one (the same shapes,
    dtypes, contiguity, 16-byte alignment and arguments; ``ElasticBuffer`` keeps it for the repeats). What
    depends on no value or address is resolved once: the payload's kind, the ``Config``, the worst-case
    sizes, and on a backend that plans its dispatches (``dispatch_run``) its plan, whose transient tensors
    (the layout's counts, the received ids before ``recv_meta`` reads them, the channel matrices no V2 call
    reads) are its scratch, not allocations. Where the backend ``fuses_layout`` (nvlink: for calls not
    ``capturing`` into a CUDA graph) that plan computes the layout in its exchange
    kernel: a call after the first launches no layout kernel."""
    be, r_, me, kern = v2.backend, v2.num_ranks, v2.rank, v2.kernels
    t, k = topk_idx.shape
    le = num_experts // r_
    dev = x.device
    probe = Payload(x, sf, rows=False)  # (its kind: the plan keeps no caller's tensor)
    lay, plans = be.dispatch_layout, be.dispatch_run  # (the layout as Buffer.get_dispatch_layout makes it)
    fused = be.fuses_layout(capturing)  # (the plan's exchange kernel makes the layout)
    config = v2.configs.get(num_sms)
    if config is None:
        config = v2.configs[num_sms] = Config.default_dispatch(r_, EL.align(max(num_sms, 2), 2))
    worst = 0 if sync else r_ * m
    chan, sms, chunk = config.num_channels, config.num_sms, config.num_max_rdma_chunked_send_tokens
    worst_x_rows = EL.worst_expanded_rows(r_, m, k, le, alignment)
    rows_of = kern.recv_meta if kern else EL.recv_meta
    meta_slot: list = []
    if kern and not sync:  # (the same N and X each call: recv_meta keeps its plan in a slot of this kind's)
        rows_of = functools.partial(kern.recv_meta, slot=meta_slot)
    # an eager no-sync dispatch whose backend plan and recv_meta are native chains: from the call after both were
    # made, the two as one chain (Kernels.merged); an expanded one's scatter too (expanded_tail; with its outputs)
    merged = native.Later(kern is not None and fused and not sync and not capturing,
                          lambda *call: kern.merged(
                              getattr(bound[0], "native", None), meta_slot[0][2][-1].value,
                              tail=chains.expanded_tail(v2, *call, zero_pad, tma_sf, k, has_w) if expand else None))
    has_w = topk_weights is not None
    bound: list = []  # the backend's plan, made at the first call (it needs that call's layout tensors)
    flat = chains.FlatResults(native.wanted(dev))  # (a merged chain's results by position)
    zeros = _zero_weights(t, k, dev)

    def run(x, sf, topk_idx, topk_weights, cum_stats, before_epilogue):
        pay, data, scales = probe.take(x, sf)
        w = topk_weights if has_w else zeros()
        mg = merged.value
        if mg is not None and before_epilogue is None and (cum_stats is None or cum_stats.is_contiguous()):
            ins = (data, scales, topk_idx, w, cum_stats)
            made = mg.raw(*ins)
            if flat.build is not None:
                return flat.build(made, ins)
            res, rm, tail = mg.parts(made)
            out = finish(pay, res, rm, topk_idx, tail=tail)
            flat.record(made, ins, out)
            return out
        go = bound[0] if bound else None
        if go is not None and fused:  # (the plan's exchange kernel makes the layout)
            per_rank = per_expert = in_rank = None
        else:
            per_rank, per_expert, in_rank = lay(topk_idx, num_experts, True)  # (counts: read by this call only)
        if go is None:
            args = DispatchArgs(data, scales, topk_idx, w, per_rank, in_rank, per_expert, alignment, worst, chan,
                                sms, chunk)
            if not bound:
                fits = all(a.is_contiguous() for a in (data, topk_idx, w, per_rank, in_rank,
                                                                             per_expert)) and (
                    scales is None or scales.is_contiguous())
                bound.append((plans(args, r_ * m, fused_layout=True) if fused else plans(args, r_ * m))
                             if fits else None)
                go = bound[0]
            if go is None:  # (a backend without plans, or a call its plan cannot take: the whole dispatch)
                res = be.dispatch(args)
        if go is not None:
            res = go(data, scales, topk_idx, w, per_rank, in_rank, per_expert)
        _wait_event(before_epilogue)
        v1 = res.handle
        if sync:
            lst = list(res.num_recv_tokens_per_expert_list)
            x_rows = sum(lst)
        else:
            lst, x_rows = None, worst_x_rows
        rm = rows_of(v1.rank_prefix_matrix, me, v1.recv_src_idx, res.recv_topk_idx, v1.send_head, topk_idx, m, le,
                     alignment, x_rows, expand, cum_stats, handle_copy)
        out = finish(pay, res, rm, topk_idx, lst, x_rows)
        if go is not None and meta_slot and meta_slot[0][2][-1].done:  # (recv_meta's chain made, or never to be)
            merged.ready(res, rm, out, pay)
        return out

    def finish(pay, res, rm, topk_idx, lst=None, x_rows=worst_x_rows, tail=()):
        """The call's results from the backend's (``res``) and recv_meta's (``rm``); ``lst``: the counts a
        synchronised call read (None: none); ``tail``: the expanded rows a merged chain made
        (``elastic_chains.expanded_tail``;
        empty: none made)."""
        v1 = res.handle
        n = res.recv_x.shape[0]
        lst = [] if lst is None else lst
        # the handle's fields after its kind, in EPHandle's order (topk_idx ... dst_buffer_slot_idx)
        fields = (rm.topk if handle_copy else topk_idx, n if sync else worst, x_rows, lst, rm.psum_rank, rm.psum,
                  rm.counts, rm.meta, rm.dst_slot)
        state = DispatchState(v1, rm.local, rm.gid, rm.meta, rm.source if expand else None, n,
                              x_rows if expand else 0, v2.device_sms, k)
        recv_w = res.recv_topk_weights if has_w else None
        if expand:
            ex = tail_rows(tail) if tail else _expanded(v2, state, pay, res.recv_x, res.recv_x_scales, recv_w, zero_pad,
                                                          tma_sf, k)
            return (*ex, fields, state)
        recv_x, recv_sf, _ = pay.unpack(res.recv_x, res.recv_x_scales)
        return recv_x, EL.sf_layout(recv_sf, tma_sf), rm.local_out, recv_w, fields, state

    tail_rows = functools.partial(chains.tail_rows, worst_x_rows, probe.p, tma_sf)
    return run


def cached_plan(v2, expand: bool, x, sf, topk_weights, zero_pad, tma_sf):
    """A dispatch replayed on a handle, of this kind: ``run(state, x, sf, topk_weights, before_epilogue) ->
    (recv_x, recv_sf, recv_topk_idx, recv_topk_weights)``, the same rows as the dispatch that made the
    handle (``state``), for every call like this one (as :func:`dispatch_plan`'s; on a backend that plans
    its cached dispatches, ``cached_dispatch_run``, its plan: the handles' tensors are this backend's own
    allocations, contiguous and aligned, whichever handle a call brings)."""
    be, kern = v2.backend, v2.kernels
    probe = Payload(x, sf, topk_weights, rows=False)  # (its kind: the plan keeps no caller's tensor)
    plans = be.cached_dispatch_run
    bound: list = []  # the backend's plan, made at the first call

    def run(state, x, sf, topk_weights, before_epilogue):
        pay, data, scales = probe.take(x, sf, topk_weights)
        v1 = state.v1
        if not bound:
            fits = all(t.is_contiguous() for t in (
                data, v1.is_token_in_rank, v1.rank_prefix_matrix, v1.recv_src_idx)) and (
                scales is None or scales.is_contiguous())
            bound.append(plans(data, scales, v1, None) if fits else None)
        go = bound[0]
        if go is not None:
            recv, recv_scales = go(data, scales, v1)
        else:
            recv, recv_scales = be.cached_dispatch(data, scales, v1, None)
        _wait_event(before_epilogue)
        k = state.num_topk
        if expand:  # (an expanded row takes its own lane's weight: a local one)
            return _expanded(v2, state, pay, recv, recv_scales, None, zero_pad, tma_sf, k)
        recv_x, recv_sf, recv_w = pay.unpack(recv, recv_scales, extra=kern is None)
        if kern is not None:  # the copy epilogue: ids, and the weights read where they landed
            recv_k, recv_w = kern.cached_epilogue(state.local, state.num_rows, k, pay.weight_rows(recv))
            return recv_x, EL.sf_layout(recv_sf, tma_sf), recv_k, recv_w
        if recv_w is not None:  # the local lanes' weights, 0 elsewhere, as a fresh dispatch gives them
            recv_w.masked_fill_(state.local < 0, 0)  # (recv_w is unpacked: its own copy)
        return recv_x, EL.sf_layout(recv_sf, tma_sf), state.local.clone(), recv_w

    return run


def _zero_weights(t: int, k: int, dev):
    """``zeros() -> f32[T, K]`` of zeros, the weights the backend moves for a dispatch given none (its kernels
    only read them): one tensor, made at the first call and kept, for every eager call (no allocation and no
    fill launch a call); a call while a CUDA graph is captured gets one of its own (the graph's pool: never kept
    for eager calls, and a kept one could be freed with its plan while the graph still reads it)."""
    kept: list = []
    cuda = dev.type == "cuda"

    def zeros() -> torch.Tensor:
        if cuda and torch.cuda.is_current_stream_capturing():
            return torch.zeros(t, k, dtype=torch.float32, device=dev)
        if not kept:
            kept.append(torch.zeros(t, k, dtype=torch.float32, device=dev))
        return kept[0]

    return zeros


def _expanded(v2, state: DispatchState, pay: Payload, recv, recv_scales, recv_w, zero_pad, tma_sf, k):
    """The received rows scattered to the expanded layout (``dispatch_copy_epilogue_impl``), read where they
    landed (packed or not): ``(recv_x, recv_sf, None, recv_topk_weights)``."""
    x, sf, w = pay.rows(recv, recv_scales, recv_w)
    parts = (x, pay.x_dtype, pay.h, sf, pay.sf_dtype, pay.p, tma_sf, w)
    if v2.kernels is None:
        ex, esf, ew = EL.expand_rows(state.source, k, zero_pad, *parts)
    else:
        ex, esf, ew = v2.kernels.copy_epilogue(state.source, k, zero_pad, state.device_sms, *parts,
                                                slots=state.slots)  # (by contiguous row: each read once)
    return ex, esf, None, ew


def _wait_event(ev) -> None:
    """The current stream waits for ``ev`` (an ``EventHandle``; None: nothing to wait for)."""
    if ev is not None:
        ev.current_stream_wait()


# ----------------------------------------------------------------------------- combine


def combine(v2, x, state: DispatchState, topk_idx, num_experts, m, expand, topk_weights, bias, multi,
            before_epilogue, num_sms: int = 0):
    """``(combined_x bf16[T, H], combined_topk_weights f32[T, K] or None)``; ``num_sms``: the transport's
    programs (``Backend.return_rows``). The rows sent back are ``x`` as it is where it can be (contiguous,
    no weights), else packed (``Kernels.pack``); on the nvlink backend a contiguous combine's transport reads
    ``x`` and the weights in place instead (``NVLinkBackend.return_row_parts``: the same bytes land, no pack)
    and moves only the rows other ranks own: the reduction reads this rank's own from ``x`` and the weights
    (at world 1 nothing moves)."""
    kern = v2.kernels
    if kern is None:
        return _combine_torch(v2, x, state, topk_idx, num_experts, m, expand, topk_weights, bias, multi,
                              before_epilogue, num_sms)
    be = v2.backend
    t, k = topk_idx.shape
    h = x.shape[1]
    le = num_experts // v2.num_ranks
    if expand and not multi:  # one transport a lane; the owner adds lane by lane in float32, rounds once
        acc = torch.empty(t, h, dtype=torch.float32, device=x.device) if k > 1 else None
        out = rows = dst = None
        x = x.contiguous()
        for j in range(k):  # (the rows and their destinations are read before the next lane writes them)
            rows, dst = kern.pack(x, state.meta, None, 2, j, rows, dst)
            got = be.return_rows(rows, dst, m, "combine/rows", num_sms)
            _wait_event(before_epilogue if j == 0 else None)
            out, _ = kern.reduce(got, topk_idx, le, m, h, bias, (j, j + 1), False, False, acc, j > 0, j < k - 1, out)
        return out, None
    got = own = None
    if not expand:  # nvlink: x and the weights read in place; this rank's own rows do not move at all
        got = be.return_row_parts(x, topk_weights, state.gid, m, "combine/rows", num_sms, skip_self=True)
        if got is not None:  # (the reduction reads them from x at the handle's send_head[:, me])
            own = (x, topk_weights, state.v1.send_head, v2.rank, v2.num_ranks)
    if got is None:
        if expand:
            rows, _ = kern.pack(x, state.meta, topk_weights, 1)
        elif topk_weights is None and (2 * h) % 16 == 0 and x.is_contiguous() and x.data_ptr() % 16 == 0:
            rows = x.view(torch.uint8)  # the rows as they are
        else:
            rows, _ = kern.pack(x, state.meta, topk_weights, 0)
        got = be.return_rows(rows, state.gid, m, "combine/rows", num_sms)
    _wait_event(before_epilogue)
    return kern.reduce(got, topk_idx, le, m, h, bias, (0, k), True, topk_weights is not None, self_rows=own)


def _combine_torch(v2, x, state: DispatchState, topk_idx, num_experts, m, expand, topk_weights, bias, multi,
                   before_epilogue, num_sms):
    """:func:`combine` in torch operations (the reference backend on CPU)."""
    be, r_ = v2.backend, v2.num_ranks
    t, k = topk_idx.shape
    h = x.shape[1]
    dev = x.device
    le = num_experts // r_
    tok = torch.arange(t, device=dev)
    valid = topk_idx >= 0
    owner = torch.where(valid, topk_idx // le, torch.zeros_like(topk_idx))
    zero_bf16 = torch.zeros((), dtype=torch.bfloat16, device=dev)

    if expand and not multi:
        # every (token, expert) row travels on its own, one lane at a time; one reduction at the source
        def lanes(j: int) -> torch.Tensor:
            s = state.slots[:, j].to(torch.int64)
            dst = torch.where((s >= 0) & (state.gid >= 0), state.gid, torch.full_like(state.gid, -1))
            got = be.return_rows(EL.pack_rows([x[s.clamp(min=0)]]), dst, m, "combine/rows", num_sms).view(r_ * m, -1)
            _wait_event(before_epilogue if j == 0 else None)
            mine = got[owner[:, j] * m + tok][:, :2 * h].contiguous().view(torch.bfloat16)
            return torch.where(valid[:, j].unsqueeze(1), mine, zero_bf16)

        return EL.ordered_reduce(lanes, k, bias, (t, h), dev), None

    if expand:
        partial = EL.local_reduce(x, state.slots)  # the expert rank's stage: fp32, one BF16 rounding
        w_rows = None
        if topk_weights is not None:
            s = state.slots.to(torch.int64)
            w_rows = torch.where(s >= 0, topk_weights[s.clamp(min=0)], torch.zeros((), device=dev))
    else:
        partial = x[:state.num_rows]
        w_rows = topk_weights
    parts = [partial] + ([w_rows] if w_rows is not None else [])
    got = be.return_rows(EL.pack_rows(parts), state.gid, m, "combine/rows", num_sms).view(r_ * m, -1)
    _wait_event(before_epilogue)
    master = EL.master_lanes(topk_idx, le)
    out_w = None
    if w_rows is not None:  # lane j: the weight its owner sent back (0 for -1 lanes)
        wcols = got[:, h * 2:h * 2 + 4 * k].view(torch.float32)
        wv = wcols[owner * m + tok.unsqueeze(1), torch.arange(k, device=dev).unsqueeze(0)]
        out_w = torch.where(valid, wv, torch.zeros((), device=dev))

    def lanes(j: int) -> torch.Tensor:
        row = got[owner[:, j] * m + tok]  # [T, W]: what lane j's owner sent for each token
        return torch.where(master[:, j].unsqueeze(1), row[:, :h * 2].contiguous().view(torch.bfloat16), zero_bf16)

    return EL.ordered_reduce(lanes, k, bias, (t, h), dev), out_w
