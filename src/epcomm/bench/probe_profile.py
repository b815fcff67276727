"""Where a call's host time goes, on the host that runs it (``hostprobe --modes profile``): the call kinds of
the probe under ``cProfile``, the profiler on around each call only, then per function its own time per call
(``tottime``: C functions such as ``torch.empty`` or Triton's C launcher included, each as one entry).

Why: the ``call`` mode says how long a call takes on a GPU host, the ``python`` mode what it does on the CPU rig,
and neither says which part of a GPU host's time is the allocator, the launches or Python. The profiler adds its
own cost to every Python function entered (a profiled call runs slower than ``call`` says); a C function's own
time is measured around the C call alone, so the C entries (``{built-in method torch.empty}``,
``{method 'launch' ...}``) are about what they cost unprofiled, and their sum is a floor of the call's host time.
"""

from __future__ import annotations

import cProfile
import pstats

TOP = 14  # entries a call kind reports


def _label(func: tuple) -> str:
    """``(file, line, name)`` of pstats -> ``name`` for C functions, ``file:line(name)`` (the path from ``epcomm/``
    or the file's name) for Python ones."""
    path, line, name = func
    if path == "~" or not path:
        return name
    short = path.split("/epcomm/", 1)[1] if "/epcomm/" in path else path.rsplit("/", 1)[-1]
    return f"{short}:{line}({name})"


def profile(prep, call, n: int, sync=None) -> list[dict]:
    """``call()`` ``n`` times (``prep()`` and ``sync()`` untimed before each), profiled around the call only:
    the ``TOP`` functions by own time, each ``{"fn", "us" (own µs per call), "per_call" (times entered per
    call), "c" (a C function)}``, then a ``"(all)"`` row: the profiled µs per call of everything, and of C
    functions alone (``c_us``)."""
    prof = cProfile.Profile()
    for _ in range(n):
        if prep is not None:
            prep()
        if sync is not None:
            sync()
        prof.enable()
        call()
        prof.disable()
    stats = pstats.Stats(prof).stats  # {func: (primitive calls, calls, tottime, cumtime, callers)}
    rows = sorted(((f, s[1], s[2]) for f, s in stats.items() if f[2] != "<method 'disable' of '_lsprof.Profiler' "
                   "objects>" and "disable" not in f[2]), key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    c_total = sum(r[2] for r in rows if r[0][0] == "~")
    out = [{"fn": _label(f), "us": tt / n * 1e6, "per_call": calls / n, "c": f[0] == "~"} for f, calls, tt in rows[:TOP]]
    out.append({"fn": "(all)", "us": total / n * 1e6, "c_us": c_total / n * 1e6, "per_call": 1.0, "c": False})
    return out


def summary(rows: dict) -> list[str]:
    """Lines for ``{"T=..": {kind: row}}`` rows whose ``top`` is :func:`profile`'s list."""
    lines = []
    for tk, kinds in rows.items():
        for kind, row in kinds.items():
            top = row.get("top")
            if not top:
                continue
            whole = top[-1]
            lines.append(f"{tk} {kind}: {row['us']:.1f} us a call unprofiled (median); profiled, own time per call summed "
                         f"{whole['us']:.1f} us, of it C functions {whole['c_us']:.1f} us")
            lines += [f"    {r['us']:7.2f} us  x{r['per_call']:<5.1f} {'C ' if r['c'] else '  '}{r['fn']}" for r in top[:-1]]
    return lines
