"""Tier 1: ``python3 -m epcomm.bench.hostprobe`` refuses ``--modes launches`` where a call's launches cannot
be replayed on their own (the high-throughput and V2 kernels wait on counters each call advances: on an
H100 such a replay left the error word full of -1s: commit f385422's hostprobe-v2.log); its ``--json``
records say where they ran (device, versions, the commit of the tree it runs from)."""
import pytest

from epcomm.bench import hostprobe


@pytest.mark.parametrize("api", ["ht", "v2"])
def test_launches_mode_is_refused_where_launches_wait_on_counters(api, capsys):
    with pytest.raises(SystemExit) as e:
        hostprobe.main(["--api", api, "--modes", "call,launches", "--rounds", "1", "--calls", "1", "--tokens", "1"])
    assert e.value.code == 2
    assert f"only --api ll, got --api {api}" in capsys.readouterr().err


def test_json_records_carry_provenance(tmp_path, monkeypatch):
    """Every record of ``--json`` says where it ran: device, versions, EPCOMM_* variables, and this tree's commit
    as ``epcomm bench`` records it (here from EPCOMM_COMMIT, as on a GPU machine's copy without .git)."""
    import json
    import os

    monkeypatch.setenv("EPCOMM_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    monkeypatch.setenv("EPCOMM_COMMIT_DIRTY", "0")
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(hostprobe.__file__)))))
    out = tmp_path / "hp.json"
    assert hostprobe.main(["--api", "ll", "--modes", "python", "--tokens", "1", "--calls", "3", "--rounds", "1",
                           "--tree", f"mine={here}", "--tree", f"other={tmp_path}", "--json", str(out)]) == 0
    recs = json.loads(out.read_text())  # ("other" has no src/: its child imports the installed epcomm)
    assert sorted(r["tree"] for r in recs) == ["mine", "other"] and all(r["env"] == recs[0]["env"] for r in recs)
    env = recs[0]["env"]
    assert env["device"] == "cpu" and env["torch"] and env["python"]
    assert env["epcomm_env"]["EPCOMM_COMMIT"].startswith("0123456789")
    assert env["trees"]["mine"] == {"path": here, "git_sha": "0123456789abcdef0123456789abcdef01234567",
                                    "git_dirty": False, "commit_source": "EPCOMM_COMMIT"}
    assert env["trees"]["other"] == {"path": str(tmp_path)}  # another tree: its label names its commit


def test_norm_divides_out_a_slow_process():
    """Two trees doing the same work in a fast and a slow process (every call, and the calibration row, twice
    as slow in one): their ``norm`` agrees, their ``us`` does not."""
    from epcomm.bench import hostprobe as hp

    def run(f):
        return {"T=1": {"dc": {"us": 20.0 * f, "p10": 18.0 * f}, hp.CALIB: {"us": 10.0 * f, "p10": 9.0 * f}}}

    lines = hp._summary({("fast", "call"): [run(1)], ("slow", "call"): [run(2)]})
    head = lines[0].split()
    rows = {ln.split()[0]: ln.split() for ln in lines[1:] if ln.split()[3] == "dc"}
    us, norm = head.index("us"), head.index("norm") + 1  # (the spread column is two words: min.. max)
    assert (float(rows["fast"][us]), float(rows["slow"][us])) == (20.0, 40.0)
    assert float(rows["fast"][norm]) == float(rows["slow"][norm]) == 30.0  # 2 x the calibration's median, 15


def test_every_probe_process_times_the_calibration_row():
    from epcomm.bench import hostprobe as hp

    row = hp._calibration("cpu", 100)
    assert row["us"] > 0 and row["p10"] <= row["us"]


def test_rotating_sets_run_in_turn_each_after_its_own_prep():
    """``--sets``: a kind's calls on several input sets in turn (as ``epcomm bench`` rotates them), each set's
    ``prep`` right before its own call; no prep where no set has one."""
    from epcomm.bench import hostprobe

    log = []
    pairs = [(lambda i=i: log.append(("prep", i)), lambda i=i: log.append(("call", i)) or i) for i in range(3)]
    prep, call = hostprobe._rotating(pairs)
    got = []
    for _ in range(4):
        prep()
        got.append(call())
    assert got == [0, 1, 2, 0]
    assert log == [(w, i) for i in (0, 1, 2, 0) for w in ("prep", "call")]
    assert hostprobe._rotating([(None, lambda: 1)] * 2)[0] is None
