"""Tier 1: ``kernels/launch.Direct``'s bound launch (``Direct.fast``, a function generated per launch) hands
the C launcher the same arguments as its generic loop: fixed arguments in place, each hole's tensor as its
``data_ptr()``, an ``int`` hole as it is, and a call whose holes are of other kinds (a ``Ptr`` or an int
where the binding call had a tensor) through the generic loop. No Triton: the prepared launch and its C
launcher are stand-ins that record what they get."""

from __future__ import annotations

import types

import torch

from epcomm.kernels.launch import Direct, Launcher, Ptr


class _Prepared:
    """Stands in for ``launch.Prepared`` once bound: its first call binds, then ``launch`` is the C launcher."""

    def __init__(self) -> None:
        self.calls: list = []
        self.b = None
        self.fast = False
        self.get_stream, self.dev = {0: 11}.get, 0
        self.launcher = types.SimpleNamespace(name="k")

    def __call__(self, grid, *args) -> None:
        self.calls.append(("prepared", grid, args))
        self.b = types.SimpleNamespace(function="F", head=("h1", "h2"), tail=("t1",),
                                       launch=lambda *a: self.calls.append(("launch", a)))
        self.fast = True


def _direct():
    p = _Prepared()
    keep = torch.zeros(4)
    return p, keep, Direct(p, (None, 7, None, keep, None), (0, 2, 4))


def test_bound_launch_passes_addresses_ints_and_fixed_arguments():
    p, keep, d = _direct()
    x, y = torch.zeros(3), torch.zeros(5)
    d(1, 2, 3, x, 5, y)  # binds: through the prepared launch, the tensors themselves
    assert p.calls[-1] == ("prepared", (1, 2, 3), (x, 7, 5, keep, y))
    assert d.fast is not None
    before = Launcher.launches
    a, b = torch.zeros(2), torch.zeros(6)
    d(4, 1, 1, a, 9, b)
    d.fast(5, 1, 1, b, 10, a)
    assert Launcher.launches == before + 2
    head = (4, 1, 1, 11, "F", "h1", "h2")
    assert p.calls[-2] == ("launch", head + (a.data_ptr(), 7, 9, keep.data_ptr(), b.data_ptr(), "t1"))
    assert p.calls[-1] == ("launch", (5,) + head[1:] + (b.data_ptr(), 7, 10, keep.data_ptr(), a.data_ptr(),
                                                         "t1"))


def test_holes_of_another_kind_take_the_generic_loop():
    p, keep, d = _direct()
    x, y = torch.zeros(3), torch.zeros(5)
    d(1, 1, 1, x, 5, y)
    d(2, 1, 1, Ptr(y), 6, 1234)  # a Ptr and an int where the binding call had tensors
    assert p.calls[-1] == ("launch", (2, 1, 1, 11, "F", "h1", "h2", y.data_ptr(), 7, 6, keep.data_ptr(), 1234,
                                      "t1"))
    d(3, 1, 1, x, 5, y)  # and the generated launch again after it
    assert p.calls[-1] == ("launch", (3, 1, 1, 11, "F", "h1", "h2", x.data_ptr(), 7, 5, keep.data_ptr(),
                                      y.data_ptr(), "t1"))


def test_named_arguments_take_the_kernels_order_and_reject_what_it_lacks():
    """``Direct.named``: arguments by the kernel's parameter names land at the signature's positions, holes
    by name; a name the kernel lacks, or a runtime parameter left out, is a TypeError naming it."""
    import pytest

    def kernel(x, n, out, stride, BLOCK=4):  # (the signature is all Direct.named reads)
        pass

    p = _Prepared()
    p.launcher = Launcher.__new__(Launcher)
    p.launcher.fn, p.launcher.name = kernel, "kernel"
    keep = torch.zeros(4)
    d = Direct.named(p, dict(stride=3, out=None, n=7, x=keep), ("out", "x"))
    assert d.template == (keep, 7, None, 3) and d.holes == (2, 0)
    with pytest.raises(TypeError, match="unknown or not given: \\['strides'\\]"):
        Direct.named(p, dict(x=None, n=7, out=None, strides=3), ("x",))
    with pytest.raises(TypeError, match="missing: \\['n'\\]"):
        Direct.named(p, dict(x=None, out=None, stride=3), ("x",))
    with pytest.raises(TypeError, match="unknown or not given: \\['y'\\]"):
        Direct.named(p, dict(x=None, n=7, out=None, stride=3), ("y",))
