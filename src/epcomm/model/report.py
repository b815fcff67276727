"""The cost model's output: the assumptions in words, fixed-width tables, JSONL/CSV rows and a plot."""

from __future__ import annotations

import csv
import json
import textwrap
from pathlib import Path

from .core import Links, Workload


def assumptions(links: Links, ht: Workload | None, ll: Workload | None, routing: str) -> list[str]:
    """Every assumption behind a table, in words (printed above it and stored with the rows)."""
    out = [
        (f"links per GPU: NVLink {links.nvlink_gbps:g} GB/s x efficiency {links.nvlink_efficiency:g}, network "
         f"{links.nic_gbps:g} GB/s x efficiency {links.nic_efficiency:g} (both calibrated, docs/model.md), "
         f"{links.gpus_per_node} GPUs per node"),
        (f"latencies: NVLink {links.nvlink_latency_us:g} us, network {links.nic_latency_us:g} us one way; "
         f"{links.launch_us:g} us per kernel launch; local copies at {links.hbm_gbps:g} GB/s"),
        (f"queue pairs: {links.qps_per_peer} per peer on {links.nic_ports} NIC port(s), round-robin: the network "
         f"runs at 1/{links.port_factor():g} of its rate"),
        (f"routing: {routing}; every rank sends and receives the average (no hot rank, no congestion, "
         "no NIC message-rate limit)")]
    if ht is not None:
        out.append(f"HT: {ht.tokens} tokens/rank, hidden {ht.hidden}, top-{ht.topk} of {ht.experts} experts, dispatch "
                   f"{ht.dtype}, combine bf16; hierarchical (one network copy per token and node, to the same local "
                   f"index, then NVLink); legs pipelined (max of the two) + {ht.ht_kernels} launches + latencies"
                   + ("; cached handle (no count exchange)" if ht.cached else "; with the count exchange"))
    if ll is not None:
        out.append(f"LL: {ll.tokens} tokens/rank, one message per (token, {ll.messages}) of row + 16 B header, "
                   f"dispatch {ll.dtype}; same-node peers over " + ("NVLink" if ll.nvlink_ll else "the network")
                   + f"; {ll.ll_kernels} launch(es), one-way latency, the local copy or reduction after the legs")
    return out


def _text_table(head: tuple, body: list[tuple]) -> str:
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = [head, tuple("-" * w for w in widths), *body]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def render_table(rows: list[dict]) -> str:
    """A fixed-width text table of ``sweep`` rows."""
    return _text_table(
        ("mode", "op", "dtype", "EP", "nodes", "time us", "network us", "NVLink us", "local us", "fixed us",
         "bound by", "DeepEP GB/s"),
        [(r["mode"], r["op"], r["dtype"], str(r["ranks"]), str(r["nodes"]),
          *(f"{r[k]:.1f}" for k in ("time_us", "nic_us", "nvlink_us", "local_us", "fixed_us")), r["bottleneck"],
          f"{r['deepep_gbps']:.1f}") for r in rows])


def render_check(rows: list[dict]) -> str:
    """A fixed-width text table of ``check_rows``."""
    return _text_table(
        ("who", "machine", "mode", "op", "dtype", "EP", "tokens", "published", "published us", "predicted us",
         "error", "bound by", "role"),
        [(r["who"], r["machine"], r["mode"], r["op"], r["dtype"], str(r["ep"]), str(r["tokens"]),
          f"{r['published']:g} {r['unit']}", f"{r['published_us']:.1f}", f"{r['predicted_us']:.1f}",
          f"{100 * r['error']:+.1f}%", r["bottleneck"], r["role"]) for r in rows])


def write_rows(path: str | Path, rows: list[dict]) -> Path:
    """``.jsonl``: one JSON object per row; ``.csv``: the flat columns (nested values as JSON)."""
    p = Path(path)
    if p.suffix not in (".jsonl", ".csv"):
        raise ValueError(f"--out must end in .jsonl or .csv, got {str(path)!r}")
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", newline="") as f:
        if p.suffix == ".jsonl":
            f.writelines(json.dumps(r) + "\n" for r in rows)
        else:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            w.writeheader()
            w.writerows({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in r.items()} for r in rows)
    return p


def plot(rows: list[dict], path: str | Path, notes: list[str], check: list[dict] | None = None) -> Path:
    """A PNG of predicted time against EP size (log-log), one panel per mode, with the published points of
    ``check`` rows on the same machine where given, and the assumptions written under it (needs matplotlib)."""
    from ..bench.plot import _matplotlib

    Figure, FigureCanvasAgg = _matplotlib()
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig = Figure(figsize=(6.0 * len(modes), 5.4 + 0.3 * len(notes)), layout="constrained")
    FigureCanvasAgg(fig)
    for i, mode in enumerate(modes):
        ax = fig.add_subplot(1, len(modes), i + 1)
        for j, op in enumerate(("dispatch", "combine")):
            pts = sorted((r["ranks"], r["time_us"], r["dtype"]) for r in rows if r["mode"] == mode and r["op"] == op)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{j}",
                        label=f"{op} {pts[0][2]} (model)")
            pub = sorted((c["ep"], c["published_us"]) for c in check or ()
                         if c["mode"] == mode and c["op"] == op and c["machine"] == "h800-cx7")
            if pub:
                ax.plot([p[0] for p in pub], [p[1] for p in pub], marker="x", linestyle="none", color=f"C{j}",
                        markersize=9, label=f"{op}: DeepEP V1 published")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("EP size (ranks)")
        ax.set_ylabel("time per call (us)")
        ax.set_title(f"{mode.upper()}: predicted time against EP size", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    wrapped = [line for n in notes for line in textwrap.wrap(n, 40 * len(modes) + 60)]
    fig.suptitle("epcomm model\n" + "\n".join(wrapped), fontsize=7, ha="left", x=0.01)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    return p
