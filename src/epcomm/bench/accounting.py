"""Byte accounting for benchmark rows, two ways, always labelled.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``G = ceil(H/128)``.

- **logical** (DeepEP's convention, as its own tests count, the ``logical_*`` fields). High-throughput
  dispatch: the rows a rank receives, its own included, one per (token, destination rank) (FP8: the
  scales too); high-throughput combine: the same rows travelling back (DeepEP counts combine bytes as
  dispatch's received bytes). Low-latency: per valid (token, expert) selection of this rank's
  tokens, one FP8 message of ``H + 4*G + 16`` bytes on dispatch (DeepEP adds 16 bytes of metadata
  per message) and one BF16 row on combine.
- **link** (the ``link_*`` fields): the bytes other ranks write into this rank during the call, as
  the backend that was timed lays them out (``link_counting`` names the rule; :data:`COUNTINGS`).
  The few words per call and rank pair (headers, counters, flags, count exchanges) are left out;
  everything per token is in: rows, scales, top-k ids and weights, messages to ranks that need
  only the ids.

Per-row sizes: BF16 ``2*H`` bytes; FP8 ``H + 4*G`` (data plus float32 scales).

Example (R = 2, me = 0, H = 128, K = 2, E = 4: experts 0-1 on rank 0, 2-3 on rank 1). Rank 1 has two
tokens, ``topk_idx = [[2, 3], [0, 1]]``: token 1 selects two experts of rank 0, token 0 none. An
FP8 row is 128 + 4 = 132 bytes.

- logical LL dispatch of rank 1: its 4 selections x (132 + 16) = 592 B;
- link, nvlink LL (``ll-rank-messages``) into rank 0 from rank 1: the ids of both tokens (2 x 128 B:
  every rank gets every token's ids) and token 1's row once (132 B) = 388 B; one row per selection
  would say 2 x 132 = 264 B;
- link, reference LL (``ll-reference-rows``) into rank 0: 2 selections x (132 + 4 B token index) = 272 B.
"""

from __future__ import annotations

import dataclasses

import torch

from ..layout import LL_MAX_TOPK

# DeepEP's low-latency test counts each FP8 message as its row plus 16 bytes
DEEPEP_LL_MESSAGE_EXTRA = 16
# kernels/ll.py: dispatch sends a token's ids (LL_MAX_TOPK int32) to every rank; combine's owner sends
# its (expert id int32, weight float32) pairs to every rank; partial sums come back in float32
LL_IDS_BYTES = LL_MAX_TOPK * 4
LL_WEIGHTS_BYTES = LL_MAX_TOPK * 8

COUNTINGS = {
    "ll-rank-messages": "kernels/ll.py: dispatch, per token, its ids (128 B) to every other rank and its "
                        "row once to each rank holding one of its experts; combine, per token, its "
                        "(id, weight) pairs (256 B) to every other rank and one float32 partial sum "
                        "(4*H B) back from each other rank holding one of its experts",
    "ll-reference-rows": "reference LL: one row per (token, expert) selection (+ a 4 B token index on "
                         "dispatch), BF16 rows back per selection on combine",
    "per-selection": "torch.distributed all-to-all (the peer baseline): one row per (token, expert) "
                     "selection both ways",
    "ht-whole-batch": "nvlink HT through the copy engine (eager calls with EPCOMM_HT_TRANSFER=ce): the whole batch (rows, scales, "
                      "top-k ids and weights) to every other rank; combine: each received row back once",
    "ht-rank-rows": "nvlink HT through SM pushes (the default, and every graph replay): each row (with "
                    "scales, top-k ids and weights) once per destination rank; combine: each received "
                    "row back once",
    "ht-reference-rows": "reference HT: each packed row (x, scales, top-k ids and weights, a 4 B token "
                         "index) once per destination rank; combine: each received row back once",
}


def row_bytes(hidden: int, dtype: str) -> int:
    """Bytes of one token row: ``bf16`` → ``2*H``; ``fp8`` → ``H`` data + ``4*ceil(H/128)`` scales.
    ``"<dtype>-worst"`` (a padded dispatch) moves the rows of ``<dtype>``."""
    dtype = dtype.split("-")[0]
    if dtype == "bf16":
        return 2 * hidden
    if dtype == "fp8":
        return hidden + 4 * ((hidden + 127) // 128)
    raise ValueError(f"dtype must be 'bf16' or 'fp8', got {dtype!r}")


@dataclasses.dataclass(frozen=True)
class Routing:
    """Who sends to whom in one input set, every rank's routing gathered (row = source rank ``i``).

    ``tokens int64[R]``: tokens of rank ``i``; ``token_ranks int64[R, R]``: tokens of rank ``i`` with at
    least one expert on rank ``j`` (high-throughput's ``num_tokens_per_rank``); ``selections
    int64[R, R]``: valid (token, expert) pairs of rank ``i`` whose expert is on rank ``j``."""

    tokens: torch.Tensor
    token_ranks: torch.Tensor
    selections: torch.Tensor

    @classmethod
    def from_rows(cls, rows: torch.Tensor) -> Routing:
        """From the gathered :func:`local_routing` rows ``int64[R, 1 + 2R]``."""
        rows = rows.to(torch.int64).cpu()
        r_ = rows.shape[0]
        if rows.shape[1] != 1 + 2 * r_:
            raise ValueError(f"routing rows must be [R, 1 + 2R], got {tuple(rows.shape)}")
        return cls(rows[:, 0], rows[:, 1:1 + r_], rows[:, 1 + r_:])


def local_routing(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """This rank's row of a :class:`Routing`: ``int64[1 + 2R]`` = ``[T, token_ranks[R], selections[R]]``
    from ``topk_idx int64[T, K]`` (``-1``: no expert), on ``topk_idx``'s device."""
    local = num_experts // num_ranks
    valid = topk_idx >= 0
    owner = torch.where(valid, topk_idx.div(local, rounding_mode="floor"), num_ranks)
    hit = torch.zeros(topk_idx.shape[0], num_ranks + 1, dtype=torch.int64, device=topk_idx.device)
    hit.scatter_add_(1, owner.to(torch.int64), torch.ones_like(owner, dtype=torch.int64))
    hit = hit[:, :num_ranks]
    t = torch.tensor([topk_idx.shape[0]], dtype=torch.int64, device=topk_idx.device)
    return torch.cat([t, (hit > 0).sum(0), hit.sum(0)])


def logical_bytes(mode: str, op: str, dtype: str, rt: Routing, me: int, hidden: int) -> int:
    """Rank ``me``'s bytes in DeepEP's convention (the module docstring)."""
    if mode == "ht":
        rows = int(rt.token_ranks[:, me].sum())
        return rows * row_bytes(hidden, dtype if op == "dispatch" else "bf16")
    selections = int(rt.selections[me].sum())
    if op == "dispatch":
        extra = DEEPEP_LL_MESSAGE_EXTRA if dtype.split("-")[0] == "fp8" else 0
        return selections * (row_bytes(hidden, dtype) + extra)
    return selections * row_bytes(hidden, "bf16")


def link_counting(backend: str, mode: str, *, graph: bool = False, ht_transfer: str = "sm") -> str | None:
    """The :data:`COUNTINGS` rule for a row of ``backend`` (``"nccl-a2a"``/``"gloo-a2a"``: the peer),
    or ``None`` where no rule is written down (the internode backend's high-throughput path).
    ``graph``: timed as CUDA-graph replays; ``ht_transfer``: ``EPCOMM_HT_TRANSFER`` (ce, sm)."""
    if backend.endswith("-a2a"):
        return "per-selection"
    if backend == "reference":
        return "ht-reference-rows" if mode == "ht" else "ll-reference-rows"
    if mode == "ll" and backend in ("nvlink", "internode"):
        return "ll-rank-messages"
    if mode == "ht" and backend == "nvlink":
        copy_engine = ht_transfer == "ce" and not graph
        return "ht-whole-batch" if copy_engine else "ht-rank-rows"
    return None


def link_bytes(counting: str, op: str, dtype: str, rt: Routing, me: int, hidden: int, topk: int,
               cached: bool = False) -> int:
    """Bytes other ranks write into rank ``me`` during one call, by the rule ``counting``.

    ``topk``: K (high-throughput dispatch rows carry ``K`` int64 ids and ``K`` float32 weights unless
    ``cached``); combines are timed without weights."""
    if counting not in COUNTINGS:
        raise ValueError(f"counting must be one of {sorted(COUNTINGS)}, got {counting!r}")
    others = [i for i in range(rt.tokens.shape[0]) if i != me]

    def inbound(per_source) -> int:
        return sum(int(per_source(i)) for i in others)

    dispatch = op == "dispatch"
    row = row_bytes(hidden, dtype if dispatch else "bf16")
    side = 0 if cached else 12 * topk  # high-throughput dispatch: int64 ids + float32 weights per row
    if counting == "ll-rank-messages":
        if dispatch:
            return inbound(lambda i: rt.tokens[i] * LL_IDS_BYTES + rt.token_ranks[i, me] * row)
        return inbound(lambda i: rt.tokens[i] * LL_WEIGHTS_BYTES + rt.token_ranks[me, i] * 4 * hidden)
    if counting == "ll-reference-rows":
        if dispatch:
            return inbound(lambda i: rt.selections[i, me] * (row + 4))
        return inbound(lambda i: rt.selections[me, i] * row)
    if counting == "per-selection":
        if dispatch:
            return inbound(lambda i: rt.selections[i, me] * row)
        return inbound(lambda i: rt.selections[me, i] * row)
    if not dispatch:  # every high-throughput combine: each row this rank sent out comes back once
        return inbound(lambda i: rt.token_ranks[me, i] * row)
    if counting == "ht-whole-batch":
        return inbound(lambda i: rt.tokens[i] * (row + side))
    if counting == "ht-rank-rows":
        return inbound(lambda i: rt.token_ranks[i, me] * (row + side))
    return inbound(lambda i: rt.token_ranks[i, me] * (row + (0 if cached else side + 4)))  # ht-reference-rows


def mean_bytes(routings: list[Routing], fn) -> int:
    """``fn(routing)`` averaged over the input sets, rounded to a byte."""
    return round(sum(fn(rt) for rt in routings) / len(routings))


def gbps(nbytes: float | None, seconds: float | None) -> float | None:
    """Bytes per second in GB/s (10**9), or ``None`` when either side is missing or zero."""
    if nbytes is None or not seconds:
        return None
    return nbytes / seconds / 1e9
