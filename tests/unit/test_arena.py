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
