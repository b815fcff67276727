"""Tier 2 (gloo on CPU, 2 and 3 ranks): NeMo Automodel 0.7.0's DeepEP module, its own code, on epcomm through
``import deep_ep`` (the switch ``EPCOMM_AS_DEEP_EP=1``, installed in each rank before the import).

The module is ``nemo_automodel/components/moe/megatron/fused_a2a.py`` of the nemo-automodel 0.7.0 wheel on
PyPI, imported as ``nemo_automodel.components.moe.megatron.fused_a2a`` from the wheel's files (``releases.py``:
downloaded, sha256 checked, unpacked into the test cache; its packages import with torch alone). Nothing in
it is changed. What it adds to Megatron-Core's copy of the same functions, and what the checks cover:

- ``buffer``: ``get_buffer`` asks ``Buffer.is_sm90_compiled()`` whether DeepEP has NVSHMEM (no RDMA bytes
  without), builds ``Buffer(group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy=True)`` and reuses it;
  ``free_buffer()`` calls ``destroy()`` (the old Buffer then refuses calls) and the next ``get_buffer`` builds
  a new one; ``set_deepep_num_sms``.
- ``fused_a2a``: ``fused_dispatch`` / ``fused_combine`` forward and backward, synchronous and with
  ``async_finish=True, allocate_on_comm_stream=True``: the combined sum, the gradient of ``x`` and of the
  routing probabilities (the combine of the backward returns them).
- ``checkpoint_replay``: activation checkpointing (``torch.utils.checkpoint``, non-reentrant) with NeMo's
  ``DispatchReplayRecorder`` and ``dispatch_replay_scope``, bound for the forward and for the recompute as
  ``nemo_automodel/components/moe/parallelizer.py``'s ``_replay_deepep_dispatch_on_recompute`` binds them
  (re-enacted: that module imports ``transformers``): the recompute's dispatch is a cached dispatch
  (``buffer.dispatch(x, handle=..., previous_event=..., async_finish=..., allocate_on_comm_stream=...)``), no
  second layout; output and gradients bitwise equal to the same block without checkpointing.
"""

from __future__ import annotations

import contextlib
import sys

import harness
import pytest
import releases
import torch
from harness import check, equal

from epcomm.testing.compare import assert_within_budget

WORLD_SIZES = (2, 3)
H, K = 64, 2


def tokens(r: int) -> int:
    return 6 + 3 * r


def num_experts(r_: int) -> int:
    return 4 * r_


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def routing(r: int, r_: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``r``'s ``topk_idx int64[T, K]`` (distinct experts, some -1) and ``probs f32[T, K]``."""
    gen, t = _gen(300 + r), tokens(r)
    idx = torch.stack([torch.randperm(num_experts(r_), generator=gen)[:K] for _ in range(t)])
    idx[torch.rand(t, K, generator=gen) < 0.2] = -1
    return idx, torch.rand(t, K, generator=gen)


def dest_ranks(idx: torch.Tensor, r_: int) -> list[list[int]]:
    le = num_experts(r_) // r_
    return [sorted({int(e) // le for e in row if e >= 0}) for row in idx]


def x_of(r: int) -> torch.Tensor:
    return torch.randn(tokens(r), H, generator=_gen(400 + r)).to(torch.bfloat16)


# ----------------------------------------------------------------------------- rank side


def fused_a2a():
    """NeMo Automodel's module from its release, with ``import deep_ep`` answered by epcomm."""
    import os

    import _epcomm_as_deep_ep

    os.environ["EPCOMM_AS_DEEP_EP"] = "1"
    _epcomm_as_deep_ep.install()
    root = str(releases.release_root("nemo-automodel"))
    if root not in sys.path:
        sys.path.insert(0, root)
    import nemo_automodel.components.moe.megatron.fused_a2a as fa

    return fa


def check_buffer(ctx):
    fa = fused_a2a()
    import epcomm

    check(fa.HAVE_DEEP_EP and issubclass(fa.Buffer, epcomm.Buffer), f"fused_a2a.Buffer is {fa.Buffer!r}")
    check(not fa.HAVE_UCCL_EP, "HAVE_UCCL_EP")
    hidden_bytes = H * 2
    buf = fa.get_buffer(ctx.group, hidden_bytes)
    equal(fa._nvshmem_available, False, "Buffer.is_sm90_compiled() on CPU (NeMo's NVSHMEM probe)")
    check(isinstance(buf, epcomm.Buffer) and buf.explicitly_destroy, "get_buffer: Buffer(..., explicitly_destroy=True)")
    equal(buf.num_rdma_bytes, 0, "num_rdma_bytes without NVSHMEM")
    want_nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, ctx.world_size)
                   for c in (fa.Buffer.get_dispatch_config(ctx.world_size),
                             fa.Buffer.get_combine_config(ctx.world_size)))
    equal(buf.num_nvl_bytes, want_nvl, "num_nvl_bytes from the config hints")
    check(fa.get_buffer(ctx.group, hidden_bytes) is buf, "get_buffer reuses its Buffer")
    fa.free_buffer()
    check(fa._buffer is None and buf._destroyed, "free_buffer() destroyed the Buffer")
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.get_dispatch_layout(routing(ctx.rank, ctx.world_size)[0], num_experts(ctx.world_size))
    check(fa.get_buffer(ctx.group, hidden_bytes) is not buf, "a new Buffer after free_buffer()")
    fa.set_deepep_num_sms(24)
    equal(epcomm.Buffer.num_sms, 24, "Buffer.num_sms after set_deepep_num_sms(24)")
    fa.set_deepep_num_sms(20)


def check_fused_a2a(ctx):
    fa = fused_a2a()
    r_, me, group = ctx.world_size, ctx.rank, ctx.group
    e_ = num_experts(r_)
    for async_finish in (False, True):
        what = f"async_finish={async_finish}"
        x = x_of(me).requires_grad_()
        idx, probs = routing(me, r_)
        probs.requires_grad_()
        recv_x, recv_idx, recv_probs, per_expert, handle = fa.fused_dispatch(
            x, idx, probs, e_, group, async_finish=async_finish, allocate_on_comm_stream=async_finish)
        equal(int(per_expert.sum()), int((recv_idx >= 0).sum()), f"{what}: tokens_per_expert")
        combined, _ = fa.fused_combine(recv_x * (2.0**me), group, handle, async_finish=async_finish,
                                       allocate_on_comm_stream=async_finish)
        dests = dest_ranks(idx, r_)
        scale = torch.tensor([[sum(2.0**d for d in ds)] for ds in dests], dtype=torch.float64)
        x64 = x.detach().double()
        assert_within_budget(combined, x64 * scale, x64.abs() * scale, r_, f"{what}: fused_combine")
        # loss = <combined, g> + <recv_probs, gp>, gp[row, k] = 2**-(receiving rank + 1) * (k + 1)
        g = torch.randn(tokens(me), H, generator=_gen(500 + me)).to(torch.bfloat16)
        gp = (2.0 ** -(me + 1)) * torch.arange(1, K + 1, dtype=torch.float32).expand(recv_probs.shape[0], K)
        ((combined.float() * g.float()).sum() + (recv_probs * gp).sum()).backward()
        g64 = g.double()
        assert_within_budget(x.grad, g64 * scale, g64.abs() * scale, r_, f"{what}: gradient of x")
        exp_gp = torch.tensor([[sum(2.0 ** -(d + 1) * (k + 1) for d in ds) for k in range(K)] for ds in dests],
                              dtype=torch.float32).reshape(-1, K)
        equal(probs.grad, exp_gp, f"{what}: gradient of the probabilities (the backward combine's top-k weights)")


class _LayoutCount:
    """Counts ``get_dispatch_layout`` calls on the class NeMo's Buffer is (a dispatch that computes a layout
    calls it; a replayed one does not)."""

    def __init__(self, cls):
        self.cls, self.calls, self.orig = cls, 0, cls.get_dispatch_layout

    def __enter__(self):
        orig = self.orig

        def counted(buf, *a, **kw):
            self.calls += 1
            return orig(buf, *a, **kw)

        self.cls.get_dispatch_layout = counted
        return self

    def __exit__(self, *exc):
        self.cls.get_dispatch_layout = self.orig


def check_checkpoint_replay(ctx):
    from torch.utils.checkpoint import checkpoint

    fa = fused_a2a()
    r_, me, group = ctx.world_size, ctx.rank, ctx.group
    e_ = num_experts(r_)
    w = torch.linspace(0.5, 1.5, H).to(torch.bfloat16).requires_grad_()
    idx, probs = routing(me, r_)

    def block(x, p):  # dispatch, an expert that scales by w and its probability, combine
        recv_x, _, recv_p, _, handle = fa.fused_dispatch(x, idx, p, e_, group, async_finish=True,
                                                                allocate_on_comm_stream=True)
        y = recv_x * w * recv_p.sum(1, keepdim=True).to(torch.bfloat16)
        return fa.fused_combine(y, group, handle, async_finish=True, allocate_on_comm_stream=True)[0]

    recorders = []

    def context_fn():  # parallelizer.py's _replay_deepep_dispatch_on_recompute around the default contexts
        recorder = fa.DispatchReplayRecorder()
        recorders.append(recorder)

        @contextlib.contextmanager
        def scoped(mode):
            if mode == "replay":
                recorder.rewind()
            with fa.dispatch_replay_scope(recorder, mode):
                yield

        return scoped("record"), scoped("replay")

    g = torch.randn(tokens(me), H, generator=_gen(600 + me)).to(torch.bfloat16)
    results = []
    for ckpt in (False, True):
        x = x_of(me).requires_grad_()
        p = probs.clone().requires_grad_()
        w.grad = None
        with _LayoutCount(fa.Buffer) as layouts:
            out = checkpoint(block, x, p, use_reentrant=False, context_fn=context_fn) if ckpt else block(x, p)
            (out.float() * g.float()).sum().backward()
        equal(layouts.calls, 1, f"checkpoint={ckpt}: layouts computed (the recompute replays the forward's)")
        results.append((out.detach(), x.grad, p.grad, w.grad.clone()))
    equal(len(recorders), 1, "one recorder for the checkpointed call")
    equal((len(recorders[0]._records), recorders[0]._cursor, recorders[0].replay_misses), (1, 1, 0),
          "the recorder: one dispatch recorded, replayed once, no miss")
    for name, a, b in zip(("output", "grad x", "grad probs", "grad w"), results[0], results[1]):
        equal(b, a, f"checkpointed block with replay against the plain block: {name}")


CHECKS = [("buffer", check_buffer), ("fused_a2a", check_fused_a2a), ("checkpoint_replay", check_checkpoint_replay)]


def _rank(ctx):
    return harness.run_checks(ctx, CHECKS)


@pytest.fixture(scope="module", autouse=True)
def _release():
    releases.release_root("nemo-automodel")  # download once, before the ranks look for it


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", [n for n, _ in CHECKS])
def test_nemo_automodel(world_size, name):
    if harness.TRANSPORT != "gloo":
        pytest.skip("the checks build their tensors on the CPU: gloo only")
    harness.report(harness.launch_cached(_rank, world_size), name)
