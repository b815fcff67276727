"""Compile every internode high-throughput kernel for sm_90 with Triton's own compiler (PTX and
ptxas; no GPU needed): the interpreter the CPU tests use runs kernels as Python and lets through what
the compiler rejects (types, loop-carried values, pointer arithmetic). The NVSHMEM calls are taken out
with ``SIM=True`` (their bodies are what changes); torch's NVSHMEM Triton module on a CPU build lacks
the device functions, which Triton's dependency walk still looks up, so stand-ins fill the gaps. Run by
``tests/unit/test_kernel_sims.py``; alone: ``PYTHONPATH=src python tests/unit/sims/compile_internode_ht.py``."""
import inspect

import triton
from torch.distributed._symmetric_memory import _nvshmem_triton as _nvmod
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _stand_in(*args):
    pass


for _name in ("putmem_signal_block", "quiet", "fence", "putmem_block_extern_wrapper"):
    if not hasattr(_nvmod, _name):
        setattr(_nvmod, _name, _stand_in)

from epcomm.kernels import internode_ht as ih  # noqa: E402
from epcomm.kernels import internode_ht_combine as ihc  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# argument types as the backend passes them: offsets past 2 GiB are 64-bit, the rest int32 words
I64 = {"ptr_table": "*i64", "timeout_ns": "i64", "stage_off": "i64", "area_off": "i64", "par_bytes": "i64",
       "rdma_rel": "i64", "nvl_rel": "i64", "stage_rel": "i64", "fin_rel": "i64", "ctr_off": "i64",
       "nsig_off": "i64", "recv_off": "i64"}


SMEM_MAX = 227 << 10  # shared memory a block may have on an H100 or H200 (a launch asking more fails)


def compile_one(fn, types: dict, consts: dict, warps: int = 4) -> int:
    """``fn``'s cubin bytes; asserts that its shared memory fits a block."""
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: "constexpr" if p in consts else types.get(p, "*i32" if p.endswith("_ptr") else "i32") for p in params}
    src = ASTSource(fn, sig, constexprs={(params.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=TARGET, options={"num_warps": warps})
    assert kernel.metadata.shared <= SMEM_MAX, (fn.fn.__name__, consts, kernel.metadata.shared)
    return len(kernel.asm["cubin"])


def main() -> None:
    from epcomm.backends.internode_ht import TUNE, _final_stages

    T = TUNE
    # the paired combine's pipeline depth as the backend picks it (2 nodes, NB biases; its shared memory at DSv3's
    # alignment: vectors_internode_ht.py)
    comb = [(T["final_block"], True, 2), (T["final_block"], False, 0)]
    cases = [
        (ih._hn_prep_kernel, {"is_in_ptr": "*i8"}, dict(BLOCK=1024, R_POW2=8), 4),
        (ih._hn_notify_kernel, I64, dict(BLOCK=1024, CHECK=True, HAS_TIMER=True, SIM=True), 4),
        # one dispatch launch (every role: senders, forwarders, receivers); DSv3's shapes' constexprs
        (ih._internode_dispatch_impl_kernel, dict(I64, rid_ptr="*i64", rw_ptr="*fp32"),
         dict(BLOCK=T["dispatch_block"], RB=T["dispatch_rb"], N_POW2=2, K_POW2=8, G_POW2=64, S_POW2=64,
              HAS_TIMER=True, SIM=True), T["dispatch_warps"]),
        # one combine launch (senders, relays, finals; paired), with and without weights and biases
        *[(ihc._hc_kernel, dict(I64, x_ptr="*bf16", out_ptr="*bf16", wout_ptr="*fp32", b0_ptr="*bf16",
                                b1_ptr="*bf16"),
           dict(BLOCK=T["combine_block"], FBLOCK=fb, RB=T["combine_rb"], K_POW2=8, P_POW2=2, HAS_W=hw, NB=nb,
                STAGES=_final_stages(2 + nb, fb), HAS_TIMER=True, SIM=True), T["combine_warps"])
          for fb, hw, nb in comb],
    ]
    # integers Triton turns into constants when they are 1 (launch.py), as real calls pass them: rank 1 of
    # nodes of one rank (me, N) with chunks of 1 and one program a role; rank 1 of one node (P)
    for d_ones, c_ones in (({"me": 1, "N": 1, "CH": 1, "s_n": 1, "f_n": 1}, {"me": 1, "N": 1, "CH": 1, "r_n": 1}),
                           ({"me": 1, "P": 1, "f_n": 1, "v_n": 1}, {"me": 1, "P": 1, "s_n": 1, "f_n": 1})):
        cases.append((ih._internode_dispatch_impl_kernel, cases[2][1], dict(cases[2][2], NSRC=1, SAVE=1, **d_ones), T["dispatch_warps"]))
        cases.append((ihc._hc_kernel, cases[3][1], dict(cases[3][2], **c_ones), T["combine_warps"]))
    print("plan", len(cases))  # the test asks for one "ok" line each
    for fn, types, consts, w in cases:
        print("ok", fn.fn.__name__, compile_one(fn, types, consts, w), "bytes of cubin,", w, "warps")


if __name__ == "__main__":
    main()
