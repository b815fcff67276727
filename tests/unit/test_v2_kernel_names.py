"""Tier 1: the kernel names DeepEP V2's timing looks for (docs/v2.md, "Kernel names").

DeepEP V2's ``tests/elastic/test_ep.py`` times each call with ``bench_kineto``, which matches kernel names by
substring in the profiler's table: ``dispatch_impl`` and ``dispatch_copy_epilogue_impl`` for dispatches,
``combine_impl`` and ``combine_reduce_epilogue_impl`` for combines; each must match exactly one kernel of the
call. On a GPU a Triton kernel's name is its ``@triton.jit`` function's. Here: which of epcomm's kernels
carry each substring (no other kernel may, or a call that launches it would match twice), and that the
epilogue kernels launched under a name of their own compile for sm_90 with that name as the PTX entry.
Which call launches which is tier 2's (tests/dist/test_v2_kernel_names_cpu.py).
"""
import importlib
import os
import pkgutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WANT = {
    "dispatch_impl": {"_dispatch_impl_kernel", "_internode_dispatch_impl_kernel"},  # the transfers
    "dispatch_copy_epilogue_impl": {"_dispatch_copy_epilogue_impl_kernel",          # expanded
                                    "_dispatch_copy_epilogue_impl_meta_kernel",     # contiguous
                                    "_dispatch_copy_epilogue_impl_cached_kernel"},  # cached contiguous
    "combine_impl": {"_combine_impl_kernel"},
    "combine_reduce_epilogue_impl": {"_combine_reduce_epilogue_impl_kernel"},
}


def _jit_names() -> set:
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    import epcomm.kernels as K

    names = set()
    for mod in pkgutil.iter_modules(K.__path__):
        m = importlib.import_module(f"epcomm.kernels.{mod.name}")
        for v in vars(m).values():
            fn = getattr(v, "jit_func", v)  # (NVSHMEM kernels are wrapped)
            if isinstance(fn, JITFunction) or type(fn).__name__ == "InterpretedFunction":
                names.add(fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__)
    return names


def test_each_deepep_name_is_carried_by_the_kernels_meant_to_carry_it():
    names = _jit_names()
    assert len(names) > 30, sorted(names)
    for sub, want in WANT.items():
        assert {n for n in names if sub in n} == want, sub


COMPILE = r"""
import sys
sys.path.insert(0, "tests/unit/sims")
from sm90 import TARGET
import inspect, triton
from triton.compiler import ASTSource
from epcomm.kernels import v2_dispatch as v2
I32, I64 = "*i32", "*i64"
def entry(fn, types, consts):
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: "constexpr" if p in consts else types.get(p, "i32") for p in params}
    src = ASTSource(fn, sig, constexprs={(params.index(k),): v for k, v in consts.items()})
    ptx = triton.compile(src, target=TARGET, options={"num_warps": 4}).asm["ptx"]
    print("entry", [l.split()[-1].rstrip("(") for l in ptx.splitlines() if ".entry" in l][0])
META = dict(rpm=I32, recv_src=I32, recv_local=I64, local=I64, local_out=I64, meta=I32, gid=I64, counts=I32,
            psum=I32, psum_rank=I32, cum=I32, topk=I64, topk_copy=I64, send_head=I32, dst_slot=I32, part=I32,
            ticket=I32)
entry(v2._dispatch_copy_epilogue_impl_meta_kernel, META,
      dict(R=8, K=8, LE=32, LEP=32, HB=32, KP=8, BN=128, RB=8, COPY=True, EXPAND=False, HAS_CUM=False,
           COPY_TOPK=True))
for w in (False, True):
    entry(v2._dispatch_copy_epilogue_impl_cached_kernel, dict(local=I64, out_k=I64, w_src="*bf16", w_out="*fp32"),
          dict(K=8, KP=8, W_OFF=14338, W_STRIDE=14400, HAS_W=w, BN=128))
"""


def test_epilogue_kernels_compile_for_sm90_under_their_names():
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)  # Triton's compiler itself, for sm_90
    res = subprocess.run([sys.executable, "-c", COMPILE], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    got = [line.split()[1] for line in res.stdout.splitlines() if line.startswith("entry")]
    assert got == ["_dispatch_copy_epilogue_impl_meta_kernel"] + ["_dispatch_copy_epilogue_impl_cached_kernel"] * 2
