"""Byte accounting for benchmark rows, two ways, always labelled.

- **logical** (DeepEP's): every byte of payload a rank ends up with, its own tokens included.
  High-throughput dispatch: ``recv_x.numel() * elem_size`` (+ the FP8 scales). High-throughput
  combine: the same rows travelling back (DeepEP counts combine bytes as dispatch's received bytes).
  Low-latency dispatch: the valid received messages (``sum(recv_count)`` rows). Low-latency combine:
  one row per valid (token, expert) selection of this rank's tokens (DeepEP's per-selection count).
- **link**: only the rows whose other end is a different rank (what must cross NVLink).

Per-row sizes: BF16 ``2*H`` bytes; FP8 ``H + 4*ceil(H/128)`` (data plus float32 scales).

Example (R = 2, me = 0, H = 128, BF16): rank 0 sends 3 tokens to itself, rank 1 sends it 2 →
``counts = [[3, .], [2, .]]``; logical = 5 * 256 B = 1280 B, link = 2 * 256 B = 512 B.
"""

from __future__ import annotations

import torch


def row_bytes(hidden: int, dtype: str) -> int:
    """Bytes of one token row: ``bf16`` → ``2*H``; ``fp8`` → ``H`` data + ``4*ceil(H/128)`` scales."""
    if dtype == "bf16":
        return 2 * hidden
    if dtype == "fp8":
        return hidden + 4 * ((hidden + 127) // 128)
    raise ValueError(f"dtype must be 'bf16' or 'fp8', got {dtype!r}")


def received_bytes(counts: torch.Tensor, me: int, row: int) -> tuple[int, int]:
    """``counts int[R, R]``: ``counts[i][j]`` rows rank ``i`` sends to rank ``j``. Returns
    ``(logical, link)`` bytes rank ``me`` receives."""
    col = counts[:, me].to(torch.int64)
    total = int(col.sum())
    return total * row, (total - int(col[me])) * row


def ht_dispatch_bytes(counts: torch.Tensor, me: int, hidden: int, dtype: str) -> tuple[int, int]:
    """High-throughput dispatch: ``counts`` = tokens rank ``i`` sends to rank ``j`` (each token once
    per destination rank)."""
    return received_bytes(counts, me, row_bytes(hidden, dtype))


def ht_combine_bytes(counts: torch.Tensor, me: int, hidden: int) -> tuple[int, int]:
    """High-throughput combine: the BF16 rows rank ``me`` received in dispatch go back (DeepEP's
    accounting); link bytes are those returning to other ranks — the same split as dispatch."""
    return received_bytes(counts, me, row_bytes(hidden, "bf16"))


def ll_dispatch_bytes(msg_counts: torch.Tensor, me: int, hidden: int) -> tuple[int, int]:
    """Low-latency FP8 dispatch: ``msg_counts[i][j]`` = (token, expert) messages rank ``i`` sends to
    experts on rank ``j``."""
    return received_bytes(msg_counts, me, row_bytes(hidden, "fp8"))


def ll_combine_bytes(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, me: int,
                     hidden: int) -> tuple[int, int]:
    """Low-latency BF16 combine: one row per valid selection in ``topk_idx int64[T, K]`` comes back
    to rank ``me``; link rows are those whose expert lives on another rank."""
    local = num_experts // num_ranks
    valid = topk_idx >= 0
    remote = valid & (topk_idx.div(local, rounding_mode="floor") != me)
    row = row_bytes(hidden, "bf16")
    return int(valid.sum()) * row, int(remote.sum()) * row


def gbps(nbytes: float | None, seconds: float | None) -> float | None:
    """Bytes per second in GB/s (10**9), or ``None`` when either side is missing or zero."""
    if nbytes is None or not seconds:
        return None
    return nbytes / seconds / 1e9
