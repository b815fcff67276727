"""Tier 1: ``epcomm bench --api v2``'s plan and arguments, its rows' merging and table, and the oracle's
comparison of a dispatch result (bench/v2.py). The runs themselves are tier 2 (tests/dist/test_bench_v2_runs.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from epcomm import cli
from epcomm.bench import report, table, v2
from epcomm.bench.cases import BenchCase
from epcomm.bench.runner import BenchPlan

CASE = BenchCase("small", "ht", 64, 256, 4, 16)
ENV = {"device": "cpu", "gpu_count": 0}


def test_plan_checks_api_and_sweep():
    with pytest.raises(ValueError, match="api must be one of .* got 'v3'"):
        BenchPlan(cases=(CASE,), api="v3")
    with pytest.raises(ValueError, match="num_sms_sweep values must be positive ints, got 0"):
        BenchPlan(cases=(CASE,), api="v2", num_sms_sweep=(4, 0))
    assert BenchPlan(cases=(CASE,)).api == "v1"  # V1 stays the default


@pytest.mark.parametrize("argv, message", [
    (["--api", "v2", "--mode", "ll"], "--api v2 times the high-throughput cases' shapes, not --mode ll"),
    (["--num-sms", "4,8"], "--num-sms takes one value with --api v1"),
    (["--num-sms", "5"], "--num-sms must be even, got 5"),
    (["--api", "v2", "--cached"], "--cached is a V1 option"),
    (["--api", "both", "--mode", "ll"], "--api both times V2 at the high-throughput cases' shapes"),
    (["--api", "both", "--num-sms", "3"], "--num-sms must be even, got 3"),  # one value: V1's too
])
def test_cli_refuses_what_v2_or_v1_cannot_do(argv, message, capsys):
    rc = cli.main(["bench", "--device", "cpu", "--world-size", "1", "--no-progress"] + argv)
    assert rc == 2 and message in capsys.readouterr().err


def test_ops_cover_both_layouts_dtypes_and_sync_choices():
    ops = v2.v2_ops()
    disp = {(o.layout, o.dtype, o.cpu_sync) for o in ops if o.op == "dispatch"}
    comb = {(o.layout, o.cpu_sync) for o in ops if o.op == "combine"}
    assert disp == {(lay, d, s) for lay in v2.LAYOUTS for d in ("bf16", "fp8") for s in (True, False)}
    assert comb == {(lay, s) for lay in v2.LAYOUTS for s in (True, False)}
    pairs = [(o.layout, o.dtype, o.cpu_sync) for o in ops if o.op == "dispatch+combine"]
    assert pairs == [("contiguous", "bf16", False), ("expanded", "bf16", False)] and len(ops) == 14
    assert [o.alignment for o in ops if o.op == "combine"] == [1, 1, 128, 128]


def result(layout, sync, sms, median, timing="events", op="dispatch"):
    return {"case": dataclasses.asdict(CASE), "backend": "nvlink", "op": op, "dtype": "bf16", "phase": "total",
            "median": median, "p10": median, "p90": median, "host": median / 4, "timing": timing,
            "logical_bytes": None, "link_bytes": None, "link_counting": None, "sms": sms, "check": "pass",
            "timed_check": "pass", "timed_oracle": "reference", "api": "v2", "layout": layout, "cpu_sync": sync,
            "theoretical_num_sms": 6}


def test_v2_rows_stay_apart_by_layout_sync_and_sms_and_pair_with_their_graph_rows():
    rank = [result("contiguous", True, 4, 30e-6), result("contiguous", False, 4, 20e-6),
            result("contiguous", False, 4, 10e-6, "graph"), result("expanded", False, 4, 40e-6),
            result("contiguous", False, 8, 16e-6), result("contiguous", False, 8, 4e-6, "graph")]
    rows = report.merge_ranks([rank, rank], env=ENV, iters=2, warmup=0)
    assert len(rows) == 6 and [r["sms"] for r in rows] == [4, 4, 4, 4, 8, 8]
    assert all(r["api"] == "v2" and r["theoretical_num_sms"] == 6 for r in rows)
    sync, nosync, _graph, expanded, nosync8, _ = rows
    assert sync["cpu_sync"] is True and nosync["cpu_sync"] is False and expanded["layout"] == "expanded"
    assert nosync["graph_us"] == pytest.approx(10.0) and nosync8["graph_us"] == pytest.approx(4.0)
    assert sync["graph_us"] is None and expanded["graph_us"] is None  # no graph row of their own
    assert tuple(rows[0]) == report.ROW_FIELDS
    lines = table.render_table(rows).splitlines()
    assert lines[0].split()[6:11] == ["op", "api", "layout", "sync", "theory-SMs"]
    assert lines[2].split()[6:12] == ["dispatch-bf16", "v2", "contiguous", "cpu", "6", "nvlink"]
    assert lines[5].split()[7:10] == ["v2", "expanded", "none"]


def test_v1_rows_say_v1_and_their_table_has_no_v2_columns():
    r = {**result("contiguous", True, 24, 1e-5)}
    for k in ("api", "layout", "cpu_sync", "theoretical_num_sms"):
        r.pop(k)
    (row,) = report.merge_ranks([[r]], env=ENV, iters=1, warmup=0)
    assert row["api"] == "v1" and row["layout"] is None and row["cpu_sync"] is None
    assert "layout" not in table.render_table([row]).splitlines()[0]


class _Handle:
    def __init__(self, n, slots):
        self.psum_num_recv_tokens_per_scaleup_rank = torch.tensor([n], dtype=torch.int32)
        self.psum_num_recv_tokens_per_expert = torch.tensor([n], dtype=torch.int32)
        self.num_unaligned_recv_tokens_per_expert = torch.tensor([n], dtype=torch.int32)
        meta = torch.full((n + 2, 4), -1, dtype=torch.int32)  # two padding rows (no CPU sync)
        meta[:n, 0] = torch.arange(n)
        meta[:n, 2] = torch.tensor(slots, dtype=torch.int32)
        self.recv_src_metadata = meta


def _dispatch_out(n=3, expand=False):
    x = torch.arange((n + 2) * 8, dtype=torch.float32).view(n + 2, 8).to(torch.bfloat16)
    idx = torch.zeros(n + 2, 2, dtype=torch.int64)
    w = torch.ones(n + 2, 2) if not expand else torch.ones(n + 2)
    return x, (None if expand else idx), w, _Handle(n, [2, 0, 1] if expand else [-1] * n), None


@pytest.mark.parametrize("expand", [False, True])
def test_dispatch_is_compared_on_valid_rows_bitwise(expand):
    op = v2.V2Op("dispatch", "expanded" if expand else "contiguous", "bf16", False)
    want = v2.V2Expect(0, {(op.layout, "bf16"): v2.canonical(_dispatch_out(expand=expand), expand)}, {})
    out = _dispatch_out(expand=expand)
    out[0][3:] = 7.0  # padding rows: not compared
    want.verify(op, 0, out)
    out[0][1, 5] = out[0][1, 5] + 1  # one valid row damaged (a slot of the expanded layout too)
    with pytest.raises(AssertionError, match="timed dispatch .* x"):
        want.verify(op, 0, out)
    with pytest.raises(AssertionError, match="the oracle ran on set 0"):
        want.verify(op, 1, _dispatch_out(expand=expand))
