"""PNG plots of benchmark rows (needs matplotlib: ``pip install 'epcomm[plot]'``).

- ``time_vs_tokens.png``: median time against tokens per rank, one panel per operation, one line
  per (case, backend), log-log.
- ``bandwidth.png``: link GB/s (solid: the bytes other ranks wrote, as the backend lays them out) and
  logical GB/s in DeepEP's per-selection convention (dashed) against tokens, with the copy-engine
  ceiling as a horizontal line where it was measured (rows without a link figure are left out).
"""

from __future__ import annotations

import math
from pathlib import Path

from .table import op_label


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("--plot needs matplotlib: pip install 'epcomm[plot]'") from e
    return Figure, FigureCanvasAgg


def _panels(rows: list[dict]) -> dict[str, dict[str, list[tuple[int, dict]]]]:
    """``{panel title: {line label: [(tokens, row), ...] sorted}}``; the send and receive halves of
    a hooked operation share a panel."""
    panels: dict[str, dict[str, list[tuple[int, dict]]]] = {}
    for r in rows:
        hook = r.get("phase", "total") != "total"
        title = f"{r['mode'].upper()} {op_label({**r, 'phase': 'total'})}" + (" with recv hook" if hook else "")
        line = f"{r['case']} H{r['hidden']} K{r['topk']} E{r['experts']} / {r['backend']}"
        line += {"graph": " graph", "events": " eager"}.get(r.get("timing"), "")  # GPUs time both
        line += f" {r['phase']}" if hook else ""
        panels.setdefault(title, {}).setdefault(line, []).append((r["tokens"], r))
    for lines in panels.values():
        for pts in lines.values():
            pts.sort(key=lambda p: p[0])
    return panels


def _grid(n: int) -> tuple[int, int]:
    cols = min(3, max(n, 1))
    return math.ceil(n / cols), cols


def _title(rows: list[dict]) -> str:
    env = rows[0].get("env") or {}
    return (f"epcomm bench: {env.get('device', '?')}, {rows[0]['world_size']} ranks "
            f"({env.get('transport', '?')}), {env.get('date', '')[:10]}")


def plot_rows(rows: list[dict], out_dir: str | Path) -> list[Path]:
    """Write the PNGs into ``out_dir`` (created); returns their paths."""
    if not rows:
        raise ValueError("no rows to plot")
    Figure, FigureCanvasAgg = _matplotlib()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    panels = _panels(rows)
    nr, nc = _grid(len(panels))
    fig = Figure(figsize=(5.2 * nc, 3.8 * nr), layout="constrained")
    FigureCanvasAgg(fig)
    for i, (title, lines) in enumerate(panels.items()):
        ax = fig.add_subplot(nr, nc, i + 1)
        for label, pts in lines.items():
            ax.plot([p[0] for p in pts], [p[1]["median_us"] for p in pts], marker="o", label=label,
                    linestyle="--" if pts[0][1]["backend"] == "reference" else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("median time (us)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_title(rows) + ": time against tokens")
    paths.append(out / "time_vs_tokens.png")
    fig.savefig(paths[-1], dpi=110)

    bw_rows = [r for r in rows if r.get("link_gbps") is not None]
    if bw_rows:
        panels = _panels(bw_rows)
        nr, nc = _grid(len(panels))
        fig = Figure(figsize=(5.2 * nc, 3.8 * nr), layout="constrained")
        FigureCanvasAgg(fig)
        ce = next((r["ce_gbps"] for r in bw_rows if r.get("ce_gbps")), None)
        for i, (title, lines) in enumerate(panels.items()):
            ax = fig.add_subplot(nr, nc, i + 1)
            for j, (label, pts) in enumerate(lines.items()):
                xs = [p[0] for p in pts]
                color = f"C{j}"
                ax.plot(xs, [p[1]["link_gbps"] for p in pts], marker="o", color=color, label=f"{label} link")
                ax.plot(xs, [p[1]["logical_gbps"] for p in pts], marker=".", color=color, linestyle="--",
                        alpha=0.6, label=f"{label} DeepEP logical")
            if ce:
                ax.axhline(ce, color="k", linestyle=":", label=f"copy-engine ceiling {ce:.0f} GB/s")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens per rank")
            ax.set_ylabel("GB/s per rank")
            ax.set_title(title, fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        note = "" if ce else " (no copy-engine ceiling: measured on GPUs only)"
        fig.suptitle(_title(rows) + ": bandwidth" + note)
        paths.append(out / "bandwidth.png")
        fig.savefig(paths[-1], dpi=110)
    return paths
