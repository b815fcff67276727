# The probe as run (from a clean export of 90d1d05: reduce_block's rule then gave 8 warps from 4096 columns);
# its stdout, transcribed from the device tool's reply, is combine_probe.log.
# Diagnostic: V2 contiguous combine graph-replay time at world 1 per kernel-constant variant,
# and the V1 combine on the same inputs' shape for reference. One process, variants alternated over rounds.
import os, statistics, sys
import torch, torch.distributed as dist
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29591")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
torch.cuda.set_device(0)
import epcomm
from epcomm.backends import elastic_kernels as EK, nvlink_v2 as NV
T, H, K, E = 4096, 7168, 8, 256
eb = epcomm.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True)
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
idx = torch.rand(T, E, device="cuda", generator=g).topk(K, -1).indices.to(torch.int64)
w = torch.rand(T, K, device="cuda", generator=g)
rx, _, rw, hd, _ = eb.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, num_max_tokens_per_rank=T,
                               num_sms=24, do_cpu_sync=False)
ref, ref_w, _ = eb.combine(rx, hd, topk_weights=rw, num_sms=24)
ref, ref_w = ref.clone(), ref_w.clone()
be = eb._backend
def reset():
    eb._kernels._go.clear()
    st = getattr(be, "_v2", None)
    if st: st["kernels"]._go.clear()
VARIANTS = {  # name: (REDUCE_BLOCK_MAX, reduce warps rule override or None, transport RB, BLOCK, WARPS)
    "r8192w8": (8192, None, 8, 1024, 8), "r1024w4": (1024, None, 8, 1024, 8), "r2048w4": (2048, 4, 8, 1024, 8),
    "r4096w8": (4096, None, 8, 1024, 8), "r8192w16": (8192, 16, 8, 1024, 8), "t-rb2": (8192, None, 2, 1024, 8),
    "t-rb4w4": (8192, None, 4, 1024, 4),
}
orig_rb = EK.reduce_block
def setv(v):
    rbmax, rw_, trb, tblk, twarps = v
    EK.REDUCE_BLOCK_MAX = rbmax
    EK.reduce_block = (lambda h: (min(EK._pow2(h), rbmax), rw_ if rw_ else (8 if min(EK._pow2(h), rbmax) >= 4096 else 4)))
    NV.RB, NV.BLOCK, NV.WARPS = trb, tblk, twarps
    reset()
res = {n: [] for n in VARIANTS}
graphs = {}
for n, v in VARIANTS.items():
    setv(v)
    out, ow, _ = eb.combine(rx, hd, topk_weights=rw, num_sms=24)
    torch.cuda.synchronize()
    ok = torch.equal(out, ref) and torch.equal(ow, ref_w)
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2): eb.combine(rx, hd, topk_weights=rw, num_sms=24)
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        o2, w2, _ = eb.combine(rx, hd, topk_weights=rw, num_sms=24)
    graphs[n] = (gr, o2, w2)
    print(n, "bitwise vs the first combine:", ok, flush=True)
for rnd in range(5):
    for n, (gr, o2, w2) in graphs.items():
        for _ in range(3): gr.replay()
        ts = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); gr.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
        res[n].append(statistics.median(ts))
        if rnd == 0:
            print(n, "replay bitwise:", torch.equal(o2, ref) and torch.equal(w2, ref_w), flush=True)
for n, r in res.items():
    print(f"{n:10s} median of round medians {statistics.median(r):7.1f} us  rounds {' '.join(f'{t:.1f}' for t in r)}")
for n, (gr, _, _) in graphs.items():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3): gr.replay()
        torch.cuda.synchronize()
    ks = {e.key: e.device_time_total / e.count for e in prof.key_averages() if "kernel" in e.key}
    print(n, {k: round(v, 1) for k, v in ks.items()}, flush=True)
eb.destroy(); dist.destroy_process_group()
