"""Compile every Triton kernel for sm_90 without a GPU (catches type and syntax errors before a
device run): ``PYTHONPATH=<triton site> python scripts/compile_check.py``.
``COMPILE_PTX=<name part>``: also print the atomics and fences of the matching kernels' PTX."""
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from epcomm.kernels import ht

TARGET = GPUTarget("cuda", 90, 32)


def compile_one(fn, signature, constexprs, name):
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    try:
        k = triton.compile(src, target=TARGET, options={"num_warps": 8})
        print(f"ok   {name}: {k.metadata.shared} B smem, {getattr(k, 'n_regs', '?')} regs")
        if os.environ.get("COMPILE_PTX") and os.environ["COMPILE_PTX"] in name:
            for line in k.asm["ptx"].splitlines():
                if any(w in line for w in ("atom.", "fence.", "membar", "red.")):
                    print("       ", line.strip())
        return True
    except Exception as e:  # noqa: BLE001
        print(f"FAIL {name}: {type(e).__name__}: {str(e)[:2000]} | cause: {e.__cause__!r:.600}")
        return False


def sig(fn, types, consts):
    names = fn.arg_names
    s = {}
    for n in names:
        if n in consts:
            s[n] = "constexpr"
        else:
            s[n] = types.get(n, "i32")
    c = {(names.index(k),): v for k, v in consts.items()}
    return s, c


def main():
    ok = True
    kernels = []
    # pointer arguments by name pattern
    def ptr_types(fn, overrides):
        t = {}
        for n in fn.arg_names:
            if n.endswith("_ptr") or (n.startswith("out_") and "stride" not in n) or n == "ptr_table":
                t[n] = "*i32"
        t.update(overrides)
        return t
    kernels.append((ht._notify_kernel, ptr_types(ht._notify_kernel, {"is_in_ptr": "*i8", "ptr_table": "*i64",
                     "flags_off": "i64", "meta_off": "i64", "list_off": "i64", "timeout_ns": "i64"}),
                    dict(BLOCK=256, R_POW2=2, DO_SEND=True, DO_RECV=True, HAS_TIMER=True)))
    kernels.append((ht._ce_wait_kernel, ptr_types(ht._ce_wait_kernel, {"ptr_table": "*i64", "flags_off": "i64",
                     "timeout_ns": "i64"}), dict(HAS_TIMER=True)))
    kernels.append((ht._ce_flag_value_kernel, ptr_types(ht._ce_flag_value_kernel, {}), dict(NC=4)))
    kernels.append((ht._ce_signal_kernel, ptr_types(ht._ce_signal_kernel, {"ptr_table": "*i64", "flags_off": "i64"}),
                    {}))
    g = ptr_types(ht._gather_kernel, {"tok_ptr": "*i32", "xs_ptr": "*fp32", "topk_ptr": "*i64", "w_ptr": "*fp32", "stage_s_ptr": "*fp32",
                  "stage_k_ptr": "*i64", "stage_w_ptr": "*fp32", "out_s": "*fp32", "out_k": "*i64",
                  "out_w": "*fp32", "ptr_table": "*i64", "flags_off": "i64", "timeout_ns": "i64",
                  "stage_src_elems": "i64", "stage_s_src": "i64", "stage_k_src": "i64", "stage_w_src": "i64",
                  "is_in_ptr": "*i8", "push_off": "i64", "push_slot_bytes": "i64", "push_s_off": "i64",
                  "push_k_off": "i64", "push_w_off": "i64"})
    import triton.language as tl
    for cached, one_load, push, prefetch in ((False, False, False, False), (True, False, False, False),
                                             (False, True, False, True), (False, True, True, False),
                                             (True, True, False, True), (False, True, True, True)):
        kernels.append((ht._gather_kernel, g, dict(CACHED=cached, IS_PREFIX=cached, HAS_SCALES=True, HAS_TOPK=not cached,
                                                 NC=4, RB=8, BLOCK=2048 if one_load else 512, R_POW2=2, K_POW2=8,
                                                 G_POW2=64, STAGES=1 if one_load else 3, HAS_TIMER=True,
                                                 ONE_LOAD=one_load, PUSH=push, PUSH_RB=8, PUSH_BLOCK=512,
                                                 ELEM=tl.int32, PUSH_TOPK=push, PREFETCH=prefetch)))
    kernels.append((ht._reduce_kernel, ptr_types(ht._reduce_kernel, {"x_ptr": "*bf16", "stage_ptr": "*bf16",
                    "w_ptr": "*fp32", "stage_w_ptr": "*fp32", "bias0_ptr": "*bf16", "bias1_ptr": "*bf16",
                    "out_ptr": "*bf16", "out_w_ptr": "*fp32", "ptr_table": "*i64", "flags_off": "i64",
                    "timeout_ns": "i64", "stage_src_elems": "i64", "stage_w_src": "i64"}),
                    dict(HAS_W=True, NUM_BIAS=2, NC=4, TB=4, BLOCK=1024, R_POW2=2, K_POW2=8, HAS_TIMER=True, STAGES=3)))
    for worst in (False, True):
        kernels.append((ht._handle_kernel, ptr_types(ht._handle_kernel, {"chan_ptr": "*i32", "topk_ptr": "*i64"}),
                        dict(CHECK_WORST=worst, R_POW2=2, C_POW2=32, TB=128, CHECK_TOPK=worst, K_POW2=8)))
    kernels.append((ht._combine_push_kernel, ptr_types(ht._combine_push_kernel, {"w_ptr": "*fp32",
                    "ptr_table": "*i64", "flags_off": "i64", "timeout_ns": "i64", "stage_off": "i64",
                    "stage_w_off": "i64"}), dict(HAS_W=True, NC=4, RB=8, BLOCK=512, K_POW2=8, HAS_TIMER=True)))
    kernels.append((ht._push_kernel, ptr_types(ht._push_kernel, {"ptr_table": "*i64", "is_in_ptr": "*i8",
                    "flags_off": "i64", "timeout_ns": "i64", "stage_off": "i64", "xs_ptr": "*fp32", "topk_ptr": "*i64",
                    "w_ptr": "*fp32", "s_off": "i64", "k_off": "i64", "w_off": "i64"}),
                    dict(NC=4, RB=8, BLOCK=512, HAS_TIMER=True, ELEM=tl.int32, HAS_SCALES=True, HAS_TOPK=True,
                         G_POW2=64, K_POW2=8)))
    try:
        from epcomm.kernels import ll
        for fn, types, consts in ll.COMPILE_CHECKS:
            kernels.append((fn, ptr_types(fn, types), consts))
    except ImportError as e:
        print("ll kernels not importable:", e)
    for fn, types, consts in kernels:
        s, c = sig(fn, types, consts)
        ok &= compile_one(fn, s, c, fn.__name__ + str({k: v for k, v in consts.items() if k.isupper()}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
