"""Tier 2 (gloo on CPU, 2 and 3 ranks): lmdeploy 0.18.0's DeepEP dispatchers, its own code, on epcomm through
``import deep_ep`` (the switch ``EPCOMM_AS_DEEP_EP=1``, installed in each rank before the import).

The module is ``lmdeploy/pytorch/backends/cuda/token_dispatcher.py`` of the lmdeploy 0.18.0 wheel on PyPI
(``releases.py``: downloaded, sha256 checked, its Python files unpacked into the test cache), imported under
its own name with the modules it imports (``lmdeploy.pytorch.envs``, ``..token_dispatcher``,
``..default.token_dispatcher``: torch and ``os`` only). Its packages are made as bare packages pointing at the
release's directories, without running their ``__init__`` files: ``lmdeploy/__init__.py`` starts the serving
API (tqdm, transformers, ...) and ``backends/{,cuda/,default/}__init__.py`` import the op backends. The
module's own code runs unchanged, ``Buffer.set_num_sms(DEEPEP_BUFFER_NUM_SMS)`` at its import included.

- ``buffer``: ``DeepEPBuffer.set_explicitly_destroy()``, then one process-wide Buffer for both modes,
  ``Buffer(group, num_nvl_bytes=, num_rdma_bytes=, low_latency_mode=True, num_qps_per_rank=max(E/R, SMs),
  allow_mnnvl=, explicitly_destroy=True)`` sized from the config hints and the low-latency hint, and
  ``set_num_sms`` on the instance.
- ``dispatcher``: ``DeepEPTokenDispatcher`` (what ``TokenDispatcherBuilder.build`` gives): layout, dispatch
  with float32 weights, lmdeploy's permutation by local expert, experts that scale their rows by a power of
  two, the weighted unpermutation and the combine; against float64 within a bf16 budget.
- ``normal``: ``DeepEPTokenDispatcherNormal`` (``expert_alignment=128``), its synchronous calls and the
  ``*_async`` ones (``num_experts=`` by keyword, ``async_finish=True``, ``event.current_stream_wait()``).
- ``low_latency``: ``DeepEPBuffer.set_deepep_mode`` from normal to low latency (``clean_low_latency_buffer``),
  ``DeepEPTokenDispatcherLowLatency`` with its FP8 dispatch (``use_fp8=True``) and ``DisposibleTensor``
  outputs, the receive hook or the event, ``expected_m``, the combine; then ``dispatch_async`` with
  ``num_experts=`` by keyword and ``combine_async``; then ``DeepEPBuffer.destroy()``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys

import harness
import pytest
import releases
import torch
from harness import check, equal, within_bf16_path

from epcomm.quant import per_token_cast_back, per_token_cast_to_fp8

WORLD_SIZES = (2, 3)
H, K, M = 256, 3, 16  # hidden, top-k, low-latency max tokens per rank


def tokens(r: int) -> int:
    return 7 + 3 * r


def num_experts(r_: int) -> int:
    return 4 * r_


def factor(e: int) -> float:
    return 2.0 ** (e % 3 - 1)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def inputs(r: int, r_: int):
    """Rank ``r``'s ``x bf16[T, H]``, ``topk_idx int64[T, K]`` (distinct; some -1) and bf16 weights."""
    gen, t = _gen(20 + r), tokens(r)
    x = torch.randn(t, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(num_experts(r_), generator=gen)[:K] for _ in range(t)])
    idx[torch.rand(t, K, generator=gen) < 0.15] = -1
    w = (torch.rand(t, K, generator=gen) * 0.75 + 0.25).to(torch.bfloat16)
    return x, idx, w


def reference(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor):
    """``sum_k w[t, k] * factor(e_k) * x[t]`` in float64, and its magnitude."""
    f = torch.tensor([[factor(int(e)) if e >= 0 else 0.0 for e in row] for row in idx], dtype=torch.float64)
    s = w.double() * f
    x64 = x.double()
    return x64 * s.sum(1, keepdim=True), x64.abs() * s.abs().sum(1, keepdim=True)




# ----------------------------------------------------------------------------- rank side


def token_dispatcher():
    """lmdeploy's module from its release (module docstring), ``import deep_ep`` answered by epcomm."""
    name = "lmdeploy.pytorch.backends.cuda.token_dispatcher"
    if name in sys.modules:
        return sys.modules[name]
    import os

    import _epcomm_as_deep_ep

    os.environ["EPCOMM_AS_DEEP_EP"] = "1"
    _epcomm_as_deep_ep.install()
    root = releases.release_root("lmdeploy")
    for pkg in ("lmdeploy", "lmdeploy.pytorch", "lmdeploy.pytorch.backends", "lmdeploy.pytorch.backends.cuda",
                "lmdeploy.pytorch.backends.default"):
        spec = importlib.machinery.ModuleSpec(pkg, None, is_package=True)
        spec.submodule_search_locations = [str(root.joinpath(*pkg.split(".")))]
        sys.modules[pkg] = importlib.util.module_from_spec(spec)
    return importlib.import_module(name)


def _fresh_state(td) -> None:
    """The class-level state of ``DeepEPBuffer`` as at import (each check builds its own Buffer)."""
    b = td.DeepEPBuffer
    if b._buffer_common is not None and b._explicitly_destroy:
        b.destroy()
    b._buffer_common = b._buffer_normal = b._buffer_low_latency = None
    b._latest_mode = td.DeepEPMode.AUTO


def check_buffer(ctx):
    td = token_dispatcher()
    import epcomm

    r_ = ctx.world_size
    e_ = num_experts(r_)
    check(td.use_deepep and issubclass(td.Buffer, epcomm.Buffer), f"token_dispatcher.Buffer is {td.Buffer!r}")
    equal(epcomm.Buffer.num_sms, 20, "Buffer.num_sms after the import's set_num_sms(DEEPEP_BUFFER_NUM_SMS)")
    _fresh_state(td)
    check(td.DeepEPBuffer.set_explicitly_destroy(), "set_explicitly_destroy() before any Buffer")
    buf = td.get_buffer_common(ctx.group, M, H, e_, H * 2)
    check(isinstance(buf, epcomm.Buffer) and buf.low_latency_mode and buf.explicitly_destroy and buf.allow_mnnvl,
          "the common Buffer: low_latency_mode, explicitly_destroy, allow_mnnvl")
    equal(buf.num_qps_per_rank, max(e_ // r_, 20), "num_qps_per_rank = max(E / R, SMs)")
    check(buf.num_rdma_bytes >= td.Buffer.get_low_latency_rdma_size_hint(M, H, r_, e_), "num_rdma_bytes")
    check(td.get_buffer_common(ctx.group, M, H, e_, H * 2) is buf, "one Buffer for the process")
    check(td.DeepEPBuffer.destroy() and buf._destroyed, "DeepEPBuffer.destroy()")


def _experts_by_row(rows: torch.Tensor, per_expert: list[int], first: int) -> torch.Tensor:
    f = torch.tensor([factor(first + e) for e in range(len(per_expert))], dtype=torch.float32)
    scale = f.repeat_interleave(torch.tensor(per_expert))
    return (rows.float() * scale.unsqueeze(1)).to(torch.bfloat16)


def check_dispatcher(ctx):
    td = token_dispatcher()
    r_, me = ctx.world_size, ctx.rank
    e_, le = num_experts(r_), num_experts(r_) // r_
    _fresh_state(td)
    d = td.TokenDispatcherBuilder.build(ctx.group, e_, le, H, torch.bfloat16)
    check(isinstance(d, td.DeepEPTokenDispatcher), f"the builder gave {type(d).__name__}")
    x, idx, w = inputs(me, r_)
    permuted, _, _, per_expert = d.dispatch(x, idx, w)
    per_expert = per_expert.tolist()
    equal(permuted.shape[0], sum(per_expert), "permuted rows = the received tokens per expert")
    out = d.combine(_experts_by_row(permuted, per_expert, me * le))
    ref, mag = reference(x, idx, w)
    # the weight product in bf16, a token's local experts summed in bf16 (up to K-1), the combine
    within_bf16_path(out, ref, mag, K + 2, "DeepEPTokenDispatcher: dispatch, permute, experts, unpermute, combine")
    check(d.release(), "release()")


def _local_sum(recv_x, recv_idx, recv_w, first: int) -> torch.Tensor:
    """A received token's output: its local experts' ``w * factor * x`` summed in float32, rounded once."""
    acc = torch.zeros(recv_x.shape[0], H)
    for k in range(recv_idx.shape[1]):
        f = torch.tensor([factor(first + int(e)) if e >= 0 else 0.0 for e in recv_idx[:, k]])
        acc += recv_x.float() * (recv_w[:, k].float() * f).unsqueeze(1)
    return acc.to(torch.bfloat16)


def check_normal(ctx):
    td = token_dispatcher()
    r_, me = ctx.world_size, ctx.rank
    e_, le = num_experts(r_), num_experts(r_) // r_
    _fresh_state(td)
    d = td.DeepEPTokenDispatcherNormal(ctx.group, e_, le, H, torch.bfloat16, num_max_dispatch_tokens_per_rank=M)
    x, idx, w = inputs(me, r_)
    ref, mag = reference(x, idx, w)
    recv_x, recv_idx, recv_w, per_expert = d.dispatch(x, idx, w)
    check(all(c % 128 == 0 for c in per_expert), f"expert_alignment=128: {per_expert}")
    out = d.combine(_local_sum(recv_x, recv_idx, recv_w, me * le))
    within_bf16_path(out, ref, mag, 2, "DeepEPTokenDispatcherNormal: dispatch, experts, combine")
    recv_x, recv_idx, recv_w, _, handle, event = d.dispatch_normal_async(x, idx, w.float(), num_experts=e_)
    event.current_stream_wait()
    out, event = d.combine_normal_async(_local_sum(recv_x, recv_idx, recv_w, me * le), handle)
    event.current_stream_wait()
    within_bf16_path(out, ref, mag, 2, "DeepEPTokenDispatcherNormal: dispatch_normal_async, combine_normal_async")


def _ll_expert(packed, masked_m: torch.Tensor, first: int) -> torch.Tensor:
    """Expert outputs ``bf16[L, R*M, H]`` from the FP8 dispatch: each slot's row, dequantised, times its factor."""
    q, scales = (t.value if hasattr(t, "value") else t for t in packed)
    x = q.float() * scales.repeat_interleave(128, dim=-1)
    f = torch.tensor([factor(first + e) for e in range(q.shape[0])])
    valid = torch.arange(q.shape[1]).unsqueeze(0) < masked_m.unsqueeze(1)
    return torch.where(valid.unsqueeze(-1), x * f.view(-1, 1, 1), 0.0).to(torch.bfloat16)


def check_low_latency(ctx):
    td = token_dispatcher()
    r_, me = ctx.world_size, ctx.rank
    e_, le = num_experts(r_), num_experts(r_) // r_
    _fresh_state(td)
    td.DeepEPBuffer.set_explicitly_destroy()
    normal = td.DeepEPTokenDispatcherNormal(ctx.group, e_, le, H, torch.bfloat16, num_max_dispatch_tokens_per_rank=M)
    x, idx, w = inputs(me, r_)
    recv_x, recv_idx, recv_w, _ = normal.dispatch(x, idx, w)
    normal.combine(_local_sum(recv_x, recv_idx, recv_w, me * le))
    td.DeepEPBuffer._deepep_mode = td.DeepEPMode.AUTO  # DEEPEP_MODE unset
    td.DeepEPBuffer.set_deepep_mode(td.DeepEPMode.NORMAL)
    equal(td.DeepEPBuffer.set_deepep_mode(td.DeepEPMode.LOW_LATENCY), (td.DeepEPMode.LOW_LATENCY, True),
          "set_deepep_mode: normal -> low latency cleans the low-latency buffer")
    # the sender's FP8 rows, cast back: what the experts receive
    xq = per_token_cast_back(*per_token_cast_to_fp8(x, False), torch.float32)
    ref, mag = reference(xq, idx, w.float())
    for hook in (True, False):
        d = td.DeepEPTokenDispatcherLowLatency(ctx.group, e_, le, H, torch.bfloat16, num_max_dispatch_tokens_per_rank=M,
                                               return_recv_hook=hook)
        check(d.get_buffer() is normal.get_buffer(), "one Buffer for both modes")
        packed, _, _, masked_m, expected_m = d.dispatch(x, idx, w.float(), e_)
        equal(expected_m, (x.shape[0] * r_ * K + e_) // e_, "expected_m")
        check(all(isinstance(t, td.DisposibleTensor) for t in packed), "DisposibleTensor outputs")
        out = d.combine(_ll_expert(packed, masked_m, me * le), idx, w)
        within_bf16_path(out, ref, mag, K + 1, f"DeepEPTokenDispatcherLowLatency (hook={hook}): FP8 dispatch, combine")
    packed, masked_m, handle, event, hook = d.dispatch_async(x, idx, num_experts=e_, use_fp8=True, async_finish=True)
    event.current_stream_wait()
    out, event, _ = d.combine_async(_ll_expert(packed, masked_m, me * le), idx, w.float(), handle, async_finish=True)
    event.current_stream_wait()
    within_bf16_path(out, ref, mag, K + 1, "dispatch_async(num_experts=...) and combine_async")
    buf = d.get_buffer()
    check(td.DeepEPBuffer.destroy() and buf._destroyed, "DeepEPBuffer.destroy() of the common Buffer")


CHECKS = [("buffer", check_buffer), ("dispatcher", check_dispatcher), ("normal", check_normal),
          ("low_latency", check_low_latency)]


def _rank(ctx):
    return harness.run_checks(ctx, CHECKS)


@pytest.fixture(scope="module", autouse=True)
def _release():
    releases.release_root("lmdeploy")  # download once, before the ranks look for it


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", [n for n, _ in CHECKS])
def test_lmdeploy(world_size, name):
    if harness.TRANSPORT != "gloo":
        pytest.skip("the checks build their tensors on the CPU: gloo only")
    harness.report(harness.launch_cached(_rank, world_size), name)
