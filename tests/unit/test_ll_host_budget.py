"""Tier 1: the host path of a repeat low-latency call (a kind of call seen before), at the level a user sees
(``Buffer.low_latency_dispatch`` / ``low_latency_combine``), on the CPU rig of ``epcomm.bench.hostprobe``:
the nvlink backend at world 1, its kernels bound as on a GPU host, Triton's C launcher a recorder.

- The budget: per repeat call kind, the torch calls at the Python level (``fn``; on a repeat they are all
  metadata reads: shape, dtype, device, address, contiguity), aten operators, allocations and launches,
  each bounded at today's count: one more torch call in a repeat fails here, on purpose.
- The launches: a repeat hands the C launcher exactly what the binding launch of its kind did, with the
  new call's tensors' addresses in their places (the repeat writes only those: ``ll_calls.launch_cell``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("triton")

from epcomm.backends import nvlink_ll
from epcomm.bench import hostprobe

M, H, K, E = 8, 256, 4, 16
FIELDS = ("fn", "meta", "aten", "allocs", "launches")

# (fn, meta, aten, allocs, launches) per repeat call, one kernel per operation (the default). All of fn are
# metadata reads: the Buffer's key reads shape, dtype, device, address and contiguity of each tensor argument
# (x and topk_idx; combine: x unless zero_copy, topk_idx, topk_weights; 5 more for each of out= and the
# statistics), and the launch reads each per-call tensor's address once (ll_calls.launch_cell: x and topk;
# combine: topk, weights, y, and out / the statistics where given). Before launch_cell (928ee47, counted the
# same way): dispatch 14, combine 20, the hook's receives 4 and 5 (the placeholders' addresses at every call).
BOUND = {
    "dispatch fp8": (12, 12, 0, 0, 1),
    "dispatch bf16": (12, 12, 0, 0, 1),
    "dispatch fp8 stats": (24, 24, 0, 0, 1),  # cumulative_local_expert_recv_stats and the wait statistics given
    "dispatch fp8 hook": (12, 12, 0, 0, 1),  # the send; the hook is its own row
    "dispatch hook()": (2, 2, 0, 0, 1),  # (x and topk are holes of the receive roles too)
    "combine": (18, 18, 0, 0, 1),
    "combine out": (24, 24, 0, 0, 1),
    "combine stats": (24, 24, 0, 0, 1),
    "combine zero_copy": (13, 13, 0, 0, 1),
    "combine hook": (18, 18, 0, 0, 1),
    "combine hook()": (3, 3, 0, 0, 1),
}
# TUNE ll.fused_dispatch off: a receive launch more per dispatch
SPLIT = dict(BOUND, **{
    "dispatch fp8": (12, 12, 0, 0, 2), "dispatch bf16": (12, 12, 0, 0, 2), "dispatch fp8 stats": (24, 24, 0, 0, 2),
    "dispatch hook()": (0, 0, 0, 0, 1)})


@pytest.fixture
def buf(monkeypatch):
    """A world-1 Buffer on the host probe's rig (gloo, the nvlink backend, recorded launches)."""
    if dist.is_initialized():
        pytest.skip("a process group from another test is still up")
    hostprobe.install(monkeypatch.setattr, monkeypatch.setitem)
    b = hostprobe.cpu_buffer(M, H, E, monkeypatch.setattr)
    yield b
    dist.destroy_process_group()


def _inputs(t: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(t, H, generator=g).to(torch.bfloat16),
                topk=torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]),
                w=torch.rand(t, K, generator=g), y=torch.randn(E, M, H, generator=g).to(torch.bfloat16),
                out=torch.empty(t, H, dtype=torch.bfloat16), cum=torch.zeros(E, dtype=torch.int32),
                wst=torch.zeros(1, dtype=torch.int64))


def _kinds(buf, v: dict) -> dict:
    """``kind -> (prep, call)`` over the inputs ``v`` (a combine's prep: the dispatch it combines)."""
    st: dict = {}

    def d(**kw):
        def go():
            out = buf.low_latency_dispatch(v["x"], v["topk"], M, E, **kw)
            st["h"], st["hook"] = out[2], out[4]
            return out
        return go

    def c(**kw):
        def go():
            out = buf.low_latency_combine(v["y"], v["topk"], v["w"], st["h"], **kw)
            st["hook"] = out[2]
            return out
        return go

    plain = d()
    return {
        "dispatch fp8": (None, plain),
        "dispatch bf16": (None, d(use_fp8=False)),
        "dispatch fp8 stats": (None, d(cumulative_local_expert_recv_stats=v["cum"],
                                       dispatch_wait_recv_cost_stats=v["wst"])),
        "dispatch fp8 hook": (None, d(return_recv_hook=True)),
        "dispatch hook()": (d(return_recv_hook=True), lambda: st["hook"]()),
        "combine": (plain, c()),
        "combine out": (plain, c(out=v["out"])),
        "combine stats": (plain, c(combine_wait_recv_cost_stats=v["wst"])),
        "combine zero_copy": (plain, c(zero_copy=True)),
        "combine hook": (plain, c(return_recv_hook=True)),
        "combine hook()": (lambda: (plain(), c(return_recv_hook=True)()), lambda: st["hook"]()),
    }


def _seen(kinds: dict) -> None:
    """Every kind run at both phases of the parity alternation, twice (its checks, then its binding)."""
    for prep, call in kinds.values():
        for i in range(5):
            if i == 2:
                kinds["dispatch fp8"][1]()  # shift the phase by one call
            if prep is not None:
                prep()
            call()


@pytest.mark.parametrize("fused", [True, False], ids=["one-kernel", "split-kernels"])
def test_ll_repeat_host_budget(buf, monkeypatch, fused):
    """Each repeat call kind, within its bound (the split dispatch kernels: the same torch calls, more
    launches)."""
    monkeypatch.setitem(nvlink_ll.TUNE, "fused_dispatch", fused)
    kinds = _kinds(buf, _inputs(M, 0))
    _seen(kinds)
    got, logs = {}, {}
    for name, (prep, call) in kinds.items():
        c = hostprobe.count_call(prep, call)
        got[name], logs[name] = tuple(c[f] for f in FIELDS), c["names"]
    over = {k: (got[k], b) for k, b in (BOUND if fused else SPLIT).items() if any(g > m for g, m in zip(got[k], b))}
    assert not over, "host work per repeat call above its bound (got, bound) " + \
        f"{FIELDS}: {over}\n" + "\n".join(f"{k}: {logs[k]}" for k in over)


@pytest.mark.parametrize("fused", [True, False], ids=["one-kernel", "split-kernels"])
def test_a_repeat_launches_what_its_binding_launch_did(buf, monkeypatch, fused):
    """Per kind, on a fresh Buffer (so that its first call binds every launch it makes): the arguments of
    each launch of a repeat with new tensors are those of the binding launch, the old tensors' addresses
    replaced by the new ones' and nothing else changed."""
    monkeypatch.setitem(nvlink_ll.TUNE, "fused_dispatch", fused)
    rec: list = []

    def pairs(args):
        return [(a.data_ptr(), a) if isinstance(a, torch.Tensor) else (a, None) for a in args]

    def bind_run(self, *args, grid, warmup, **kw):  # the binding launch, its arguments as given
        rec.append(pairs(args))
        return self.kernel

    monkeypatch.setattr(hostprobe._Kernel, "run", bind_run)
    monkeypatch.setattr(hostprobe._NoLaunch, "launch", staticmethod(lambda *a: rec.append(pairs(a[13:]))))
    old, new = _inputs(M, 1), _inputs(M, 2)
    swap = {id(old[k]): new[k].data_ptr() for k in old}
    for name in BOUND:
        b = hostprobe.cpu_buffer(M, H, E, monkeypatch.setattr)
        got = []
        for kinds in (_kinds(b, old), _kinds(b, new)):  # the first of its kind, then a repeat (same parity)
            b._ll_calls = 0
            prep, call = kinds[name]
            if prep is not None:
                prep()
            rec.clear()
            call()
            got.append(rec[:])
        bound, repeat = got
        assert all(t is None for launch in repeat for _, t in launch), f"{name}: the repeat was not bound"
        want = [[swap.get(id(t), v) if t is not None else v for v, t in launch] for launch in bound]
        moved = sum(id(t) in swap for launch in bound for _, t in launch)
        assert moved or (name, fused) == ("dispatch hook()", False), f"{name}: no per-call tensor launched"
        assert [[v for v, _ in launch[:len(w)]] for launch, w in zip(repeat, want)] == want and len(repeat) == len(want), \
            f"{name}: the repeat's launch arguments differ from its binding launch's"
