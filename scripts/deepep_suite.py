"""Run DeepEP's own test scripts against epcomm (``import deep_ep`` resolves to epcomm through
``EPCOMM_AS_DEEP_EP=1``), also with several ranks sharing one GPU.

Usage (on a GPU machine, epcomm installed with ``pip install --no-deps --no-build-isolation -e .`` so the
switch's start-up hook is in place)::

    python scripts/deepep_suite.py DEEPEP_CHECKOUT test_intranode.py --num-processes 2
    python scripts/deepep_suite.py DEEPEP_CHECKOUT test_low_latency.py --num-processes 2

``DEEPEP_CHECKOUT`` is a DeepEP source tree (only its ``tests/`` folder is read; nothing of it is built
or committed here). The tests are copied to a temporary folder and run from there unchanged, except that
their ``utils.init_dist`` is wrapped: with ``EPCOMM_TEST_SHARE_GPU=1`` the ranks join through gloo for
CPU and CUDA tensors (NCCL refuses two ranks on one GPU) and rank ``r`` uses GPU ``r % device_count``,
which is how the tests can run with more ranks than GPUs. Without it ``init_dist`` is DeepEP's own.
Run several processes on one GPU under MPS (``scripts/deepep_suite.sh`` starts a private daemon), so
that the ranks' kernels run at the same time rather than by time slices.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

_SHIM = '''"""epcomm's wrapper of DeepEP's tests/utils.py (renamed _deepep_utils.py here): init_dist for ranks
that share a GPU (EPCOMM_TEST_SHARE_GPU=1); everything else is DeepEP's."""
import os

import torch
import torch.distributed as dist

import _deepep_utils as _orig
from _deepep_utils import *  # noqa: F401,F403


_all_gather_into_tensor = dist.all_gather_into_tensor


def _gather_stacked(output, input, group=None, async_op=False):
    """gloo takes an all_gather_into_tensor output only as a concatenation along dim 0; NCCL also as a
    stack (``[R, *input.shape]``), which the LL test passes: view a stack as the concatenation."""
    if output.dim() == input.dim() + 1:
        output = output.view(-1, *input.shape[1:])
    return _all_gather_into_tensor(output, input, group=group, async_op=async_op)


def init_dist(local_rank: int, num_local_ranks: int):
    if os.environ.get("EPCOMM_TEST_SHARE_GPU") != "1":
        return _orig.init_dist(local_rank, num_local_ranks)
    dist.all_gather_into_tensor = _gather_stacked
    ip = os.getenv("MASTER_ADDR", "127.0.0.1")
    port = int(os.getenv("MASTER_PORT", "8361"))
    num_nodes = int(os.getenv("WORLD_SIZE", 1))
    node_rank = int(os.getenv("RANK", 0))
    dist.init_process_group(backend="cpu:gloo,cuda:gloo", init_method=f"tcp://{ip}:{port}",
                            world_size=num_nodes * num_local_ranks, rank=node_rank * num_local_ranks + local_rank)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_local_ranks * num_nodes)))
'''


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    checkout, script, rest = argv[0], argv[1], argv[2:]
    tests = os.path.join(checkout, "tests")
    if not os.path.isfile(os.path.join(tests, script)):
        raise SystemExit(f"no {script} under {tests}")
    work = tempfile.mkdtemp(prefix="deepep-tests-")
    try:
        for name in os.listdir(tests):
            src = os.path.join(tests, name)
            if os.path.isfile(src) and name.endswith(".py"):
                shutil.copy(src, os.path.join(work, "_deepep_utils.py" if name == "utils.py" else name))
        with open(os.path.join(work, "utils.py"), "w") as f:
            f.write(_SHIM)
        env = dict(os.environ, EPCOMM_AS_DEEP_EP="1")
        if env.get("EPCOMM_TEST_SHARE_GPU") == "1":  # torch symmetric memory: one device mapped by several ranks
            env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        return subprocess.call([sys.executable, script, *rest], cwd=work, env=env)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
