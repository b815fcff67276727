"""A/B runs: two source trees measured in one session, alternated run by run, several rounds.

``epcomm bench --ab A,B --rounds 3 ...`` runs, for each round, an ordinary ``epcomm bench`` subprocess
on tree A, then one on tree B (``A, B, A, B, ...``), each importing epcomm from its tree
(``PYTHONPATH=<tree>/src``) with the same bench arguments. Every run writes ordinary JSONL rows; the
parent tags each row with the tree's label, path and commit and the round (``ab_*`` fields) and writes
them all to one file. A run that fails (non-zero exit without rows, a timeout, a tree that does not
import) is reported as failed in its own record, never dropped.

Summary, per case (``case .. phase``, backend, timing) and tree: the median of the rounds' medians,
the median of their p10s, the spread (min..max of the round medians), the same for host time, how
many rounds had the row, and the ratio to tree A's median of medians.

A tree is ``PATH`` or ``LABEL=PATH`` (default labels ``A`` and ``B``); ``PATH/src/epcomm`` must exist.
Its commit comes from ``--ab-commits SHA[+dirty],SHA[+dirty]`` (for copies without ``.git``, as on a
GPU machine: passed to its runs as ``EPCOMM_COMMIT``/``EPCOMM_COMMIT_DIRTY``), else from the tree's
own git checkout; an ``EPCOMM_COMMIT`` of the calling process is never passed on (it describes
neither tree). Rows record ``"unknown"`` when nothing says.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from . import report
from .table import op_label

log = logging.getLogger(__name__)

# bench options forwarded to every run as given; the A/B options and the outputs are the parent's
FORWARD = {"cases": "--cases", "mode": "--mode", "tokens": "--tokens", "hidden": "--hidden", "topk": "--topk",
           "experts": "--experts", "backend": "--backend", "num_sms": "--num-sms", "iters": "--iters",
           "warmup": "--warmup", "sets": "--sets", "world_size": "--world-size", "device": "--device",
           "seed": "--seed", "timeout": "--timeout"}
FLAGS = {"cached": "--cached", "no_graph": "--no-graph", "no_check": "--no-check"}
NOT_FORWARDED = {"ab", "ab_commits", "rounds", "out", "plot", "profile", "no_progress", "list",
                 "api"}  # --api is passed only where it is not v1 (child_argv): trees before it lack the option
# a row's identity: V1's fields, then V2's (api, layout, CPU sync, SM count; None on V1 rows)
KEY = ("case", "mode", "tokens", "hidden", "topk", "experts", "backend", "op", "dtype", "phase", "timing", "cached",
       "api", "layout", "cpu_sync", "sms")


@dataclasses.dataclass(frozen=True)
class Tree:
    label: str
    path: Path
    commit: str | None = None    # from --ab-commits (None: the run finds its own, or "unknown")
    dirty: bool | None = None


def parse_trees(spec: str, commits: str | None = None) -> tuple[Tree, Tree]:
    """``"A_PATH,B_PATH"`` or ``"base=PATH,new=PATH"`` (+ ``"SHA[+dirty],SHA[+dirty]"``) → two trees.
    Raises ValueError naming the value for a malformed spec, a missing tree or equal labels."""
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"--ab takes two trees, PATH or LABEL=PATH, separated by a comma; got {spec!r}")
    shas = [c.strip() for c in commits.split(",")] if commits is not None else ["", ""]
    if len(shas) != 2:
        raise ValueError(f"--ab-commits takes two commits (SHA or SHA+dirty; empty: unknown), got {commits!r}")
    trees = []
    for default, part, sha in zip("AB", parts, shas):
        label, eq, path = part.partition("=")
        label, path = (label.strip(), path.strip()) if eq else (default, part)
        root = Path(path).expanduser().resolve()
        if not label or not (root / "src" / "epcomm" / "__init__.py").is_file():
            raise ValueError(f"--ab tree {part!r}: expected LABEL=PATH or PATH with PATH/src/epcomm/__init__.py")
        dirty = sha.endswith("+dirty")
        sha = sha.removesuffix("+dirty").lower()
        if sha and (not 7 <= len(sha) <= 40 or any(c not in "0123456789abcdef" for c in sha)):
            raise ValueError(f"--ab-commits: {sha!r} is not a git commit sha (7-40 hex digits)")
        trees.append(Tree(label, root, sha or None, dirty if sha else None))
    if trees[0].label == trees[1].label:
        raise ValueError(f"--ab: the two trees need different labels, got {trees[0].label!r} twice")
    return trees[0], trees[1]


def child_argv(args) -> list[str]:
    """The ``epcomm bench`` arguments every run gets: the forwarded options as parsed (see FORWARD)."""
    argv = []
    for dest, opt in FORWARD.items():
        v = getattr(args, dest, None)
        if v is None:
            continue
        argv += [opt, ",".join(str(x) for x in v) if isinstance(v, list) else str(v)]
    argv += [opt for dest, opt in FLAGS.items() if getattr(args, dest, False)]
    if getattr(args, "api", "v1") not in (None, "v1"):
        argv += ["--api", args.api]
    if getattr(args, "log_level", None):
        argv = ["--log-level", args.log_level] + argv
    return argv


def _env(tree: Tree) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("EPCOMM_COMMIT", "EPCOMM_COMMIT_DIRTY")}
    env["PYTHONPATH"] = os.pathsep.join([str(tree.path / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                   else []))
    env["PYTHONUNBUFFERED"] = "1"
    if tree.commit:
        env["EPCOMM_COMMIT"] = tree.commit
        env["EPCOMM_COMMIT_DIRTY"] = "1" if tree.dirty else "0"
    return env


def imported_from(tree: Tree, timeout_s: float = 120.0) -> str:
    """Where a process with the tree's environment imports epcomm from (it must be the tree)."""
    code = "import epcomm, os; print(os.path.realpath(epcomm.__file__))"
    p = subprocess.run([sys.executable, "-c", code], env=_env(tree), capture_output=True, text=True,
                       timeout=timeout_s, check=False)
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"--ab tree {tree.label}={tree.path}: importing epcomm failed: {tail}")
    return p.stdout.strip().splitlines()[-1]


def run_one(tree: Tree, rnd: int, run: int, argv: list[str], work: Path, timeout_s: float) -> tuple[dict, list]:
    """One ``epcomm bench`` run of ``tree``: ``(run record, its rows tagged)``."""
    out, logf = work / f"run{run:02d}-{tree.label}.jsonl", work / f"run{run:02d}-{tree.label}.log"
    cmd = [sys.executable, "-m", "epcomm", "bench", *argv, "--no-progress", "--out", str(out)]
    rec = {"ab_tree": tree.label, "ab_path": str(tree.path), "ab_round": rnd, "ab_run": run, "log": str(logf),
           "command": " ".join(cmd[1:])}
    try:
        with logf.open("w") as f:
            p = subprocess.run(cmd, env=_env(tree), stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                               check=False, cwd=work)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        rc = None
    rows = report.read_jsonl(out) if out.exists() else []
    lines = logf.read_text(errors="replace").strip().splitlines() if logf.exists() else []
    if rc is None:
        status = f"failed: timed out after {timeout_s:.0f} s"
    elif not rows:
        status = f"failed (exit {rc}): {lines[-1] if lines else 'no output'}"[:300]
    elif rc != 0:
        status = f"rows, exit {rc}: some rows failed their check"
    else:
        status = "ok"
    rec.update(status=status, rows=len(rows), ab_commit=tree.commit or "unknown")
    for r in rows:
        sha = r.get("env", {}).get("git_sha")
        known = sha not in (None, "unknown")
        # the run's own record first; an older tree that does not read EPCOMM_COMMIT leaves it unknown,
        # and then the commit the caller gave for the tree stands in
        r.update(ab_tree=tree.label, ab_path=str(tree.path), ab_commit=sha if known else tree.commit or "unknown",
                 ab_dirty=r["env"].get("git_dirty") if known else tree.dirty, ab_round=rnd, ab_run=run)
    if rows:
        rec["ab_commit"] = rows[0]["ab_commit"]
    return rec, rows


def run_ab(trees: tuple[Tree, Tree], argv: list[str], *, rounds: int, work: Path, timeout_s: float,
           say=print) -> tuple[list[dict], list[dict]]:
    """All runs, ``A, B`` per round: ``(run records, tagged rows)``. ``say`` gets one line per run."""
    if rounds < 3:
        raise ValueError(f"--rounds must be >= 3 (the spread needs several rounds), got {rounds}")
    for t in trees:
        where = imported_from(t)
        if not Path(where).is_relative_to(t.path / "src"):
            raise ValueError(f"--ab tree {t.label}={t.path}: its runs would import epcomm from {where}")
    runs, rows = [], []
    for rnd in range(1, rounds + 1):
        for t in trees:
            rec, got = run_one(t, rnd, len(runs), argv, work, timeout_s)
            runs.append(rec)
            rows += got
            say(f"round {rnd}/{rounds} tree {t.label}: {rec['status']} ({rec['rows']} rows, {rec['log']})")
    return runs, rows


def _med(v: list[float]) -> float | None:
    return statistics.median(v) if v else None


def summarize(rows: list[dict], runs: list[dict], labels: list[str]) -> list[dict]:
    """Per case key and tree (in ``labels`` order): the round statistics (module docstring)."""
    rounds = sorted({r["ab_round"] for r in runs})
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in KEY), {}).setdefault(r["ab_tree"], []).append(r)
    out = []
    for key, per_tree in groups.items():
        base = None
        for label in labels:
            rs = per_tree.get(label, [])
            med = [r["median_us"] for r in rs]
            host = [r["host_us"] for r in rs if r.get("host_us") is not None]
            s = dict(zip(KEY, key))
            s.update(tree=label, commits=sorted({f"{r['ab_commit']}{'+dirty' if r.get('ab_dirty') else ''}"
                                                 for r in rs}), rounds=len(rs), of=len(rounds),
                     missing_rounds=sorted(set(rounds) - {r["ab_round"] for r in rs}),
                     median_us=_med(med), p10_us=_med([r["p10_us"] for r in rs]),
                     min_us=min(med) if med else None, max_us=max(med) if med else None,
                     host_us=_med(host), host_min_us=min(host) if host else None,
                     host_max_us=max(host) if host else None,
                     checks=sorted({r.get("check", "?") for r in rs}),
                     timed_checks=sorted({r.get("timed_check", "not run") for r in rs}))
            if label == labels[0]:
                base = s["median_us"]
            s["vs_first"] = s["median_us"] / base if base and s["median_us"] is not None else None
            out.append(s)
    return out


def _label(s: dict) -> str:
    """The op's label (``op_label``), a V2 row's layout and sync added: ``dispatch-bf16 expanded no-sync``."""
    if s.get("api") != "v2" or not s.get("layout"):
        return op_label(s)
    return f"{op_label(s)} {s['layout']}" + ("" if s.get("cpu_sync", True) else " no-sync") + (
        f" sms={s['sms']}" if s.get("sms") else "")


def _us(v) -> str:
    return "-" if v is None else (f"{v:.1f}" if v < 1000 else f"{v:.0f}")


def render_summary(summary: list[dict], runs: list[dict], trees: tuple[Tree, Tree]) -> str:
    """The runs (failed ones named) and one line per case and tree."""
    lines = [f"A/B: {len(runs)} runs, trees alternated run by run: "
             + ", ".join(f"{t.label}={t.path}" for t in trees)]
    for rec in runs:
        if rec["status"] != "ok":
            lines.append(f"  run {rec['ab_run']} (round {rec['ab_round']}, tree {rec['ab_tree']}): {rec['status']}"
                         f" -- log {rec['log']}")
    head = ["case", "T", "op", "backend", "timing", "tree", "commit", "rounds", "median of medians us", "p10",
            "spread (round medians)", "host us", "host spread", "vs " + trees[0].label, "checks"]
    body = []
    for s in summary:
        bad = [c for c in s["checks"] if c != "pass"] + [c for c in s["timed_checks"] if c != "pass"]
        body.append([s["case"], str(s["tokens"]), _label(s), s["backend"], s["timing"], s["tree"],
                     ",".join(c.split("+")[0][:10] + ("+dirty" if c.endswith("+dirty") else "")
                              for c in s["commits"]) or "-",
                     f"{s['rounds']}/{s['of']}",
                     _us(s["median_us"]), _us(s["p10_us"]), f"{_us(s['min_us'])}..{_us(s['max_us'])}",
                     _us(s["host_us"]), f"{_us(s['host_min_us'])}..{_us(s['host_max_us'])}",
                     "-" if s["vs_first"] is None else f"{s['vs_first']:.3f}",
                     "pass" if not bad else "; ".join(bad)[:60]])
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
              for row in [head, ["-" * w for w in widths]] + body]
    return "\n".join(lines)


def main(args, say=print) -> int:
    """``epcomm bench --ab``: run, write the tagged rows (``--out``, else a new directory) and the run
    records beside them, print the summary. Exit 0 only if every run produced rows that passed."""
    trees = parse_trees(args.ab, args.ab_commits)
    if args.rounds < 3:
        raise ValueError(f"--rounds must be >= 3 (the spread needs several rounds), got {args.rounds}")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="epcomm-ab-")) / f"ab-{stamp}.jsonl"
    work = out.with_name(out.stem + "-runs")
    work.mkdir(parents=True, exist_ok=True)
    runs, rows = run_ab(trees, child_argv(args), rounds=args.rounds, work=work.resolve(),
                        timeout_s=args.timeout + 120.0, say=say)
    report.write_jsonl(out, rows)
    with (work / "runs.jsonl").open("w") as f:
        for rec in runs:
            f.write(json.dumps(rec) + "\n")
    summary = summarize(rows, runs, [t.label for t in trees])
    with out.with_name(out.stem + "-summary.jsonl").open("w") as f:
        for s in summary:
            f.write(json.dumps(s) + "\n")
    say(f"wrote {len(rows)} rows to {out}, the runs to {work / 'runs.jsonl'}, the summary beside them")
    say(render_summary(summary, runs, trees))
    return 0 if all(rec["status"] == "ok" for rec in runs) else 1
