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
them, a dimension given as ``ROWS`` taking ``rows``. The extension is built the first time a process asks for it
(``torch.utils.cpp_extension.load_inline``: a C++ compiler and ninja; ~25 s once a machine, then loaded from
torch's extension cache, whose file lock lets ranks of one machine share one build); a buffer asks for it when it
is made, before its first collective (``backends/deadline.prepare_native``). Where it cannot be built
(no compiler) the same tensors come from ``torch.empty``, and a warning says why once; ``EPCOMM_NATIVE=0`` turns
it off, ``EPCOMM_NATIVE=all`` also on CPU devices (for tests: :func:`wanted`).
Every tensor is contiguous, as ``torch.empty`` makes it; each its own allocation, but for those a plan marks
``packed`` (with ``TUNE["native_pack"]``: its small outputs, never the received rows): views of one allocation,
each from a 16-byte boundary, made in C++ without a call into the allocator each (that allocation lives while any
of them does: a few hundred KB at DSv3 shapes).

:class:`Chain` (``TUNE["native_chain"]``): where a call is only its outputs and launches (no host wait between them),
one call into the extension makes the outputs and launches the call's Triton kernels through the driver
(``cuLaunchKernel``, each kernel's parameters packed once from its bound launch, ``kernels/launch.Direct.step``,
and checked against the driver's own parameter list); per call only the caller's tensors and a few integers are
read. Under ``EPCOMM_VERIFY_LAUNCH`` and the Triton interpreter no chain is made (every launch goes through Triton).
"""

from __future__ import annotations

import logging

import torch

from . import _env

log = logging.getLogger(__name__)

ROWS = -1  # a dimension that each call gives

_SRC = r"""
#include <torch/extension.h>
#include <dlfcn.h>
#include <array>
#include <string>

// A view of `block`'s bytes from `off` as a contiguous tensor of `shape` and `dt` (a TensorImpl on the block's
// storage: no allocation, no dispatcher call).
static at::Tensor view_of(const at::Tensor& block, int64_t off, at::ScalarType dt, const std::vector<int64_t>& shape) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(block.storage()), block.key_set(),
                                                   c10::scalarTypeToTypeMeta(dt));
  impl->set_sizes_contiguous(shape);
  impl->set_storage_offset(off / (int64_t)c10::elementSize(dt));
  return at::Tensor(std::move(impl));
}

// One kind of call's outputs: shapes (a dimension of -1 is the call's rows), dtypes, device; those `packed` are
// views of one allocation (each from a 16-byte boundary), the others one allocation each.
struct Outputs {
  std::vector<std::vector<int64_t>> shapes;
  std::vector<at::ScalarType> dtypes;
  at::Device device;
  std::vector<bool> packed;
  bool any_packed = false;
  Outputs(std::vector<std::vector<int64_t>> s, std::vector<at::ScalarType> d, at::Device dev,
          std::vector<bool> p = {})
      : shapes(std::move(s)), dtypes(std::move(d)), device(dev), packed(std::move(p)) {
    TORCH_CHECK(packed.empty() || packed.size() == shapes.size(), "a packed flag for each output");
    TORCH_CHECK(dtypes.size() == shapes.size(), "a dtype for each output");
    packed.resize(shapes.size(), false);
    for (bool b : packed) any_packed = any_packed || b;
  }
  std::vector<at::Tensor> tensors(int64_t rows) const {
    std::vector<at::Tensor> out(shapes.size());
    std::vector<std::vector<int64_t>> sh(shapes);
    std::vector<int64_t> off(shapes.size(), 0);
    int64_t total = 0;
    for (size_t i = 0; i < sh.size(); ++i) {
      int64_t n = (int64_t)c10::elementSize(dtypes[i]);
      for (auto& v : sh[i]) {
        if (v < 0) v = rows;
        n *= v;
      }
      if (packed[i]) {
        off[i] = total;
        total += (n + 15) / 16 * 16;
      }
    }
    at::Tensor block;
    if (any_packed) block = at::empty({total}, at::TensorOptions().dtype(at::kByte).device(device));
    for (size_t i = 0; i < sh.size(); ++i)
      out[i] = packed[i] ? view_of(block, off[i], dtypes[i], sh[i])
                         : at::empty(sh[i], at::TensorOptions().dtype(dtypes[i]).device(device));
    return out;
  }
  py::tuple make(int64_t rows) const {
    auto ts = tensors(rows);
    py::tuple out(ts.size());
    for (size_t i = 0; i < ts.size(); ++i) out[i] = py::cast(std::move(ts[i]));
    return out;
  }
};

// The driver's entry points, looked up once in libcuda (no CUDA headers: this file builds with a CPU torch).
typedef int (*LaunchFn)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                        void**, void**);
typedef int (*ErrFn)(int, const char**);
typedef int (*ParamInfoFn)(void*, size_t, size_t*, size_t*);
struct Driver {
  LaunchFn launch = nullptr;
  ErrFn err = nullptr;
  ParamInfoFn info = nullptr;
};
static const Driver& driver() {
  static Driver d = [] {
    Driver r;
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (h) {
      r.launch = (LaunchFn)dlsym(h, "cuLaunchKernel");
      r.err = (ErrFn)dlsym(h, "cuGetErrorString");
      r.info = (ParamInfoFn)dlsym(h, "cuFuncGetParamInfo");
    }
    return r;
  }();
  return d;
}

// Where a kernel parameter, a grid dimension or the rows come from: kind 0 the constant `value`; 1 the call's
// value `idx` as an address (a tensor's data_ptr() plus `value` bytes; None 0; an int as it is); 2 output
// `idx`'s address plus `value`; 3 the call's value `idx` as an integer. `size`: the parameter's bytes.
struct Src {
  int64_t kind, idx, value, size;
};
struct Step {
  uint64_t fn;
  std::array<Src, 3> grid;
  uint32_t block, smem;
  std::vector<Src> params;
  std::vector<uint64_t> slots;
  std::vector<void*> ptrs;
};

static Src to_src(const std::vector<int64_t>& v) {
  TORCH_CHECK(v.size() == 4, "a source is (kind, idx, value, size)");
  TORCH_CHECK(v[0] >= 0 && v[0] <= 3, "a source's kind is 0-3, got ", v[0]);
  TORCH_CHECK(v[3] == 1 || v[3] == 2 || v[3] == 4 || v[3] == 8, "a parameter of ", v[3], " bytes");
  return Src{v[0], v[1], v[2], v[3]};
}

// A call's outputs made and its kernels launched, in one call from Python: the launches' fixed parameters
// packed once; per call only the sources of kinds 1-3 are read. `dry`: nothing is launched, the last call's
// grids and parameters are kept for `last()` (the tests on machines without a GPU).
struct Chain {
  Outputs outs;
  Src rows;
  std::vector<Step> steps;
  int64_t nvals;
  bool dry;
  std::vector<std::vector<uint64_t>> seen;

  Chain(std::vector<std::vector<int64_t>> shapes, std::vector<at::ScalarType> dtypes, at::Device dev,
        std::vector<bool> packed, std::vector<int64_t> rows_src, std::vector<py::tuple> step_specs, int64_t nvals_,
        bool dry_)
      : outs(std::move(shapes), std::move(dtypes), dev, std::move(packed)), rows(to_src(rows_src)), nvals(nvals_), dry(dry_) {
    const Driver& d = driver();
    TORCH_CHECK(dry || d.launch, "epcomm native chain: cuLaunchKernel not found in libcuda.so.1");
    for (auto& t : step_specs) {
      TORCH_CHECK(t.size() == 5, "a step is (function, grid, block, smem, params)");
      Step s;
      s.fn = t[0].cast<uint64_t>();
      auto g = t[1].cast<std::vector<std::vector<int64_t>>>();
      TORCH_CHECK(g.size() == 3, "a grid has 3 dimensions");
      for (int i = 0; i < 3; ++i) s.grid[i] = to_src(g[i]);
      s.block = t[2].cast<uint32_t>();
      s.smem = t[3].cast<uint32_t>();
      for (auto& p : t[4].cast<std::vector<std::vector<int64_t>>>()) s.params.push_back(to_src(p));
      for (auto& p : s.params) check_src(p);
      for (auto& p : s.grid) check_src(p);
      s.slots.assign(s.params.size(), 0);
      for (size_t j = 0; j < s.params.size(); ++j)
        if (s.params[j].kind == 0) s.slots[j] = (uint64_t)s.params[j].value;
      for (auto& v : s.slots) s.ptrs.push_back(&v);
      if (!dry && d.info) {  // the kernel's own parameter list, from the driver: sizes must match ours
        for (size_t j = 0; j <= s.params.size(); ++j) {
          size_t off = 0, sz = 0;
          int rc = d.info((void*)s.fn, j, &off, &sz);
          if (j == s.params.size()) {
            TORCH_CHECK(rc != 0, "epcomm native chain: the kernel has more than ", j, " parameters");
          } else {
            TORCH_CHECK(rc == 0, "epcomm native chain: the kernel has ", j, " parameters, not ", s.params.size());
            TORCH_CHECK((int64_t)sz == s.params[j].size, "epcomm native chain: parameter ", j, " has ", sz,
                        " bytes, not ", s.params[j].size);
          }
        }
      }
      steps.push_back(std::move(s));
    }
    check_src(rows);
    TORCH_CHECK(rows.kind != 2, "the rows come from a constant or a call value");
  }

  void check_src(const Src& p) const {
    if (p.kind == 1 || p.kind == 3) TORCH_CHECK(p.idx >= 0 && p.idx < nvals, "a call value ", p.idx, " of ", nvals);
    if (p.kind == 2) TORCH_CHECK(p.idx >= 0 && p.idx < (int64_t)outs.shapes.size(), "an output ", p.idx);
  }

  static inline uint64_t get(const Src& p, const int64_t* v, const std::vector<int64_t>& o) {
    switch (p.kind) {
      case 0: return (uint64_t)p.value;
      case 1: return v[p.idx] ? (uint64_t)(v[p.idx] + p.value) : 0;
      case 2: return (uint64_t)(o[p.idx] + p.value);
      default: return (uint64_t)v[p.idx];
    }
  }

  py::tuple run(int64_t stream, py::args vals) {
    TORCH_CHECK((int64_t)vals.size() == nvals, "epcomm native chain: ", nvals, " values, got ", vals.size());
    int64_t v[64];
    TORCH_CHECK(nvals <= 64, "at most 64 values");
    for (int64_t i = 0; i < nvals; ++i) {
      PyObject* o = vals[i].ptr();
      if (o == Py_None) {
        v[i] = 0;
      } else if (THPVariable_Check(o)) {
        v[i] = (int64_t)THPVariable_Unpack(o).data_ptr();
      } else {
        v[i] = vals[i].cast<int64_t>();
      }
    }
    auto ts = outs.tensors((int64_t)get(rows, v, {}));
    std::vector<int64_t> o(ts.size());
    for (size_t i = 0; i < ts.size(); ++i) o[i] = (int64_t)ts[i].data_ptr();
    if (dry) seen.clear();
    int rc = 0;
    size_t failed = 0;
    {
      py::gil_scoped_release nogil;
      const Driver& d = driver();
      for (size_t k = 0; k < steps.size() && !rc; ++k) {
        Step& s = steps[k];
        for (size_t j = 0; j < s.params.size(); ++j)
          if (s.params[j].kind) s.slots[j] = get(s.params[j], v, o);
        unsigned g0 = (unsigned)get(s.grid[0], v, o), g1 = (unsigned)get(s.grid[1], v, o),
                 g2 = (unsigned)get(s.grid[2], v, o);
        if (dry) {
          std::vector<uint64_t> row{g0, g1, g2};
          row.insert(row.end(), s.slots.begin(), s.slots.end());
          seen.push_back(std::move(row));
        } else if ((uint64_t)g0 * g1 * g2 > 0) {
          rc = d.launch((void*)s.fn, g0, g1, g2, s.block, 1, 1, s.smem, (void*)stream, s.ptrs.data(), nullptr);
          failed = k;
        }
      }
    }
    if (rc) {
      const char* msg = nullptr;
      if (driver().err) driver().err(rc, &msg);
      TORCH_CHECK(false, "epcomm native chain: launch ", failed, " failed: CUDA error ", rc, " ",
                  msg ? msg : "");
    }
    py::tuple out(ts.size());
    for (size_t i = 0; i < ts.size(); ++i) out[i] = py::cast(std::move(ts[i]));
    return out;
  }

  std::vector<std::vector<uint64_t>> last() const { return seen; }
};

// What a repeated call must share with the first of its kind, for each argument (a tensor or None), as the bytes
// of one flat sequence of int64: None -1; a tensor its dimensions, its sizes, its dtype, its device index (-1: CPU),
// its address modulo 16 and whether it is contiguous (as _validate.repeat_signature, one call for all the
// arguments). Each argument's part says its own length (its dimensions first), so equal bytes are equal kinds; one
// bytes object is cheaper to make and to hash in a key than a tuple of ~40 ints.
static py::bytes signatures_from(const py::args& args, bool rows) {
  std::vector<int64_t> v;
  v.reserve(args.size() * 8);
  for (auto& a : args) {
    PyObject* o = a.ptr();
    if (o == Py_None) {
      v.push_back(-1);
      continue;
    }
    if (!THPVariable_Check(o)) throw py::type_error("a tensor or None");
    const at::Tensor& t = THPVariable_Unpack(o);
    v.push_back(t.dim());
    auto sizes = t.sizes();
    for (size_t i = rows && !sizes.empty() ? 1 : 0; i < sizes.size(); ++i) v.push_back(sizes[i]);
    v.push_back((int64_t)t.scalar_type());
    v.push_back(t.is_cuda() ? (int64_t)t.get_device() : -1);
    v.push_back((int64_t)((uintptr_t)t.data_ptr() & 15));
    v.push_back(t.is_contiguous() ? 1 : 0);
  }
  return py::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int64_t));
}
static py::bytes signatures(py::args args) { return signatures_from(args, false); }
// The same without each tensor's first size (its rows: as _validate.rows_signature).
static py::bytes row_signatures(py::args args) { return signatures_from(args, true); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("signatures", &signatures);
  m.def("row_signatures", &row_signatures);
  py::class_<Outputs>(m, "Outputs")
      .def(py::init<std::vector<std::vector<int64_t>>, std::vector<at::ScalarType>, at::Device, std::vector<bool>>())
      .def("make", &Outputs::make);
  py::class_<Chain>(m, "Chain")
      .def(py::init<std::vector<std::vector<int64_t>>, std::vector<at::ScalarType>, at::Device, std::vector<bool>,
                    std::vector<int64_t>, std::vector<py::tuple>, int64_t, bool>())
      .def("run", &Chain::run)
      .def("last", &Chain::last);
}
"""
def wanted(device: torch.device, tune: bool) -> bool:
    """Whether a plan on ``device`` makes its outputs natively: ``tune`` (``TUNE["native_alloc"]``) on a CUDA
    device; also on CPU with ``EPCOMM_NATIVE=all`` (the tests' way to run this path without a GPU); never with
    ``EPCOMM_NATIVE=0``."""
    how = _env.native()
    return bool(tune) and how != "0" and (device.type == "cuda" or how == "all")


_NAME = "epcomm_native_6"  # (a new source gets a new name: torch's cache keys builds by name and source)
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


def key_functions(device: torch.device, tune: bool):
    """``(signatures, row_signatures)`` of the extension (a call's kind from its tensors in one C++ call, as
    ``_validate.signatures`` and ``_validate.row_signatures`` distinguish them) where ``tune`` asks for them, outputs
    on ``device`` are made natively and it is built; else those two Python functions."""
    from . import _validate as V

    mod = module() if tune and wanted(device, True) else None
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
    does them in one call with the parameters packed once (``hostprobe --variants native_chain=0``)."""

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
