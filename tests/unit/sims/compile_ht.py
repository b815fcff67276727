"""Compile the nvlink backend's high-throughput kernels for sm_90 with Triton's own compiler (PTX and
ptxas; no GPU needed), in the variants the backend launches: the interpreter the CPU tests use runs
kernels as Python and lets through what the compiler rejects (types, loop-carried values, pointer
arithmetic). Run by ``tests/unit/test_ht_kernels.py``; alone:
``PYTHONPATH=src python tests/unit/sims/compile_ht.py``."""
import triton.language as tl
import re

from sm90 import compile_kernel, compile_one, spill_bytes

from epcomm.backends.nvlink_params import TUNE, layout_launch
from epcomm.kernels import ht_layout, ht_notify, ht_receive

COMMON = {"ptr_table": "*i64", "timeout_ns": "i64", "is_in_ptr": "*i8", "topk_ptr": "*i64",
          "host_addr_ptr": "*i64"}
GATHER = dict(COMMON, x_ptr="*i32", xs_ptr="*fp32", w_ptr="*fp32", stage_ptr="*i32", stage_s_ptr="*fp32",
              stage_k_ptr="*i64", stage_w_ptr="*fp32", out_x="*i32", out_s="*fp32", out_k="*i64", out_w="*fp32",
              out_src="*i32")
COMBINE = dict(COMMON, x_ptr="*bf16", w_ptr="*fp32", stage_ptr="*bf16", stage_w_ptr="*fp32", bias0_ptr="*bf16",
               bias1_ptr="*bf16", out_ptr="*bf16", out_w_ptr="*fp32")


def main() -> None:
    t = TUNE
    gather = dict(NC=4, RB=t["gather_rb"], BLOCK=t["gather_block"], R_POW2=8, K_POW2=8, G_POW2=64, HAS_TIMER=True,
                  STAGES=t["gather_stages"], PUSH_RB=t["push_rb"],
                  PUSH_BLOCK=t["push_block"], ELEM=tl.int32)
    reduce = dict(NC=4, TB=t["reduce_tb"], BLOCK=t["reduce_block"], R_POW2=2, K_POW2=8, HAS_TIMER=True, STAGES=3)
    # the exchange kernel unfused (Buffer, and ElasticBuffer's captured dispatch) and with the layout fused in
    # (ElasticBuffer's eager dispatch: DSv3 at world 1, and 8 ranks; 300 experts: two histogram blocks)
    cases = [
        (ht_notify._dispatch_notify_kernel, COMMON,
         dict(BLOCK=t["notify_block"], R_POW2=r, C_POW2=32, K_POW2=8, TB=128, CHECK_WORST=w, CHECK_TOPK=True,
              HOST_COUNTS=not w, HAS_TIMER=True, FUSED_LAYOUT=f, EB=eb, CP2=32), t["notify_warps"])
        for r, w, f, eb in ((8, False, False, 1), (8, True, False, 1), (1, False, True, 256), (1, True, True, 256),
                            (8, False, True, 256), (4, False, True, 256))
    ] + [
        (ht_notify._notify_kernel, COMMON, dict(BLOCK=t["notify_block"], R_POW2=8, DO_SEND=True, DO_RECV=True,
                                                HAS_TIMER=True), t["notify_warps"]),
        (ht_notify._handle_kernel, COMMON, dict(CHECK_WORST=True, R_POW2=8, C_POW2=32, TB=128, CHECK_TOPK=True,
                                                K_POW2=8), 4),
        (ht_layout._layout_kernel, COMMON, layout_launch(8, 256, 8)[2], 4),  # DeepSeek-V3 on 8 ranks
    ] + [
        (ht_receive._dispatch_impl_kernel, GATHER, dict(gather, CACHED=cached, IS_PREFIX=cached, HAS_SCALES=True,
                                                 HAS_TOPK=not cached, PUSH=True, PUSH_TOPK=not cached),
         t["gather_warps"]) for cached in (False, True)
    ] + [
        (ht_receive._combine_kernel, COMBINE, dict(reduce, HAS_W=True, NUM_BIAS=2, PUSH_RB=t["cpush_rb"],
                                                   PUSH_BLOCK=t["cpush_block"]), t["reduce_warps"]),
        (ht_receive._reduce_kernel, COMBINE, dict(reduce, HAS_W=True, NUM_BIAS=1), t["reduce_warps"]),
    ]
    fused = [c for c in cases if c[2].get("FUSED_LAYOUT")]
    print("plan", len(cases) + 1 + len(fused))  # the test asks for one "ok" line each
    # the layout kernel's sums are read only by later kernels on its GPU: its ticket is acq_rel at GPU scope,
    # with no system-scope atomic or fence (a MEMBAR.SYS per program)
    ptx = compile_kernel(ht_layout._layout_kernel, COMMON, layout_launch(8, 256, 8)[2], 4).asm["ptx"]
    sys_ops = re.findall(r"\b(?:atom|red|fence|membar)\.[\w.]*\bsys\b[\w.]*", ptx)
    gpu_ticket = re.findall(r"atom\.global\.gpu\.acq_rel\.add\.u32", ptx)
    if sys_ops or not gpu_ticket:
        raise SystemExit(f"layout kernel: system-scope operations {sys_ops[:4]}, GPU-scope tickets {gpu_ticket[:2]}")
    print("ok _layout_kernel scope: no system-scope atomic or fence,", len(gpu_ticket), "acq_rel.gpu ticket(s)")
    # the exchange kernel with the layout fused in holds a tile's ids, its rank bits and a histogram besides the
    # rank programs' scan: no register spills (ranks as a [TB, K, R] compare spilled at 8 ranks)
    for fn, types, consts, warps in fused:
        spilled = spill_bytes(compile_kernel(fn, types, consts, warps))
        if spilled:
            raise SystemExit(f"{fn.fn.__name__} R_POW2={consts['R_POW2']}: {spilled} bytes of register spills")
        print("ok", fn.fn.__name__, f"FUSED_LAYOUT R_POW2={consts['R_POW2']}: no register spills")
    for fn, types, consts, warps in cases:
        name = fn.fn.__name__
        flags = ",".join(f"{k}={v}" for k, v in consts.items() if isinstance(v, bool))
        print("ok", name, flags, compile_one(fn, types, consts, warps), "bytes of cubin,", warps, "warps")


if __name__ == "__main__":
    main()
