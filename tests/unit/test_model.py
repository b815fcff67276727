"""Tier 1: the cost model (``epcomm.model``, ``epcomm model``): routing statistics against hand-worked
examples and the exact formulas, one prediction worked by hand, the calibration reproducing the defaults,
the published rows it is checked against, output files, and bad input."""

from __future__ import annotations

import csv
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from epcomm import cli
from epcomm import model as m

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_uniform_stats_worked_example():
    # R = 2 ranks on one node, E = 4, K = 2: a rank is missed when both experts are the other rank's:
    # C(2,2) / C(4,2) = 1/6
    s = m.uniform_stats(2, 2, 4, 2)
    assert s.ranks_touched == pytest.approx(2 * 5 / 6) and s.self_touched == pytest.approx(5 / 6)
    assert s.nodes_touched == s.own_node_touched == 1
    assert s.nvl_forwards == pytest.approx(5 / 6)  # the other rank, whenever it is touched
    assert (s.selections, s.sel_self, s.sel_node, s.sel_remote) == (2, 1, 1, 0)


def test_stats_from_ids_worked_example():
    # R = 4, G = 2 (nodes {0,1} and {2,3}), E = 8 (2 per rank), source rank 0 (forwarders: ranks 0 and 2)
    ids = torch.tensor([[0, 5],     # ranks 0, 2: both nodes, each reached at its forwarder: no NVLink forward
                        [2, 3],     # rank 1 (twice): node 0, forwarder 0 forwards to 1
                        [6, -1]])   # rank 3: node 1, forwarder 2 forwards to 3
    s = m.stats_from_ids(ids, 4, 2, 8)
    assert s.ranks_touched == pytest.approx(4 / 3) and s.self_touched == pytest.approx(1 / 3)
    assert s.nodes_touched == pytest.approx(4 / 3) and s.own_node_touched == pytest.approx(2 / 3)
    assert s.nvl_forwards == pytest.approx(2 / 3)
    assert s.selections == pytest.approx(5 / 3) and s.sel_self == pytest.approx(1 / 3)
    assert s.sel_node == pytest.approx(2 / 3) and s.sel_remote == pytest.approx(2 / 3)
    assert s.ranks_node == pytest.approx(1 / 3) and s.ranks_remote == pytest.approx(2 / 3)
    # [R, T, K]: rank r = 2a + b sends the same routing as seen from it: rank 2n + l maps to 2(n^a) + (l^b),
    # which keeps nodes together and forwarders at the sender's local index
    def seen_from(r, e):
        x, a, b = e // 2, r // 2, r % 2
        return 2 * (2 * ((x // 2) ^ a) + ((x % 2) ^ b)) + e % 2

    every = torch.stack([torch.where(ids >= 0, seen_from(r, ids), ids) for r in range(4)])
    assert dataclasses.replace(m.stats_from_ids(every, 4, 2, 8), source="") == dataclasses.replace(s, source="")


def test_sampled_uniform_routing_matches_the_exact_formulas():
    gen = torch.Generator().manual_seed(1)
    t, r_, g, e, k = 20000, 16, 4, 64, 6
    ids = torch.rand(t, e, generator=gen).topk(k, dim=-1).indices  # a uniform k-subset per token
    got, exact = m.stats_from_ids(ids, r_, g, e), m.uniform_stats(r_, g, e, k)
    for f in ("ranks_touched", "nodes_touched", "nvl_forwards", "sel_node", "sel_remote", "ranks_remote"):
        # per-token counts lie in [0, K]: their standard error is below K / 2 / sqrt(T) = 0.021
        assert getattr(got, f) == pytest.approx(getattr(exact, f), abs=0.09), f


def test_node_limited_routing_keeps_to_its_nodes():
    ids = m.node_limited_ids(2000, 32, 8, 256, 8, topk_groups=2, seed=3)
    nodes = ids // 64
    assert all(len(set(row.tolist())) == 8 for row in ids)  # distinct experts
    assert max(len(set(row.tolist())) for row in nodes) == 2  # never more than 2 nodes
    assert m.stats_from_ids(m.node_limited_ids(500, 32, 8, 256, 8, topk_groups=1), 32, 8, 256).nodes_touched == 1
    with pytest.raises(ValueError, match="topk_groups=1 nodes of 4 experts cannot hold topk=8"):
        m.node_limited_ids(10, 16, 1, 64, 8, topk_groups=1)


def test_ht_prediction_by_hand():
    links = m.Links(nvlink_gbps=100, nic_gbps=10, gpus_per_node=2, nvlink_efficiency=1, nic_efficiency=0.5,
                    nvlink_latency_us=1, nic_latency_us=2, launch_us=3, qps_per_peer=1, nic_ports=2)
    work = m.Workload(tokens=1000, hidden=128, topk=2, experts=8, dtype="bf16")  # rows of 256 bytes
    stats = m.RoutingStats(ranks=4, gpus_per_node=2, ranks_touched=1.5, self_touched=0.5, nodes_touched=1.25,
                           own_node_touched=0.75, nvl_forwards=0.5, selections=2, sel_self=0.5, sel_node=0.5,
                           sel_remote=1, ranks_node=0.5, ranks_remote=0.5, source="by hand")
    p = m.predict(links, work, stats, "ht", "dispatch")
    # network: 1000 * (1.25 - 0.75) * 256 B = 128 kB, twice as slow on one of two ports, at 10 * 0.5 GB/s
    assert p.nic_bytes == 128_000 and p.nic_us == pytest.approx(2 * 128_000 / 5e3)
    assert p.nvlink_bytes == 128_000 and p.nvlink_us == pytest.approx(128_000 / 100e3)
    assert p.fixed_us == 2 * 3 + 1 + 2 and p.time_us == pytest.approx(51.2 + 9) and p.bottleneck == "network"
    assert p.deepep_bytes == 1000 * 1.25 * 256
    uncached = m.predict(links, dataclasses.replace(work, cached=False), stats, "ht", "dispatch")
    assert uncached.time_us - p.time_us == pytest.approx(3 + 2 * 2)  # a launch and a network round trip
    ll = m.predict(links, work, stats, "ll", "combine")  # 1000 * 1 remote message of 256 B, 500 over NVLink
    assert ll.nic_bytes == 256_000 and ll.nvlink_bytes == 128_000 and ll.fixed_us == 3 + 2
    assert ll.local_us == pytest.approx(1000 * 3 * 256 / links.hbm_gbps / 1e3)  # 2 rows read, 1 written


def test_port_factor():
    assert m.Links(qps_per_peer=1, nic_ports=2).port_factor() == 2
    assert m.Links(qps_per_peer=24, nic_ports=2).port_factor() == 1
    assert m.Links(qps_per_peer=3, nic_ports=2).port_factor() == pytest.approx(4 / 3)


def test_calibration_reproduces_the_defaults_and_the_checks_hold():
    cal = m.calibrate()
    d = m.Links()
    assert cal["nvlink_efficiency"] == pytest.approx(d.nvlink_efficiency, abs=5e-4)
    assert cal["nic_efficiency"] == pytest.approx(d.nic_efficiency, abs=5e-4)
    rows = m.check_rows()
    assert len(rows) == 32
    for r in rows:
        if r["role"] != "check":
            assert abs(r["error"]) < 1e-3, r  # the calibration rows are met
        elif r["machine"] != "h800-cx7":
            assert r["error"] < 0, r  # at 2 ranks on H200 both implementations are slower than the link floor
    # DeepEP's published rows not used for calibration: the errors docs/model.md states, to its rounding
    # (0.05 points; the routing is seeded, so nothing else moves them)
    doc = (DOCS / "model.md").read_text()
    said = re.search(r"HT mean \|error\| ([\d.]+) % \(max ([\d.]+) %\), LL ([\d.]+) % \(max ([\d.]+) %\)", doc)
    assert said, "docs/model.md no longer states the model's errors in the form this test reads"
    stated = dict(zip(("ht_mean", "ht_max", "ll_mean", "ll_max"), (float(v) / 100 for v in said.groups())))
    for mode in ("ht", "ll"):
        err = [r["error"] for r in rows if (r["machine"], r["mode"], r["role"]) == ("h800-cx7", mode, "check")]
        assert len(err) == {"ht": 6, "ll": 12}[mode]
        assert sum(map(abs, err)) / len(err) == pytest.approx(stated[f"{mode}_mean"], abs=5e-4), (mode, err)
        assert max(map(abs, err)) == pytest.approx(stated[f"{mode}_max"], abs=5e-4), (mode, err)
    # "LL is predicted 5-24 % fast, every row"
    assert all(r["error"] < 0 for r in rows if (r["machine"], r["mode"]) == ("h800-cx7", "ll")), rows
    # DeepEP's HT bandwidth converts back to time with the same byte count the prediction uses
    ep32 = next(r for r in rows if (r["mode"], r["op"], r["ep"]) == ("ht", "dispatch", 32))
    assert ep32["published_us"] == pytest.approx(4096 * 7392 * 3.62 / 58e3, rel=0.01)


def test_bad_input_names_the_argument(tmp_path):
    with pytest.raises(ValueError, match="nic_gbps must be > 0 GB/s, got 0"):
        m.Links(nic_gbps=0)
    with pytest.raises(ValueError, match=r"nvlink_efficiency must be in \(0, 1\], got 1.5"):
        m.Links(nvlink_efficiency=1.5)
    with pytest.raises(ValueError, match="gpus_per_node must be an integer >= 1, got 0"):
        m.Links(gpus_per_node=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        m.Workload(tokens=1, dtype="fp16")
    with pytest.raises(ValueError, match="hidden must be a multiple of 128 for fp8, got 100"):
        m.Workload(tokens=1, hidden=100)
    with pytest.raises(ValueError, match="ranks=12 must be a multiple of gpus_per_node=8"):
        m.uniform_stats(12, 8, 96, 8)
    with pytest.raises(TypeError, match=r"topk_idx must be an int64 \(or int32\) tensor, got torch.float32"):
        m.stats_from_ids(torch.zeros(2, 2), 2, 1, 4)
    with pytest.raises(ValueError, match=r"topk_idx must be \[T, K\] or \[R=2, T, K\], got shape \(3, 2, 2\)"):
        m.stats_from_ids(torch.zeros(3, 2, 2, dtype=torch.int64), 2, 1, 4)
    with pytest.raises(ValueError, match=r"outside \[-1, 4\)"):
        m.stats_from_ids(torch.tensor([[0, 4]]), 2, 1, 4)
    with pytest.raises(ValueError, match="routing must be 'uniform', 'node-limited' or a file"):
        m.routing_stats("zipf", 8, m.Links(), m.Workload(tokens=1))
    bad = tmp_path / "ids.pt"
    bad.write_text("not a tensor")
    with pytest.raises(ValueError, match="routing file .*ids.pt' is not a saved tensor of expert ids"):
        m.routing_stats(str(bad), 8, m.Links(), m.Workload(tokens=1))
    with pytest.raises(ValueError, match="mode must be 'ht' or 'll'"):
        m.predict(m.Links(), m.Workload(tokens=1), m.uniform_stats(8, 8, 256, 8), "xx", "dispatch")
    with pytest.raises(ValueError, match=r"--out must end in .jsonl or .csv, got 'rows.txt'"):
        m.write_rows("rows.txt", [])


def test_cli_model_table_file_routing_and_outputs(tmp_path, capsys):
    ids = m.node_limited_ids(256, 16, 8, 256, 8, topk_groups=2)
    torch.save(ids, tmp_path / "ids.pt")
    out = tmp_path / "rows.csv"
    assert cli.main(["model", "--ep", "16", "--mode", "ht", "--routing", str(tmp_path / "ids.pt"),
                     "--nic-ports", "2", "--qps-per-peer", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "# queue pairs: 1 per peer on 2 NIC port(s), round-robin: the network runs at 1/2 of its rate" in text
    with out.open() as f:
        got = list(csv.DictReader(f))
    assert len(got) == 2 and all(r["routing"] == "file ids.pt" for r in got)
    want = m.sweep(dataclasses.replace(m.Links(), nic_ports=2, qps_per_peer=1), m.Workload(tokens=4096), None,
                   [16], str(tmp_path / "ids.pt"))
    assert [float(r["time_us"]) for r in got] == pytest.approx([r["time_us"] for r in want])
    assert json.loads(got[0]["assumptions"])[2].startswith("queue pairs: 1 per peer")
    assert cli.main(["model", "--check", "--out", str(tmp_path / "check.jsonl")]) == 0
    text = capsys.readouterr().out
    assert "DeepEP V1 published rows not used for calibration: 18" in text
    checks = [json.loads(ln) for ln in (tmp_path / "check.jsonl").read_text().splitlines()]
    assert {r["role"] for r in checks} == {"check", "nvlink_efficiency", "nic_efficiency"}
    assert cli.main(["model", "--ep", "12"]) == 2
    assert "experts=256 must be a multiple of every EP size, got 12" in capsys.readouterr().err


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    links, work = m.Links(), m.Workload(tokens=128)
    rows = m.sweep(links, None, work, [8, 16], "uniform")
    p = m.plot(rows, tmp_path / "model.png", m.assumptions(links, None, work, "uniform"))
    assert p.stat().st_size > 10_000
