"""Launchers of ``ElasticBuffer``'s kernels (``kernels/v2_dispatch.py``, ``kernels/v2.py``): allocate the outputs, derive the grid and
the launch key, launch. Each kind of launch is bound once (``kernels/launch.Direct``), so a call costs no
Triton binder and no driver query per pointer; under the Triton interpreter (CPU runs) the kernels run
as Python. Every function here returns what its torch twin in ``elastic_layout`` returns (the same bytes;
``tests/unit/sims/sim_elastic.py`` compares them) and reads nothing back on the host: no synchronisation,
so a CUDA graph captures it.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``LE = E/R``,
``M`` = ``num_max_tokens_per_rank``, ``N`` contiguous rows, ``X`` expanded rows, ``P`` scale packs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import elastic_layout as EL
from .. import native
from ..kernels.launch import Direct, Launcher
from ..native import ROWS, Outputs
from .elastic_meta_chains import merged, meta_chain
from .nvlink_params import _aligned, _contiguous, _pow2

BN = 128    # rows (or tokens) a program of the metadata kernels
RB = 64     # ranks a step of the metadata kernels
BLOCK = 1024
# the reduction (``_combine_reduce_epilogue_impl_kernel``): a program takes up to this many columns of a token's
# row, 4 warps. DSv3 combine at world 1 on an H100, graph replays of one process (commit 3a3c1af; its log in git
# history): 1024 columns 110 us, 2048 94, 4096 (8 warps) 102, 8192 (8 warps) 141
REDUCE_BLOCK_MAX = 2048


def reduce_block(h: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` of the reduction for rows of ``h`` columns.
    Example: ``reduce_block(7168) == (2048, 4)``, ``reduce_block(128) == (128, 4)``."""
    return min(_pow2(h), REDUCE_BLOCK_MAX), 4


# the expanded copy (``_dispatch_copy_epilogue_impl_kernel``): a tile of COPY_RB rows x COPY_BLOCK bytes a
# step (16 KB in flight a program; one row of 1 KB a step, as before 29a75e2, left each program waiting
# on one load after another), COPY_PER_SM programs of COPY_WARPS warps an SM of the device at most
LBN = 512   # rows a step of the expanded layout's scan (``_expert_layout_kernel``: a program an expert reads
            # every row, one step after another: 128 rows a step took 64 dependent steps at DSv3's 8192 rows)
COPY_RB = 8
COPY_BLOCK = 2048
COPY_WARPS = 8
COPY_PER_SM = 4


def copy_grid(x_rows: int, sms: int) -> int:
    """Programs of the expanded copy for ``x_rows`` rows on a device of ``sms`` SMs: one tile of ``COPY_RB``
    rows each, at most ``COPY_PER_SM`` a SM (the kernel takes no wait: any grid finishes).
    Example: ``copy_grid(81792, 132) == 528``; ``copy_grid(20, 132) == 3``."""
    return max(1, min((x_rows + COPY_RB - 1) // COPY_RB, COPY_PER_SM * max(sms, 1)))


def combine_row_bytes(h: int, k: int) -> int:
    """Bytes of a row a combine sends back: ``x bf16[H]`` from byte 0, then ``k`` float32 weights (0: none)
    from byte ``2H``, padded to 16 (``Kernels.pack``'s rows, and the nvlink transport's when it reads the
    two in place). Example: ``combine_row_bytes(7168, 8) == 14368``, ``combine_row_bytes(100, 0) == 208``."""
    return EL.align(2 * h + 4 * k, 16)


def _parts(rows: tuple, k: int) -> tuple[list, tuple]:
    """One block of int64 rows of ``k`` for parts of ``rows[i]`` rows (None: no such part), each from a 16-byte
    boundary: ``(sizes of its split, the last item the block's rows; index of each part in the split or None)``.
    Example: ``_parts((3, None, 2), 1) == ([3, 1, 2, 6], (0, None, 2))``."""
    sizes, at = [], []
    for r in rows:
        if r is None:
            at.append(None)
            continue
        if sum(sizes) * k % 2:  # (an odd number of int64 before: a pad row)
            sizes.append(1)
        at.append(len(sizes))
        sizes.append(r)
    return sizes + [sum(sizes)], tuple(at)


def _outputs_at(rows: tuple, expand: bool) -> tuple:
    """Where ``recv_meta``'s ten outputs (counts, psum, psum_rank, meta, dst, local, local_out, topk_copy, gid,
    source) lie in its ``native.Outputs`` (:meth:`Kernels._meta_plan`'s specs: the row blocks of ``rows`` that are
    present, then gid, then source where ``expand``), None where absent.
    Example: ``_outputs_at((4, None, 3), True) == (0, 1, 2, 3, 4, 5, None, 6, 7, 8)``."""
    at, i = [0, 1, 2, 3, 4], 5
    for r in rows:
        at.append(None if r is None else i)
        i += r is not None
    return (*at, i, i + 1 if expand else None)


class PlannedLaunch(NamedTuple):
    """A launch :meth:`Kernels.launch` would make (``launch(name, key, consts, grid, *args)``), not made: what a
    ``plan=True`` call returns first (``elastic_chains`` makes it a chain's step)."""

    name: str
    key: tuple
    consts: dict
    grid: tuple
    args: tuple


class PlannedCopy(NamedTuple):
    """``Kernels.copy_epilogue(plan=True)``: its launch and outputs."""

    launch: PlannedLaunch
    out: torch.Tensor
    out_sf: torch.Tensor | None
    out_w: torch.Tensor | None


class PlannedPack(NamedTuple):
    """``Kernels.pack(plan=True)``: its launch, the rows and their destinations (None: mode 0 and 1)."""

    launch: PlannedLaunch
    rows: torch.Tensor
    dst: torch.Tensor | None


class PlannedReduce(NamedTuple):
    """``Kernels.reduce(plan=True)``: its launch, the combined rows and weights (None without)."""

    launch: PlannedLaunch
    out: torch.Tensor
    out_w: torch.Tensor | None


def _planned(call: tuple) -> PlannedLaunch:
    return PlannedLaunch(call[0], call[1], call[2], call[3], tuple(call[4:]))


def _kernel(name: str):
    """The ``@triton.jit`` kernel ``name`` of ``kernels/v2_dispatch.py`` or ``kernels/v2.py`` (imported on first
    use: importing this module compiles nothing)."""
    from ..kernels import v2, v2_dispatch

    return getattr(v2_dispatch, name, None) or getattr(v2, name)


class Kernels:
    """The launches of one ``ElasticBuffer`` (bound per key on first use)."""

    def __init__(self):
        self._launchers: dict = {}
        self._go: dict = {}
        self._plans: dict = {}  # recv_meta's, per kind of call
        self._scratch: dict = {}  # recv_meta's counts and ticket, per device (_counts_scratch)
        self._pinned: list = []  # scratches made while a graph was captured: that graph replays into them

    def launch(self, name: str, key: tuple, consts: dict, grid: tuple, *args) -> None:
        """Kernel ``name`` (:func:`_kernel`) on ``grid`` (3 ints) with ``args`` (all positional, tensors and ints);
        ``key`` must fix ``consts`` (the constexprs and options) and the alignment of the tensors a
        caller may pass unaligned: it names the compiled kernel."""
        go = self._go.get((name, key))
        if go is None:
            lau = self._launchers.get(name)
            if lau is None:
                lau = self._launchers[name] = Launcher(_kernel(name))
            go = self._go[(name, key)] = Direct(lau.prepared((name, key), consts), (None,) * len(args),
                                                tuple(range(len(args))))
        go(*grid, *args)

    # ------------------------------------------------------------------ dispatch

    def recv_meta(self, rpm, me: int, recv_src_idx, recv_local, send_head, topk_idx, m: int, le: int,
                  alignment: int, x_rows: int, expand: bool, cum, copy_topk: bool = False,
                  slot: list | None = None) -> EL.RecvMeta:
        """``elastic_layout.recv_meta``: for a contiguous dispatch one launch (``_recv_meta_kernel``'s body as
        ``_dispatch_copy_epilogue_impl_meta_kernel``: every output, the counts and prefix sums, ``cum``, the
        copy of ``topk_idx``); an expanded one launches ``_recv_meta_kernel`` and then
        ``_expert_layout_kernel`` (the layout). ``cum`` (``int32[LE]`` or None) gains the counts. No output
        is zeroed first. The kernels read rows in place: every tensor is made contiguous first (a no-op
        for the backend's and most callers' tensors). A kind of call (sizes, dtypes, flags, alignment) is
        planned once (:meth:`_meta_plan`): a repeat costs its outputs and the launches.

        ``slot`` (a list, empty at first; ``elastic_engine.dispatch_plan``'s, one per kind of dispatch that
        reads no counts on the host): the plan of the first call whose tensors were all contiguous is kept
        there, and a later call of ``N`` and ``X`` alike takes it without a key (no contiguity or alignment
        read): for a caller whose every call passes tensors of the first one's contiguity and 16-byte
        alignment (the caller's are in ``ElasticBuffer``'s key of the kind, the backend's are made alike
        by one plan; ``EPCOMM_VERIFY_LAUNCH`` checks it at every launch)."""
        n, k = recv_local.shape
        t = topk_idx.shape[0]
        got = slot[0] if slot else None
        if got is not None and got[0] == n and got[1] == x_rows:
            plan, stats = got[2], cum
        else:
            given = (rpm, recv_src_idx, recv_local, send_head, topk_idx, cum)
            rpm, recv_src_idx, recv_local = _contiguous(rpm), _contiguous(recv_src_idx), _contiguous(recv_local)
            send_head, topk_idx, stats = _contiguous(send_head), _contiguous(topk_idx), _contiguous(cum)
            key = (n, t, k, rpm.shape[0], le, m, me, alignment, x_rows, expand, cum is not None,
                   copy_topk, recv_src_idx.dtype, send_head.dtype, recv_local.device,
                   _aligned(topk_idx, rpm, recv_src_idx, recv_local, send_head, stats))
            plan = self._plans.get(key)
            if plan is None:
                if len(self._plans) > 64:
                    self._plans.clear()
                plan = self._plans[key] = self._meta_plan(key)
            if slot is not None and not slot and all(a is b for a, b in zip(given, (
                    rpm, recv_src_idx, recv_local, send_head, topk_idx, stats))):
                slot.append((n, x_rows, plan))
        go_rows, g_rows, go_layout, small, r_, (wide, rows_at), (ones, ones_at), outs, outs_at, chain = plan
        dev = recv_local.device
        part, ticket = self._counts_scratch(dev)
        ch = chain.value
        if ch is not None and ch[1] is part and stats is cum:  # (one native.Chain call: outputs and launch)
            Launcher.launches += 1
            return ch[2][3](ch[0](rpm, recv_src_idx, recv_local, send_head, topk_idx, stats))
        if outs is not None:  # (native.wanted: every output in one C++ call, native.Outputs)
            made = outs(x_rows)
            counts, psum, psum_rank, meta, dst, local, local_out, topk_copy, gid, source = (
                None if i is None else made[i] for i in outs_at)
            source = source if expand else ones
        else:
            small = torch.empty(small, dtype=torch.int32, device=dev)
            counts, psum, psum_rank = small.split_with_sizes((le, le, r_))
            meta = torch.empty(n, k + 2, dtype=torch.int32, device=dev)
            dst = torch.empty(t, k, dtype=torch.int32, device=dev)
            # the int64 outputs from two blocks, each part 16-byte aligned (pads where K is odd): rows of K ids
            # (local, recv_topk_idx of a contiguous dispatch, the handle's copy of topk_idx), then gid and source
            parts = torch.empty(wide[-1], k, dtype=torch.int64, device=dev).split_with_sizes(wide[:-1])
            local, local_out, topk_copy = (None if i is None else parts[i] for i in rows_at)
            if expand:
                parts = torch.empty(ones[-1], dtype=torch.int64, device=dev).split_with_sizes(ones[:-1])
                gid, source = parts[0], parts[ones_at[1]]
            else:  # (no expanded rows: an empty source, the plan's, as the torch twin's; read by no one)
                gid, source = torch.empty(n, dtype=torch.int64, device=dev), ones
        go_rows(g_rows, 1, 1, rpm, recv_src_idx, recv_local, local, local if expand else local_out, meta, gid,
                counts, psum, psum_rank, stats if cum is not None else counts, topk_idx,
                topk_copy if copy_topk else topk_idx, send_head, dst, part, ticket)
        if expand:
            go_layout(le, 1, 1, counts, local, rpm, meta, source)
        if self._scratch.get(dev) is not None and self._scratch[dev][0] is part:  # (not captured)
            chain.ready(part, ticket)  # (bound now: the next such call is one chain call)
        if stats is not cum:  # a strided cumulative_local_expert_recv_stats: updated through a copy
            cum.copy_(stats)
        return EL.RecvMeta(psum_rank, gid, local, local_out, meta, counts, psum, source, dst, topk_copy)

    def _counts_scratch(self, dev) -> tuple:
        """``(part int32[256], ticket int32[4])`` of ``_recv_meta_kernel`` on ``dev``: allocated zeroed once
        (each launch leaves them at 0). Allocated while a graph is captured, the zeroing is a node of the
        graph, run at its replays only: such a scratch serves that call alone, kept alive for the graph."""
        got = self._scratch.get(dev)
        if got is None:
            got = torch.zeros(EL.MAX_LOCAL_EXPERTS + 4, dtype=torch.int32, device=dev).split_with_sizes(
                (EL.MAX_LOCAL_EXPERTS, 4))
            if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
                self._pinned.append(got)
            else:
                self._scratch[dev] = got
        return got

    def _meta_plan(self, key: tuple):
        """``recv_meta``'s launches for ``key``, their sizes and grids resolved: ``(go_rows (17 tensors), its
        grid, go_layout (5 tensors; None: contiguous), size of the small int32 outputs, R, the int64 blocks'
        parts, outs)``: ``outs`` a ``native.Outputs`` of every output where ``native.wanted`` (a GPU), else
        None."""
        n, t, k, r_, le, m, me, alignment, x_rows, expand, has_cum, copy_topk = key[:12]
        assert le <= EL.MAX_LOCAL_EXPERTS, le  # (ElasticBuffer checks it): the counts' scratch holds them
        kp, rb, lep = _pow2(k), min(RB, _pow2(r_)), _pow2(le)
        lkey = (r_, k, le, expand) + key[-4:-2] + key[-1:]  # the compiled kernels' key
        # a contiguous dispatch's epilogue is this kernel (named for DeepEP's timing); an expanded one's the copy
        go_rows = self.bound("_recv_meta_kernel" if expand else "_dispatch_copy_epilogue_impl_meta_kernel",
                             lkey + (has_cum, copy_topk),
                             dict(R=r_, K=k, LE=le, LEP=lep, HB=max(lep, 32), KP=kp, BN=BN, RB=rb,
                                  COPY=not expand, EXPAND=expand, HAS_CUM=has_cum, COPY_TOPK=copy_topk,
                                  num_warps=4),
                             (None, me, None, None, n) + (None,) * 11 + (t, None, m, alignment, None, None))
        go_layout = None
        if expand:
            go_layout = self.bound("_expert_layout_kernel", lkey,
                                   dict(R=r_, K=k, LE=le, LEP=lep, KP=kp, BN=LBN, num_warps=16),
                                   (None, None, None, me, alignment, None, None, x_rows))
        rows = (n, None if expand else n, t if copy_topk else None)
        dev = key[-2]
        outs = specs = None
        at = _outputs_at(rows, expand)
        if native.wanted(dev):  # (x_rows: the call's, which a synchronised one reads)
            i32, i64 = torch.int32, torch.int64
            specs = ([((le,), i32), ((le,), i32), ((r_,), i32), ((n, k + 2), i32), ((t, k), i32)]
                     + [((r, k), i64) for r in rows if r is not None] + [((n,), i64)]
                     + ([((ROWS,), i64)] if expand else []))
            outs = Outputs(dev, specs, True, range(len(specs)))
        g_rows = max(1, (n + BN - 1) // BN) + (t + BN - 1) // BN
        ones = _parts((n, x_rows), 1) if expand else (torch.empty(0, dtype=torch.int64, device=dev), 0)
        # the outputs and launches (an expanded layout's two) as one native.Chain (made after the first
        # uncaptured call bound the launches)
        chain = native.Later(outs is not None and outs.native,
                             lambda part, ticket: self._meta_chain(go_rows, g_rows, specs, at, has_cum, copy_topk, part,
                                                                   ticket, ones[0], go_layout, le, x_rows))
        return go_rows, g_rows, go_layout, 2 * le + r_, r_, _parts(rows, k), ones, outs, at, chain

    # recv_meta's outputs and launches as a chain, and that chain joined to the dispatch's (elastic_meta_chains.py)
    _meta_chain = staticmethod(meta_chain)
    merged = staticmethod(merged)

    def bound(self, name: str, key: tuple, consts: dict, template: tuple):
        """``go(gx, gy, gz, *tensors)``: kernel ``name`` with ``template``'s fixed arguments and the
        ``tensors`` in its None positions (``key`` as :meth:`launch`'s). Where this object's ``launch`` is
        replaced (the tests record launches that way), ``go`` calls it with every argument."""
        holes = tuple(i for i, a in enumerate(template) if a is None)
        if "launch" in vars(self):
            def go(gx, gy, gz, *tensors):
                args = list(template)
                for i, a in zip(holes, tensors):
                    args[i] = a
                self.launch(name, key, consts, (gx, gy, gz), *args)
            return go
        lau = self._launchers.get(name)
        if lau is None:
            lau = self._launchers[name] = Launcher(_kernel(name))
        return Direct(lau.prepared((name, key), consts), template, holes)

    def copy_epilogue(self, source: torch.Tensor, k: int, zero_pad: bool, sms: int, x: EL.Rows, x_dtype,
                      h: int, sf: EL.Rows | None, sf_dtype, p: int, tma_sf: bool, w: EL.Rows | None,
                      slots: torch.Tensor | None = None, plan: bool = False):
        """The expanded layout's rows (``dispatch_copy_epilogue_impl``): ``(x [X, H], sf [X, P] or None,
        weights f32[X] or None)`` from the contiguous rows' sources (``elastic_layout.Rows``: a tensor, the
        byte offset of the part in a row, the bytes between rows), as ``elastic_layout.expand_rows``.
        ``slots`` (``int32[N, K]``, the handle's ``recv_src_metadata[:, 2:]``; unit column stride): the
        copy goes by contiguous row, each read once for all its lanes (``BY_ROW``); None: by expanded row,
        each contiguous row read once per local lane. With ``plan`` nothing is launched: a
        :class:`PlannedCopy` (the launch :meth:`launch` would make, and the outputs) (``elastic_chains.expanded_tail`` makes it
        a chain's step; None where there are no rows)."""
        x_rows = source.shape[0]
        dev = source.device
        x, sf, w = (None if r is None else r._replace(tensor=r.tensor.contiguous()) for r in (x, sf, w))
        out = torch.empty(x_rows, h, dtype=x_dtype, device=dev)
        row = h * x_dtype.itemsize
        out_sf = out_w = None
        sf_rs, sf_cs = p, 1
        if sf is not None:
            if tma_sf:
                sf_rs, sf_cs = 1, EL.align(max(x_rows, 1), 4)
            out_sf = torch.empty_strided((x_rows, p), (sf_rs, sf_cs), dtype=sf_dtype, device=dev)
        if w is not None:
            out_w = torch.empty(x_rows, dtype=torch.float32, device=dev)
        if x_rows:
            sf_src = sf if sf is not None else x
            w_src = w if w is not None else x
            n = 0 if slots is None else slots.shape[0]
            stride = 0 if slots is None else slots.stride(0)
            key = (k, row, x.stride, sf is not None and (p, sf.offset, sf.stride),
                   w is not None and (w.offset, w.stride), bool(zero_pad), x.tensor.dtype, sf_src.tensor.dtype,
                   w_src.tensor.dtype, sf_dtype, slots is not None, stride, _aligned(x.tensor, sf_src.tensor,
                                                                                      w_src.tensor, slots))
            call = ("_dispatch_copy_epilogue_impl_kernel", key, dict(
                K=k, KP=_pow2(k), ROW=row, SRC_STRIDE=x.stride, SFB=4 * p, SFBP=_pow2(4 * p),
                SF_OFF=sf_src.offset, SF_STRIDE=sf_src.stride, W_OFF=w_src.offset, W_STRIDE=w_src.stride,
                HAS_SF=sf is not None, HAS_W=w is not None, ZERO=bool(zero_pad), RB=COPY_RB, BLOCK=COPY_BLOCK,
                BY_ROW=slots is not None, SLOT_STRIDE=stride, num_warps=COPY_WARPS),
                (copy_grid(max(n, x_rows if zero_pad or slots is None else 0), sms), 1, 1), x.tensor, source, out,
                x_rows, sf_src.tensor, out_sf if out_sf is not None else out, sf_rs, sf_cs, w_src.tensor,
                out_w if out_w is not None else out, slots if slots is not None else source, n)
            if plan:
                return PlannedCopy(_planned(call), out, out_sf, out_w)
            self.launch(*call)
        elif plan:
            return None
        return out, out_sf, out_w

    def cached_epilogue(self, local: torch.Tensor, n: int, k: int, w: EL.Rows | None):
        """A cached contiguous dispatch's ``(recv_topk_idx int64[N, K], recv_topk_weights f32[N, K] or None)``
        (``dispatch_copy_epilogue_impl``): the handle's local ids ``local int64[N, K]`` (its own, contiguous),
        and the received weights (``w``: where they lie in the received rows) masked to the local lanes; one
        launch, even of no rows."""
        dev = local.device
        out_k = torch.empty(n, k, dtype=torch.int64, device=dev)
        out_w = None if w is None else torch.empty(n, k, dtype=torch.float32, device=dev)
        # (the weights travel packed, in BF16 rows: their dtype is fixed)
        key = (k,) if w is None else (k, w.offset, w.stride, _aligned(w.tensor))
        self.launch("_dispatch_copy_epilogue_impl_cached_kernel", key, dict(
            K=k, KP=_pow2(k), W_OFF=0 if w is None else w.offset, W_STRIDE=0 if w is None else w.stride,
            HAS_W=w is not None, BN=BN, num_warps=4),
            (max(1, (n + BN - 1) // BN), 1, 1), local, out_k, n, out_k if w is None else w.tensor,
            out_k if w is None else out_w)
        return out_k, out_w

    # ------------------------------------------------------------------ combine

    def pack(self, x: torch.Tensor, meta: torch.Tensor, w: torch.Tensor | None, mode: int, lane: int = 0,
             rows: torch.Tensor | None = None, dst: torch.Tensor | None = None, plan: bool = False):
        """The rows a combine sends back, ``uint8[N, W]`` (``W`` = ``2H`` (+ ``4K`` with ``w``) padded to 16),
        and with ``mode`` 2 their ``dst int64[N]`` (else None): ``mode`` 0 the contiguous rows ``x bf16[N, H]``
        (and ``w f32[N, K]``) as they are, 1 each row's expanded rows ``x bf16[X, H]`` summed
        (``elastic_layout.local_reduce``; ``w f32[X]`` at each lane's row), 2 lane ``lane``'s expanded row
        (``x`` contiguous). Padding rows (``meta[:, 0] == -1``) are left unwritten: their destination is
        ``-1``. ``rows`` and ``dst``: a previous call's, to be written again (made here when None). With ``plan``
        nothing is launched: a :class:`PlannedPack` (None where there are no rows), as :meth:`reduce`'s."""
        n, k = meta.shape[0], meta.shape[1] - 2
        h = x.shape[1]
        width = combine_row_bytes(h, k if w is not None else 0)
        dev = x.device
        if rows is None:
            rows = torch.empty(n, width, dtype=torch.uint8, device=dev)
        if dst is None and mode == 2:
            dst = torch.empty(n, dtype=torch.int64, device=dev)
        if n:
            if mode != 2:
                x = x.contiguous()
            if w is not None:
                w = w.contiguous()
            key = (mode, k, h, width, w is not None, _aligned(x, w))
            call = ("_combine_pack_kernel", key, dict(
                K=k, KP=_pow2(k), H=h, W=width, HAS_W=w is not None, MODE=mode, BLOCK=BLOCK, num_warps=4),
                (n, (h + BLOCK - 1) // BLOCK, 1), x, meta, w if w is not None else x, rows,
                dst if dst is not None else meta, lane)
            if plan:
                return PlannedPack(_planned(call), rows, dst)
            self.launch(*call)
        elif plan:
            return None
        return rows, dst

    def reduce(self, got: torch.Tensor, topk_idx: torch.Tensor, le: int, m: int, h: int, bias: tuple,
               lanes: tuple[int, int], master: bool, with_w: bool, acc: torch.Tensor | None = None,
               acc_in: bool = False, acc_out: bool = False, out: torch.Tensor | None = None, self_rows=None,
               plan: bool = False):
        """``combine_reduce_epilogue_impl``: lanes ``lanes[0] .. lanes[1]-1`` of the rows sent back (``got
        uint8[R, M, W]``, BF16 from byte 0, weights from byte ``2H``) added in lane order in float32 from
        the biases (or ``acc`` with ``acc_in``), one BF16 rounding into ``out`` (made here when None;
        ``acc_out``: into ``acc`` in float32, for a later call). ``master``: each rank's partial once, at
        its highest lane; else every lane. ``self_rows``: ``(x bf16[N, H], weights f32[N, K] or None,
        send_head int32[T, R] (contiguous, as the nvlink handle's), me, R)``, where this rank's own partials lie (the transport skipped them:
        ``return_row_parts(skip_self=True)``), read in place from row ``send_head[t, me]``; rows of unit
        column stride. Returns ``(out bf16[T, H], weights f32[T, K] or None)``; with ``plan`` nothing is
        launched: a :class:`PlannedReduce`, the launch :meth:`launch` would make and the outputs
        (``elastic_chains.combine_chain`` makes it a chain's step)."""
        t, k = topk_idx.shape
        dev = got.device
        if out is None:
            out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
        out_w = torch.empty(t, k, dtype=torch.float32, device=dev) if with_w else None
        if t or plan:
            topk_idx = topk_idx.contiguous()
            b0 = bias[0].contiguous() if bias else out
            b1 = bias[1].contiguous() if len(bias) > 1 else out
            row = got.shape[-1]
            if self_rows is None:
                xs, ws, sh, me, r_ = out, out, topk_idx, 0, 0
                sx = sw = 0
            else:  # (x and the weights passed return_row_parts' 16-byte checks; send_head is the handle's own)
                xs, ws, sh, me, r_ = self_rows
                sx = xs.stride(0)
                sw = ws.stride(0) if ws is not None else 0
                ws = ws if ws is not None else xs
            key = (k, le, row, h, len(bias), master, with_w, acc_in, acc_out, self_rows is not None, sx, sw,
                   _aligned(got, topk_idx, b0, b1))
            rblock, rwarps = reduce_block(h)
            call = ("_combine_reduce_epilogue_impl_kernel", key, dict(
                K=k, KP=_pow2(k), LE=le, ROW=row, H=h, W_OFF=h // 2, NB=len(bias), MASTER=master, HAS_W=with_w,
                ACC_IN=acc_in, ACC_OUT=acc_out, BLOCK=rblock, SELF=self_rows is not None, XS=sx, WS=sw,
                num_warps=rwarps),
                (t, (h + rblock - 1) // rblock, 1), got, topk_idx, b0, b1, acc if acc is not None else out, out,
                out_w if out_w is not None else out, m, lanes[0], lanes[1], xs, ws, sh, me, r_)
            if plan:
                return PlannedReduce(_planned(call), out, out_w)
            self.launch(*call)
        return out, out_w

    def launched(self, name: str, key: tuple):
        """The ``Direct`` that :meth:`launch` keeps for kernel ``name`` and ``key`` (None before its first call)."""
        return self._go.get((name, key))
