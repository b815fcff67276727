"""DeepEP V2's ``ElasticBuffer`` timed the way the V1 rows are: ``epcomm bench --api v2``.

For each high-throughput case of the plan (its shape: ``T`` tokens a rank, which is also
``num_max_tokens_per_rank``) and each ``num_sms`` of the sweep (``BenchPlan.num_sms_sweep``; empty: the
buffer's ``get_theoretical_num_sms``), these ops, in this order:

- dispatch in both layouts (``contiguous``: ``do_expand=False``, alignment 1; ``expanded``:
  ``do_expand=True``, alignment 128), BF16 and FP8 (``(x, sf)``, fp32 scales per 128 channels), with CPU
  sync (``do_cpu_sync=True``) and without (worst-case sizing);
- combine (BF16, the dispatch's top-k weights sent back) of each layout, with and without CPU sync;
- ``dispatch+combine``: a BF16 dispatch without CPU sync and the combine of what it received, as one step
  (captured together on GPUs), in each layout.

Each op is timed by :func:`epcomm.bench.timing.measure` like a V1 op: eager launches (``median``: GPU time
with the host gaps, ``host``: the call's return time) and, for the no-sync ops on a fast backend on GPUs,
CUDA-graph replays (each captured call replayed).

The oracle: a second ``ElasticBuffer`` on the reference backend in the same ranks, run on the checked input
set (:func:`epcomm.bench.timing.checked_set`) before timing. Every timed op's output on that set, as timed
(eager or graph replay), must equal it bitwise: dispatch on its valid rows (the handle's prefix sums, counts,
source ids and expanded slots; the rows, scales, local top-k ids and weights at the valid rows or slots),
combine on the result and the weights sent back (V2's combine is bit-exact by contract). With and without
CPU sync the valid rows are the same, so one oracle result serves both. The case check (``check``) runs the
same comparison on one eager call before timing.

Rows carry ``api: "v2"``, ``layout``, ``cpu_sync``, ``sms`` (the ``num_sms`` passed) and
``theoretical_num_sms``. After them, a case's rows of the experimental calls (``engram_fetch``, ``pp_send_recv``,
``all_gather``: ``bench/v2_extras.py``), their ``sms`` the SMs each holds. Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``N`` valid
rows, ``X`` expanded rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch

from ..testing.compare import assert_bitwise
from ..testing.gpu_cases import forced_backend
from . import workloads
from .cases import BenchCase
from .profile import profile_op
from .timing import TimedOp, checked_set, fail_text, measure, timed_fields

log = logging.getLogger(__name__)

LAYOUTS = ("contiguous", "expanded")


@dataclasses.dataclass(frozen=True)
class V2Op:
    """One timed V2 operation: ``op`` dispatch or combine, ``layout``, payload ``dtype``, ``cpu_sync``."""

    op: str
    layout: str
    dtype: str
    cpu_sync: bool

    @property
    def expand(self) -> bool:
        return self.layout == "expanded"

    @property
    def alignment(self) -> int:
        return 128 if self.expand else 1


def v2_ops() -> list[V2Op]:
    """The ops of one (case, num_sms), in run order (see the module docstring)."""
    out = [V2Op("dispatch", layout, dtype, sync) for layout in LAYOUTS for dtype in ("bf16", "fp8")
           for sync in (True, False)]
    out += [V2Op("combine", layout, "bf16", sync) for layout in LAYOUTS for sync in (True, False)]
    return out + [V2Op("dispatch+combine", layout, "bf16", False) for layout in LAYOUTS]


def dispatch_kwargs(st: workloads.HTSet, case: BenchCase, op: V2Op, num_sms: int) -> dict:
    return {"topk_idx": st.topk_idx, "topk_weights": st.topk_weights, "num_experts": case.experts,
            "num_max_tokens_per_rank": case.tokens, "expert_alignment": op.alignment, "do_expand": op.expand,
            "do_cpu_sync": op.cpu_sync, "num_sms": num_sms}


def canonical(out, expand: bool) -> dict:
    """The valid part of a dispatch's result ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``,
    copied to the host: the handle's prefix sums, real counts, source ids (``recv_src_metadata[:N, 0]``) and
    expanded slots (``[:N, 2:]``); contiguous, the first ``N`` rows of ``recv_x`` (and scales), local top-k
    ids and weights; expanded, ``recv_x`` (and scales) and weights at the slots the lanes name."""
    rx, ridx, rw, hd, _ = out
    rx, rsf = rx if isinstance(rx, tuple) else (rx, None)
    psum = hd.psum_num_recv_tokens_per_scaleup_rank
    n = int(psum[-1]) if psum.numel() else 0
    meta = hd.recv_src_metadata[:n]
    got = {"psum_rank": psum, "psum_expert": hd.psum_num_recv_tokens_per_expert,
           "counts": hd.num_unaligned_recv_tokens_per_expert, "src": meta[:, 0], "slots": meta[:, 2:]}
    if expand:
        sel = meta[:, 2:]
        sel = sel[sel >= 0].long()
        got.update(x=rx[sel], w=rw[sel])
        if rsf is not None:
            got["sf"] = rsf[sel]
    else:
        got.update(x=rx[:n], topk_idx=ridx[:n], w=rw[:n])
        if rsf is not None:
            got["sf"] = rsf[:n]
    return {k: v.detach().cpu().clone() for k, v in got.items()}


@dataclasses.dataclass
class V2Expect:
    """The oracle's results on input set ``set_index``: ``dispatch[(layout, dtype)]`` (:func:`canonical`)
    and ``combine[layout]`` (``(combined bf16[T, H], weights back f32[T, K])``)."""

    set_index: int
    dispatch: dict
    combine: dict

    def verify(self, op: V2Op, s: int, out) -> None:
        """Raise AssertionError where ``out`` (the timed call's result on set ``s``) differs from the oracle's."""
        what = f"timed {op.op} ({op.layout}, {op.dtype}, {'sync' if op.cpu_sync else 'no sync'}, set {s})"
        if s != self.set_index:
            raise AssertionError(f"{what}: the oracle ran on set {self.set_index}")
        if op.op == "dispatch":
            want = self.dispatch[(op.layout, op.dtype)]
            got = canonical(out, op.expand)
            if set(got) != set(want):
                raise AssertionError(f"{what}: fields {sorted(got)} != {sorted(want)}")
            for field in want:  # the counts first: rows compared only where they say the same rows
                assert_bitwise(got[field], want[field], f"{what} {field}")
        else:  # combine, or dispatch+combine (the combine of the BF16 rows received, as the oracle's)
            combined, weights = self.combine[op.layout]
            assert_bitwise(out[0], combined, f"{what} combined_x")
            assert_bitwise(out[1], weights, f"{what} combined_topk_weights")


def combine_inputs(buf, st: workloads.HTSet, case: BenchCase, op: V2Op, num_sms: int):
    """``(y, weights, handle)`` for a combine: a BF16 dispatch of ``st`` in ``op``'s layout and sync, its
    received rows as the expert outputs and its received weights to send back (copies: they outlive later
    dispatches)."""
    kw = dispatch_kwargs(st, case, dataclasses.replace(op, dtype="bf16"), num_sms)
    rx, _, rw, hd, _ = buf.dispatch(st.x, **kw)
    return rx.clone(), rw.clone(), hd


def expect_v2(ref, st: workloads.HTSet, case: BenchCase, set_index: int) -> V2Expect:
    """The oracle ``ref`` (a reference-backend ElasticBuffer) on ``st``. Collective (every rank, same order)."""
    disp, comb = {}, {}
    for op in v2_ops():
        if op.op == "dispatch" and op.cpu_sync:
            xin = st.x if op.dtype == "bf16" else st.x_fp8
            disp[(op.layout, op.dtype)] = canonical(ref.dispatch(xin, **dispatch_kwargs(st, case, op, 0)), op.expand)
        elif op.op == "combine" and op.cpu_sync:
            y, w, hd = combine_inputs(ref, st, case, op, 0)
            out, back, _ = ref.combine(y, hd, topk_weights=w)
            comb[op.layout] = (out.cpu().clone(), back.cpu().clone())
    return V2Expect(set_index, disp, comb)


def timed_op(buf, sets: list[workloads.HTSet], case: BenchCase, op: V2Op, num_sms: int,
             expect: V2Expect | None, capturable: bool) -> TimedOp:
    """``op`` as a :class:`TimedOp` on ``buf`` (one step per call), verified against ``expect``."""
    def build(s: int):
        st = sets[s]
        if op.op == "dispatch":
            xin = st.x if op.dtype == "bf16" else st.x_fp8
            kw = dispatch_kwargs(st, case, op, num_sms)
            return [], [lambda: buf.dispatch(xin, **kw)]
        if op.op == "dispatch+combine":
            kw = dispatch_kwargs(st, case, op, num_sms)

            def pair():
                rx, _, rw, hd, _ = buf.dispatch(st.x, **kw)
                return buf.combine(rx, hd, topk_weights=rw)
            return [], [pair]
        y, w, hd = combine_inputs(buf, st, case, op, num_sms)
        return [], [lambda: buf.combine(y, hd, topk_weights=w)]

    verify = None if expect is None else (lambda s, out: expect.verify(op, s, out))
    return TimedOp(op.op, op.dtype, ("total",), build, capturable=capturable and not op.cpu_sync, verify=verify)


def _case_check(top: TimedOp, s: int) -> str:
    """One eager call of ``top`` on set ``s`` against the oracle: ``pass`` or ``FAIL: ...``."""
    _, steps = top.build(s)
    out = [step() for step in steps][-1]
    try:
        top.verify(s, out)
    except AssertionError as e:
        return fail_text(e)
    return "pass"


def make_elastic(group, cases: list[BenchCase], backend: str):
    """``(timed, oracle)`` ElasticBuffers sized for the largest case: the one epcomm picks (or ``backend``
    forced through ``EPCOMM_BACKEND``) and one on the reference backend. Collective."""
    from ..elastic import ElasticBuffer

    kw = {"num_max_tokens_per_rank": max(c.tokens for c in cases), "hidden": max(c.hidden for c in cases),
          "num_topk": max(c.topk for c in cases), "explicitly_destroy": True}
    with (forced_backend(backend) if backend != "auto" else contextlib.nullcontext()):
        fast = ElasticBuffer(group, **kw)
    with forced_backend("reference"):
        ref = ElasticBuffer(group, **kw)
    return fast, ref


def backend_name(buf) -> str:
    """The row's backend: a stand-in's ``backend_name`` (tests), else the engine's backend."""
    return getattr(buf, "backend_name", None) or buf._backend.name


def run_v2_case(ctx, plan, case: BenchCase, buf, ref, sms_sweep: tuple[int, ...], progress=None) -> list[dict]:
    """Every V2 op of ``case`` at every ``num_sms`` of ``sms_sweep`` (empty: the theoretical one) on ``buf``,
    checked against the oracle ``ref``. Returns this rank's results (``report.merge_ranks`` rows)."""
    dev, group = ctx.device, ctx.group
    sets = workloads.make_ht_sets(case, ctx.rank, ctx.world_size, dev, plan.sets, plan.seed)
    sv = checked_set(plan.warmup, plan.iters, plan.sets)
    expect = expect_v2(ref, sets[sv], case, sv) if plan.check else None
    theory = int(buf.get_theoretical_num_sms(case.experts, case.topk))
    name = backend_name(buf)
    out = []
    for sms in (sms_sweep or (theory,)):
        for op in v2_ops():
            top = timed_op(buf, sets, case, op, sms, expect, capturable=name != "reference")
            label = (f"v2 {case.name} T={case.tokens} {op.op}-{op.dtype} {op.layout} "
                     f"{'sync' if op.cpu_sync else 'no-sync'} sms={sms}")
            if progress is not None:
                progress.show(f"{label} ({name})")
            check = _case_check(top, sv) if expect is not None else "skipped"  # --no-check, as V1 says
            graph_too = dev.type == "cuda" and plan.graphs and top.capturable
            for use_graphs in ((False, True) if graph_too else (False,)):
                m = measure(top, num_sets=plan.sets, iters=plan.iters, warmup=plan.warmup, group=group, device=dev,
                            use_graphs=use_graphs)
                if use_graphs and m.method != "graph":
                    continue  # the capture failed (logged): the eager row stands alone
                if plan.profile and not use_graphs:
                    profile_op(top, f"{label} {name}", num_sets=plan.sets, iters=plan.iters, group=group, device=dev,
                               rank=ctx.rank, out_dir=plan.profile)
                out.append({"case": dataclasses.asdict(case), "backend": name, "op": op.op, "dtype": op.dtype,
                            "phase": "total", "logical_bytes": None, "link_bytes": None, "link_counting": None,
                            "sms": sms,
                            **timed_fields(m, 0, check, plan.check, "reference" if top.verify is not None else None),
                            "api": "v2", "layout": op.layout, "cpu_sync": op.cpu_sync,
                            "theoretical_num_sms": theory})
            if progress is not None:
                progress.update(f"{label} ({name})")
    del sets
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_worker_v2(ctx, plan, progress) -> tuple[list[dict], list[str]]:
    """One rank of ``--api v2`` (or the V2 half of ``both``): the two ElasticBuffers, then every
    high-throughput case of ``plan``.
    Returns ``(results, [timed backend name])``."""
    cases = [c for c in plan.cases if c.mode == "ht"]
    if not cases:
        raise ValueError("--api v2 times the high-throughput cases' shapes; the plan has none")
    from .v2_extras import OPS, run_extras_case

    fast, ref = make_elastic(ctx.group, cases, plan.backend)
    if progress is not None:
        sweep = plan.num_sms_sweep or (0,)
        extras = len(OPS) if ctx.world_size > 1 else 1
        progress.set_total(progress.total + len(cases) * (len(sweep) * len(v2_ops()) + extras))
        progress.show(f"ElasticBuffer backend: {backend_name(fast)}; oracle: reference", always=True)
    try:
        results = []
        for case in cases:
            results += run_v2_case(ctx, plan, case, fast, ref, plan.num_sms_sweep, progress)
    finally:
        fast.destroy()
        ref.destroy()
    for case in cases:  # Engram, pipeline send/recv and the AGRS all-gather (bench/v2_extras.py)
        results += run_extras_case(ctx, plan, case, progress)
    return results, [backend_name(fast)]
