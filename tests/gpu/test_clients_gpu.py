"""Tier 3: Megatron-Core's MoE layer with the flex token dispatcher and the DeepEP backend
(``moe_token_dispatcher_type="flex"``, ``moe_enable_deepep=True``) trains a few steps on GPUs through
the switch ``EPCOMM_AS_DEEP_EP=1``, at ``EPCOMM_TEST_WORLD`` ranks (default 2; with fewer GPUs than
ranks, ``EPCOMM_TEST_SHARE_GPU=1`` puts several ranks on one GPU, see tests/gpu/conftest.py).

Unlike tier 2 (tests/dist/test_clients_megatron.py, whose helpers this reuses) the layer runs whole,
``layer(x)``, router gating on the GPU included. The first step's output and gradients are checked
against the same float64 single-process layer and bf16 budget as tier 2; then a few SGD steps on a
fixed batch must lower the loss.

Needs on the GPU machine: ``pip install --no-deps megatron-core==0.16.1`` (it also needs numpy and
packaging) and epcomm installed by pip so that ``epcomm_as_deep_ep.pth`` is in site-packages
(``pip install --no-deps --no-build-isolation -e .``; ``epcomm env`` shows the hook). Run::

    EPCOMM_TEST_WORLD=2 python -m pytest -q tests/gpu/test_clients_gpu.py            # 2 GPUs
    EPCOMM_TEST_SHARE_GPU=1 EPCOMM_TEST_WORLD=2 python -m pytest -q tests/gpu/test_clients_gpu.py  # 1 GPU
"""

from __future__ import annotations

import os

import pytest
import torch

from epcomm.testing.launcher import parallel_launch

WORLD = int(os.environ.get("EPCOMM_TEST_WORLD", "2"))
STEPS = 5


def _rank(ctx):
    import test_clients_megatron as M  # tests/dist is on sys.path (tests/conftest.py), also in the ranks

    import _epcomm_as_deep_ep as hook
    import epcomm

    assert hook.installed(), (
        "EPCOMM_AS_DEEP_EP hook did not run in this rank: is epcomm_as_deep_ep.pth installed?"
    )
    fa, _ = M._megatron(ctx)
    assert fa.HAVE_DEEP_EP and issubclass(fa.Buffer, epcomm.Buffer), "Megatron-Core did not pick up epcomm"
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = (
            None  # Megatron-Core 0.16.1 without Transformer Engine (test_clients_megatron)
        )
    model_parallel_cuda_manual_seed(1234)
    r_, me = ctx.world_size, ctx.rank
    layer = M.build_layer(ctx).to(ctx.device)
    x_cpu, g_cpu = M.layer_inputs(me)
    x = x_cpu.to(ctx.device).clone().requires_grad_()
    out, bias = layer(x)  # the whole MoELayer.forward, router gating included
    assert bias is None
    (out.float() * g_cpu.to(ctx.device).float()).sum().backward()
    ref = M.reference(r_)
    M._budget(out.reshape(-1, M.H).cpu(), ref["out"][me], ref["out_mag"][me], M.K + 4, "MoE layer output")
    M._budget(
        x.grad.reshape(-1, M.H).cpu(), ref["gx"][me], ref["gx_mag"][me], M.K + 6, "gradient of the input"
    )
    for i, e in enumerate(layer.local_expert_indices):
        mlp = layer.experts.local_experts[i]
        M._budget(
            mlp.linear_fc1.weight.grad.cpu(), ref["fc1"][e], ref["fc1_mag"][e], 4, f"expert {e} fc1 grad"
        )
        M._budget(
            mlp.linear_fc2.weight.grad.cpu(), ref["fc2"][e], ref["fc2_mag"][e], 4, f"expert {e} fc2 grad"
        )
    # a few training steps on a fixed batch: the mean loss over the ranks must go down
    import torch.distributed as dist

    target = (0.5 * x_cpu.detach()).to(ctx.device)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        out, _ = layer(x.detach())
        loss = ((out.float() - target.float()) ** 2).mean()
        loss.backward()
        router_grad = layer.router.weight.grad  # expert weights are rank-local; the router is replicated
        dist.all_reduce(router_grad, group=ctx.group)
        router_grad /= r_
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=ctx.group)
        losses.append(float(total) / r_)
    assert all(torch.isfinite(torch.tensor(losses))), f"losses {losses}"
    assert losses[-1] < losses[0], f"the loss did not go down over {STEPS} steps: {losses}"
    return {"rank": me, "backend": fa._buffer.backend_name, "losses": losses}


def test_megatron_flex_deepep_trains_on_gpus(monkeypatch):
    pytest.importorskip("megatron.core", reason="pip install --no-deps megatron-core==0.16.1")
    monkeypatch.setenv("EPCOMM_AS_DEEP_EP", "1")  # the ranks are fresh interpreters: they start with it
    res = parallel_launch(WORLD, _rank, backend="nccl", timeout_s=300)
    assert [r["rank"] for r in res] == list(range(WORLD))
    assert len({tuple(round(v, 6) for v in r["losses"]) for r in res}) == 1, "ranks disagree on the mean loss"
