"""The host probe's CPU rig and its clock (``bench/hostprobe.py`` says what they are for).

The rig (:func:`install`): CUDA streams and events, the symmetric memory of one rank and Triton's driver
stood in for on a CPU, and every ``@triton.jit`` kernel of ``epcomm.kernels`` replaced by a stand-in that
``kernels/launch.Launcher`` binds as it binds a compiled kernel, whose C launcher does nothing. Like
``probe_calls.py``, hostprobe loads this file from its own tree, whichever tree it probes: it imports
nothing of epcomm but by absolute name, lazily.
"""

from __future__ import annotations

import os
import sys
import time
import types


_ARGS = [0]  # arguments handed to the C launcher (after its 13 fixed ones), summed, for the report


class _NoLaunch:
    """The compiled kernel's launcher slot (``CompiledKernel.run``): ``launch`` does nothing."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False
    @staticmethod
    def launch(*a) -> None:
        _ARGS[0] += len(a) - 13


class _Kernel:
    """Stands in for a ``@triton.jit`` kernel where ``kernels/launch.Launcher`` binds it: ``run`` (the first
    launch of a key) returns a compiled kernel whose launcher is :class:`_NoLaunch`, with a signature made from
    that launch's arguments (a tensor or None a pointer, an int ``i32``/``i64``, a float ``fp32``), as
    ``Direct.step`` reads it for a chain (``native.Chain``: dry in the rig, see :func:`install`)."""

    def __init__(self, jit) -> None:
        self.fn, self.params, self.device_caches, self.debug = jit.fn, jit.params, {}, False
        self.kernel = types.SimpleNamespace(run=_NoLaunch(), function=0, packed_metadata=(4, 1, 0))  # (no signature)

    def run(self, *args, grid, warmup, **kw):
        sig = {}
        for i, p in enumerate(self.params):
            v = args[i] if i < len(args) else kw.get(p.name)
            sig[p.name] = "constexpr" if p.is_constexpr or p.name in kw else \
                "fp32" if isinstance(v, float) else \
                ("i32" if -2**31 <= v < 2**31 else "i64") if isinstance(v, int) and not hasattr(v, "tensor") else "*i8"
        return types.SimpleNamespace(**vars(self.kernel), src=types.SimpleNamespace(signature=sig))


def _kernel_modules(package) -> list:
    """Every module of ``package`` (``epcomm.kernels``) that imports here (the NVSHMEM ones may not)."""
    import importlib
    import pkgutil

    out = []
    for info in pkgutil.iter_modules(package.__path__):
        try:
            out.append(importlib.import_module(f"{package.__name__}.{info.name}"))
        except ImportError:
            pass
    return out


def install(set_attr=setattr, setitem=None) -> None:
    """The CPU rig's stand-ins, through ``set_attr`` / ``setitem`` (pytest's monkeypatch undoes them):
    CUDA streams and events, the symmetric memory of one rank, Triton's driver, every kernel of
    ``epcomm.kernels``."""
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import triton
    from triton.runtime import driver

    import epcomm.kernels
    from epcomm.testing.cpu_nvlink import cuda_stand_ins

    cuda_stand_ins(set_attr, sms=132)
    mod = types.ModuleType("torch.distributed._symmetric_memory")
    mod.empty = lambda n, dtype=torch.uint8, device=None: torch.zeros(n, dtype=dtype)
    mod.rendezvous = lambda t, name: types.SimpleNamespace(
        buffer_ptrs=[t.data_ptr()], get_buffer=lambda r, shape, dtype: t.view(dtype).view(shape))
    setitem = setitem or (lambda d, key, v: d.__setitem__(key, v))
    setitem(sys.modules, "torch.distributed._symmetric_memory", mod)
    setitem(vars(torch.distributed), "_symmetric_memory", mod)
    set_attr(driver, "_active", types.SimpleNamespace(get_current_stream={0: 0}.get, get_current_device=lambda: 0))
    from epcomm import native

    set_attr(native, "DRY", True)  # (the chains of EPCOMM_NATIVE=all pack and read their values, launch nothing)
    for mod in _kernel_modules(epcomm.kernels):
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, triton.runtime.jit.JITFunction):
                set_attr(mod, name, _Kernel(obj))


# ----------------------------------------------------------------------------- measuring


def time_calls(prep, call, n: int, sync=None) -> list[int]:
    """Nanoseconds of ``call()`` each of ``n`` times (``prep()`` and ``sync()`` untimed, before)."""
    clock = time.perf_counter_ns
    out = []
    for _ in range(n):
        if prep is not None:
            prep()
        if sync is not None:
            sync()
        t0 = clock()
        call()
        out.append(clock() - t0)
    return out


def us_row(ns: list[int]) -> dict:
    """A row of nanosecond samples: ``us`` (median) and ``p10``, in µs."""
    ns = sorted(ns)
    return {"us": ns[len(ns) // 2] / 1e3, "p10": ns[len(ns) // 10] / 1e3}


def record_launches() -> dict:
    """From now on, every kernel bound by ``kernels/launch.Launcher`` also appends ``(launcher, args)`` of each
    C launch to ``rec["on"]`` while that is a list (``--modes launches``: a call's launches, replayed alone)."""
    from epcomm.kernels import launch

    rec: dict = {"on": None}
    init = launch._Bound.__init__

    def bound_init(self, *a, **kw):
        init(self, *a, **kw)
        real = self.launch
        if real is not None:
            def recorded(*args):
                if rec["on"] is not None:
                    rec["on"].append((real, args))
                return real(*args)
            self.launch = recorded

    launch._Bound.__init__ = bound_init
    return rec
