"""What ``epcomm bench`` prints: a header (device, versions, then a legend of a few lines), one table line per
row in run order, and a closing summary.

The summary takes each *path* (one kind of call: mode, op and dtype, backend, timing; for V2 rows also layout,
sync and ``num_sms``) over the cases it ran, and gives epcomm against its peer: ``speedup`` = the peer
baseline's median / epcomm's (``> 1``: epcomm is faster), as the geometric mean over the path's rows, with the
lowest and the highest. The peer is the same exchange made with torch.distributed's all-to-all on the group's
own transport (``gloo-a2a``, ``nccl-a2a``: bench/a2a.py). Where a fast backend ran, the reference backend's
rows are the oracle's and stay out of the summary. A last line counts the rows' checks.
"""

from __future__ import annotations

import math

from .report import caveat, staged_peer, timed_check_failed


def op_label(row: dict) -> str:
    """``dispatch-fp8``, ``combine-bf16``, ``dispatch-fp8:send`` (+ ``(cached)``)."""
    s = f"{row['op']}-{row['dtype']}"
    if row.get("phase", "total") != "total":
        s += f":{row['phase']}"
    if row.get("cached"):
        s += "(cached)"
    return s


def _gbps(v) -> str:
    """3 significant digits at most, never a misleading ``0.00``."""
    if v is None:
        return "-"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    if v >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def _us(v) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def timed_mark(row: dict) -> str:
    """The table's ``timed`` column: ``ref`` (the timed call matched the reference's result), ``trip``
    (the peer's round trip held), ``FAIL``, or ``NONE`` (no check of the timed call: see timed_check)."""
    v = row.get("timed_check") or "not run"
    if timed_check_failed(v):
        return "FAIL"
    if v != "pass":
        return "NONE"
    return {"reference": "ref", "round trip": "trip"}.get(row.get("timed_oracle"), "?")


def _check(v: str) -> str:
    return v if len(v) <= 60 else v[:57] + "..."


# columns whose cells are words, not numbers (left-aligned)
_WORDS = {"path", "case", "mode", "op", "api", "layout", "sync", "theory-SMs", "backend", "timing", "timed", "check"}


def _fmt(head: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]

    def line(cells):
        return "  ".join(c.ljust(w) if h in _WORDS else c.rjust(w)
                         for h, c, w in zip(head, cells, widths)).rstrip()

    return [line(head), line(["-" * w for w in widths])] + [line(b) for b in body]


def render_table(rows: list[dict]) -> str:
    """A fixed-width text table, one line per row, in run order; a column that no row fills (%CE without a
    copy-engine ceiling, eager/graph without graph rows, the V2 columns without V2 rows) is left out."""
    show_ce = any(r.get("link_fraction") is not None for r in rows)
    show_v2 = any(r.get("api") == "v2" for r in rows)
    show_graph = any(r.get("eager_over_graph") is not None for r in rows)
    head = (["case", "mode", "T", "H", "K", "E", "op"] + (["api", "layout", "sync", "theory-SMs"] if show_v2 else [])
            + ["backend", "median us", "p10", "p90", "host us", "DeepEP GB/s", "link GB/s"] + (["%CE"] if show_ce else [])
            + ["SMs", "timing"] + (["eager/graph"] if show_graph else []) + ["peer us", "speedup", "timed", "check"])
    body = []
    for r in rows:
        line = [r["case"], r["mode"], str(r["tokens"]), str(r["hidden"]), str(r["topk"]), str(r["experts"]),
                op_label(r)]
        if show_v2:
            v2 = r.get("api") == "v2"
            sync, theory = r.get("cpu_sync"), r.get("theoretical_num_sms")  # (None: an experimental call's row)
            line += [r.get("api") or "v1", r.get("layout") or "-",
                     ("cpu" if sync else "none") if v2 and sync is not None else "-",
                     str(theory) if v2 and theory is not None else "-"]
        line += [r["backend"], _us(r["median_us"]), _us(r["p10_us"]), _us(r["p90_us"]), _us(r.get("host_us")),
                 _gbps(r["logical_gbps"]), _gbps(r["link_gbps"])]
        if show_ce:
            lf = r.get("link_fraction")
            line.append("-" if lf is None else f"{100 * lf:.0f}%")
        line += [str(r["sms"]), r["timing"]]
        if show_graph:
            eg = r.get("eager_over_graph")
            line.append("-" if eg is None else f"{eg:.2f}")
        line += [_us(r.get("peer_us")), _x(r.get("speedup")), timed_mark(r), _check(r["check"])]
        body.append(line)
    return "\n".join(_fmt(head, body))


def _peers(rows: list[dict]) -> list[str]:
    return sorted({r["backend"] for r in rows if r["backend"].endswith("-a2a")})


def render_header(env: dict, ce_gbps: float | None, rows: list[dict] | None = None) -> str:
    """Lines naming the device, versions and date above the table, a legend of its columns, and what the
    times are not (CPU ranks, shared GPUs); ``rows`` name the peer and a gloo-staged one, if any."""
    rows = rows or []
    staged = [p for p in _peers(rows) if staged_peer(p, env)]
    peer = ", ".join(_peers(rows)) or "the peer"
    dev = env["device"] + (f" x{env['gpu_count']}" if env.get("gpu_count") else "")
    lines = [
        (f"epcomm bench | {dev} | {env['world_size']} ranks on {env['transport']}"
         + (f" ({env['launch']})" if str(env.get("launch", "")).startswith("torchrun") else "")
         + f" | backends: {', '.join(env['backends'])}"),
        f"torch {env['torch']} | triton {env['triton'] or 'absent'} | epcomm {env['epcomm']} "
        f"(git {(env.get('git_sha') or 'unknown')[:12]}{'+dirty' if env.get('git_dirty') else ''}"
        f"{' from EPCOMM_COMMIT' if env.get('commit_source') == 'EPCOMM_COMMIT' else ''}) | "
        + (f"driver {env['driver']} | cuda {env['cuda']} | nccl {env['nccl']} | " if env.get("gpu_count") else "")
        + env["date"],
    ]
    if env.get("epcomm_env"):
        lines.append("set: " + " ".join(f"{k}={v}" for k, v in env["epcomm_env"].items()))
    if ce_gbps is not None:
        lines.append(f"copy-engine peer ceiling: {ce_gbps:.1f} GB/s per direction (256 MiB, both directions at "
                     "once); %CE = link GB/s / that")
    lines += [
        "mode: ht = high-throughput, ll = low-latency; T H K E: tokens a rank, hidden, top-k, experts",
        "us: the slowest rank's median (p10, p90 likewise); host us: until the call returned to Python",
        "GB/s: the lowest rank's; DeepEP: bytes as DeepEP's tests count them; link: bytes other ranks wrote in",
        f"peer us: {peer} (torch.distributed all-to-all) on the same case; speedup: peer us / median us",
        "timed: the timed call's output matched ref (the reference's) or trip (the peer's round trip), or NONE",
    ]
    if any(r.get("api") == "v2" for r in rows):
        lines += ["v2: ElasticBuffer rows; sync cpu = do_cpu_sync=True, none = worst-case sizing (no host wait);",
                  "  SMs: the num_sms passed, theory-SMs: get_theoretical_num_sms; ref: the reference ElasticBuffer's",
                  "  result, bitwise (dispatch: valid rows; combine: all)"]
    if staged:
        lines.append(f"peer {', '.join(staged)}: GPU tensors exchanged through gloo (the host): no speedup is shown")
    note = caveat(env)
    if note is not None:
        lines.append(f"NOTE: {note}")
    return "\n".join(lines)


def _path(r: dict, with_api: bool) -> str:
    words = ([r.get("api") or "v1"] if with_api else []) + [r["mode"], op_label(r)]
    if r.get("api") == "v2":
        words += [r.get("layout") or "-", "sync=" + ("cpu" if r.get("cpu_sync") else "none"), f"SMs={r['sms']}"]
    return " ".join(words)


def render_summary(rows: list[dict]) -> str:
    """The closing lines: per path, epcomm's speedup over its peer (geometric mean, lowest, highest over the
    path's rows), then how the rows' checks went (module doc)."""
    peers = _peers(rows)
    ours = [r for r in rows if not r["backend"].endswith("-a2a") and r.get("phase", "total") == "total"]
    ours = [r for r in ours if r["backend"] != "reference"] or ours  # a fast backend ran: the reference is the oracle
    with_api = any(r.get("api") == "v2" for r in rows) and any(r.get("api") != "v2" for r in rows)
    paths: dict[tuple, list[dict]] = {}
    for r in ours:
        paths.setdefault((_path(r, with_api), r["backend"], r["timing"]), []).append(r)
    body, unpaired = [], []
    for (path, backend, timing), rs in paths.items():
        ratios = [r["speedup"] for r in rs if r.get("speedup")]
        if not ratios:
            unpaired.append(rs[0])
            continue
        mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        body.append([path, backend, timing, str(len(rs)), _x(mean), _x(min(ratios)), _x(max(ratios))])
    lines = []
    if body:
        lines += [f"summary: epcomm against its peer {', '.join(peers)} (torch.distributed all-to-all), per path;",
                  "  speedup = peer us / epcomm's median us (> 1: epcomm faster): geometric mean, lowest, highest"]
        lines += _fmt(["path", "backend", "timing", "rows", "speedup", "lowest", "highest"], body)
    if unpaired:
        why = (["V2 rows have no peer at their layouts"] if any(r.get("api") == "v2" for r in unpaired) else []) + (
            ["the peer went through the host"] if any(r.get("peer_us") is not None for r in unpaired) else [])
        lines.append(f"{'summary: ' if not body else ''}{len(unpaired)} path(s) without a speedup: "
                     + ("; ".join(why) or "no peer row at their shapes"))
    failed = [r for r in rows if r["check"] not in ("pass", "skipped")]
    marks = [timed_mark(r) for r in rows]
    timed = ", ".join(f"{marks.count(m)} {m}" for m in ("ref", "trip", "NONE", "FAIL", "?") if m in marks)
    lines.append((f"checks: {len(failed)} of {len(rows)} rows FAILED (see the check column)" if failed
                  else f"checks: all {len(rows)} rows pass") + f"; timed calls: {timed}")
    return "\n".join(lines)
