"""Tier 3: ``epcomm bench`` on GPUs checks every row the way it was timed against the reference, counts
link bytes by the timed backend's own layout, and labels the peer by the group's transport.

The ``small`` cases (HT and LL, with the receive hook) on WORLD ranks, eager and (where the ranks are
joined by NCCL) CUDA-graph rows: every row of the fast backend passes its timed check against the
reference's result (``timed_oracle == "reference"``), graph replays included; the link counting rule
follows the backend and the timing (nvlink LL: one message per (token, rank); nvlink HT: the copy
engine's whole batch when eager, the SM push's rows under graph replay); with ranks sharing a GPU
(gloo) the peer is ``gloo-a2a`` and no speedup is printed against it.
"""
import json
import os

from epcomm import cli
from epcomm.testing.launcher import share_gpu

WORLD = int(os.environ.get("EPCOMM_TEST_WORLD", "2"))


def test_bench_rows_are_checked_as_timed_on_gpus(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    rc = cli.main(["bench", "--cases", "small", "--world-size", str(WORLD), "--iters", "3", "--warmup", "1",
                   "--sets", "2", "--out", str(out), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    shared = share_gpu(WORLD)
    fast = [r for r in rows if r["backend"] not in ("reference",) and not r["backend"].endswith("-a2a")]
    assert fast and {r["backend"] for r in fast} == {"nvlink"}, {r["backend"] for r in rows}
    for r in rows:
        assert r["check"] == "pass" and r["timed_check"] == "pass", r
        assert r["timed_oracle"] == ("round trip" if r["backend"].endswith("-a2a") else "reference"), r
        assert r["caveat"] == ("ranks share GPUs through gloo: host times only; GPU times are not performance"
                               if shared else None)
    if not shared:  # graph capture needs NCCL between the ranks
        assert {r["timing"] for r in fast} == {"events", "graph"}
    for r in fast:
        if r["phase"] != "total":
            continue
        if r["mode"] == "ll":
            assert r["link_counting"] == "ll-rank-messages", r
        elif r["op"] == "dispatch" and not os.environ.get("EPCOMM_HT_TRANSFER"):
            assert r["link_counting"] == "ht-rank-rows", r  # the SM push, eager and graph (the default)
        assert r["link_bytes"] > 0
    peer = {r["backend"] for r in rows if r["backend"].endswith("-a2a")}
    # (a shared-GPU group is gloo for CPU and CUDA tensors: its name is "cpu:gloo,cuda:gloo")
    assert len(peer) == 1 and next(iter(peer)).endswith("gloo-a2a" if shared else "nccl-a2a"), peer
    if shared:
        assert all(r["speedup"] is None for r in rows)
        assert "no speedup is shown" in text
