"""Compile the row movers of ``ElasticBuffer`` (``kernels/v2.py``, ``kernels/v2_dispatch.py``) for sm_90 as the JIT does for 16-byte aligned
tensors (Triton's own compiler, no GPU) and check in the PTX that their rows move as 16-byte vectors
(``ld/st.global.v4.b32``): the combine transport with DSv3's rows (3592 words, destinations known aligned: a
pointer built from a loaded address is 4-byte aligned to the compiler unless told), packed or read in place
as ``x`` (3584 words) then the weights (8 words, whose loads and stores must be vectors too) and the expanded copy
(BF16 and FP8 rows of bytes; it moved 8 bytes a thread a step), by expanded row and by contiguous row (one load,
a store to each lane's row: the stores vectors too, their rows ``e * ROW`` bytes in). Run by ``tests/unit/test_elastic_launches.py``;
alone: ``PYTHONPATH=src python tests/unit/sims/vectors_elastic.py``."""
import collections
import inspect
import re

import triton
from sm90 import TARGET
from triton.compiler import ASTSource

from epcomm.backends import elastic_kernels as ek
from epcomm.backends import nvlink_v2
from epcomm.kernels import v2, v2_dispatch

COPY = dict(src="*bf16", source="*i64", out="*bf16", sf_src="*fp32", sf_out="*i32", w_src="*fp32", w_out="*fp32",
            slots="*i32")
TRANSPORT = dict(rows="*u8", wts="*u8", dst="*i64", ptr_table="*i64", flags="*i32", epoch_ptr="*i32", err_ptr="*i32",
                 timeout_ns="i64")


def ptx(fn, types: dict, consts: dict, warps: int) -> str:
    """``fn``'s PTX with every pointer argument 16-byte aligned (the JIT's specialisation)."""
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: "constexpr" if p in consts else types.get(p, "*i32" if p.endswith("_ptr") else "i32") for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if sig[p].startswith("*")}
    src = ASTSource(fn, sig, constexprs={(params.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": warps}).asm["ptx"]


def vectors(text: str, op: str) -> int:
    return len(re.findall(rf"\b{op}\.global(?:\.[a-z0-9:_]+)*\.v4\.b32", text))


def main() -> None:
    copy = [dict(ROW=14336, SRC_STRIDE=14336, SFB=0, SFBP=1, HAS_SF=False, HAS_W=True),
            dict(ROW=7168, SRC_STRIDE=7168, SFB=224, SFBP=256, HAS_SF=True, HAS_W=False)]
    copy = [dict(c, BY_ROW=br) for br in (False, True) for c in copy]
    print("plan", 2 + len(copy))
    ops = {}
    for parts in (None, (3584, 3584, 8, 8)):  # packed rows; x | weights read in place (the nvlink combine)
        _, consts = nvlink_v2.transport_launch(14368, 24, True, parts)
        warps = consts.pop("num_warps")
        text = ptx(v2._combine_impl_kernel, TRANSPORT, consts, warps)
        assert vectors(text, "ld") and vectors(text, "st"), f"transport parts={parts}: rows not moved as 16-byte vectors"
        ops[parts] = collections.Counter(re.findall(r"\b(?:ld|st)\.global(?:\.[a-z0-9:_]+)*", text))
        print("ok transport parts", parts, vectors(text, "ld"), "v4 loads", vectors(text, "st"), "v4 stores")
    # read in place, x and the weights move as the packed rows do: the same loads and stores, all of the
    # row's words as 16-byte vectors (no 4-byte ones for the weights)
    assert ops[None] == ops[(3584, 3584, 8, 8)], ops
    for c in copy:
        cc = dict(K=8, KP=8, SF_OFF=0, SF_STRIDE=c["SFB"], W_OFF=0, W_STRIDE=32, ZERO=False, RB=ek.COPY_RB,
                  BLOCK=ek.COPY_BLOCK, SLOT_STRIDE=10, **c)
        text = ptx(v2_dispatch._dispatch_copy_epilogue_impl_kernel, COPY, cc, ek.COPY_WARPS)
        what = f"copy ROW={c['ROW']} BY_ROW={c['BY_ROW']}"
        assert vectors(text, "ld") and vectors(text, "st"), f"{what}: rows not moved as 16-byte vectors"
        # by contiguous row: one load, a store for each of the K lanes
        assert not c["BY_ROW"] or vectors(text, "st") >= 8 * vectors(text, "ld"), (what, vectors(text, "ld"),
                                                                                 vectors(text, "st"))
        print("ok", what, vectors(text, "ld"), "v4 loads", vectors(text, "st"), "v4 stores")


if __name__ == "__main__":
    main()
