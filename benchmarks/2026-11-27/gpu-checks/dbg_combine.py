"""Debug: the internode HT combine on a GPU, 2 ranks (virtual nodes), each case with a short deadline;
prints the error and the counter words after it."""
import os, sys, traceback
import torch
from epcomm.testing.launcher import parallel_launch


def _rank(ctx, gpn, variant):
    os.environ["EPCOMM_GPUS_PER_NODE"] = str(gpn)
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.inputs import Case
    from epcomm import Config
    from epcomm.kernels import internode_ht as ih
    r = ctx.world_size
    ref, fast = G.make_buffers(ctx.group, fast="internode", num_nvl_bytes=1 << 30)
    fast._backend.timeout_s = 6.0
    case = Case(num_ranks=r, tokens=(512, 300), hidden=7168, num_topk=8, num_experts=64, seed=1)
    if variant.startswith("h"):  # h<H>k<K>t<T0>-<T1>
        import re
        hh, kk, t0, t1 = map(int, re.match(r"h(\d+)k(\d+)t(\d+)-(\d+)", variant).groups())
        case = Case(num_ranks=r, tokens=(t0, t1), hidden=hh, num_topk=kk, num_experts=64, seed=1)
    if variant == "small":
        case = Case(num_ranks=r, tokens=(64, 40), hidden=256, num_topk=4, num_experts=16, seed=1)
    dev = fast.device
    xin, x, topk, w = G.device_inputs(case, ctx.rank, dev, False)
    fr = G._dispatch(fast, xin, topk, w, case.num_experts)
    (torch.cuda.synchronize() if torch.cuda.is_available() else None)
    info = fast._backend._ht_impl()._info(fr[4])
    lines = [f"rank {ctx.rank} gpn {gpn} {variant}: dispatch ok rows={fr[0].shape[0]} T={x.shape[0]} "
             f"C={getattr(info, 'c', '?')} pc={getattr(info, 'pc', '?')} tm={getattr(info, 'tm', '?')}"]
    y = fr[0]
    cfg = Config(2, 6, 256, 1, 128) if variant == "sms2" else None
    try:
        fo, fw, _ = fast.combine(y, fr[4], topk_weights=fr[2] if variant != "now" else None, config=cfg)
        (torch.cuda.synchronize() if torch.cuda.is_available() else None)
        lines.append(f"rank {ctx.rank}: combine returned, sum {float(fo.float().abs().sum()):.4g}")
        fast._backend.check_mirror() if hasattr(fast._backend, "check_mirror") else None
    except Exception as e:  # noqa: BLE001
        lines.append(f"rank {ctx.rank}: combine raised {type(e).__name__}: {str(e)[:600]}")
    try:
        (torch.cuda.synchronize() if torch.cuda.is_available() else None)
        be = fast._backend
        ht = be._ht_impl()
        n_, p_ = be.ranks_per_node, r // be.ranks_per_node
        d_nv, c_cs, c_fn, f_rd, f_nv, f_cs, f_fn, tot = ih.ctr_words(r, n_, ht.cm)
        words = be.symm[ht.ctr_off:ht.ctr_off + tot * 8].view(torch.int64).cpu()
        bases = ht.bases.cpu()
        C = getattr(info, "c", 4)
        for nm, lo, cnt in (("D_RD", 0, p_), ("D_NV", d_nv, r), ("C_CS", c_cs, r), ("C_FN", c_fn, p_)):
            for q in range(cnt):
                lines.append(f"  {nm}[{q}] ctr={words[lo + q * ht.cm: lo + q * ht.cm + C].tolist()} "
                             f"base={bases[lo + q * ht.cm: lo + q * ht.cm + C].tolist()}")
        lines.append(f"  F words {words[f_rd:tot].tolist()} state={ht.state.tolist()} tickets={ht.tickets.tolist()}")
        lines.append(f"  err {be.err.cpu().tolist()}")
    except Exception as e:  # noqa: BLE001
        lines.append(f"rank {ctx.rank}: dump failed {type(e).__name__}: {e}\n{traceback.format_exc()[-800:]}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 2:
        for v in sys.argv[2:]:
            print(f"=== {v}", flush=True)
            try:
                for out in parallel_launch(2, _rank, 1, v, backend="nccl", timeout_s=60):
                    print(out, flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"launch failed: {str(e)[:1500]}", flush=True)
        sys.exit(0)
    for gpn, variant in ([(1, "small")] if len(sys.argv) > 1 else [(1, "dsv3"), (1, "small"), (2, "small"), (1, "sms2"), (1, "now")]):
        print(f"=== gpn={gpn} variant={variant}", flush=True)
        try:
            for out in parallel_launch(2, _rank, gpn, variant, backend="nccl" if torch.cuda.is_available() else "gloo", timeout_s=75):
                print(out, flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"launch failed: {str(e)[:3000]}", flush=True)
