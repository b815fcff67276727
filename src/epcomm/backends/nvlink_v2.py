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

from .nvlink_params import TIMER

PROGRAMS = 16  # programs when num_sms is 0 (every rank passes the same num_sms to a call, as DeepEP asks)
BLOCK = 512    # int32 words a step


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


def return_rows(be, rows: torch.Tensor, dst: torch.Tensor, slots: int, phase: str, num_sms: int = 0) -> torch.Tensor:
    """As ``Backend.return_rows``; ``rows uint8[n, W]`` with ``W`` a multiple of 4."""
    from ..kernels import v2

    be._check_error()
    r_, w = be.num_ranks, rows.shape[1]
    if w % 4:
        raise ValueError(f"return_rows needs rows of a multiple of 4 bytes, got {w}")
    flags_off = be.ht_off + be.nvl_bytes // 2
    area_off = flags_off + _align(8 * r_)
    need = area_off + r_ * slots * w
    if need > be.ht_off + be.nvl_bytes:
        raise ValueError(f"num_nvl_bytes={be.nvl_bytes} holds no combine area of {r_} x {slots} rows of {w} "
                         f"bytes (needs {2 * (need - flags_off)}); make the ElasticBuffer with the MoE shape")
    epoch = getattr(be, "_v2_epoch", None)
    if epoch is None:
        epoch = be._v2_epoch = torch.zeros(2, dtype=torch.int32, device=be.device)  # [calls, programs so far]
    flags = be.symm[flags_off:flags_off + 8 * r_].view(torch.int32)
    n = rows.shape[0]
    words = rows.contiguous().view(torch.int32) if n else torch.zeros(1, w // 4, dtype=torch.int32,
                                                                      device=rows.device)
    programs = num_sms or PROGRAMS
    v2._combine_impl_kernel[(programs,)](
        words, dst.contiguous(), n, w // 4, slots, be.ptr_table, area_off, flags_off, flags, epoch, be.rank, r_,
        be.err, be._timeout_ns, HAS_TIMER=TIMER, BLOCK=BLOCK, num_warps=4)
    v2._combine_arrive_kernel[(1,)](flags, epoch, r_, programs, be.err, be._timeout_ns, HAS_TIMER=TIMER,
                                    num_warps=1)
    return be.symm[area_off:area_off + r_ * slots * w].view(r_, slots, w)
