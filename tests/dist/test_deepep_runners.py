"""Tier 2: the runners of DeepEP's own test scripts (``scripts/deepep_suite.py`` for V1,
``python -m epcomm.testing.deepep_v2`` for V2) on a stand-in DeepEP checkout: the scripts' ``init_dist``
becomes epcomm's shared-GPU one under ``EPCOMM_TEST_SHARE_GPU=1`` (two ranks over gloo, a group of both),
DeepEP's own without it, and ``import deep_ep`` gives epcomm's classes in the ranks."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The stand-in test script: two ranks call the test utilities' init_dist, then agree on a sum.
SCRIPT = r'''
import sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
{imp}

def rank(local_rank, n):
    r, world, group = init_dist(local_rank, n)
    import deep_ep, epcomm
    t = torch.tensor([r + 1.0], dtype=torch.float32)
    dist.all_reduce(t, group=group)
    ours = issubclass(deep_ep.Buffer, epcomm.Buffer), issubclass(deep_ep.ElasticBuffer, epcomm.ElasticBuffer)
    sys.stdout.write(f"rank {{r}} world {{world}} sum {{int(t.item())}} epcomm {{ours[0]}} {{ours[1]}}\n")
    sys.stdout.flush()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(rank, args=(2,), nprocs=2)
'''

ORIGINAL = '''
def init_dist(local_rank, num_local_ranks, seed=0):
    raise SystemExit("DeepEP's own init_dist ran")
_local_rank = None
def init_seed(seed):
    pass
'''


def _start(cmd, share: bool, port: int) -> subprocess.Popen:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="1", RANK="0",
               PYTHONPATH=str(ROOT / "src"))
    env.pop("EPCOMM_TEST_SHARE_GPU", None)
    if share:
        env["EPCOMM_TEST_SHARE_GPU"] = "1"
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _check(p, share: bool):
    if not share:
        assert p.returncode != 0 and "DeepEP's own init_dist ran" in p.stderr, (p.returncode, p.stderr[-2000:])
        return
    assert p.returncode == 0, p.stderr[-3000:]
    lines = sorted(ln for ln in p.stdout.splitlines() if ln.startswith("rank"))
    assert lines == [f"rank {r} world 2 sum 3 epcomm True True" for r in range(2)], p.stdout


def _v1(tmp_path: Path, share: bool) -> list:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "utils.py").write_text(ORIGINAL)
    (tests / "test_stand_in.py").write_text(SCRIPT.format(imp="from utils import init_dist"))
    return [sys.executable, str(ROOT / "scripts" / "deepep_suite.py"), str(tmp_path), "test_stand_in.py"]


def _v2(tmp_path: Path) -> list:
    utils = tmp_path / "deep_ep" / "utils"
    utils.mkdir(parents=True)
    (utils / "envs.py").write_text(ORIGINAL)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_stand_in.py").write_text(
        SCRIPT.format(imp="import deep_ep.utils.envs as envs\ninit_dist = envs.init_dist"))
    return [sys.executable, "-m", "epcomm.testing.deepep_v2", str(tmp_path), "tests/test_stand_in.py"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's four runs (each a runner, its script and two ranks: processes that mostly import torch one
    after another) started at once, so that they share the cores: ``{name: started process}``."""
    port = random.randint(20000, 40000)
    cmds = {"v1-shared": (_v1(tmp_path_factory.mktemp("v1s"), True), True),
            "v1-own": (_v1(tmp_path_factory.mktemp("v1o"), False), False),
            "v2-shared": (_v2(tmp_path_factory.mktemp("v2s")), True),
            "v2-extras": (_v2_extras(tmp_path_factory.mktemp("v2x")), True)}
    procs = {name: _start(cmd, share, port + i) for i, (name, (cmd, share)) in enumerate(cmds.items())}
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("share", [True, False])
def test_v1_runner(runs, share):
    _check(_result(runs["v1-shared" if share else "v1-own"]), share)


@pytest.mark.parametrize("share", [True])  # without EPCOMM_TEST_SHARE_GPU: only test_v1_runner (CI time)
def test_v2_runner(runs, share):
    _check(_result(runs["v2-shared"]), share)


# What DeepEP V2's experimental scripts need of the runner (test_engram --use-fp8 gathers FP8 storage; test_pp
# divides by get_rdma_gbs(), 0 without an RDMA NIC): both ranks gather FP8 bytes through gloo and see 450.
EXTRAS = r'''
import sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
from deep_ep.utils.envs import init_dist, get_rdma_gbs

def rank(local_rank, n):
    r, world, group = init_dist(local_rank, n)
    x = torch.full((2, 3), float(r + 1)).to(torch.float8_e4m3fn)
    out = torch.empty(2 * world, 3, dtype=torch.float8_e4m3fn)
    dist.all_gather_into_tensor(out, x, group)
    sys.stdout.write(f"rank {r} gathered {out.float()[:, 0].tolist()} rdma {get_rdma_gbs()}\n")
    sys.stdout.flush()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(rank, args=(2,), nprocs=2)
'''


def _v2_extras(tmp_path: Path) -> list:
    utils = tmp_path / "deep_ep" / "utils"
    utils.mkdir(parents=True)
    (utils / "envs.py").write_text(ORIGINAL + "def get_rdma_gbs(nic_name='mlx5_0'):\n    return 0\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_extras_stand_in.py").write_text(EXTRAS)
    return [sys.executable, "-m", "epcomm.testing.deepep_v2", str(tmp_path), "tests/test_extras_stand_in.py"]


def test_v2_runner_extras(runs):
    p = _result(runs["v2-extras"])
    assert p.returncode == 0, p.stderr[-3000:]
    lines = sorted(ln for ln in p.stdout.splitlines() if ln.startswith("rank"))
    assert lines == [f"rank {r} gathered [1.0, 1.0, 2.0, 2.0] rdma 450.0" for r in range(2)], (p.stdout, p.stderr[-2000:])
