"""A soak: thousands of mixed calls of the fast library, every one checked, while each rank's memory and plan
caches are watched (``soak_watch``). ``scripts/soak.py`` is its command line.

Each iteration draws, from one seeded generator (the same on every rank, so all ranks make the same calls), a
kind and its arguments, and runs one of the existing checks on fresh inputs. What each compares with what:

- ``ht``: a V1 high-throughput layout, dispatch (BF16 or FP8, with or without biases in the combine), combine and
  cached dispatch: ``gpu_cases.check_ht_case``, the fast Buffer against the reference Buffer on the same inputs:
  the received rows, scales, ids, weights and the handle's tensors bit for bit; the combine within its budget of the
  reference's combine of the same expert outputs (the budget's sum of |terms| from the reference's combine of their
  magnitudes), the combined weights likewise; the cached dispatch's rows bit for bit;
- ``ht-worst``: the same with ``num_worst_tokens`` (padding ids -1);
- ``ll``: a low-latency dispatch and combine, BF16 or FP8 (UE8M0 scales), with or without the receive hook,
  zero-copy or ``out=``: ``gpu_cases.check_ll_case``, the fast Buffer against the reference Buffer on the same
  inputs: the counts, layout ranges, cumulative statistics and every local expert's valid rows (source info, rows
  (FP8 within one e4m3 step), scales) bit for bit; the combine within its budget of the reference's combine of the
  same expert outputs, the budget's sum of |terms| computed from the inputs (``gpu_cases_ll.ll_combine_abs_sum``,
  which tests/dist/test_gpu_summaries_cpu.py holds to the reference's combine of the magnitudes);
- ``v2-dispatch``: an ``ElasticBuffer`` dispatch, contiguous or expanded, with or without the CPU sync, BF16 or
  FP8 (float32 or opaque UE8M0 scales), then its cached replay and a second dispatch: ``elastic_cases.check_dispatch``
  against the V2 oracle (``elastic_cases.expected_dispatch``: what a rank receives, from every rank's seeded
  inputs), bit for bit;
- ``v2-combine``: an ``ElasticBuffer`` dispatch and combine of either layout with 0-2 biases:
  ``elastic_cases.check_combine`` against ``elastic_cases.expected_combine`` (DeepEP's reduction order), bit for bit.
  The V2 oracles are the ones tests/dist/test_elastic.py holds the reference backend's ``ElasticBuffer`` to.

The comparisons run where the results live (on a GPU: no copy to the host unless one fails, for its message) and
read back a flag or a few a call. Each rank's intra-op threads are the host's cores shared among its ranks.

Token counts are drawn per rank from 1 to the maximum (``max_tokens`` for V1 high-throughput, the low-latency
buffer's ``num_max_dispatch_tokens_per_rank``, the ``ElasticBuffer``'s ``num_max_tokens_per_rank``), and 0 one time
in twenty. The fast objects' public calls are counted and timed as they are made (a check makes two to four), and
the loop stops once ``calls`` have been made. The report gives the seconds by check kind and the host's seconds in
the fast calls by call kind, for the whole run and past the warm-up (``after_warmup``: the kernels have compiled by
then, as the memory verdict's ``new_kernels`` tells; its rate is the one a longer run keeps). The fast backend is ``nvlink``: on GPUs as the library runs it, on
the CPU the CPU rig's (``cpu_nvlink``: its kernels under the Triton interpreter, so a CPU run takes few calls and
small shapes).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import time

import torch

from . import elastic_cases as C
from . import gpu_cases as G
from .graphs import progress
from .inputs import Case
from .soak_watch import Watch, fmt

KINDS = ("ht", "ht-worst", "ll", "v2-dispatch", "v2-combine")
LL_VARIANTS = ({"use_fp8": False}, {"use_fp8": False, "hook": True}, {"use_fp8": False, "zero_copy": True},
               {"use_fp8": True}, {"use_fp8": True, "hook": True},
               {"use_fp8": True, "round_scale": True, "ue8m0": True})
ZERO_TOKENS = 0.05  # share of a rank's draws that take no token


@dataclasses.dataclass(frozen=True)
class Options:
    calls: int = 10000
    seed: int = 0
    device: str = "cuda"  # "cuda" (NCCL, or gloo for ranks sharing a GPU) or "cpu" (gloo, the CPU rig)
    hidden: int = 0  # 0: 2048 on GPUs, 128 on the CPU
    max_tokens: int = 0  # V1 high-throughput, per rank; 0: 1024 on GPUs, 8 on the CPU
    ll_max_tokens: int = 0  # the low-latency buffer's; 0: 128 on GPUs, 8 on the CPU
    v2_max_tokens: int = 0  # the ElasticBuffer's; 0: 128 on GPUs, 8 on the CPU
    warmup: float = 0.3  # share of the calls before memory must stay flat
    sample_every: int = 0  # 0: calls // 50
    kinds: tuple = KINDS
    tag: str = "soak"  # the CPU rig's shared-memory names (the same on every rank)
    profile: str = ""  # a file: rank 0's calls and checks under cProfile, the 40 costliest functions written there

    def __post_init__(self):
        for name in ("calls", "hidden", "max_tokens", "ll_max_tokens", "v2_max_tokens", "sample_every"):
            v = getattr(self, name)
            if type(v) is not int or v < (1 if name == "calls" else 0):
                raise ValueError(f"{name} must be an integer >= {1 if name == 'calls' else 0}, got {v!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        if not 0 < self.warmup < 1:
            raise ValueError(f"warmup must be a share of the calls in (0, 1), got {self.warmup!r}")
        if not self.kinds or set(self.kinds) - set(KINDS):
            raise ValueError(f"kinds must be some of {KINDS}, got {self.kinds!r}")


@dataclasses.dataclass(frozen=True)
class Shapes:
    hidden: int
    ht: tuple  # (max tokens, top-k, experts)
    ll: tuple
    v2: tuple

    def result_bytes(self, r: int) -> int:
        """The largest result set of one call at the maxima, on one rank: the rows a high-throughput dispatch
        receives (every rank's tokens) with their ids, weights and scales; both low-latency output sets; the
        expanded rows of a V2 dispatch."""
        h = self.hidden
        row = h * 2 + (h // 128) * 4
        (t, k, _), (m, _, e), (m2, k2, _) = self.ht, self.ll, self.v2
        return max(r * t * (row + k * 12), 2 * (e // r) * r * m * (row + 4), r * m2 * k2 * (row + 4) + r * m2 * k2 * 16)


def shapes(opts: Options, r: int) -> Shapes:
    gpu = opts.device != "cpu"
    h = opts.hidden or (2048 if gpu else 128)
    t = opts.max_tokens or (1024 if gpu else 8)
    m = opts.ll_max_tokens or (128 if gpu else 8)
    m2 = opts.v2_max_tokens or (128 if gpu else 8)
    k, k2 = (8, 8) if gpu else (4, 3)
    e = (16 if gpu else 4) * r
    return Shapes(h, (t, k, e), (m, k, e), (m2, k2, max(e, 8)))


@dataclasses.dataclass(frozen=True)
class _V2Case(C.V2Case):
    """A V2 case whose ``num_max_tokens_per_rank`` is the buffer's, as a client passes it, not the case's most."""

    max_tokens: int = 1

    @property
    def m(self) -> int:
        return self.max_tokens


# ----------------------------------------------------------------------------- the objects


def _build(ctx, s: Shapes, opts: Options) -> dict:
    """``{"ht", "ht-ref", "ll", "ll-ref", "v2"}``: the fast and reference V1 Buffers (high-throughput and
    low-latency) and the fast ElasticBuffer."""
    from .. import Buffer, ElasticBuffer

    (t, _, _), (m, _, e), (m2, k2, _) = s.ht, s.ll, s.v2
    r = ctx.world_size
    hint = Buffer.get_low_latency_rdma_size_hint(m, s.hidden, r, e)
    if opts.device == "cpu":
        from . import cpu_nvlink

        if not _INSTALLED:  # once a process: later runs in it allocate further on in the same shared memory
            os.environ.setdefault("EPCOMM_TIMEOUT_S", "20")
            cpu_nvlink.install(opts.tag, ctx.rank, r, ctx.group)
            _INSTALLED.append(opts.tag)

        class OnNVLink(ElasticBuffer):
            _make_backend = staticmethod(cpu_nvlink.nvlink_backend())

        objs = {"ht-ref": Buffer(ctx.group), "ht": cpu_nvlink.nvlink_buffer(ctx.group, num_nvl_bytes=32 << 20),
                "ll-ref": Buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True),
                "ll": cpu_nvlink.nvlink_buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True),
                "v2": OnNVLink(ctx.group, num_max_tokens_per_rank=m2, hidden=s.hidden, num_topk=k2)}
    else:
        nvl = max(256 << 20, 4 * r * t * s.hidden * 2)
        objs = dict(zip(("ht-ref", "ht"), G.make_buffers(ctx.group, "nvlink", num_nvl_bytes=nvl)))
        objs.update(zip(("ll-ref", "ll"), G.make_buffers(ctx.group, "nvlink", num_rdma_bytes=hint,
                                                         low_latency_mode=True)))
        with G.forced_backend("nvlink"):
            objs["v2"] = ElasticBuffer(ctx.group, num_max_tokens_per_rank=m2, hidden=s.hidden, num_topk=k2)
    ran = {name: objs[name].backend_name for name in ("ht", "ll")} | {"v2": objs["v2"]._backend.name}
    if set(ran.values()) != {"nvlink"}:
        raise RuntimeError(f"the fast objects must run the nvlink backend, they run {ran}")
    return objs


_INSTALLED: list = []  # the CPU rig's tag, once it is installed in this process


def _count_calls(objs: dict, counts: collections.Counter, secs: collections.Counter) -> None:
    """Every public call of the fast objects adds one to ``counts[its kind]`` and the seconds the host spent in it
    to ``secs[its kind]`` (on a GPU the kernels run on after the call returns: this is the call's host path,
    a plan or a compile where the call is the first of its kind, and any wait on the device inside it)."""

    def wrap(obj, name, kind_of):
        fn = getattr(obj, name)

        def counted(*a, **kw):
            kind = kind_of(a, kw)
            counts[kind] += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                secs[kind] += time.perf_counter() - t0

        setattr(obj, name, counted)

    def ht_dispatch(a, kw):
        if kw.get("handle") is not None:
            return "ht cached"
        return "ht worst" if kw.get("num_worst_tokens", 0) else "ht dispatch"

    def v2_dispatch(a, kw):
        if kw.get("handle") is not None:
            return "v2 cached"
        return ("v2 expanded" if kw.get("do_expand") else "v2 contiguous") + (
            "" if kw.get("do_cpu_sync", True) else " no-sync")

    wrap(objs["ht"], "get_dispatch_layout", lambda a, kw: "ht layout")
    wrap(objs["ht"], "dispatch", ht_dispatch)
    wrap(objs["ht"], "combine", lambda a, kw: "ht combine")
    wrap(objs["ll"], "low_latency_dispatch", lambda a, kw: "ll dispatch")
    wrap(objs["ll"], "low_latency_combine", lambda a, kw: "ll combine")
    wrap(objs["v2"], "dispatch", v2_dispatch)
    wrap(objs["v2"], "combine", lambda a, kw: "v2 combine")


# ----------------------------------------------------------------------------- one iteration


def _tokens(rng: random.Random, r: int, most: int) -> tuple:
    return tuple(0 if rng.random() < ZERO_TOKENS else rng.randint(1, most) for _ in range(r))


def draw(kind: str, rng: random.Random, s: Shapes, r: int) -> dict:
    """The arguments of one check of ``kind`` (the same on every rank for the same generator state)."""
    seed = rng.randrange(1 << 20)
    fp8_ok = s.hidden % 128 == 0
    if kind in ("ht", "ht-worst"):
        t, k, e = s.ht
        hot, empty = rng.randrange(e), rng.randrange(r)
        case = Case(num_ranks=r, tokens=_tokens(rng, r, t), hidden=s.hidden, num_topk=k, num_experts=e, seed=seed,
                    drop_prob=rng.choice((0.0, 0.1, 0.3)), hot_expert=rng.choice((None, hot)),
                    empty_rank=rng.choice((None, None, None, empty)), no_expert_token=rng.random() < 0.5)
        fp8 = fp8_ok and rng.random() < 0.5
        kw = {"fp8": fp8, "with_bias": not fp8 and rng.random() < 0.5}
        if kind == "ht-worst":
            kw["worst"] = sum(case.tokens) + 1 + rng.randrange(16)
        return {"case": case, **kw}
    if kind == "ll":
        m, k, e = s.ll
        case = Case(num_ranks=r, tokens=_tokens(rng, r, m), hidden=s.hidden, num_topk=k, num_experts=e, seed=seed,
                    drop_prob=rng.choice((0.0, 0.1)))
        variants = [v for v in LL_VARIANTS if fp8_ok or not v["use_fp8"]]
        return {"case": case, "m": m, **rng.choice(variants)}
    m2, k2, e2 = s.v2
    case = _V2Case(num_ranks=r, tokens=_tokens(rng, r, m2), hidden=s.hidden, num_topk=k2, num_experts=e2,
                   masked=rng.choice((0.0, 0.2, 0.5)), seed=seed, max_tokens=m2)
    expand, alignment, sync = rng.random() < 0.5, rng.choice((1, 4, 128)), rng.random() < 0.5
    if kind == "v2-dispatch":
        sf = rng.choice(("bf16", "fp32", "ue8m0") if fp8_ok else ("bf16",))
        return {"case": case, "sf_kind": sf, "expand": expand, "alignment": alignment, "sync": sync}
    return {"case": case, "expand": expand, "n_bias": rng.randrange(3), "alignment": alignment, "sync": sync}


def check(kind: str, args: dict, objs: dict, rank: int) -> None:
    a = dict(args)
    case = a.pop("case")
    if kind in ("ht", "ht-worst"):
        G.check_ht_case(objs["ht-ref"], objs["ht"], case, rank, **a)
    elif kind == "ll":
        G.check_ll_case(objs["ll-ref"], objs["ll"], case, rank, a.pop("m"), **a)
    elif kind == "v2-dispatch":
        C.check_dispatch(objs["v2"], case, rank, a["sf_kind"], a["expand"], a["alignment"], a["sync"])
    else:
        C.check_combine(objs["v2"], case, rank, a["expand"], a["n_bias"], a["alignment"], a["sync"])


def _describe(kind: str, args: dict) -> str:
    rest = " ".join(f"{k}={v}" for k, v in args.items() if k != "case")
    return f"{kind} {args['case']} {rest}"


class SoakFailure(AssertionError):
    """A check failed: the iteration, its kind and arguments, and the check's message."""


# ----------------------------------------------------------------------------- a rank


def run_rank(ctx, opts: Options, hooks=None) -> dict:
    """The soak in one rank: ``opts.calls`` calls at least; returns the rank's report (its ``failures`` list the
    memory and cache rules it broke); a failed check raises ``SoakFailure``. ``hooks(objs)``, where given, runs
    once the objects are built and their calls counted (the tests break them there)."""
    r = ctx.world_size
    _share_cores(r)
    s = shapes(opts, r)
    objs = _build(ctx, s, opts)
    counts: collections.Counter = collections.Counter()
    call_secs: collections.Counter = collections.Counter()
    _count_calls(objs, counts, call_secs)
    if hooks is not None:
        hooks(objs)
    every = opts.sample_every or max(opts.calls // 50, 1)
    warm_calls = int(opts.calls * opts.warmup)
    watch = Watch(objs, ctx.device)
    watch.take(0)
    rng = random.Random(opts.seed)
    checks: collections.Counter = collections.Counter()
    secs: collections.Counter = collections.Counter()
    warm_secs: collections.Counter = collections.Counter()  # secs at the end of the warm-up
    order: list = []
    next_sample, warm_taken, it, t0 = every, False, 0, time.perf_counter()
    prof = _profiler(opts, ctx.rank)
    while sum(counts.values()) < opts.calls:
        if not order:  # the kinds in a random order, round after round: every kind runs within len(kinds) checks
            order = rng.sample(list(opts.kinds), len(opts.kinds))
        kind = order.pop()
        args = draw(kind, rng, s, r)
        before, t1 = sum(counts.values()), time.perf_counter()
        try:
            check(kind, args, objs, ctx.rank)
        except Exception as e:
            raise SoakFailure(f"rank {ctx.rank}, iteration {it} ({_describe(kind, args)}), after {before} calls: "
                              f"{type(e).__name__}: {e}") from e
        checks[kind] += 1
        secs[kind] += time.perf_counter() - t1
        it += 1
        done = sum(counts.values())
        if not warm_taken and done >= warm_calls:
            watch.take(done)  # the end of the warm-up (the samples up to it set the peak)
            warm_calls, warm_taken = done, True
            warm_secs = collections.Counter({k: v for k, v in secs.items()} | {
                "calls " + k: v for k, v in call_secs.items()} | {"checks " + k: v for k, v in checks.items()})
            warm_secs["wall"] = time.perf_counter() - t0
        if done >= next_sample:
            if watch.samples[-1].calls != done:
                sm = watch.take(done)
                if ctx.rank == 0:
                    gpu = "" if sm.gpu is None else f", gpu {fmt(sm.gpu)}"
                    progress(0, f"soak: {done}/{opts.calls} calls, {time.perf_counter() - t0:.0f} s{gpu}, "
                                f"rss {fmt(sm.rss)}, {sm.entries} cache entries")
            next_sample = (done // every + 1) * every
    done = sum(counts.values())
    if prof is not None:
        _write_profile(prof, opts.profile)
    if watch.samples[-1].calls != done:
        watch.take(done)
    report = watch.verdict(warm_calls, s.result_bytes(r))
    report.update(rank=ctx.rank, calls=done, seconds=round(time.perf_counter() - t0, 1), by_kind=dict(counts),
                  checks=dict(checks), seconds_by_check={k: round(v, 2) for k, v in secs.items()}, iterations=it,
                  seconds_in_calls={k: round(v, 2) for k, v in call_secs.items()},
                  after_warmup=_after_warmup(warm_secs, t0, secs, call_secs, checks), shapes=dataclasses.asdict(s),
                  samples=watch.series())
    return report


def _after_warmup(warm: collections.Counter, t0: float, secs, call_secs, checks) -> dict:
    """Past the warm-up (the kernels compiled by then): its seconds, and per check kind the checks run, their
    seconds, and the seconds the host spent in the fast objects' calls, by call kind (``_count_calls``)."""
    return {"seconds": round(time.perf_counter() - t0 - warm["wall"], 1),
            "checks": {k: v - warm["checks " + k] for k, v in checks.items()},
            "seconds_by_check": {k: round(v - warm[k], 2) for k, v in secs.items()},
            "seconds_in_calls": {k: round(v - warm["calls " + k], 2) for k, v in call_secs.items()}}


def _share_cores(ranks: int) -> None:
    """The host's cores shared among the ranks on it (``LOCAL_WORLD_SIZE`` under torchrun, else ``ranks``): each
    rank's intra-op threads a share. (Two ranks each running as many threads as there are cores make every host
    op of the checks many times slower; ``epcomm bench`` does the same on the CPU.)"""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    here = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    torch.set_num_threads(max(1, cores // max(here, 1)))


def _profiler(opts: Options, rank: int):
    """Rank 0's profiler, running, where ``opts.profile`` names a file."""
    if not opts.profile or rank != 0:
        return None
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    return prof


def _write_profile(prof, path: str) -> None:
    import io
    import pstats

    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(40)
    st.sort_stats("cumulative").print_stats(40)
    with open(path, "w") as f:
        f.write(s.getvalue())


def summary(report: dict) -> str:
    """One line of a rank's report: calls by kind, checks passed, memory, cache sizes, the verdict."""
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(report["by_kind"].items()))
    checks = ", ".join(f"{k} {v}" for k, v in sorted(report["checks"].items()))
    after, calls_after = report.get("after_warmup", {}), report["calls"] - report["warm_calls"]
    rate = f"{calls_after / after['seconds']:.1f} calls/s" if after.get("seconds") else "-"
    parts = [(f"rank {report['rank']}: {report['calls']} calls in {report['seconds']:.0f} s ({kinds}); "
              f"{sum(report['checks'].values())} checks passed ({checks}); after the warm-up {calls_after} calls in "
              f"{after.get('seconds', 0):.0f} s ({rate})")]
    for metric in ("gpu", "rss"):
        m = report.get(metric)
        if m:
            parts.append(f"{metric} {fmt(m['warm_end'])} at warm-up end, peak {fmt(m['warm_peak'])} before and "
                         f"{fmt(m['peak_after'])} after (budget +{fmt(m['budget_at_worst'])})")
    caches = " ".join(f"{k} {now}/{most}/{bound}" for k, (now, most, bound) in report["caches"].items()
                      if not k.split(".")[0].endswith("-ref"))
    parts.append(f"caches now/most/bound: {caches}")
    others = sorted(((n - w, k) for k, (w, n) in report.get("grew", {}).items() if k not in report["caches"]),
                    reverse=True)[:4]
    if others:
        parts.append("other containers grown after the warm-up: " + " ".join(f"{k} +{d}" for d, k in others))
    parts.append("FAILED: " + "; ".join(report["failures"]) if report["failures"] else "OK")
    return "; ".join(parts)
