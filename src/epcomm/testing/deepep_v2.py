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
with ``EPCOMM_TEST_SHARE_GPU=1``, wraps ``deep_ep.utils.envs.init_dist`` so that the ranks join through
gloo for CPU and CUDA tensors (NCCL refuses two ranks on one GPU) and rank ``r`` uses GPU
``r % device_count`` (and DeepEP's reference moves its FP8 tensors through gloo as bytes, a type gloo
lacks). ``--skip-perf-test``: the timing part looks kernels up by DeepEP's names, which
epcomm's dispatch kernels do not carry (docs/v2.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

_SITE = '''"""epcomm.testing.deepep_v2: DeepEP's test helpers beside epcomm's deep_ep (see that module)."""
import os

import deep_ep.utils as _utils

_utils.__path__.append({utils!r})
if os.environ.get("EPCOMM_TEST_SHARE_GPU") == "1":
    import torch
    import torch.distributed as dist
    import deep_ep.utils.envs as _envs

    def init_dist(local_rank, num_local_ranks, seed=0):
        num_nodes = int(os.getenv("WORLD_SIZE", 1))
        node_rank = int(os.getenv("RANK", 0))
        dist.init_process_group(backend="cpu:gloo,cuda:gloo",
                                init_method="tcp://%s:%s" % (os.getenv("MASTER_ADDR", "127.0.0.1"),
                                                             os.getenv("MASTER_PORT", "8361")),
                                world_size=num_nodes * num_local_ranks, rank=node_rank * num_local_ranks + local_rank)
        _envs._local_rank = local_rank
        torch.set_default_dtype(torch.bfloat16)
        torch.set_default_device("cuda")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        _envs.init_seed(seed)
        return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_local_ranks * num_nodes)))

    _envs.init_dist = init_dist
    _a2a = dist.all_to_all_single

    def _all_to_all_single(output, input, *args, **kw):  # DeepEP's reference moves FP8; gloo has no FP8 type
        if output.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return _a2a(output.view(torch.uint8), input.view(torch.uint8), *args, **kw)
        return _a2a(output, input, *args, **kw)

    dist.all_to_all_single = _all_to_all_single
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
        env = dict(os.environ, EPCOMM_AS_DEEP_EP="1",
                   PYTHONPATH=os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p))
        if env.get("EPCOMM_TEST_SHARE_GPU") == "1":  # torch symmetric memory: one device mapped by several ranks
            env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        return subprocess.call([sys.executable, path, *rest], cwd=os.path.dirname(path), env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
