"""Tier 1: statistics and the timing loop on CPU (the barrier replaced by a no-op: no process group)."""

from __future__ import annotations

import pytest
import torch

from epcomm.bench import timing
from epcomm.bench.progress import Progress


def test_percentile_matches_numpy_linear():
    s = [1.0, 2.0, 3.0, 4.0]
    assert timing.percentile(s, 50) == pytest.approx(2.5)
    assert timing.percentile(s, 10) == pytest.approx(1.3)
    assert timing.percentile(s, 90) == pytest.approx(3.7)
    assert timing.percentile([5.0], 90) == 5.0


def test_stats_of():
    st = timing.Stats.of([3.0, 1.0, 2.0])
    assert (st.median, st.p10, st.p90, st.n) == (2.0, pytest.approx(1.2), pytest.approx(2.8), 3)
    with pytest.raises(ValueError):
        timing.Stats.of([])


def test_measure_runs_prep_and_phases_and_rotates_sets(monkeypatch):
    monkeypatch.setattr(timing, "make_barrier", lambda group, device: lambda: None)
    calls = []

    def build(s):
        return [lambda: calls.append(("prep", s))], [lambda: calls.append(("send", s)),
                                                     lambda: calls.append(("recv", s))]

    op = timing.TimedOp("dispatch", "fp8", ("send", "recv"), build)
    m = timing.measure(op, num_sets=3, iters=4, warmup=2, group=None, device=torch.device("cpu"))
    assert m.method == "wall" and m.phases == ("send", "recv")
    assert [st.n for st in m.stats] == [4, 4] and len(m.host) == 2
    sets = [s for what, s in calls if what == "prep"]
    assert sets == [0, 1, 2, 0, 1, 2]  # 2 warm-up + 4 timed iterations, sets rotating
    assert calls[:3] == [("prep", 0), ("send", 0), ("recv", 0)]


def test_measure_rejects_zero_iterations(monkeypatch):
    monkeypatch.setattr(timing, "make_barrier", lambda group, device: lambda: None)
    op = timing.TimedOp("dispatch", "bf16", ("total",), lambda s: ([], [lambda: None]))
    with pytest.raises(ValueError, match="iters"):
        timing.measure(op, num_sets=1, iters=0, warmup=0, group=None, device=torch.device("cpu"))


def test_progress_render():
    p = Progress(total=4, enabled=False)
    p.update("a")
    text = p.render("ht-dsv3 dispatch-bf16")
    assert "1/4" in text and "25%" in text and text.endswith("ht-dsv3 dispatch-bf16")
    assert text.count("#") == 6 and text.startswith("[")
