"""Tier 2 (gloo on CPU, spawned processes): ``epcomm bench`` and ``epcomm check`` end to end, and
the benchmark's correctness check catching a broken backend.

``bench`` runs the ``small`` cases on 2 ranks with few iterations through ``epcomm.cli.main`` and
checks the JSONL rows and the table (printed last). The check test wraps a reference Buffer in a
"fast backend" that corrupts one byte (it must FAIL) or reorders rows within a low-latency source
block (allowed: it must pass), beside a true reference Buffer; and a faithful wrapper gets rows
paired with the reference's (speedup, the same checks).
"""

from __future__ import annotations

import functools
import json
import os
import re

import harness
import pytest
import torch

from epcomm import Buffer, cli
from epcomm.bench import workloads
from epcomm.bench.cases import CASE_SETS
from epcomm.testing.launcher import parallel_launch

pytestmark = pytest.mark.skipif(
    harness.TRANSPORT == "nccl",
    reason="gloo-only: drives epcomm bench/check with --device cpu and gloo launches (run it without "
           "EPCOMM_TEST_TRANSPORT)")


@pytest.fixture(autouse=True)
def _deadline(monkeypatch):
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "60")


def test_bench_small_end_to_end(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    rc = cli.main(["bench", "--cases", "small", "--world-size", "2", "--device", "cpu", "--iters", "2",
                   "--warmup", "0", "--sets", "2", "--out", str(out), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # HT: dispatch bf16, dispatch fp8, combine bf16; LL: dispatch, combine, and their send/recv halves;
    # then the peer baseline (gloo-a2a): HT's three and LL's dispatch and combine
    ref_rows = [r for r in rows if r["backend"] == "reference"]
    peer_rows = [r for r in rows if r["backend"] == "gloo-a2a"]
    assert len(ref_rows) == 3 + 2 + 4 and len(peer_rows) == 3 + 2 and len(rows) == 14
    peer_us = {(r["mode"], r["op"], r["dtype"]): r["median_us"] for r in peer_rows}
    for r in rows:
        assert r["world_size"] == 2 and r["timing"] == "wall"
        assert r["check"] == "pass" and r["sms"] == "gloo" and r["iters"] == 2
        # every row is also checked the way it was timed (the next set in rotation once more): against
        # the reference's result on those inputs, the peer by its round trip
        assert r["timed_check"] == "pass", r
        assert r["timed_oracle"] == ("round trip" if r["backend"] == "gloo-a2a" else "reference"), r
        assert r["caveat"] == "CPU ranks on gloo: these times are not GPU performance"
        if r["phase"] == "total":
            want = {"gloo-a2a": "per-selection", "reference": f"{r['mode']}-reference-rows"}[r["backend"]]
            assert r["link_counting"] == want, r
        assert r["median_us"] > 0 and r["p10_us"] <= r["p90_us"]
        assert r["ref_median_us"] == (r["median_us"] if r["backend"] == "reference" else None) or \
            r["backend"] == "gloo-a2a"
        if r["phase"] == "total":  # speedup: the peer's median over this one
            assert r["peer_us"] == peer_us[(r["mode"], r["op"], r["dtype"])]
            assert r["speedup"] == pytest.approx(r["peer_us"] / r["median_us"])
        else:
            assert r["speedup"] is None
        assert r["env"]["transport"] == "gloo" and r["env"]["world_size"] == 2 and r["env"]["device"] == "cpu"
        if r["phase"] == "total":
            assert 0 < r["link_bytes"] < r["logical_bytes"] and r["logical_gbps"] > 0
        else:
            assert r["logical_bytes"] is None
    assert {(r["mode"], r["op"], r["dtype"], r["phase"]) for r in rows} >= {
        ("ht", "dispatch", "bf16", "total"), ("ht", "dispatch", "fp8", "total"), ("ht", "combine", "bf16", "total"),
        ("ll", "dispatch", "fp8", "send"), ("ll", "combine", "bf16", "recv")}
    lines = text.rstrip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("case "))
    assert lines[0].startswith("wrote 14 rows")
    assert "NOTE: CPU ranks on gloo: these times are not GPU performance" in lines[:header]
    assert max(map(len, lines[:header])) <= 110  # the legend: a few short lines
    body, summary = lines[header + 2:header + 2 + len(rows)], lines[header + 2 + len(rows):]
    assert [line.split()[:2] for line in body] == [[r["case"], r["mode"]] for r in rows]  # the mode column
    timed = lines[header].index("timed")
    assert {line[timed:timed + 4] for line in body} == {"ref ", "trip"}
    # the closing summary: per path (one case each here), the reference (epcomm on CPU) against gloo-a2a
    assert summary[0].startswith("summary: epcomm against its peer gloo-a2a") and summary[-1] == \
        "checks: all 14 rows pass; timed calls: 9 ref, 5 trip"
    paths = {tuple(line.split()[:2]): line.split()[2:] for line in summary[4:-1]}
    totals = [r for r in ref_rows if r["phase"] == "total"]
    assert set(paths) == {(r["mode"], f"{r['op']}-{r['dtype']}") for r in totals}
    for r in totals:
        assert paths[(r["mode"], f"{r['op']}-{r['dtype']}")] == ["reference", "wall", "1"] + [f"{r['speedup']:.2f}x"] * 3


def test_bench_profile_writes_tables_per_operation(tmp_path, capsys):
    """``epcomm bench --profile DIR`` on CPU ranks: per operation and rank a host table (µs per call,
    the Buffer's call among its functions) and a torch.profiler table, and the host primitives."""
    prof = tmp_path / "prof"
    rc = cli.main(["bench", "--cases", "small", "--mode", "ll", "--world-size", "2", "--device", "cpu",
                   "--iters", "2", "--warmup", "0", "--sets", "2", "--no-progress", "--profile", str(prof)])
    assert rc == 0, capsys.readouterr().out
    host = sorted(prof.glob("*.host.txt"))
    torch_tables = sorted(prof.glob("*.torch.txt"))
    # LL small: dispatch, combine, their hook halves (reference), the peer's two; on each of 2 ranks
    assert len(host) == len(torch_tables) == 2 * (4 + 2), [p.name for p in host]
    dispatch = (prof / "small_ll_T_32_dispatch-fp8_reference.rank0.host.txt").read_text()
    assert "host time per call" in dispatch and "with callees us" in dispatch
    assert re.search(r"buffer\w*\.py:\d+\(low_latency_dispatch\)", dispatch), dispatch
    assert "Self CPU" in (prof / "small_ll_T_32_combine-bf16_gloo-a2a.rank1.torch.txt").read_text()
    primitives = (prof / "host-primitives.rank0.txt").read_text()
    assert "torch.empty" in primitives and len(primitives.splitlines()) >= 4


def test_check_command(capsys):
    assert cli.main(["check", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("PASS") and "2 ranks on gloo" in out


class _Wrapped:
    """A Buffer stand-in for a fast backend: delegates, then damages or reorders some results."""

    def __init__(self, buf: Buffer, how: str):
        self.buf, self.how = buf, how
        self.backend_name = f"fake-{how}"
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.buf, name)

    def dispatch(self, x, **kw):
        out = self.buf.dispatch(x, **kw)
        self.calls += 1
        # "late": right in the case check (its first two dispatches), wrong afterwards, as a path that
        # is only broken the way it is timed (the copy engine under graph replay was)
        broken = self.how == "corrupt" or (self.how == "late" and self.calls > 2)
        if broken and not isinstance(x, tuple) and out[0].numel():
            out[0].view(torch.int16)[0, -1] ^= 1  # row 0: also inside the rows a worst-case dispatch fills
        return out

    @staticmethod
    def _blocks(handle):
        begin, count = (v.tolist() for v in (handle.layout_range >> 32, handle.layout_range & 0xFFFFFFFF))
        for e, (bs, cs) in enumerate(zip(begin, count)):
            for b, c in zip(bs, cs):
                idx = torch.arange(b, b + c)
                yield e, idx, idx.flip(0)

    def low_latency_dispatch(self, *a, **kw):
        recv_x, cnt, handle, ev, hook = self.buf.low_latency_dispatch(*a, **kw)
        self.calls += 1
        if self.how == "late" and self.calls > 1:  # right in the case check only

            def damage():
                if int(cnt[0]) > 0:
                    recv_x[1][0, 0, 0] *= 2
            hook = self._after(hook, damage, kw)
        if self.how == "reorder":  # reverse every (expert, source rank) block: allowed by the contract
            for e, idx, rev in self._blocks(handle):
                recv_x[0].view(torch.uint8)[e, idx] = recv_x[0].view(torch.uint8)[e, rev].clone()
                recv_x[1][e, idx] = recv_x[1][e, rev].clone()
                handle.recv_src_info[e, idx] = handle.recv_src_info[e, rev].clone()
        if self.how == "corrupt" and int(cnt[0]) > 0:
            recv_x[1][0, 0, 0] *= 2
        return recv_x, cnt, handle, ev, hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, **kw):
        if self.how == "reorder":  # a consistent backend combines in its own dispatch order
            x = x.clone()
            for e, idx, rev in self._blocks(handle):
                x[e, idx] = x[e, rev].clone()
        out = self.buf.low_latency_combine(x, topk_idx, topk_weights, handle, **kw)
        if self.how == "late" and self.calls > 1:
            def damage():
                out[0][0, 0] += 1.0
            return out[0], out[1], self._after(out[2], damage, kw)
        return out

    @staticmethod
    def _after(hook, damage, kw):
        """Damage the result once it is complete: at once, or after the receive hook (which fills it)."""
        if not kw.get("return_recv_hook"):
            damage()
            return hook

        def received():
            hook()
            damage()
        return received


def _check_worker(ctx):
    os.environ["EPCOMM_TIMEOUT_S"] = "60"
    ht, ll = CASE_SETS["small"]
    dev, me, r_ = ctx.device, ctx.rank, ctx.world_size
    ht_set = workloads.make_ht_sets(ht, me, r_, dev, 1)[0]
    ll_set = workloads.make_ll_sets(ll, me, r_, dev, 1)[0]
    rdma = Buffer.get_low_latency_rdma_size_hint(ll.tokens, ll.hidden, r_, ll.experts)
    out = {}
    for how in ("corrupt", "reorder"):
        fake = _Wrapped(Buffer(ctx.group), how)
        out[("ht", how)] = workloads.check_ht({fake.backend_name: fake, "reference": Buffer(ctx.group)}, ht_set)[0]
        fake = _Wrapped(Buffer(ctx.group, num_rdma_bytes=rdma, low_latency_mode=True), how)
        ref = Buffer(ctx.group, num_rdma_bytes=rdma, low_latency_mode=True)
        out[("ll", how)] = workloads.check_ll({fake.backend_name: fake, "reference": ref}, ll_set, ll)
    return out


def test_correctness_check_catches_a_broken_backend():
    res = parallel_launch(2, _check_worker, backend="gloo", timeout_s=120)
    for rank, out in enumerate(res):
        for mode in ("ht", "ll"):
            assert out[(mode, "corrupt")]["reference"] == "pass", (rank, mode, out)
            assert out[(mode, "corrupt")]["fake-corrupt"].startswith("FAIL: "), (rank, mode, out)
            assert out[(mode, "reorder")]["fake-reorder"] == "pass", (rank, mode, out)


def _two_backend_worker(ctx, api="v1"):
    os.environ["EPCOMM_TIMEOUT_S"] = "60"
    from epcomm.bench.runner import BenchPlan, _run_case

    ht, ll = CASE_SETS["small"]
    plan = BenchPlan(cases=(ht, ll), iters=2, warmup=0, sets=2, api=api)
    rdma = Buffer.get_low_latency_rdma_size_hint(ll.tokens, ll.hidden, ctx.world_size, ll.experts)
    out = []
    for case, kw in ((ht, {}), (ll, {"num_rdma_bytes": rdma, "low_latency_mode": True})):
        fast = _Wrapped(Buffer(ctx.group, **kw), "ok")
        out += _run_case(ctx, plan, case, {fast.backend_name: fast, "reference": Buffer(ctx.group, **kw)}, None)
    return out


@pytest.mark.parametrize("api", ["v1", "both"])
def test_rows_pair_a_fast_backend_with_the_reference(api):
    from epcomm.bench import report

    res = parallel_launch(2, functools.partial(_two_backend_worker, api=api), backend="gloo", timeout_s=120)
    rows = report.merge_ranks(res, env={}, iters=2, warmup=0)
    fast = [r for r in rows if r["backend"] == "fake-ok"]
    ref = [r for r in rows if r["backend"] == "reference"]
    assert len(ref) == 3 + 2 + 4
    # plus dispatch bf16/fp8 with num_worst_tokens (capturable); with --api both also those whose step computes
    # the layout (get_dispatch_layout, then dispatch: V1's row beside an ElasticBuffer dispatch)
    layout = {"bf16-worst-layout", "fp8-worst-layout"} if api == "both" else set()
    assert len(fast) == len(ref) + 2 + len(layout)
    assert {r["dtype"] for r in fast if "-worst" in r["dtype"]} == {"bf16-worst", "fp8-worst"} | layout
    for r in fast:
        assert r["check"] == "pass" and r["timing"] == "wall"
        assert r["ref_median_us"] is not None  # the oracle's time, kept beside the peer's
        if r["phase"] == "total":
            assert r["speedup"] == pytest.approx(r["peer_us"] / r["median_us"])
    n = 5 + len(layout)
    assert [r["op"] for r in rows[:n]] == ["dispatch", "dispatch", "combine"] + ["dispatch"] * (n - 3)  # fast first
    assert [r["op"] for r in rows[n:n + 3]] == ["dispatch", "dispatch", "combine"]  # then the reference


def _late_worker(ctx):
    os.environ["EPCOMM_TIMEOUT_S"] = "60"
    from epcomm.bench.runner import BenchPlan, _run_case

    ht, _ = CASE_SETS["small"]
    plan = BenchPlan(cases=(ht,), iters=2, warmup=0, sets=2, api="both")  # (V1's rows: the layout rows too)
    late = _Wrapped(Buffer(ctx.group), "late")
    return _run_case(ctx, plan, ht, {late.backend_name: late, "reference": Buffer(ctx.group)}, None)


def test_a_path_broken_only_as_timed_fails_its_rows():
    from epcomm.bench import report

    rows = report.merge_ranks(parallel_launch(2, _late_worker, backend="gloo", timeout_s=120), env={}, iters=2,
                              warmup=0)
    late = {r["dtype"]: r for r in rows if r["backend"] == "fake-late" and r["op"] == "dispatch"}
    for dtype in ("bf16", "bf16-worst", "bf16-worst-layout"):
        assert "rank 0: FAIL as timed (FAIL: timed dispatch (bf16, set 0) bf16 recv_x" in late[dtype]["check"]
        assert late[dtype]["timed_check"].startswith("rank 0: FAIL: timed dispatch"), late[dtype]
    assert late["fp8"]["check"] == "pass" and late["fp8"]["timed_check"] == "pass"  # FP8 rows are not damaged
    assert all(r["check"] == "pass" for r in rows if r["backend"] == "reference")


def _ll_timed_worker(ctx, how):
    os.environ["EPCOMM_TIMEOUT_S"] = "60"
    from epcomm.bench.runner import BenchPlan, _run_case

    _, ll = CASE_SETS["small"]
    plan = BenchPlan(cases=(ll,), iters=2, warmup=0, sets=2)
    kw = {"num_rdma_bytes": Buffer.get_low_latency_rdma_size_hint(ll.tokens, ll.hidden, ctx.world_size, ll.experts),
          "low_latency_mode": True}
    fake = _Wrapped(Buffer(ctx.group, **kw), how)
    return _run_case(ctx, plan, ll, {fake.backend_name: fake, "reference": Buffer(ctx.group, **kw)}, None)


@pytest.mark.parametrize("how", ["late", "reorder"])
def test_low_latency_rows_are_checked_as_timed_against_the_reference(how):
    """Eager low-latency rows are checked against the reference's result on the inputs as timed: a path
    right in the case check but wrong as timed ("late": its scales and combine output damaged after its
    first call) fails every one of its rows; a backend whose slots differ from the reference's
    ("reorder", allowed) passes its dispatch rows, and its combine rows say they had no oracle."""
    from epcomm.bench import report, table

    rows = report.merge_ranks(parallel_launch(2, _ll_timed_worker, how, backend="gloo", timeout_s=120), env={},
                              iters=2, warmup=0)
    fake = [r for r in rows if r["backend"] == f"fake-{how}"]
    assert len(fake) == 2 + 4 and all(r["timed_oracle"] == "reference" for r in fake)  # totals + hook halves
    assert all(r["check"] == "pass" and r["timed_check"] == "pass" for r in rows if r["backend"] == "reference")
    for r in fake:
        if how == "late":
            assert r["check"].startswith("rank 0: FAIL as timed (FAIL: timed low-latency " + r["op"]), r
            assert table.timed_mark(r) == "FAIL"
        elif r["op"] == "dispatch":
            assert r["check"] == r["timed_check"] == "pass" and table.timed_mark(r) == "ref"
        else:
            assert r["check"] == "pass" and r["timed_check"].startswith("not checked: this backend's slots"), r
            assert table.timed_mark(r) == "NONE"



def test_bench_profile_covers_elastic_buffer_ops(tmp_path, capsys):
    """``epcomm bench --api v2 --profile DIR``: every V2 op (layout, sync choice, SM count in the name) gets
    its host table, with ElasticBuffer's call among its functions, and its torch.profiler table, on each rank."""
    from epcomm.bench.v2 import v2_ops

    prof = tmp_path / "prof"
    rc = cli.main(["bench", "--api", "v2", "--cases", "small", "--world-size", "2", "--device", "cpu",
                   "--iters", "2", "--warmup", "0", "--sets", "2", "--no-progress", "--profile", str(prof)])
    assert rc == 0, capsys.readouterr().out
    host = sorted(prof.glob("v2_*.host.txt"))
    assert len(host) == len(sorted(prof.glob("v2_*.torch.txt"))) == 2 * len(v2_ops()), [p.name for p in host]
    table = (prof / "v2_small_T_64_combine-bf16_contiguous_no-sync_sms_20_reference.rank1.host.txt").read_text()
    assert "host time per call" in table and re.search(r"elastic\.py:\d+\(combine\)", table), table
