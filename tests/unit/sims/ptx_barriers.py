"""Two hazards of a CTA's barriers that only a GPU shows (the interpreter runs a program as one thread),
checked in the sm_90 PTX of the kernels that wait on counters or take tickets (Triton's compiler and
ptxas; no GPU):

1. A spin loop that reads the clock (``%globaltimer``: ``common.wait_ge``'s deadline) must hold no
   barrier: its end differs per thread (each thread reads its own clock and the error word), and a
   barrier inside (Triton puts two around every scalar atomic, whose one thread's result it broadcasts
   through shared memory) then parts the warps that left from those still inside: a deadlock, so the
   deadline never ends a hang.
2. No global word read by every thread and then stored by thread 0 alone (a Triton scalar store) without
   a barrier between: a warp that reads after thread 0's store sees the new value, the others the old
   one, and a branch on it around a barrier deadlocks (``internode_ht_combine``'s counter bases were so).

Run by ``tests/unit/test_cta_uniform.py``; alone: ``PYTHONPATH=src python tests/unit/sims/ptx_barriers.py``.
"""
import re
import sys

import triton
import triton.language as tl
from sm90 import TARGET

from epcomm.kernels.common import wait_ge

LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
BARRIER = re.compile(r"^\s*(?:@%p\d+\s+)?(?:bar|barrier)\.")
ADDR = re.compile(r"\[\s*(%rd\d+)\s*\+\s*(-?\d+)\s*\]")


def body(ptx: str) -> list[str]:
    """The kernel's instructions and labels, without debug lines and comments."""
    out = []
    for line in ptx.splitlines():
        s = line.split("//")[0].rstrip()
        if not s.strip() or s.lstrip().startswith((".loc", ".file", "$L__tmp", "$L__func", "$L__info")):
            continue
        out.append(s)
    return out


def clock_loops_with_barriers(ptx: str) -> list[str]:
    """Innermost loops (a label, then a branch back to it, no loop inside) that read %globaltimer and hold a
    barrier: each as its label and the barrier's line."""
    lines = body(ptx)
    where = {LABEL.match(s.strip()).group(1): i for i, s in enumerate(lines) if LABEL.match(s.strip())}
    loops = []
    for i, s in enumerate(lines):
        m = BRANCH.search(s)
        if m and m.group(1) in where and where[m.group(1)] < i:
            loops.append((where[m.group(1)], i, m.group(1)))
    bad = []
    for lo, hi, name in loops:
        if any(lo < lo2 and hi2 <= hi and (lo2, hi2) != (lo, hi) for lo2, hi2, _ in loops):
            continue  # not innermost
        seg = lines[lo:hi + 1]
        if any("%globaltimer" in s for s in seg):
            bad += [f"{name}: {s.strip()}" for s in seg if BARRIER.match(s)]
    return bad


def one_thread_stores_after_loads(ptx: str) -> list[str]:
    """Stores by thread 0 alone (predicated on ``(tid & (threads - 1)) == 0``, Triton's scalar store) to an
    address that every thread loaded since the last barrier (a straight scan: a barrier forgets)."""
    lines = body(ptx)
    tid = {m.group(1) for s in lines for m in [re.search(r"mov\.u32\s+(%r\d+), %tid\.x;", s)] if m}
    masked = {m.group(1) for s in lines for m in [re.search(r"and\.b32\s+(%r\d+), (%r\d+), (\d+);", s)]
              if m and m.group(2) in tid and (int(m.group(3)) + 1) & int(m.group(3)) == 0}
    one = {m.group(1) for s in lines for m in [re.search(r"setp\.eq\.b32\s+(%p\d+), (%r\d+), 0;", s)]
           if m and m.group(2) in masked}
    loaded: dict = {}
    bad = []
    for s in lines:
        if BARRIER.match(s) or LABEL.match(s.strip()):
            if BARRIER.match(s):
                loaded.clear()
            continue
        t = s.strip()
        pred = re.match(r"@(%p\d+)\s+", t)
        a = ADDR.search(t)
        if a is None:
            continue
        if re.search(r"\bld\.global\b", t) and (pred is None or pred.group(1) not in one):
            loaded[a.groups()] = t
        elif re.search(r"\bst\.global\b", t) and pred is not None and pred.group(1) in one and a.groups() in loaded:
            bad.append(f"{loaded[a.groups()]}  ...  {t}")
    return bad


@triton.jit
def _wait_kernel(flag_ptr, err_ptr, mask_ptr, out_ptr, target, peer, timeout_ns, SHRINK: tl.constexpr):
    ok = wait_ge(flag_ptr, target, err_ptr, 5, peer, timeout_ns, True, mask_ptr, SHRINK)
    tl.store(out_ptr, ok.to(tl.int32))


def _ptx(fn, types, consts, warps):
    import inspect

    from triton.compiler import ASTSource

    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: "constexpr" if p in consts else types.get(p, "*i32" if p.endswith("_ptr") else "i32") for p in params}
    src = ASTSource(fn, sig, constexprs={(params.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=TARGET, options={"num_warps": warps}).asm["ptx"]


def cases():
    import compile_internode_ht as cih  # (installs the NVSHMEM stand-ins before the kernels load)

    from epcomm.backends.internode_ht import TUNE as T
    from epcomm.backends.nvlink_params import layout_launch
    from epcomm.kernels import ht_layout
    from epcomm.kernels import internode_ht as ih
    from epcomm.kernels import internode_ht_combine as ihc

    comb_types = dict(cih.I64, x_ptr="*bf16", out_ptr="*bf16", wout_ptr="*fp32", b0_ptr="*bf16", b1_ptr="*bf16")
    comb = dict(BLOCK=T["combine_block"], FBLOCK=T["final_block"], RB=T["combine_rb"], K_POW2=8, P_POW2=2,
                STAGES=T["c_stages"], HAS_TIMER=True, SIM=True)
    disp = dict(BLOCK=T["dispatch_block"], RB=T["dispatch_rb"], N_POW2=2, K_POW2=8, G_POW2=64, S_POW2=64,
                HAS_TIMER=True, SIM=True)
    out = [(f"wait_ge SHRINK={s}", _wait_kernel, {"timeout_ns": "i64"}, dict(SHRINK=s), 16) for s in (False, True)]
    # the combine with weights (the case that hung; without, the code around the counters is the same), in
    # nodes of any size and of one rank (N=1: a constant)
    out += [(f"internode combine N={extra.get('N', 'any')}", ihc._hc_kernel, comb_types,
             dict(comb, HAS_W=True, NB=2, **extra), T["combine_warps"]) for extra in ({}, {"N": 1})]
    out += [("internode dispatch", ih._internode_dispatch_impl_kernel, dict(cih.I64, rid_ptr="*i64", rw_ptr="*fp32"), disp,
             T["dispatch_warps"])]
    # the layout kernel's last chunk of a group (a ticket, then the sum of every chunk's counts)
    out += [("layout", ht_layout._layout_kernel, {"topk_ptr": "*i64", "in_rank_ptr": "*i8"},
             layout_launch(8, 256, 8)[2], 4)]
    return out


def main() -> int:
    todo = cases()
    print("plan", 2 * len(todo))
    failed = 0
    for name, fn, types, consts, warps in todo:
        ptx = _ptx(fn, types, consts, warps)
        for what, check in (("no barrier in a clock loop", clock_loops_with_barriers),
                            ("no one-thread store over an all-thread load", one_thread_stores_after_loads)):
            bad = check(ptx)
            if bad:
                failed += 1
                print("FAIL", name, what, *bad[:6], sep="\n  ")
            else:
                print("ok", name, what)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
