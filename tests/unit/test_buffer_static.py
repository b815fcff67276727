"""Tier 1 (no process group): ``Buffer``'s static helpers (configs for any rank count, the
low-latency size hint, ``set_num_sms``, ``capture``), the constructor's checks that need no group,
the package surface, and ``EventOverlap`` on CPU.
"""

from __future__ import annotations

import pytest
import torch

import epcomm
from epcomm import Buffer, Config, EventOverlap, layout
from epcomm.backends.base import PeerTimeoutError


@pytest.fixture
def restore_num_sms():
    saved = Buffer.num_sms
    yield
    Buffer.num_sms = saved


def test_package_surface():
    assert epcomm.topk_idx_t is torch.int64
    for name in ("Buffer", "Config", "EventOverlap", "topk_idx_t"):
        assert name in epcomm.__all__


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 5, 7, 8, 9, 16, 24, 64, 72, 144])
def test_default_configs_for_any_rank_count(num_ranks):
    for cfg in (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks)):
        assert isinstance(cfg, Config)
        assert cfg.num_sms == Buffer.num_sms
        assert 0 < cfg.num_max_nvl_chunked_send_tokens <= cfg.num_max_nvl_chunked_recv_tokens
        assert 0 < cfg.num_max_rdma_chunked_send_tokens <= cfg.num_max_rdma_chunked_recv_tokens
        assert cfg.get_nvl_buffer_size_hint(7168 * 2, num_ranks) % 128 == 0


def test_default_configs_bad_rank_count():
    with pytest.raises(ValueError, match="num_ranks must be >= 1, got 0"):
        Buffer.get_dispatch_config(0)
    with pytest.raises(TypeError, match=r"num_ranks must be an int, got 2\.0"):
        Buffer.get_combine_config(2.0)


def test_set_num_sms(restore_num_sms):
    Buffer.set_num_sms(24)
    assert Buffer.num_sms == 24
    assert Buffer.get_dispatch_config(4).num_sms == 24
    assert Buffer.get_combine_config(4).num_channels == 12
    with pytest.raises(ValueError, match="new_num_sms must be even, got 25"):
        Buffer.set_num_sms(25)
    with pytest.raises(ValueError, match="new_num_sms must be >= 2, got 0"):
        Buffer.set_num_sms(0)
    with pytest.raises(TypeError, match=r"new_num_sms must be an int, got 24\.0"):
        Buffer.set_num_sms(24.0)
    assert Buffer.num_sms == 24  # failed calls changed nothing


@pytest.mark.parametrize("m,h,r,e", [(1, 128, 1, 1), (128, 7168, 8, 256), (32, 512, 3, 12), (7, 136, 5, 10),
                                     (256, 4096, 64, 256)])
def test_low_latency_rdma_size_hint(m, h, r, e):
    hint = Buffer.get_low_latency_rdma_size_hint(m, h, r, e)
    assert isinstance(hint, int) and hint > 0 and hint % 128 == 0
    assert hint == layout.low_latency_buffer_layout(m, h, r, e).total
    # room for two receive areas of R*M BF16 rows plus the zero-copy combine buffer
    assert hint >= 2 * r * m * h * 2 + (e // r) * r * m * h * 2
    # monotone in M and H
    assert Buffer.get_low_latency_rdma_size_hint(m + 1, h, r, e) >= hint
    assert Buffer.get_low_latency_rdma_size_hint(m, h + 128, r, e) >= hint


def test_low_latency_rdma_size_hint_bad_args():
    with pytest.raises(ValueError, match=r"num_experts=10 must be divisible by the number of ranks \(4\)"):
        Buffer.get_low_latency_rdma_size_hint(8, 128, 4, 10)
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank must be >= 1, got 0"):
        Buffer.get_low_latency_rdma_size_hint(0, 128, 2, 4)
    with pytest.raises(TypeError, match=r"hidden must be an int, got 128\.0"):
        Buffer.get_low_latency_rdma_size_hint(8, 128.0, 2, 4)
    with pytest.raises(ValueError, match="num_ranks must be >= 1, got 0"):
        Buffer.get_low_latency_rdma_size_hint(8, 128, 0, 4)


def test_is_sm90_compiled_and_capture_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    assert Buffer.is_sm90_compiled() is False
    ev = Buffer.capture()
    assert isinstance(ev, EventOverlap) and ev.event is None
    ev.current_stream_wait()


def test_constructor_checks_before_any_group():
    with pytest.raises(ValueError, match="group must be a torch.distributed process group, got None"):
        Buffer(None)
    with pytest.raises(ValueError, match="comm"):
        Buffer(None, comm=object())
    with pytest.raises(TypeError, match="group must be a torch.distributed.ProcessGroup, got str"):
        Buffer("world")


# ----------------------------------------------------------------------------- EventOverlap


def test_event_overlap_cpu():
    ev = EventOverlap()
    assert ev.event is None and ev.extra_tensors is None
    ev.current_stream_wait()  # no-op without an event
    t = torch.ones(3)
    ev2 = EventOverlap(None, (t,))
    assert ev2.extra_tensors[0] is t
    with ev2 as entered:
        assert entered is ev2
        t += 1
    assert torch.equal(t, torch.full((3,), 2.0))
    assert "EventOverlap" in repr(ev2)


def test_event_overlap_does_not_swallow_exceptions():
    with pytest.raises(KeyError, match="boom"), EventOverlap():
        raise KeyError("boom")


def test_peer_timeout_error_names_rank_and_phase():
    e = PeerTimeoutError(1, "combine/payload", 3, 2.5, "detail")
    assert isinstance(e, TimeoutError)
    assert (e.rank, e.phase) == (3, "combine/payload")
    assert str(e).startswith("epcomm rank 1: combine/payload waited 2.5 s for rank 3 and gave up (detail)")
    assert "EPCOMM_TIMEOUT_S" in str(e)
    assert "waited 1 s for a peer" in str(PeerTimeoutError(0, "dispatch/notify", None, 1.0))
