"""Tier 3: needs CUDA GPUs (skipped elsewhere). Run on the device machine: scripts/gpu_check.sh."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return
    skip = pytest.mark.skip(reason="tier 3 needs at least two CUDA GPUs")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)
