"""Tier 1: ``hostprobe --variants`` (``bench/probe_variants.py``): ``EPCOMM_TUNE`` variants of one tree timed in one
process, their calls interleaved call by call. Each call runs under its own variant's launch tables, the
paired ratio is the later variant's call over the first's of the same iteration, and the process's tables and
``EPCOMM_TUNE`` are as before afterwards."""
import os

import pytest

from epcomm import _env
from epcomm.backends import nvlink_params
from epcomm.bench import hostprobe
from epcomm.bench import probe_variants as pv


def test_parse():
    assert pv.parse("off=;on=ce_chunks=2,gather_rb=8") == [("off", ""), ("on", "ce_chunks=2,gather_rb=8")]
    for bad in ("off", "off=;off=gather_rb=8", "only=", "=gather_rb=8;b="):
        with pytest.raises(ValueError, match="--variants"):
            pv.parse(bad)


def _make(seen: list):
    """A stand-in for the probe's buffer: applies ``EPCOMM_TUNE`` as a backend does at its start; its one call
    records the ``gather_rb`` it runs under and the label of the variant it was made for."""
    nvlink_params.apply_tune(_env.tune())
    made_with = nvlink_params.TUNE["gather_rb"]
    return {"T=1": {"dc": (None, lambda: seen.append((made_with, nvlink_params.TUNE["gather_rb"])) or made_with)}}


def test_each_call_runs_under_its_own_variants_tables(monkeypatch):
    monkeypatch.setenv("EPCOMM_TUNE", "push_rb=4")
    before = dict(nvlink_params.TUNE)
    seen: list = []
    out = pv.probe([("a", ""), ("b", "gather_rb=8")], lambda: _make(seen), hostprobe.time_calls, hostprobe.us_row,
                   5)  # (5 iterations: the last one ends on b)
    default = before["gather_rb"]
    assert default != 8
    assert sorted(set(seen)) == sorted({(default, default), (8, 8)})  # made with b's tables, b's when it ran
    assert len(seen) == 10 and seen[0][0] == default and seen[1][0] == 8 and seen[2][0] == 8  # a b, b a, ...
    assert set(out) == {"a", "b"} and "ratio" in out["b"]["T=1"]["dc"] and "ratio" not in out["a"]["T=1"]["dc"]
    assert nvlink_params.TUNE == before and os.environ["EPCOMM_TUNE"] == "push_rb=4"


def test_the_ratio_pairs_each_call_with_the_first_variants(monkeypatch):
    monkeypatch.delenv("EPCOMM_TUNE", raising=False)
    ns = {4: 100, 8: 150}  # b's i-th call takes 1.5 times a's i-th, each variant's calls slower one by one
    count = {4: 0, 8: 0}

    def timed(prep, call, n, sync=None):
        v = call()
        count[v] += 1
        return [ns[v] * count[v]]

    def make():
        nvlink_params.apply_tune(_env.tune())
        return {"T=1": {"dc": (None, lambda: nvlink_params.TUNE["gather_rb"])}}

    out = pv.probe([("a", "gather_rb=4"), ("b", "gather_rb=8")], make, timed, hostprobe.us_row, 10)
    row = out["b"]["T=1"]["dc"]
    assert row["ratio"] == row["ratio_p10"] == row["ratio_p90"] == 1.5
    assert out["a"]["T=1"]["dc"]["us"] == 0.6 and row["us"] == 0.9  # (the medians of 100..1000 and 150..1500 ns)
    assert "EPCOMM_TUNE" not in os.environ
    lines = pv.summary({"a": [out["a"]], "b": [out["b"]]})
    assert lines[1].split()[:4] == ["b/a", "1", "dc", "1.500"]


def test_cli_on_the_cpu_rig(capsys):
    """The probe's CPU rig (V2 calls, the nvlink backend with no-op launches): a variant of a launch constant
    against the defaults, one process; its table and the paired ratios of every call kind."""
    assert hostprobe.main(["--api", "v2", "--modes", "python", "--tokens", "1", "--calls", "5", "--rounds", "1",
                           "--variants", "off=;g8=gather_rb=8"]) == 0
    out = capsys.readouterr().out
    table = out.split("paired ratios, python:")
    assert len(table) == 2
    kinds = {ln.split()[2] for ln in table[1].splitlines()[2:] if ln.startswith("g8/off")}
    assert {"dc", "dcs", "dx", "dxs", "cached"} <= kinds
    assert any(ln.startswith("g8 ") for ln in table[0].splitlines())


def test_cli_refuses_variants_with_two_trees(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        hostprobe.main(["--modes", "python", "--variants", "a=;b=gather_rb=8", "--tree", f"x={tmp_path}",
                        "--tree", f"y={tmp_path}"])
    assert e.value.code == 2 and "--variants takes one tree" in capsys.readouterr().err


def test_each_variant_runs_after_its_own_sync(monkeypatch):
    """``syncs`` (``hostprobe --before sync,bench``: one code in two positions): every call of a variant runs right
    after that variant's own ``sync``, and the pairs alternate as for TUNE variants."""
    monkeypatch.delenv("EPCOMM_TUNE", raising=False)
    last, seen = [], []

    def make():
        return {"T=1": {"dc": (None, lambda: seen.append(last[-1]))}}

    syncs = {"sync": lambda: last.append("sync"), "bench": lambda: last.append("bench")}
    out = pv.probe([("sync", ""), ("bench", "")], make, hostprobe.time_calls, hostprobe.us_row, 4, syncs=syncs)
    assert seen == ["sync", "bench", "bench", "sync", "sync", "bench", "bench", "sync"]
    assert "ratio" in out["bench"]["T=1"]["dc"]


def test_the_probe_takes_two_positions_as_variants(monkeypatch, own_group):
    """``probe(before="sync,bench")`` (on the CPU rig both positions are the rig's): rows for both labels, the
    second with its paired ratio."""
    real = hostprobe.install
    monkeypatch.setattr(hostprobe, "install", lambda: real(monkeypatch.setattr, monkeypatch.setitem))
    out = hostprobe.probe("python", tokens=(1,), calls=3, api="ll", before="sync,bench")
    assert set(out) == {"sync", "bench"} and "ratio" in out["bench"]["T=1"]["dispatch"]
