"""Tier 1: ``epcomm.ops`` without communication.

Shape propagation runs on fake tensors (``FakeTensorMode``), forward and backward, so no op ever
moves data. The ops need a ``Buffer``, and a ``Buffer`` needs a process group: these tests use
torch's in-process ``fake`` group (4 ranks, one process, no peers); nothing here calls a
collective on it. Bad inputs must raise ``TypeError``/``ValueError`` naming the argument and value.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``,
``C`` channels, ``N`` received rows, ``W`` = ``num_worst_tokens``.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.testing._internal.distributed.fake_pg import FakeStore

import epcomm
from epcomm import ops
from epcomm.layout import DispatchHandle

R, T, H, K, E, W = 4, 5, 16, 3, 8, 11


@pytest.fixture(scope="module")
def buf():
    if dist.is_initialized():
        pytest.skip("a default process group exists already in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=R)
    try:
        yield epcomm.Buffer(dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def _channels(buf) -> int:
    return buf.get_dispatch_config(R).num_channels


def _inputs(t: int = T, h: int = H, k: int = K):
    return (torch.zeros(t, h, dtype=torch.bfloat16), torch.zeros(t, k, dtype=torch.int64),
            torch.zeros(t, k, dtype=torch.float32))


def _handle(buf, n: int = 7, t: int = T) -> DispatchHandle:
    c = _channels(buf)
    i32 = torch.int32
    return DispatchHandle(torch.zeros(R, R, dtype=i32), torch.zeros(R, c, dtype=i32), torch.zeros(R, c, dtype=i32),
                          torch.zeros(n, dtype=i32), torch.zeros(t, R, dtype=torch.bool), torch.zeros(t, R, dtype=i32))


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


# ----------------------------------------------------------------------------- fake shapes


def test_fake_shapes_with_num_worst_tokens(buf):
    c = _channels(buf)
    with FakeTensorMode():
        x, idx, w = _inputs()
        out = ops.dispatch(buf, x, idx, w, E, num_worst_tokens=W)
        assert (_shape(out.recv_x), out.recv_x.dtype) == ((W, H), torch.bfloat16)
        assert (_shape(out.recv_topk_idx), out.recv_topk_idx.dtype) == ((W, K), torch.int64)
        assert (_shape(out.recv_topk_weights), out.recv_topk_weights.dtype) == ((W, K), torch.float32)
        assert (_shape(out.num_recv_tokens_per_expert), out.num_recv_tokens_per_expert.dtype) == ((E // R,),
                                                                                                   torch.int32)
        h = out.handle
        assert isinstance(h, DispatchHandle)
        expected = {"rank_prefix_matrix": ((R, R), torch.int32), "channel_prefix_matrix": ((R, c), torch.int32),
                    "recv_channel_prefix_matrix": ((R, c), torch.int32), "recv_src_idx": ((W,), torch.int32),
                    "is_token_in_rank": ((T, R), torch.bool), "send_head": ((T, R), torch.int32)}
        assert {f: (_shape(getattr(h, f)), getattr(h, f).dtype) for f in h._fields} == expected

        y = ops.combine(buf, out.recv_x, h, out.recv_topk_weights)
        assert (_shape(y.combined_x), y.combined_x.dtype) == ((T, H), torch.bfloat16)
        assert (_shape(y.combined_topk_weights), y.combined_topk_weights.dtype) == ((T, K), torch.float32)
        assert ops.combine(buf, out.recv_x, h).combined_topk_weights is None
        z = ops.cached_dispatch(buf, x, h)
        assert (_shape(z), z.dtype) == ((W, H), torch.bfloat16)


def test_fake_shapes_data_dependent_rows(buf):
    """``num_worst_tokens=0``: the row count is one unbacked size shared by every received tensor."""
    with FakeTensorMode(shape_env=ShapeEnv()):
        x, idx, w = _inputs()
        out = ops.dispatch(buf, x, idx, w, E)
        n = out.recv_x.shape[0]
        assert isinstance(n, torch.SymInt), f"expected an unbacked row count, got {n!r}"
        rows = [out.recv_topk_idx.shape[0], out.recv_topk_weights.shape[0], out.handle.recv_src_idx.shape[0]]
        assert [str(r) for r in rows] == [str(n)] * 3
        assert _shape(out.handle.is_token_in_rank) == (T, R)
        y = ops.combine(buf, out.recv_x, out.handle, out.recv_topk_weights)
        assert _shape(y.combined_x) == (T, H) and _shape(y.combined_topk_weights) == (T, K)
        assert str(ops.cached_dispatch(buf, x, out.handle).shape[0]) == str(n)


def test_fake_backward_shapes(buf):
    """Backward runs the fake combine (dispatch's backward) and cached dispatch (combine's)."""
    with FakeTensorMode():
        x, idx, w = _inputs()
        x.requires_grad_()
        w.requires_grad_()
        out = ops.dispatch(buf, x, idx, w, E, num_worst_tokens=W)
        y = (out.recv_x.float() * out.recv_topk_weights.sum(1, keepdim=True)).to(torch.bfloat16)
        c = ops.combine(buf, y, out.handle, out.recv_topk_weights)
        (c.combined_x.float().sum() + c.combined_topk_weights.sum()).backward()
        assert (_shape(x.grad), x.grad.dtype) == ((T, H), torch.bfloat16)
        assert (_shape(w.grad), w.grad.dtype) == ((T, K), torch.float32)


def test_fake_raw_op_checks_shapes(buf):
    """The raw op validates too (under torch.compile nothing else sees the call)."""
    bid = ops.register_buffer(buf)
    with FakeTensorMode():
        x, idx, w = _inputs()
        with pytest.raises(ValueError, match=r"topk_weights must have shape \(5, 3\), got \(5, 2\)"):
            torch.ops.epcomm.dispatch(bid, x, idx, w[:, :2], E, 0)
        with pytest.raises(ValueError, match="x must have the 7 rows of the handle, got shape \\(6, 16\\)"):
            torch.ops.epcomm.combine(bid, torch.zeros(6, H, dtype=torch.bfloat16), *_handle(buf), None)


# ----------------------------------------------------------------------------- the buffer registry


def test_register_buffer_is_idempotent(buf):
    bid = ops.register_buffer(buf)
    assert isinstance(bid, int) and ops.register_buffer(buf) == bid
    assert ops.get_buffer(bid) is buf


def test_registry_does_not_keep_buffers_alive(buf):
    other = epcomm.Buffer(dist.group.WORLD)
    bid = ops.register_buffer(other)
    assert bid != ops.register_buffer(buf)
    del other
    gc.collect()
    with pytest.raises(ValueError, match=f"buffer_id={bid} names no live Buffer"):
        ops.get_buffer(bid)


def test_register_buffer_rejects_other_objects():
    with pytest.raises(TypeError, match="buffer must be an epcomm.Buffer, got dict"):
        ops.register_buffer({})


# ----------------------------------------------------------------------------- bad inputs


def _dispatch_args():
    x, idx, w = _inputs()
    return {"x": x, "topk_idx": idx, "topk_weights": w, "num_experts": E, "num_worst_tokens": 0}


@pytest.mark.parametrize("change,exc,match", [
    ({"x": torch.zeros(T, H)}, TypeError, "x must have dtype torch.bfloat16, got torch.float32"),
    ({"x": [[0.0] * H] * T}, TypeError, "x must be a torch.Tensor, got list"),
    ({"x": torch.zeros(T * H, dtype=torch.bfloat16)}, ValueError, r"x must be 2-D, got shape \(80,\)"),
    ({"x": torch.zeros(T, 12, dtype=torch.bfloat16)}, ValueError, "multiple of 8.*got 12"),
    ({"topk_idx": torch.zeros(T, K, dtype=torch.int32)}, TypeError,
     "topk_idx must have dtype torch.int64, got torch.int32"),
    ({"topk_idx": torch.zeros(T - 1, K, dtype=torch.int64), "topk_weights": torch.zeros(T - 1, K)}, ValueError,
     r"x has 5 rows but topk_idx has 4"),
    ({"topk_idx": torch.zeros(T, 33, dtype=torch.int64), "topk_weights": torch.zeros(T, 33)}, ValueError,
     "topk_idx has top-k 33; at most 32 is supported"),
    ({"topk_weights": torch.zeros(T, K, dtype=torch.float64)}, TypeError,
     "topk_weights must have dtype torch.float32, got torch.float64"),
    ({"topk_weights": torch.zeros(T, K + 1)}, ValueError, r"topk_weights must have shape \(5, 3\), got \(5, 4\)"),
    ({"num_experts": 6}, ValueError, r"num_experts=6 must be divisible by the number of ranks \(4\)"),
    ({"num_experts": "8"}, TypeError, "num_experts must be an int, got '8'"),
    ({"num_worst_tokens": -1}, ValueError, "num_worst_tokens must be >= 0, got -1"),
    ({"num_worst_tokens": 2.0}, TypeError, "num_worst_tokens must be an int, got 2.0"),
])
def test_dispatch_bad_inputs(buf, change, exc, match):
    args = {**_dispatch_args(), **change}
    with pytest.raises(exc, match=match):
        ops.dispatch(buf, **args)


def test_dispatch_bad_buffer():
    x, idx, w = _inputs()
    with pytest.raises(TypeError, match="buffer must be an epcomm.Buffer, got str"):
        ops.dispatch("buffer", x, idx, w, E)


def test_dispatch_expert_out_of_range(buf):
    """Value checks run where the op really runs (in ``Buffer``), before any communication."""
    x, idx, w = _inputs()
    idx[2, 1] = E + 91
    with pytest.raises(ValueError, match=f"topk_idx holds expert id {E + 91}, outside \\[-1, {E}\\)"):
        ops.dispatch(buf, x, idx, w, E)


@pytest.mark.parametrize("what,exc,match", [
    ("handle", TypeError, "handle must be the DispatchHandle dispatch returned, got str"),
    ("short_handle", TypeError, "handle must be the DispatchHandle dispatch returned, got tuple"),
    ("x_rows", ValueError, r"x must have the 7 rows of the handle, got shape \(8, 16\)"),
    ("x_dtype", TypeError, "x must have dtype torch.bfloat16, got torch.float16"),
    ("x_hidden", ValueError, "multiple of 8.*got 20"),
    ("w_rows", ValueError, r"topk_weights must have the 7 rows of the handle, got shape \(6, 3\)"),
    ("w_dtype", TypeError, "topk_weights must have dtype torch.float32, got torch.bfloat16"),
    ("in_rank_cols", ValueError, r"handle.is_token_in_rank must have 4 columns .*got shape \(5, 3\)"),
    ("prefix_dtype", TypeError, "handle.rank_prefix_matrix must have dtype torch.int32, got torch.int64"),
])
def test_combine_bad_inputs(buf, what, exc, match):
    h = _handle(buf)
    x = torch.zeros(7, H, dtype=torch.bfloat16)
    w = torch.zeros(7, K)
    if what == "handle":
        h = "handle"
    elif what == "short_handle":
        h = tuple(h)[:5]
    elif what == "x_rows":
        x = torch.zeros(8, H, dtype=torch.bfloat16)
    elif what == "x_dtype":
        x = x.half()
    elif what == "x_hidden":
        x = torch.zeros(7, 20, dtype=torch.bfloat16)
    elif what == "w_rows":
        w = torch.zeros(6, K)
    elif what == "w_dtype":
        w = w.bfloat16()
    elif what == "in_rank_cols":
        h = h._replace(is_token_in_rank=torch.zeros(T, R - 1, dtype=torch.bool))
    elif what == "prefix_dtype":
        h = h._replace(rank_prefix_matrix=h.rank_prefix_matrix.long())
    with pytest.raises(exc, match=match):
        ops.combine(buf, x, h, w)


def test_cached_dispatch_bad_inputs(buf):
    h = _handle(buf)
    with pytest.raises(ValueError, match=r"x must have the 5 rows of the handle, got shape \(7, 16\)"):
        ops.cached_dispatch(buf, torch.zeros(7, H, dtype=torch.bfloat16), h)
    with pytest.raises(TypeError, match="x must have dtype torch.bfloat16, got torch.float32"):
        ops.cached_dispatch(buf, torch.zeros(T, H), h)


# ----------------------------------------------------------------------------- weight rows as bytes


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 8, 11])
def test_weight_rows_travel_as_bf16_bit_exact(k):
    """Combine's backward sends float32 weight-gradient rows as BF16 bytes: the round trip is exact
    (NaN payloads, infinities, -0.0 and subnormals included) and rows stay 16-byte multiples."""
    w = torch.randn(6, k)
    special = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45, -3.4e38, 2.0 ** -126])
    w.view(-1)[: min(w.numel(), special.numel())] = special[: w.numel()]
    w.view(-1)[-1:] = torch.tensor([0x7FC00123], dtype=torch.int32).view(torch.float32)  # NaN with payload
    b = ops._f32_as_bf16(w)
    assert b.dtype == torch.bfloat16 and b.shape[1] % 8 == 0
    back = ops._bf16_as_f32(b, k)
    assert torch.equal(back.view(torch.int32), w.view(torch.int32))
