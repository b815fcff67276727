"""``ElasticBuffer``'s combine transport on the nvlink backend (``Backend.return_rows``): rows stored
straight into their owners' symmetric buffers by ``kernels/v2.py``, no host wait, so a CUDA graph captures
it whatever the group (also gloo with ranks sharing a GPU, where the default ``all_to_all_single`` cannot
be captured).

Where (in each rank's symmetric buffer): the second half of the high-throughput region (the V1 combine's
staging, which an ``ElasticBuffer`` does not use): ``free[R]`` and ``data[R]`` flags, then the area
``[R, S, W]`` (block ``r`` from rank ``r``). The area is one region for every call: a rank writes into a
peer's only after that peer announced it finished reading the previous call's (``free``).

Letters: ``R`` ranks, ``S`` slots a rank, ``W`` bytes a row, ``P`` programs a rank (the call's ``num_sms``).
"""

from __future__ import annotations

import torch

from .nvlink_params import TIMER, _aligned

PROGRAMS = 16  # programs when num_sms is 0 (every rank passes the same num_sms to a call, as DeepEP asks)
# a program's step: a tile of RB rows x BLOCK int32 words (32 KB in flight, as the V1 combine's push keeps
# 8 rows x 512 words and its gather 16 x 1024; one row of 512 words a step, as before 2026-11-28, kept 2 KB in
# flight a program: a DSv3 combine, 8192 rows of 14 KB, took ~5.8 ms at 24 SMs on an H100, V1's ~0.45 ms)
RB = 8
BLOCK = 1024
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


def transport_launch(w: int, num_sms: int, aligned: bool) -> tuple[tuple[int, int, int], dict]:
    """``(grid, constexprs)`` of ``_combine_impl_kernel`` for rows of ``w`` bytes: ``num_sms`` programs
    (``PROGRAMS`` when 0), whatever the number of rows: each waits for every peer's program 0 and the arrival counts every
    program of a call (``P``), so the grid is the call's ``num_sms`` and never depends on the rows.

    Example: ``transport_launch(14368, 24, True) == ((24, 1, 1), dict(W=3592, RB=8, BLOCK=1024,
    ALIGNED=True, HAS_TIMER=TIMER, num_warps=8))``."""
    return (num_sms or PROGRAMS, 1, 1), dict(W=w // 4, RB=RB, BLOCK=BLOCK, ALIGNED=aligned, HAS_TIMER=TIMER,
                                             num_warps=WARPS)


def return_rows(be, rows: torch.Tensor, dst: torch.Tensor, slots: int, phase: str, num_sms: int = 0) -> torch.Tensor:
    """As ``Backend.return_rows``; ``rows uint8[n, W]`` with ``W`` a multiple of 4. The launches are bound
    once per shape (``backends/elastic_kernels.Kernels``): a call costs a few torch calls on the host."""
    be._check_error()
    n, w = rows.shape
    if w % 4:
        raise ValueError(f"return_rows needs rows of a multiple of 4 bytes, got {w}")
    st = getattr(be, "_v2", None)
    if st is None:
        from .elastic_kernels import Kernels

        st = be._v2 = {"epoch": torch.zeros(2, dtype=torch.int32, device=be.device),  # [calls, programs so far]
                       "kernels": Kernels()}
    area = st.get((slots, w))
    if area is None:
        area = st[(slots, w)] = _Area(be, slots, w)
    r_, epoch, kern = be.num_ranks, st["epoch"], st["kernels"]
    grid, consts = transport_launch(w, num_sms, area.aligned)
    programs = grid[0]
    rows = rows if n else area.flags  # (a placeholder: no row is read)
    kern.launch("_combine_impl_kernel", (w, slots, be._timeout_ns, rows.dtype, _aligned(rows), area.aligned), consts,
                grid, rows, dst, n, slots, be.ptr_table, area.area_off, area.flags_off, area.flags,
                epoch, be.rank, r_, be.err, be._timeout_ns)
    kern.launch("_combine_arrive_kernel", (be._timeout_ns,), dict(HAS_TIMER=TIMER, num_warps=1), (1, 1, 1), area.flags, epoch, r_,
                programs, be.err, be._timeout_ns)
    return area.area
