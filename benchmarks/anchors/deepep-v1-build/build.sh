#!/usr/bin/env bash
# Build DeepEP V1 at 567632dd (release 1.2.1), intranode kernels only, sm_90, against the torch of $PYTHON.
#
# usage: build.sh DEEPEP_GIT_DIR OUT_DIR
#   DEEPEP_GIT_DIR  a clone or bare mirror of github.com/deepseek-ai/DeepEP that holds 567632dd
#   OUT_DIR         receives deep_ep/ and deep_ep_cpp.cpython-*.so; must be absent or empty
# environment (defaults in brackets):
#   PYTHON [python3]  a Python with the target torch and its CUDA wheels installed, plus setuptools and ninja
#   CUDA_HOME [/usr/local/cuda]  a CUDA toolkit whose major version matches torch.version.cuda
#   MAX_JOBS [2]  parallel compile jobs;  BUILD_DIR [a new temporary directory]  sources, objects, build.log
#   CUOBJDUMP [cuobjdump on PATH or in CUDA_HOME/bin]  used only to check the SASS; skipped if absent
set -euo pipefail

if [ $# -ne 2 ]; then sed -n 4,11p "$0" | sed 's/^# \{0,1\}//'; exit 2; fi
here=$(cd "$(dirname "$0")" && pwd)
repo=$1
out=$2
commit=567632dd
py=${PYTHON:-python3}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MAX_JOBS=${MAX_JOBS:-2} TORCH_CUDA_ARCH_LIST=9.0 DISABLE_AGGRESSIVE_PTX_INSTRS=1
unset NVSHMEM_DIR DISABLE_SM90_FEATURES TOPK_IDX_BITS

if [ -e "$out" ] && [ -n "$(ls -A "$out")" ]; then echo "OUT_DIR $out is not empty" >&2; exit 2; fi
if [ -n "${BUILD_DIR:-}" ] && [ -e "$BUILD_DIR/src" ]; then echo "BUILD_DIR $BUILD_DIR already holds src/" >&2; exit 2; fi
git -C "$repo" rev-parse --verify --quiet "$commit^{commit}" >/dev/null 2>&1 ||
    { echo "$repo does not hold commit $commit" >&2; exit 2; }
build=${BUILD_DIR:-$(mktemp -d /tmp/deepep-v1-build.XXXXXX)}
"$py" -c 'import torch, setuptools, ninja; print("torch", torch.__version__, "CUDA", torch.version.cuda)'
"$CUDA_HOME/bin/nvcc" --version | tail -1
echo "build dir: $build"

# 1. DeepEP's sources at the pinned commit, plus our stubs file.
mkdir -p "$build/src"
git -C "$repo" archive "$commit" | tar -x -C "$build/src"
cp "$here/no_nvshmem_stubs.cu" "$build/src/csrc/kernels/no_nvshmem_stubs.cu"

# 2. Three edits to DeepEP's setup.py, each an exact replacement that must match once:
#    its NVSHMEM lookup finds none (intranode kernels only, whatever this Python has installed),
#    and a build without NVSHMEM also compiles our stubs and device-links its -rdc=true objects.
"$py" - "$build/src/setup.py" <<'EOF'
import sys
path = sys.argv[1]
text = open(path).read()
edits = [
    ('            nvshmem_dir = importlib.util.find_spec("nvidia.nvshmem").submodule_search_locations[0]\n',
     "            raise ModuleNotFoundError('intranode-only build: NVSHMEM is not used')\n"),
    ("        cxx_flags.append('-DDISABLE_NVSHMEM')\n        nvcc_flags.append('-DDISABLE_NVSHMEM')\n",
     "        cxx_flags.append('-DDISABLE_NVSHMEM')\n        nvcc_flags.append('-DDISABLE_NVSHMEM')\n"
     "        sources.append('csrc/kernels/no_nvshmem_stubs.cu')\n"
     "        nvcc_dlink.append('-dlink')\n"),
]
for old, new in edits:
    if text.count(old) != 1:
        sys.exit(f"setup.py: expected exactly one match for {old!r}")
    text = text.replace(old, new)
open(path, "w").write(text)
EOF

# 3. setup.py links with -lcuda. Where no libcuda.so is installed (a machine without a driver), link
#    against a stand-in named libcuda.so.1 that defines every cu* name of cuda.h as an empty function:
#    the extension then records libcuda.so.1 as needed, and its driver symbols resolve, when it loads,
#    from the real driver of the GPU machine. The stand-in is not part of the output.
if ! printf '' | gcc -shared -x c - -lcuda -o "$build/probe.so" 2>/dev/null; then
    mkdir -p "$build/libcuda-stub"
    grep -oE '\bcu[A-Z][A-Za-z0-9_]*' "$CUDA_HOME/include/cuda.h" | sort -u | sed 's/.*/void &(void) {}/' \
        > "$build/libcuda-stub/libcuda.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$build/libcuda-stub/libcuda.so" "$build/libcuda-stub/libcuda.c"
    export LDFLAGS="${LDFLAGS:-} -L$build/libcuda-stub"
    echo "no libcuda.so here: linking against a stand-in libcuda.so.1 ($(wc -l < "$build/libcuda-stub/libcuda.c") names)"
fi
rm -f "$build/probe.so"
#    torch's CUDA headers include the cuSPARSE/cuBLAS/cuSOLVER headers. A toolkit without them (a minimal
#    install) gets them from torch's nvidia-* wheels, searched after the toolkit's own include directory.
if [ ! -e "$CUDA_HOME/include/cusparse.h" ]; then
    wheel_include=$("$py" -c 'import glob, os, nvidia
print(":".join(sorted(os.path.dirname(h) for p in nvidia.__path__ for h in glob.glob(os.path.join(p, "*", "include", "cusparse.h")))))')
    [ -n "$wheel_include" ] || { echo "no cusparse.h in $CUDA_HOME/include nor in torch's nvidia-* wheels" >&2; exit 2; }
    export CPATH="${CPATH:+$CPATH:}$wheel_include"
    echo "no cusparse.h in $CUDA_HOME/include: CPATH=$CPATH"
fi

# 4. DeepEP's own build.
(cd "$build/src" && nice -n 19 "$py" setup.py build_ext --inplace) 2>&1 | tee "$build/build.log"
so=$(ls "$build"/src/deep_ep_cpp.cpython-*.so)
strip --strip-debug "$so"

# 5. Checks: the driver is a needed library, the sm_90 SASS is there, and every undefined symbol is
#    defined by torch's libraries, the CUDA runtime, the C/C++ runtimes, Python or the driver.
readelf -d "$so" | grep -q 'NEEDED.*\[libcuda\.so\.1\]' || { echo "libcuda.so.1 is not a needed library" >&2; exit 1; }
cuobjdump=${CUOBJDUMP:-$(command -v cuobjdump || echo "$CUDA_HOME/bin/cuobjdump")}
if [ -x "$cuobjdump" ]; then
    "$cuobjdump" --list-elf "$so" | tee "$build/elf.txt"
    grep -q 'sm_90' "$build/elf.txt" || { echo "no sm_90 ELF in $so" >&2; exit 1; }
    if grep -v 'sm_90\.' "$build/elf.txt" | grep -q 'sm_'; then echo "ELF for another arch in $so" >&2; exit 1; fi
else
    echo "cuobjdump not found: SASS not checked"
fi
"$py" - "$so" "$CUDA_HOME" <<'EOF'
import glob, os, re, subprocess, sys, sysconfig, torch
so, cuda_home = sys.argv[1:]
def dyn(path, kind, types=None):
    out = subprocess.run(["nm", "-D", kind, "--format=posix", path], capture_output=True, text=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip()]
    return {row[0].split("@")[0] for row in rows if types is None or row[1] in types}
def gcc_lib(name):
    return subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
undefined = dyn(so, "--undefined-only", types="U")  # weak references may stay undefined
providers = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "lib*.so*"))
providers += glob.glob(os.path.join(cuda_home, "lib64", "libcudart.so*"))
providers += [gcc_lib(n) for n in ("libstdc++.so.6", "libgcc_s.so.1", "libc.so.6", "libm.so.6")]
providers += ["/lib64/ld-linux-x86-64.so.2", sys.executable]
providers += [os.path.join(sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY"))]
defined = set()
for path in providers:
    if os.path.isfile(path):
        defined |= dyn(path, "--defined-only")
left = sorted(undefined - defined)
python_api = [s for s in left if re.match(r"_?Py", s)]
driver = [s for s in left if re.match(r"cu[A-Z]", s)]
unknown = [s for s in left if s not in driver]
print(f"undefined symbols: {len(undefined)}; defined by torch, cudart, Python, libstdc++, libc: {len(undefined) - len(left)}; "
      f"Python C API not found: {python_api}; CUDA driver: {driver}; other: {unknown}")
def newest(path, prefix):
    found = subprocess.run(["objdump", "-T", path], capture_output=True, text=True).stdout
    vers = {tuple(int(x) for x in v.split(".")) for v in re.findall(rf"\b{prefix}_([0-9.]+[0-9])\b", found)}
    return ".".join(map(str, max(vers))) if vers else "none"
torch_cpu = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))[0]
for prefix in ("GLIBC", "GLIBCXX", "CXXABI"):
    print(f"newest {prefix} version needed: extension {newest(so, prefix)}, libtorch_cpu.so {newest(torch_cpu, prefix)}")
sys.exit(1 if unknown else 0)
EOF

# 6. The output: DeepEP's Python package and the extension, nothing else.
mkdir -p "$out"
cp -r "$build/src/deep_ep" "$out/"
cp "$so" "$out/"
find "$out" -name __pycache__ -prune -exec rm -rf {} +
du -sh "$out"
echo "done: PYTHONPATH=$out python3 -c 'import deep_ep'"
