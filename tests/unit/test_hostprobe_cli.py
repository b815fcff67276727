"""Tier 1: ``python3 -m epcomm.bench.hostprobe`` refuses ``--modes launches`` where a call's launches cannot
be replayed on their own (the high-throughput and V2 kernels wait on counters each call advances: on an
H100 such a replay left the error word full of -1s, benchmarks/2026-11-27/s5/call1-501f1b8)."""
import pytest

from epcomm.bench import hostprobe


@pytest.mark.parametrize("api", ["ht", "v2"])
def test_launches_mode_is_refused_where_launches_wait_on_counters(api, capsys):
    with pytest.raises(SystemExit) as e:
        hostprobe.main(["--api", api, "--modes", "call,launches", "--rounds", "1", "--calls", "1", "--tokens", "1"])
    assert e.value.code == 2
    assert f"only --api ll, got --api {api}" in capsys.readouterr().err
