"""``arena.Block``: one allocation, views of the planned dtypes and shapes, 16-byte aligned, apart, fresh."""

import pytest
import torch

from epcomm.arena import Block

PARTS = [(torch.int32, (2, 2)), (torch.int64, (4, 8)), (torch.bool, (3,)), (torch.float32, (0, 5)),
         (torch.bfloat16, (5, 7)), (torch.uint8, (9,)), (torch.float32, (3, 1))]


def test_parts_are_planned_views_of_one_allocation():
    b = Block(PARTS, "cpu")
    ts = b.make()
    assert [(t.dtype, tuple(t.shape)) for t in ts] == [(d, s) for d, s in PARTS]
    base = ts[0].untyped_storage().data_ptr()
    spans = []
    for t in ts:
        assert t.is_contiguous()
        if t.numel():
            assert t.untyped_storage().data_ptr() == base  # one allocation
            assert t.data_ptr() % 16 == 0
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    assert all(a[1] <= b_[0] for a, b_ in zip(spans, spans[1:])), spans  # no two parts overlap
    assert spans[-1][1] - base <= b.nbytes
    # writing one part changes no other
    for i, t in enumerate(ts):
        if t.numel():
            t.view(torch.uint8).fill_(i + 1)
    for i, t in enumerate(ts):
        if t.numel():
            assert bool((t.view(torch.uint8) == i + 1).all()), i


def test_each_make_is_fresh_memory():
    b = Block(PARTS, "cpu")
    first, second = b.make(), b.make()
    assert first[1].untyped_storage().data_ptr() != second[1].untyped_storage().data_ptr()


def test_bad_parts_are_refused():
    with pytest.raises(TypeError, match="dtype"):
        Block([("int32", (2,))], "cpu")
    with pytest.raises(ValueError, match="negative"):
        Block([(torch.int32, (2, -1))], "cpu")


def test_separate_allocations_gives_each_part_its_own_storage():
    from epcomm.arena import separate_allocations

    b = Block(PARTS, "cpu")
    with separate_allocations():
        ts = b.make()
    assert [(t.dtype, tuple(t.shape)) for t in ts] == [(d, s) for d, s in PARTS]
    ptrs = [t.untyped_storage().data_ptr() for t in ts if t.numel()]
    assert len(set(ptrs)) == len(ptrs)
    again = b.make()  # outside: one storage again
    assert again[1].untyped_storage().data_ptr() == again[0].untyped_storage().data_ptr()


def test_ops_dispatch_outputs_are_allocated_apart_not_cloned(monkeypatch):
    """``epcomm.ops``'s dispatch op runs the Buffer's calls inside ``separate_allocations``: a backend's block
    outputs come out apart, so the op's no-alias rule (``ops._fresh``) clones none of them."""
    from epcomm import ops
    from epcomm.layout import DispatchHandle

    t, h, k, e, r_, c = 4, 8, 2, 4, 1, 2
    i32, i64, f32 = torch.int32, torch.int64, torch.float32
    lay = Block([(i32, (r_,)), (i32, (e,)), (torch.bool, (t, r_))], "cpu")
    outs = Block([(i32, (r_, r_)), (i32, (r_, c)), (i32, (r_, c)), (i32, (t,)), (i32, (t, r_)), (i64, (t, k)),
                  (f32, (t, k))], "cpu")

    class Buf:
        group_size = r_

        def get_dispatch_layout(self, topk_idx, num_experts):
            per_rank, per_expert, in_rank = lay.make()
            return per_rank, None, per_expert, in_rank, None

        def dispatch(self, x, **kw):
            rpm, cpm, rcp, src, head, idx, w = outs.make()
            idx.copy_(kw["topk_idx"])
            return x.clone(), idx, w, None, DispatchHandle(rpm, cpm, rcp, src, kw["is_token_in_rank"], head), None

    monkeypatch.setattr(ops, "get_buffer", lambda _id: Buf())
    monkeypatch.setattr(ops, "_check_dispatch", lambda *a: None, raising=False)
    clones = []
    real = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda self, *a, **kw: clones.append(self.shape) or real(self, *a, **kw))
    x = torch.zeros(t, h, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])
    out = ops._dispatch_op(0, x, idx, torch.ones(t, k), e, 0)
    ptrs = [o.untyped_storage().data_ptr() for o in out if o.numel()]
    assert len(set(ptrs)) == len(ptrs)
    assert not [s for s in clones if s != x.shape], clones  # (recv_x's clone is the fake's own)
