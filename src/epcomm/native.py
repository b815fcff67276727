"""A call's output tensors made by one C++ call (``TUNE["native_alloc"]``, on CUDA devices).

Why: on a GPU host each ``torch.empty`` whose result outlives the call costs ~4-6 us (Python's argument
parsing, the dispatcher, the caching allocator, the Python object; then its free), and a high-throughput
dispatch makes 8-12 of them: the largest single part of its host time (``hostprobe --modes profile``,
benchmarks/2026-11-27/s9 call 1). The same eleven tensors made by ``at::empty`` in one call into a small C++
extension took 27 us against 63 from Python on one H100 host (s9 call 8). In whole calls, one process, calls
alternated (s9 call 9): a V2 contiguous no-sync dispatch 0.905x the host time, V1 ``num_worst_tokens`` 0.908x
(FP8 0.888x), the layout 0.910x, a synchronised dispatch 0.936x, the HT combine (two outputs) 0.977x; a cached
dispatch (one or two outputs) 1.03x, so it keeps ``torch.empty``.

:class:`Outputs` is one kind of call's output list, fixed once (shapes, dtypes, device); ``outs(rows)`` makes
them, a dimension given as ``ROWS`` taking ``rows``. The extension is built the first time a process asks for it
(``torch.utils.cpp_extension.load_inline``: a C++ compiler and ninja; ~25 s once a machine, then loaded from
torch's extension cache, whose file lock lets ranks of one machine share one build); a buffer asks for it when it
is made, before its first collective (``backends/deadline.prepare_native``). Where it cannot be built
(no compiler) the same tensors come from ``torch.empty``, and a warning says why once; ``EPCOMM_NATIVE=0`` turns
it off, ``EPCOMM_NATIVE=all`` also on CPU devices (for tests: :func:`wanted`).
Every tensor is contiguous, its own allocation, as ``torch.empty`` makes it.
"""

from __future__ import annotations

import logging

import torch

from . import _env

log = logging.getLogger(__name__)

ROWS = -1  # a dimension that each call gives

_SRC = r"""
#include <torch/extension.h>

// One kind of call's outputs: shapes (a dimension of -1 is the call's rows), dtypes, device.
struct Outputs {
  std::vector<std::vector<int64_t>> shapes;
  std::vector<at::ScalarType> dtypes;
  at::Device device;
  Outputs(std::vector<std::vector<int64_t>> s, std::vector<at::ScalarType> d, at::Device dev)
      : shapes(std::move(s)), dtypes(std::move(d)), device(dev) {}
  py::tuple make(int64_t rows) const {
    py::tuple out(shapes.size());
    std::vector<int64_t> shape;
    for (size_t i = 0; i < shapes.size(); ++i) {
      shape = shapes[i];
      for (auto& v : shape) if (v < 0) v = rows;
      out[i] = py::cast(at::empty(shape, at::TensorOptions().dtype(dtypes[i]).device(device)));
    }
    return out;
  }
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Outputs>(m, "Outputs")
      .def(py::init<std::vector<std::vector<int64_t>>, std::vector<at::ScalarType>, at::Device>())
      .def("make", &Outputs::make);
}
"""
def wanted(device: torch.device, tune: bool) -> bool:
    """Whether a plan on ``device`` makes its outputs natively: ``tune`` (``TUNE["native_alloc"]``) on a CUDA
    device; also on CPU with ``EPCOMM_NATIVE=all`` (the tests' way to run this path without a GPU); never with
    ``EPCOMM_NATIVE=0``."""
    how = _env.native()
    return bool(tune) and how != "0" and (device.type == "cuda" or how == "all")


_NAME = "epcomm_native_1"  # (a new source gets a new name: torch's cache keys builds by name and source)
_state: dict = {}


def module():
    """The built extension, or None where it cannot be built (the reason logged once)."""
    if "mod" not in _state:
        _state["mod"] = None
        if _env.native() == "0":
            _state["why"] = "EPCOMM_NATIVE=0"
        else:
            try:
                from torch.utils.cpp_extension import load_inline

                _state["mod"] = load_inline(_NAME, cpp_sources=_SRC, extra_cflags=["-O2"], verbose=False)
            except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: torch.empty instead
                _state["why"] = f"{type(e).__name__}: {str(e)[:300]}"
                log.warning("epcomm: the native output allocator could not be built (%s); outputs come from "
                            "torch.empty (slower on the host)", _state["why"])
    return _state["mod"]


class Outputs:
    """``Outputs(device, [(shape, dtype), ...], native)``: ``outs(rows=0)`` -> a tuple of new tensors, a ``ROWS``
    dimension taking ``rows``. ``native``: through the extension (when it is built), else ``torch.empty``.

    Example: ``Outputs(torch.device("cpu"), [((ROWS, 4), torch.int32), ((2,), torch.float32)], False)(3)`` gives
    an ``int32[3, 4]`` and a ``float32[2]``."""

    __slots__ = ("make", "native")

    def __init__(self, device: torch.device, specs, native: bool) -> None:
        specs = [(tuple(shape), dtype) for shape, dtype in specs]
        mod = module() if native else None
        self.native = mod is not None
        if mod is not None:
            self.make = mod.Outputs([list(s) for s, _ in specs], [d for _, d in specs], device).make
        else:
            def make(rows: int = 0, specs=specs, empty=torch.empty):
                return tuple(empty(tuple(rows if v < 0 else v for v in s), dtype=d, device=device) for s, d in specs)
            self.make = make

    def __call__(self, rows: int = 0) -> tuple:
        return self.make(rows)
