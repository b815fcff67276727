"""Timing: wall clock on CPU, CUDA events or CUDA-graph replays on GPU.

A :class:`TimedOp` builds, for each input set ``s``, a list of untimed ``prep`` steps and a list of
timed ``steps`` (one per phase: ``["total"]``, or ``["send", "recv"]`` for the receive hook). Every
iteration runs the prep steps, waits at a barrier (all ranks start together, the GPU idle), then
marks a timestamp before the first step and after each step. Input sets rotate from one iteration
to the next so caches do not flatter.

Methods, recorded in each row as ``timing``:
- ``wall``: ``time.perf_counter`` (CPU ranks; the ops complete synchronously).
- ``events``: ``torch.cuda.Event`` pairs on the current stream (eager launches, host gaps included).
- ``graph``: each step captured once per input set into a ``torch.cuda.CUDAGraph`` and replayed;
  the events bracket the replays. Capture is attempted only where the op says it can be captured;
  all ranks agree (one failing rank makes every rank fall back to ``events``). One eager iteration
  follows the replays, so errors the backend records on the device surface as exceptions.

Start alignment (GPU): after the host barrier, the ranks' devices would start up to tens of
microseconds apart (host jitter), and a rank that starts early spends that time waiting for its
peers inside the timed op. So every iteration first enqueues a one-element ``all_reduce`` on the
group, which every rank's device leaves at about the same moment, and marks the start after it.
With ``graph`` a ``torch.cuda._sleep`` is enqueued before that, long enough for the host to queue
the rest of the iteration, so the marks bracket device work only (eager ``events`` rows keep their
host gaps: there the host is part of what is measured).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

Step = Callable[[], object]


@dataclasses.dataclass(frozen=True)
class Stats:
    """Median and 10th/90th percentiles (seconds) of ``n`` samples."""

    median: float
    p10: float
    p90: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> Stats:
        if not samples:
            raise ValueError("no samples to summarise")
        s = sorted(samples)
        return cls(percentile(s, 50), percentile(s, 10), percentile(s, 90), len(s))


def percentile(sorted_samples: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) of already sorted samples.

    Example: ``percentile([1, 2, 3, 4], 50) == 2.5``; ``percentile([1, 2, 3, 4], 10) == 1.3``.
    """
    n = len(sorted_samples)
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return sorted_samples[lo] * (1 - frac) + sorted_samples[hi] * frac


@dataclasses.dataclass
class TimedOp:
    """``build(s) -> (prep, steps)`` for input set ``s``; ``len(steps) == len(phases)``."""

    op: str                       # "dispatch" | "combine"
    dtype: str                    # "bf16" | "fp8"
    phases: tuple[str, ...]       # ("total",) or ("send", "recv")
    build: Callable[[int], tuple[list[Step], list[Step]]]
    capturable: bool = False      # worth trying a CUDA graph (fixed shapes, no host sync)
    # verify(s, out): raise AssertionError if ``out`` (what the last step returned for input set ``s``,
    # run the way it was timed: graph replay or eager) is not the oracle's result for that set, or
    # NotChecked where this output cannot be compared with it
    verify: Callable[[int, Any], None] | None = None
    oracle: str = "reference"     # what verify compares with: "reference" (the oracle backend's results)
    #                               or "round trip" (combine(dispatch(x)) against x * sum(w), the peer's)


class NotChecked(Exception):
    """Raised by a ``verify`` that has no oracle for this output; the row says so (``not checked: ...``)."""


def checked_set(warmup: int, iters: int, num_sets: int) -> int:
    """The input set a timed op is verified on: the next one in rotation after the timed iterations
    (low-latency graphs alternate receive areas; the check keeps the alternation). The expectations are
    computed for this set before timing."""
    return (warmup + iters) % num_sets


@dataclasses.dataclass
class Measurement:
    phases: tuple[str, ...]
    stats: list[Stats]            # one per phase (GPU or wall time)
    host: list[float]             # median host seconds per phase (time to return from the call)
    method: str                   # "wall" | "events" | "graph"
    verified: str | None = None   # op.verify run as timed: "pass" | "FAIL: ..." | "not checked: ..." | None
    calib: float | None = None    # median host seconds of calibration_work, timed in each iteration
    host_spread: list | None = None  # (p10, p90) host seconds per phase


def calibration_work(device: torch.device):
    """A fixed host workload that no epcomm code runs: ``work()`` makes 8 small tensors and launches one
    one-element in-place op (a kernel on a GPU), and returns the tensors (freed by the caller). Timed in the bench
    (``host_calib_us``) and in the host probe's processes (``bench/hostprobe.py``'s calibration row)."""
    one = torch.zeros(1, device=device)

    def work():
        kept = [torch.empty(64, dtype=torch.int32, device=device) for _ in range(8)]
        one.add_(1)
        return kept
    return work


class _WallMarks:
    def __init__(self) -> None:
        self.t: list[float] = []

    def mark(self) -> None:
        self.t.append(time.perf_counter())

    def intervals(self) -> list[float]:
        return [b - a for a, b in zip(self.t, self.t[1:])]


class _EventMarks:
    def __init__(self) -> None:
        self.ev: list[torch.cuda.Event] = []

    def mark(self) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.ev.append(e)

    def intervals(self) -> list[float]:
        self.ev[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in zip(self.ev, self.ev[1:])]


def make_barrier(group, device: torch.device) -> Callable[[], None]:
    """All ranks line up with an idle device: synchronise the GPU, then a group barrier."""
    if device.type == "cuda":
        def barrier() -> None:
            torch.cuda.synchronize()
            dist.barrier(group=group)
            torch.cuda.synchronize()
        return barrier
    return lambda: dist.barrier(group=group)


_SLEEP_CYCLES = 4_000_000  # ~2 ms at 2 GHz: covers the host's queueing of align + replays


def make_start(group, device: torch.device, graphs: bool) -> Callable[[], None]:
    """Enqueue what lines the ranks' devices up before the first mark (see the module docstring)."""
    if device.type != "cuda":
        return lambda: None
    one = torch.ones(1, dtype=torch.float32, device=device)

    def start() -> None:
        if graphs:
            torch.cuda._sleep(_SLEEP_CYCLES)
        dist.all_reduce(one, group=group)
    return start


def check_verdict(case_check: str, timed: str | None) -> str:
    """The row's check: the case check (eager calls, before timing) and, where the op has one, the
    check of the checked set run the way it was timed, against the oracle (a CUDA-graph replay is not
    the eager call)."""
    if timed is None or timed == "pass" or timed.startswith("not checked") or case_check.startswith("FAIL"):
        return case_check
    return f"FAIL as timed ({timed})"


def timed_fields(m, i: int, case_check: str, checked: bool, oracle: str | None) -> dict:
    """The fields every timed row carries, for phase ``i`` of measurement ``m``: its times, how they were
    taken, and its checks (``checked``: the run checks at all, else ``--no-check``; ``oracle``: what the
    timed call was compared with, None where it was not)."""
    st = m.stats[i]
    p10, p90 = m.host_spread[i] if m.host_spread else (None, None)
    return {"median": st.median, "p10": st.p10, "p90": st.p90, "host": m.host[i], "host_p10": p10, "host_p90": p90,
            "host_calib": m.calib,
            "timing": m.method,
            "check": check_verdict(case_check, m.verified),
            "timed_check": m.verified or ("not run" if checked else "not run: --no-check"),
            "timed_oracle": oracle}


def fail_text(e: AssertionError) -> str:
    """A failed check as a row's verdict: ``FAIL:`` and the first line of the message."""
    return "FAIL: " + (str(e).splitlines() or ["assertion failed"])[0][:200]


class _Replay:
    """A captured step: calling it replays the graph and returns what the step returned at capture
    (its output tensors, which every replay rewrites), so a replayed step can be checked like an
    eager one. It holds the step too: the graph reads what the step's closure holds (a combine's
    handle and input), which must outlive it (freed, the allocator hands that memory to others)."""

    def __init__(self, graph, out, step) -> None:
        self.graph, self.out, self.step = graph, out, step

    def __call__(self):
        self.graph.replay()
        return self.out


def capture_graphs(plans: list[tuple[list[Step], list[Step]]]) -> list[tuple[list[Step], list[Step]]]:
    """Capture every prep and timed step of every input set into its own CUDA graph.

    Each step runs once eagerly on a side stream first (warm-up: allocations and compilation happen
    outside capture), then all are captured in the same order, so every rank issues the same
    sequence of collective calls. Returns the plans with each step replaced by its graph's replay.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for prep, steps in plans:
            for step in prep + steps:
                step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    out = []
    for prep, steps in plans:
        replays = []
        for step in prep + steps:
            g = torch.cuda.CUDAGraph()
            # thread_local: calls from other threads (NCCL's watchdog) cannot invalidate the capture
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                result = step()
            replays.append(_Replay(g, result, step))
        out.append((replays[:len(prep)], replays[len(prep):]))
    torch.cuda.synchronize()
    return out


def _agree(ok: bool, group, device: torch.device) -> bool:
    """True only if every rank says ``ok``."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def measure(op: TimedOp, *, num_sets: int, iters: int, warmup: int, group, device: torch.device,
            use_graphs: bool = True, reset: Callable[[], None] | None = None) -> Measurement:
    """Time ``op`` (see the module docstring). ``reset`` runs on every rank after a failed capture
    attempt (e.g. to reset low-latency buffer state that the partial capture may have advanced)."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    plans = [op.build(s) for s in range(num_sets)]
    barrier = make_barrier(group, device)
    method = "wall" if device.type != "cuda" else "events"
    if device.type == "cuda" and use_graphs and op.capturable:
        err = None
        try:
            graphed = capture_graphs(plans)
        except Exception as e:  # noqa: BLE001 - any capture failure falls back to events, logged
            err, graphed = e, None
        if _agree(graphed is not None, group, device):
            plans, method = graphed, "graph"
        else:
            log.warning("CUDA-graph capture of %s-%s failed on some rank (%s); timing eager launches with events",
                        op.op, op.dtype, err or "another rank failed")
            torch.cuda.synchronize()
            barrier()
            if reset is not None:
                reset()
    marks_cls = _WallMarks if device.type != "cuda" else _EventMarks
    start = make_start(group, device, method == "graph")
    samples: list[list[float]] = [[] for _ in op.phases]
    host: list[list[float]] = [[] for _ in op.phases]
    work, calib = calibration_work(device), []
    for it in range(warmup + iters):
        prep, steps = plans[it % num_sets]
        for p in prep:
            p()
        barrier()
        start()
        marks = marks_cls()
        marks.mark()
        h = []
        for step in steps:
            h0 = time.perf_counter()
            step()
            h.append(time.perf_counter() - h0)
            marks.mark()
        c0 = time.perf_counter()
        work()  # (after the last mark: outside the op's times)
        c = time.perf_counter() - c0
        dt = marks.intervals()
        if it >= warmup:
            calib.append(c)
            for j in range(len(op.phases)):
                samples[j].append(dt[j])
                host[j].append(h[j])
    barrier()
    verified = None
    sv = checked_set(warmup, iters, num_sets)
    if op.verify is not None:
        # Check the op the way it was timed (a graph replay is not an eager call): the checked set once
        # more through the timed plans; its last step's output against the oracle's for that set.
        prep, steps = plans[sv]
        for p in prep:
            p()
        timed_out = [step() for step in steps][-1]
        if device.type == "cuda":
            torch.cuda.synchronize()
        try:
            op.verify(sv, timed_out)
            verified = "pass"
        except AssertionError as e:
            verified = fail_text(e)
        except NotChecked as e:
            verified = f"not checked: {e}"[:200]
        barrier()
    if method == "graph":
        # Replays bypass the backend's host-side checks (deadline expiries recorded by its kernels):
        # one eager iteration afterwards lets them raise here instead of leaving wrong numbers.
        if reset is not None:
            reset()
        prep, steps = op.build(sv)
        for step in prep + steps:
            step()
        barrier()
    hs = [Stats.of(h) for h in host]
    return Measurement(op.phases, [Stats.of(s) for s in samples], [h.median for h in hs], method, verified,
                       Stats.of(calib).median, [(h.p10, h.p90) for h in hs])
