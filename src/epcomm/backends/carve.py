"""A call's outputs of one dtype as views of one allocation (``TUNE["alloc_blocks"]``).

On a GPU host each ``torch.empty`` whose tensor outlives the call costs about 4 us (the caching allocator, then
its free), and a V2 dispatch makes eleven (``hostprobe --modes profile``, benchmarks/2026-11-27/s9). A
:class:`Carve` makes the tensors of one dtype from one ``torch.empty`` and one C call that returns every view
(``torch._C._nn.unflatten_dense_tensors``, the call torch's own flatten utilities use): one allocation and one
free for all of them. Each part starts at a 16-byte boundary (Triton specialises kernels on their pointers'
16-byte alignment, and the launch keys assume it). The parts share one storage: it lives while any of them
does, and none overlaps another.
"""

from __future__ import annotations

import math
import operator

import torch

ALIGN = 16  # bytes: each part's start

_unflatten = torch._C._nn.unflatten_dense_tensors


class Carve:
    """``Carve(dtype, shapes)(device)``: a tuple of tensors of ``shapes`` (contiguous; zero-size ones too).

    Example: ``Carve(torch.int32, [(2, 3), (5,)])("cpu")`` gives a ``(2, 3)`` and a ``(5,)`` tensor, the second
    from element 8 of their common storage (6 elements, then 2 of padding to its 16-byte boundary)."""

    __slots__ = ("dtype", "numel", "templates", "pick")

    def __init__(self, dtype: torch.dtype, shapes) -> None:
        per = max(ALIGN // torch.empty((), dtype=dtype).element_size(), 1)  # elements a 16-byte step
        templates, keep, at = [], [], 0
        for shape in shapes:
            if at % per:
                pad = per - at % per
                templates.append(torch.empty(pad, dtype=dtype, device="meta"))
                at += pad
            keep.append(len(templates))
            templates.append(torch.empty(shape, dtype=dtype, device="meta"))
            at += math.prod(shape)
        if not keep:
            raise ValueError("Carve needs at least one shape")
        self.dtype, self.numel, self.templates = dtype, at, templates
        self.pick = operator.itemgetter(*keep) if len(keep) > 1 else (lambda parts, i=keep[0]: (parts[i],))

    def __call__(self, device) -> tuple:
        return self.pick(_unflatten(torch.empty(self.numel, dtype=self.dtype, device=device), self.templates))
