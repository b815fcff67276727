"""Tier 2 (gloo on CPU, 2 and 3 ranks): torchtitan 0.3.0's DeepEP V2 module, its own code, on epcomm through
``import deep_ep`` (the switch ``EPCOMM_AS_DEEP_EP=1``, installed in each rank before the import).

The module is ``torchtitan/distributed/deepep/deepep.py`` of the torchtitan 0.3.0 wheel on PyPI, loaded from
that file (``releases.py``: downloaded, sha256 checked, unpacked into the test cache). Its package's
``__init__`` is not run (it imports ``spmd_types``, which a DeepEP test does not need); the module itself
imports only torch and ``deep_ep``. One thing is added, nothing changed: its two custom ops
(``deepep::dispatch``, ``deepep::combine``) have implementations for CUDA only, and the test registers the
same Python functions for CPU (``torch.library.impl(module._lib, op, "CPU")``).

What runs, all of it torchtitan's: ``get_buffer`` (``ElasticBuffer.get_buffer_size_hint`` and the buffer with
``deterministic`` and ``explicitly_destroy=True``), ``dispatch_tokens`` / ``combine_tokens`` /
``sync_combine`` through the custom ops and their autograd functions.

- ``training``: grad on, so the compact layout with a CPU sync; tokens permuted by local expert from
  ``handle.num_recv_tokens_per_expert_list``; each expert multiplies its rows by a power of two; scores
  applied before the combine; then backward: the combine's backward is a cached dispatch
  (``num_sms=handle.num_sms``, ``do_cpu_sync=False``) and the dispatch's is a combine that carries the
  top-k weight gradients back. Output and the gradients of ``x`` and of the scores against float64 within
  a bf16 budget; zero-score picks masked to -1 (their gradient 0); the handle cache empty at the end.
- ``inference``: under ``no_grad`` with ``cudagraphable=True``: the expanded layout without a sync, per-expert
  counts from ``psum_num_recv_tokens_per_expert`` on the device; bitwise equal to the training forward.
"""

from __future__ import annotations

import importlib.util

import harness
import pytest
import releases
import torch
from harness import check, equal, within_bf16_path

WORLD_SIZES = (2, 3)
H, K = 128, 3


def tokens(r: int) -> int:
    return 5 + 3 * r


def num_experts(r_: int) -> int:
    return 4 * r_


def factor(e: int) -> float:
    """Expert ``e`` multiplies its rows by this power of two (exact in bf16)."""
    return 2.0 ** (e % 3 - 1)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def inputs(r: int, r_: int):
    """Rank ``r``'s ``x bf16[T, H]``, expert ids ``int64[T, K]`` (distinct), scores ``f32[T, K]`` (some 0: a
    pick torchtitan masks to -1; token 0 has every score 0) and the output gradient ``g bf16[T, H]``."""
    t, e_ = tokens(r), num_experts(r_)
    gen = _gen(10 + r)
    x = torch.randn(t, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e_, generator=gen)[:K] for _ in range(t)])
    scores = torch.rand(t, K, generator=gen) * 0.75 + 0.25
    scores[torch.rand(t, K, generator=gen) < 0.2] = 0.0
    scores[0] = 0.0
    g = torch.randn(t, H, generator=gen).to(torch.bfloat16)
    return x, idx, scores, g


def reference(r: int, r_: int) -> dict:
    """float64 output, input and score gradients of ``loss = <out, g>``, each with the magnitude that bounds
    its bf16 rounding (``_budget``)."""
    x, idx, scores, g = inputs(r, r_)
    f = torch.tensor([[factor(int(e)) for e in row] for row in idx], dtype=torch.float64)
    s = scores.double() * f  # zero where the score is 0
    x64, g64 = x.double(), g.double()
    xg = (x64 * g64).sum(1, keepdim=True)
    return {
        "out": x64 * s.sum(1, keepdim=True),
        "out_mag": x64.abs() * s.abs().sum(1, keepdim=True),
        "gx": g64 * s.sum(1, keepdim=True),
        "gx_mag": g64.abs() * s.abs().sum(1, keepdim=True),
        "gs": torch.where(scores > 0, f * xg, 0.0),
        "gs_mag": torch.where(scores > 0, f * (x64.abs() * g64.abs()).sum(1, keepdim=True), 0.0),
    }




# ----------------------------------------------------------------------------- rank side

_MODULE = {}


def torchtitan_deepep():
    """torchtitan's module, loaded once per rank from its release, its ops registered for CPU too."""
    if "m" not in _MODULE:
        import os

        import _epcomm_as_deep_ep

        os.environ["EPCOMM_AS_DEEP_EP"] = "1"
        _epcomm_as_deep_ep.install()
        path = releases.release_root("torchtitan") / "torchtitan" / "distributed" / "deepep" / "deepep.py"
        spec = importlib.util.spec_from_file_location("torchtitan_deepep", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for op, fn in (("dispatch", mod._dispatch_op_impl), ("combine", mod._combine_op_impl)):
            torch.library.impl(mod._lib, op, "CPU")(fn)
        _MODULE["m"] = mod
    return _MODULE["m"]


def _experts(routed: torch.Tensor, per_expert: torch.Tensor, first: int) -> torch.Tensor:
    """Rows grouped by local expert (``per_expert`` rows each, then unused rows) times the expert's factor."""
    n = int(per_expert.sum())
    f = torch.tensor([factor(first + e) for e in range(per_expert.numel())], dtype=torch.float32)
    scale = torch.cat([f.repeat_interleave(per_expert.long().cpu()), torch.zeros(routed.shape[0] - n)])
    return (routed.float() * scale.unsqueeze(1)).to(torch.bfloat16)


def _run(ctx, mod, cudagraphable: bool, grad: bool):
    import epcomm

    r_, me = ctx.world_size, ctx.rank
    e_, le = num_experts(r_), num_experts(r_) // r_
    m = max(tokens(r) for r in range(r_))
    buf = mod.get_buffer(ctx.group, hidden=H, num_max_tokens_per_rank=m, num_topk=K)
    check(isinstance(buf, epcomm.ElasticBuffer) and mod._buffer is buf, f"get_buffer gave {buf!r}")
    check(mod.get_buffer(ctx.group, hidden=H, num_max_tokens_per_rank=m, num_topk=K) is buf, "buffer reused")
    x, idx, scores, g = inputs(me, r_)
    x, scores = x.clone().requires_grad_(grad), scores.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        routed, per_expert, state = mod.dispatch_tokens(x, idx, scores, le, e_, num_tokens_per_rank=m,
                                                        cudagraphable=cudagraphable)
        check(state.cudagraphable == (cudagraphable and not grad), f"layout: cudagraphable={state.cudagraphable}")
        equal(tuple(per_expert.shape), (le,), "tokens per expert")
        out = mod.combine_tokens(_experts(routed, per_expert, me * le), state)
        mod.sync_combine()
    return x, scores, g, out, per_expert


def check_training(ctx):
    mod = torchtitan_deepep()
    me, r_ = ctx.rank, ctx.world_size
    x, scores, g, out, per_expert = _run(ctx, mod, cudagraphable=False, grad=True)
    ref = reference(me, r_)
    # the receiving rank's rows: each source token once per local expert it picked with a score
    le = num_experts(r_) // r_
    want = torch.zeros(le, dtype=torch.int64)
    for s in range(r_):
        _, ids, sc, _ = inputs(s, r_)
        for e in ids[(sc > 0) & (ids // le == me)].tolist():
            want[e % le] += 1
    equal(per_expert.long(), want, "tokens per local expert (from num_recv_tokens_per_expert_list)")
    # rounding: the score product, up to K-1 bf16 adds of a token's local experts, the combine's rounding
    within_bf16_path(out, ref["out"], ref["out_mag"], K + 2, "training forward")
    (out.float() * g.float()).sum().backward()
    within_bf16_path(x.grad, ref["gx"], ref["gx_mag"], K + 2, "gradient of x")
    within_bf16_path(scores.grad, ref["gs"], ref["gs_mag"], 3, "gradient of the scores (combine's top-k weights)")
    equal(mod._handle_cache, {}, "torchtitan's handle cache after backward")
    _TRAINING_OUT["out"] = out.detach()


_TRAINING_OUT = {}


def check_inference(ctx):
    mod = torchtitan_deepep()
    me, r_ = ctx.rank, ctx.world_size
    _, _, _, out, _ = _run(ctx, mod, cudagraphable=True, grad=False)
    ref = reference(me, r_)
    within_bf16_path(out, ref["out"], ref["out_mag"], K + 2, "inference forward")
    check("out" in _TRAINING_OUT, "the training check ran first in this rank")
    equal(out, _TRAINING_OUT["out"], "inference forward (expanded, no sync) against the training forward")
    equal(mod._handle_cache, {}, "torchtitan's handle cache after an inference combine")


CHECKS = [("training", check_training), ("inference", check_inference)]


def _rank(ctx):
    return harness.run_checks(ctx, CHECKS)


@pytest.fixture(scope="module", autouse=True)
def _release():
    releases.release_root("torchtitan")  # download once, before the ranks look for it


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", [n for n, _ in CHECKS])
def test_torchtitan(world_size, name):
    if harness.TRANSPORT != "gloo":
        pytest.skip("torchtitan's module on CPU ranks: gloo only (its CUDA ops need no registering there)")
    harness.report(harness.launch_cached(_rank, world_size), name)
