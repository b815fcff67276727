"""Run DeepEP V2's own test scripts (``tests/elastic/test_ep.py``, ...) against epcomm: ``import deep_ep``
resolves to epcomm (``EPCOMM_AS_DEEP_EP=1``), and ``deep_ep.utils.{math,gate,envs,refs,testing}``, DeepEP's
pure-Python test helpers that epcomm does not ship, load from a DeepEP checkout. Nothing of DeepEP is
copied into this repository; the checkout is only read.

Usage (a GPU machine, epcomm installed with ``pip install --no-deps --no-build-isolation -e .``)::

    EPCOMM_TEST_SHARE_GPU=1 python -m epcomm.testing.deepep_v2 DEEPEP_CHECKOUT tests/elastic/test_ep.py \\
        --num-processes 2 --skip-perf-test

How: a temporary folder on ``PYTHONPATH`` holds a ``sitecustomize.py``, which every process (the
script's and the ranks it spawns) runs at start-up, after the switch's hook: it appends the checkout's
``deep_ep/utils`` to ``deep_ep.utils.__path__`` (epcomm's own ``deep_ep.utils.event`` stays first) and,
with ``EPCOMM_TEST_SHARE_GPU=1``, wraps ``deep_ep.utils.envs.init_dist`` with
:func:`epcomm.testing.shared_gpu.init_dist` (the ranks join through gloo and share GPUs; DeepEP's
reference then moves its FP8 tensors through gloo as bytes, a type gloo lacks). The timing part (without
``--skip-perf-test``) looks kernels up by DeepEP's names, which epcomm's kernels carry on the nvlink
backend; on the reference backend (torch operations only) and for the internode combine it needs
``--skip-perf-test`` (docs/v2.md, "Kernel names").

The experimental calls' scripts run the same way (``tests/elastic/test_engram.py``, ``test_pp.py``,
``test_agrs.py``, ``test_barrier.py``; ``scripts/gpu_check.sh deepep-extras`` runs all four). For them the
``sitecustomize`` also moves FP8 tensors of ``all_gather_into_tensor`` through gloo as bytes (test_engram
``--use-fp8`` gathers its FP8 storage for the reference), and where ``ibstat`` reports no RDMA NIC (one GPU under
MPS) makes ``deep_ep.utils.envs.get_rdma_gbs`` give 450 (an NVLink figure, GB/s) instead of 0: test_pp sizes
a sleep by dividing by it, and the tensors move over NVLink there anyway.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from . import shared_gpu

_SITE = '''"""epcomm.testing.deepep_v2: DeepEP's test helpers beside epcomm's deep_ep (see that module)."""
import os

import _epcomm_as_deep_ep

_epcomm_as_deep_ep.install()  # (where epcomm's start-up hook is not installed: a tree on PYTHONPATH)
import deep_ep.utils as _utils

_utils.__path__.append({utils!r})
import deep_ep.utils.envs as _envs

_rdma_gbs = getattr(_envs, "get_rdma_gbs", None)


def _get_rdma_gbs(*args, **kw):  # no RDMA NIC (one GPU): an NVLink figure, not 0 (test_pp divides by it)
    return _rdma_gbs(*args, **kw) or 450.0


if _rdma_gbs is not None:
    _envs.get_rdma_gbs = _get_rdma_gbs
if os.environ.get("EPCOMM_TEST_SHARE_GPU") == "1":
    import torch
    import torch.distributed as dist
    import deep_ep.utils.envs as _envs
    from epcomm.testing import shared_gpu

    def init_dist(local_rank, num_local_ranks, seed=0):
        got = shared_gpu.init_dist(local_rank, num_local_ranks)
        _envs._local_rank = local_rank
        _envs.init_seed(seed)
        return got

    _envs.init_dist = init_dist
    _a2a = dist.all_to_all_single

    def _all_to_all_single(output, input, *args, **kw):  # DeepEP's reference moves FP8; gloo has no FP8 type
        if output.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return _a2a(output.view(torch.uint8), input.view(torch.uint8), *args, **kw)
        return _a2a(output, input, *args, **kw)

    dist.all_to_all_single = _all_to_all_single
    _agit = dist.all_gather_into_tensor

    def _all_gather_into_tensor(output, input, *args, **kw):  # test_engram --use-fp8 gathers FP8 storage
        if output.dim() == input.dim() + 1:  # gloo takes a concatenation along dim 0, NCCL a stack too (the LL test)
            output = output.view(-1, *input.shape[1:])
        if output.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return _agit(output.view(torch.uint8), input.view(torch.uint8), *args, **kw)
        return _agit(output, input, *args, **kw)

    dist.all_gather_into_tensor = _all_gather_into_tensor
'''


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        sys.stderr.write(__doc__)  # the usage (a command-line entry point, not library output)
        return 2
    checkout, script, rest = argv[0], argv[1], argv[2:]
    utils = os.path.join(os.path.abspath(checkout), "deep_ep", "utils")
    path = os.path.join(os.path.abspath(checkout), script)
    if not os.path.isdir(utils) or not os.path.isfile(path):
        raise SystemExit(f"{checkout} is not a DeepEP checkout with deep_ep/utils and {script}")
    with tempfile.TemporaryDirectory(prefix="epcomm-deepep-v2-") as site:
        with open(os.path.join(site, "sitecustomize.py"), "w") as f:
            f.write(_SITE.format(utils=utils))
        env = shared_gpu.child_env(dict(os.environ, EPCOMM_AS_DEEP_EP="1", PYTHONPATH=os.pathsep.join(
            p for p in (site, os.environ.get("PYTHONPATH")) if p)))
        return subprocess.call([sys.executable, path, *rest], cwd=os.path.dirname(path), env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
