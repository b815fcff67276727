"""DeepEP V2's experimental calls timed beside the V2 rows (``epcomm bench --api v2``): for each high-throughput case
(``T`` tokens a rank, hidden ``H``) one row each of

- ``engram_fetch``: ``engram_fetch`` of ``T`` tokens x 24 entries of 128 BF16 (DeepEP's test_engram shape) from
  storages of ``ENTRIES`` entries a rank, and its hook; bytes: the rows fetched, as DeepEP's test counts them;
- ``pp_send_recv``: ``pp_send`` of a ``[T, H]`` BF16 tensor to the next rank and ``pp_recv`` of the previous
  rank's (every rank at once); bytes: the tensor received;
- ``all_gather``: one session's ``all_gather`` of a ``[T, H]`` BF16 tensor, its wait and the session's end (the
  session made untimed before); bytes: the ``R`` parts gathered, as DeepEP's test_agrs counts them.

Each is timed by :func:`epcomm.bench.timing.measure` (eager: the calls wait on the host or hold device state
that a graph replay would not advance the same way) and checked as timed, bitwise, against the same call on a
reference-backend ``ElasticBuffer`` on the checked input set. ``sms``: the SMs the call holds on its backend
(``engram_fetch``: its programs at ``num_qps=0``; ``pp_send_recv``: at ``num_sms=0``; ``all_gather``: 1, the
handshake's program, the data moving by the copy engine; 0 on the reference). ``pp_send_recv`` and
``all_gather`` need two ranks or more.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..testing.compare import assert_bitwise
from ..testing.gpu_cases import forced_backend
from .cases import BenchCase
from .timing import TimedOp, checked_set, fail_text, measure, timed_fields

OPS = ("engram_fetch", "pp_send_recv", "all_gather")
ENGRAM_HIDDEN = 128
ENGRAM_PER_TOKEN = 24


def entries(device: torch.device) -> int:
    """Engram entries a rank: 65536 on a GPU (16 MiB of BF16 rows), 1024 on CPU ranks."""
    return 65536 if device.type == "cuda" else 1024


def _buffers(group, backend: str, op: str, case: BenchCase, device: torch.device):
    """``(timed, oracle)`` ElasticBuffers configured for ``op`` (the oracle on the reference backend). Collective."""
    from ..elastic import ElasticBuffer as EB

    t, h = case.tokens, case.hidden
    out = []
    for name in (backend, "reference"):
        with (forced_backend(name) if name != "auto" else contextlib.nullcontext()):
            if op == "engram_fetch":
                gpu, cpu = EB.get_engram_storage_size_hint(entries(device), ENGRAM_HIDDEN, t * ENGRAM_PER_TOKEN)
                buf = EB(group, num_bytes=gpu + cpu, num_cpu_bytes=cpu, explicitly_destroy=True)
            elif op == "pp_send_recv":
                buf = EB(group, num_bytes=EB.get_pp_buffer_size_hint(t * h * 2, 4), explicitly_destroy=True)
                buf.pp_set_config(t * h * 2, 4)
            else:
                sess = EB.get_agrs_num_max_session_bytes(group, (t, h), torch.bfloat16)
                buf = EB(group, num_bytes=EB.get_agrs_buffer_size_hint(group, sess), explicitly_destroy=True)
                buf.agrs_set_config(sess, 1)
        out.append(buf)
    return out


@dataclasses.dataclass
class _Op:
    """One experimental call on ``buf``: ``inputs[s]`` per input set, ``prep(s)`` untimed, ``step(s)`` timed (its
    output: what is checked), ``logical_bytes`` a call."""

    name: str
    buf: object
    inputs: list
    logical_bytes: int

    def prep(self, s: int):
        if self.name == "all_gather":
            self.buf.create_agrs_session()

    def step(self, s: int):
        buf, x = self.buf, self.inputs[s]
        if self.name == "engram_fetch":
            data, _ = buf.engram_fetch(x)()
            return data
        if self.name == "pp_send_recv":
            x, out = x
            me, r_ = buf.rank_idx, buf.num_ranks
            buf.pp_send(x, (me + 1) % r_)
            buf.pp_recv(out, (me - 1) % r_)
            return out
        out, wait = buf.all_gather(x)
        wait()
        buf.destroy_agrs_session()
        return out

    def sms(self) -> int:
        buf = self.buf
        if self.name == "engram_fetch":
            return buf._x_engram.sms_held(0)
        if self.name == "pp_send_recv":
            return buf._x_pp.sms_held(0, self.inputs[0][0].numel() * 2)
        return buf._x_agrs.sms_held()


def _inputs(op: str, case: BenchCase, rank: int, num_ranks: int, device, num_sets: int, seed: int):
    t, h = case.tokens, case.hidden
    out = []
    for s in range(num_sets):
        g = torch.Generator().manual_seed(seed * 7919 + s * 131 + rank)
        if op == "engram_fetch":
            idx = torch.randint(0, num_ranks * entries(device), (t, ENGRAM_PER_TOKEN), generator=g, dtype=torch.int32)
            out.append(idx.to(device))
        elif op == "pp_send_recv":
            out.append((torch.randn(t, h, generator=g).to(torch.bfloat16).to(device),
                        torch.empty(t, h, dtype=torch.bfloat16, device=device)))
        else:
            out.append(torch.randn(t, h, generator=g).to(torch.bfloat16).to(device))
    return out


def _write_storage(bufs, rank: int, device, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 104729 + rank)
    storage = torch.randn(entries(device), ENGRAM_HIDDEN, generator=g).to(torch.bfloat16).to(device)
    for buf in bufs:
        buf.engram_write(storage)


def _once(op: _Op, s: int):
    op.prep(s)
    out = op.step(s)
    return out.detach().cpu().clone()


def backend_name(buf) -> str:
    """The row's backend: a stand-in's ``backend_name`` (tests), else the buffer's backend (as ``bench/v2.py``)."""
    return getattr(buf, "backend_name", None) or buf._backend.name


def run_extras_case(ctx, plan, case: BenchCase, progress=None) -> list[dict]:
    """This rank's rows of the experimental calls for ``case`` (module docstring). Collective."""
    rows = []
    sv = checked_set(plan.warmup, plan.iters, plan.sets)
    for name in OPS:
        if name != "engram_fetch" and ctx.world_size < 2:
            continue
        fast, ref = _buffers(ctx.group, plan.backend, name, case, ctx.device)
        try:
            if name == "engram_fetch":
                _write_storage((fast, ref), ctx.rank, ctx.device, plan.seed)
            sets = _inputs(name, case, ctx.rank, ctx.world_size, ctx.device, plan.sets, plan.seed)
            t, h, r_ = case.tokens, case.hidden, ctx.world_size
            nbytes = {"engram_fetch": t * ENGRAM_PER_TOKEN * ENGRAM_HIDDEN * 2, "pp_send_recv": t * h * 2,
                      "all_gather": r_ * t * h * 2}[name]
            timed, oracle = _Op(name, fast, sets, nbytes), _Op(name, ref, sets, nbytes)
            label = f"v2 {case.name} T={case.tokens} {name}"
            if progress is not None:
                progress.show(f"{label} ({backend_name(fast)})")
            want = _once(oracle, sv) if plan.check else None

            def verify(s, out, want=want, name=name):
                assert_bitwise(out, want, f"timed {name} (set {s})")

            top = TimedOp(name, "bf16", ("total",), lambda s, o=timed: ([lambda: o.prep(s)], [lambda: o.step(s)]),
                          capturable=False, verify=None if want is None else verify)
            check = "skipped"
            if want is not None:
                try:
                    verify(sv, _once(timed, sv))
                    check = "pass"
                except AssertionError as e:
                    check = fail_text(e)
            m = measure(top, num_sets=plan.sets, iters=plan.iters, warmup=plan.warmup, group=ctx.group,
                        device=ctx.device, use_graphs=False)
            rows.append({"case": dataclasses.asdict(case), "backend": backend_name(fast), "op": name, "dtype": "bf16",
                         "phase": "total", "logical_bytes": nbytes, "link_bytes": None, "link_counting": None,
                         "sms": timed.sms(), **timed_fields(m, 0, check, plan.check, "reference" if want is not None
                                                            else None),
                         "api": "v2", "layout": None, "cpu_sync": None, "theoretical_num_sms": None})
            if progress is not None:
                progress.update(f"{label} ({backend_name(fast)})")
        finally:
            fast.destroy()
            ref.destroy()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows
