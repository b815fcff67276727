"""Tier 3: after a named timeout on a GPU the process exits promptly, caught or not, the peer alive or
dead (``tests/dist/test_timeout_exit.py`` on GPUs).

Two plain ``python`` processes per case (``tests/dist/timeout_rank.py``), ``EPCOMM_TIMEOUT_S=5``:

- ``shared``: both ranks on GPU 0, joined by gloo for CPU and CUDA tensors (what
  ``EPCOMM_TEST_SHARE_GPU=1`` does), so it runs on one GPU. The Buffer runs the nvlink backend (its
  notify kernel gives up at the deadline, the peer named) or, with ``EPCOMM_BACKEND=reference``, the
  reference backend staging through the host (gloo's operation gives up).
- ``nccl``: rank ``r`` on GPU ``r`` (two GPUs or more), the reference backend over NCCL: the collective
  stays queued on the GPU after the deadline, so epcomm aborts the group.

Rank 0 must end within ``BOUND_S`` of the moment it began waiting, with exit code 0 when it caught the
error (then ``destroy()`` and ``dist.destroy_process_group()``) and 1 when it did not, its stderr naming
rank 0 and the phase.
"""

from __future__ import annotations

import re

import pytest
import timeout_rank
import torch

TIMEOUT_S = 5
BOUND_S = TIMEOUT_S + 25

# case -> (rank 0's role, rank 1's role, backend, rank 0's exit code, what rank 0's stderr must match)
SHARED = {
    "nvlink, caught, peer alive": ("caught", "idle", "nvlink", 0,
                                   r"caught PeerTimeoutError on nvlink: epcomm rank 0: dispatch/\S+ waited 5 s"),
    "nvlink, uncaught, peer alive": ("uncaught", "idle", "nvlink", 1,
                                     r"PeerTimeoutError: epcomm rank 0: dispatch/\S+ waited 5 s"),
    "nvlink, uncaught, peer dead": ("uncaught", "dies", "nvlink", 1,
                                    r"Peer\w+Error: epcomm rank 0: dispatch/\S+ (waited|lost)"),
    "reference, caught, peer alive": ("caught", "idle", "reference", 0,
                                      r"caught PeerTimeoutError on reference: epcomm rank 0: dispatch/notify waited"),
    "construction, peer absent": ("build", "absent", "nvlink", 1,
                                  r"PeerTimeoutError: epcomm rank 0: Buffer/rank exchange waited 5 s"),
}
NCCL = {
    "nccl reference, caught, peer alive": ("caught", "idle", "reference", 0,
                                           r"caught PeerTimeoutError on reference: epcomm rank 0: dispatch/notify"),
    "nccl reference, uncaught, peer alive": ("uncaught", "idle", "reference", 1,
                                             r"PeerTimeoutError: epcomm rank 0: dispatch/notify waited 5 s"),
}


def _outcomes(cases, transport, tmp_path_factory):
    out = {}
    for backend in sorted({c[2] for c in cases.values()}):
        mine = {k: v for k, v in cases.items() if v[2] == backend}
        out.update(timeout_rank.run(mine, tmp_path_factory, {"EPCOMM_TIMEOUT_S": str(TIMEOUT_S),
                                                            "EPCOMM_BACKEND": backend}, transport))
    return out


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return _outcomes(SHARED, "shared", tmp_path_factory)


@pytest.fixture(scope="module")
def nccl(tmp_path_factory):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    return _outcomes(NCCL, "nccl", tmp_path_factory)


def _check(cases, outcomes, case):
    code, took, text = outcomes[case]
    expected_code, pattern = cases[case][3:]
    assert code is not None, f"{case}: rank 0 still running long after its deadline; stderr:\n{text[-3000:]}"
    assert took is not None, f"{case}: rank 0 never reached its wait; stderr:\n{text[-3000:]}"
    assert took < BOUND_S, f"{case}: rank 0 exited {took:.1f} s after it began waiting; stderr:\n{text[-3000:]}"
    assert code == expected_code, f"{case}: exit code {code}, expected {expected_code}; stderr:\n{text[-3000:]}"
    assert re.search(pattern, text), f"{case}: stderr does not match {pattern!r}:\n{text[-3000:]}"


@pytest.mark.parametrize("case", list(SHARED))
def test_one_gpu_two_ranks_exit_promptly(shared, case):
    _check(SHARED, shared, case)


@pytest.mark.parametrize("case", list(NCCL))
def test_nccl_exits_promptly(nccl, case):
    _check(NCCL, nccl, case)
