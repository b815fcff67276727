"""Launching Triton kernels through their compiled kernels, bound once per specialisation.

``fn[grid](*args, **kw)`` re-binds every argument on every call (Triton's binder, a cache-key string,
launch metadata), and its C launcher asks the driver about every tensor pointer: 18.4 microseconds of
host time for a 5-argument kernel on an H100 host, against 4.5 for Triton's C launcher alone
(benchmarks/2026-11-25/h100-host-primitives.txt); the kernels here take 20-45 arguments, and a
one-token low-latency dispatch takes 11.8 microseconds on that GPU (BENCHMARKS.md). A :class:`Launcher` compiles each
specialisation once through Triton's own path (the first call for a key launches through it), then
calls the compiled kernel's launcher directly.

The key: Triton compiles one kernel per (constexpr values and launch options; dtypes of the pointer
arguments; for each integer argument not in ``do_not_specialize``, whether it is 1 or divisible by 16,
and whether it fits 32 bits; whether each pointer is 16-byte aligned). The constexprs and options given
by keyword join the key by themselves; the caller's ``key`` names the rest that can change between its
calls (shapes and flags it derives integers from, the alignment of tensors a user passes). Runtime
arguments are passed positionally. With ``EPCOMM_VERIFY_LAUNCH=1`` (the GPU tests set it) every launch
also runs Triton's binder and raises if the kernel bound to the key is not the one Triton would pick.

:class:`Ptr` is a persistent buffer's address as an ``int`` that remembers its tensor: the launcher
passes it to the driver as it is (no ``data_ptr()`` call and no driver query per launch), and Triton's
binder sees the tensor when a key is bound. Make one per buffer view, once.

:class:`Direct` is one launch of a :class:`Prepared` whose arguments are fixed but for a few per-call
tensors (the holes): once bound, a call goes through ``Direct.fast``, a function generated for that
launch (:func:`_direct_call`) that takes each hole's address and calls the C launcher with every fixed argument
in place (no argument list to fill, no loop: the low-latency calls' eager path).

Under the Triton interpreter (CPU runs: ``TRITON_INTERPRET=1``) a launcher calls ``fn[grid]`` as usual.
"""

from __future__ import annotations

import inspect
import struct

import torch

from .. import _env
from ..native import no_stream, param

_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


class Ptr(int):
    """The address of ``tensor`` (a persistent buffer or view); ``Ptr(t)`` keeps ``t`` alive."""

    tensor: torch.Tensor

    def __new__(cls, tensor: torch.Tensor) -> Ptr:
        p = super().__new__(cls, tensor.data_ptr())
        p.tensor = tensor
        return p


def _tensors(args) -> tuple:
    return tuple(a.tensor if type(a) is Ptr else a for a in args)


class _Bound:
    """One compiled specialisation and how to launch it. Where the kernel needs no scratch memory (none of
    ours does) the launch goes straight to the C launcher that Triton built for it (``launch``),
    skipping ``CudaLauncher.__call__``; otherwise through it (``run``)."""

    __slots__ = ("run", "launch", "head", "function", "packed", "tail", "key", "types")

    def __init__(self, kernel, tail: tuple, key) -> None:
        run = kernel.run  # initialises the kernel's handles (the first launch already did)
        self.run, self.function, self.packed = run, kernel.function, kernel.packed_metadata
        # each parameter's type as the launcher passes it ("*i32", "i32", "fp32", "constexpr": not passed), for
        # Direct.step; None where Triton does not say
        sig = getattr(getattr(kernel, "src", None), "signature", None)
        self.types = tuple(sig.values()) if isinstance(sig, dict) else None
        self.tail = tail
        self.key = key  # Triton's own cache key (EPCOMM_VERIFY_LAUNCH)
        self.launch = getattr(run, "launch", None)
        if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
            self.launch = None
        if self.launch is not None:
            # launch(gx, gy, gz, stream, function, cooperative, pdl, global_scratch, profile_scratch,
            #        packed_metadata, launch_metadata, enter_hook, exit_hook, *args): triton 3.4-3.6
            self.head = (run.launch_cooperative_grid, run.launch_pdl, None, None, self.packed, None, None,
                         None)


def _go(b: _Bound, grid: tuple, stream: int, args: tuple) -> None:
    n = len(grid)
    g1 = grid[1] if n > 1 else 1
    g2 = grid[2] if n > 2 else 1
    if b.launch is not None:
        b.launch(grid[0], g1, g2, stream, b.function, *b.head, *args, *b.tail)
    else:
        b.run(grid[0], g1, g2, stream, b.function, b.packed, None, None, None, *args, *b.tail)


class Launcher:
    """``fn`` (a ``@triton.jit`` kernel) launched as ``launcher(key, grid, *args, **constexprs_and_options)``.

    Counts every launch in ``Launcher.launches`` (the tests bound the launches per call with it)."""

    launches = 0

    def __init__(self, fn) -> None:
        # torch's requires_nvshmem wraps a kernel (GridCallableWithExtern) so that Triton links NVSHMEM's
        # device library (extern_libs) and initialises the module once it is compiled (a post-compile
        # hook): bound here through the kernel itself with those extern_libs, then launched as any other
        self.extra = {"extern_libs": fn.extern_libs} if hasattr(fn, "jit_func") and hasattr(fn, "extern_libs") \
            else {}
        fn = fn.jit_func if self.extra else fn
        self.fn = fn
        self.name = getattr(getattr(fn, "fn", fn), "__name__", repr(fn))
        self.interpreted = not hasattr(fn, "device_caches")  # the interpreter's InterpretedFunction
        self.verify = _env.verify_launch()
        self.bound: dict = {}
        self._get_stream = self._dev = None  # the driver's stream lookup and the device, at the first bind
        self._params = None

    def __call__(self, key, grid: tuple, *args, **kw) -> None:
        Launcher.launches += 1
        if self.interpreted:
            self.fn[grid](*_tensors(args), **kw, **self.extra)
            return
        k = (key, *kw.values())
        b = self.bound.get(k)
        if b is None:
            self._bind(k, grid, args, kw)
            return
        if self.verify:
            self._check(b, args, kw)
        _go(b, grid, self._get_stream(self._dev), args)

    def arg_names(self) -> tuple[str, ...]:
        """The kernel's parameters in its signature's order: a launch passes its runtime arguments
        positionally in this order, then constexprs and options by keyword."""
        names = getattr(self, "_names", None)
        if names is None:
            names = self._names = tuple(inspect.signature(getattr(self.fn, "fn", self.fn)).parameters)
        return names

    def prepared(self, key, consts: dict) -> Prepared:
        """A launcher for one key whose constexprs and options (``consts``) are fixed: ``p(grid, *args)``
        costs no keyword dictionary and no key lookup per call."""
        return Prepared(self, (key, *consts.values()), consts)

    # ------------------------------------------------------------------ binding (once per key)

    def _bind(self, k, grid, args, kw) -> None:
        from triton.runtime import driver

        fn = self.fn
        if self._params is None:
            self._params = list(inspect.signature(fn.fn).parameters.values())
            self._get_stream, self._dev = driver.active.get_current_stream, driver.active.get_current_device()
        params = self._params
        const_names = {p.name for p in fn.params if p.is_constexpr}
        for name in kw:
            if name not in _OPTIONS and name not in const_names:
                raise TypeError(f"{self.name}: pass runtime argument {name!r} positionally (keywords are "
                                "constexprs and launch options, part of the key)")
        tail = []
        for p in params[len(args):]:
            if p.name in kw:
                tail.append(kw[p.name])
            elif p.default is not inspect.Parameter.empty:
                tail.append(p.default)
            else:
                raise TypeError(f"{self.name}: missing argument {p.name!r}")
        kernel = fn.run(*_tensors(args), grid=grid, warmup=False, **kw, **self.extra)  # compiles if new; launches
        if hasattr(kernel, "result"):
            kernel = kernel.result()
        self.bound[k] = _Bound(kernel, tuple(t.value if hasattr(t, "value") else t for t in tail),
                               self._triton_key(args, kw))

    def _triton_key(self, args, kw) -> str | None:
        if not self.verify:
            return None
        from triton import knobs
        from triton.runtime import driver
        from triton.runtime.jit import compute_cache_key

        _, key_cache, _, _, binder = self.fn.device_caches[driver.active.get_current_device()]
        opts = dict(kw, **self.extra)  # as JITFunction.run completes them
        opts["debug"] = opts.get("debug", self.fn.debug) or knobs.runtime.debug
        opts["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        _, spec, options = binder(*_tensors(args), **opts)
        return compute_cache_key(key_cache, spec, options)

    def _check(self, b: _Bound, args, kw) -> None:
        got = self._triton_key(args, kw)
        if got != b.key:
            raise AssertionError(f"{self.name}: the launch key does not determine Triton's specialisation:\n"
                                 f"bound: {b.key}\nnow:   {got}")


class Prepared:
    """``Launcher.prepared``: one key, its constexprs fixed. Once ``fast`` is True (bound, and not
    verifying), a caller may pass a per-call tensor's ``data_ptr()`` in its place: the driver then is
    not asked about that pointer at every launch (the key already fixed its dtype and alignment)."""

    __slots__ = ("launcher", "k", "consts", "b", "get_stream", "dev", "fast")

    def __init__(self, launcher: Launcher, k: tuple, consts: dict) -> None:
        self.launcher, self.k, self.consts, self.b = launcher, k, consts, None
        self.get_stream = self.dev = None
        self.fast = False

    def chain_stream(self) -> tuple:
        """``(get_stream, device)``: where a ``native.Chain`` of this launch finds the current stream at each call
        (Triton's driver once bound; a stand-in giving 0 where there is none: CPU tests)."""
        return (self.get_stream or no_stream), self.dev

    def __call__(self, grid: tuple, *args) -> None:
        b = self.b
        if b is None or self.launcher.verify:
            self.launcher(self.k[0], grid, *args, **self.consts)  # binds (once), launches, verifies
            self.b = self.launcher.bound.get(self.k)
            if self.b is not None:
                self.get_stream, self.dev = self.launcher._get_stream, self.launcher._dev
                self.fast = not self.launcher.verify
            return
        Launcher.launches += 1
        _go(b, grid, self.get_stream(self.dev), args)


_data_ptr = torch.Tensor.data_ptr
# a kernel parameter's bytes by its type (a pointer: 8), as Triton's launcher passes it
_SIZES = {"i1": 1, "i8": 1, "u1": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4, "i64": 8, "u64": 8, "fp32": 4,
          "f32": 4, "fp64": 8}


class Direct:
    """``go(gx, gy, gz, *tensors)``: ``prepared`` launched with the arguments ``template``, where the
    positions ``holes`` take ``tensors`` (per-call tensors, or plain ``int`` scalars, in order). Until ``prepared`` is bound, and
    while verifying (``EPCOMM_VERIFY_LAUNCH``) or under the interpreter, the launch goes through
    ``prepared`` with the tensors themselves; after, through the C launcher with their addresses:
    ``fast`` (None until then) is that launch as a function of its own (:func:`_direct_call`), which a caller
    may call instead of the ``Direct`` (one frame less).

    Example: ``Direct(p, (None, None, 7, buf), (0, 1))(128, 2, 1, x, topk)`` launches ``p`` on the grid
    ``(128, 2, 1)`` with ``(x, topk, 7, buf)``."""

    __slots__ = ("p", "template", "holes", "launch", "args", "first", "get_stream", "dev", "fast")

    def __init__(self, prepared: Prepared, template: tuple, holes: tuple) -> None:
        self.p, self.template, self.holes = prepared, tuple(template), tuple(holes)
        self.launch = self.fast = None

    @classmethod
    def named(cls, prepared: Prepared, args: dict, holes: tuple = ()) -> Direct:
        """A ``Direct`` whose arguments are named by the kernel's parameters: ``args`` gives every runtime
        parameter by name (a hole's value: None, or anything: it is replaced at each call), ``holes`` the names
        of the per-call ones, in the order a call passes them. The positions come from the kernel's signature
        (``Launcher.arg_names``), so a parameter renamed, added or moved is an error here, at the plan's
        making, naming it; never an argument in the wrong place.

        Example: for ``@triton.jit def k(x, n, out, BLOCK: tl.constexpr)``, ``Direct.named(p, dict(x=None, n=7,
        out=None), ("x", "out"))`` is ``Direct(p, (None, 7, None), (0, 2))``."""
        names = prepared.launcher.arg_names()
        given = tuple(args)
        runtime = names[:len(given)]
        if set(given) != set(runtime) or set(holes) - set(given):
            unknown = sorted(set(given) - set(names)) + sorted(set(holes) - set(given))
            missing = [n for n in runtime if n not in args]
            raise TypeError(f"{prepared.launcher.name}: launch arguments by name must be its first {len(given)} "
                            f"parameters {list(runtime)}; unknown or not given: {unknown}, missing: {missing}")
        return cls(prepared, tuple(args[n] for n in runtime), tuple(runtime.index(h) for h in holes))

    def __call__(self, gx: int, gy: int, gz: int, *tensors) -> None:
        fast = self.fast
        if fast is not None:
            if len(tensors) == len(self.holes):
                fast(gx, gy, gz, *tensors)
            else:  # (fewer: the other holes keep what they held)
                self._any(gx, gy, gz, *tensors)
            return
        args = list(self.template)
        for i, t in zip(self.holes, tensors):
            args[i] = t
        p = self.p
        p((gx, gy, gz), *args)
        b = p.b
        if p.fast and b is not None and b.launch is not None:  # bound: from now on, the direct way
            head = [b.function, *b.head]
            self.first = len(head)
            self.args = head + [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in self.template] \
                + list(b.tail)
            self.get_stream, self.dev = p.get_stream, p.dev
            self.launch = b.launch
            if len(tensors) == len(self.holes):
                self.fast = _direct_call(self, tuple(isinstance(t, int) for t in tensors))

    def step(self, grid: tuple, holes: tuple):
        """This launch as a step of a ``native.Chain``: ``grid`` three sources, ``holes`` a source for each hole
        (``native.const``, ``addr``, ``out``, ``num``); the fixed arguments as bound. None where it cannot be one:
        not bound yet, verifying (``EPCOMM_VERIFY_LAUNCH``: every launch goes through Triton's binder), a
        launch with scratch memory, clusters, cooperative or PDL, or types this does not know."""
        p = self.p
        b = p.b
        if not p.fast or b is None or b.launch is None or b.types is None or len(holes) != len(self.holes):
            return None
        coop, pdl = b.head[0], b.head[1]
        num_warps, num_ctas, shared = b.packed
        values = list(self.template) + list(b.tail)
        if coop or pdl or num_ctas != 1 or len(values) != len(b.types):
            return None
        at = dict(zip(self.holes, holes))
        params = []
        for i, (ty, v) in enumerate(zip(b.types, values)):
            if ty == "constexpr":
                continue
            size = 8 if ty[0] == "*" else _SIZES.get(ty)
            if size is None:
                return None
            if i in at:
                params.append(param(at[i], size))  # (native.const of a tensor: its address)
                continue
            if ty[0] == "*":
                src = (0, 0, 0 if v is None else v.data_ptr() if isinstance(v, torch.Tensor) else int(v))
            elif ty in ("fp32", "f32"):
                src = (0, 0, struct.unpack("<I", struct.pack("<f", float(v)))[0])
            elif ty == "fp64":
                src = (0, 0, struct.unpack("<q", struct.pack("<d", float(v)))[0])
            else:
                src = (0, 0, int(v))
            params.append((*src, size))
        params += [(0, 0, 0, 8), (0, 0, 0, 8)]  # the global and profile scratch: none
        return (b.function, [(*g, 4) for g in grid], 32 * num_warps, shared, params)

    def _any(self, gx: int, gy: int, gz: int, *tensors) -> None:
        """The bound launch with holes of any kind (a tensor, a ``Ptr`` or an ``int`` in any hole)."""
        a = self.args
        f = self.first
        for i, t in zip(self.holes, tensors):
            a[f + i] = t if isinstance(t, int) else _data_ptr(t)  # an int, or a Ptr
        Launcher.launches += 1
        self.launch(gx, gy, gz, self.get_stream(self.dev), *a)


def _direct_call(d: Direct, ints: tuple):
    """``d``'s bound launch as a generated function ``go(gx, gy, gz, h0, h1, ...)``: the C launcher called with
    ``d``'s fixed arguments and, in the holes, each ``h`` as it is where the binding call passed an ``int``
    there (``ints[i]``), else its ``data_ptr()``. A call whose holes are not of those kinds (an int or a
    ``Ptr`` where a tensor was) goes through ``Direct._any``.

    Example: for ``Direct(p, (None, 7, None), (0, 2))`` bound with ``(x, 5)``: ``go(gx, gy, gz, h0, h1)``
    runs ``launch(gx, gy, gz, stream, <head>, dp(h0), 7, h1, <tail>)``."""
    f = d.first
    at = {f + j: i for i, j in enumerate(d.holes)}
    names = [f"h{i}" for i in range(len(d.holes))]
    ptrs = [f"p{i} = dp(h{i})" for i, is_int in enumerate(ints) if not is_int]
    args = [(f"h{at[j]}" if ints[at[j]] else f"p{at[j]}") if j in at else f"c{j}" for j in range(len(d.args))]
    hs = ", ".join(names)
    src = (f"def go(gx, gy, gz, {hs}):\n"
           f"    try:\n        {'; '.join(ptrs) or 'pass'}\n"
           f"    except TypeError:\n        return slow(gx, gy, gz, {hs})\n"
           f"    launch(gx, gy, gz, stream(dev), {', '.join(args)})\n"
           f"    L.launches += 1\n")
    # the fixed arguments, each a global name of the generated function (``c<position>``)
    ns = dict(dp=_data_ptr, slow=d._any, launch=d.launch, stream=d.get_stream, dev=d.dev, L=Launcher)
    ns.update((f"c{j}", v) for j, v in enumerate(d.args) if j not in at)
    exec(compile(src, f"<Direct {d.p.launcher.name}>", "exec"), ns)
    return ns["go"]
