"""Ranks sharing a GPU, for running other projects' test scripts against epcomm (``EPCOMM_TEST_SHARE_GPU=1``).

NCCL refuses two ranks on one GPU, so :func:`init_dist` joins the ranks through gloo for CPU and CUDA
tensors and puts rank ``r`` on GPU ``r % device_count``. The runners of DeepEP's V1 and V2 test scripts
(``scripts/deepep_suite.py``, :mod:`epcomm.testing.deepep_v2`) call it from the ``init_dist`` they put in
place of DeepEP's. Run several such ranks on one GPU under an MPS daemon, so that their kernels run at the
same time rather than by time slices.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def sharing() -> bool:
    """True where the ranks share GPUs (``EPCOMM_TEST_SHARE_GPU=1``)."""
    return os.environ.get("EPCOMM_TEST_SHARE_GPU") == "1"


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for the ranks' processes: with shared GPUs, torch symmetric memory must accept one device
    mapped by several ranks."""
    env = dict(env)
    if env.get("EPCOMM_TEST_SHARE_GPU") == "1":
        env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    return env


def init_dist(local_rank: int, num_local_ranks: int):
    """DeepEP's ``init_dist`` contract for ranks sharing GPUs: join the world of ``WORLD_SIZE`` nodes of
    ``num_local_ranks`` ranks (this one ``RANK * num_local_ranks + local_rank``) at
    ``MASTER_ADDR:MASTER_PORT`` through gloo, make BF16 and the rank's GPU the defaults, and return
    ``(rank, world size, a group of every rank)``. Without CUDA (a CPU test of the runners) the device
    defaults stay as they are."""
    num_nodes = int(os.getenv("WORLD_SIZE", 1))
    node_rank = int(os.getenv("RANK", 0))
    world = num_nodes * num_local_ranks
    dist.init_process_group(backend="cpu:gloo,cuda:gloo",
                            init_method=f"tcp://{os.getenv('MASTER_ADDR', '127.0.0.1')}:"
                                        f"{os.getenv('MASTER_PORT', '8361')}",
                            world_size=world, rank=node_rank * num_local_ranks + local_rank)
    torch.set_default_dtype(torch.bfloat16)
    if torch.cuda.is_available():
        torch.set_default_device("cuda")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(world)))
