"""Compile a Triton kernel for sm_90 with Triton's own compiler (PTX and ptxas; no GPU needed), for the
sims' compile scripts (run as scripts: this directory is on their path)."""
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(fn, types: dict, consts: dict, warps: int = 4):
    """``fn`` (a ``@triton.jit`` kernel) with the constexprs ``consts`` and argument types ``types`` (by name;
    else ``*i32`` for a name ending in ``_ptr``, ``i32`` otherwise), ``warps`` warps, compiled for sm_90."""
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: "constexpr" if p in consts else types.get(p, "*i32" if p.endswith("_ptr") else "i32") for p in params}
    src = ASTSource(fn, sig, constexprs={(params.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=TARGET, options={"num_warps": warps})


def compile_one(fn, types: dict, consts: dict, warps: int = 4) -> int:
    """``compile_kernel``'s cubin's bytes."""
    return len(compile_kernel(fn, types, consts, warps).asm["cubin"])


def spill_bytes(kernel) -> int:
    """Bytes of register spill stores of ``compile_kernel``'s result, from ptxas -v (Triton's own ptxas) on its
    PTX, for sm_90a."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull], capture_output=True,
                             text=True, check=True)
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", out.stdout + out.stderr))
