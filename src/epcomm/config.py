"""Tuning configuration for the high-throughput kernels (DeepEP's ``Config``).

``Config(24, 8, 256)`` (DeepEP's positional form) and keyword use both work. ``num_sms`` is honoured
by the high-throughput kernels of both fast backends (at most that many programs, so SMs, per kernel
that moves tokens); ``num_max_rdma_chunked_send_tokens`` by the internode backend (tokens per put
across nodes: the dispatch config's for the dispatch, the combine config's for the combine's partial
sums). The receive fields size DeepEP's ring buffers; epcomm stages whole batches, so they serve the
size hints and the checks, as do the NVL send fields.
"""

from __future__ import annotations

import dataclasses

# Per-token metadata budgeted in the high-throughput staging buffer (bytes): source index, top-k ids
# (int64) and weights (float32) for up to ``MAX_TOPK`` entries, FP8 scales for up to ``MAX_SCALES``.
MAX_TOPK = 32
MAX_SCALES = 128
_SOURCE_META_BYTES = 16


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclasses.dataclass(frozen=True)
class Config:
    """Kernel tuning knobs; validated on construction.

    Positional order matches DeepEP: ``(num_sms, num_max_nvl_chunked_send_tokens,
    num_max_nvl_chunked_recv_tokens, num_max_rdma_chunked_send_tokens,
    num_max_rdma_chunked_recv_tokens)``.
    """

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"Config.{f.name} must be an int, got {v!r}")
            if v <= 0:
                raise ValueError(f"Config.{f.name} must be positive, got {v}")
        if self.num_sms % 2 != 0:
            raise ValueError(f"Config.num_sms must be even (two SMs per channel), got {self.num_sms}")
        if self.num_max_nvl_chunked_send_tokens > self.num_max_nvl_chunked_recv_tokens:
            raise ValueError(
                "Config.num_max_nvl_chunked_send_tokens must be <= num_max_nvl_chunked_recv_tokens, got "
                f"{self.num_max_nvl_chunked_send_tokens} > {self.num_max_nvl_chunked_recv_tokens}"
            )
        if self.num_max_rdma_chunked_send_tokens > self.num_max_rdma_chunked_recv_tokens:
            raise ValueError(
                "Config.num_max_rdma_chunked_send_tokens must be <= num_max_rdma_chunked_recv_tokens, got "
                f"{self.num_max_rdma_chunked_send_tokens} > {self.num_max_rdma_chunked_recv_tokens}"
            )

    @property
    def num_channels(self) -> int:
        """Channels = num_sms / 2 (one sending and one receiving SM per channel, as in DeepEP)."""
        return self.num_sms // 2

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of intranode buffer the high-throughput path needs for ``hidden_bytes`` per token."""
        _check_hint_args(hidden_bytes, num_ranks)
        nvl_ranks = min(num_ranks, 8) if num_ranks > 8 else num_ranks
        rdma_ranks = max(num_ranks // 8, 1) if num_ranks > 8 else 1
        c, q = self.num_channels, self.num_max_nvl_chunked_recv_tokens
        per_token = hidden_bytes + _SOURCE_META_BYTES + MAX_TOPK * (8 + 4) + MAX_SCALES * 4
        n = c * nvl_ranks * (2 * nvl_ranks + rdma_ranks) * 4  # channel head/tail/prefix counters
        n += c * nvl_ranks * q * per_token
        return _align(n, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of inter-node (RDMA) buffer; 0 while every rank sits on one node (<= 8 ranks)."""
        _check_hint_args(hidden_bytes, num_ranks)
        if num_ranks <= 8:
            return 0
        rdma_ranks = num_ranks // 8
        c, q = self.num_channels, self.num_max_rdma_chunked_recv_tokens
        per_token = hidden_bytes + _SOURCE_META_BYTES + MAX_TOPK * (8 + 4) + MAX_SCALES * 4
        n = c * rdma_ranks * (8 * 2 + 2) * 2 * 4
        n += c * rdma_ranks * q * per_token * 2
        return _align(n, 128)

    @classmethod
    def default_dispatch(cls, num_ranks: int, num_sms: int) -> Config:
        """Heuristic for any rank count: receive chunks shrink as the ranks sharing a channel grow."""
        _check_ranks(num_ranks)
        recv = max(64, min(512, 2048 // max(num_ranks, 1)))
        send = max(4, min(32, recv // 8))
        return cls(num_sms, send, recv, 16, 128)

    @classmethod
    def default_combine(cls, num_ranks: int, num_sms: int) -> Config:
        _check_ranks(num_ranks)
        recv = max(64, min(512, 2048 // max(num_ranks, 1)))
        send = max(4, min(16, recv // 16))
        return cls(num_sms, send, recv, 8, 128)


def _check_ranks(num_ranks: int) -> None:
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int):
        raise TypeError(f"num_ranks must be an int, got {num_ranks!r}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")


def _check_hint_args(hidden_bytes: int, num_ranks: int) -> None:
    _check_ranks(num_ranks)
    if isinstance(hidden_bytes, bool) or not isinstance(hidden_bytes, int):
        raise TypeError(f"hidden_bytes must be an int, got {hidden_bytes!r}")
    if hidden_bytes <= 0:
        raise ValueError(f"hidden_bytes must be positive, got {hidden_bytes}")
