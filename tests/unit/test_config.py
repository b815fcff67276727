"""Tier 1 (no process group): ``epcomm.Config`` — DeepEP's positional form, keywords, validation
errors, and the buffer size hints (multiples of 128, monotone in hidden bytes and ranks).
"""

from __future__ import annotations

import dataclasses

import pytest

from epcomm import Config

FIELDS = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
          "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")


def as_tuple(c: Config) -> tuple[int, ...]:
    return tuple(getattr(c, f) for f in FIELDS)


def test_positional_deepep_form():
    c = Config(24, 8, 256)
    assert as_tuple(c) == (24, 8, 256, 6, 256)
    assert c.num_channels == 12
    assert as_tuple(Config(24, 6, 256, 6, 128)) == (24, 6, 256, 6, 128)


def test_keywords_and_defaults():
    assert as_tuple(Config()) == (20, 6, 256, 6, 256)
    c = Config(num_sms=8, num_max_rdma_chunked_send_tokens=4, num_max_rdma_chunked_recv_tokens=64)
    assert as_tuple(c) == (8, 6, 256, 4, 64)
    assert c.num_channels == 4
    assert Config(24, 8, 256) == Config(num_sms=24, num_max_nvl_chunked_send_tokens=8,
                                        num_max_nvl_chunked_recv_tokens=256)


def test_frozen():
    c = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_sms = 4


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"num_sms": 0}, ValueError, "num_sms must be positive, got 0"),
    ({"num_sms": -2}, ValueError, "num_sms must be positive, got -2"),
    ({"num_sms": 23}, ValueError, "num_sms must be even.*got 23"),
    ({"num_sms": 2.0}, TypeError, r"num_sms must be an int, got 2\.0"),
    ({"num_sms": True}, TypeError, "num_sms must be an int, got True"),
    ({"num_max_nvl_chunked_send_tokens": 0}, ValueError, "num_max_nvl_chunked_send_tokens must be positive, got 0"),
    ({"num_max_nvl_chunked_recv_tokens": "256"}, TypeError,
     "num_max_nvl_chunked_recv_tokens must be an int, got '256'"),
    ({"num_max_nvl_chunked_send_tokens": 300}, ValueError,
     "num_max_nvl_chunked_send_tokens must be <= num_max_nvl_chunked_recv_tokens, got 300 > 256"),
    ({"num_max_rdma_chunked_send_tokens": 16, "num_max_rdma_chunked_recv_tokens": 8}, ValueError,
     "num_max_rdma_chunked_send_tokens must be <= num_max_rdma_chunked_recv_tokens, got 16 > 8"),
])
def test_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Config(**kwargs)


def test_positional_validation():
    with pytest.raises(ValueError, match="num_sms must be even.*got 7"):
        Config(7, 8, 256)
    with pytest.raises(ValueError, match="got 512 > 256"):
        Config(24, 512, 256)


def test_nvl_hint_hand_worked():
    # Config(): C = 10 channels, 256-token receive chunks. Per token: 256 hidden bytes + 16 source
    # metadata + 32 * (8 + 4) top-k + 128 * 4 scales = 1168 bytes.
    # counters 10 * 2 * (2*2 + 1) * 4 = 400; payload 10 * 2 * 256 * 1168 = 5_980_160;
    # 5_980_560 rounded up to 128 -> 5_980_672.
    assert Config().get_nvl_buffer_size_hint(256, 2) == 5_980_672
    assert Config().get_rdma_buffer_size_hint(256, 2) == 0  # one node


HIDDEN_BYTES = [16, 256, 1000, 7168 * 2, 7168 * 2 + 1]
RANKS = [1, 2, 3, 4, 5, 7, 8, 9, 16, 24, 64]


@pytest.mark.parametrize("cfg", [Config(), Config(24, 8, 256), Config(4, 4, 64, 4, 32), Config(132, 32, 512)])
def test_size_hints_multiple_of_128_and_monotone(cfg):
    nvl = [[cfg.get_nvl_buffer_size_hint(hb, r) for r in RANKS] for hb in HIDDEN_BYTES]
    rdma = [[cfg.get_rdma_buffer_size_hint(hb, r) for r in RANKS] for hb in HIDDEN_BYTES]
    for table in (nvl, rdma):
        for i, row in enumerate(table):
            assert all(v % 128 == 0 and v >= 0 for v in row), row
            assert row == sorted(row), f"not monotone in num_ranks: {row}"
            if i:
                assert all(a <= b for a, b in zip(table[i - 1], row)), "not monotone in hidden_bytes"
    # the intranode hint always covers at least one receive chunk of tokens per channel
    for hb, row in zip(HIDDEN_BYTES, nvl):
        assert all(v >= cfg.num_channels * cfg.num_max_nvl_chunked_recv_tokens * hb for v in row)
    # the RDMA hint is 0 within a node and positive beyond 8 ranks
    for row in rdma:
        assert [v == 0 for v in row] == [r <= 8 for r in RANKS]
    # more receive tokens -> more bytes
    bigger = dataclasses.replace(cfg, num_max_nvl_chunked_recv_tokens=2 * cfg.num_max_nvl_chunked_recv_tokens)
    assert bigger.get_nvl_buffer_size_hint(256, 4) > cfg.get_nvl_buffer_size_hint(256, 4)


@pytest.mark.parametrize("args,exc,match", [
    ((0, 2), ValueError, "hidden_bytes must be positive, got 0"),
    ((256, 0), ValueError, "num_ranks must be >= 1, got 0"),
    ((256.0, 2), TypeError, r"hidden_bytes must be an int, got 256\.0"),
    ((256, True), TypeError, "num_ranks must be an int, got True"),
])
def test_hint_validation(args, exc, match):
    with pytest.raises(exc, match=match):
        Config().get_nvl_buffer_size_hint(*args)
    with pytest.raises(exc, match=match):
        Config().get_rdma_buffer_size_hint(*args)
