"""Benchmark reports: the environment record, merging per-rank results into rows, JSONL, the table.

A row (one JSON object per line) holds::

    case mode tokens hidden topk experts world_size backend op dtype phase cached
    api layout cpu_sync theoretical_num_sms
    median_us p10_us p90_us host_us host_p10_us host_p90_us host_calib_us iters warmup timing
    logical_bytes link_bytes logical_gbps link_gbps sms link_counting
    ref_median_us peer_us speedup graph_us eager_over_graph ce_gbps link_fraction
    check timed_check timed_oracle caveat env{...}

Across ranks: every rank times itself; a row reports the **largest** per-rank median (and the
largest p10/p90, host time), the bytes of the busiest rank, and the **smallest** per-rank GB/s
(each rank's bytes over its own median); ``host_p10_us`` / ``host_p90_us``: the largest per-rank percentiles of
the host time; ``host_calib_us``: the largest per-rank median of the host calibration timed in the same iterations
(``bench/timing.py``; None where a rank had none). ``timing`` is ``events`` (eager calls), ``graph`` (CUDA-graph
replays) or ``wall`` (CPU); on GPUs a capturable op has a row of each, and its eager row carries
``graph_us`` and ``eager_over_graph``.

Bytes (bench/accounting.py): ``logical_*`` as DeepEP's tests count them (high-throughput: the rows
received, own included; low-latency: per (token, expert) selection of the rank's tokens, FP8
messages counted with 16 bytes of metadata); ``link_*`` what other ranks wrote into the rank, as the
timed backend lays it out, by the rule ``link_counting`` names (``"not modelled"``: no link figure).

``peer_us`` is the peer baseline's eager median (backend ``<transport>-a2a``, the group's own transport:
torch.distributed all-to-all dispatch and combine, bench/a2a.py) and ``speedup`` = peer_us / this
median, except against a gloo exchange of GPU tensors (ranks sharing a GPU: the bytes went through the
host; no speedup). ``ref_median_us`` is the oracle's (reference backend), kept for the record. All
from the same run; ``link_fraction`` = link GB/s / the copy-engine ceiling ``ce_gbps``.

Checks: ``check`` is the case check before timing (every backend against the reference) and fails
when the timed check fails; ``timed_check`` is the timed call itself (eager or graph replay) on the
checked input set against ``timed_oracle``: ``"reference"`` (the oracle backend's results on those
inputs) or ``"round trip"`` (the peer: combine(dispatch(x)) against x * sum(w)); ``"not checked: ..."``
where no oracle result applies, ``"not run..."`` where no check ran. ``caveat`` says when times are
not GPU performance (CPU ranks, ranks sharing a GPU).

``api`` is ``"v1"`` (the ``Buffer``) or ``"v2"`` (``ElasticBuffer``, bench/v2.py); V2 rows also carry
``layout`` (``contiguous``/``expanded``), ``cpu_sync``, ``sms`` (the ``num_sms`` passed) and
``theoretical_num_sms`` (``get_theoretical_num_sms`` for the shape); V1 rows have None there.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

from .. import _env
from . import accounting

log = logging.getLogger(__name__)

ROW_FIELDS = (
    "case", "mode", "tokens", "hidden", "topk", "experts", "world_size", "backend", "op", "dtype", "phase",
    "cached", "api", "layout", "cpu_sync", "theoretical_num_sms", "median_us", "p10_us", "p90_us", "host_us",
    "host_p10_us", "host_p90_us", "host_calib_us", "iters", "warmup", "timing", "logical_bytes",
    "link_bytes", "logical_gbps", "link_gbps", "sms", "ref_median_us", "peer_us", "speedup", "graph_us",
    "eager_over_graph", "ce_gbps", "link_fraction", "link_counting",
    "check", "timed_check", "timed_oracle", "caveat", "env",
)
ENV_FIELDS = ("date", "device", "gpu_count", "driver", "cuda", "nccl", "torch", "triton", "epcomm", "git_sha",
              "git_dirty", "commit_source", "python", "world_size", "transport", "backends", "epcomm_env", "launch")


def _timed_check(rs: list[dict]) -> str:
    """``pass`` when every rank passed; else each rank's other verdict (``FAIL: ...``, ``not checked:
    ...``, ``not run...``), named by rank."""
    vals = [r.get("timed_check", "not run") for r in rs]
    other = [f"rank {i}: {v}" for i, v in enumerate(vals) if v != "pass"]
    if not other or all(v == vals[0] for v in vals):
        return vals[0]
    return "; ".join(other)


def timed_check_failed(v: str | None) -> bool:
    """A timed check that ran and failed (not one that could not run)."""
    return v is not None and "FAIL" in v


def caveat(env: dict) -> str | None:
    """What a row's times are not: CPU ranks are not GPUs; ranks sharing a GPU through gloo time the
    host path, not GPU performance (their GPU times interleave). None on dedicated GPUs."""
    if not env.get("gpu_count"):
        return "CPU ranks on gloo: these times are not GPU performance"
    if "sharing" in str(env.get("transport", "")):
        return "ranks share GPUs through gloo: host times only; GPU times are not performance"
    return None


def _run(cmd: list[str], cwd: str | None = None, timeout: float = 10.0) -> str | None:
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def _package_dir() -> Path:
    """The directory of the imported ``epcomm/__init__.py`` (not the cwd: a bench may run anywhere)."""
    return Path(__file__).resolve().parents[1]


def _installed_commit() -> str | None:
    """The commit pip recorded when epcomm was installed from a VCS URL (PEP 610 ``direct_url.json``)."""
    try:
        dist = importlib.metadata.distribution("epcomm")
        if Path(dist.locate_file("epcomm/__init__.py")).resolve() != _package_dir() / "__init__.py":
            return None  # the imported package is not the installed one
        text = dist.read_text("direct_url.json")
        return json.loads(text)["vcs_info"]["commit_id"] if text else None
    except (importlib.metadata.PackageNotFoundError, KeyError, TypeError, ValueError):
        return None


def source_commit() -> tuple[str | None, bool | None]:
    """``(sha, dirty)`` of epcomm's own source, wherever the process runs (:func:`commit_record`)."""
    sha, dirty, _ = commit_record()
    return sha, dirty


def commit_record() -> tuple[str | None, bool | None, str | None]:
    """``(sha, dirty, where from)`` of epcomm's own source.

    1. ``"EPCOMM_COMMIT"``: the commit the run script set for the tree it shipped (a GPU machine's copy),
       ``dirty`` from ``EPCOMM_COMMIT_DIRTY`` (None when unset). It wins over a checkout around the package:
       the device machines' copies carry the ``.git`` of the session's start beside a newer working tree,
       so there the checkout's HEAD names a commit that did not run (a disagreement is logged).
    2. ``"git"``: the git checkout that holds the imported package (``dirty``: the package's files differ
       from that commit, untracked modules included). A checkout counts only if it tracks
       ``epcomm/__init__.py``: a site-packages inside some other repository is not epcomm's.
    3. ``"pip"``: the install record of a ``pip install git+...``, ``dirty`` None.
    4. ``(None, None, None)``: unknown (rows say ``"unknown"``, never a guess).
    """
    var_sha, var_dirty = _env.commit()
    pkg = str(_package_dir())
    if _run(["git", "-C", pkg, "ls-files", "--error-unmatch", "__init__.py"]) is not None:
        sha = _run(["git", "-C", pkg, "rev-parse", "HEAD"])
        if sha and var_sha:
            if not sha.startswith(var_sha):
                log.warning("EPCOMM_COMMIT=%s, but epcomm is imported from a checkout at %s: recording the "
                            "variable's commit", var_sha, sha)
        elif sha:
            status = _run(["git", "-C", pkg, "status", "--porcelain", "--", "."])
            return sha, (bool(status) if status is not None else None), "git"
    if var_sha:
        return var_sha, var_dirty, "EPCOMM_COMMIT"
    installed = _installed_commit()
    return installed, None, "pip" if installed else None


def git_info() -> tuple[str, bool | None]:
    """:func:`source_commit` with ``"unknown"`` for a missing sha (for ``epcomm env``)."""
    sha, dirty = source_commit()
    return sha or "unknown", dirty


def epcomm_version() -> str:
    """The installed distribution's version; the package's ``__version__`` when not installed."""
    from .. import __version__

    return package_version("epcomm") or __version__


def epcomm_variables() -> dict[str, str]:
    """Every ``EPCOMM_*`` variable set for this run, known to ``epcomm env`` or not, sorted."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("EPCOMM_") and v}


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def driver_version() -> str | None:
    """The NVIDIA driver version from ``nvidia-smi`` (None without the binary)."""
    if not shutil.which("nvidia-smi"):
        return None
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def environment(device_info: dict, world_size: int, transport: str, backends: list[str]) -> dict:
    """What every row carries: device, versions, epcomm's commit, date, world size, transport, backends.

    ``git_sha``/``git_dirty`` are epcomm's own (:func:`commit_record`; ``"unknown"``/None when nothing
    says), ``commit_source`` where they came from;
    ``epcomm_env`` holds every ``EPCOMM_*`` variable that was set.
    """
    import torch

    sha, dirty, where = commit_record()
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_info.get("device", "cpu"),
        "gpu_count": device_info.get("gpu_count", 0),
        "driver": driver_version() if device_info.get("gpu_count") else None,
        "cuda": device_info.get("cuda"),
        "nccl": device_info.get("nccl"),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "epcomm": epcomm_version(),
        "git_sha": sha or "unknown",
        "git_dirty": dirty,
        "commit_source": where,
        "python": platform.python_version(),
        "world_size": world_size,
        "transport": transport,
        "backends": backends,
        # the epcomm variables set for this run (EPCOMM_HT_TRANSFER, EPCOMM_TUNE, ...): what ran
        "epcomm_env": epcomm_variables(),
        "launch": launch_description(),
    }
    return env


def launch_description(environ: dict | None = None) -> str:
    """How the ranks were started: ``"torchrun: <hosts> host(s) x <n> rank(s)"`` where torchrun's
    ``WORLD_SIZE``/``LOCAL_WORLD_SIZE`` are set, else ``"local processes"`` (bench spawned them).

    Example: ``launch_description({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) ==
    "torchrun: 2 host(s) x 8 rank(s)"``."""
    e = os.environ if environ is None else environ
    world, local = e.get("WORLD_SIZE"), e.get("LOCAL_WORLD_SIZE") or e.get("WORLD_SIZE")
    if not world:
        return "local processes"
    try:
        w, l_ = int(world), int(local)
        return f"torchrun: {w // l_ if l_ else '?'} host(s) x {l_} rank(s)"
    except ValueError:
        return f"torchrun: WORLD_SIZE={world!r} LOCAL_WORLD_SIZE={local!r}"


def _v2_key(r: dict) -> tuple:
    """What tells V2 rows of one shape apart (layout, sync, the SM count of a sweep); empty for V1 rows."""
    return (r.get("layout"), r.get("cpu_sync"), r.get("sms")) if r.get("api") == "v2" else ()


def _key(r: dict) -> tuple:
    c = r["case"]
    return (c["name"], c["mode"], c["tokens"], c["hidden"], c["topk"], c["experts"], r["op"], r["dtype"],
            r["phase"], r["backend"], r["timing"]) + _v2_key(r)


def merge_ranks(per_rank: list[list[dict]], *, env: dict, iters: int, warmup: int,
                ce_gbps: float | None = None, cached: bool = False) -> list[dict]:
    """Per-rank results (one list per rank, same keys in the same order) → report rows."""
    groups: dict[tuple, list[dict]] = {}
    for results in per_rank:
        for r in results:
            groups.setdefault(_key(r), []).append(r)
    rows = []
    for rs in groups.values():
        c = rs[0]["case"]
        worst = max(rs, key=lambda r: r["median"])
        lb = [r["logical_bytes"] for r in rs]
        kb = [r["link_bytes"] for r in rs]
        has_bytes = all(v is not None for v in lb)
        has_link = all(v is not None for v in kb)  # None: no counting rule for this backend ("not modelled")
        failures = [f"rank {i}: {r['check']}" for i, r in enumerate(rs) if r["check"] not in ("pass", "skipped")]
        row = {
            "case": c["name"], "mode": c["mode"], "tokens": c["tokens"], "hidden": c["hidden"],
            "topk": c["topk"], "experts": c["experts"], "world_size": len(rs), "backend": rs[0]["backend"],
            "op": rs[0]["op"], "dtype": rs[0]["dtype"], "phase": rs[0]["phase"],
            "cached": bool(cached and c["mode"] == "ht" and rs[0]["op"] == "dispatch"),
            "api": rs[0].get("api", "v1"), "layout": rs[0].get("layout"), "cpu_sync": rs[0].get("cpu_sync"),
            "theoretical_num_sms": rs[0].get("theoretical_num_sms"),
            "median_us": worst["median"] * 1e6,
            "p10_us": max(r["p10"] for r in rs) * 1e6,
            "p90_us": max(r["p90"] for r in rs) * 1e6,
            "host_us": max(r["host"] for r in rs) * 1e6,
            "host_p10_us": _max_us(r.get("host_p10") for r in rs),
            "host_p90_us": _max_us(r.get("host_p90") for r in rs),
            "host_calib_us": _max_us(r.get("host_calib") for r in rs),
            "iters": iters, "warmup": warmup, "timing": worst["timing"],
            "logical_bytes": max(lb) if has_bytes else None,
            "link_bytes": max(kb) if has_link else None,
            "logical_gbps": min(accounting.gbps(r["logical_bytes"], r["median"]) for r in rs) if has_bytes else None,
            "link_gbps": min(accounting.gbps(r["link_bytes"], r["median"]) for r in rs) if has_link else None,
            "sms": rs[0]["sms"],
            "ref_median_us": None, "peer_us": None, "speedup": None, "graph_us": None, "eager_over_graph": None,
            "ce_gbps": ce_gbps, "link_fraction": None, "link_counting": rs[0].get("link_counting"),
            "check": "; ".join(failures) if failures else rs[0]["check"],
            # the op checked the way it was timed (graph replay or eager) on the checked set, every rank,
            # against timed_oracle ("reference": the oracle backend's results; "round trip": the peer's)
            "timed_check": _timed_check(rs), "timed_oracle": rs[0].get("timed_oracle"),
            "caveat": caveat(env),
            "env": env,
        }
        if ce_gbps and row["link_gbps"] is not None:
            row["link_fraction"] = row["link_gbps"] / ce_gbps
        rows.append(row)
    # the oracle (reference) and the peer baseline ("<transport>-a2a", eager): "<dtype>-worst" rows (the
    # fast path captured with num_worst_tokens) pair with their plain dtype row, the same exchange
    ref = {_key_of_row(r, "reference"): r for r in rows if r["backend"] == "reference" and r["timing"] != "graph"}
    peer = {_key_of_row(r, "peer"): r for r in rows if r["backend"].endswith("-a2a")}
    graphs = {_key_of_row(r, r["backend"]) + (r["dtype"],): r for r in rows if r["timing"] == "graph"}
    for row in rows:
        plain = {**row, "dtype": row["dtype"].split("-")[0]}
        base = ref.get(_key_of_row(plain, "reference"))
        if base is not None:
            row["ref_median_us"] = base["median_us"]
        p = peer.get(_key_of_row(plain, "peer"))
        if p is not None and row["median_us"]:
            row["peer_us"] = p["median_us"]
            if not staged_peer(p["backend"], env):
                row["speedup"] = p["median_us"] / row["median_us"]
        g = graphs.get(_key_of_row(row, row["backend"]) + (row["dtype"],))
        if row["timing"] != "graph" and g is not None and g["median_us"]:
            row["graph_us"] = g["median_us"]
            row["eager_over_graph"] = row["median_us"] / g["median_us"]
    return rows


def staged_peer(peer_backend: str, env: dict) -> bool:
    """The peer baseline ran on gloo with GPU tensors (ranks sharing a GPU): every byte went through the
    host, so a ratio against it says nothing about the fast path (no speedup is reported)."""
    name = peer_backend.removesuffix("-a2a")
    # a group's name is its one backend ("gloo", "nccl") or "device:backend" pairs ("cpu:gloo,cuda:gloo")
    cuda = dict(p.split(":", 1) for p in name.split(",")).get("cuda", "") if ":" in name else name
    return cuda == "gloo" and bool(env.get("gpu_count"))


def _key_of_row(r: dict, backend: str) -> tuple:
    return (r["case"], r["mode"], r["tokens"], r["hidden"], r["topk"], r["experts"], r["op"],
            r["dtype"].split("-")[0] if backend in ("reference", "peer") else r["dtype"], r["phase"],
            backend) + _v2_key(r)


def write_jsonl(path: str | os.PathLike, rows: list[dict]) -> Path:
    """Write one JSON object per row (the file is replaced)."""
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=False) + "\n")
    return p


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------- the table


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


def _max_us(values) -> float | None:
    """The largest of per-rank seconds, in µs; None where any is None."""
    vs = list(values)
    return None if not vs or any(v is None for v in vs) else max(vs) * 1e6


def _us(v) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


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


def render_table(rows: list[dict]) -> str:
    """A fixed-width text table, one line per row, in run order."""
    show_ce = any(r.get("link_fraction") is not None for r in rows)
    show_v2 = any(r.get("api") == "v2" for r in rows)
    v2_head = ["api", "layout", "sync", "theory-SMs"] if show_v2 else []
    head = ["case", "T", "H", "K", "E", "op"] + v2_head + ["backend", "median us", "p10", "p90", "host us",
            "DeepEP GB/s", "link GB/s"] + (["%CE"] if show_ce else []) + ["SMs", "timing", "eager/graph",
                                                                          "peer us", "speedup", "timed", "check"]
    body = []
    for r in rows:
        line = [r["case"], str(r["tokens"]), str(r["hidden"]), str(r["topk"]), str(r["experts"]), op_label(r)]
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
        eg = r.get("eager_over_graph")
        line += [str(r["sms"]), r["timing"], "-" if eg is None else f"{eg:.2f}", _us(r.get("peer_us")),
                 "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x", timed_mark(r), _check(r["check"])]
        body.append(line)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    left = {0, 5, 6 + len(v2_head), len(head) - 2, len(head) - 1} | set(range(6, 6 + len(v2_head)))

    def fmt(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    lines = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body]
    return "\n".join(line.rstrip() for line in lines)


def render_header(env: dict, ce_gbps: float | None, rows: list[dict] | None = None) -> str:
    """Lines naming the device, versions and date above the table, what the columns count, and what
    the times are not (CPU ranks, shared GPUs); ``rows`` name a gloo-staged peer, if any."""
    staged = sorted({r["backend"] for r in rows or [] if r["backend"].endswith("-a2a")
                     and staged_peer(r["backend"], env)})
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
        lines.append(f"copy-engine peer ceiling: {ce_gbps:.1f} GB/s per direction (256 MiB, both directions at once)")
    lines.append("times: max over ranks of each rank's median; GB/s: min over ranks; DeepEP = logical bytes as "
                 "DeepEP's tests count them (HT: rows received, own included; LL: per (token, expert) selection "
                 "of the rank's tokens, FP8 messages + 16 B); link = bytes other "
                 "ranks wrote into the rank, as the backend lays them out")
    lines.append("timed: the timed call's output checked against ref (the reference's result on those inputs) "
                 "or trip (the peer's round trip); NONE: not checked (see timed_check)")
    if any(r.get("api") == "v2" for r in rows or []):
        lines.append("v2: ElasticBuffer rows; sync cpu = do_cpu_sync=True, none = worst-case sizing (no host wait); "
                     "SMs = the num_sms passed, theory-SMs = get_theoretical_num_sms; ref = the reference-backend "
                     "ElasticBuffer's result on those inputs, bitwise (dispatch: valid rows; combine: all)")
    if any(staged):
        lines.append(f"peer {', '.join(staged)}: GPU tensors exchanged through gloo (the host): no speedup is shown")
    note = caveat(env)
    if note is not None:
        lines.append(f"NOTE: {note}")
    return "\n".join(lines)
