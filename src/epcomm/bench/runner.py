"""Run a benchmark: one process per GPU (NCCL) or per CPU rank (gloo), every case timed on the
backend a ``Buffer`` picks and on the reference backend, side by side, in one run.

``run_bench(plan, ...)`` is the parent's driver: it measures the copy-engine ceiling (two or more
GPUs), launches the ranks through :func:`epcomm.testing.launcher.parallel_launch`, and merges their
results into report rows. ``bench_worker`` is what each rank runs. Under torchrun
(``run_bench(..., world=env_world())``) every process is one rank already: it joins the launcher's world
(:func:`epcomm.testing.launcher.env_launch`), rank 0 measures the ceiling first, and every rank gets the
merged rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

import torch
import torch.distributed as dist

from .. import _env
from ..buffer import Buffer
from ..testing.gpu_cases import forced_backend
from ..testing.launcher import EnvWorld, env_launch, parallel_launch, share_gpu
from . import accounting, oracle, report, workloads
from .cases import BenchCase
from .peer import measure_copy_engine
from .profile import host_primitives, profile_op
from .progress import Progress
from .timing import checked_set, measure, timed_fields

log = logging.getLogger(__name__)

BACKEND_CHOICES = ("auto", "reference", "nvlink", "internode")
API_CHOICES = ("v1", "v2", "both")


@dataclasses.dataclass(frozen=True)
class BenchPlan:
    """Everything a rank needs to run the benchmark (picklable)."""

    cases: tuple[BenchCase, ...]
    backend: str = "auto"        # "auto": what Buffer picks; else forced through EPCOMM_BACKEND
    iters: int = 20
    warmup: int = 3
    sets: int = 4                # input sets rotated between iterations
    num_sms: int | None = None   # Buffer.set_num_sms before the Buffers are made
    graphs: bool = True          # try CUDA graphs for capturable (low-latency, fast-backend) ops
    cached: bool = False         # time HT dispatch with a handle (DeepEP's tuning mode)
    check: bool = True           # correctness check of every case before timing it
    seed: int = 0
    profile: str | None = None   # a directory: profile every op's eager call there (bench/profile.py)
    api: str = "v1"              # "v1": the Buffer; "v2": the ElasticBuffer (bench/v2.py); "both": v1 then v2
    num_sms_sweep: tuple[int, ...] = ()  # v2: ElasticBuffer num_sms values, one row set each (empty: theoretical)

    def __post_init__(self) -> None:
        if self.api not in API_CHOICES:
            raise ValueError(f"api must be one of {API_CHOICES}, got {self.api!r}")
        for v in self.num_sms_sweep:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"num_sms_sweep values must be positive ints, got {v!r}")
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {self.backend!r}")
        for f in ("iters", "sets"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not self.cases:
            raise ValueError("no cases to run")


@dataclasses.dataclass
class BenchResult:
    rows: list[dict]
    env: dict
    ce_gbps: float | None


def _forced_backend(name: str | None):
    """``EPCOMM_BACKEND`` set (this rank's process only) while a Buffer is made; no-op for None."""
    return forced_backend(name) if name is not None else contextlib.nullcontext()


def ht_nvl_bytes(case: BenchCase, num_ranks: int) -> int:
    """``num_nvl_bytes`` for a high-throughput case: the larger of DeepEP's config hints and room to
    stage a whole batch from every rank for dispatch and combine (a BF16 row with its FP8 scales
    and top-k, plus 16 bytes), which backends that stage whole batches (nvlink) need."""
    dcfg, ccfg = Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks)
    hint = max(cfg.get_nvl_buffer_size_hint(case.hidden * 2, num_ranks) for cfg in (dcfg, ccfg))
    row = case.hidden * 2 + 4 * (case.hidden // 128) + 12 * case.topk + 16
    staging = 2 * num_ranks * case.tokens * row
    return (max(hint, staging) + (1 << 20) - 1) // (1 << 20) * (1 << 20)


def _node_sizes(num_ranks: int) -> list[int]:
    """The ranks per node the internode backend may form: ``EPCOMM_GPUS_PER_NODE`` where set, else every
    divisor of ``num_ranks`` up to 8 (a node is a host, unknown before the Buffer is made)."""
    n = _env.gpus_per_node()
    return [n] if n else [d for d in range(1, min(num_ranks, 8) + 1) if num_ranks % d == 0]


def _buffer_kwargs(mode: str, cases: list[BenchCase], num_ranks: int, backend: str = "auto") -> dict:
    if mode == "ht":
        nvl = max(ht_nvl_bytes(c, num_ranks) for c in cases)
        if backend == "internode":  # the hierarchical path's areas, for the run's ranks per node
            from ..backends.internode_ht import high_throughput_bytes
            nvl = max([nvl] + [high_throughput_bytes(c.tokens, c.hidden, c.topk, num_ranks, n)
                               for c in cases for n in _node_sizes(num_ranks)])
        return {"num_nvl_bytes": nvl}
    rdma = max(Buffer.get_low_latency_rdma_size_hint(c.tokens, c.hidden, num_ranks, c.experts) for c in cases)
    return {"num_rdma_bytes": rdma, "low_latency_mode": True}


def make_buffers(group, num_ranks: int, plan: BenchPlan) -> dict[str, dict[str, Buffer]]:
    """``{mode: {backend name: Buffer}}``: the picked (or forced) backend first, then ``reference``
    if the first one is not already it. Made in the same order on every rank (collective)."""
    out: dict[str, dict[str, Buffer]] = {}
    for mode in ("ht", "ll"):
        cases = [c for c in plan.cases if c.mode == mode]
        if not cases:
            continue
        kw = _buffer_kwargs(mode, cases, num_ranks, plan.backend)
        with _forced_backend(None if plan.backend == "auto" else plan.backend):
            fast = Buffer(group, **kw)
        bufs = {fast.backend_name: fast}
        if fast.backend_name != "reference":
            with _forced_backend("reference"):
                # The reference needs no intranode staging buffer; low-latency needs its rdma bytes.
                bufs["reference"] = Buffer(group, **{**kw, "num_nvl_bytes": 0})
        out[mode] = bufs
    return out


def device_info(device: torch.device) -> dict:
    """GPU model, count and CUDA/NCCL versions (rank 0 reports them; the parent never touches CUDA)."""
    if device.type != "cuda":
        return {"device": "cpu", "gpu_count": 0}
    nccl = torch.cuda.nccl.version()
    return {"device": torch.cuda.get_device_name(device), "gpu_count": torch.cuda.device_count(),
            "cuda": torch.version.cuda, "nccl": ".".join(str(v) for v in nccl) if isinstance(nccl, tuple) else str(nccl)}


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def group_transport(group) -> str:
    """The process group's backend as torch.distributed names it (``"nccl"``, ``"gloo"``, ...): what the
    reference and the peer baseline move their bytes through. Ranks sharing a GPU are joined by gloo."""
    return str(dist.get_backend(group)).lower()


def peer_name(group) -> str:
    """The peer baseline's row name: :mod:`epcomm.bench.a2a` on the group's own transport
    (``"nccl-a2a"``, ``"gloo-a2a"``), never the transport a GPU run would usually have."""
    return f"{group_transport(group)}-a2a"


def _sms(name: str, device: torch.device, mode: str = "ht", transport: str = "gloo"):
    if name == "reference" or name.endswith("-a2a"):
        return transport
    if mode == "ll" and device.type == "cuda":
        # the low-latency kernels are not bounded by num_sms: their grids reach every SM
        return f"all {torch.cuda.get_device_properties(device).multi_processor_count}"
    return Buffer.num_sms


def _bytes(case: BenchCase, backend: str, op, method: str, routings, me: int, cached: bool, ht_transfer: str):
    """``(logical, link, link_counting)`` bytes of rank ``me`` for one timed op, averaged over the input
    sets; ``link`` is None where no counting rule covers the backend (``accounting.link_counting``)."""
    lg = accounting.mean_bytes(routings, lambda rt: accounting.logical_bytes(case.mode, op.op, op.dtype, rt, me,
                                                                            case.hidden))
    counting = accounting.link_counting(backend, case.mode, graph=method == "graph", ht_transfer=ht_transfer)
    if counting is None:
        return lg, None, "not modelled"
    handle_dispatch = cached and case.mode == "ht" and op.op == "dispatch" and not backend.endswith("-a2a")
    kb = accounting.mean_bytes(routings, lambda rt: accounting.link_bytes(
        counting, op.op, op.dtype, rt, me, case.hidden, case.topk, cached=handle_dispatch))
    return lg, kb, counting


def _run_case(ctx, plan: BenchPlan, case: BenchCase, bufs: dict[str, Buffer], progress: Progress | None):
    me, r_, dev, group = ctx.rank, ctx.world_size, ctx.device, ctx.group
    num_sets = plan.sets
    if case.mode == "ll":
        num_sets += num_sets % 2  # even: graph replays keep the two receive areas alternating
    sv = checked_set(plan.warmup, plan.iters, num_sets)  # the set every timed op is verified on
    expect = None
    if case.mode == "ht":
        sets = workloads.make_ht_sets(case, me, r_, dev, num_sets, plan.seed)
        if plan.check:
            checks, expect = workloads.check_ht(bufs, sets[sv], sv)
        else:
            checks = dict.fromkeys(bufs, "skipped")
    else:
        sets = workloads.make_ll_sets(case, me, r_, dev, num_sets, plan.seed)
        for buf in bufs.values():  # M = T changes from case to case: the contract asks for a clean first
            dist.barrier(group=group)
            buf.clean_low_latency_buffer(case.tokens, case.hidden, case.experts)
        dist.barrier(group=group)
        checks = dict.fromkeys(bufs, "skipped")
        if plan.check:
            checks = workloads.check_ll(bufs, sets[sv], case)
            expect = oracle.ll_expect(bufs["reference"], sets[sv], case, group, sv)
    routings = workloads.gather_routings(group, sets, case, r_)
    ht_transfer = _env.ht_transfer()
    out = []
    timed = [(name, buf) for name, buf in bufs.items()]
    timed.append((peer_name(group), None))
    for name, buf in timed:
        if buf is None:
            ops = workloads.a2a_ops(group, sets, case)
        else:
            ops = (workloads.ht_ops(buf, sets, plan.cached, expect, layout_rows=plan.api == "both") if case.mode == "ht"
                   else workloads.ll_ops(buf, sets, case, expect))
        reset = None
        if case.mode == "ll" and buf is not None:
            def reset(buf=buf):
                dist.barrier(group=group)
                buf.clean_low_latency_buffer(case.tokens, case.hidden, case.experts)
                dist.barrier(group=group)
        for op in ops:
            label = f"{case.name} {case.mode} T={case.tokens} {op.op}-{op.dtype}"
            label += "" if op.phases == ("total",) else " send/recv"
            if progress is not None:
                progress.show(f"{label} ({name})")
            # on GPUs a capturable op is timed both ways: eager launches (events) and graph replays
            graph_too = dev.type == "cuda" and plan.graphs and op.capturable
            for use_graphs in ((False, True) if graph_too else (False,)):
                if reset is not None:
                    reset()
                m = measure(op, num_sets=num_sets, iters=plan.iters, warmup=plan.warmup, group=group, device=dev,
                            use_graphs=use_graphs, reset=reset)
                if use_graphs and m.method != "graph":
                    continue  # the capture failed (logged): the eager row stands alone
                if plan.profile and not use_graphs:
                    profile_op(op, f"{label} {name}", num_sets=num_sets, iters=plan.iters, group=group, device=dev,
                               rank=me, out_dir=plan.profile, reset=reset)
                check = checks.get(name, "not checked") if buf is not None else (m.verified or "not checked")
                lb, kb, counting = _bytes(case, name, op, m.method, routings, me, plan.cached, ht_transfer)
                compared = op.oracle if op.verify is not None else None
                for i, phase in enumerate(m.phases):
                    total = phase == "total"
                    out.append({"case": dataclasses.asdict(case), "backend": name, "op": op.op, "dtype": op.dtype,
                                "phase": phase, "logical_bytes": lb if total else None,
                                "link_bytes": kb if total else None, "link_counting": counting if total else None,
                                "sms": _sms(name, dev, case.mode, group_transport(group)),
                                **timed_fields(m, i, check, plan.check, compared)})
            if progress is not None:
                progress.update(f"{label} ({name})")
    del sets
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_worker(ctx, plan: BenchPlan, progress: Progress | None) -> dict:
    """One rank: make the Buffers, check and time every case. Returns this rank's results."""
    if ctx.device.type == "cpu":
        # The ranks share the host's cores: oversubscribed intra-op threads make every op ~20x slower.
        torch.set_num_threads(max(1, _cpu_count() // ctx.world_size))
    if plan.api == "v2":
        from .v2 import bench_worker_v2

        results, names = bench_worker_v2(ctx, plan, progress if ctx.rank == 0 else None)
        if progress is not None and ctx.rank == 0:
            progress.close()
        return {"rank": ctx.rank, "results": results, "backends": names,
                "device": device_info(ctx.device) if ctx.rank == 0 else None}
    if plan.num_sms is not None:
        Buffer.set_num_sms(plan.num_sms)
    bufs = make_buffers(ctx.group, ctx.world_size, plan)
    names = list(dict.fromkeys(n for per_mode in bufs.values() for n in per_mode))
    if ctx.rank != 0:
        progress = None
    if progress is not None:
        progress.set_total(sum(len(c.ops()) * len(bufs[c.mode]) + len(c.peer_ops()) for c in plan.cases))
        progress.show(f"backends: {', '.join(names)}", always=True)
    results = []
    if plan.profile:
        host_primitives(ctx.device, plan.profile, ctx.rank)
    for case in plan.cases:
        results += _run_case(ctx, plan, case, bufs[case.mode], progress)
    if plan.api == "both":  # the V2 rows after the V1 rows, in the same ranks (bench/v2.py)
        from .v2 import bench_worker_v2

        v2_results, v2_names = bench_worker_v2(ctx, plan, progress)
        results += v2_results
        names = list(dict.fromkeys(names + v2_names))
    if progress is not None:
        progress.close()
    return {"rank": ctx.rank, "results": results, "backends": names,
            "device": device_info(ctx.device) if ctx.rank == 0 else None}


def _bench_worker_sharing_ce(ctx, plan: BenchPlan, progress: Progress | None, ce: float | None) -> dict:
    """``bench_worker`` under a launcher; rank 0's result also carries its copy-engine ceiling."""
    return {**bench_worker(ctx, plan, progress), "ce_gbps": ce}


def run_bench(plan: BenchPlan, *, world_size: int, device: str = "cpu", progress: Progress | None = None,
              timeout_s: float = 1800.0, measure_ce: bool = True, world: EnvWorld | None = None) -> BenchResult:
    """Launch ``world_size`` ranks on ``device`` (``"cuda"``: NCCL, one GPU each; ``"cpu"``: gloo).

    ``world``: this process is one rank of a launcher's world (torchrun, possibly many nodes): nothing is
    spawned, ``world_size`` must equal its size, and every rank returns the same rows."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    _env.commit()  # a malformed EPCOMM_COMMIT fails now, not after the run
    # EPCOMM_TEST_SHARE_GPU=1 with fewer GPUs than ranks: the ranks time-share the GPUs (the tests'
    # shared mode, joined through gloo); the rows say so, and there is no copy-engine peer to measure
    shared = device == "cuda" and world is None and share_gpu(world_size)
    if device == "cuda" and world is None and not shared:
        n = torch.cuda.device_count()
        if world_size > n:
            raise ValueError(f"world_size={world_size} needs {world_size} GPUs, {n} visible "
                             "(EPCOMM_TEST_SHARE_GPU=1 lets ranks share them, for correctness only)")
    ce = None
    if device == "cuda" and measure_ce and plan.api != "v2" and not shared and (world is None or world.rank == 0):
        # under a launcher rank 0 measures before joining the group: the others wait in its rendezvous
        if progress is not None:
            progress.show("measuring the copy-engine peer bandwidth", always=True)
        ce = measure_copy_engine()
    transport = "nccl" if device == "cuda" else "gloo"
    if world is not None:
        out = env_launch(world, world_size, _bench_worker_sharing_ce, plan, progress, ce, backend=transport)
        ce = out[0]["ce_gbps"]
    else:
        out = parallel_launch(world_size, bench_worker, plan, progress, backend=transport, timeout_s=timeout_s)
    env = report.environment(out[0]["device"], world_size,
                             f"gloo, {world_size} ranks sharing {torch.cuda.device_count()} GPU(s)" if shared
                             else transport, out[0]["backends"])
    rows = report.merge_ranks([o["results"] for o in out], env=env, iters=plan.iters, warmup=plan.warmup,
                              ce_gbps=ce, cached=plan.cached)
    return BenchResult(rows, env, ce)
