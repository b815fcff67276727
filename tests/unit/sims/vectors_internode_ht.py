"""Compile the internode high-throughput launches for sm_90 as the JIT does for DSv3's shapes (16-byte aligned
tensors, the hidden size's words divisible by 16; Triton's own compiler, no GPU) and check in the PTX that
their rows move as 16-byte vectors (``ld/st.global.v4.b32``), in nodes of one rank, one node of two and any
layout (``N``, ``P`` not constants). Their row pointers come from addresses loaded from ``ptr_table``, which
the compiler takes as 4-byte aligned unless the kernels say otherwise (``kernels/internode_ht_rows.py``): with
every hint in place each tile copy of a row's ``x`` part is 8 vector loads and 8 vector stores a thread
([16 rows x 1024 words] at 16 warps; combine tiles of BF16 [16 x 512], 2), and no BF16 element is read alone.
The minimum counts are this tree's; a hint lost costs a tile copy (8 or 2 fewer). Before the hints: the
dispatch 24-32 of each, the combine 2-6, and 16-64 two-byte loads (the finals' partial rows read element by
element). In nodes of one rank the paired combine (``internode_ht_pair``) reduces [16 x 512] BF16 tiles of two
rows and two biases a step (2 vector loads each, 2 stores a thread; without its partial rows' hint: 16 two-byte
loads), compiled here with its loads unpipelined (``STAGES=1``); pipelined (``TUNE["c_stages"]``), the same
loads become 16-byte ``cp.async`` copies to shared memory (24 at 3 stages; at least 8 asked), and the
shared memory the backend's pipeline depth asks (``_final_stages``) fits a block, at 512 and 1024 columns. Run by
``tests/unit/test_internode_vectors.py``; alone:
``PYTHONPATH=src python tests/unit/sims/vectors_internode_ht.py``."""
import collections
import inspect
import re

import compile_internode_ht as cih  # (installs the NVSHMEM stand-ins before the kernels load)
import triton
from sm90 import TARGET
from triton.compiler import ASTSource

from epcomm.backends.internode_ht import TUNE as T
from epcomm.backends.internode_ht import _final_stages
from epcomm.kernels import internode_ht as ih
from epcomm.kernels import internode_ht_combine as ihc

LAYOUTS = {"nodes of one": dict(N=1, P=2, me=1), "one node of two": dict(N=2, P=1, me=1), "any": {}}
# (dispatch v4 loads, v4 stores, combine v4 loads, v4 stores) at least, per layout
MIN_V4 = {"nodes of one": (48, 48, 28, 16), "one node of two": (40, 40, 20, 14), "any": (64, 64, 24, 18)}


def compiled(fn, types: dict, consts: dict, ints16: set, warps: int):
    """``fn`` compiled with every pointer argument 16-byte aligned and the integers ``ints16`` divisible by 16
    (the JIT's specialisation of DSv3's hidden words and slot rows)."""
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: "constexpr" if p in consts else types.get(p, "*i32" if p.endswith("_ptr") else "i32") for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if sig[p].startswith("*") or p in ints16}
    src = ASTSource(fn, sig, constexprs={(params.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": warps})


def ptx(fn, types: dict, consts: dict, ints16: set, warps: int) -> str:
    """:func:`compiled`'s PTX."""
    return compiled(fn, types, consts, ints16, warps).asm["ptx"]


def counts(text: str) -> collections.Counter:
    """Global loads and stores by kind: ``ld.v4`` / ``st.v4`` (16-byte vectors), ``ld.b16`` (2-byte), ..."""
    c = collections.Counter()
    for m in re.finditer(r"\b(ld|st)\.global((?:\.[a-z0-9:_]+)*)", text):
        mods = m.group(2)
        width = re.findall(r"\.[bsuf](8|16|32|64)\b", mods)
        c[f"{m.group(1)}.{'v4' if '.v4' in mods else 'v2' if '.v2' in mods else 'b' + (width[-1] if width else '?')}"] += 1
    c["cp.async16"] = len(re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*, 0x10", text))  # 16-byte async copies
    return c


def main() -> None:
    print("plan", 2 * len(LAYOUTS) + 2)
    dtypes = dict(cih.I64, rid_ptr="*i64", rw_ptr="*fp32")
    ctypes = dict(cih.I64, x_ptr="*bf16", out_ptr="*bf16", wout_ptr="*fp32", b0_ptr="*bf16", b1_ptr="*bf16")
    for name, lay in LAYOUTS.items():
        d_ld, d_st, c_ld, c_st = MIN_V4[name]
        dc = dict(BLOCK=T["dispatch_block"], RB=T["dispatch_rb"], N_POW2=2, K_POW2=8, G_POW2=1, S_POW2=16,
                  HAS_TIMER=True, SIM=True, NSRC=1, SAVE=1, **lay)
        got = counts(ptx(ih._internode_dispatch_impl_kernel, dtypes, dc, {"XW", "TM"}, T["dispatch_warps"]))
        assert got["ld.v4"] >= d_ld and got["st.v4"] >= d_st, f"dispatch, {name}: {dict(got)}"
        print("ok dispatch", name, dict(got))
        cc = dict(BLOCK=T["combine_block"], FBLOCK=T["final_block"], RB=T["combine_rb"], K_POW2=8, P_POW2=2,
                  HAS_W=True, NB=2, STAGES=1, HAS_TIMER=True, SIM=True, **lay)
        got = counts(ptx(ihc._hc_kernel, ctypes, cc, {"H", "TM"}, T["combine_warps"]))
        assert got["ld.v4"] >= c_ld and got["st.v4"] >= c_st and not got["ld.b16"], f"combine, {name}: {dict(got)}"
        print("ok combine", name, dict(got))
        if name == "nodes of one" and T["c_stages"] > 1:
            for fb in (T["final_block"], 1024):  # (at 1024 columns 3 stages of 2 rows and 2 biases: 256 KiB)
                k = compiled(ihc._hc_kernel, ctypes, dict(cc, FBLOCK=fb, STAGES=_final_stages(2 + 2, fb)), {"H", "TM"},
                             T["combine_warps"])
                got = counts(k.asm["ptx"])
                assert k.metadata.shared <= cih.SMEM_MAX, f"combine, {fb} columns: {k.metadata.shared} bytes shared"
                if fb == T["final_block"]:
                    assert got["cp.async16"] >= 8 and not got["ld.b16"], f"combine, pipelined: {dict(got)}"
                print("ok combine pipelined", name, fb, "columns", k.metadata.shared, "bytes shared", dict(got))


if __name__ == "__main__":
    main()
