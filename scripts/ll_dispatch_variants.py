"""Low-latency dispatch launch variants A/B'd in one process on one GPU (world 1, NCCL).

Each variant is a set of ``nvlink_ll.TUNE`` overrides (the keys ``EPCOMM_TUNE=ll.<key>=<value>`` sets);
between variants the Buffer's and the engine's per-kind calls are dropped, so the next call builds its
launches anew. Per variant and token count: the compiled kernels' registers / spills / warps, whether the
outputs equal the first variant's bit for bit, and CUDA-graph replay times of a graph of ``--graph``
dispatches (median of the per-dispatch time over ``--replays`` replays; rounds alternate the variants,
the table gives the median of round medians).

Example (DSv3 shapes, 128 and 1 tokens, FP8):
``python3 scripts/ll_dispatch_variants.py --variants "sep:fused_dispatch=0" "head:" "qb1:both_qb=1"``
"""

from __future__ import annotations

import argparse
import statistics
import sys


def _variant(spec: str) -> tuple[str, dict]:
    name, _, kv = spec.partition(":")
    over = {}
    for item in filter(None, (p.strip() for p in kv.split(","))):
        k, _, v = item.partition("=")
        over[k.strip()] = v.strip()
    return name, over


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", required=True, help="NAME:key=val,key=val (TUNE keys of nvlink_ll)")
    ap.add_argument("--tokens", default="128,1")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--m", type=int, default=128)
    ap.add_argument("--graph", type=int, default=8, help="dispatches per captured graph (even)")
    ap.add_argument("--replays", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bf16", action="store_true")
    a = ap.parse_args(argv)

    import torch

    from epcomm.backends import nvlink_ll
    from epcomm.backends.nvlink import apply_tune
    from epcomm.bench.hostprobe import gpu_buffer

    buf = gpu_buffer(a.m, a.hidden, a.experts)
    base = dict(nvlink_ll.TUNE)
    variants = [_variant(s) for s in a.variants]
    toks = [int(t) for t in a.tokens.split(",")]
    h, e, k, m = a.hidden, a.experts, a.topk, a.m
    g = torch.Generator().manual_seed(0)
    inputs = {}
    for t in toks:
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
        topk = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).cuda()
        inputs[t] = (x, topk)

    def use(over):
        nvlink_ll.TUNE.clear()
        nvlink_ll.TUNE.update(base)
        apply_tune(dict(over), nvlink_ll.TUNE, "ll.")
        buf._ll_fast.clear()
        eng = buf._backend._ll_impl()
        eng._dcalls.clear()
        eng._ccalls.clear()

    def call(t):
        x, topk = inputs[t]
        return buf.low_latency_dispatch(x, topk, m, e, use_fp8=not a.bf16)

    def snapshot(res):
        recv_x, count, handle = res[0], res[1], res[2]
        xs = recv_x if isinstance(recv_x, torch.Tensor) else recv_x[0]
        cnt = count.cpu()
        parts = [cnt]
        for l in range(xs.shape[0]):
            c = int(cnt[l])
            parts.append(xs[l, :c].view(torch.uint8).cpu())
            if not isinstance(recv_x, torch.Tensor):
                parts.append(recv_x[1][l, :c].cpu())
            parts.append(handle.recv_src_info[l, :c].cpu())
        return parts

    def same(p, q):
        return len(p) == len(q) and all(torch.equal(u, v) for u, v in zip(p, q))

    graphs, ref, info = {}, {}, {}
    for name, over in variants:
        use(over)
        for t in toks:
            for _ in range(4):
                out = call(t)
            torch.cuda.synchronize()
            snap = snapshot(out)
            ok = same(snap, ref.setdefault(t, snap))
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                for _ in range(a.graph):
                    call(t)
            gr.replay()
            torch.cuda.synchronize()
            graphs[(name, t)] = gr
            info[(name, t)] = ok
        regs = []
        for kname in ("k_dfused", "k_send", "k_recv"):
            lau = getattr(buf._backend._ll_impl(), kname)
            for ck in lau.fn.device_caches[torch.cuda.current_device()][0].values():
                if hasattr(ck, "result"):
                    ck = ck.result()
                regs.append(f"{kname}:{ck.n_regs}r/{ck.n_spills}s/{ck.metadata.num_warps}w")
        info[name] = sorted(set(regs))
    use({})

    times = {key: [] for key in graphs}
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(a.rounds):
        for key, gr in graphs.items():
            per = []
            for _ in range(a.replays):
                torch.cuda._sleep(200_000)
                st.record()
                gr.replay()
                en.record()
                en.synchronize()
                per.append(st.elapsed_time(en) * 1000 / a.graph)
            times[key].append(statistics.median(per))
    print(f"# world 1, H={h} E={e} K={k} M={m} {'BF16' if a.bf16 else 'FP8'}, graph of {a.graph} dispatches, "
          f"{a.rounds} rounds x {a.replays} replays, us per dispatch (median of round medians, spread)")
    print(f"# device: {torch.cuda.get_device_name()}")
    for name, over in variants:
        cells = []
        for t in toks:
            v = times[(name, t)]
            cells.append(f"T={t}: {statistics.median(v):6.1f} ({min(v):.1f}..{max(v):.1f})"
                         f"{'' if info[(name, t)] else ' DIFFERS'}")
        print(f"{name:14s} {'  '.join(cells)}  {' '.join(info[name])}  {over}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
