"""Tier 2 (gloo on CPU, 2 ranks): README's example, the first ```python block as CI takes it (``.ci/run`` runs it
under ``torchrun --standalone --nproc-per-node 2``), checks its own result and says so in one line a rank; with
a combine one bf16 step off in one element, it fails instead. Here the ranks come from the test launcher, whose
process group the example's ``init_process_group`` call finds already made."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import harness
import pytest

from epcomm.testing.launcher import parallel_launch

pytestmark = pytest.mark.skipif(harness.TRANSPORT == "nccl", reason="gloo-only: the example runs on CPU tensors")

README = Path(__file__).resolve().parents[2] / "README.md"


def _example() -> str:
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S)  # as .ci/run finds it
    assert block is not None, "README.md has no ```python example"
    return block.group(1)


def _run_once(code: str) -> dict:
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "README.md", "exec"), {"__name__": "__main__"})
        return {"printed": printed.getvalue(), "error": None}
    except AssertionError as e:
        return {"printed": printed.getvalue(), "error": str(e)}


def _worker(ctx, code: str) -> list[dict]:
    """The example as written, then with rank 1's combine output one bf16 step off in its first element."""
    import torch.distributed as dist

    import epcomm

    init, combine = dist.init_process_group, epcomm.Buffer.combine

    def one_step_off(self, *a, **k):
        out, weights, event = combine(self, *a, **k)
        if ctx.rank == 1:
            out[0, 0] = out[0, 0] * (1 + 2 ** -6)  # at least one bf16 step (7 fraction bits)
        return out, weights, event

    dist.init_process_group = lambda *a, **k: None  # the launcher's group is the example's
    try:
        faithful = _run_once(code)
        epcomm.Buffer.combine = one_step_off
        return [faithful, _run_once(code)]
    finally:
        dist.init_process_group, epcomm.Buffer.combine = init, combine


def test_the_readme_example_checks_its_result_and_says_so():
    code = _example()
    res = parallel_launch(2, _worker, code, backend="gloo", timeout_s=120)
    for rank, (faithful, broken) in enumerate(res):
        assert faithful["error"] is None, (rank, faithful)
        line = faithful["printed"].splitlines()
        assert len(line) == 1 and re.fullmatch(
            rf"rank {rank}: 64 tokens dispatched, \d+ rows received, combine checked: OK", line[0]), (rank, line)
    assert res[0][1]["error"] is None and res[0][1]["printed"].endswith("OK\n")  # rank 0's output left alone
    assert res[1][1]["error"] == "combine disagrees" and res[1][1]["printed"] == "", res[1][1]
