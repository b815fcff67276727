"""Tier 2 (gloo on CPU, rank processes): Megatron-Core's own DeepEP code path, unmodified, on
epcomm through the switch ``EPCOMM_AS_DEEP_EP=1`` (docs/clients.md).

Megatron-Core (pinned in the ``test`` extra: 0.16.1 on Python 3.11, the newest release, 0.19.2, on 3.12, which
it requires; ``test_clients_py312.py`` runs this file there) imports ``deep_ep`` at import time; the ranks start
from an interpreter started with the switch in its environment, so the ``.pth`` hook installed with epcomm
answers that import: the fork server ``harness.MEGATRON`` (tests/conftest.py), which imported Megatron-Core so, or
where there is none (CUDA), fresh interpreters. Checks, on 2 and 4 ranks:

- ``switch``: ``fused_a2a.HAVE_DEEP_EP`` is True with epcomm's ``Buffer``; ``HAVE_HYBRIDEP`` False.
- ``fused_a2a``: ``fused_dispatch`` / ``fused_combine`` forward and backward, synchronous and with
  ``async_finish=True, allocate_on_comm_stream=True`` (what the flex dispatcher passes, with
  ``EventOverlap(EventHandle())``): received rows bitwise, ``tokens_per_expert``, the combined sum, the
  gradients of ``x`` (combine of the received gradients) and of the routing probabilities (summed per
  slot over the receiving ranks), ``set_deepep_num_sms``.
- ``flex_layer``: a ``MoELayer`` with ``moe_token_dispatcher_type="flex"``,
  ``moe_flex_dispatcher_backend="deepep"`` and the release's SM option (``moe_deepep_num_sms`` in 0.16.1,
  ``moe_flex_dispatcher_num_sms`` in 0.19.2: ``Buffer.num_sms`` follows it) (Megatron's router, permutation, ``SequentialMLP`` experts, ``_DeepepManager``), forward and
  backward against a float64 single-process computation of the same layer on every rank's tokens:
  output, gradients of the input, of the router weight (summed over ranks) and of every local
  expert's weights, each within a budget derived from bf16 rounding (``_budget``).

What Megatron-Core 0.16.1 needs CUDA (or Transformer Engine) for, and how far this goes without:
``TopKRouter.gating`` moves a CPU router weight to ``torch.cuda.current_device()`` before the gating
matmul, and ``moe_utils.RouterGatingLinearFunction`` reads ``te_general_gemm``, a name bound only when
Transformer Engine imports (a NameError without it, on any device). So on CPU the layer runs
``MoELayer.forward``'s own steps (``preprocess``, ``dispatch``, ``routed_experts_compute``,
``combine``, ``postprocess``, the router's ``routing``) with the gating matmul done by Megatron's
``router_gating_linear`` after binding ``te_general_gemm = None`` (the value Megatron means to use
without TE). Everything after the gating is Megatron's own code. Tier 3 (tests/gpu) runs
``layer(x)`` whole.
"""

from __future__ import annotations

import warnings

import harness
import pytest
import torch
from harness import check, equal, within_bf16_path

from epcomm.testing.compare import assert_within_budget

WORLD_SIZES = (2, 4)
H, F, K = 64, 32, 2  # hidden, expert FFN hidden, top-k
T_BASE = 7  # tokens on rank r: T_BASE + 2 r (odd, different per rank)
MEGATRON = "megatron-core"
# the releases this file is written for, each with its option for the flex dispatcher's SMs
SM_OPTION = {"0.16.1": "moe_deepep_num_sms", "0.19.2": "moe_flex_dispatcher_num_sms"}
NUM_SMS = 22  # not DeepEP's default (20): Buffer.num_sms shows the option reached it


def megatron_version() -> str | None:
    import importlib.metadata as md

    try:
        return md.version(MEGATRON)
    except md.PackageNotFoundError:
        return None


def _megatron_missing() -> str | None:
    import os

    v = megatron_version()
    if v is None:
        return f"{MEGATRON} is not installed (pip install -e '.[test]')"
    want = os.environ.get("EPCOMM_TEST_MEGATRON_VERSION")
    if want and v != want:
        return f"{MEGATRON} {v} is installed, EPCOMM_TEST_MEGATRON_VERSION asks for {want}"
    if v not in SM_OPTION:
        return f"{MEGATRON} {v}: this test is written for {sorted(SM_OPTION)}"
    return None


def num_experts(r_: int) -> int:
    return 4 * r_


def tokens(r: int) -> int:
    return T_BASE + 2 * r


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def layer_inputs(r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``r``'s hidden states ``bf16[T, 1, H]`` and the output gradient ``bf16[T, 1, H]``."""
    x = torch.randn(tokens(r), 1, H, generator=_gen(100 + r)).to(torch.bfloat16)
    g = torch.randn(tokens(r), 1, H, generator=_gen(200 + r)).to(torch.bfloat16)
    return x, g


def weights(e_: int) -> dict:
    """Every weight of the layer, bf16, seeded: router ``[E, H]``, fc1 ``[E, F, H]``, fc2 ``[E, H, F]``."""
    return {
        "router": (torch.randn(e_, H, generator=_gen(1)) / H**0.5).to(torch.bfloat16),
        "fc1": (torch.randn(e_, F, H, generator=_gen(2)) / H**0.5).to(torch.bfloat16),
        "fc2": (torch.randn(e_, H, F, generator=_gen(3)) / F**0.5).to(torch.bfloat16),
    }


# ----------------------------------------------------------------------------- rank side


def _megatron(ctx):
    """Import Megatron-Core in the rank (quietly: it warns that TE and Apex are absent)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.transformer.moe.fused_a2a as fused_a2a
        from megatron.core import parallel_state
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1, expert_model_parallel_size=ctx.world_size
        )
    return fused_a2a, parallel_state


def check_switch(ctx):
    import _epcomm_as_deep_ep as hook
    import epcomm

    check(
        hook.installed(),
        "the EPCOMM_AS_DEEP_EP hook did not run in this rank (is epcomm_as_deep_ep.pth "
        "installed? `epcomm env` says)",
    )
    fa, _ = _megatron(ctx)
    check(fa.HAVE_DEEP_EP, "fused_a2a.HAVE_DEEP_EP is False")
    check(issubclass(fa.Buffer, epcomm.Buffer), f"fused_a2a.Buffer is {fa.Buffer!r}, not epcomm's")
    check(not fa.HAVE_HYBRIDEP, "fused_a2a.HAVE_HYBRIDEP is True: deep_ep must not offer HybridEPBuffer")


def _routing(r: int, r_: int, e_: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``r``'s ``topk_idx int64[T, K]`` (distinct experts, some -1) and ``probs f32[T, K]``."""
    gen = _gen(300 + r)
    t = tokens(r)
    idx = torch.stack([torch.randperm(e_, generator=gen)[:K] for _ in range(t)])
    idx[torch.rand(t, K, generator=gen) < 0.2] = -1
    probs = torch.rand(t, K, generator=gen)
    return idx, probs


def _dest_ranks(idx: torch.Tensor, r_: int) -> list[list[int]]:
    lx = num_experts(r_) // r_
    return [sorted({int(e) // lx for e in row if e >= 0}) for row in idx]


def check_fused_a2a(ctx):
    fa, _ = _megatron(ctx)
    import epcomm

    r_, me, group = ctx.world_size, ctx.rank, ctx.group
    e_, lx = num_experts(r_), num_experts(r_) // r_
    fa.set_deepep_num_sms(24)
    equal(epcomm.Buffer.num_sms, 24, "Buffer.num_sms after set_deepep_num_sms(24)")
    fa.set_deepep_num_sms(20)
    for async_finish in (False, True):
        x = (torch.randn(tokens(me), H, generator=_gen(400 + me))).to(torch.bfloat16).requires_grad_()
        idx, probs = _routing(me, r_, e_)
        probs.requires_grad_()
        recv_x, recv_idx, recv_probs, per_expert, handle = fa.fused_dispatch(
            x, idx, probs, e_, group, async_finish=async_finish, allocate_on_comm_stream=async_finish
        )
        what = f"async_finish={async_finish}"
        check(fa._buffer is not None and fa._buffer.group is group, f"{what}: get_buffer's Buffer and group")
        # expected received rows: every source rank's tokens with an expert here, by source rank then token
        rows, exp_idx, exp_probs = [], [], []
        for s in range(r_):
            xs = torch.randn(tokens(s), H, generator=_gen(400 + s)).to(torch.bfloat16)
            ids, ps = _routing(s, r_, e_)
            for t, dests in enumerate(_dest_ranks(ids, r_)):
                if me in dests:
                    rows.append(xs[t])
                    local = torch.where(ids[t] // lx == me, ids[t] % lx, -1)
                    local = torch.where(ids[t] >= 0, local, -1)
                    exp_idx.append(local)
                    exp_probs.append(torch.where(local >= 0, ps[t], 0.0))
        n = len(rows)
        equal(
            recv_x.detach(),
            torch.stack(rows) if n else torch.empty(0, H, dtype=torch.bfloat16),
            f"{what}: recv_x",
        )
        equal(
            recv_idx, torch.stack(exp_idx) if n else torch.empty(0, K, dtype=torch.int64), f"{what}: indices"
        )
        equal(recv_probs.detach(), torch.stack(exp_probs) if n else torch.empty(0, K), f"{what}: probs")
        counts = (
            torch.bincount(torch.stack(exp_idx).flatten() + 1, minlength=lx + 1)[1:]
            if n
            else torch.zeros(lx, dtype=torch.int64)
        )
        equal(per_expert, counts, f"{what}: tokens_per_expert")
        # combine what came back scaled by 2**me: combined[t] = sum over its ranks of 2**r * x[t]
        y = recv_x * (2.0**me)
        combined, _ = fa.fused_combine(
            y, group, handle, async_finish=async_finish, allocate_on_comm_stream=async_finish
        )
        dests = _dest_ranks(idx, r_)
        scale = torch.tensor([[sum(2.0**d for d in ds)] for ds in dests], dtype=torch.float64)
        assert_within_budget(
            combined.detach(),
            x.detach().double() * scale,
            x.detach().double().abs() * scale,
            r_,
            f"{what}: fused_combine",
        )
        # backward: loss = <combined, g> + <recv_probs, gp>, gp[row, k] = 2**-(receiving rank + 1) * (k + 1)
        g = torch.randn(tokens(me), H, generator=_gen(500 + me)).to(torch.bfloat16)
        gp = (2.0 ** -(me + 1)) * torch.arange(1, K + 1, dtype=torch.float32).expand(n, K)
        ((combined.float() * g.float()).sum() + (recv_probs * gp).sum()).backward()
        assert_within_budget(x.grad, g.double() * scale, g.double().abs() * scale, r_, f"{what}: grad of x")
        exp_gp = torch.tensor(
            [[sum(2.0 ** -(d + 1) * (k + 1) for d in ds) for k in range(K)] for ds in dests],
            dtype=torch.float32,
        ).reshape(-1, K)
        equal(probs.grad, exp_gp, f"{what}: grad of probs (per slot, summed over the receiving ranks)")


# ----------------------------------------------------------------------------- the MoE layer


def _config(r_: int):
    import torch.nn.functional as F_
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=4,
        ffn_hidden_size=F,
        moe_ffn_hidden_size=F,
        num_moe_experts=num_experts(r_),
        moe_router_topk=K,
        expert_model_parallel_size=r_,
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend="deepep",
        **{SM_OPTION[megatron_version()]: NUM_SMS},
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        add_bias_linear=False,
        activation_func=F_.relu,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
    )


def build_layer(ctx):
    """The flex/DeepEP MoE layer with the seeded weights of ``weights`` (local experts of this rank)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher
    from megatron.core.transformer.spec_utils import ModuleSpec

    r_ = ctx.world_size
    sub = MoESubmodules(
        router=TopKRouter,
        experts=ModuleSpec(
            module=SequentialMLP,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        ),
    )
    import epcomm

    layer = MoELayer(_config(r_), sub)
    check(
        isinstance(layer.token_dispatcher, MoEFlexTokenDispatcher), f"dispatcher {layer.token_dispatcher!r}"
    )
    equal(epcomm.Buffer.num_sms, NUM_SMS, f"Buffer.num_sms after {SM_OPTION[megatron_version()]}={NUM_SMS}")
    w = weights(num_experts(r_))
    with torch.no_grad():
        layer.router.weight.copy_(w["router"])
        for i, e in enumerate(layer.local_expert_indices):
            mlp = layer.experts.local_experts[i]
            mlp.linear_fc1.weight.copy_(w["fc1"][e])
            mlp.linear_fc2.weight.copy_(w["fc2"][e])
    return layer


def layer_forward(layer, x: torch.Tensor) -> torch.Tensor:
    """``MoELayer.forward``'s steps, the router's gating matmul included, without its move to CUDA
    (module docstring)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # Megatron-Core 0.16.1 without Transformer Engine: see the docstring
    logits = moe_utils.router_gating_linear(x, layer.router.weight, None, torch.float32)
    probs, routing_map = layer.router.routing(logits)
    hidden, probs = layer.preprocess(x, probs, routing_map)
    dispatched, probs = layer.dispatch(hidden, probs)
    out, _ = layer.routed_experts_compute(dispatched, probs)
    return layer.postprocess(layer.combine(out), None)


def reference(r_: int) -> dict:
    """The same layer in one process, in float64, on every rank's tokens: outputs, gradients of the
    loss ``sum_r <out_r, g_r>``, and for each a magnitude ``M`` (the same sums over absolute values)
    that bounds how far bf16 rounding can move it (``_budget``)."""
    e_ = num_experts(r_)
    w = {k: v.double().requires_grad_() for k, v in weights(e_).items()}
    out, xs, mags, loss = [], [], [], 0.0
    a1, a2, ar = (w[k].detach().abs() for k in ("fc1", "fc2", "router"))
    m_gx, m_gw1, m_gw2, m_gr = [], torch.zeros_like(a1), torch.zeros_like(a2), torch.zeros_like(ar)
    for r in range(r_):
        x_bf, g_bf = layer_inputs(r)
        x = x_bf.reshape(-1, H).double().requires_grad_()
        g = g_bf.reshape(-1, H).double()
        # top-k picked exactly as Megatron does (the same float32 matmul on the same rank's batch)
        logits32 = torch.mm(x_bf.reshape(-1, H).float(), weights(e_)["router"].float().t())
        top = torch.topk(logits32, K, dim=-1).indices
        p = torch.softmax((x @ w["router"].t()).gather(1, top), dim=-1)
        h = torch.einsum("tkfh,th->tkf", w["fc1"][top], x)
        y = torch.einsum("tkhf,tkf->tkh", w["fc2"][top], p.unsqueeze(-1) * torch.relu(h))
        o = y.sum(1)
        loss = loss + (o * g).sum()
        out.append(o)
        xs.append(x)
        # magnitudes: a value rounded to bf16 moves by at most u times its own size (|h|, |W2^T g|), and
        # that error reaches the result through absolute values of the later (linear) steps
        xa, ga, pd = x.detach().abs(), g.abs(), p.detach()
        mh = h.detach().abs()  # |h| = |W1 x|
        mags.append((torch.einsum("tkhf,tkf->tkh", a2[top], pd.unsqueeze(-1) * mh)).sum(1))
        mgs = torch.einsum("tkhf,th->tkf", w["fc2"].detach()[top], g).abs()  # |W2^T g|
        mgp = (mh * mgs).sum(-1)  # |d loss / d p|
        mgz = pd * (mgp + (pd * mgp).sum(-1, keepdim=True))  # |d loss / d logits| (top-k)
        mgx = torch.einsum("tkfh,tkf->th", a1[top], pd.unsqueeze(-1) * mgs)
        mgx = mgx + torch.einsum("tk,tkh->th", mgz, ar[top])
        m_gx.append(mgx)
        for t in range(x.shape[0]):
            for k in range(K):
                e = int(top[t, k])
                m_gw1[e] += torch.outer(pd[t, k] * mgs[t, k], xa[t])
                m_gw2[e] += torch.outer(ga[t], pd[t, k] * mh[t, k])
                m_gr[e] += mgz[t, k] * xa[t]
    loss.backward()
    return {
        "out": [o.detach() for o in out],
        "out_mag": mags,
        "gx": [x.grad for x in xs],
        "gx_mag": m_gx,
        "fc1": w["fc1"].grad,
        "fc1_mag": m_gw1,
        "fc2": w["fc2"].grad,
        "fc2_mag": m_gw2,
        "router": w["router"].grad,
        "router_mag": m_gr,
    }


def _budget(actual, ref, mag, roundings: int, what: str) -> None:
    """``harness.within_bf16_path`` on ``actual`` in ``ref``'s shape, with this test's floor of 1e-12."""
    within_bf16_path(actual.detach().reshape(ref.shape), ref, mag, roundings, what, floor=1e-12)


def check_flex_layer(ctx):
    import torch.distributed as dist

    _megatron(ctx)
    r_, me = ctx.world_size, ctx.rank
    layer = build_layer(ctx)
    x, g = layer_inputs(me)
    x = x.clone().requires_grad_()
    out = layer_forward(layer, x)
    equal(tuple(out.shape), (tokens(me), 1, H), "output shape")
    (out.float() * g.float()).sum().backward()
    ref = reference(r_)
    # forward: fc1, the probability scale, fc2, the K-term unpermute and the combine round to bf16
    _budget(out.reshape(-1, H), ref["out"][me], ref["out_mag"][me], K + 4, "MoE layer output")
    _budget(x.grad.reshape(-1, H), ref["gx"][me], ref["gx_mag"][me], K + 6, "gradient of the input")
    gr = layer.router.weight.grad.double().clone()
    dist.all_reduce(gr, group=ctx.group)
    _budget(gr, ref["router"], ref["router_mag"], K + 4, "gradient of the router weight (summed over ranks)")
    for i, e in enumerate(layer.local_expert_indices):
        mlp = layer.experts.local_experts[i]
        _budget(
            mlp.linear_fc1.weight.grad, ref["fc1"][e], ref["fc1_mag"][e], 4, f"gradient of expert {e} fc1"
        )
        _budget(
            mlp.linear_fc2.weight.grad, ref["fc2"][e], ref["fc2_mag"][e], 4, f"gradient of expert {e} fc2"
        )


CHECKS = [("switch", check_switch), ("fused_a2a", check_fused_a2a), ("flex_layer", check_flex_layer)]


def _rank(ctx):
    return harness.run_checks_as_deep_ep(ctx, CHECKS)


deep_ep_switch = harness.deep_ep_switch  # the fixture, for this module's tests
pytestmark = pytest.mark.usefixtures("deep_ep_switch")


def start_early(items):  # (tests/conftest.py) this module's launches, in the background (tests/dist/background.py)
    if harness.TRANSPORT == "gloo" and not _megatron_missing():
        worlds = dict.fromkeys(it.callspec.params["world_size"] for it in items)
        harness.queue_cached([(_rank, w, harness.MEGATRON) for w in worlds], switch=True)


stop_early = harness.stop_early


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", [n for n, _ in CHECKS])
def test_megatron(world_size, name):
    if harness.TRANSPORT != "gloo":
        pytest.skip("Megatron-Core on CPU ranks: gloo only (tier 3 runs it on GPUs)")
    missing = _megatron_missing()
    if missing:
        pytest.fail(missing)
    harness.report(harness.launch_cached(_rank, world_size, server=harness.MEGATRON), name)
