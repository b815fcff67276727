"""Compile every kernel of ``ElasticBuffer`` (``kernels/v2_dispatch.py``, ``kernels/v2.py``) for sm_90 with Triton's own compiler (PTX
and ptxas; no GPU needed), in each variant the launchers (``backends/elastic_kernels.py``,
``backends/nvlink_v2.py``) pick: the interpreter the CPU tests use runs kernels as Python and lets through
what the compiler rejects (types, pointer casts, loop-carried values). Argument types as the launchers pass
them (``sm90.compile_one``). Run by ``tests/unit/test_elastic_layout.py``;
alone: ``PYTHONPATH=src python tests/unit/sims/compile_elastic.py``."""
from sm90 import compile_one

from epcomm.backends.elastic_kernels import reduce_block
from epcomm.kernels import v2, v2_dispatch

I32, I64, U8, BF16, F32 = "*i32", "*i64", "*u8", "*bf16", "*fp32"
META = dict(rpm=I32, recv_src=I32, recv_local=I64, local=I64, local_out=I64, meta=I32, gid=I64, counts=I32,
            psum=I32, psum_rank=I32, cum=I32, topk=I64, topk_copy=I64, send_head=I32, dst_slot=I32, part=I32,
            ticket=I32)
LAYOUT = dict(counts=I32, local=I64, rpm=I32, meta=I32, source=I64)
COPY = dict(src=BF16, source=I64, out=BF16, sf_src=F32, sf_out=I32, w_src=F32, w_out=F32, slots=I32)
PACK = dict(x=BF16, meta=I32, w=F32, rows=U8, dst=I64)
REDUCE = dict(got=U8, topk=I64, b0=BF16, b1=BF16, acc_io=F32, out=BF16, out_w=F32, x_self=BF16, w_self=F32,
              send_head=I32)
TRANSPORT = dict(rows=U8, wts=U8, dst=I64, ptr_table=I64, flags=I32, epoch_ptr=I32, err_ptr=I32, timeout_ns="i64")


def main() -> None:
    k8 = dict(K=8, KP=8)
    cases = [
        # (DSv3 at 8 ranks, at world 1 with 256 local experts and the handle's copy of the ids, 8 experts)
        *[(fn, META, dict(k8, R=r, LE=le, LEP=le, HB=max(le, 32), BN=128, RB=r, COPY=not e, EXPAND=e,
                          HAS_CUM=c, COPY_TOPK=ct))
          for fn, r, le, e, c, ct in ((v2_dispatch._dispatch_copy_epilogue_impl_meta_kernel, 8, 32, 0, 0, 1),
                                      (v2_dispatch._dispatch_copy_epilogue_impl_meta_kernel, 1, 256, 0, 1, 1),
                                      (v2_dispatch._recv_meta_kernel, 8, 32, 1, 1, 0),
                                      (v2_dispatch._recv_meta_kernel, 2, 8, 1, 0, 1))],
        (v2_dispatch._expert_layout_kernel, LAYOUT, dict(k8, R=8, LE=32, LEP=32, BN=512)),
        # by expanded row, and by contiguous row (the handle's slots, rows K + 2 apart)
        *[(v2_dispatch._dispatch_copy_epilogue_impl_kernel, COPY, dict(
            k8, ROW=7168, SRC_STRIDE=7168, SFB=224, SFBP=256, SF_OFF=0, SF_STRIDE=224, W_OFF=0, W_STRIDE=32,
            HAS_SF=sf, HAS_W=w, ZERO=z, RB=8, BLOCK=2048, BY_ROW=br, SLOT_STRIDE=10))
          for br in (0, 1) for sf, w, z in ((0, 1, 0), (1, 1, 1), (1, 0, 0))],
        *[(v2._combine_pack_kernel, PACK, dict(k8, H=7168, W=14352, HAS_W=w, MODE=mode, BLOCK=1024))
          for mode, w in ((0, 0), (0, 1), (1, 1), (2, 0))],
        *[(v2._combine_reduce_epilogue_impl_kernel, REDUCE, dict(
            k8, LE=128, ROW=14352, H=7168, W_OFF=3584, NB=nb, MASTER=ms, HAS_W=w, ACC_IN=ai, ACC_OUT=ao,
            BLOCK=reduce_block(7168)[0]))
          for nb, ms, w, ai, ao in ((0, 1, 0, 0, 0), (2, 1, 1, 0, 0), (1, 0, 0, 0, 1), (0, 0, 0, 1, 0))],
        # this rank's own rows read in place (x and weights of DSv3, and strided x without weights)
        *[(v2._combine_reduce_epilogue_impl_kernel, REDUCE, dict(
            k8, LE=128, ROW=14368, H=7168, W_OFF=3584, NB=nb, MASTER=1, HAS_W=w, ACC_IN=0, ACC_OUT=0,
            BLOCK=reduce_block(7168)[0],
            SELF=True, XS=xs, WS=8 if w else 0)) for nb, w, xs in ((2, 1, 7168), (0, 0, 7200))],
        # packed rows (XW = XS = W, KW = 0), and x | weights read in place (aligned DSv3; odd words)
        *[(v2._combine_impl_kernel, TRANSPORT, dict(W=w, XW=xw, XS=xs, KW=kw, KS=ks, HAS_TIMER=True, RB=8, BLOCK=1024,
                                                    ALIGNED=a))
          for w, xw, xs, kw, ks, a in ((3592, 3592, 3592, 0, 0, True), (3587, 3587, 3587, 0, 0, False),
                                       (3592, 3584, 3584, 8, 8, True), (3588, 3583, 3590, 3, 5, False))],
        (v2._combine_impl_kernel, TRANSPORT, dict(W=3592, XW=3584, XS=3584, KW=8, KS=8, HAS_TIMER=True, RB=8,
                                                  BLOCK=1024, ALIGNED=True, SKIP_SELF=True)),
        (v2._combine_arrive_kernel, TRANSPORT, dict(HAS_TIMER=True)),
    ]
    print("plan", len(cases))  # the test asks for one "ok" line each
    for fn, types, consts in cases:
        w = {v2._combine_arrive_kernel: 1, v2._combine_impl_kernel: 8, v2_dispatch._dispatch_copy_epilogue_impl_kernel: 8,
             v2._combine_reduce_epilogue_impl_kernel: reduce_block(7168)[1]}.get(
            fn, 16 if fn is v2_dispatch._expert_layout_kernel else 4)  # as the launchers launch them
        print("ok", fn.fn.__name__, compile_one(fn, types, consts, w), "bytes of cubin")


if __name__ == "__main__":
    main()
