"""The host cost of a repeat low-latency call, measured where it is spent: the exact Python that
``Buffer.low_latency_dispatch`` / ``low_latency_combine`` run for a kind of call seen before (key, lookup,
the backend's closure, the bound launch of ``kernels/launch.py``), on a CPU with Triton's C launcher
replaced by a no-op, or on a GPU with its real launches.

Why on a CPU: an eager low-latency call on a GPU host is this Python plus one C launch per kernel (about
4.5 us each on an H100 host, ``benchmarks/2026-11-25/h100-host-primitives.txt``), and a GPU host's eager
rows move 1.5-2x from run to run. The Python part can be timed and counted here, call by call, and
compared between source trees without that noise.

The rig (:func:`install`): world 1 on gloo, a ``Buffer`` whose backend is the nvlink backend
(``testing.cpu_nvlink``'s CUDA stand-ins, a local symmetric buffer), every ``@triton.jit`` kernel of
``epcomm.kernels`` replaced by a stand-in that ``Launcher`` binds as it binds a compiled kernel: later
launches go, as on a GPU host, straight to the stand-in's C-launcher slot, which does nothing. With
``EPCOMM_NATIVE=all`` the plans make their outputs through the C++ extension and their chains
(``native.Chain``) as on a GPU host, dry: packed and read each call, nothing launched.

Measured per call kind (``--api ll``, the default: ``dispatch``: FP8, DeepSeek-V3 shapes by default;
``combine``: BF16, after an untimed dispatch, as ``epcomm bench`` times it; with ``--hook`` the send and
its hook as one step; ``--api ht``: ``Buffer``'s high-throughput calls; ``--api v2``: ``ElasticBuffer``'s;
the buffers and calls are ``bench/probe_calls.py``'s), in one of three modes, each in a process of its own:

- ``python`` (any machine): the CPU rig. ``us``: ``time.perf_counter_ns`` around each call, median and p10;
  ``fn`` torch calls at the Python level (``TorchFunctionMode``: every function and method; on a repeat all
  are metadata reads), ``aten`` operators (``TorchDispatchMode``), ``allocs`` (a result whose storage no
  input had), ``launches`` and ``args`` (the arguments handed to the C launcher), in one repeat call;
- ``call`` (a GPU): the same calls with their real launches, the GPU idle at each call's start (synchronised
  before, untimed), as ``epcomm bench`` times an eager call's host time;
- ``launches`` (a GPU, ``--api ll`` only: the HT and V2 kernels wait on counters each call advances, so
  their launches cannot be replayed outside their calls): one call's C launches, recorded, then replayed alone (the same idle GPU): what the
  call costs below Python. ``call`` minus ``launches`` is the Python on that host; ``python`` on that host
  should agree;
- ``profile`` (a GPU; without one, the CPU rig): ``call``'s calls under ``cProfile``, each function's own time
  per call, C functions (``torch.empty``, Triton's C launcher) included (``bench/probe_profile.py``), then the
  ``us`` of the same calls unprofiled.

Trees: ``--tree LABEL=PATH`` (repeatable) runs each mode in a subprocess per tree and round, importing
epcomm from ``PATH/src`` (``git worktree add /tmp/wt-SHA SHA`` or ``git archive SHA src | tar -x -C DIR``
makes one), alternated ``A, B, C, A, B, C, ...`` so that drift hits every tree alike; the table gives each
tree's median of round medians, the spread (min..max), the median p10 and ``norm``: every process also times
a fixed torch workload (row ``calib``: 8 small tensors and one launch, no epcomm code), and ``norm`` is a call's
µs over that row's in the same process, times the row's median over all processes. A GPU host's processes
differ up to 2x in speed, every call of a process alike (2026-11-27: a call no tree changed moved
as much as the calls under test); ``norm`` divides that out.

Example: ``python3 -m epcomm.bench.hostprobe --tree old=/tmp/wt-59e45d1 --tree new=. --rounds 5``; on a GPU
``--modes call,launches,python``.

``norm`` does not take out everything: two processes of one tree have differed by 20-150 % in one lease with
their calibration rows alike, pinned to one core or not, with the hash seed and address-space layout fixed
(commits 1fd2e5e and 291ac6c). ``--variants LABEL=EPCOMM_TUNE;LABEL=...`` (one tree; ``python`` and ``call``)
times ``EPCOMM_TUNE`` variants in one process per round, their calls interleaved one by one, and adds each later
variant's paired ratio to the first (``bench/probe_variants.py``): the way to measure a host change of a few
launches or tensors, with the change behind a ``TUNE`` key until it is measured. Example:
``python3 -m epcomm.bench.hostprobe --api v2 --modes call --tokens 4096 --variants "off=;g8=gather_rb=8"``.

``--json``: every round's rows, each record with ``env`` (:func:`provenance`): the date, the device (the GPU's
name for ``call``/``launches``, ``cpu`` for the rig), driver, torch, triton, python, every ``EPCOMM_*`` variable,
and per tree its path and, for the tree this probe runs from, epcomm's commit as ``epcomm bench`` records it
(``EPCOMM_COMMIT`` on a copy without ``.git``); another tree's commit is what its label says.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys

ME = os.path.abspath(__file__)
log = logging.getLogger(__name__)


def _own(*path: str):
    """The module at ``path`` (under ``src/epcomm``) of this file's own tree, whichever tree the process
    imports epcomm from (the trees probed may predate it): ``testing/torch_calls.py``, ``bench/probe_calls.py``."""
    import importlib.util

    name = "_hostprobe_" + path[-1][:-3]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.dirname(ME)), *path))
        mod = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _torch_calls():
    return _own("testing", "torch_calls.py")


def _rig():
    return _own("bench", "probe_rig.py")


def install(set_attr=setattr, setitem=None) -> None:
    """The CPU rig (``probe_rig.install``; a test patches this name to undo what the rig stands in for)."""
    _rig().install(set_attr, setitem)


def __getattr__(name: str):
    """The rig and clock of ``bench/probe_rig.py`` (``install``, ``time_calls``, ``us_row``, ...) and the buffers
    and call sets of ``bench/probe_calls.py`` (``cpu_buffer``, ``ll_calls``, ...) as this module's."""
    if not name.startswith("__"):
        for mod in (_rig(), _own("bench", "probe_calls.py")):
            if hasattr(mod, name):
                return getattr(mod, name)
    raise AttributeError(name)


def count_call(prep, call) -> dict:
    """The torch work, launches and launch arguments of one call (after ``prep()``): ``fn``, ``meta`` and
    ``allocs`` as ``testing/torch_calls.TorchCalls`` counts them, ``aten`` operators, and ``names`` in order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from epcomm.kernels.launch import Launcher

    calls = _torch_calls().TorchCalls(log=True)
    aten: list = []

    class Aten(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            aten.append(f"aten.{func.__name__}")
            return func(*args, **(kwargs or {}))

    if prep is not None:
        prep()
    before = Launcher.launches
    rig = _rig()
    rig._ARGS[0] = 0
    with calls, Aten():
        call()
    return dict(fn=calls.ops, meta=calls.meta, aten=len(aten), allocs=calls.allocs,
                launches=Launcher.launches - before, args=rig._ARGS[0], names=calls.names + aten)


def _buffer(pc, api: str, rig: bool, m: int, h: int, k: int, e: int):
    """The probe's buffer for ``api`` (``bench/probe_calls.py``): on the CPU rig where ``rig``."""
    if api == "v2":
        return pc.v2_buffer(m, h, k, rig)
    if api == "ht":
        return pc.ht_buffer(m, h, k, rig)
    return pc.cpu_buffer(m, h, e) if rig else pc.gpu_buffer(m, h, e)


def _calls(pc, api: str, buf, t: int, m: int, h: int, k: int, e: int, hook: bool, sets: int = 1) -> dict:
    """``{kind: (prep, call)}`` at ``t`` tokens (warmed); with ``hook`` the send and its hook as one call. With
    ``sets`` > 1 each kind also as ``"<kind> /<sets>"``: its calls on ``sets`` input sets in turn (inputs of other
    seeds), as ``epcomm bench`` rotates its input sets from call to call (a call's tensors are then never the last
    call's)."""
    def make(seed: int) -> dict:
        made = (pc.v2_calls(buf, t, m, h, k, e, seed=seed) if api == "v2" else
                pc.ht_calls(buf, t, h, k, e, seed=seed) if api == "ht" else pc.ll_calls(buf, t, m, h, k, e, hook, seed))
        if hook:
            made = {kind: (prep, lambda base=call: base()[-1]()) for kind, (prep, call) in made.items()}
        return made

    made = make(0)
    if sets > 1:
        more = [made] + [make(i) for i in range(1, sets)]
        for kind in list(made):
            made[f"{kind} /{sets}"] = _rotating([m_[kind] for m_ in more])
    return made


def _rotating(pairs: list) -> tuple:
    """``(prep, call)`` that runs ``pairs``' calls in turn, each after its own ``prep`` (None where none has one)."""
    at = [0]

    def prep() -> None:
        p = pairs[at[0]][0]
        if p is not None:
            p()

    def call():
        i = at[0]
        at[0] = (i + 1) % len(pairs)
        return pairs[i][1]()

    return (prep if any(p for p, _ in pairs) else None), call


def bench_position():
    """What ``epcomm bench`` runs before each eager call it times (``bench/timing.measure``: its barrier, its start
    (a one-element ``all_reduce``), then a timing event recorded) on the default group; ``--before bench``."""
    import torch
    import torch.distributed as dist

    from epcomm.bench import timing

    dev = torch.device("cuda", torch.cuda.current_device())
    barrier, start = timing.make_barrier(dist.group.WORLD, dev), timing.make_start(dist.group.WORLD, dev, False)

    def before() -> None:
        barrier()
        start()
        torch.cuda.Event(enable_timing=True).record()
    return before


def probe(mode: str = "python", tokens=(1, 128), h: int = 7168, k: int = 8, e: int = 256, calls: int = 2000,
          hook: bool = False, api: str = "ll", variants: list | None = None, before: str = "sync",
          sets: int = 1) -> dict:
    """This process's epcomm, every call kind at each token count: ``{"T=..": {kind: row}}``. ``mode``:
    ``python`` (the CPU rig: the calls' Python, counted too), ``call`` (a GPU: whole calls) or ``launches``
    (a GPU: one call's C launches, recorded, then replayed alone). ``variants`` (``[(label, EPCOMM_TUNE)]``,
    ``python`` and ``call`` modes): ``{label: {"T=..": {kind: row}}}``, the variants' calls interleaved in this
    process (``bench/probe_variants.py``). ``before`` (GPU modes): what runs, untimed, before each call: ``sync``
    (``torch.cuda.synchronize``) or ``bench`` (:func:`bench_position`: what ``epcomm bench`` runs before an eager
    call; the calibration row too); ``sync,bench``: both, as two variants of one code (labels ``sync`` and
    ``bench``), each call of one paired with the other's next to it. ``sets``: see :func:`_calls`."""
    import torch

    rec = sync = None
    rig = mode == "python" or (mode == "profile" and not torch.cuda.is_available())
    if rig:
        install()
    else:
        sync = torch.cuda.synchronize
        if mode == "launches":
            rec = _rig().record_launches()
    positions = before.split(",")
    syncs = {p: sync for p in positions}
    if not rig and "bench" in positions:
        import torch.distributed as dist

        if not dist.is_initialized():  # (as bench/probe_calls.py makes it: the buffers then take this one)
            torch.cuda.set_device(0)
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        syncs["bench"] = bench_position()
    sync = syncs[positions[0]]
    if len(positions) > 1:  # one code, the calls in two positions, paired as variants are
        variants = [(p, "") for p in positions]
    calib = _calibration("cpu" if rig else "cuda", calls, sync)
    m = max(tokens)
    pc = _own("bench", "probe_calls.py")
    if variants:
        def make():
            buf = _buffer(pc, api, rig, m, h, k, e)
            return {f"T={t}": _calls(pc, api, buf, t, m, h, k, e, hook, sets) for t in tokens}

        out = _own("bench", "probe_variants.py").probe(variants, make, _rig().time_calls, _rig().us_row, calls, sync,
                                                        syncs if len(positions) > 1 else None)
        for rows in out.values():
            for kinds in rows.values():
                kinds[CALIB] = calib
        return out
    buf = _buffer(pc, api, rig, m, h, k, e)
    out = {}
    for t in tokens:
        for kind, (prep, call) in _calls(pc, api, buf, t, m, h, k, e, hook, sets).items():
            row = {}
            if mode == "python":
                row.update({k_: v for k_, v in count_call(prep, call).items() if k_ != "names"})
            elif mode == "launches":
                if prep is not None:
                    prep()
                rec["on"] = []
                call()
                recs, rec["on"] = rec["on"], None
                prep, call = None, lambda recs=recs: [f(*a) for f, a in recs]
                row["launches"] = len(recs)
            elif mode == "profile":
                row["top"] = _own("bench", "probe_profile.py").profile(prep, call, calls, sync)
            row.update(_rig().us_row(_rig().time_calls(prep, call, calls, sync)))
            out.setdefault(f"T={t}", {})[kind] = row
        out[f"T={t}"][CALIB] = calib
    return out


CALIB = "calib"  # the row of a fixed torch workload, measured in every probe process (see _calibration)


def _calibration(device: str, calls: int, sync=None) -> dict:
    """The host µs of a fixed torch workload that no epcomm code runs: 8 small tensors made and freed and one
    one-element in-place op (a launch on a GPU), timed like a call (median, p10). Host timings on a GPU
    host swing up to 2x from process to process, and a slow process is slow in every call: each call's
    ``norm`` in the summary is its µs over this row's, times the median of this row over every process,
    which takes that factor out (an A/B's trees then differ by their own work)."""
    import torch

    from epcomm.bench import timing

    work = timing.calibration_work(torch.device(device, 0) if device == "cuda" else torch.device("cpu"))
    for _ in range(50):
        work()
    return _rig().us_row(_rig().time_calls(None, work, max(calls, 100), sync))


# ----------------------------------------------------------------------------- trees and the command line


def _child(tree: str, argv: list[str]) -> dict | None:
    """One mode's rows for ``tree`` from a fresh process, or None (its error printed) if it failed."""
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(tree), "src"))
    env.pop("TRITON_INTERPRET", None)
    code = f"import runpy, sys; sys.argv = {[ME, '--child', *argv]!r}; runpy.run_path({ME!r}, run_name='__main__')"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if p.returncode:
        log.error("probe of %s (%s) failed:\n%s", tree, " ".join(argv), p.stderr[-3000:])
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def provenance(trees: list, here: str, modes: list[str]) -> dict:
    """What a probe's JSON records carry (``env``): see the module docstring. ``trees``: ``(label, path)``;
    ``here``: the tree this file belongs to (whose commit ``report.commit_record`` knows)."""
    import datetime
    import platform

    import torch

    from . import report

    gpu = any(m in ("call", "launches", "profile") for m in modes) and torch.cuda.is_available()
    sha, dirty, where = report.commit_record()
    mine = os.path.realpath(here)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "driver": report.driver_version() if gpu else None,
        "torch": torch.__version__, "triton": report.package_version("triton"), "python": platform.python_version(),
        "epcomm_env": report.epcomm_variables(),
        "trees": {label: {"path": path, **({"git_sha": sha or "unknown", "git_dirty": dirty, "commit_source": where}
                                            if os.path.realpath(path) == mine else {})}
                  for label, path in trees},
    }


def _summary(res: dict) -> list[str]:
    """Per tree, mode, token count and call: the median of the rounds' medians, their spread, the median
    p10, ``norm`` (the median over rounds of the call's µs over its process's calibration row, times that
    row's median over every process of the mode: :func:`_calibration`; ``-`` where runs have none), and
    (python) the counts of one call."""
    lines = [(f"{'tree':10s} {'mode':8s} {'T':>4s} {'call':14s} {'us':>7s} {'spread':>15s} {'p10':>7s} "
              f"{'norm':>7s} {'fn':>4s} {'aten':>4s} {'alloc':>5s} {'launch':>6s} {'args':>4s}")]
    ref = {}  # per mode: the calibration row's median over every process
    for (_, mode), runs in res.items():
        ref.setdefault(mode, []).extend(k[CALIB]["us"] for r in runs for k in r.values() if CALIB in k)
    for (label, mode), runs in res.items():
        for tk, kinds in runs[0].items():
            for kind, row in kinds.items():
                meds = [r[tk][kind]["us"] for r in runs]
                p10 = statistics.median(r[tk][kind]["p10"] for r in runs)
                cal = [r[tk].get(CALIB, {}).get("us") for r in runs]
                norm = (f"{statistics.median(m / c for m, c in zip(meds, cal)) * statistics.median(ref[mode]):7.2f}"
                        if ref[mode] and all(cal) else f"{'-':>7s}")
                lines.append(f"{label:10s} {mode:8s} {tk[2:]:>4s} {kind:14s} {statistics.median(meds):7.2f} "
                             f"{min(meds):7.2f}..{max(meds):6.2f} {p10:7.2f} {norm} {row.get('fn', -1):4d} "
                             f"{row.get('aten', -1):4d} {row.get('allocs', -1):5d} {row.get('launches', -1):6d} "
                             f"{row.get('args', -1):4d}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m epcomm.bench.hostprobe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", default=[],
                    help="LABEL=PATH of a source tree (repeatable; default: this file's tree)")
    ap.add_argument("--modes", default="python", help="python (CPU rig), call, launches (GPU), profile (GPU, else the "
                    "rig): comma-separated")
    ap.add_argument("--tokens", default="1,128")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--calls", type=int, default=2000, help="timed calls per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hook", action="store_true", help="with return_recv_hook (send + hook timed together)")
    ap.add_argument("--api", default="ll", choices=("ll", "ht", "v2"),
                    help="ll: Buffer's low-latency calls; ht: its high-throughput ones; v2: ElasticBuffer's "
                         "(bench/probe_calls.py)")
    ap.add_argument("--variants", help="LABEL=EPCOMM_TUNE;LABEL=EPCOMM_TUNE...: the variants' calls interleaved "
                    "call by call in one process per round and mode, with their paired ratios "
                    "(bench/probe_variants.py; one tree)")
    ap.add_argument("--before", default="sync", choices=("sync", "bench", "sync,bench"),
                    help="GPU modes: what runs untimed before each call: sync (torch.cuda.synchronize), or bench "
                         "(what epcomm bench runs before an eager call: a barrier, a one-element all_reduce, an "
                         "event); sync,bench: both in one process, paired as --variants are")
    ap.add_argument("--sets", type=int, default=1,
                    help="also each kind on this many input sets in turn, as epcomm bench rotates them (\"<kind> /N\")")
    ap.add_argument("--json", help="write every round's rows here")
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # a child's one mode
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.sets < 1:
        ap.error(f"--sets must be >= 1, got {a.sets}")
    if not logging.getLogger().handlers:  # (run as a program: the rounds and failures on stderr, as they come)
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    pv = _own("bench", "probe_variants.py")
    try:
        variants = pv.parse(a.variants) if a.variants is not None else None
    except ValueError as err:
        ap.error(str(err))
    kw = {"tokens": tuple(int(s) for s in a.tokens.split(",")), "h": a.hidden, "k": a.topk, "e": a.experts,
          "calls": a.calls, "hook": a.hook, "api": a.api, "variants": variants,
          "before": a.before, "sets": a.sets}
    if a.child:
        sys.stdout.write(json.dumps(probe(a.mode, **kw)) + "\n")  # (the parent reads this last line)
        return 0
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(ME))))
    trees = [s.split("=", 1) if "=" in s else (s, s) for s in a.tree] or [("here", here)]
    fwd = ["--tokens", a.tokens, "--hidden", str(a.hidden), "--topk", str(a.topk), "--experts", str(a.experts),
           "--calls", str(a.calls), "--api", a.api, "--before", a.before, "--sets", str(a.sets)] \
        + (["--hook"] if a.hook else [])
    modes = a.modes.split(",")
    if variants:
        if len(trees) != 1 or "launches" in modes:
            ap.error("--variants takes one tree and the modes python and call")
        fwd += ["--variants", a.variants]
    if "," in a.before:
        if variants or len(trees) != 1 or set(modes) - {"call"}:
            ap.error("--before sync,bench takes one tree, the mode call and no --variants")
        variants = [(p, "") for p in a.before.split(",")]
    if "launches" in modes and a.api != "ll":
        # a high-throughput or V2 call's kernels wait on counters that each call advances (the exchange, the
        # transport): replayed outside their calls they wait for arrivals that never come and write garbage
        ap.error(f"--modes launches replays one call's recorded launches on their own: only --api ll, got "
                 f"--api {a.api} (its kernels wait on counters each call advances)")
    env = provenance(trees, here, modes) if a.json else None
    labels = [label for label, _ in variants] if variants else [label for label, _ in trees]
    res: dict = {(label, mode): [] for label in labels for mode in modes}
    failed = 0
    for r in range(a.rounds):  # A, B, ... per round, every mode of a tree together
        for label, path in trees:
            for mode in modes:
                got = _child(path, fwd + ["--mode", mode])
                if got is None:
                    failed += 1
                    continue
                for lab, rows in (got.items() if variants else [(label, got)]):
                    res[(lab, mode)].append(rows)
                    log.info("round %d/%d %s %s: %s", r + 1, a.rounds, lab, mode, ", ".join(
                        f"T={tk[2:]} {kind} {row['us']:.2f}" for tk, kinds in rows.items()
                        for kind, row in kinds.items()))
                if a.json:  # after every run: what a run cut short leaves is kept
                    with open(a.json, "w") as f:
                        json.dump([{"tree": label_, "mode": mode_, "round": i, "rows": run, "env": env}
                                   for (label_, mode_), runs in res.items() for i, run in enumerate(runs)], f)
    sys.stdout.write("\n".join(_summary({k: v for k, v in res.items() if v})) + "\n")
    for mode in modes:
        if mode == "profile" and res.get((labels[0], mode)):
            for label in labels:  # the last round of each tree
                sys.stdout.write(f"profile, {label}, round {len(res[(label, mode)])}:\n" + "\n".join(
                    _own("bench", "probe_profile.py").summary(res[(label, mode)][-1])) + "\n")
    if variants:
        for mode in modes:
            sys.stdout.write(f"paired ratios, {mode}:\n" + "\n".join(
                pv.summary({lab: res[(lab, mode)] for lab in labels})) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
