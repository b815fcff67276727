"""Fixtures of tier 1."""

from __future__ import annotations

import pytest


@pytest.fixture
def own_group(monkeypatch):
    """For a test that makes a buffer through the host probe (``bench/probe_calls.py``): the probe makes the default
    process group (gloo, world 1) where there is none, and points ``Buffer``'s backend choice at the nvlink backend;
    both undone after the test, for later tests of this process."""
    import torch.distributed as dist

    import epcomm.runtime as rm

    monkeypatch.setattr(rm, "select_backend", rm.select_backend)
    had = dist.is_initialized()
    yield
    if not had and dist.is_initialized():
        dist.destroy_process_group()
