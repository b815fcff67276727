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


class _FakeCuda:
    """Just enough of ``torch.cuda`` to drive the GPU control flow of ``measure`` on a CPU: graphs
    record nothing (a replay counts itself), events return 1 ms."""

    def __init__(self, fail_capture: bool):
        self.fail_capture = fail_capture
        self.capturing = False
        self.replays = 0

    def install(self, monkeypatch):
        fake = self

        class Stream:
            def wait_stream(self, other):
                pass

        class Graph:
            def replay(self):
                fake.replays += 1

        class GraphCtx:
            def __init__(self, g, capture_error_mode="global"):
                assert capture_error_mode == "thread_local"

            def __enter__(self):
                fake.capturing = True

            def __exit__(self, *exc):
                fake.capturing = False

        class Event:
            def __init__(self, enable_timing=False):
                pass

            def record(self, stream=None):
                pass

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return 1.0

        import contextlib

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", GraphCtx)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(timing, "make_barrier", lambda group, device: lambda: None)
        monkeypatch.setattr(timing, "_agree", lambda ok, group, device: ok)
        fake.starts = []
        monkeypatch.setattr(timing, "make_start", lambda group, device, graphs: lambda: fake.starts.append(graphs))
        fake.calibs = []  # (the host calibration's runs: it makes tensors on the device, which a CPU torch cannot)
        monkeypatch.setattr(timing, "calibration_work", lambda device: lambda: fake.calibs.append(device))


@pytest.mark.parametrize("fail_capture", [False, True])
def test_gpu_control_flow_graph_or_fallback(monkeypatch, fail_capture):
    fake = _FakeCuda(fail_capture)
    fake.install(monkeypatch)
    eager, resets = [], []

    def build(s):
        def prep():
            eager.append(("prep", s))

        def step():
            if fake.capturing and fake.fail_capture:
                raise RuntimeError("operation not permitted when stream is capturing")
            eager.append(("step", s))
        return [prep], [step]

    op = timing.TimedOp("combine", "bf16", ("total",), build, capturable=True)
    m = timing.measure(op, num_sets=2, iters=3, warmup=1, group=None, device=torch.device("cuda"),
                       reset=lambda: resets.append(1))
    assert m.stats[0].median == pytest.approx(1e-3) and m.stats[0].n == 3
    # every iteration (warm-up included) lines the ranks up; graphs also pre-fill the queue (sleep)
    assert fake.starts == [not fail_capture] * 4
    # and times the host calibration once, after its steps (the row's host_calib_us: the timed iterations' median)
    assert fake.calibs == [torch.device("cuda")] * 4 and m.calib is not None and m.calib >= 0
    if fail_capture:
        assert m.method == "events" and fake.replays == 0 and resets == [1]
        # warm-up before the failed capture (2 sets), then 4 eager iterations
        assert [s for w, s in eager if w == "step"] == [0, 1, 0, 1, 0, 1]
    else:
        assert m.method == "graph"
        assert fake.replays == 4 * 2  # (warm-up + timed) iterations x (prep + step)
        # each set once eagerly (warm-up) and once under capture, then one eager check afterwards
        assert eager == [("prep", 0), ("step", 0), ("prep", 1), ("step", 1),
                         ("prep", 0), ("step", 0), ("prep", 1), ("step", 1), ("prep", 0), ("step", 0)]
        assert resets == [1]


def test_captured_steps_keep_what_their_graphs_read(monkeypatch):
    """A graph reads the tensors its step's closure holds (a combine's handle and input), so the
    replays keep the steps alive once the eager plans are gone: freed, that memory went to other
    tensors and the internode combine's graph replays read garbage (H100, MPS, 2026-11-25)."""
    import gc
    import weakref

    _FakeCuda(False).install(monkeypatch)

    class Held:  # stands for the handle a step closes over
        pass

    refs = []

    def build(s):
        held = Held()
        refs.append(weakref.ref(held))

        def step():
            return [type(held).__name__]  # a new output, as a combine's (it reads the handle, returns new tensors)
        return [], [step]

    plans = timing.capture_graphs([build(s) for s in range(2)])
    gc.collect()
    assert all(r() is not None for r in refs)
    del plans
    gc.collect()
    assert all(r() is None for r in refs)


def test_reference_ops_are_not_captured(monkeypatch):
    fake = _FakeCuda(False)
    fake.install(monkeypatch)
    op = timing.TimedOp("dispatch", "fp8", ("send", "recv"), lambda s: ([], [lambda: None, lambda: None]))
    m = timing.measure(op, num_sets=1, iters=2, warmup=0, group=None, device=torch.device("cuda"))
    assert m.method == "events" and fake.replays == 0 and len(m.stats) == 2


@pytest.mark.parametrize("wrong", [False, True])
def test_graph_rows_are_verified_as_replayed(monkeypatch, wrong):
    """The op's verify sees set 0's output the way it was timed: after a replay, the tensor the step
    returned under capture (which replays rewrite), not a fresh eager result."""
    fake = _FakeCuda(False)
    fake.install(monkeypatch)
    seen = []

    def build(s):
        def step():
            return {"set": s, "captured": fake.capturing}
        return [], [step]

    def verify(s, out):
        seen.append((s, out, fake.replays))
        if wrong:
            raise AssertionError("graph replay 0 recv_x: 3 of 63 rows differ\nmore detail")

    op = timing.TimedOp("dispatch", "bf16-worst", ("total",), build, capturable=True, verify=verify)
    m = timing.measure(op, num_sets=2, iters=2, warmup=0, group=None, device=torch.device("cuda"))
    assert m.method == "graph"
    assert seen == [(0, {"set": 0, "captured": True}, 2 + 1)]  # after the timed replays and one more of set 0
    assert m.verified == ("FAIL: graph replay 0 recv_x: 3 of 63 rows differ" if wrong else "pass")


def test_eager_rows_are_verified_and_ops_without_verify_say_so(monkeypatch):
    monkeypatch.setattr(timing, "make_barrier", lambda group, device: lambda: None)
    outs = []

    def build(s):
        return [], [lambda: outs.append(s) or len(outs)]

    got = []
    op = timing.TimedOp("combine", "bf16", ("total",), build, verify=lambda s, out: got.append((s, out)))
    m = timing.measure(op, num_sets=2, iters=3, warmup=0, group=None, device=torch.device("cpu"))
    # the next set in rotation (3 % 2 = 1) run once more after the 3 timed iterations, its output verified
    assert m.verified == "pass" and got == [(1, 4)] and outs == [0, 1, 0, 1]
    assert timing.checked_set(0, 3, 2) == 1 and timing.checked_set(10, 50, 4) == 0
    op = timing.TimedOp("combine", "bf16", ("total",), build)
    assert timing.measure(op, num_sets=1, iters=1, warmup=0, group=None, device=torch.device("cpu")).verified is None


@pytest.mark.parametrize("how", ["pass", "fail", "no oracle"])
def test_graph_rows_are_verified_against_the_oracle_not_an_eager_call(monkeypatch, how):
    """A graph row's timed check is the replay's output against the oracle's (verify), on the next set
    in rotation; the eager call after the replays (which surfaces errors the kernels recorded) is run
    but is not what the row's check compares. A verify without an oracle says so."""
    fake = _FakeCuda(False)
    fake.install(monkeypatch)
    resets, seen, eager_after = [], [], []

    def build(s):
        def step():
            if not fake.capturing and fake.replays:
                eager_after.append(s)
            return ("graph" if fake.capturing else "eager", s)
        return [], [step]

    def verify(s, out):
        seen.append((s, out))
        if how == "fail":
            raise AssertionError(f"set {s}: 3 of 8 rows differ from the reference\nmore")
        if how == "no oracle":
            raise timing.NotChecked("slots differ from the reference's")

    op = timing.TimedOp("dispatch", "fp8", ("total",), build, capturable=True, verify=verify)
    m = timing.measure(op, num_sets=2, iters=2, warmup=1, group=None, device=torch.device("cuda"),
                       reset=lambda: resets.append(fake.replays))
    assert m.method == "graph" and seen == [(1, ("graph", 1))]  # the replay's own output, set (1 + 2) % 2
    assert eager_after == [1] and resets == [3 + 1]  # reset after the timed replays and the checked one
    assert m.verified == {"pass": "pass", "fail": "FAIL: set 1: 3 of 8 rows differ from the reference",
                          "no oracle": "not checked: slots differ from the reference's"}[how]
