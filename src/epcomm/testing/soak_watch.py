"""What the soak (``epcomm.testing.soak``) watches in each rank between its calls, and the rules the run must keep.

A sample (every ``sample_every`` calls, at the end of the warm-up and at the end; ``torch.cuda.synchronize()``, the
finished gloo operations released and a garbage collection first) records the GPU memory in use (``torch.cuda.memory_allocated()``: live tensors, what a
cache that keeps tensors grows), the process's resident memory (``/proc/self/statm``), the size of every container
(dict, set, list, deque) the front ends, their backends, the low-latency engines and the V2 kernels hold, and the
Triton kernels compiled so far.

The rules, each failure a line naming what broke:

- **Caches bounded.** Each plan cache below holds at most its bound, the one its module enforces, at every sample.
  A cache the soak expects on a fast object but cannot find is a failure too (the table here must follow the code).
- **Memory flat after the warm-up.** No sample after the warm-up may exceed the warm-up's peak by more than its
  budget. On the GPU: twice the largest result set of one call at the maxima (``result_bytes``: a plan may keep
  one output set of its kind, and the low-latency outputs are two per shape), plus ``ENTRY_DEVICE`` bytes for
  each plan-cache entry beyond the most the caches held at the end of the warm-up. Resident memory: ``HOST_SLACK``
  (the allocator's arenas, Python's free lists, gloo's buffers), twice ``result_bytes`` where the tensors are host
  memory (a CPU run), ``ENTRY_HOST`` bytes a new cache entry (its Python objects: closures, bound launch
  arguments) and ``KERNEL_HOST`` a Triton kernel compiled after the warm-up. The new entries are counted from
  the caches' running peak, so a cache that is cleared and refilled is not charged twice, and a leak that is not
  a cache entry gets no allowance: a rank that keeps ``L`` bytes a call fails once ``L`` times the calls after
  the warm-up passes the budget.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import os
import sys
import time

import torch

MiB = 1 << 20
HOST_SLACK = 64 * MiB
ENTRY_HOST = 256 << 10  # a plan's Python objects (measured on the CPU rig: tens of KiB; four-fold margin)
ENTRY_DEVICE = 64 << 10  # a plan's own device scratch for its kind (index-sized: weights of zeros, prefix sums)
KERNEL_HOST = 16 * MiB  # a Triton compile in the process (its module, its binary, the compiler's arenas)

_CONTAINERS = (dict, set, list, collections.deque)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def compiled_kernels() -> int:
    """Triton kernels compiled in this process for epcomm's kernels (0 under the interpreter)."""
    n = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("epcomm.kernels"):
            continue
        for v in list(vars(mod).values()):
            caches = getattr(v, "device_caches", None)
            if isinstance(caches, dict):
                for c in list(caches.values()):
                    try:
                        n += len(c[0])
                    except (TypeError, IndexError, KeyError):
                        pass
    return n


def _bounds() -> dict:
    """``(kind of owner, attribute) -> (bound, where the bound is)`` of every plan cache the soak checks."""
    from ..backends import ht_combine, ht_dispatch, ll_calls

    # a plan cache of the backend is cleared once it holds more than _MAX_PLANS when a dispatch, cached dispatch or
    # combine plan is added (so it may hold one more), and the layout plan is added to it unchecked (one more)
    plans, kinds = max(ht_dispatch._MAX_PLANS, ht_combine._MAX_PLANS), ll_calls._MAX_KINDS
    return {
        ("buffer", "_ht_fast"): (4096, "buffer.py Buffer._keep: cleared when it holds 4096"),
        ("buffer", "_checked"): (4096, "buffer.py: no signature added past 4096"),
        ("buffer", "_ll_fast"): (4096, "buffer_ll.py _remember: cleared when it holds 4096"),
        ("elastic", "_fast"): (256, "elastic.py ElasticBuffer.dispatch: cleared when it holds 256"),
        ("backend", "_plans"): (plans + 2, f"backends/ht_dispatch.py, ht_combine.py _MAX_PLANS={plans}, and the "
                                           + "layout plan"),
        ("ll", "_dcalls"): (kinds + 1, f"backends/ll_calls.py _MAX_KINDS={kinds}: cleared past it"),
        ("ll", "_ccalls"): (kinds + 1, f"backends/ll_calls.py _MAX_KINDS={kinds}: cleared past it"),
        ("kernels", "_plans"): (65, "backends/elastic_kernels.py Kernels.recv_meta: cleared past 64"),
    }


# the caches a fast object must have (a reference object's are checked where it has them)
REQUIRED = {"ht": [("buffer", "_ht_fast"), ("buffer", "_checked"), ("backend", "_plans")],
            "ll": [("buffer", "_ll_fast"), ("buffer", "_checked"), ("ll", "_dcalls"), ("ll", "_ccalls")],
            "v2": [("elastic", "_fast"), ("backend", "_plans"), ("kernels", "_plans")]}


def owners(objs: dict) -> list[tuple[str, str, object]]:
    """``(label, kind of owner, object)`` of every object whose containers are watched: each front end in
    ``objs`` (``name -> Buffer or ElasticBuffer``), its backend, the backend's low-latency engine, its V2 kernels."""
    out = []
    for name, fe in objs.items():
        out.append((name, "elastic" if hasattr(fe, "_steps") else "buffer", fe))
        be = getattr(fe, "_backend", None)
        if be is not None:
            out.append((f"{name}.backend", "backend", be))
            if getattr(be, "_ll", None) is not None:
                out.append((f"{name}.backend._ll", "ll", be._ll))
        kern = getattr(getattr(fe, "_steps", None), "kernels", None)
        if kern is not None:
            out.append((f"{name}.kernels", "kernels", kern))
    return out


def census(objs: dict) -> tuple[dict, dict]:
    """``(sizes, bounded)``: the size of every container attribute of the watched objects (``label.attr``), and
    ``label.attr -> (bound, where)`` for the plan caches among them."""
    bounds = _bounds()
    sizes, bounded = {}, {}
    for label, kind, obj in owners(objs):
        for attr, v in list(vars(obj).items()):
            if isinstance(v, _CONTAINERS):
                sizes[f"{label}.{attr}"] = len(v)
                if (kind, attr) in bounds:
                    bounded[f"{label}.{attr}"] = bounds[(kind, attr)]
    return sizes, bounded


def missing(objs: dict) -> list[str]:
    """The plan caches ``REQUIRED`` on the fast objects that are not there."""
    out = []
    for name, need in REQUIRED.items():
        if name not in objs:
            continue
        by_kind = {kind: (label, obj) for label, kind, obj in owners({name: objs[name]})}
        for kind, attr in need:
            label, obj = by_kind.get(kind, (f"{name}.{kind}", None))
            if obj is None or not isinstance(vars(obj).get(attr), _CONTAINERS):
                out.append(f"{label}.{attr}")
    return out


@dataclasses.dataclass
class Sample:
    calls: int
    seconds: float
    rss: int
    gpu: int | None
    gpu_reserved: int | None
    entries: int  # entries of the bounded caches, all together
    kernels: int
    sizes: dict


class Watch:
    """The samples of one rank: ``take(calls)`` between calls; ``verdict(warm_calls, result_bytes)`` at the end."""

    def __init__(self, objs: dict, device: torch.device):
        self.objs, self.device = objs, device
        self.samples: list[Sample] = []
        self.bounded: dict = {}
        self.t0 = time.perf_counter()

    def take(self, calls: int) -> Sample:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        from ..backends import deadline

        settle = getattr(deadline, "_settle", None)  # the finished gloo works the backends keep for a moment,
        if settle is not None:  # with their tensors: let them go, so a sample holds nothing of the last call
            settle()
        gc.collect()
        sizes, bounded = census(self.objs)
        self.bounded.update(bounded)
        s = Sample(calls, time.perf_counter() - self.t0, rss_bytes(),
                   torch.cuda.memory_allocated(self.device) if cuda else None,
                   torch.cuda.memory_reserved(self.device) if cuda else None,
                   sum(sizes[k] for k in bounded), compiled_kernels(), sizes)
        self.samples.append(s)
        return s

    def verdict(self, warm_calls: int, result_bytes: int) -> dict:
        """The run's memory and cache figures, and ``failures`` (a list of lines; empty: every rule kept)."""
        failures = [f"plan cache {c} not found (epcomm.testing.soak_watch.REQUIRED must follow the code)"
                    for c in missing(self.objs)]
        for label, (bound, where) in sorted(self.bounded.items()):
            most = max(s.sizes.get(label, 0) for s in self.samples)
            if most > bound:
                failures.append(f"plan cache {label} held {most} entries, more than its bound {bound} ({where})")
        warm = [s for s in self.samples if s.calls <= warm_calls]
        after = [s for s in self.samples if s.calls > warm_calls]
        out = {"warm_calls": warm_calls, "result_bytes": result_bytes, "failures": failures,
               "caches": {k: [self.samples[-1].sizes.get(k, 0), max(s.sizes.get(k, 0) for s in self.samples), b[0]]
                          for k, b in sorted(self.bounded.items())}}
        # every container, plan cache or not, that holds more at the end than at the end of the warm-up
        end, w_end = self.samples[-1].sizes, (warm[-1] if warm else self.samples[0]).sizes
        out["grew"] = {k: [w_end.get(k, 0), n] for k, n in sorted(end.items()) if n > w_end.get(k, 0)}
        if len(after) < 2 or not warm:
            failures.append(f"too few samples after the warm-up ({len(after)}) to judge the memory: more calls, "
                            "or a smaller --sample-every")
            return out
        cpu = self.device.type != "cuda"
        peak_entries = max(s.entries for s in warm)
        k0 = warm[-1].kernels
        for metric in ("gpu", "rss"):
            if getattr(warm[0], metric) is None:
                continue
            base = max(getattr(s, metric) for s in warm)
            worst, running = None, peak_entries
            for s in after:
                running = max(running, s.entries)
                new_entries, new_kernels = running - peak_entries, max(s.kernels - k0, 0)
                if metric == "gpu":
                    budget = 2 * result_bytes + ENTRY_DEVICE * new_entries
                else:
                    budget = HOST_SLACK + (2 * result_bytes if cpu else 0) + ENTRY_HOST * new_entries + \
                        KERNEL_HOST * new_kernels
                over = getattr(s, metric) - base - budget
                if worst is None or over > worst[0]:
                    worst = (over, s, budget, new_entries, new_kernels)
            peak_after = max(getattr(s, metric) for s in after)
            over, s, budget, new_entries, new_kernels = worst
            out[metric] = {"warm_end": getattr(warm[-1], metric), "warm_peak": base, "peak_after": peak_after,
                           "budget_at_worst": budget, "new_entries": new_entries, "new_kernels": new_kernels}
            if over > 0:
                failures.append(f"{metric} memory grew after the warm-up: {fmt(getattr(s, metric))} at call {s.calls}, "
                                f"{fmt(getattr(s, metric) - base)} past the warm-up peak {fmt(base)}, budget "
                                f"{fmt(budget)} ({new_entries} new cache entries, {new_kernels} new kernels)")
        return out

    def series(self) -> list[dict]:
        return [{"calls": s.calls, "seconds": round(s.seconds, 3), "rss": s.rss, "gpu": s.gpu,
                 "gpu_reserved": s.gpu_reserved, "entries": s.entries, "kernels": s.kernels,
                 "caches": {k: s.sizes[k] for k in sorted(self.bounded) if k in s.sizes}}
                for s in self.samples]


def fmt(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"
