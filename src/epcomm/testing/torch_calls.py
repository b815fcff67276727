"""What a host path asks of torch, counted on a CPU (each torch call costs microseconds of host time on a
GPU host, so these counts are a host-time budget that tier 1 and tier 2 can bound without a GPU).

``TorchCalls`` (a ``TorchFunctionMode``) counts every torch function and tensor method the path calls
(``ops``), those of them that only read metadata (``meta``: ``.shape``, ``.dtype``, ``data_ptr()``...,
a fraction of a microsecond each) and those that allocate (``allocs``: their result has a storage none of their inputs had, so
``x.contiguous()`` of a contiguous ``x`` is no allocation). ``HostCount`` adds what would reach the GPU:
aten operators that launch a kernel there (``launches``: not views, not bare allocations), Triton kernel
launches (counted in ``launches`` and ``triton``), and reads of a device value on the host (``syncs``:
``.item()``, ``.tolist()``, ``bool(t)``: a host wait on a GPU). ``with count.paused():`` leaves a part
(a backend's own host path) out; a Triton launch is always left out of ``ops`` (the interpreter's own
torch calls are not the path's).

Example::

    with HostCount() as c:
        y = torch.arange(4) * 2
    (c.ops, c.allocs, c.launches, c.syncs) == (2, 2, 2, 0)
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_NO_KERNEL = {"empty", "empty_strided", "lift_fresh", "detach", "alias", "_local_scalar_dense", "set_",
              "resize_", "_to_copy_cpu_noop"}


META = {"__get__", "dim", "numel", "element_size", "get_device", "stride", "data_ptr", "is_contiguous", "size",
        "storage_offset", "nelement", "__len__", "is_floating_point"}


def _storages(obj, out: set) -> set:
    """The storages of the tensors in ``obj`` (tensors, and tuples, lists and dicts of them)."""
    if isinstance(obj, torch.Tensor):
        out.add(obj.untyped_storage()._cdata)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _storages(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _storages(o, out)
    return out


class TorchCalls(TorchFunctionMode):
    """Counts the torch functions and tensor methods a host path calls, and those that allocate;
    ``names`` lists them in order (``log=True``)."""

    def __init__(self, log: bool = False):
        super().__init__()
        self.ops = self.meta = self.allocs = 0
        self.names: list[str] | None = [] if log else None
        self.off = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.off:
            name = getattr(func, "__name__", str(func))
            self.ops += 1
            self.meta += name in META
            self.allocs += bool(_storages(out, set()) - _storages((args, kwargs), set()))
            if self.names is not None:
                self.names.append(name)
        return out


class _Aten(TorchDispatchMode):
    def __init__(self, owner: HostCount):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        o = self.owner
        if not o.calls.off:
            name = func.overloadpacket.__name__
            if name == "_local_scalar_dense":
                o.syncs += 1
            elif not func.is_view and name not in _NO_KERNEL:
                o.launches += 1
                if o.kernels is not None:
                    o.kernels.append(name)
        return func(*args, **(kwargs or {}))


class HostCount:
    """``TorchCalls`` plus kernel launches and host reads of device values (see the module docstring);
    ``log=True`` keeps the names (``calls.names``, ``kernels``)."""

    def __init__(self, log: bool = False):
        self.calls = TorchCalls(log)
        self.launches = self.syncs = self.triton = 0
        self.kernels: list[str] | None = [] if log else None
        self._stack = contextlib.ExitStack()

    @property
    def ops(self) -> int:
        return self.calls.ops

    @property
    def meta(self) -> int:
        return self.calls.meta

    @property
    def allocs(self) -> int:
        return self.calls.allocs

    def counts(self) -> dict:
        return {"ops": self.ops, "meta": self.meta, "allocs": self.allocs, "launches": self.launches,
                "syncs": self.syncs}

    @contextlib.contextmanager
    def paused(self):
        self.calls.off += 1
        try:
            yield
        finally:
            self.calls.off -= 1

    def _triton_run(self, run):
        count = self

        def counted(fn_self, *args, **kwargs):
            if not count.calls.off:
                count.launches += 1
                count.triton += 1
                if count.kernels is not None:
                    count.kernels.append("triton:" + getattr(getattr(fn_self, "fn", None), "__name__", "?"))
            with count.paused():
                return run(fn_self, *args, **kwargs)

        return counted

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        for cls in (InterpretedFunction, JITFunction):
            self._stack.callback(setattr, cls, "run", cls.run)
            cls.run = self._triton_run(cls.run)
        self._stack.enter_context(self.calls)
        self._stack.enter_context(_Aten(self))
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)
