"""Tier 2 (gloo on CPU, subprocesses): ``epcomm bench --ab`` runs two source trees alternated run by
run, each an ordinary ``epcomm bench``, tags every row with its tree, commit and round, and reports a
failed run as failed. Tree A is this checkout; tree B a copy of its ``src`` (no ``.git``: its commit
comes from ``--ab-commits``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import harness
import pytest

import epcomm
from epcomm import cli
from epcomm.bench import ab, report

pytestmark = pytest.mark.skipif(harness.TRANSPORT == "nccl", reason="gloo-only: drives epcomm bench --device cpu")

SRC = Path(epcomm.__file__).resolve().parent
FAST = ["--device", "cpu", "--cases", "small", "--mode", "ht", "--tokens", "8", "--iters", "1", "--warmup", "0",
        "--sets", "1", "--timeout", "120"]


def _copy(tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    shutil.copytree(SRC, root / "src" / "epcomm", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_two_trees_alternate_run_by_run_at_world_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EPCOMM_COMMIT", "f" * 40)  # the caller's: describes neither tree, never passed on
    a, b = SRC.parents[1], _copy(tmp_path, "b")
    if not (a / "src" / "epcomm").is_dir():
        pytest.skip("epcomm is not imported from a source tree here")
    out = tmp_path / "ab.jsonl"
    rc = cli.main(["bench", "--ab", f"{a},new={b}", "--ab-commits", ",0123abc+dirty", "--rounds", "3",
                   "--world-size", "2", *FAST, "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    runs = [json.loads(line) for line in (tmp_path / "ab-runs" / "runs.jsonl").read_text().splitlines()]
    assert [(r["ab_round"], r["ab_tree"], r["status"]) for r in runs] == [
        (1, "A", "ok"), (1, "new", "ok"), (2, "A", "ok"), (2, "new", "ok"), (3, "A", "ok"), (3, "new", "ok")]
    rows = report.read_jsonl(out)
    assert len(rows) == 6 * 6  # HT: 3 reference ops + 3 of the peer, each run
    for r in rows:
        assert r["env"]["world_size"] == 2 and r["check"] == "pass" and r["timed_check"] == "pass"
        assert r["ab_path"] == str((a if r["ab_tree"] == "A" else b).resolve())
        if r["ab_tree"] == "new":  # no .git: the commit it was given
            assert (r["ab_commit"], r["ab_dirty"], r["env"]["commit_source"]) == ("0123abc", True, "EPCOMM_COMMIT")
        else:  # this checkout: its own git, or unknown; never the caller's EPCOMM_COMMIT
            assert r["ab_commit"] != "f" * 40 and r["env"]["commit_source"] in ("git", "pip", None)
    summary = [json.loads(line) for line in (tmp_path / "ab-summary.jsonl").read_text().splitlines()]
    assert len(summary) == 2 * 6 and all(s["rounds"] == s["of"] == 3 for s in summary)
    for s in summary:
        mine = sorted(r["median_us"] for r in rows if r["ab_tree"] == s["tree"] and r["op"] == s["op"]
                      and r["dtype"] == s["dtype"] and r["backend"] == s["backend"])
        assert (s["min_us"], s["median_us"], s["max_us"]) == (mine[0], mine[1], mine[2])
    assert "A/B: 6 runs" in text and "0123abc+dirty" in text


def test_a_failed_run_is_reported_as_failed(tmp_path):
    """World 1: a tree whose bench raises yields a failed run record (the reason, its log), no rows."""
    b = _copy(tmp_path, "broken")
    runner = b / "src" / "epcomm" / "bench" / "runner.py"
    line = '    if device not in ("cpu", "cuda"):\n'
    runner.write_text(runner.read_text().replace(line, '    raise RuntimeError("tree B is broken")\n' + line))
    tree = ab.Tree("B", b.resolve())
    assert ab.imported_from(tree).startswith(str(b.resolve()))
    rec, rows = ab.run_one(tree, 2, 3, ["--world-size", "1", *FAST], tmp_path, timeout_s=120)
    assert rows == [] and rec["ab_round"] == 2 and rec["ab_run"] == 3 and rec["ab_commit"] == "unknown"
    assert rec["status"].startswith("failed (exit 1): RuntimeError: tree B is broken"), rec
    assert Path(rec["log"]).read_text().count("Traceback") == 1
