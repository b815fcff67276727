"""Several tensors of one call in one allocation (``Block``): the host path's allocations, fewer.

On a GPU an eager call's ``torch.empty`` costs several µs of host time once the tensor it returns lives until the
next call (the caching allocator's search, then the free when the caller drops it): at DSv3 shapes, the eleven
outputs of an ``ElasticBuffer`` dispatch took more host time than its four launches. A view of a block costs less
than that (``as_strided`` of a dtype view of it). So a call's small outputs that live and die together (a
handle's tensors, the ids and weights beside them) come from one ``torch.empty`` and are views of it.

Only parts that share a lifetime belong to one block: the block's memory is freed when the last of its views
is. A dispatch's received rows (megabytes, dropped by a caller long before its handle) stay allocations of
their own; the small tensors a handle keeps may carry a few hundred KB of ids and weights with them.

Every part is contiguous and starts at a 16-byte boundary (Triton specialises its kernels on 16-byte
alignment of pointers: a part is aligned as a fresh allocation is, for that purpose). The shapes are known
when a plan is made (its kind of call), so the offsets are computed once; ``make()`` is one allocation and one
view a part (plus one dtype view per dtype).

Where outputs must share no storage (``epcomm.ops``: a custom op's outputs may not alias each other), the
caller runs the call inside :func:`separate_allocations`: ``make()`` then allocates each part on its own.

Example: ``Block([(torch.int32, (2, 2)), (torch.int64, (4, 8))], dev).make()`` gives an ``int32[2, 2]`` and an
``int64[4, 8]`` (at byte 16) of one 272-byte allocation.
"""

from __future__ import annotations

import contextlib
import math

import torch

_SEPARATE = [0]  # > 0 inside separate_allocations() (nested: a count)


@contextlib.contextmanager
def separate_allocations():
    """Within it, every ``Block.make()`` allocates each part on its own (no two outputs share a storage)."""
    _SEPARATE[0] += 1
    try:
        yield
    finally:
        _SEPARATE[0] -= 1


class Block:
    """The parts ``[(dtype, shape), ...]`` of one allocation on ``device``: ``make()`` -> the list of tensors,
    each contiguous, 16-byte aligned, of fresh (uninitialised) memory shared by no earlier call."""

    __slots__ = ("device", "nbytes", "parts", "dtypes")

    def __init__(self, parts, device) -> None:
        self.device = torch.device(device)
        off, plan = 0, []
        for dt, shape in parts:
            if not isinstance(dt, torch.dtype):
                raise TypeError(f"a part's dtype must be a torch.dtype, got {dt!r}")
            shape = tuple(int(s) for s in shape)
            if any(s < 0 for s in shape):
                raise ValueError(f"a part's shape must have no negative size, got {shape}")
            size = dt.itemsize
            off = -(-off // 16) * 16
            strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            plan.append((dt, shape, strides, off // size))
            off += math.prod(shape) * size
        self.nbytes = max(16, -(-off // 16) * 16)
        self.parts = tuple(plan)
        self.dtypes = tuple(dict.fromkeys(dt for dt, *_ in plan))

    def make(self) -> list:
        if _SEPARATE[0]:
            return [torch.empty(shape, dtype=dt, device=self.device) for dt, shape, _, _ in self.parts]
        blk = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        base = {dt: blk if dt == torch.uint8 else blk.view(dt) for dt in self.dtypes}
        return [base[dt].as_strided(shape, strides, at) for dt, shape, strides, at in self.parts]
