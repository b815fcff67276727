"""Tier 2: ``epcomm.ops`` (differentiable dispatch/combine custom ops) over gloo, spawned processes.

One launch per world size (1, 2, 3) runs every check (``harness``). Forward results must equal
``Buffer.dispatch``/``Buffer.combine`` bit for bit. Gradients are checked against an analytical
float64 computation done in one process from every rank's regenerated inputs (one seed), within a
budget derived from the BF16/float32 roundings the distributed computation makes. At R = 2 the ops
also go through ``torch.compile`` (must equal eager bit for bit) and ``torch.library.opcheck``.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``,
``N`` received rows, ``W`` = ``num_worst_tokens``.

The loss whose gradient is checked (the shape of an MoE layer): on every rank ``j``,

    c[n]  = s_j(src rank, src token)[n] * sum_k recv_topk_weights[n, k]    (s: fixed, random, > 0)
    y     = bf16(recv_x * c)                                               (the "experts")
    out   = combine(y, handle, topk_weights=recv_topk_weights)
    loss  = sum(out.combined_x * G_j) + sum(out.combined_topk_weights * Gw_j)

and the total loss is the sum over ranks. For a token ``t`` of rank ``i`` sent to ranks ``J(t)``,
with ``k`` a slot whose expert lives on rank ``j*``::

    d/dx[t]      = G_i[t] * sum_{j in J(t)} c_j[t]
    d/dw[t, k]   = Gw_i[t, k] + s_{j*}[t] * <G_i[t], x[t]>       (0 where topk_idx[t, k] == -1)
"""

from __future__ import annotations

import dataclasses

import harness
import pytest
import torch
from harness import check, equal
from torch._dynamo.backends.registry import lookup_backend

from epcomm import Buffer, layout, ops
from epcomm.testing.compare import assert_bitwise, assert_within_budget
from epcomm.testing.inputs import Case, make_topk, make_x

pytestmark = pytest.mark.skipif(
    harness.TRANSPORT == "nccl",
    reason="gloo-only for now: its inputs, gradients and opcheck arguments are CPU tensors (run it without "
           "EPCOMM_TEST_TRANSPORT)")

HIDDEN = 40  # a multiple of 8 that is not a power of two
# An odd top-k: rows of topk_weights are not a multiple of 16 bytes, so combine's backward pads them
# before they travel as bytes. (It also keeps the reference backend's packed dispatch rows a multiple
# of 8 bytes: with an even K, a rank receiving exactly one row fails in reference._unpack, whose
# int64 view of a one-row slice needs an 8-byte row stride.)
TOPK = 5


def _cases(num_ranks: int) -> dict[str, Case]:
    return {name: dataclasses.replace(case, num_topk=TOPK) for name, case in harness.cases(num_ranks, HIDDEN).items()}


def _worst(case: Case) -> int:
    """A ``num_worst_tokens`` that always suffices: every token of every rank, plus 3 padding rows."""
    return sum(case.tokens) + 3


# ----------------------------------------------------------------------------- inputs of the loss


def _row_scale(case: Case, dst: int, src: int) -> torch.Tensor:
    """``s_dst(src, t)``: ``f32[T_src]`` in [0.5, 1.5), fixed per (receiving rank, source rank)."""
    g = torch.Generator().manual_seed(case.seed * 7919 + 101 * dst + src + 1)
    return torch.rand(case.tokens_of(src), generator=g) + 0.5


def _loss_weights(case: Case, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G f32[T, H], Gw f32[T, K])``; ``G`` holds BF16 values, so ``combined_x``'s gradient
    (BF16, like ``combined_x``) carries it without rounding."""
    g = torch.Generator().manual_seed(case.seed * 7919 + 55_555 + rank)
    t = case.tokens_of(rank)
    big_g = torch.randn(t, case.hidden, generator=g).to(torch.bfloat16).float()
    return big_g, torch.randn(t, case.num_topk, generator=g)


def _recv_row_scale(case: Case, me: int, handle) -> torch.Tensor:
    """``s`` for each row of this rank's ``recv_x`` (``f32[N]``; 0 on padding rows)."""
    r_ = case.num_ranks
    col = handle.rank_prefix_matrix[:, me].to(torch.int64)
    counts = torch.cat([col[:1], col[1:] - col[:-1]])
    src_rank = torch.repeat_interleave(torch.arange(r_), counts)
    n_real = int(col[-1])
    s = torch.zeros(handle.recv_src_idx.shape[0])
    tok = handle.recv_src_idx[:n_real].to(torch.int64)
    for i in range(r_):
        sel = src_rank == i
        s[:n_real][sel] = _row_scale(case, me, i)[tok[sel]]
    return s


def _moe_loss(buf: Buffer, case: Case, x, topk_idx, topk_weights, num_worst_tokens: int = 0,
              with_weights: bool = True, row_scale: torch.Tensor | None = None, loss_weights=None):
    """The loss of the module docstring on this rank (``with_weights=False``: combine without
    ``topk_weights``, and no ``Gw`` term). ``row_scale`` (``s`` per received row) and
    ``loss_weights`` (``(G, Gw)``) may be made beforehand, outside a compiled region (making them
    needs host values and a generator). Returns ``(loss, dispatch output)``."""
    me = buf.rank
    o = ops.dispatch(buf, x, topk_idx, topk_weights, case.num_experts, num_worst_tokens)
    s = _recv_row_scale(case, me, o.handle) if row_scale is None else row_scale
    c = s * o.recv_topk_weights.sum(1)
    y = (o.recv_x.float() * c[:, None]).to(torch.bfloat16)
    out = ops.combine(buf, y, o.handle, o.recv_topk_weights if with_weights else None)
    big_g, gw = _loss_weights(case, me) if loss_weights is None else loss_weights
    loss = (out.combined_x.float() * big_g).sum()
    if with_weights:
        loss = loss + (out.combined_topk_weights * gw).sum()
    return loss, o


def _expected_grads(case: Case, me: int) -> dict[str, torch.Tensor]:
    """Float64 gradients of the total loss for rank ``me``'s ``x`` and ``topk_weights``, with the
    sums of absolute terms the budgets need."""
    r_, e = case.num_ranks, case.num_experts
    lx = e // r_
    idx, w = make_topk(case, me)
    x = make_x(case, me).double()
    big_g, gw = _loss_weights(case, me)
    big_g, gw = big_g.double(), gw.double()
    _, _, in_rank = layout.dispatch_layout(idx, e, r_)
    owner = torch.where(idx >= 0, idx // lx, torch.full_like(idx, -1))  # rank of each slot's expert
    t = idx.shape[0]
    gx = torch.zeros(t, case.hidden, dtype=torch.float64)
    gx_abs = torch.zeros_like(gx)
    s_owner = torch.zeros(t, idx.shape[1], dtype=torch.float64)
    for j in range(r_):
        s_j = _row_scale(case, j, me).double()
        wsum_j = (w.double() * (owner == j)).sum(1)
        c_j = s_j * wsum_j * in_rank[:, j]
        term = big_g * c_j[:, None]
        gx += term
        gx_abs += term.abs()
        s_owner += torch.where(owner == j, s_j[:, None], torch.zeros_like(s_owner))
    g_dot_x = (big_g * x).sum(1, keepdim=True)
    g_abs_x = (big_g * x).abs().sum(1, keepdim=True)
    valid = idx >= 0
    gwt = torch.where(valid, gw + s_owner * g_dot_x, torch.zeros_like(gw))
    gwt_abs = torch.where(valid, gw.abs() + s_owner * g_abs_x, torch.zeros_like(gw))
    return {"x": gx, "x_abs": gx_abs, "w": gwt, "w_abs": gwt_abs}


# Budget of d/dx (BF16): each term G*c reaches combine as a BF16 row (rounded once: 2**-8 relative,
# the unit roundoff of BF16), after c = s * sum_k w was formed in float32 (<= K + 2 roundings of
# 2**-24, K <= 32) and the product rounded to float32; combine adds R terms in float32 (num_terms=R)
# and rounds to BF16 (2**-8 |ref| in reduction_budget; the 2**-8 |error| part of that rounding is
# second order). 2**-14 covers the float32 roundings (< 2**-18) and second-order terms (< 2**-15).
_X_EXTRA_REL = 2.0 ** -8 + 2.0 ** -14


def _check_grads(case: Case, me: int, x_grad: torch.Tensor, w_grad: torch.Tensor, what: str) -> None:
    ref = _expected_grads(case, me)
    assert_within_budget(x_grad, ref["x"], ref["x_abs"], case.num_ranks, f"{what}: x.grad",
                         extra_rel=_X_EXTRA_REL)
    # d/dw (float32): <G, x> is a float32 sum of H products, then one product (s) and one sum (Gw):
    # at most H + 2 roundings of 2**-24 relative to the sum of absolute terms (num_terms = H + 3).
    assert_within_budget(w_grad, ref["w"], ref["w_abs"], case.hidden + 3, f"{what}: topk_weights.grad")


# ----------------------------------------------------------------------------- the checks


def _layout(buf: Buffer, idx: torch.Tensor, num_experts: int) -> dict:
    """The routing arguments of ``Buffer.dispatch`` (no handle): from ``get_dispatch_layout``."""
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    return {"num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank, "num_tokens_per_expert": per_expert}


def _inputs(case: Case, me: int):
    idx, w = make_topk(case, me)
    return make_x(case, me), idx, w


def check_forward_matches_buffer(ctx) -> None:
    """Every output of ops.dispatch / combine / cached_dispatch equals the Buffer's, bit for bit."""
    buf = Buffer(ctx.group)
    me = ctx.rank
    for name, case in _cases(ctx.world_size).items():
        x, idx, w = _inputs(case, me)
        e = case.num_experts
        for nwt in (0, _worst(case)):
            ref = buf.dispatch(x, **_layout(buf, idx, e), topk_idx=idx, topk_weights=w, num_worst_tokens=nwt)
            got = ops.dispatch(buf, x, idx, w, e, num_worst_tokens=nwt)
            what = f"{name}, num_worst_tokens={nwt}"
            assert_bitwise(got.recv_x, ref[0], f"{what}: recv_x")
            assert_bitwise(got.recv_topk_idx, ref[1], f"{what}: recv_topk_idx")
            assert_bitwise(got.recv_topk_weights, ref[2], f"{what}: recv_topk_weights")
            for field in ref[4]._fields:
                assert_bitwise(getattr(got.handle, field), getattr(ref[4], field), f"{what}: handle.{field}")
            lx = e // ctx.world_size
            counts = torch.stack([(got.recv_topk_idx == le).sum() for le in range(lx)]).to(torch.int32)
            equal(got.num_recv_tokens_per_expert, counts, f"{what}: num_recv_tokens_per_expert")
            if nwt == 0:
                equal(got.num_recv_tokens_per_expert.tolist(), ref[3], f"{what}: per-expert counts vs Buffer")

            g = torch.Generator().manual_seed(me + 17)
            y = torch.randn(got.recv_x.shape, generator=g).to(torch.bfloat16)
            ref_c = buf.combine(y, ref[4], topk_weights=ref[2])
            got_c = ops.combine(buf, y, got.handle, topk_weights=got.recv_topk_weights)
            assert_bitwise(got_c.combined_x, ref_c[0], f"{what}: combined_x")
            assert_bitwise(got_c.combined_topk_weights, ref_c[1], f"{what}: combined_topk_weights")
            plain = ops.combine(buf, y, got.handle)
            check(plain.combined_topk_weights is None, f"{what}: combined_topk_weights without topk_weights")
            assert_bitwise(plain.combined_x, ref_c[0], f"{what}: combined_x without topk_weights")
            assert_bitwise(ops.cached_dispatch(buf, x, got.handle), buf.dispatch(x, handle=ref[4])[0],
                           f"{what}: cached_dispatch")


def check_gradients(ctx) -> None:
    """Autograd through dispatch -> experts -> combine against the float64 analytical gradient."""
    buf = Buffer(ctx.group)
    me = ctx.rank
    for name, case in _cases(ctx.world_size).items():
        x, idx, w = _inputs(case, me)
        grads = {}
        for nwt in (0, _worst(case)):
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            loss, _ = _moe_loss(buf, case, xg, idx, wg, nwt)
            loss.backward()
            _check_grads(case, me, xg.grad, wg.grad, f"{name}, num_worst_tokens={nwt}")
            grads[nwt] = (xg.grad, wg.grad)
        # Padding rows must not change a single bit.
        (x0, w0), (x1, w1) = grads.values()
        assert_bitwise(x1, x0, f"{name}: x.grad with num_worst_tokens vs without")
        assert_bitwise(w1, w0, f"{name}: topk_weights.grad with num_worst_tokens vs without")

        # topk_weights without grad and combine without weights: x.grad is the same (Gw only feeds w).
        xg = x.clone().requires_grad_()
        loss, _ = _moe_loss(buf, case, xg, idx, w, with_weights=False)
        loss.backward()
        assert_bitwise(xg.grad, x0, f"{name}: x.grad when topk_weights needs no grad")

        # cached_dispatch's backward is a combine: the gradient of sum(recv * Q) is combine(Q).
        h = ops.dispatch(buf, x, idx, w, case.num_experts).handle
        q = torch.randn(h.recv_src_idx.shape[0], case.hidden,
                        generator=torch.Generator().manual_seed(me + 3)).to(torch.bfloat16)
        xg = x.clone().requires_grad_()
        (ops.cached_dispatch(buf, xg, h).float() * q.float()).sum().backward()
        assert_bitwise(xg.grad, ops.combine(buf, q, h).combined_x, f"{name}: cached_dispatch backward")


def _recording_aot_eager(traced: list[str]):
    """The ``aot_eager`` backend, noting in ``traced`` the call targets of every captured graph."""

    def backend(gm, example_inputs):
        traced.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return lookup_backend("aot_eager")(gm, example_inputs)

    return backend


def check_compile(ctx) -> None:
    """torch.compile (aot_eager: the real autograd graphs, CPU-cheap) gives eager's bits.

    - ``num_worst_tokens > 0`` (static shapes) and ``= 0`` (an unbacked row count), on a registered
      Buffer: the whole step is one graph (``fullgraph=True``).
    - A Buffer the compiled code meets unregistered: registering is a graph break where torch cannot
      trace it (``fullgraph=False``); the first and the second (recompiled) calls equal eager.
    """
    case = _cases(ctx.world_size)["random"]
    me = ctx.rank
    x, idx, w = _inputs(case, me)
    loss_weights = _loss_weights(case, me)

    def step(buf, x, idx, w, nwt, row_scale):
        loss, o = _moe_loss(buf, case, x, idx, w, nwt, row_scale=row_scale, loss_weights=loss_weights)
        return loss, o.recv_x, o.num_recv_tokens_per_expert

    def run(fn, buf, nwt, row_scale):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss, recv_x, counts = fn(buf, xg, idx, wg, nwt, row_scale)
        loss.backward()
        return loss.detach(), recv_x.detach(), counts, xg.grad, wg.grad

    for nwt, registered in ((_worst(case), True), (0, True), (_worst(case), False)):
        torch._dynamo.reset()
        buf = Buffer(ctx.group)
        # The per-row scales need host values: make them from an eager dispatch of the same routing.
        row_scale = _recv_row_scale(case, me, buf.dispatch(
            x, **_layout(buf, idx, case.num_experts), topk_idx=idx, topk_weights=w, num_worst_tokens=nwt)[4])
        if registered:
            ops.register_buffer(buf)
        traced: list[str] = []
        what = f"num_worst_tokens={nwt}, registered={registered}"
        compiled = torch.compile(step, backend=_recording_aot_eager(traced), fullgraph=registered)
        eager = run(step, buf, nwt, row_scale)
        for call in range(1 if registered else 2):
            got = run(compiled, buf, nwt, row_scale)
            for name, e, c in zip(("loss", "recv_x", "counts", "x.grad", "w.grad"), eager, got):
                assert_bitwise(c, e, f"{what}, compiled call {call}: {name}")
        for op in ("epcomm.dispatch", "epcomm.combine"):
            check(any(op in t for t in traced), f"{what}: {op} not in a compiled graph: {traced}")
        _check_grads(case, me, got[3], got[4], f"compiled, {what}")


def check_opcheck(ctx) -> None:
    """torch.library.opcheck on each op: schema, autograd registration, fake vs real, AOT dispatch.

    Every sub-test applies: each runs the op (a collective) the same number of times on every rank,
    so the ranks stay in step."""
    case = _cases(ctx.world_size)["random"]
    buf = Buffer(ctx.group)
    bid = ops.register_buffer(buf)
    x, idx, w = _inputs(case, ctx.rank)

    def g(t):
        return t.clone().requires_grad_()

    for nwt in (0, _worst(case)):
        torch.library.opcheck(torch.ops.epcomm.dispatch.default, (bid, g(x), idx, g(w), case.num_experts, nwt))
    o = ops.dispatch(buf, x, idx, w, case.num_experts)
    y = torch.randn(o.recv_x.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.epcomm.combine.default, (bid, g(y), *o.handle, g(o.recv_topk_weights)))
    torch.library.opcheck(torch.ops.epcomm.combine.default, (bid, g(y), *o.handle, None))
    torch.library.opcheck(torch.ops.epcomm.cached_dispatch.default, (bid, g(x), *o.handle))


CHECKS = {
    "forward_matches_buffer": check_forward_matches_buffer,
    "gradients": check_gradients,
    "compile": check_compile,
    "opcheck": check_opcheck,
}
# torch.compile and opcheck cost seconds of tracing per rank: run them at R = 2 only.
PLAN = {1: ("forward_matches_buffer", "gradients"),
        2: ("forward_matches_buffer", "gradients", "compile", "opcheck"),
        3: ("forward_matches_buffer", "gradients")}


def _ops_checks_1(ctx):
    return harness.run_checks(ctx, [(n, CHECKS[n]) for n in PLAN[1]])


def _ops_checks_2(ctx):
    return harness.run_checks(ctx, [(n, CHECKS[n]) for n in PLAN[2]])


def _ops_checks_3(ctx):
    return harness.run_checks(ctx, [(n, CHECKS[n]) for n in PLAN[3]])


_LAUNCHERS = {1: _ops_checks_1, 2: _ops_checks_2, 3: _ops_checks_3}


def start_early(items):  # (tests/conftest.py) this module's launches, in the background (tests/dist/background.py)
    worlds = dict.fromkeys(it.callspec.params["world_size"] for it in items)
    harness.queue_cached([(_LAUNCHERS[w], w, "") for w in worlds])


stop_early = harness.stop_early


@pytest.mark.parametrize("world_size,check_name", [(r, n) for r, names in PLAN.items() for n in names])
def test_ops(world_size: int, check_name: str) -> None:
    harness.report(harness.launch_cached(_LAUNCHERS[world_size], world_size), check_name)
