"""``ElasticBuffer``'s combine transport on the nvlink backend (``Backend.return_rows``): rows stored
straight into their owners' symmetric buffers by ``kernels/v2.py``, no host wait, so a CUDA graph captures
it whatever the group (also gloo with ranks sharing a GPU, where the default ``all_to_all_single`` cannot
be captured).

Where (in each rank's symmetric buffer): the second half of the high-throughput region (the V1 combine's
staging, which an ``ElasticBuffer`` does not use): ``free[R]`` and ``data[R]`` flags, then the area
``[R, S, W]`` (block ``r`` from rank ``r``). The area is one region for every call: a rank writes into a
peer's only after that peer announced it finished reading the previous call's (``free``).

What: ``return_rows`` moves rows already packed; ``return_row_parts`` (which ``elastic_engine.combine`` takes
on this backend, found by ``row_parts``) the contiguous combine's ``x`` and ``topk_weights`` read in place,
landing as the same bytes as their packed rows, with no pack pass before the transport.

Letters: ``R`` ranks, ``S`` slots a rank, ``W`` bytes a row, ``P`` programs a rank (the call's ``num_sms``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from .elastic_kernels import Kernels, combine_row_bytes
from .nvlink_params import TIMER, _aligned

PROGRAMS = 16  # programs when num_sms is 0 (every rank passes the same num_sms to a call, as DeepEP asks)
# a program's step: a tile of RB rows x BLOCK int32 words (32 KB in flight, as the V1 combine's push keeps
# 8 rows x 512 words and its gather 16 x 1024; one row of 512 words a step, as before 29a75e2, kept 2 KB in
# flight a program: a DSv3 combine, 8192 rows of 14 KB, took ~5.8 ms at 24 SMs on an H100, V1's ~0.45 ms)
RB = 8
BLOCK = 1024


class TransportDirect(NamedTuple):
    """A transport kind's two bound launches as a ``native.Chain`` takes them (``kernels/launch.Direct``:
    ``Direct.step``) and the transport's grid."""

    impl: Any  # _combine_impl_kernel's Direct: holes rows, wts, dst, n
    arrive: Any  # _combine_arrive_kernel's Direct: no hole
    grid: tuple


class Transport(NamedTuple):
    """The bound launches of one kind of transport call (:func:`_bind`): ``impl(rows, wts, dst, n)``, then
    ``arrive()``; ``area`` the ``_Area`` the rows land in; ``direct`` the same launches for a chain."""

    impl: Callable
    arrive: Callable
    area: Any  # _Area
    direct: TransportDirect


class TransportKind(NamedTuple):
    """A transport call's kind (:func:`row_parts_kind`, :func:`rows_kind`): its launches and the rows it moves
    (0 where none moves: ``skip_self`` at one rank)."""

    go: Transport
    n: int
WARPS = 8


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


class _Area:
    """One call shape's places in the symmetric buffer (made once per ``(slots, W)``): the flags, the
    area as ``uint8[R, S, W]`` and their offsets."""

    def __init__(self, be, slots: int, w: int):
        r_ = be.num_ranks
        self.flags_off = be.ht_off + be.nvl_bytes // 2
        self.area_off = self.flags_off + _align(8 * r_)
        need = self.area_off + r_ * slots * w
        if need > be.ht_off + be.nvl_bytes:
            raise ValueError(f"num_nvl_bytes={be.nvl_bytes} holds no combine area of {r_} x {slots} rows of {w} "
                             f"bytes (needs {2 * (need - self.flags_off)}); make the ElasticBuffer with the MoE shape")
        self.flags = be.symm[self.flags_off:self.flags_off + 8 * r_].view(torch.int32)
        # every row's destination 16-byte aligned: vector stores (the peers' bases are the host's own numbers)
        ptrs = getattr(getattr(be, "hdl", None), "buffer_ptrs", None)
        self.aligned = bool(ptrs) and w % 16 == 0 and all((p + self.area_off) % 16 == 0 for p in ptrs)
        self.area = be.symm[self.area_off:self.area_off + r_ * slots * w].view(r_, slots, w)


def transport_launch(w: int, num_sms: int, aligned: bool, parts: tuple[int, int, int, int] | None = None,
                     skip_self: bool = False) -> tuple[tuple[int, int, int], dict]:
    """``(grid, constexprs)`` of ``_combine_impl_kernel`` for rows of ``w`` bytes: ``num_sms`` programs
    (``PROGRAMS`` when 0), whatever the number of rows: each waits for every peer's program 0 and the arrival counts every
    program of a call (``P``), so the grid is the call's ``num_sms`` and never depends on the rows. ``parts``:
    ``(XW, XS, KW, KS)``, the words of a row read from its two sources and their row strides in words (None:
    rows already packed, ``(w/4, w/4, 0, 0)``). ``skip_self``: rows this rank owns are not stored (the
    reduction reads them in place).

    Example: ``transport_launch(14368, 24, True) == ((24, 1, 1), dict(W=3592, XW=3592, XS=3592, KW=0, KS=0,
    RB=8, BLOCK=1024, ALIGNED=True, HAS_TIMER=TIMER, SKIP_SELF=False, num_warps=8))``; DSv3's ``x`` and
    weights read in place: ``parts=(3584, 3584, 8, 8)``."""
    xw, xs, kw, ks = parts if parts is not None else (w // 4, w // 4, 0, 0)
    return (num_sms or PROGRAMS, 1, 1), dict(W=w // 4, XW=xw, XS=xs, KW=kw, KS=ks, RB=RB, BLOCK=BLOCK,
                                             ALIGNED=aligned, HAS_TIMER=TIMER, SKIP_SELF=skip_self, num_warps=WARPS)


def return_rows(be, rows: torch.Tensor, dst: torch.Tensor, slots: int, phase: str, num_sms: int = 0) -> torch.Tensor:
    """As ``Backend.return_rows``; ``rows uint8[n, W]`` with ``W`` a multiple of 4. The launches are bound
    once per shape (``backends/elastic_kernels.Kernels``): a call costs a few torch calls on the host."""
    be._check_error()
    n, w = rows.shape
    if w % 4:
        raise ValueError(f"return_rows needs rows of a multiple of 4 bytes, got {w}")
    return _transport(be, rows, None, dst, n, w, None, slots, num_sms)


def return_row_parts(be, x: torch.Tensor, wts: torch.Tensor | None, dst: torch.Tensor, slots: int, phase: str,
                     num_sms: int = 0, skip_self: bool = False) -> torch.Tensor | None:
    """``return_rows`` of the rows ``x bf16[n, H]`` and ``wts f32[n, K]`` (or None) side by side, as
    ``elastic_kernels.Kernels.pack`` (mode 0) would make them (``combine_row_bytes(H, K)`` bytes a row: x
    from byte 0, the weights from byte ``2H``, padding unwritten), but read in place by the transport: no
    pass that builds them. None (nothing launched; the caller packs them) unless both move as 16-byte
    vectors, as packed rows do: ``H`` a multiple of 8 and ``K`` of 4, rows contiguous, their strides
    multiples of 16 bytes, both 16-byte aligned (a weight row of 8 bytes, ``K = 2``, would leave the whole
    row's loads 8 bytes wide). ``skip_self``: rows this rank owns are not stored (block ``me`` of the
    result is then unspecified; the caller reads them from ``x`` and ``wts``, as the contiguous combine's
    reduction does: at world 1 nothing moves, with 2 ranks half as much)."""
    be._check_error()
    kind = _row_parts(be, x, wts, slots, num_sms, skip_self)
    return None if kind is None else _launch(kind, x, wts, dst)


def row_parts_kind(be, x: torch.Tensor, wts: torch.Tensor | None, slots: int, num_sms: int = 0,
                   skip_self: bool = False) -> TransportKind | None:
    """The kind of :func:`return_row_parts` call this one is (:class:`TransportKind`: its launches, bound once,
    and the rows it moves), or None where the rows cannot move in place (the checks above). Its
    ``go.direct`` for a ``native.Chain`` of the call (``elastic_chains.combine_chain``)."""
    return _named(_row_parts(be, x, wts, slots, num_sms, skip_self))


def _row_parts(be, x, wts, slots: int, num_sms: int, skip_self: bool):
    """:func:`row_parts_kind` as a plain ``(go, n)`` (a call's: no NamedTuple made per call)."""
    n, h = x.shape
    xs = x.stride()
    if h % 8 or xs[1] != 1 or xs[0] % 8 or x.data_ptr() % 16:
        return None
    k, ws = 0, (0, 1)
    if wts is not None:
        k, ws = wts.shape[1], wts.stride()
        if k % 4 or ws[0] % 4 or ws[1] != 1 or wts.data_ptr() % 16:
            return None
    return _kind(be, x, n, combine_row_bytes(h, k), (h // 2, xs[0] // 2, k, ws[0]), slots, num_sms, skip_self)


def rows_kind(be, rows: torch.Tensor, slots: int, num_sms: int = 0) -> TransportKind | None:
    """The kind of :func:`return_rows` call this one is (as :func:`row_parts_kind`'s), or None where its rows' width is
    not a multiple of 4."""
    n, w = rows.shape
    return None if w % 4 else _named(_kind(be, rows, n, w, None, slots, num_sms, False))


def _named(kind) -> TransportKind | None:
    """A plain ``(go, n)`` of :func:`_kind` with its fields named (None stays None)."""
    return None if kind is None else TransportKind(Transport(*kind[0]), kind[1])


def _transport(be, rows, wts, dst, n: int, w: int, parts, slots: int, num_sms: int,
               skip_self: bool = False) -> torch.Tensor:
    """Launch ``_combine_impl_kernel`` (rows of ``w`` bytes; ``parts`` as :func:`transport_launch`'s) and
    ``_combine_arrive_kernel``; returns the area ``uint8[R, slots, w]``. Each kind of call (the area, the
    parts, the grid, the dtype and alignment of the rows) binds its two launches once, every argument but
    the rows, weights, destinations and their count fixed: a repeat makes no torch call but the alignment."""
    return _launch(_kind(be, rows, n, w, parts, slots, num_sms, skip_self), rows, wts, dst)


def _kind(be, rows, n: int, w: int, parts, slots: int, num_sms: int, skip_self: bool):
    """``(go, n)`` (:class:`TransportKind`'s fields, a plain tuple each: :func:`_named` names them): the bound
    launches of a transport call of this kind (:func:`_bind`) and the rows it moves."""
    st = getattr(be, "_v2", None)
    if st is None:
        st = be._v2 = {"epoch": torch.zeros(2, dtype=torch.int32, device=be.device),  # [calls, programs so far]
                       "kernels": Kernels()}
    if skip_self and be.num_ranks == 1:  # every row is this rank's own: the call keeps its handshake, moves nothing
        n = 0                           # (its row loop took ~75 us of a DSv3 combine on an H100 with no row to move)
    # the alignment of both sources: return_row_parts passes only 16-byte aligned ones; else wts is rows
    aligned = 0 if parts is not None and n else (_aligned(rows) if n else -1)
    timeout = be._timeout_ns
    key = (slots, w, parts, num_sms, skip_self, rows.dtype if n else None, aligned, timeout)
    go = st.get(key)
    if go is None:
        go = st[key] = _bind(be, st, slots, w, parts, num_sms, skip_self, rows.dtype if n else None, aligned,
                             timeout)
    return go, n


def _launch(kind, rows, wts, dst) -> torch.Tensor:
    """The launches of ``kind`` (:func:`_kind`) on ``rows``, ``wts`` (None: ``rows``) and ``dst``; the area."""
    (impl, arrive, area, _), n = kind
    if n:
        impl(rows, wts if wts is not None else rows, dst, n)
    else:  # (placeholders: no row is read)
        impl(area.flags, area.flags, dst, 0)
    arrive()
    return area.area


def _bind(be, st: dict, slots: int, w: int, parts, num_sms: int, skip_self: bool, dtype, aligned: int,
          timeout: int):
    """The :class:`Transport` fields of one kind of transport call (:func:`_kind`), as a plain tuple."""
    area = st.get((slots, w))
    if area is None:
        area = st[(slots, w)] = _Area(be, slots, w)
    r_, epoch, kern = be.num_ranks, st["epoch"], st["kernels"]
    grid, consts = transport_launch(w, num_sms, area.aligned, parts, skip_self)
    if dtype is None:  # (no rows: the placeholders are the flags, int32 and aligned)
        dtype, aligned = area.flags.dtype, _aligned(area.flags)
    impl = kern.bound("_combine_impl_kernel", (w, parts, slots, timeout, dtype, aligned, area.aligned, skip_self),
                      consts, (None, None, None, None, slots, be.ptr_table, area.area_off, area.flags_off,
                               area.flags, epoch, be.rank, r_, be.err, timeout))
    arrive = kern.bound("_combine_arrive_kernel", (timeout,), dict(HAS_TIMER=TIMER, num_warps=1),
                        (area.flags, epoch, r_, grid[0], be.err, timeout))
    # (a plain tuple, which a call unpacks on the fast path; a kind's caller gets it as a Transport: _named)
    return ((lambda rows, wts, dst, n: impl(grid[0], 1, 1, rows, wts, dst, n)), (lambda: arrive(1, 1, 1)), area,
            TransportDirect(impl, arrive, grid))
