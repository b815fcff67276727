"""A call's output tensors made, and where it can be its kernels launched, by one C++ call (on CUDA devices).

Why: on a GPU host each ``torch.empty`` whose result outlives the call costs ~4-6 us (Python's argument
parsing, the dispatcher, the caching allocator, the Python object; then its free), and a high-throughput
dispatch makes 8-12 of them: the largest single part of its host time (``hostprobe --modes profile``,
commit 42eeb3b). The same eleven tensors made by ``at::empty`` in one call into a small C++
extension took 27 us against 63 from Python on one H100 host (commit 1d65ff0). In whole calls, one process, calls
alternated (commit 0a52b55): a V2 contiguous no-sync dispatch 0.905x the host time, V1 ``num_worst_tokens`` 0.908x
(FP8 0.888x), the layout 0.910x, a synchronised dispatch 0.936x, the HT combine (two outputs) 0.977x; a cached
dispatch (one or two outputs) 1.03x, so it keeps ``torch.empty``.

:class:`Outputs` is one kind of call's output list, fixed once (shapes, dtypes, device); ``outs(rows)`` makes
them, a dimension given as ``ROWS`` taking ``rows``. The extension (its source ``native.cpp``, beside this
module) is built the first time a process asks for it (``torch.utils.cpp_extension.load``: a C++ compiler and
ninja; ~25 s once a machine for a given source and torch, then imported from torch's extension cache, from a folder
named by the source's content, :func:`cache_name`; the build's file lock lets ranks of one machine share one
build); a buffer asks for it when it is made, before its first collective (``backends/deadline.prepare_native``). Where it cannot be built (no compiler) the same tensors come from
``torch.empty``, and a warning says why once; ``EPCOMM_NATIVE=0`` turns it off, ``EPCOMM_NATIVE=all`` also on
CPU devices (for tests: :func:`wanted`). Every tensor is contiguous, as ``torch.empty`` makes it; each its own
allocation, but for those a plan marks ``packed`` (its small outputs, never the received rows): views of one
allocation, each from a 16-byte boundary, made in C++ without a call into the allocator each (that allocation
lives while any of them does: a few hundred KB at DSv3 shapes).

:class:`Chain`: where a call is only its outputs and launches (no host wait between them),
one call into the extension makes the outputs and launches the call's Triton kernels through the driver
(``cuLaunchKernel``, each kernel's parameters packed once from its bound launch, ``kernels/launch.Direct.step``,
and checked against the driver's own parameter list); per call only the caller's tensors and a few integers are
read. Under ``EPCOMM_VERIFY_LAUNCH`` and the Triton interpreter no chain is made (every launch goes through Triton).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys

import torch

from . import _env

log = logging.getLogger(__name__)

ROWS = -1  # a dimension that each call gives
# the extension's source, shipped in the package beside this module (pyproject.toml's package data)
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native.cpp")


def wanted(device: torch.device, on: bool = True) -> bool:
    """Whether plans on ``device`` take the native path, every part of it (their outputs by :class:`Outputs`,
    the small ones packed in one allocation, their launches as :class:`Chain` calls, a call's kind by the
    extension's signatures): on a CUDA device; also on CPU with ``EPCOMM_NATIVE=all`` (the tests' way to run
    this path without a GPU); never with ``EPCOMM_NATIVE=0``, which leaves the plain torch path (``on``: the
    caller's own condition)."""
    how = _env.native()
    return bool(on) and how != "0" and (device.type == "cuda" or how == "all")


_NAME = "epcomm_native_7"
_FLAGS = ["-O2"]
_state: dict = {}


def cache_name(source: bytes | None = None) -> str:
    """The extension's name and folder in torch's extension cache: ``_NAME`` and a digest of what the build depends
    on (``source``, default ``native.cpp``'s bytes; the compiler flags; torch's version and build; this Python's
    version; the machine), never of where the source or torch lie. torch keys its cache by name alone and rebuilds
    a build whose source path or torch include folder differs: two checkouts or virtualenvs of one machine (a CI
    clone beside a working tree) rebuilt each other's, 30-60 s of compiling each time."""
    if source is None:
        with open(SOURCE, "rb") as f:
            source = f.read()
    h = hashlib.sha256(source)
    for part in (*_FLAGS, torch.__version__, str(torch.version.git_version), sys.version, platform.machine()):
        h.update(b"\0" + part.encode())
    return f"{_NAME}_{h.hexdigest()[:16]}"


def _import(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load():
    """The extension from the cache folder of :func:`cache_name`: imported where it was built, else built there
    (torch's ``load``, from a copy of the source in that folder: one path for every checkout; its file lock lets
    the ranks of one machine share one build)."""
    from torch.utils import cpp_extension

    name = cache_name()
    where = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root(), name)
    built = os.path.join(where, name + (".pyd" if sys.platform == "win32" else ".so"))
    if os.path.exists(built):
        try:
            return _import(name, built)
        except ImportError as e:  # (a build cut short: built again below)
            log.info("epcomm: the native extension in %s did not load (%s); building it again", where, e)
    os.makedirs(where, exist_ok=True)
    source = os.path.join(where, os.path.basename(SOURCE))
    if not os.path.exists(source):
        part = f"{source}.{os.getpid()}"
        shutil.copyfile(SOURCE, part)
        os.replace(part, source)
    return cpp_extension.load(name, sources=[source], extra_cflags=_FLAGS, build_directory=where, verbose=False)


def module():
    """The built extension, or None where it cannot be built (the reason logged once)."""
    if "mod" not in _state:
        _state["mod"] = None
        if _env.native() == "0":
            _state["why"] = "EPCOMM_NATIVE=0"
        else:
            try:
                _state["mod"] = _load()
            except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: torch.empty instead
                _state["why"] = f"{type(e).__name__}: {str(e)[:300]}"
                log.warning("epcomm: the native output allocator could not be built (%s); outputs come from "
                            "torch.empty (slower on the host)", _state["why"])
    return _state["mod"]


def key_functions(device: torch.device):
    """``(signatures, row_signatures)`` of the extension (a call's kind from its tensors in one C++ call, as
    ``_validate.signatures`` and ``_validate.row_signatures`` distinguish them) where plans on ``device`` are
    native (:func:`wanted`) and it is built; else those two Python functions."""
    from . import _validate as V

    mod = module() if wanted(device) else None
    return (V.signatures, V.row_signatures) if mod is None else (mod.signatures, mod.row_signatures)


def _packed(packed, n: int) -> list:
    """The outputs of indexes ``packed`` as a flag per output (``n``)."""
    flags = [False] * n
    for i in packed:
        flags[i] = True
    return flags


class Outputs:
    """``Outputs(device, [(shape, dtype), ...], native, packed=())``: ``outs(rows=0)`` -> a tuple of new tensors, a
    ``ROWS`` dimension taking ``rows``. ``native``: through the extension (when it is built), else ``torch.empty``;
    there the outputs of indexes ``packed`` are views of one allocation.

    Example: ``Outputs(torch.device("cpu"), [((ROWS, 4), torch.int32), ((2,), torch.float32)], False)(3)`` gives
    an ``int32[3, 4]`` and a ``float32[2]``."""

    __slots__ = ("make", "native")

    def __init__(self, device: torch.device, specs, native: bool, packed=()) -> None:
        specs = [(tuple(shape), dtype) for shape, dtype in specs]
        mod = module() if native else None
        self.native = mod is not None
        if mod is not None:
            self.make = mod.Outputs([list(s) for s, _ in specs], [d for _, d in specs], device,
                                    _packed(packed, len(specs))).make
        else:
            def make(rows: int = 0, specs=specs, empty=torch.empty):
                return tuple(empty(tuple(rows if v < 0 else v for v in s), dtype=d, device=device) for s, d in specs)
            self.make = make

    def __call__(self, rows: int = 0) -> tuple:
        return self.make(rows)


# a source of a chain's kernel parameter, grid dimension or rows (without its size: ``kernels/launch.py`` adds it)
def const(value) -> tuple:
    """The constant ``value``: an int, or a tensor (its address: a buffer the chain's launches use on every call)."""
    return (0, 0, value if isinstance(value, torch.Tensor) else int(value))


def param(src: tuple, size: int) -> tuple:
    """``src`` as a chain's parameter of ``size`` bytes (a constant tensor as its address)."""
    kind, idx, value = src
    return (kind, idx, value.data_ptr() if isinstance(value, torch.Tensor) else value, size)


def addr(i: int, offset: int = 0) -> tuple:
    """The call's value ``i``: a tensor's ``data_ptr()`` plus ``offset`` bytes (None: 0; an int: as it is)."""
    return (1, i, offset)


def out(i: int, offset: int = 0) -> tuple:
    """Output ``i``'s address plus ``offset`` bytes."""
    return (2, i, offset)


def num(i: int) -> tuple:
    """The call's value ``i``, an int."""
    return (3, i, 0)


DRY = False  # every chain dry (the host probe's CPU rig: bench/hostprobe.install)


class Chain:
    """A call's outputs made and its kernels launched by one call into the extension: ``Chain(device, specs,
    rows, steps, nvals, stream=(get_stream, device))``; ``chain(*vals)`` makes the outputs of ``specs`` (as
    :class:`Outputs`, a ``ROWS`` dimension taking ``rows``, a source: :func:`const` or :func:`num`), then launches
    ``steps`` in order on the current stream (``get_stream(device)``: a raw CUDA stream handle, as Triton's driver
    gives it; ``kernels/launch.Prepared.chain_stream``), their parameters from the ``nvals`` values given (tensors,
    None or ints) and the outputs, and returns the outputs. A step (``kernels/launch.Direct.step``) is a bound Triton
    kernel's launch with every parameter a source; the driver's list of the kernel's parameters is checked
    against it when the chain is made. ``dry``: nothing is launched, ``last()`` gives each step's grid and
    parameters of the last call (tests without a GPU).

    Why: a high-throughput dispatch's host path is its outputs (a few us each from Python), its launches (Triton's
    launcher parses every argument from Python: ~5-9 us each on an H100 host) and the Python between them; a chain
    does them in one call with the parameters packed once."""

    __slots__ = ("chain", "dev", "get_stream", "run", "spec", "steps")

    def __init__(self, device: torch.device, specs, rows: tuple, steps: list, nvals: int, dry: bool = False,
                 packed=(), stream=None) -> None:
        mod = module()
        if mod is None:
            raise RuntimeError(f"the native extension is not built: {_state.get('why')}")
        specs = [(tuple(shape), dtype) for shape, dtype in specs]
        # (its outputs as ``Outputs`` takes them: scripts/v2_host_split.py makes them alone)
        self.spec = ([list(s) for s, _ in specs], [d for _, d in specs], device, _packed(packed, len(specs)))
        self.chain = mod.Chain(*self.spec, [*rows, 8], list(steps), nvals, dry or DRY)
        self.run = self.chain.run
        self.steps = len(steps)
        self.get_stream, self.dev = stream if stream is not None else (no_stream, None)

    def __call__(self, *vals) -> tuple:
        return self.run(self.get_stream(self.dev), *vals)

    def last(self) -> list:
        return self.chain.last()


def no_stream(dev) -> int:
    return 0  # (no driver: the dry chains of machines without a GPU)


class Later:
    """What a plan makes once its first call bound its launches (a :class:`Chain`): ``value``, None until
    ``ready()`` made it (``make()``, which may give None: it cannot be made), and forever where not ``wanted``.
    ``done``: made, or never to be."""

    __slots__ = ("_make", "value")

    def __init__(self, wanted: bool, make) -> None:
        self.value, self._make = None, make if wanted else None

    @property
    def done(self) -> bool:
        return self._make is None

    def ready(self, *args) -> None:
        """After a call that bound the launches: make it (``make(*args)``), once."""
        if self._make is not None:
            make, self._make = self._make, None
            self.value = make(*args)
