"""Tier 1: ``epcomm bench --ab`` (bench/ab.py): parsing two trees, the arguments every run gets, and the
summary over rounds (median of medians, p10, spread, no run left out), on rows written out by hand.
The runs themselves, as subprocesses on gloo: tests/dist/test_bench_ab_runs.py."""

from __future__ import annotations

import argparse
import json
import subprocess

import pytest

from epcomm import cli
from epcomm.bench import ab


def _tree(tmp_path, name):
    root = tmp_path / name
    (root / "src" / "epcomm").mkdir(parents=True)
    (root / "src" / "epcomm" / "__init__.py").write_text("")
    return root


def test_parse_trees(tmp_path):
    a, b = _tree(tmp_path, "old"), _tree(tmp_path, "new")
    ta, tb = ab.parse_trees(f"{a},{b}")
    assert (ta.label, ta.path, ta.commit, tb.label, tb.path) == ("A", a.resolve(), None, "B", b.resolve())
    ta, tb = ab.parse_trees(f"base={a},head={b}", "59E45D1,7796da0+dirty")
    assert (ta.label, ta.commit, ta.dirty) == ("base", "59e45d1", False)
    assert (tb.label, tb.commit, tb.dirty) == ("head", "7796da0", True)
    assert ab.parse_trees(f"{a},{b}", ",7796da0")[0].commit is None
    for spec, commits, match in ((f"{a}", None, "two trees"), (f"{a},{tmp_path}", None, "src/epcomm"),
                                 (f"x={a},x={b}", None, "different labels"),
                                 (f"{a},{b}", "main,", "not a git commit"), (f"{a},{b}", "abcdef1", "two commits")):
        with pytest.raises(ValueError, match=match):
            ab.parse_trees(spec, commits)


def _bench_parser():
    p = cli.build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return p, sub.choices["bench"]


def test_every_bench_option_is_forwarded_or_kept_by_the_parent():
    """A bench option added later must be decided on: forwarded to the runs or the parent's own."""
    _, bench = _bench_parser()
    dests = {a.dest for a in bench._actions if a.dest != "help"}
    assert dests == set(ab.FORWARD) | set(ab.FLAGS) | ab.NOT_FORWARDED


def test_child_arguments_repeat_the_parsed_options():
    p, _ = _bench_parser()
    args = p.parse_args(["bench", "--ab", "a,b", "--cases", "small,ll-dsv3", "--tokens", "1,128", "--world-size",
                         "2", "--device", "cpu", "--iters", "5", "--cached", "--no-graph", "--out", "x.jsonl",
                         "--rounds", "4"])
    argv = ab.child_argv(args)
    assert argv == ["--cases", "small,ll-dsv3", "--mode", "both", "--tokens", "1,128", "--backend", "auto",
                    "--iters", "5", "--sets", "4", "--world-size", "2", "--device", "cpu", "--seed", "0",
                    "--timeout", "1800.0", "--cached", "--no-graph"]
    assert p.parse_args(["bench", *argv]).tokens == [1, 128]  # what a run parses back


def test_v2_runs_get_the_api_and_its_rows_stay_apart_by_layout_and_sync(tmp_path):
    """``--ab --api v2``: every run gets ``--api v2`` (V1 runs get no --api: trees before it lack the option),
    and V2 rows of one op that differ only in layout, CPU sync or SM count are summarised apart."""
    p, _ = _bench_parser()
    argv = ab.child_argv(p.parse_args(["bench", "--ab", "a,b", "--api", "v2", "--device", "cpu"]))
    assert argv[argv.index("--api") + 1] == "v2"
    assert "--api" not in ab.child_argv(p.parse_args(["bench", "--ab", "a,b", "--device", "cpu"]))
    runs = [{"ab_tree": t, "ab_round": r, "ab_run": i, "status": "ok", "rows": 4, "log": f"run{i}.log"}
            for i, (r, t) in enumerate((r, t) for r in (1, 2, 3) for t in "AB")]
    rows = [dict(_row(t, r, 10.0 + 5 * sync + 20 * (layout == "expanded") + sms), api="v2", layout=layout,
                 cpu_sync=bool(sync), sms=sms)
            for t in "AB" for r in (1, 2, 3) for layout in ("contiguous", "expanded") for sync in (0, 1)
            for sms in (0, 1)]
    summary = ab.summarize(rows, runs, ["A", "B"])
    assert len(summary) == 16  # 2 layouts x 2 syncs x 2 SM counts x 2 trees, each its own line
    assert all(s["rounds"] == 3 and s["min_us"] == s["max_us"] for s in summary)  # no two ops mixed
    text = ab.render_summary(summary, runs, (ab.Tree("A", tmp_path), ab.Tree("B", tmp_path)))
    assert "dispatch-bf16 expanded no-sync" in text and "dispatch-bf16 contiguous " in text


def _row(tree, rnd, median, *, host=None, op="dispatch", check="pass"):
    return {"case": "small", "mode": "ht", "tokens": 64, "hidden": 256, "topk": 4, "experts": 16,
            "backend": "reference", "op": op, "dtype": "bf16", "phase": "total", "timing": "wall", "cached": False,
            "median_us": median, "p10_us": median * 0.5, "host_us": host if host is not None else median / 2,
            "check": check, "timed_check": "pass", "ab_tree": tree, "ab_round": rnd,
            "ab_commit": {"A": "59e45d1", "B": "7796da0"}[tree], "ab_dirty": tree == "B"}


def test_summary_is_the_median_of_round_medians_with_spread_and_no_run_left_out(tmp_path):
    runs = [{"ab_tree": t, "ab_round": r, "ab_run": i, "status": "ok", "rows": 1, "log": f"run{i}.log"}
            for i, (r, t) in enumerate((r, t) for r in (1, 2, 3) for t in "AB")]
    runs[3]["status"] = "failed (exit 1): RuntimeError: boom"  # round 2 of tree B
    rows = [_row("A", 1, 10.0), _row("A", 2, 40.0, host=4.0), _row("A", 3, 20.0),
            _row("B", 1, 16.0), _row("B", 3, 12.0, check="FAIL: recv_x")]
    a, b = ab.summarize(rows, runs, ["A", "B"])
    # the median of the rounds' medians (not their mean, 23.3), the median of their p10s, the spread
    assert (a["median_us"], a["p10_us"], a["min_us"], a["max_us"]) == (20.0, 10.0, 10.0, 40.0)
    assert (a["host_us"], a["host_min_us"], a["host_max_us"]) == (5.0, 4.0, 10.0)  # 5, 4, 10 by round
    assert a["rounds"] == 3 and a["of"] == 3 and a["missing_rounds"] == [] and a["vs_first"] == 1.0
    assert (b["median_us"], b["min_us"], b["max_us"], b["rounds"], b["missing_rounds"]) == (14.0, 12.0, 16.0, 2, [2])
    assert b["vs_first"] == pytest.approx(0.7) and b["commits"] == ["7796da0+dirty"]
    assert b["checks"] == ["FAIL: recv_x", "pass"]
    text = ab.render_summary([a, b], runs, (ab.Tree("A", tmp_path), ab.Tree("B", tmp_path)))
    assert "run 3 (round 2, tree B): failed (exit 1): RuntimeError: boom -- log run3.log" in text
    line_b = next(line for line in text.splitlines() if " B " in line and "dispatch-bf16" in line)
    assert "2/3" in line_b and "12.0..16.0" in line_b and "0.700" in line_b and "FAIL: recv_x" in line_b
    assert "7796da0+dirty" in line_b


def test_fewer_than_three_rounds_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--rounds must be >= 3"):
        ab.run_ab((ab.Tree("A", tmp_path), ab.Tree("B", tmp_path)), [], rounds=2, work=tmp_path, timeout_s=1)


def test_runs_alternate_a_b_per_round_and_a_failed_run_stays(tmp_path, monkeypatch):
    trees = (ab.Tree("A", tmp_path / "a"), ab.Tree("B", tmp_path / "b"))
    monkeypatch.setattr(ab, "imported_from", lambda t: str(t.path / "src" / "epcomm" / "__init__.py"))
    order = []

    def run_one(tree, rnd, run, argv, work, timeout_s):
        order.append((rnd, tree.label, run))
        failed = (rnd, tree.label) == (2, "B")
        rec = {"ab_tree": tree.label, "ab_round": rnd, "ab_run": run, "status": "failed (exit 1): x" if failed
               else "ok", "rows": 0 if failed else 1, "log": "l"}
        return rec, [] if failed else [_row(tree.label, rnd, 1.0)]

    monkeypatch.setattr(ab, "run_one", run_one)
    runs, rows = ab.run_ab(trees, [], rounds=3, work=tmp_path, timeout_s=1, say=lambda s: None)
    assert order == [(1, "A", 0), (1, "B", 1), (2, "A", 2), (2, "B", 3), (3, "A", 4), (3, "B", 5)]
    assert len(runs) == 6 and runs[3]["status"].startswith("failed") and len(rows) == 5
    monkeypatch.setattr(ab, "imported_from", lambda t: "/elsewhere/epcomm/__init__.py")
    with pytest.raises(ValueError, match="would import epcomm from /elsewhere"):
        ab.run_ab(trees, [], rounds=3, work=tmp_path, timeout_s=1)


def test_a_run_gets_its_trees_commit_and_never_the_callers(tmp_path, monkeypatch):
    monkeypatch.setenv("EPCOMM_COMMIT", "f" * 40)
    monkeypatch.setenv("PYTHONPATH", "/x")
    env = ab._env(ab.Tree("A", tmp_path))
    assert "EPCOMM_COMMIT" not in env and "EPCOMM_COMMIT_DIRTY" not in env
    assert env["PYTHONPATH"].split(":") == [str(tmp_path / "src"), "/x"]
    env = ab._env(ab.Tree("B", tmp_path, "7796da0", True))
    assert (env["EPCOMM_COMMIT"], env["EPCOMM_COMMIT_DIRTY"]) == ("7796da0", "1")



@pytest.mark.parametrize("run_sha", [None, "0123abcd" * 5])
def test_a_run_records_its_own_commit_else_the_one_given_for_its_tree(tmp_path, monkeypatch, run_sha):
    """An older tree does not read EPCOMM_COMMIT: its rows (no .git on a GPU machine) say no commit, and
    the commit given for the tree stands in; a commit the run found itself is kept."""
    def fake_run(cmd, env, stdout, stderr, timeout, check, cwd):
        out = cmd[cmd.index("--out") + 1]
        row = {**_row("A", 1, 5.0), "env": {"git_sha": run_sha, "git_dirty": False if run_sha else None}}
        for k in [k for k in row if k.startswith("ab_")]:
            del row[k]
        report_rows = [row]
        with open(out, "w") as f:
            f.write("\n".join(json.dumps(r) for r in report_rows) + "\n")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(ab.subprocess, "run", fake_run)
    rec, rows = ab.run_one(ab.Tree("base", tmp_path, "59e45d1", True), 2, 4, [], tmp_path, timeout_s=5)
    assert rec["status"] == "ok" and rec["rows"] == 1
    want = (run_sha, False) if run_sha else ("59e45d1", True)
    assert (rows[0]["ab_commit"], rows[0]["ab_dirty"]) == want and rec["ab_commit"] == want[0]
    assert (rows[0]["ab_tree"], rows[0]["ab_round"], rows[0]["ab_run"]) == ("base", 2, 4)
