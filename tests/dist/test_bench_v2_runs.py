"""Tier 2 (gloo on CPU, spawned processes): ``epcomm bench --api v2`` end to end with an SM sweep (world 2;
world 1 as ``--api both``, after the V1 rows), and its check as timed catching an ``ElasticBuffer`` whose FP8 dispatch damages one received row
(a stand-in wrapping a real one), beside a faithful stand-in that passes."""

from __future__ import annotations

import json
import os

import harness
import pytest
import torch

from epcomm import cli
from epcomm.bench import report, table
from epcomm.bench.cases import CASE_SETS
from epcomm.testing.launcher import parallel_launch

EXTRAS = ("engram_fetch", "pp_send_recv", "all_gather")

pytestmark = pytest.mark.skipif(
    harness.TRANSPORT == "nccl",
    reason="gloo-only: drives epcomm bench with --device cpu and gloo launches (run it without "
           "EPCOMM_TEST_TRANSPORT)")


@pytest.fixture(autouse=True)
def _deadline(monkeypatch):
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "60")


@pytest.mark.parametrize("world, api", [(1, "both"), (2, "v2")])
def test_v2_bench_rows_are_checked_as_timed_one_set_per_sm_count(world, api, tmp_path, capsys, monkeypatch):
    """World 1 runs as from a source archive (the package in no checkout, no ``EPCOMM_COMMIT``): its rows say
    ``git_sha`` "unknown", a valid record. World 2 records what this tree says of itself (a commit in a
    checkout, "unknown" in an archive)."""
    if world == 1:
        (tmp_path / "archive" / "epcomm").mkdir(parents=True)
        monkeypatch.setattr(report, "_package_dir", lambda: tmp_path / "archive" / "epcomm")
        monkeypatch.delenv("EPCOMM_COMMIT", raising=False)
        monkeypatch.delenv("EPCOMM_COMMIT_DIRTY", raising=False)
    sha = report.git_info()[0]
    assert world != 1 or sha == "unknown"
    out = tmp_path / "rows.jsonl"
    rc = cli.main(["bench", "--api", api, "--cases", "small", "--world-size", str(world), "--device", "cpu",
                   "--iters", "2", "--warmup", "0", "--sets", "2", "--num-sms", "4,8", "--out", str(out),
                   "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    every = [json.loads(line) for line in out.read_text().splitlines()]
    extras = [r for r in every if r["op"] in EXTRAS]
    rows = [r for r in every if r["api"] == "v2" and r["op"] not in EXTRAS]
    v1 = [r for r in every if r["api"] == "v1"]
    # the experimental calls: once a case after its V2 rows (pipeline and all-gather need 2 ranks), checked as timed
    assert [r["op"] for r in extras] == (list(EXTRAS) if world > 1 else ["engram_fetch"])
    assert every[-len(extras):] == extras
    for r in extras:
        assert r["api"] == "v2" and r["sms"] == 0 and r["logical_gbps"] > 0 and r["timing"] == "wall", r
        assert r["check"] == "pass" and r["timed_check"] == "pass" and r["timed_oracle"] == "reference", r
    # "both": the V1 rows of the small cases first (the reference's 3 + 2 + 4, the peer's 3 + 2), V1 settings
    assert len(v1) == (14 if api == "both" else 0) and every[:len(v1)] == v1
    assert all(r["check"] == "pass" and r["layout"] is None and r["sms"] == "gloo" for r in v1)
    assert len(rows) == 2 * 14 and [r["sms"] for r in rows] == [4] * 14 + [8] * 14
    combos = {(r["op"], r["dtype"], r["layout"], r["cpu_sync"]) for r in rows if r["sms"] == 8}
    assert len(combos) == 14 and {c[2] for c in combos} == {"contiguous", "expanded"}
    assert {c[1] for c in combos if c[0] == "dispatch"} == {"bf16", "fp8"}
    for r in rows:
        assert r["world_size"] == world and r["timing"] == "wall" and r["tokens"] == 64 and r["mode"] == "ht"
        assert r["check"] == "pass" and r["timed_check"] == "pass" and r["timed_oracle"] == "reference", r
        assert r["theoretical_num_sms"] == rows[0]["theoretical_num_sms"] >= 1
        assert r["median_us"] > 0 and r["host_calib_us"] > 0 and 0 < r["host_p10_us"] <= r["host_us"] <= r["host_p90_us"]
        assert r["env"]["device"] == "cpu" and r["env"]["git_sha"] == sha and r["env"]["epcomm_env"]
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("case "))
    assert "layout" in lines[head] and "theory-SMs" in lines[head]
    assert f"(git {sha[:12]}" in text
    assert any(line.startswith("v2: ElasticBuffer rows;") for line in lines[:head])  # the header explains them
    assert sum(" expanded " in line and " none " in line for line in lines[head:]) == 2 * 4  # 2 dispatch, combine, the pair


class _Stand:
    """An ElasticBuffer stand-in: delegates; ``corrupt`` flips one bit of one valid received FP8 row after
    every FP8 dispatch (the first row, or the slot of its first lane when expanded)."""

    def __init__(self, buf, how: str):
        self.buf, self.how = buf, how
        self.backend_name = f"fake-{how}"

    def __getattr__(self, name):
        return getattr(self.buf, name)

    def dispatch(self, x, **kw):
        out = self.buf.dispatch(x, **kw)
        rx, _, _, hd, _ = out
        if self.how == "corrupt" and isinstance(x, tuple) and int(hd.psum_num_recv_tokens_per_scaleup_rank[-1]):
            row = 0
            if kw.get("do_expand"):
                lanes = hd.recv_src_metadata[0, 2:]
                row = int(lanes[lanes >= 0][0])
            rx[0].view(torch.uint8)[row, 0] ^= 1
        return out


def _stand_worker(ctx):
    os.environ["EPCOMM_TIMEOUT_S"] = "60"
    from epcomm.bench.runner import BenchPlan
    from epcomm.bench.v2 import make_elastic, run_v2_case

    (ht, _) = CASE_SETS["small"]
    plan = BenchPlan(cases=(ht,), iters=2, warmup=0, sets=2, api="v2")
    fast, ref = make_elastic(ctx.group, [ht], "auto")
    try:
        return {how: run_v2_case(ctx, plan, ht, _Stand(fast, how), ref, (4,)) for how in ("corrupt", "ok")}
    finally:
        fast.destroy()
        ref.destroy()


def test_a_damaged_timed_dispatch_fails_its_rows_and_a_faithful_one_passes():
    res = parallel_launch(2, _stand_worker, backend="gloo", timeout_s=120)
    for how in ("corrupt", "ok"):
        rows = report.merge_ranks([r[how] for r in res], env={}, iters=2, warmup=0)
        assert len(rows) == 14 and all(r["backend"] == f"fake-{how}" for r in rows)
        for r in rows:
            damaged = how == "corrupt" and r["op"] == "dispatch" and r["dtype"] == "fp8"
            if damaged:  # every rank's timed call (eager) differs from the oracle's in its received x
                for rank in (0, 1):
                    assert f"rank {rank}: FAIL: timed dispatch ({r['layout']}, fp8" in r["timed_check"], r
                    assert f"rank {rank}: FAIL: timed dispatch" in r["check"], r
                assert ") x: 1 of " in r["timed_check"] and table.timed_mark(r) == "FAIL"
            else:  # BF16 rows (what combine and the pair send back) are untouched
                assert r["check"] == "pass" and r["timed_check"] == "pass" and table.timed_mark(r) == "ref", r


class _DamagedExtras:
    """An ElasticBuffer stand-in for the experimental calls' rows: flips one bit of what each call returns."""

    def __init__(self, buf):
        self.buf = buf
        self.backend_name = "fake-extras"

    def __getattr__(self, name):
        return getattr(self.buf, name)

    def engram_fetch(self, *a, **kw):
        hook = self.buf.engram_fetch(*a, **kw)

        def damaged():
            data, sf = hook()
            data.view(torch.uint8).view(-1)[0] ^= 1
            return data, sf
        return damaged

    def pp_recv(self, t, *a, **kw):
        self.buf.pp_recv(t, *a, **kw)
        t.view(torch.uint8).view(-1)[-1] ^= 1

    def all_gather(self, t):
        out, wait = self.buf.all_gather(t)

        def damaged():
            wait()
            out.view(torch.uint8).view(-1)[3] ^= 1
        return out, damaged


def _extras_worker(ctx):
    os.environ["EPCOMM_TIMEOUT_S"] = "60"
    from epcomm.bench import v2_extras
    from epcomm.bench.runner import BenchPlan

    (ht, _) = CASE_SETS["small"]
    plan = BenchPlan(cases=(ht,), iters=2, warmup=0, sets=2, api="v2")
    made = v2_extras._buffers

    def damaged(*a):
        fast, ref = made(*a)
        return _DamagedExtras(fast), ref
    v2_extras._buffers = damaged
    return v2_extras.run_extras_case(ctx, plan, ht)


def test_damaged_experimental_calls_fail_their_rows():
    """Each experimental call's row is checked as timed: a bit flipped in what the timed call returns fails both
    the case check and the timed check (the faithful rows: test_v2_bench_rows_are_checked_as_timed_...)."""
    res = parallel_launch(2, _extras_worker, backend="gloo", timeout_s=120)
    rows = report.merge_ranks(res, env={}, iters=2, warmup=0)
    assert [r["op"] for r in rows] == list(EXTRAS)
    for r in rows:
        assert r["backend"] == "fake-extras" and table.timed_mark(r) == "FAIL", r
        assert f"FAIL: timed {r['op']} (set" in r["timed_check"] and " differ" in r["timed_check"], r
        for rank in (0, 1):
            assert f"rank {rank}: FAIL: timed {r['op']}" in r["check"], r
