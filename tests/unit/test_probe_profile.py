"""Tier 1: ``hostprobe --modes profile`` (``bench/probe_profile.py``): each call kind's functions by their own time
per call, the profiler on around the call only (not its ``prep``), C functions such as ``torch.empty`` counted
as many times a call as the call makes them."""
import torch

from epcomm.bench import probe_profile


def test_counts_per_call_and_leaves_prep_out():
    kept = []

    def prep():  # untimed: three allocations the report must not show
        kept[:] = [torch.empty(4) for _ in range(3)]

    def call():
        return [torch.empty(8) for _ in range(5)], torch.zeros(2).add_(1)

    top = probe_profile.profile(prep, call, 40)
    rows = {r["fn"]: r for r in top}
    assert rows["<built-in method torch.empty>"]["per_call"] == 5.0 and rows["<built-in method torch.empty>"]["c"]
    assert rows["<built-in method torch.zeros>"]["per_call"] == 1.0
    whole = top[-1]
    assert whole["fn"] == "(all)" and whole["us"] >= whole["c_us"] > 0
    assert whole["c_us"] >= sum(r["us"] for r in top[:-1] if r["c"]) * 0.999
    assert not any("disable" in r["fn"] for r in top)


def test_summary_lines():
    top = probe_profile.profile(None, lambda: torch.empty(3), 10)
    lines = probe_profile.summary({"T=1": {"dc": {"us": 2.0, "top": top}, "calib": {"us": 1.0}}})
    assert lines[0].startswith("T=1 dc: 2.0 us a call unprofiled") and "torch.empty" in lines[1]
    assert len(lines) == len(top)  # a line per function, the whole in the first, no line for a row without top


def test_the_probe_profiles_each_kind_on_the_cpu_rig(monkeypatch, own_group):
    """``probe(mode="profile")`` without a GPU: the CPU rig's LL calls, each row with its list."""
    from epcomm.bench import hostprobe

    real = hostprobe.install
    monkeypatch.setattr(hostprobe, "install", lambda: real(monkeypatch.setattr, monkeypatch.setitem))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = hostprobe.probe("profile", tokens=(1,), calls=5, api="ll")
    for kind, row in out["T=1"].items():
        if kind != hostprobe.CALIB:
            assert row["top"][-1]["fn"] == "(all)" and row["us"] > 0, kind


def test_before_bench_runs_what_the_bench_runs_before_an_eager_call(monkeypatch):
    """``hostprobe --before bench``: before each call the bench's own barrier and start (``bench/timing``), then
    an event: the order the bench's eager loop has (fails if the probe's sequence differs)."""
    import torch.distributed as dist

    from epcomm.bench import hostprobe, timing

    seen = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(timing, "make_barrier", lambda group, dev: lambda: seen.append("barrier"))
    monkeypatch.setattr(timing, "make_start", lambda group, dev, graphs: (
        lambda: seen.append(f"start graphs={graphs}")))

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            seen.append("event")
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(dist, "group", type("G", (), {"WORLD": object()}))
    before = hostprobe.bench_position()
    hostprobe.time_calls(None, lambda: seen.append("call"), 2, before)
    assert seen == ["barrier", "start graphs=False", "event", "call"] * 2
