"""Tier 2: NumPy is a dependency of epcomm, yet a Buffer on the reference backend runs without it (an install
with ``--no-deps`` beside a torch that came without it). Without NumPy torch warns "Failed to initialize NumPy"
at every import, once per process (five times in one ``epcomm bench``), and the GPU backends cannot run: so
``pip install -e .`` brings it. Two plain ``python`` processes with ``import numpy`` made to fail build a Buffer
on gloo, dispatch and combine, and exchange results the way ``epcomm check`` under torchrun does. Before,
the ranks exchanged pickled objects (``dist.all_gather_object``), which raised ``RuntimeError: Numpy is
not available``. Where NumPy is missing, the GPU backends say so instead of failing later.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

RANK = r'''
import sys
sys.modules["numpy"] = None  # import numpy raises ImportError, as where it is not installed
import torch, torch.distributed as dist
from epcomm import Buffer
from epcomm.testing.inputs import Case, make_topk, make_x
from epcomm.testing.launcher import _all_gather_results

rank, init = int(sys.argv[1]), sys.argv[2]
try:
    torch.zeros(1).numpy()
    raise SystemExit("numpy is importable here")
except RuntimeError:
    pass
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
case = Case(2, (5, 9), hidden=128, num_topk=2, num_experts=4, seed=2)
buf = Buffer(dist.group.WORLD, num_nvl_bytes=32 << 20)
idx, w = make_topk(case, rank)
x = make_x(case, rank)
per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, case.num_experts)
recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                          num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
out, _, _ = buf.combine(recv_x, handle)
got = _all_gather_results(dist.group.WORLD, rank, {"rank": rank, "received": recv_x.shape[0]}, 30.0)
print("results", [g["rank"] for g in got], sum(g["received"] for g in got), tuple(out.shape), flush=True)
dist.destroy_process_group()
'''


def test_a_buffer_runs_without_numpy(tmp_path):
    init = str(tmp_path / "rendezvous")
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), init], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed:\n{err[-3000:]}"
    from epcomm.testing.inputs import Case, make_topk

    case = Case(2, (5, 9), hidden=128, num_topk=2, num_experts=4, seed=2)
    per_rank = case.num_experts // 2
    rows = sum(len({int(e) // per_rank for e in tok if e >= 0}) for r in range(2) for tok in make_topk(case, r)[0])
    for r, (out, _) in enumerate(outs):
        line = next((ln for ln in out.splitlines() if ln.startswith("results")), "")
        assert line.startswith(f"results [0, 1] {rows} "), f"rank {r}: {out!r} (expected {rows} rows received)"
        assert line.endswith(f"({case.tokens[r]}, {case.hidden})"), f"rank {r}: combine gave {line!r}"


@pytest.mark.parametrize("backend", ["nvlink", "internode"])
def test_the_gpu_backends_say_they_need_numpy(monkeypatch, backend):
    import importlib

    import torch

    mod = importlib.import_module(f"epcomm.backends.{backend}")
    monkeypatch.setitem(sys.modules, "numpy", None)
    buf = types.SimpleNamespace(device=torch.device("cuda", 0))
    ok, why = mod.availability(buf)
    assert not ok and "numpy" in why, (ok, why)


def test_numpy_is_a_dependency_so_no_command_warns_about_it():
    """``pip install torch==2.13.0 -e .`` (README's first command) installs NumPy: without it torch's import warns
    in every process of every command, and the nvlink and internode backends are unavailable."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower() for req in project["dependencies"]}
    assert "numpy" in names, project["dependencies"]
