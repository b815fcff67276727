"""What a checked call moved between ranks, so that a check can say it exercised the peers and not
only this rank's own rows (a dispatch that keeps every row local passes any comparison with the
reference, and proves nothing about the transport). Used by ``gpu_cases``' summaries.

Letters: ``R`` ranks, ``L`` local experts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Stress(NamedTuple):
    """What a stress loop (``gpu_cases.check_*_stress``) did."""

    iters: int          # dispatch + combine pairs run
    checked: int        # of which compared with the reference
    remote_rows: int    # rows received from other ranks, over all iterations
    seconds: float


def ll_remote_rows(layout_range: torch.Tensor, rank: int) -> torch.Tensor:
    """Rows a low-latency dispatch delivered to ``rank`` from the other ranks (0-d int64, on the device):
    ``layout_range int64[L, R]`` holds ``(begin << 32) | count`` per (local expert, source rank).

    Example: ``R = 2``, ``L = 2``, rank 0, counts ``[[3, 2], [1, 0]]`` (expert 0: 3 rows from rank 0, 2
    from rank 1; expert 1: 1 from rank 0): 2 remote rows."""
    counts = layout_range & 0xFFFFFFFF
    return counts.sum() - counts[:, rank].sum()


def ht_remote_rows(rank_prefix_matrix: torch.Tensor, rank: int) -> torch.Tensor:
    """Rows a high-throughput dispatch delivered to ``rank`` from the other ranks (0-d, on the device):
    ``rank_prefix_matrix int32[R, R]``, where ``[i, j]`` counts the rows ranks ``0..i`` send to ``j``.

    Example: ``R = 3``, rank 1, column 1 ``[4, 9, 10]``: 4 rows from rank 0, 5 from itself, 1 from
    rank 2: 5 remote rows."""
    col = rank_prefix_matrix[:, rank].long()
    own = col[rank] - (col[rank - 1] if rank else 0)
    return col[-1] - own
