// epcomm's native extension (epcomm/native.py builds it with torch.utils.cpp_extension.load the first time a
// process asks for it): a kind of call's output tensors in one call (Outputs), a call's outputs and its Triton
// launches through the driver in one call (Chain), and a call's kind from its tensors (signatures).
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
