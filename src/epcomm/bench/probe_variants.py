"""In-process A/B of ``EPCOMM_TUNE`` variants for the host probe (``hostprobe --variants``): every variant's
buffer in one process, their calls interleaved call by call.

Why: on the GPU hosts we lease, two processes running the same code differ by up to 2.5x in host time, with
the core pinned and with the Python hash seed and address-space layout fixed
(commits 1fd2e5e and 291ac6c), and the difference drifts with time. A host change of a few
launches or tensors is far below that. Within one process, calls of two variants alternated one by one see
the same process and the same moment: the paired ratio (variant B's call over the A call next to it)
takes both effects out.

How: for each variant (``LABEL=KEY=VALUE,...``; an empty spec is the defaults) the module-level launch tables
(``nvlink_params.TUNE``, ``nvlink_ll.TUNE``) are reset to their defaults, ``EPCOMM_TUNE`` is set to the spec, and
the variant's buffer is made (its backend applies the variable, as at any start) and its calls bound and
warmed; the tables as they then stand are the variant's. Timing: call ``i`` of every kind runs each variant
once, in the order A, B, ... for even ``i`` and reversed for odd ``i``, each after restoring its variant's
tables (untimed) and the probe's ``prep``/``sync``. A code change is measured the same way once its new path
sits behind a ``TUNE`` key.
"""

from __future__ import annotations

import os
import statistics


def tables() -> list[dict]:
    """The launch tables a variant may set (the nvlink backend's; their keys are ``EPCOMM_TUNE``'s)."""
    import importlib

    # (absolute: the host probe loads this file from its own tree, the process imports epcomm from the probed one)
    return [importlib.import_module(f"epcomm.backends.{m}").TUNE for m in ("nvlink_params", "nvlink_ll")]


def _set(tabs: list[dict], state: list[dict]) -> None:
    for t, s in zip(tabs, state):
        t.clear()
        t.update(s)


def parse(spec: str) -> list[tuple[str, str]]:
    """``"A=;B=gather_rb=8"`` -> ``[("A", ""), ("B", "gather_rb=8")]`` (at least two, labels unique).

    Example: ``parse("off=;on=ll.fused_dispatch=1")[1] == ("on", "ll.fused_dispatch=1")``."""
    out = []
    for part in spec.split(";"):
        label, sep, tune = part.partition("=")
        if not sep or not label.strip():
            raise ValueError(f"--variants: each variant is LABEL=EPCOMM_TUNE (may be empty), got {part!r}")
        out.append((label.strip(), tune.strip()))
    labels = [label for label, _ in out]
    if len(out) < 2 or len(set(labels)) != len(labels):
        raise ValueError(f"--variants needs two or more distinct labels, got {labels}")
    return out


def probe(variants: list[tuple[str, str]], make, time_calls, us_row, calls: int, sync=None, syncs=None) -> dict:
    """``{label: {"T=..": {kind: row}}}`` for each variant: ``make()`` builds this process's buffer and its call
    sets (``{"T=..": {kind: (prep, call)}}``, calls already warmed) under the tables and ``EPCOMM_TUNE`` of
    the variant being made; ``time_calls(prep, call, 1, sync)`` times one call (``probe_rig.time_calls``).
    Each row: ``us_row`` of its own calls' nanoseconds (``probe_rig.us_row``: ``us``, ``p10``); a variant after
    the first also ``ratio`` and ``ratio_p10`` / ``ratio_p90``: its calls over the first variant's call of the
    same iteration. ``syncs`` (``{label: sync}``): each variant's own ``sync`` (``hostprobe --before sync,bench``:
    one code, two positions of the call)."""
    tabs = tables()
    defaults = [dict(t) for t in tabs]
    env = os.environ.get("EPCOMM_TUNE")
    made, state = {}, {}
    try:
        for label, tune in variants:
            _set(tabs, defaults)
            os.environ["EPCOMM_TUNE"] = tune
            made[label] = make()
            state[label] = [dict(t) for t in tabs]
        labels = [label for label, _ in variants]
        out: dict = {label: {} for label in labels}
        first = made[labels[0]]
        for tk, kinds in first.items():
            for kind in kinds:
                ns: dict = {label: [] for label in labels}
                for i in range(calls):
                    for label in (labels if i % 2 == 0 else labels[::-1]):
                        _set(tabs, state[label])
                        prep, call = made[label][tk][kind]
                        ns[label].extend(time_calls(prep, call, 1, syncs[label] if syncs else sync))
                for label in labels:
                    row = us_row(ns[label])
                    if label != labels[0]:
                        r = sorted(b / a for a, b in zip(ns[labels[0]], ns[label]))
                        row.update(ratio=statistics.median(r), ratio_p10=r[len(r) // 10], ratio_p90=r[len(r) * 9 // 10])
                    out[label].setdefault(tk, {})[kind] = row
        return out
    finally:
        _set(tabs, defaults)
        if env is None:
            os.environ.pop("EPCOMM_TUNE", None)
        else:
            os.environ["EPCOMM_TUNE"] = env


def summary(res: dict) -> list[str]:
    """Per variant after the first, call and token count: the median over rounds of the round's paired ratio,
    the rounds' spread and the median p10..p90 of the pairs (``res``: ``{label: [round rows]}``)."""
    labels = list(res)
    lines = [f"{'variant':14s} {'T':>4s} {'call':14s} {'ratio':>6s} {'rounds':>13s} {'pairs p10..p90':>15s}"]
    for label in labels[1:]:
        runs = res[label]
        if not runs:
            continue
        for tk, kinds in runs[0].items():
            for kind, row in kinds.items():
                if "ratio" not in row:  # (the calibration row)
                    continue
                rs = [r[tk][kind]["ratio"] for r in runs]
                lo = statistics.median(r[tk][kind]["ratio_p10"] for r in runs)
                hi = statistics.median(r[tk][kind]["ratio_p90"] for r in runs)
                lines.append(f"{label + '/' + labels[0]:14s} {tk[2:]:>4s} {kind:14s} {statistics.median(rs):6.3f} "
                             f"{min(rs):6.3f}..{max(rs):5.3f} {lo:7.3f}..{hi:6.3f}")
    return lines
