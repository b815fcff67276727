"""Tier 3: needs CUDA GPUs (skipped elsewhere). Run on the device machine: scripts/gpu_check.sh."""
import os

import pytest
import torch

from epcomm.testing.launcher import share_gpu


def pytest_collection_modifyitems(config, items):
    world = int(os.environ.get("EPCOMM_TEST_WORLD", "2"))
    if torch.cuda.is_available() and (torch.cuda.device_count() >= max(world, 2) or share_gpu(max(world, 2))):
        return
    skip = pytest.mark.skip(reason="tier 3 needs at least two CUDA GPUs (or EPCOMM_TEST_SHARE_GPU=1 on one)")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)
