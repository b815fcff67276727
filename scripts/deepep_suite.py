"""Run DeepEP's own test scripts against epcomm (``import deep_ep`` resolves to epcomm through
``EPCOMM_AS_DEEP_EP=1``), also with several ranks sharing one GPU.

Usage (on a GPU machine, epcomm installed with ``pip install --no-deps --no-build-isolation -e .`` so the
switch's start-up hook is in place)::

    python scripts/deepep_suite.py DEEPEP_CHECKOUT test_intranode.py --num-processes 2
    python scripts/deepep_suite.py DEEPEP_CHECKOUT test_low_latency.py --num-processes 2

``DEEPEP_CHECKOUT`` is a DeepEP source tree (only its ``tests/`` folder is read; nothing of it is built
or committed here). The tests are copied to a temporary folder and run from there unchanged, except that
their ``utils.init_dist`` is wrapped: with ``EPCOMM_TEST_SHARE_GPU=1`` it is
``epcomm.testing.shared_gpu.init_dist`` (the ranks join through gloo and share GPUs), which is how the
tests can run with more ranks than GPUs. Without it ``init_dist`` is DeepEP's own. Run several processes
on one GPU under an MPS daemon (``scripts/gpu_check.sh`` starts a private one for its shared modes).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from epcomm.testing import shared_gpu

_SHIM = '''"""epcomm's wrapper of DeepEP's tests/utils.py (renamed _deepep_utils.py here): init_dist for ranks
that share a GPU (EPCOMM_TEST_SHARE_GPU=1); everything else is DeepEP's."""
import torch.distributed as dist

import _deepep_utils as _orig
from _deepep_utils import *  # noqa: F401,F403
from epcomm.testing import shared_gpu


_all_gather_into_tensor = dist.all_gather_into_tensor


def _gather_stacked(output, input, group=None, async_op=False):
    """gloo takes an all_gather_into_tensor output only as a concatenation along dim 0; NCCL also as a
    stack (``[R, *input.shape]``), which the LL test passes: view a stack as the concatenation."""
    if output.dim() == input.dim() + 1:
        output = output.view(-1, *input.shape[1:])
    return _all_gather_into_tensor(output, input, group=group, async_op=async_op)


def init_dist(local_rank: int, num_local_ranks: int):
    if not shared_gpu.sharing():
        return _orig.init_dist(local_rank, num_local_ranks)
    dist.all_gather_into_tensor = _gather_stacked
    return shared_gpu.init_dist(local_rank, num_local_ranks)
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
        env = shared_gpu.child_env(dict(os.environ, EPCOMM_AS_DEEP_EP="1"))
        return subprocess.call([sys.executable, script, *rest], cwd=work, env=env)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
