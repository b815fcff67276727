"""Tier 1: ``backends.base.raise_error_word``, the one reading of the kernels' error word
``[code, peer, observed, target]`` that the nvlink and internode backends share, and
``input_error``, the high-throughput dispatch's reading of it at its host synchronisation."""

from __future__ import annotations

import types

import pytest
import torch

from epcomm.backends.base import PeerTimeoutError, input_error, raise_error_word


def _be(rank=1, timeout_s=2.5):
    return types.SimpleNamespace(rank=rank, timeout_s=timeout_s)


def test_no_error_raises_nothing():
    raise_error_word(_be(), [0, 0, 0, 0], lambda: pytest.fail("M asked for without an error"))


def test_input_errors_name_their_values():
    with pytest.raises(ValueError, match=r"expert id 17, outside \[-1, 16\) for num_experts=16"):
        raise_error_word(_be(), [10, 0, 17, 16])
    with pytest.raises(RuntimeError, match="epcomm rank 1: num_worst_tokens=8 but 9 tokens arrived"):
        raise_error_word(_be(), [9, 0, 9, 8])
    with pytest.raises(ValueError, match="num_tokens_per_rank on rank 3 says 5 tokens for a rank to which its "
                                         "is_token_in_rank sends 4"):
        raise_error_word(_be(), [11, 3, 5, 4])
    with pytest.raises(ValueError, match=r"^is_token_in_rank does not match topk_idx at token 6, rank 2: pass the "
                                         r"layout get_dispatch_layout made from this topk_idx \(found on the device; "):
        raise_error_word(_be(), [12, -1, 6, 2])


def test_a_timeout_names_the_phase_the_peer_and_what_it_waited_for():
    with pytest.raises(PeerTimeoutError, match=r"epcomm rank 1: combine/receive-data waited 2.5 s for rank 0 .*"
                                               r"signal 3 < expected 4") as e:
        raise_error_word(_be(), [5, 0, 3, 4], waited="signal")
    assert (e.value.rank, e.value.phase) == (0, "combine/receive-data")
    with pytest.raises(PeerTimeoutError, match="phase 42 .*flag 1 < expected 2"):
        raise_error_word(_be(), [42, 2, 1, 2])


def test_an_error_word_no_kernel_writes_is_not_called_a_timeout():
    # a word of -1s (seen on a GPU when recorded launches were replayed outside their calls) once read
    # "phase -1 waited 2.5 s for rank -1"
    for word in ([-1, -1, -1, -1], [5, -1, 3, 4]):
        with pytest.raises(RuntimeError, match=r"error word reads \[.*no epcomm kernel records") as e:
            raise_error_word(_be(), word)
        assert not isinstance(e.value, PeerTimeoutError)


def test_a_low_latency_timeout_blames_differing_m_first():
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank differs across ranks: 8 on rank 0, "
                                         "0 on rank 1, 16 on rank 2"):
        raise_error_word(_be(), [6, 2, 0, 1], lambda: [8, 0, 16])
    # the same M everywhere (0: a rank that made no low-latency call): the timeout itself
    with pytest.raises(PeerTimeoutError, match="low_latency_dispatch/receive waited 2.5 s for rank 2"):
        raise_error_word(_be(), [6, 2, 0, 1], lambda: [8, 0, 8])
    with pytest.raises(PeerTimeoutError, match="low_latency_dispatch/receive"):  # no M to read
        raise_error_word(_be(), [6, 2, 0, 1])


def test_input_errors_are_returned_once_and_cleared():
    be = _be()
    be.err, be.err_host = torch.tensor([10, 0, 17, 16, 7, 7], dtype=torch.int32), torch.tensor([10, 0, 17, 16])
    be._check_error = lambda word: raise_error_word(be, word)
    err = input_error(be, [10, 0, 17, 16])
    assert isinstance(err, ValueError)
    assert str(err) == "topk_idx holds expert id 17, outside [-1, 16) for num_experts=16"
    assert be.err.tolist() == [0, 0, 0, 0, 7, 7] and be.err_host.tolist() == [0, 0, 0, 0]  # the mirror address stays
    assert input_error(be, [0, 0, 0, 0]) is None
    be.err[0], be.err_host[0] = 12, 12
    assert str(input_error(be, [12, -1, 3, 1])) == ("is_token_in_rank does not match topk_idx at token 3, rank 1: "
                                                   "pass the layout get_dispatch_layout made from this topk_idx")
    assert be.err.tolist()[:4] == [0, 0, 0, 0] and be.err_host.tolist() == [0, 0, 0, 0]
    with pytest.raises(PeerTimeoutError):
        input_error(be, [3, 1, 0, 1])
