"""Tier 2 (gloo on CPU): ``epcomm check`` and ``epcomm bench`` launched by torchrun take their world from
the environment instead of spawning, here as two virtual nodes of one rank (``EPCOMM_GPUS_PER_NODE=1``).

torchrun (``python -m torch.distributed.run --standalone --nproc-per-node 2``) starts two processes
with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; each runs the command
as one rank, and rank 0 alone prints. The first tests parse that environment without any process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import harness
import pytest

from epcomm import cli
from epcomm.testing.launcher import EnvWorld, env_world

pytestmark = pytest.mark.skipif(harness.TRANSPORT == "nccl", reason="gloo-only: launches CPU ranks with torchrun")

TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_env_world_reads_torchruns_variables():
    assert env_world({}) is None
    assert env_world({"PATH": "/bin"}) is None
    assert env_world(TORCHRUN_ENV) == EnvWorld(rank=1, world_size=2, local_rank=0, local_world_size=1,
                                               master_addr="10.0.0.1", master_port=29500)
    no_local_world = {k: v for k, v in TORCHRUN_ENV.items() if k != "LOCAL_WORLD_SIZE"}
    assert env_world({**no_local_world, "LOCAL_RANK": "1"}).local_world_size == 2  # defaults to WORLD_SIZE


@pytest.mark.parametrize("change, message", [
    ({"MASTER_ADDR": None}, "MASTER_ADDR is not"),
    ({"LOCAL_RANK": None, "MASTER_PORT": None}, "LOCAL_RANK, MASTER_PORT are not"),
    ({"RANK": "one"}, "RANK must be an integer, got 'one'"),
    ({"RANK": "2"}, "RANK must be < WORLD_SIZE=2, got 2"),
    ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE must be >= 1, got 0"),
    ({"LOCAL_RANK": "1"}, "LOCAL_RANK must be < LOCAL_WORLD_SIZE=1, got 1"),
])
def test_env_world_names_a_bad_variable(change, message):
    env = {k: v for k, v in {**TORCHRUN_ENV, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        env_world(env)


@pytest.mark.parametrize("command", ["check", "bench"])
def test_world_size_other_than_the_launchers_is_a_user_error(monkeypatch, capsys, command):
    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    assert cli.main([command, "--world-size", "4", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--world-size 4, but the launcher started WORLD_SIZE=2" in err, err


def _torchrun(args: list[str], tmp_path, timeout: float = 60.0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env.update(EPCOMM_GPUS_PER_NODE="1", EPCOMM_TIMEOUT_S="60", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def test_check_under_torchrun(tmp_path):
    p = _torchrun(["-m", "epcomm", "check", "--device", "cpu"], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("epcomm check: 2 ranks on gloo") == 1  # rank 0 alone prints
    assert "rank 0: backend reference" in p.stdout and "rank 1: backend reference" in p.stdout
    assert p.stdout.rstrip().endswith("PASS"), p.stdout


def test_bench_under_torchrun(tmp_path):
    out = tmp_path / "rows.jsonl"
    p = _torchrun(["-m", "epcomm", "bench", "--cases", "small", "--mode", "ht", "--device", "cpu", "--iters", "2",
                   "--warmup", "0", "--sets", "2", "--out", str(out), "--no-progress"], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["backend"], r["op"], r["dtype"]) for r in rows} == {
        (b, op, dt) for b in ("reference", "gloo-a2a") for op, dt in
        (("dispatch", "bf16"), ("dispatch", "fp8"), ("combine", "bf16"))}
    assert all(r["world_size"] == 2 and r["check"] == "pass" and r["env"]["transport"] == "gloo" for r in rows)
    assert p.stdout.count("wrote 6 rows") == 1 and p.stdout.count("\nsmall ") == 6  # one table, rank 0's


SCRIPT = textwrap.dedent('''
    import sys
    import torch
    from epcomm import Buffer
    from epcomm.testing.launcher import env_launch, env_world

    def nodes(ctx, fail_rank):
        if ctx.rank == fail_rank:
            raise RuntimeError(f"rank {ctx.rank} gives up")
        buf = Buffer(ctx.group)
        per_rank, per_node, _, _, _ = buf.get_dispatch_layout(torch.tensor([[0, 3], [1, -1]]), 4)
        return buf.node_map[0], per_node.tolist(), buf.backend_name

    out = env_launch(env_world(), 2, nodes, int(sys.argv[1]), backend="gloo")
    print(f"rank {env_world().rank}: {out}")
''')


def test_env_launch_runs_two_virtual_nodes_and_reports_a_failing_rank(tmp_path):
    """Each process joins torchrun's world, the group is two nodes of one rank (so the layout counts
    tokens per node), every rank gets every rank's result; a rank that raises is named."""
    (tmp_path / "nodes.py").write_text(SCRIPT)
    p = _torchrun(["nodes.py", "-1"], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    want = str([([0, 1], [2, 1], "reference")] * 2)  # token 0 reaches both nodes, token 1 node 0 only
    assert f"rank 0: {want}" in p.stdout and f"rank 1: {want}" in p.stdout, p.stdout
    p = _torchrun(["nodes.py", "1"], tmp_path)
    assert p.returncode != 0
    assert "rank 1 failed" in p.stderr + p.stdout and "rank 1 gives up" in p.stderr + p.stdout
