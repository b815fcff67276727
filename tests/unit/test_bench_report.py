"""Tier 1: merging per-rank results into rows, the JSONL fields, the table and the plots."""

from __future__ import annotations

import dataclasses
import json

import pytest

from epcomm.bench import report, table
from epcomm.bench.cases import BenchCase

CASE = dataclasses.asdict(BenchCase("small", "ht", 64, 256, 4, 16))
ENV = {"date": "2026-11-21T00:00:00+00:00", "device": "cpu", "gpu_count": 0, "driver": None, "cuda": None,
       "nccl": None, "torch": "2.x", "triton": None, "epcomm": "0.1.0", "git_sha": "abc", "git_dirty": False, "commit_source": "git",
       "python": "3.11", "world_size": 2, "transport": "gloo", "backends": ["nvlink", "reference"], "epcomm_env": {},
       "launch": "local processes"}


def result(backend, median, *, lb=1000, kb=500, check="pass", phase="total", p10=None, p90=None,
           timing="events", dtype="bf16"):
    return {"case": CASE, "backend": backend, "op": "dispatch", "dtype": dtype, "phase": phase,
            "median": median, "p10": p10 or median * 0.9, "p90": p90 or median * 1.1, "host": median / 2,
            "timing": timing, "logical_bytes": lb, "link_bytes": kb, "sms": 24 if backend != "reference" else "nccl",
            "check": check}


def test_merge_takes_max_median_min_bandwidth_and_pairs_the_reference():
    rank0 = [result("nvlink", 10e-6, lb=2000, kb=1000), result("reference", 40e-6), result("gloo-a2a", 40e-6)]
    rank1 = [result("nvlink", 20e-6, lb=1000, kb=500), result("reference", 30e-6), result("gloo-a2a", 30e-6)]
    rows = report.merge_ranks([rank0, rank1], env=ENV, iters=5, warmup=1, ce_gbps=100.0)
    fast, ref, peer = rows
    assert fast["backend"] == "nvlink" and ref["backend"] == "reference"
    assert fast["median_us"] == pytest.approx(20.0)          # max over ranks of the medians
    assert fast["p90_us"] == pytest.approx(22.0)
    assert fast["logical_bytes"] == 2000                      # the busiest rank
    # per rank: 2000 B / 10 us = 0.2 GB/s, 1000 B / 20 us = 0.05 GB/s -> the minimum
    assert fast["logical_gbps"] == pytest.approx(0.05)
    assert fast["link_gbps"] == pytest.approx(0.025)
    assert fast["link_fraction"] == pytest.approx(0.025 / 100.0)
    assert fast["ref_median_us"] == pytest.approx(40.0)
    assert fast["peer_us"] == pytest.approx(40.0) and fast["speedup"] == pytest.approx(2.0)  # peer / this
    assert ref["speedup"] == pytest.approx(1.0) and peer["speedup"] == pytest.approx(1.0)
    assert fast["world_size"] == 2 and fast["sms"] == 24 and ref["sms"] == "nccl"
    assert fast["check"] == "pass" and fast["env"] is ENV


def test_merge_pairs_eager_rows_with_their_graph_rows():
    rank = [result("nvlink", 30e-6), result("nvlink", 20e-6, timing="graph"),
            result("nvlink", 50e-6, dtype="bf16-worst", timing="graph"), result("nccl-a2a", 90e-6)]
    eager, graph, worst, peer = report.merge_ranks([rank], env=ENV, iters=5, warmup=1)
    assert eager["graph_us"] == pytest.approx(20.0) and eager["eager_over_graph"] == pytest.approx(1.5)
    assert graph["eager_over_graph"] is None and graph["speedup"] == pytest.approx(4.5)
    assert worst["speedup"] == pytest.approx(1.8)  # "-worst" rows pair with the peer's plain row
    assert peer["graph_us"] is None


def test_merge_reports_failing_ranks_and_missing_bytes():
    rank0 = [result("nvlink", 1e-5, check="pass", lb=None, kb=None, phase="send")]
    rank1 = [result("nvlink", 1e-5, check="FAIL: recv_x differs", lb=None, kb=None, phase="send")]
    (row,) = report.merge_ranks([rank0, rank1], env=ENV, iters=1, warmup=0)
    assert row["check"] == "rank 1: FAIL: recv_x differs"
    assert row["logical_gbps"] is None and row["link_fraction"] is None and row["speedup"] is None


def test_jsonl_rows_carry_every_field(tmp_path):
    rows = report.merge_ranks([[result("reference", 1e-5)]], env=ENV, iters=3, warmup=1)
    path = report.write_jsonl(tmp_path / "sub" / "rows.jsonl", rows)
    back = report.read_jsonl(path)
    assert back == json.loads(json.dumps(rows))
    assert tuple(back[0]) == report.ROW_FIELDS
    assert set(back[0]["env"]) == set(report.ENV_FIELDS)


def test_table_rendering():
    rows = report.merge_ranks([[result("nvlink", 12.3e-6), result("gloo-a2a", 1234.5e-6)]], env=ENV, iters=3,
                              warmup=1, ce_gbps=None)
    text = table.render_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["case", "mode", "T"] and "speedup" in lines[0] and "%CE" not in lines[0]
    assert set(lines[1]) <= {"-", " "}
    assert "12.3" in lines[2] and "100.37x" in lines[2] and "dispatch-bf16" in lines[2]
    assert "1234" in lines[3] or "1235" in lines[3]
    rows[0]["link_fraction"] = 0.5
    assert "%CE" in table.render_table(rows) and "50%" in table.render_table(rows)


def test_the_mode_column_tells_ht_and_ll_rows_of_one_case_apart():
    ll = {**CASE, "mode": "ll"}
    rows = report.merge_ranks([[result("reference", 1e-5), {**result("reference", 2e-5), "case": ll}]], env=ENV,
                              iters=1, warmup=0)
    head, _, ht_line, ll_line = table.render_table(rows).splitlines()
    assert head.split()[:3] == ["case", "mode", "T"]
    assert ht_line.split()[:2] == ["small", "ht"] and ll_line.split()[:2] == ["small", "ll"]
    assert "eager/graph" not in head  # no graph rows, no column
    rows[0]["eager_over_graph"] = 1.5
    assert "eager/graph" in table.render_table(rows).splitlines()[0]


def test_the_legend_is_a_few_short_lines():
    rows = report.merge_ranks([[result("nvlink", 1e-5), result("gloo-a2a", 2e-5)]], env=ENV, iters=1, warmup=0)
    for env, ce in ((ENV, None), ({**ENV, "device": "NVIDIA H200", "gpu_count": 8, "driver": "570.1", "cuda": "12.8",
                                   "nccl": "2.27.3", "transport": "nccl", "epcomm_env": {"EPCOMM_TUNE": "a=1"}}, 386.0)):
        lines = table.render_header(env, ce, rows).splitlines()
        assert max(map(len, lines[2:])) <= 110, [line for line in lines if len(line) > 110]
        assert len(lines) <= 10
    assert "peer us: gloo-a2a (torch.distributed all-to-all)" in "\n".join(lines)


def _path_rows(backend, mode, op, dtype, speedups, timing="events"):
    """Rows of one path at len(speedups) token counts, each ``speedup`` times faster than its peer."""
    rows = []
    for t, s in zip((1, 4, 16, 64), speedups):
        rows.append({"case": "small", "mode": mode, "tokens": t, "op": op, "dtype": dtype, "phase": "total",
                     "backend": backend, "timing": timing, "api": "v1", "speedup": s, "check": "pass",
                     "timed_check": "pass", "timed_oracle": "reference"})
    return rows


def test_the_summary_gives_each_path_against_its_peer():
    rows = (_path_rows("nvlink", "ht", "dispatch", "bf16", [2.0, 8.0]) + _path_rows("nvlink", "ll", "dispatch", "fp8", [0.5])
            + _path_rows("nvlink", "ht", "dispatch", "bf16", [3.0], timing="graph")
            + _path_rows("reference", "ht", "dispatch", "bf16", [0.1, 0.1])  # the oracle beside a fast backend
            + [{**_path_rows("nvlink", "ll", "dispatch", "fp8", [None])[0], "phase": "send"}]  # no peer for a half
            + [{**r, "speedup": 1.0, "timed_oracle": "round trip"} for r in _path_rows("nccl-a2a", "ht", "dispatch",
                                                                                       "bf16", [1.0])])
    rows[1].update(check="rank 1: FAIL: recv_x differs", timed_check="rank 1: FAIL: timed dispatch")
    lines = table.render_summary(rows).splitlines()
    assert lines[0].startswith("summary: epcomm against its peer nccl-a2a (torch.distributed all-to-all)")
    assert [line.split() for line in lines[4:-1]] == [
        ["ht", "dispatch-bf16", "nvlink", "events", "2", "4.00x", "2.00x", "8.00x"],  # geometric mean of 2 and 8
        ["ll", "dispatch-fp8", "nvlink", "events", "1", "0.50x", "0.50x", "0.50x"],
        ["ht", "dispatch-bf16", "nvlink", "graph", "1", "3.00x", "3.00x", "3.00x"]]
    assert lines[-1] == "checks: 1 of 8 rows FAILED (see the check column); timed calls: 6 ref, 1 trip, 1 FAIL"
    only_ref = table.render_summary(_path_rows("reference", "ll", "combine", "bf16", [0.25, 1.0])
                                    + _path_rows("gloo-a2a", "ll", "combine", "bf16", [1.0, 1.0]))
    assert only_ref.splitlines()[4].split() == ["ll", "combine-bf16", "reference", "events", "2", "0.50x", "0.25x",
                                                "1.00x"]  # on CPU the reference is epcomm's path
    v2 = [{**r, "api": "v2", "layout": "expanded", "cpu_sync": False, "sms": 20}
          for r in _path_rows("nvlink", "ht", "combine", "bf16", [None])]
    assert table.render_summary(v2).splitlines()[0] == \
        "summary: 1 path(s) without a speedup: V2 rows have no peer at their layouts"


def test_op_label():
    assert table.op_label({"op": "dispatch", "dtype": "fp8", "phase": "send"}) == "dispatch-fp8:send"
    assert table.op_label({"op": "dispatch", "dtype": "bf16", "phase": "total", "cached": True}) == \
        "dispatch-bf16(cached)"


def test_header_names_device_versions_and_ceiling():
    text = table.render_header({**ENV, "device": "NVIDIA H200", "gpu_count": 2, "driver": "570.1",
                                 "cuda": "12.8", "nccl": "2.27.3"}, 386.0)
    assert "NVIDIA H200 x2" in text and "driver 570.1" in text and "386.0 GB/s" in text


def test_environment_record(monkeypatch):
    monkeypatch.setenv("EPCOMM_TUNE", "push_rb=4")
    monkeypatch.delenv("EPCOMM_HT_TRANSFER", raising=False)
    env = report.environment({"device": "cpu", "gpu_count": 0}, 4, "gloo", ["reference"])
    assert set(env) == set(report.ENV_FIELDS)
    # epcomm's version and commit: tests/unit/test_bench_env.py (git_sha is None outside a checkout)
    assert env["world_size"] == 4 and env["driver"] is None and env["epcomm"]
    assert env["epcomm_env"] == {"EPCOMM_TUNE": "push_rb=4"}  # the variables that shaped the run
    assert "set: EPCOMM_TUNE=push_rb=4" in table.render_header(env, None)


def test_plots(tmp_path):
    import matplotlib  # noqa: F401 - in the test extra: the plot tests must run, not skip

    from epcomm.bench.plot import plot_rows

    res = []
    for t in (1, 4, 16):
        case = {**CASE, "tokens": t}
        for b, m in (("nvlink", 1e-5 * t), ("reference", 3e-5 * t)):
            res.append({**result(b, m), "case": case})
    rows = report.merge_ranks([res], env=ENV, iters=3, warmup=1, ce_gbps=1.0)
    paths = plot_rows(rows, tmp_path / "plots")
    assert [p.name for p in paths] == ["time_vs_tokens.png", "bandwidth.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_plot_without_matplotlib_says_what_to_install(monkeypatch):
    import sys

    from epcomm.bench import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"pip install 'epcomm\[plot\]'"):
        plot.plot_rows([{"x": 1}], "unused")


def test_rows_say_how_the_ranks_were_started():
    assert report.launch_description({}) == "local processes"
    assert report.launch_description({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == "torchrun: 2 host(s) x 8 rank(s)"
    assert report.launch_description({"WORLD_SIZE": "2"}) == "torchrun: 1 host(s) x 2 rank(s)"
    head = table.render_header(dict(ENV, launch="torchrun: 2 host(s) x 8 rank(s)"), None)
    assert "2 ranks on gloo (torchrun: 2 host(s) x 8 rank(s))" in head.splitlines()[0]
    assert "torchrun" not in table.render_header(ENV, None)


def test_no_speedup_against_a_gloo_exchange_of_gpu_tensors():
    """Ranks sharing a GPU are joined by gloo: the peer's GPU tensors go through the host, so it is
    labelled by that transport and no ratio against it is printed. On CPU ranks gloo is the real peer."""
    shared = {**ENV, "device": "NVIDIA H100", "gpu_count": 1, "transport": "gloo, 2 ranks sharing 1 GPU(s)"}
    rank = [result("nvlink", 10e-6), result("gloo-a2a", 1300e-6)]
    fast, peer = report.merge_ranks([rank], env=shared, iters=3, warmup=1)
    assert fast["peer_us"] == pytest.approx(1300.0) and fast["speedup"] is None and peer["speedup"] is None
    assert fast["caveat"] == "ranks share GPUs through gloo: host times only; GPU times are not performance"
    head = table.render_header(shared, None, [fast, peer])
    assert "peer gloo-a2a: GPU tensors exchanged through gloo (the host): no speedup is shown" in head
    assert "NOTE: ranks share GPUs" in head
    cpu, _ = report.merge_ranks([rank], env=ENV, iters=3, warmup=1)
    assert cpu["speedup"] == pytest.approx(130.0) and cpu["caveat"].startswith("CPU ranks on gloo")
    assert "no speedup" not in table.render_header(ENV, None, [cpu])
    dedicated = {**shared, "gpu_count": 8, "transport": "nccl"}
    nccl, _ = report.merge_ranks([[result("nvlink", 10e-6), result("nccl-a2a", 50e-6)]], env=dedicated, iters=3,
                                 warmup=1)
    assert nccl["speedup"] == pytest.approx(5.0) and nccl["caveat"] is None


def test_timed_column_marks_rows_without_an_oracle_check():
    rows = report.merge_ranks([[result("nvlink", 1e-5), result("gloo-a2a", 1e-5)]], env=ENV, iters=1, warmup=0)
    rows[0].update(timed_check="pass", timed_oracle="reference")
    rows[1].update(timed_check="pass", timed_oracle="round trip")
    assert [table.timed_mark(r) for r in rows] == ["ref", "trip"]
    for v, mark in (("not run: --no-check", "NONE"), ("not checked: slots differ", "NONE"),
                    ("rank 1: FAIL: timed dispatch", "FAIL")):
        assert table.timed_mark({**rows[0], "timed_check": v}) == mark
    text = table.render_table([{**rows[0], "timed_check": "not run"}])
    assert " NONE " in text.splitlines()[2]


def test_progress_off_a_terminal_writes_a_few_lines(capsys):
    from epcomm.bench.progress import Progress

    p = Progress(total=65)
    p.show("backends: nvlink, reference", always=True)
    for i in range(65):
        p.show(f"step {i}")
        p.update(f"step {i}")
    p.close()
    lines = capsys.readouterr().err.splitlines()  # captured: not a terminal
    assert len(lines) == 1 + 4, lines  # the message, then as each quarter is crossed: 17, 33, 49, 65 of 65
    assert [ln.split()[1] for ln in lines[1:]] == ["17/65", "33/65", "49/65", "65/65"]



def test_a_gloo_peer_of_gpu_tensors_is_staged_whatever_the_group_calls_it():
    """Ranks sharing a GPU run the peer on gloo for CUDA tensors: the group's name is "cpu:gloo,cuda:gloo"
    (torch >= 2.11) or "gloo"; either way no speedup against it. NCCL for CUDA tensors is not staged,
    and without GPUs nothing is."""
    from epcomm.bench.report import staged_peer
    gpu = {"gpu_count": 1}
    assert staged_peer("cpu:gloo,cuda:gloo-a2a", gpu)
    assert staged_peer("gloo-a2a", gpu)
    assert not staged_peer("cpu:gloo,cuda:nccl-a2a", gpu)
    assert not staged_peer("nccl-a2a", gpu)
    assert not staged_peer("cpu:gloo,cuda:gloo-a2a", {"gpu_count": 0})


def test_merge_reports_the_host_spread_and_calibration_of_the_slowest_rank():
    """``host_p10_us`` / ``host_p90_us`` / ``host_calib_us``: the largest per-rank value each (as ``host_us``), None
    where a rank has none (an older result)."""
    rank0, rank1 = result("nvlink", 10e-6), result("nvlink", 20e-6)
    rank0.update(host_p10=3e-6, host_p90=9e-6, host_calib=4e-6)
    rank1.update(host_p10=5e-6, host_p90=7e-6, host_calib=2e-6)
    row = report.merge_ranks([[rank0], [rank1]], env=ENV, iters=5, warmup=1, ce_gbps=None)[0]
    assert (row["host_p10_us"], row["host_p90_us"], row["host_calib_us"]) == pytest.approx((5.0, 9.0, 4.0))
    del rank1["host_calib"]
    row = report.merge_ranks([[rank0], [rank1]], env=ENV, iters=5, warmup=1, ce_gbps=None)[0]
    assert row["host_calib_us"] is None and row["host_us"] == pytest.approx(10.0)
