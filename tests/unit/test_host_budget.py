"""Tier 1: the host budget of an eager high-throughput call on the nvlink backend, per call kind, at the
level a user sees (``Buffer.get_dispatch_layout`` / ``dispatch`` / ``combine``: validation, events,
stream joins, handle building and the backend) and the backend's share of it.

What is counted, on the CPU stand-ins of ``epcomm.testing.cpu_nvlink`` (the same host code as on a GPU
host; the kernels are not run, the ``test_nvlink_orchestration`` rig records their launches):

- ``ops``: torch calls that make or change tensors (views, allocations, copies, arithmetic: each a trip
  through torch's dispatcher, microseconds apiece on a GPU host, more under MPS);
- ``meta``: metadata reads (``.shape``, ``.dtype``, ``numel()``, ``data_ptr()``, ...), a fraction of a
  microsecond each;
- ``allocs``: calls whose result has a storage none of their inputs had (a real allocation);
- ``launches``: kernel launches through ``kernels/launch.py`` plus torch ops that run device work
  (anything but views, allocations without a fill, and metadata);
- ``syncs``: host synchronisations (event/stream/device synchronise, ``item``/``tolist`` and kin);
- ``streams``: CUDA stream and event calls (current stream, waits, records, new events).

Each kind is counted on its second call (the first binds its launches). ``python -m pytest -s`` prints
the table and, per kind, every op with the line that made it. Bounds are the counts of the commit that
set them: a change that adds host work must raise a bound here, on purpose.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import traceback
import weakref

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("triton")

from test_nvlink_orchestration import E, H, K, R, T, _args, make_rig  # noqa: E402

from epcomm.backends.base import LowLatencyCombineArgs, LowLatencyDispatchArgs  # noqa: E402

from epcomm.backends import nvlink as nv  # noqa: E402
from epcomm.event import EventOverlap  # noqa: E402
from epcomm.kernels.launch import Launcher  # noqa: E402
from epcomm.testing import cpu_nvlink  # noqa: E402
from epcomm.testing.torch_calls import META as _META, _storages  # noqa: E402

META = _META | {"untyped_storage"}
VIEWS = {"view", "__getitem__", "reshape", "flatten", "t", "transpose", "unsqueeze", "squeeze", "expand",
         "split", "narrow", "as_strided", "contiguous", "select", "unflatten", "view_as", "split_with_sizes",
         "unbind", "permute"}
EMPTY = {"empty", "empty_like", "new_empty", "empty_strided", "pin_memory"}
SYNCS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}


@dataclasses.dataclass
class Counts:
    ops: int = 0
    meta: int = 0
    allocs: int = 0
    launches: int = 0
    syncs: int = 0
    streams: int = 0
    log: list = dataclasses.field(default_factory=list)

    def row(self) -> tuple:
        return self.ops, self.meta, self.allocs, self.launches, self.syncs, self.streams


def _site() -> str:
    for f in reversed(traceback.extract_stack()[:-2]):
        if "/epcomm/" in f.filename and "/testing/" not in f.filename:
            return f"{f.filename.split('/epcomm/')[1]}:{f.lineno}"
    return "?"


class _Count(torch.overrides.TorchFunctionMode):
    """Counts and classifies every torch call made inside (see the module docstring)."""

    def __init__(self, c: Counts):
        super().__init__()
        self.c = c

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        c = self.c
        if name in META:
            c.meta += 1
            c.log.append(f"[meta] {name}  {_site()}")
            return out
        c.ops += 1
        new = _storages(out, set()) - _storages((args, kwargs), set())
        alloc = bool(new)
        c.allocs += alloc
        launch = name not in SYNCS and not (name in VIEWS and not alloc) and name not in EMPTY
        c.launches += launch
        c.syncs += name in SYNCS
        c.log.append(f"{name}{' (alloc)' if alloc else ''}{' (launch)' if launch else ''}  {_site()}")
        return out


class _Recorder:
    """The stand-ins' stream/event calls and synchronisations, counted into the current ``Counts``."""

    def __init__(self, monkeypatch):
        self.c: Counts | None = None
        rec = self

        def counted(kind, fn):
            def f(*a, **k):
                if rec.c is not None:
                    setattr(rec.c, kind, getattr(rec.c, kind) + 1)
                    rec.c.log.append(f"[{kind}] {getattr(fn, '__name__', fn)}  {_site()}")
                return fn(*a, **k)
            f.__name__ = getattr(fn, "__name__", "f")
            return f

        for cls in (cpu_nvlink.Stream, cpu_nvlink.Event):
            for name in ("wait_stream", "wait_event", "record", "wait", "query"):
                if hasattr(cls, name):
                    monkeypatch.setattr(cls, name, counted("streams", getattr(cls, name)))
            monkeypatch.setattr(cls, "synchronize", counted("syncs", cls.synchronize))
        event_cls, stream = torch.cuda.Event, cpu_nvlink.Stream
        monkeypatch.setattr(torch.cuda, "Event", counted("streams", event_cls))
        for name in ("current_stream", "set_stream", "stream", "Stream"):
            monkeypatch.setattr(torch.cuda, name, counted("streams", getattr(torch.cuda, name)))
        monkeypatch.setattr(torch.cuda, "synchronize", counted("syncs", lambda *a, **k: None))
        # the synchronised dispatch's poll of the exchange's done word (the rig's: it sets the word)
        monkeypatch.setattr(nv.NVLinkBackend, "_await_counts", counted("syncs", nv.NVLinkBackend._await_counts))
        del stream

    def __call__(self, fn, *args, **kwargs):
        c = Counts()
        self.c = c
        before = Launcher.launches
        try:
            with _Count(c):
                out = fn(*args, **kwargs)
        finally:
            self.c = None
        c.launches += Launcher.launches - before
        return out, c


@pytest.fixture
def rig(monkeypatch):
    """The nvlink backends of ``test_nvlink_orchestration``'s rig, their kernels bound as on a GPU host
    (``_Compiled``: after its first launch a kernel launches through ``Direct`` with addresses, so the
    views a binding needs are not counted, and the addresses taken are)."""
    return make_rig(monkeypatch, compiled=True)


@pytest.fixture
def bufs(rig, monkeypatch):
    """A ``Buffer`` per rank of the rig, its backend the rig's nvlink backend (SM transfer, the default),
    on a CUDA-like communication stream (the stand-in), as on a GPU host."""
    import epcomm.runtime as rm
    from epcomm import Buffer

    out = []
    # (the ranks of the rig live in one process: the first call's exchange of its arguments, a collective, cannot
    # meet there; a repeat, which this file budgets, makes none)
    from epcomm import _agree

    monkeypatch.setattr(_agree.Agreement, "check", lambda self, call, fields, timeout_s: None)
    monkeypatch.setattr(dist, "get_world_size", lambda g: R)
    monkeypatch.setattr(dist, "get_backend", lambda g: "nccl")
    monkeypatch.setattr(rm, "group_nodes", lambda g, t=None: ([0] * R, "one node"))
    for r in range(R):
        monkeypatch.setattr(dist, "get_rank", lambda g, r=r: r)
        monkeypatch.setattr(rm, "select_backend", lambda buf, r=r: (rig.b[r], "the rig"))
        b = Buffer(dist.ProcessGroup(dist.HashStore(), r, R), num_nvl_bytes=0)
        rig.b[r]._buf = weakref.ref(b)
        rig.b[r]._keep = b
        rig.b[r].transfer = "sm"
        b._streams.comm = cpu_nvlink.Stream()  # as on a GPU: asynchronous calls go through it
        out.append(b)
    # as on a GPU build of torch: the backend finds the current stream by its raw handle (cached)
    monkeypatch.setattr(nv, "_raw_stream", lambda index: 0)
    return out


def buffer_calls(buf, record) -> dict[str, Counts]:
    """Every high-throughput call kind of ``buf``, each counted on its second call."""
    got = {}

    def twice(kind, fn, *a, **k):
        fn(*a, **k)
        out, got[kind] = record(fn, *a, **k)
        return out

    for fp8 in (False, True):
        tag = "fp8" if fp8 else "bf16"
        a = _args(fp8=fp8)
        x = a.x if a.x_scales is None else (a.x, a.x_scales)
        if not fp8:
            per_rank, _, per_expert, in_rank, _ = twice("layout", buf.get_dispatch_layout, a.topk_idx, E)
        kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=a.topk_idx, topk_weights=a.topk_weights)
        recv_x, _, recv_w, _, handle, _ = twice(f"dispatch {tag}", buf.dispatch, x, **kw)
        twice(f"cached {tag}", buf.dispatch, x, handle=handle)
        twice(f"worst {tag}", buf.dispatch, x, num_worst_tokens=R * T, **kw)
        if fp8:  # column-major scales, as DeepEP's tests pass them: one contiguous copy more
            twice("dispatch fp8 col-major", buf.dispatch, (x[0], x[1].t().contiguous().t()), **kw)
        if not fp8:
            twice("combine", buf.combine, recv_x, handle, recv_w)
            ev = EventOverlap(torch.cuda.Event())  # a recorded event (Buffer.capture() on a GPU)
            twice("dispatch bf16 async", buf.dispatch, x, previous_event=ev, async_finish=True, **kw)
            twice("combine async", buf.combine, recv_x, handle, recv_w, previous_event=ev, async_finish=True)
    return got


def backend_calls(be, record) -> dict[str, Counts]:
    """The backend's share: its dispatch, cached dispatch, num_worst_tokens dispatch and combine (BF16), and
    the repeats of a low-latency dispatch and combine (what ``Buffer`` runs for a kind seen before)."""
    got = {}

    def twice(kind, fn, *a):
        fn(*a)
        out, got[kind] = record(fn, *a)
        return out

    res = twice("dispatch", be.dispatch, _args())
    twice("combine", be.combine, res.recv_x, res.handle, res.recv_topk_weights, ())
    twice("cached", be.cached_dispatch, res.recv_x, None, res.handle)
    twice("worst", be.dispatch, _args(worst=R * T))
    m = 8
    x = torch.randn(6, H).to(torch.bfloat16)
    topk = torch.randint(-1, E, (6, K), generator=torch.Generator().manual_seed(2))
    run = be.low_latency_dispatch_run(LowLatencyDispatchArgs(x, topk, m, E, True, False, False, None, None, 0, None))
    lres, _ = twice("ll dispatch repeat", run, x, topk, None, None)
    y = torch.randn(E // R, R * m, H).to(torch.bfloat16)
    w = torch.rand(6, K)
    crun = be.low_latency_combine_run(LowLatencyCombineArgs(y, topk, w, lres.handle, None, None, 1, None))
    twice("ll combine repeat", crun, y, topk, w, None, None)
    return got


def table(got: dict[str, Counts]) -> str:
    head = f"{'call':22s} {'ops':>4s} {'meta':>5s} {'allocs':>6s} {'launch':>6s} {'syncs':>5s} {'stream':>6s}"
    return "\n".join([head] + [f"{k:22s} " + " ".join(f"{v:>{w}d}" for v, w in zip(c.row(), (4, 5, 6, 6, 5, 6)))
                               for k, c in got.items()])


def _over(got: dict[str, Counts], bound: dict[str, tuple]) -> dict:
    return {k: (got[k].row(), b) for k, b in bound.items() if any(g > m for g, m in zip(got[k].row(), b))}


def _report(got: dict[str, Counts], title: str) -> None:
    print(f"\n{title}\n{table(got)}", file=sys.stderr)
    for k, c in got.items():
        print(f"--- {k}", *c.log, sep="\n    ", file=sys.stderr)


# (ops, meta, allocs, launches, syncs, stream/event calls) per call, at 2 ranks, SM transfer (the default).
# Before the per-kind plans (1ddae3a, the same counting), for comparison: layout 20/9/15/17/0/0, dispatch
# BF16 18/54/9/4/1/1, cached 6/31/1/2/0/0, num_worst_tokens 17/54/9/3/0/0, combine 7/35/2/2/0/0, dispatch
# FP8 22/65/10/4/1/1 (the bf16 async ones 18/66/9/4/1/6 and 7/39/2/2/0/5).
BUFFER_BOUND = {
    # the layout kernel and its three outputs; a repeat's kind by its signature (5 reads here, one C++ call on a
    # GPU host, native.key_functions) in place of its checks
    "layout": (3, 11, 3, 1, 0, 0),
    # the outputs (handle: 4, rows, ids, weights, sources) and two launches (the exchange with the handle;
    # the gather that pushes); the signature of the kind (5 reads a tensor), the launches' addresses
    "dispatch bf16": (8, 46, 8, 2, 1, 0),
    "cached bf16": (1, 26, 1, 1, 0, 0),
    "worst bf16": (8, 46, 8, 2, 0, 0),
    "combine": (2, 31, 2, 1, 0, 0),  # the outputs and one launch (push and reduce)
    "dispatch bf16 async": (8, 58, 8, 2, 1, 5),  # + the communication stream's joins and event (streams.py)
    "combine async": (2, 35, 2, 1, 0, 5),
    "dispatch fp8": (9, 53, 9, 2, 1, 0),
    "cached fp8": (2, 33, 2, 1, 0, 0),
    "worst fp8": (9, 53, 9, 2, 0, 0),
    "dispatch fp8 col-major": (10, 53, 10, 3, 1, 0),  # + the scales' contiguous copy
}
# the backend's share, by transfer (EPCOMM_HT_TRANSFER). Before, SM push: dispatch 18/30/9/4/1/1, combine
# 7/23/2/2/0/0, cached 6/24/1/2/0/0, num_worst_tokens 17/30/9/3/0/0; copy engine: dispatch 45/40/9/15/1/5,
# combine 6/18/2/6/0/4, cached 5/19/1/6/0/4, num_worst_tokens 44/40/9/14/0/4 (the rig's counts are zeros: no
# combine rows to copy). The low-latency repeats make no torch op (their launches read the tensors' addresses).
BACKEND_BOUND = {
    "sm": {"dispatch": (8, 30, 8, 2, 1, 0), "combine": (2, 18, 2, 1, 0, 0), "cached": (1, 16, 1, 1, 0, 0),
           "worst": (8, 30, 8, 2, 0, 0)},
    "ce": {"dispatch": (37, 41, 8, 13, 1, 4), "combine": (2, 18, 2, 6, 0, 4), "cached": (2, 17, 1, 6, 0, 4),
           "worst": (37, 41, 8, 13, 0, 4)},
}
LL_BOUND = {"ll dispatch repeat": (0, 4, 0, 1, 0, 0), "ll combine repeat": (0, 5, 0, 1, 0, 0)}


def test_buffer_level_host_budget(bufs, monkeypatch):
    """Every high-throughput call kind through ``Buffer``, within its bound."""
    got = buffer_calls(bufs[0], _Recorder(monkeypatch))
    _report(got, "Buffer level")
    over = _over(got, BUFFER_BOUND)
    assert not over, f"host work per call above its bound (got, bound): {over}\n{table(got)}"


@pytest.mark.parametrize("transfer", ["sm", "ce"])
def test_backend_level_host_budget(rig, monkeypatch, transfer):
    """The nvlink backend's share of the same calls, by transfer (SM push, the default; the copy engine), and
    the low-latency repeats, within their bounds."""
    be = rig.b[0]
    be.transfer = transfer
    monkeypatch.setattr(nv, "_raw_stream", lambda index: 0)
    got = backend_calls(be, _Recorder(monkeypatch))
    _report(got, f"backend level, transfer {transfer}")
    over = _over(got, dict(BACKEND_BOUND[transfer], **LL_BOUND))
    assert not over, f"host work per call above its bound (got, bound): {over}\n{table(got)}"


def test_counting_sees_each_kind_of_work(monkeypatch):
    """The classifier: a metadata read, a view, an allocation, device work and a synchronisation each land
    in their column (so a bound above cannot miss the work it is meant to catch)."""
    cpu_nvlink.cuda_stand_ins(monkeypatch.setattr)
    record = _Recorder(monkeypatch)
    x = torch.zeros(4, 4)

    def work():
        n = x.shape[0]
        v = x.view(16)
        y = torch.empty(n)
        v.add_(1)
        torch.cuda.current_stream()
        return y, x.sum().item()

    _, c = record(work)
    assert (c.meta, c.allocs, c.syncs, c.streams) == (1, 2, 1, 1), (c.row(), c.log)
    assert c.ops == 5 and c.launches == 2, (c.row(), c.log)  # view, empty, add_, sum, item; add_ and sum run
    assert collections.Counter(line.split()[0] for line in c.log)["view"] == 1


def test_a_repeat_layout_still_refuses_bad_arguments(bufs):
    """A repeat of ``get_dispatch_layout`` skips its checks only for the kind they passed for (the key holds what they
    read): after good calls, other dtypes, shapes or expert counts are still refused, by name."""
    buf, a = bufs[0], _args()
    for _ in range(2):
        buf.get_dispatch_layout(a.topk_idx, E)
    with pytest.raises(TypeError, match="topk_idx must have dtype torch.int64"):
        buf.get_dispatch_layout(a.topk_idx.to(torch.int32), E)
    with pytest.raises(ValueError, match=f"num_experts={E + 1} must be divisible"):
        buf.get_dispatch_layout(a.topk_idx, E + 1)
    with pytest.raises(ValueError, match="topk_idx must be 2-D"):
        buf.get_dispatch_layout(a.topk_idx[0], E)
    with pytest.raises(TypeError, match="num_experts must be an int"):
        buf.get_dispatch_layout(a.topk_idx, float(E))


def test_a_synchronous_call_after_an_asynchronous_one_waits_for_the_comm_stream(bufs, monkeypatch):
    """The layout, a fresh and a cached dispatch and a combine without ``previous_event`` / ``async_finish`` run on
    the current stream without ``streams.run``'s frame (``CallStreams.now``): they still make it wait for work an
    asynchronous call left on the communication stream (``CallStreams.sync``), once."""
    buf, a = bufs[0], _args()
    waits = []
    monkeypatch.setattr(cpu_nvlink.Stream, "wait_stream", lambda self, other: waits.append(other), raising=False)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(a.topk_idx, E)
    kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
              topk_idx=a.topk_idx, topk_weights=a.topk_weights)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(a.x, **kw)  # (its plan made, so the next ones are repeats)
    buf.dispatch(a.x, handle=handle)
    buf.combine(recv_x, handle, recv_w)
    for call in (lambda: buf.get_dispatch_layout(a.topk_idx, E), lambda: buf.dispatch(a.x, **kw),
                 lambda: buf.dispatch(a.x, handle=handle), lambda: buf.combine(recv_x, handle, recv_w)):
        buf._streams.comm_pending, buf._streams.last_on_current = True, False  # as after an async_finish call
        waits.clear()
        call()
        assert waits == [buf._streams.comm] and not buf._streams.comm_pending and buf._streams.last_on_current
