"""Sizes and offsets of the internode backend's high-throughput region (``internode_ht``): the counter
words, the dispatch and combine areas of each parity, the row strides, and how a launch's programs split
between its roles. Pure arithmetic, no CUDA.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``R`` ranks, ``N`` ranks per node, ``P = R/N`` nodes,
``TM`` the most tokens any rank dispatches.
"""

from __future__ import annotations


def _align(n: int, a: int = 128) -> int:
    return (n + a - 1) // a * a


def roles(programs: int, weights: list[int]) -> list[tuple[int, int]]:
    """``(first program, programs)`` of each role of a launch of ``programs`` (weight 0: the role has no
    work here and gets none), in role order and disjoint, split by the weights, each at least one; with
    fewer programs than roles, role ``k`` takes program ``min(k, programs - 1)`` (the last program does the
    rest after its own: a program never waits on a later one of its launch).
    Example: ``roles(24, [1, 1, 0]) -> [(0, 12), (12, 12), (0, 0)]``; ``roles(2, [1, 1, 1]) -> [(0, 1),
    (1, 1), (1, 1)]``."""
    live = [k for k, w in enumerate(weights) if w > 0]
    out = [(0, 0)] * len(weights)
    if programs < len(live):
        for n, k in enumerate(live):
            out[k] = (min(n, programs - 1), 1)
        return out
    total, start = sum(weights[k] for k in live), 0
    for n, k in enumerate(live):
        left = len(live) - n - 1
        take = programs - start if not left else max(1, min(programs - start - left,
                                                            round(programs * weights[k] / total)))
        out[k] = (start, take)
        start += take
    return out


def _counter_bytes(r_: int, n_: int) -> int:
    """The counter region: ``ctr_words`` uint64 words, for up to ``C_MAX`` channels."""
    from ..kernels.internode_ht import ctr_words
    from .nvlink_params import C_MAX

    return _align(ctr_words(r_, n_, C_MAX)[-1] * 8)


def _pad4(words: int) -> int:
    """A row stride: ``words`` rounded up to 16 bytes (``kernels/internode_ht_rows.pad4``)."""
    return (words + 3) // 4 * 4


def _dispatch_areas(tm: int, w: int, r_: int, n_: int) -> tuple[int, int, int]:
    """Offsets in a dispatch area (relative to its start) of the RDMA slots and the NVL slots, and the
    bytes it needs (words: ``w`` a row, messages ``w`` plus a position per rank of a node of more than
    one, each stride padded to 16 bytes): staging, one slot per other node, then the RDMA slots, as many,
    then one NVL slot per source whose relay is another rank of the node."""
    p_ = r_ // n_
    mw = _pad4(w + (n_ if n_ > 1 else 0))
    rdma = _align((p_ - 1) * tm * mw * 4)
    nvl = rdma + _align((p_ - 1) * tm * mw * 4)
    return rdma, nvl, nvl + p_ * (n_ - 1) * tm * _pad4(w) * 4


def _combine_areas(tm: int, cw: int, fw: int, n_: int, p_: int) -> tuple[int, int, int]:
    """Offsets in a combine area of the relay's staging and the final partials, and the bytes it
    needs (words): a relay slot of ``[tm, cw]`` per (source node, other rank of the node), then
    ``[tm, fw]`` per other node twice (staging, final), plus one final slot for this node's own partials
    in nodes of more than one rank."""
    stage = _align(p_ * (n_ - 1) * tm * cw * 4)
    fin = stage + _align((p_ - 1) * tm * fw * 4)
    return stage, fin, fin + (p_ - 1 + (n_ > 1)) * tm * fw * 4


def _combine_words(h: int, k: int, n_: int) -> tuple[int, int]:
    """Words of a combine's relay row (BF16 ``x``, ``k`` weights) and of its partial sum: float32 (``h``
    words, the weights), or the relay row itself in nodes of one rank (a sum of one row, sent as BF16);
    strides padded to 16 bytes."""
    cw = _pad4((2 * h + 3) // 4 + k)
    return cw, cw if n_ == 1 else _pad4(h + k)


def high_throughput_bytes(num_tokens: int, hidden: int, num_topk: int, num_ranks: int, ranks_per_node: int,
                          round_mib: bool = True) -> int:
    """The high-throughput buffer (``num_nvl_bytes``, plus ``num_rdma_bytes`` outside low-latency
    mode) this path needs for batches of up to ``num_tokens`` per rank: the counters, then four areas
    (dispatch and combine, two parities each), each the larger of a BF16 dispatch with top-k and a
    combine. Rounded up to MiB unless ``round_mib`` is false.
    Example: 4096 tokens of 7168 with top-8 at 2 ranks in nodes of 1 -> 452 MiB (four areas of the
    dispatch's messages, 3609 words padded to 3612, the larger part; the combine's rows are 3592)."""
    r_, n_ = num_ranks, ranks_per_node
    p_, tm = r_ // n_, max(1, num_tokens)
    w = (2 * hidden + 12 * num_topk + 4 + 3) // 4  # x, topk_idx (int64), weights, token index
    dispatch = _dispatch_areas(tm, w, r_, n_)[2]
    combine = _combine_areas(tm, *_combine_words(hidden, num_topk, n_), n_, p_)[2]
    need = 4 * max(dispatch, combine) + _counter_bytes(r_, n_)
    return (need + (1 << 20) - 1) >> 20 << 20 if round_mib else need
