"""``epcomm bench --profile DIR``: where each operation's eager call spends its time.

For every timed operation (after its timing) each rank runs it eagerly again, twice over:

- under ``cProfile`` (the Python host path: argument checks, allocations, kernel launches, copies,
  events, host synchronisations, each a function in the table), written as
  ``DIR/<case>-<op>-<backend>.rank<r>.host.txt``, sorted by cumulative time, with the host time per call;
- under ``torch.profiler`` (CPU and, on GPUs, CUDA activities: kernels, copies, synchronisations),
  written as ``DIR/<case>-<op>-<backend>.rank<r>.torch.txt``.

The profilers' own overhead inflates the absolute host times; the ratios between phases are what
these files are for. The timed rows (``host us``) are measured without them, and so is
``DIR/host-primitives.rank<r>.txt``: the cost of each building block of the host path on this machine
(an allocation, a view, an event synchronisation, a kernel launch through Triton and through
``kernels/launch.py``), each timed alone.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import re
import time
from pathlib import Path

import torch

from .timing import TimedOp, make_barrier


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", s).strip("_")


def host_table(stats: pstats.Stats, calls: int, limit: int = 45) -> str:
    """cProfile's functions as µs per call of the profiled operation: calls, own time, time with callees."""
    rows = []
    for (file, line, name), (_, nc, tt, ct, _) in stats.stats.items():
        where = name if file == "~" else f"{Path(file).name}:{line}({name})"
        rows.append((ct / calls * 1e6, tt / calls * 1e6, nc / calls, where))
    rows.sort(reverse=True)
    out = [f"{'with callees us':>16} {'own us':>9} {'calls':>7}  function"]
    out += [f"{ct:16.1f} {tt:9.1f} {nc:7.1f}  {where}" for ct, tt, nc, where in rows[:limit]]
    return "\n".join(out) + "\n"


def profile_op(op: TimedOp, label: str, *, num_sets: int, iters: int, group, device: torch.device, rank: int,
               out_dir: str | Path, reset=None) -> list[Path]:
    """Profile ``iters`` eager iterations of ``op`` (see the module docstring); returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    barrier = make_barrier(group, device)
    if reset is not None:
        reset()
    plans = [op.build(s) for s in range(num_sets)]
    base = f"{_slug(label)}.rank{rank}"

    def run(it: int, before=None, after=None) -> float:
        prep, steps = plans[it % num_sets]
        for p in prep:
            p()
        barrier()
        if before is not None:
            before()
        t0 = time.perf_counter()
        for step in steps:
            step()
        dt = time.perf_counter() - t0
        if after is not None:
            after()
        return dt

    for it in range(2):  # warm-up: compilation, allocator
        run(it)
    prof = cProfile.Profile()
    host = [run(it, prof.enable, prof.disable) for it in range(iters)]
    text = io.StringIO()
    median_us = sorted(host)[len(host) // 2] * 1e6
    text.write(f"{label}: {iters} eager calls under cProfile, host time per call (median, with the "
               f"profiler's overhead): {median_us:.1f} us\n\n")
    text.write(host_table(pstats.Stats(prof), iters))
    host_path = out / f"{base}.host.txt"
    host_path.write_text(text.getvalue())

    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as tp:
        for it in range(iters):
            run(it)
        if device.type == "cuda":
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    torch_path = out / f"{base}.torch.txt"
    torch_path.write_text(f"{label}: {iters} eager calls under torch.profiler\n\n"
                          + tp.key_averages().table(sort_by=sort, row_limit=40))
    barrier()
    return [host_path, torch_path]


def _per_call_us(fn, n: int = 2000, batches: int = 5) -> float:
    """Median over ``batches`` of the mean host µs of ``n`` back-to-back calls of ``fn``."""
    out = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return sorted(out)[len(out) // 2]


def host_primitives(device: torch.device, out_dir: str | Path, rank: int) -> Path:
    """What the host path is made of on this machine, each timed alone (no profiler): a CUDA allocation,
    a view, an event record + synchronisation on an idle stream, and one launch of a small kernel
    (``ht._ce_flag_value_kernel``, 5 arguments, on scratch memory) through Triton's ``fn[grid](...)``
    and through ``kernels/launch.py`` (``Launcher``, ``Prepared`` with an address for its tensor,
    ``Direct``, and the C launcher it ends in, alone).
    Written to ``DIR/host-primitives.rank<r>.txt``."""
    from ..kernels import ht
    from ..kernels.launch import Direct, Launcher, Ptr

    rows = []
    x = torch.empty(1024, dtype=torch.int32, device=device)
    rows.append(("torch.empty(1024, int32) on the device", _per_call_us(
        lambda: torch.empty(1024, dtype=torch.int32, device=device))))
    rows.append(("tensor.view(dtype) + view(shape)",
                 _per_call_us(lambda: x.view(torch.float32).view(32, 32))))
    if device.type == "cuda":
        ev, s = torch.cuda.Event(), torch.cuda.current_stream()

        def sync():
            ev.record(s)
            ev.synchronize()
        rows.append(("Event.record(stream) + synchronize (idle GPU)", _per_call_us(sync, n=500)))
        ctr = torch.zeros(1, dtype=torch.int32, device=device)
        word = torch.zeros(1, dtype=torch.int32, device=device)
        fn = ht._ce_flag_value_kernel
        rows.append(("Triton fn[grid](...) launch, 5 arguments", _per_call_us(
            lambda: fn[(1,)](ctr, word, 3, 0, NC=4), n=500)))
        lau = Launcher(fn)
        rows.append(("Launcher(key, grid, ...) launch (tensors)", _per_call_us(
            lambda: lau(0, (1,), ctr, word, 3, 0, NC=4), n=500)))
        prep = lau.prepared(1, {"NC": 4})
        prep((1,), ctr, word, 3, 0)  # binds
        pc, pw = Ptr(ctr), Ptr(word)
        rows.append(("Prepared(grid, ...) launch (addresses)",
                     _per_call_us(lambda: prep((1,), pc, pw, 3, 0), n=500)))
        go = Direct(prep, (None, pw, 3, 0), (0,))
        go(1, 1, 1, ctr)  # after it, the direct way
        rows.append(("Direct(gx, gy, gz, tensor) launch (one per-call tensor)",
                     _per_call_us(lambda: go(1, 1, 1, ctr), n=500)))
        launch, args, stream = go.launch, list(go.args), go.get_stream(go.dev)
        args[go.first] = ctr.data_ptr()
        rows.append(("Triton's C launcher alone (prebuilt arguments)",
                     _per_call_us(lambda: launch(1, 1, 1, stream, *args), n=500)))
        torch.cuda.synchronize()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / f"host-primitives.rank{rank}.txt"
    path.write_text("host µs per call, each alone, back to back (no profiler)\n\n"
                    + "\n".join(f"{us:8.2f}  {what}" for what, us in rows) + "\n")
    return path
