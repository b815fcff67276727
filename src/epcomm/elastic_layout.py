"""The layout math of DeepEP V2's ``ElasticBuffer`` in pure torch (any device, no process group).

Letters: ``T`` tokens on this rank, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks,
``LE = E / R`` local experts, ``M`` = ``num_max_tokens_per_rank``, ``N`` received rows of the
contiguous layout (one per distinct received token), ``X`` rows of the expanded layout, ``A`` =
``expert_alignment``.

The two layouts of a dispatch (the contiguous one is the high-throughput dispatch's rows, in source
rank then source token order; the expanded one is derived from it here)::

    R = 2, LE = 2, A = 2; rank 0 receives token a (local experts 0 and 1) and token b (expert 1)
    contiguous rows:  [a, b]          recv_topk_idx = [[0, 1], [-1, 1]] (local ids; -1 elsewhere)
    unaligned counts: [1, 2]          aligned: [2, 2]
    expanded rows:    [a, pad, a, b]  expert 0 at [0, 2), expert 1 at [2, 4)
    psum_num_recv_tokens_per_expert:  contiguous [2, 4] (inclusive sums of aligned counts),
                                      expanded   [1, 4] (aligned start + real count)
    slots (recv_src_metadata[:, 2:]): [[0, 2], [-1, 3]]

Nothing here synchronises with the device: every shape is given by the caller (exact or worst case).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

ALIGNMENT = 2 << 20  # num_bytes and num_cpu_bytes are multiples of 2 MiB, as in DeepEP
MAX_RANKS = 1024
MAX_EXPERTS = 2048
MAX_LOCAL_EXPERTS = 256
MAX_TOPK = 32
NUM_MAX_CHANNELS = 1280  # DeepEP's hybrid channel bound (8 a SM x 160 SMs), used only for sizing


def align(x: int, a: int) -> int:
    """``x`` rounded up to a multiple of ``a``: ``align(5, 4) == 8``."""
    return (x + a - 1) // a * a


def dispatch_token_bytes(hidden: int, num_topk: int, use_fp8: bool) -> int:
    """Bytes of one dispatched token record in DeepEP's buffer: payload, 4-byte scale packs
    (``ceil(H/32)`` with FP8), then top-k ids, weights, the source index and top-k slots, each part
    padded to 32 bytes. Example: ``H = 7168, K = 8``, BF16 -> ``14336 + 0 + 128 = 14464``."""
    k = num_topk or MAX_TOPK
    payload = hidden * (1 if use_fp8 else 2)
    sf = (hidden + 31) // 32 * 4 if use_fp8 else 0
    return align(payload, 32) + align(sf, 32) + align(4 * (3 * k + 1), 32)


def combine_token_bytes(hidden: int, num_topk: int) -> int:
    """Bytes of one combined token record (BF16 payload, then top-k ids and weights):
    ``H = 7168, K = 8`` -> ``14336 + 64 = 14400``."""
    k = num_topk or MAX_TOPK
    return align(hidden * 2, 32) + align(8 * k, 32)


def buffer_bytes(num_ranks: int, num_nvl_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int,
                 use_fp8: bool, num_scaleout_ranks: int, allow_multiple_reduction: bool) -> int:
    """DeepEP's ``calculate_elastic_buffer_size``: the larger of the dispatch and combine areas, 2 MiB-aligned.

    Examples (``M = 4096, H = 7168, K = 8``, BF16): EP8 on one node -> 473,956,352; EP16 as 2 x 8 with
    hybrid mode -> 1,218,445,312 (the figures DeepEP prints with ``EP_BUFFER_DEBUG``)."""
    r, m, k = num_ranks, num_max_tokens_per_rank, num_topk or MAX_TOPK
    td = dispatch_token_bytes(hidden, num_topk, use_fp8)
    tc = combine_token_bytes(hidden, num_topk)
    multi = allow_multiple_reduction
    if num_scaleout_ranks <= 1:
        nvlink = num_nvl_ranks >= r
        lanes = min(r, k) if multi else k
        dispatch = (0 if nvlink else m * td) + r * m * td
        combine = (0 if nvlink else r * m * (1 if multi else k) * tc) + lanes * m * tc
    else:
        so, su, c = num_scaleout_ranks, r // num_scaleout_ranks, NUM_MAX_CHANNELS
        dispatch = su * so * m * td + m * td + so * (m + c) * td
        combine = ((min(su, k) if multi else k) * so * m * tc + (min(so, k) if multi else k) * m * tc
                   + (1 if multi else k) * so * (m + c) * tc)
    return align(max(dispatch, combine), ALIGNMENT)


def worst_expanded_rows(num_ranks: int, num_max_tokens_per_rank: int, num_topk: int, num_local_experts: int,
                        expert_alignment: int) -> int:
    """Rows of an expanded dispatch without CPU sync: ``align(R*M*min(K, LE) + (A-1)*LE, A)``.
    Example: EP8, ``M = 4096, K = 8, LE = 32, A = 128`` -> 266,240."""
    a = expert_alignment
    return align(num_ranks * num_max_tokens_per_rank * min(num_topk, num_local_experts)
                 + (a - 1) * num_local_experts, a)


def expected_ranks_per_token(num_experts: int, num_topk: int, num_groups: int) -> float:
    """Expected number of distinct groups (of ``E / groups`` experts each) a token's ``K`` distinct experts
    fall in, for a balanced gate: ``g * (1 - C(E - E/g, K) / C(E, K))``. Example: ``E = 256, K = 8, g = 8``
    -> about 5.2."""
    e, g = num_experts, num_groups
    return g * (1 - math.comb(e - e // g, num_topk) / math.comb(e, num_topk))


def theoretical_num_sms(num_ranks: int, num_experts: int, num_topk: int, device_sms: int,
                        prefer_overlap_with_compute: bool, nvlink_gbs: float, sm_read_gbs: float = 200,
                        sm_write_gbs: float = 50) -> int:
    """SMs the copy kernels need to keep the link busy, from the traffic per token a rank sends (one node,
    every peer written over NVLink, as epcomm's kernels do): per token read once (``1/topk_ranks`` of a
    received row), written once per destination; the link carries the non-local share. Then x1.25,
    even, at least 4; at least 64 when ``prefer_overlap_with_compute`` is off; at most the device's SMs.
    One rank: every SM (nothing crosses a link). Example: ``R = 8, E = 256, K = 8``, 450 GB/s ->
    ``ceil(450 / 0.875 * 1 / 50 * 1.25) = 13`` -> 14."""
    if num_ranks <= 1:
        return device_sms
    topk_ranks = expected_ranks_per_token(num_experts, num_topk, num_ranks)
    sm_read = 1 / topk_ranks
    sm_write = 1.0
    traffic = 1 - 1 / num_ranks
    sms = max(nvlink_gbs / traffic * sm_read / sm_read_gbs, nvlink_gbs / traffic * sm_write / sm_write_gbs)
    sms = align(max(4, math.ceil(sms * 1.25)), 2)
    if not prefer_overlap_with_compute:
        sms = max(sms, 64)
    return min(sms, device_sms)


def theoretical_num_qps(num_sms: int, hybrid: bool, num_allocated_qps: int) -> int:
    """DeepEP's QP rule: ``min(num_sms, 9)`` in direct mode, ``16 * num_sms + 1`` in hybrid mode, capped by
    the allocated QPs: ``theoretical_num_qps(24, False, 17) == 9``."""
    q = num_sms * 16 + 1 if hybrid else min(num_sms, 9)
    return min(q, num_allocated_qps)


# ----------------------------------------------------------------------------- dispatch epilogue


class ExpandedLayout(NamedTuple):
    """Where the rows of a dispatch land (``N`` contiguous rows, ``X`` expanded rows):

    - ``counts int32[LE]``: real (unaligned) rows per local expert.
    - ``psum_contiguous int32[LE]``: inclusive prefix sum of the aligned counts.
    - ``psum_expanded int32[LE]``: aligned start of each expert plus its real count.
    - ``slots int32[N, K]``: the expanded row of each (row, lane), ``-1`` for a lane not on this rank.
    - ``source int64[X]``: ``row * K + lane`` that fills each expanded row, ``-1`` for padding.
    """

    counts: torch.Tensor
    psum_contiguous: torch.Tensor
    psum_expanded: torch.Tensor
    slots: torch.Tensor
    source: torch.Tensor


def expanded_layout(local_idx: torch.Tensor, num_local_experts: int, expert_alignment: int,
                    num_expanded_rows: int) -> ExpandedLayout:
    """The expanded layout of the contiguous rows' local expert ids ``local_idx int64[N, K]`` (``-1``: not
    here; ids of one row distinct). Inside an expert segment rows keep the contiguous order (source rank,
    then source token), so the order depends only on the routing.

    Example (``LE = 2, A = 2``): ``local_idx = [[0, 1], [-1, 1]]`` -> counts ``[1, 2]``, psum_contiguous
    ``[2, 4]``, psum_expanded ``[1, 4]``, slots ``[[0, 2], [-1, 3]]``, source ``[0, -1, 1, 3]`` (with
    ``X = 4``)."""
    n, k = local_idx.shape
    le, dev = num_local_experts, local_idx.device
    valid = local_idx >= 0
    ids = torch.where(valid, local_idx, torch.full_like(local_idx, le))  # le: a spill column
    onehot = torch.zeros(n, le + 1, dtype=torch.int32, device=dev)
    onehot.scatter_(1, ids, 1)
    onehot = onehot[:, :le]
    counts = onehot.sum(0, dtype=torch.int32)
    aligned = (counts + expert_alignment - 1) // expert_alignment * expert_alignment
    psum = torch.cumsum(aligned, 0, dtype=torch.int32)
    start = psum - aligned
    rank_in_expert = torch.cumsum(onehot, 0, dtype=torch.int32) - onehot  # rows before, same expert
    pos = torch.gather(rank_in_expert, 1, ids.clamp(max=le - 1)) + start[ids.clamp(max=le - 1)]
    slots = torch.where(valid, pos, torch.full_like(pos, -1)).to(torch.int32)
    if num_expanded_rows == 0:
        return ExpandedLayout(counts, psum, start + counts, slots, torch.empty(0, dtype=torch.int64, device=dev))
    source = torch.full((num_expanded_rows + 1,), -1, dtype=torch.int64, device=dev)
    flat = slots.reshape(-1).to(torch.int64)
    source.index_copy_(0, torch.where(flat >= 0, flat, torch.full_like(flat, num_expanded_rows)),
                       torch.arange(n * k, dtype=torch.int64, device=dev))
    source = source[:num_expanded_rows]  # the spill row (index X) took every -1 lane
    return ExpandedLayout(counts, psum, start + counts, slots, source)


class RecvMeta(NamedTuple):
    """What a dispatch derives from the backend's rows (``N`` rows, ``X`` expanded rows), for its handle,
    its outputs and its combine:

    - ``psum_rank int32[R]``: rows from source ranks ``0..r`` (``rank_prefix_matrix[:, me]``).
    - ``gid int64[N]``: ``src_rank * M + src_token``, ``-1`` for padding rows.
    - ``local int64[N, K]``: local expert ids, ``-1`` for lanes elsewhere and on padding rows;
      ``local_out``: a copy (the contiguous layout's ``recv_topk_idx``), None when expanded.
    - ``meta int32[N, K+2]``: ``recv_src_metadata`` (``[gid, src_rank * K + highest local lane, slots]``).
    - ``counts int32[LE]``: real rows per local expert; ``psum int32[LE]``: the handle's prefix sums
      (contiguous: inclusive sums of the aligned counts; expanded: aligned start + count).
    - ``source int64[X]``: expanded only, ``row * K + lane`` filling each expanded row, ``-1`` padding.
    - ``dst_slot int32[T, K]``: ``dst_buffer_slot_idx`` (``rank * M + row`` where each lane landed).
    - ``topk``: a copy of ``topk_idx`` (the handle's, ``do_handle_copy``), or None where none was asked for.
    """

    psum_rank: torch.Tensor
    gid: torch.Tensor
    local: torch.Tensor
    local_out: torch.Tensor | None
    meta: torch.Tensor
    counts: torch.Tensor
    psum: torch.Tensor
    source: torch.Tensor
    dst_slot: torch.Tensor
    topk: torch.Tensor | None = None


def recv_meta(rank_prefix_matrix: torch.Tensor, rank: int, recv_src_idx: torch.Tensor, recv_local: torch.Tensor,
              send_head: torch.Tensor, topk_idx: torch.Tensor, num_max_tokens_per_rank: int, num_local_experts: int,
              expert_alignment: int, num_expanded_rows: int, expand: bool,
              cum_stats: torch.Tensor | None = None, copy_topk: bool = False) -> RecvMeta:
    """:class:`RecvMeta` of a dispatch from the backend's handle (``rank_prefix_matrix int32[R, R]``,
    ``recv_src_idx int32[N]``, ``send_head int32[T, R]``), its rows' local ids ``recv_local int64[N, K]``
    (rows past ``rank_prefix_matrix[-1, rank]`` are padding) and this rank's ``topk_idx int64[T, K]``;
    ``cum_stats int32[LE]`` gains the counts; ``copy_topk``: with a copy of ``topk_idx``.
    ``backends.elastic_kernels.Kernels.recv_meta`` computes the same.

    Example (``R = 2, M = 4, LE = 2, K = 2``, rank 1, ``rank_prefix_matrix[:, 1] = [1, 3]``,
    ``recv_src_idx = [2, 0, 3, *]``, ``recv_local = [[0, -1], [1, 0], [-1, 1], *]``): gid ``[2, 4, 7, -1]``,
    meta column 1 ``[0, 3, 3, -1]``, counts ``[2, 2]``."""
    n, k = recv_local.shape
    dev, m, le = recv_local.device, num_max_tokens_per_rank, num_local_experts
    psum_rank = rank_prefix_matrix[:, rank].to(torch.int32).contiguous()
    rows = torch.arange(n, device=dev)
    src_rank = torch.searchsorted(psum_rank.to(torch.int64), rows, right=True)
    valid_row = rows < psum_rank[-1].to(torch.int64)
    gid = torch.where(valid_row, src_rank * m + recv_src_idx.to(torch.int64), torch.full_like(rows, -1))
    local = torch.where(valid_row.unsqueeze(1), recv_local, torch.full_like(recv_local, -1))
    lay = expanded_layout(local, le, expert_alignment, num_expanded_rows if expand else 0)
    if cum_stats is not None:
        cum_stats += lay.counts
    lane = torch.arange(k, device=dev)
    master = torch.where(local >= 0, lane, torch.full_like(local, -1)).max(1).values if k else rows * 0
    meta = torch.full((n, k + 2), -1, dtype=torch.int32, device=dev)
    meta[:, 0] = gid.to(torch.int32)
    meta[:, 1] = torch.where(valid_row & (master >= 0), src_rank * k + master, torch.full_like(rows, -1))
    if expand:
        meta[:, 2:] = lay.slots
    d = torch.where(topk_idx >= 0, topk_idx // le, torch.zeros_like(topk_idx))
    row_there = send_head.to(torch.int64).gather(1, d)
    dst_slot = torch.where(topk_idx >= 0, d * m + row_there, torch.full_like(d, -1)).to(torch.int32)
    return RecvMeta(psum_rank, gid, local, None if expand else local.clone(), meta, lay.counts,
                    lay.psum_expanded if expand else lay.psum_contiguous, lay.source, dst_slot,
                    topk_idx.clone() if copy_topk else None)


class Rows(NamedTuple):
    """One part of the contiguous rows: ``tensor`` (``[N, ...]``, any dtype), the part's first byte in a
    row (``offset``) and the bytes from one row to the next (``stride``): a part of its own is
    ``Rows(t, 0, row bytes)``; packed parts share one tensor at different offsets."""

    tensor: torch.Tensor
    offset: int
    stride: int


def _part(r: Rows, nbytes: int) -> torch.Tensor:
    """``uint8[N, nbytes]``: the bytes of part ``r``."""
    return r.tensor.view(torch.uint8).reshape(-1, r.stride)[:, r.offset:r.offset + nbytes]


def gather_rows(t: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``t[rows]`` (any dtype, FP8 through bytes); rows where ``keep`` is False become zero bytes."""
    raw = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    out = raw[rows]
    if keep is not None:
        out = torch.where(keep.view(-1, *([1] * (out.dim() - 1))), out, torch.zeros((), dtype=out.dtype,
                                                                                       device=out.device))
    return out.view(t.dtype) if t.dtype == torch.float8_e4m3fn else out


def sf_layout(sf: torch.Tensor | None, tma: bool) -> torch.Tensor | None:
    """``sf [rows, P]`` row-major, or (``tma``) column-major with a 4-row aligned column stride."""
    if sf is None or not tma:
        return sf
    rows, p = sf.shape
    out = torch.empty_strided((rows, p), (1, align(max(rows, 1), 4)), dtype=sf.dtype, device=sf.device)
    out.copy_(sf)
    return out


def expand_rows(source: torch.Tensor, k: int, zero_pad: bool, x: Rows, x_dtype: torch.dtype, h: int,
                sf: Rows | None, sf_dtype, p: int, tma_sf: bool, w: Rows | None):
    """The expanded layout's rows: ``(x [X, H], sf [X, P] or None, weights f32[X] or None)``; expanded row
    ``e`` holds contiguous row ``source[e] // K`` (weight: its lane ``source[e] % K``). Padding rows
    (``source < 0``) are zero with ``zero_pad``, else unspecified (here: row 0's bytes; the kernel,
    ``backends.elastic_kernels.Kernels.copy_epilogue``, leaves them unwritten)."""
    keep = (source >= 0) if zero_pad else None
    row = source.clamp(min=0) // max(k, 1)
    ex = gather_rows(_part(x, h * x_dtype.itemsize), row, keep).view(x_dtype)
    esf = ew = None
    if sf is not None:
        esf = sf_layout(gather_rows(_part(sf, 4 * p), row, keep).view(sf_dtype), tma_sf)
    if w is not None:
        ew = gather_rows(_part(w, 4 * k).contiguous().view(torch.float32).reshape(-1), source.clamp(min=0), keep)
    return ex, esf, ew


def master_lanes(topk_idx: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """``bool[T, K]``: lane ``j`` is the master of its rank (the highest lane whose expert sits on the same
    rank); the reduction adds each rank's partial at its master lane. Example (``LE = 2``):
    ``[[0, 3, 1, -1]]`` -> ``[[False, True, True, False]]`` (rank 0: lanes 0 and 2, master 2; rank 1: 1)."""
    k = topk_idx.shape[1]
    valid = topk_idx >= 0
    rank = torch.where(valid, topk_idx // num_local_experts, torch.full_like(topk_idx, -1))
    later_same = torch.zeros_like(valid)
    for j in range(k - 1):
        later_same[:, j] = (rank[:, j + 1:] == rank[:, j:j + 1]).any(1)
    return valid & ~later_same


def ordered_reduce(lanes, num_topk: int, bias: tuple[torch.Tensor, ...], shape: tuple[int, int],
                   device) -> torch.Tensor:
    """One float32 accumulation in lane order, rounded to BF16 once: ``acc = bias0 + bias1`` (or zeros),
    then ``acc += lanes(j)`` for ``j = 0 .. K-1`` (``lanes(j)``: ``bf16[T, H]``, zero where lane ``j``
    contributes nothing). Adding a zero row is exact, so the order of the non-zero terms is the order."""
    if len(bias) == 2:
        acc = bias[0].float() + bias[1].float()
    elif len(bias) == 1:
        acc = bias[0].float()
    else:
        acc = torch.zeros(shape, dtype=torch.float32, device=device)
    for j in range(num_topk):
        acc += lanes(j).float()
    return acc.to(torch.bfloat16)


def local_reduce(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The expert rank's first reduction stage of an expanded combine: per contiguous row, its expanded rows
    ``x bf16[X, H]`` at ``slots int32[N, K]`` summed in lane order in float32 from zero, rounded once ->
    ``bf16[N, H]``."""
    n, k = slots.shape
    acc = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
    for j in range(k):
        s = slots[:, j].to(torch.int64)
        rows = x[s.clamp(min=0)]
        acc += torch.where((s >= 0).unsqueeze(1), rows, torch.zeros_like(rows)).float()
    return acc.to(torch.bfloat16)


# ----------------------------------------------------------------------------- payload as bytes


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[T, ...]`` -> ``uint8[T, row bytes]`` (copies only what is not contiguous)."""
    rows = t.shape[0]
    cols = math.prod(t.shape[1:]) * t.element_size()
    if t.numel() == 0:
        return torch.empty(rows, cols, dtype=torch.uint8, device=t.device)
    return t.contiguous().view(torch.uint8).reshape(rows, cols)


def pack_rows(parts: list[torch.Tensor], multiple: int = 16) -> torch.Tensor:
    """The parts' rows side by side as bytes, padded to ``multiple`` bytes: ``uint8[T, W]``."""
    b = [as_bytes(p) for p in parts]
    width = sum(x.shape[1] for x in b)
    pad = align(width, multiple) - width
    if pad:
        b.append(torch.zeros(b[0].shape[0], pad, dtype=torch.uint8, device=b[0].device))
    return torch.cat(b, 1)


def unpack_rows(buf: torch.Tensor, specs: list[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """Inverse of :func:`pack_rows`: ``specs`` = ``(dtype, elements a row)`` of each part."""
    out, col = [], 0
    rows = buf.shape[0]
    for dtype, n in specs:
        w = n * dtype.itemsize
        part = torch.empty(rows, w, dtype=torch.uint8, device=buf.device)
        part.copy_(buf[:, col:col + w])
        out.append(part.view(dtype) if rows and w else torch.empty(rows, n, dtype=dtype, device=buf.device))
        col += w
    return out


def staging_bytes(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int) -> int:
    """Bytes of the high-throughput staging (``Buffer``'s ``num_nvl_bytes``) an ``ElasticBuffer`` gives its
    engine: a dispatch half and a combine half, each ``R`` slots of ``M`` records of the widest payload
    (BF16; an FP8 row with up to ``ceil(H/32)`` packs is narrower), float32-per-128 scales and top-k ids and
    weights; 2 MiB-aligned. Example: ``R = 2, M = 64, H = 256, K = 4`` -> 2 MiB."""
    k = num_topk or MAX_TOPK
    record = 2 * hidden + 4 * ((hidden + 127) // 128) + 12 * k
    return align(2 * num_ranks * (num_max_tokens_per_rank * record + 256), ALIGNMENT)
