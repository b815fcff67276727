"""Compile the kernels of DeepEP V2's experimental calls (``kernels/engram.py``, ``pp.py``, ``agrs.py``) for sm_90
with Triton's own compiler (no GPU), in the variants their plans launch (the internode ones with ``SIM=True``: torch's
NVSHMEM Triton module on a CPU build lacks the device library; their bodies are what changes), and check in the PTX
that the copies said to move 16-byte vectors do (``ld/st.global.v4.b32``): the pipeline's payload with
``ALIGNED`` (whole chunks unmasked) and Engram's rows of 16-byte multiples (BF16, ``H = 128`` and ``7168``).
Run by ``tests/unit/test_elastic_extras_hints.py``; alone:
``PYTHONPATH=src python tests/unit/sims/compile_extras.py``."""
import triton
import triton.language as tl
from sm90 import compile_one
from torch.distributed._symmetric_memory import _nvshmem_triton as _nvmod
from vectors_elastic import ptx, vectors


@triton.jit
def _stand_in(*args):
    pass


for _name in ("putmem_signal_block", "quiet", "fence", "putmem_block_extern_wrapper",
              "getmem_nbi_block_extern_wrapper"):  # (device functions a CPU build of torch lacks; SIM=True skips them)
    if not hasattr(_nvmod, _name):
        setattr(_nvmod, _name, _stand_in)

from epcomm.backends.pp import BLOCK
from epcomm.kernels import agrs, engram, pp

PP = dict(x_ptr="*i32", ptr_table="*i64", ctr_ptr="*i32", ticket_ptr="*i32", err_ptr="*i32", timeout_ns="i64")
ENG = dict(idx_ptr="*i32", ptr_table="*i64", out_ptr="*i32", err_ptr="*i32", sf_ptr="*i32", out_sf_ptr="*i32")
AG = dict(ptr_table="*i64", err_ptr="*i32", offs_ptr="*i64", sizes_ptr="*i64", timeout_ns="i64")


def main() -> None:
    cases = []
    for elem, t in ((tl.int32, "*i32"), (tl.int8, "*i8")):
        types = dict(PP, x_ptr=t)
        for aligned in (True, False):
            consts = dict(ELEM=elem, BLOCK=BLOCK, HAS_TIMER=True, ALIGNED=aligned)
            cases += [(pp._pp_send_impl_kernel, types, consts), (pp._pp_recv_impl_kernel, types, consts),
                      (pp._pp_send_impl_nvshmem_kernel, types, dict(consts, SIM=True)),
                      (pp._pp_recv_impl_nvshmem_kernel, types, dict(consts, SIM=True))]
    for h, sf in ((128, False), (7168, False), (72, True), (65, False)):  # (72 FP8: 18 words; 65 BF16: 130 bytes)
        words, elem = engram.row_words(h * (1 if sf else 2))
        w, rb = engram.block_shape(words)
        ty = {tl.int32: "*i32", tl.int16: "*i16", tl.int8: "*i8"}[elem]
        consts = dict(ROW_WORDS=words, W_POW2=w, RB=rb, ELEM=elem, PE=24, PK=3 if sf else 0, PK_POW2=4 if sf else 1,
                      HAS_SF=sf, ALIGNED=(h * (1 if sf else 2)) % 16 == 0)
        cases.append((engram._engram_fetch_impl_kernel, dict(ENG, out_ptr=ty), consts))
        cases.append((engram._engram_fetch_impl_nvshmem_kernel, ENG,
                      dict(ROW_BYTES=h * (1 if sf else 2), PE=24, PK=consts["PK"], PK_POW2=consts["PK_POW2"],
                           HAS_SF=sf, SIM=True)))
    cases += [(agrs._agrs_handshake_kernel, AG, dict(HAS_TIMER=True)),
              (agrs._agrs_put_nvshmem_kernel, AG, dict(SIM=True)),
              (agrs._agrs_wait_signals_kernel, AG, dict(HAS_TIMER=True))]
    vec = [(pp._pp_send_impl_kernel, dict(ELEM=tl.int32, BLOCK=BLOCK, HAS_TIMER=True, ALIGNED=True), PP),
           (pp._pp_recv_impl_kernel, dict(ELEM=tl.int32, BLOCK=BLOCK, HAS_TIMER=True, ALIGNED=True), PP)]
    for h in (128, 7168):
        words, elem = engram.row_words(h * 2)
        w, rb = engram.block_shape(words)
        vec.append((engram._engram_fetch_impl_kernel, dict(ROW_WORDS=words, W_POW2=w, RB=rb, ELEM=elem, PE=24, PK=0,
                                                           PK_POW2=1, HAS_SF=False, ALIGNED=True), ENG))
    print("plan", len(cases) + len(vec))
    for fn, types, consts in cases:
        print("ok", fn.fn.__name__, compile_one(fn, types, consts), "bytes of cubin")
    for fn, consts, types in vec:
        text = ptx(fn, types, consts, 4)
        assert vectors(text, "ld") and vectors(text, "st"), f"{fn.fn.__name__} {consts}: no 16-byte vectors"
        print("ok", fn.fn.__name__, "moves 16-byte vectors")


if __name__ == "__main__":
    main()
