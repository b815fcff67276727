"""Where does a low-latency call spend its time? Per-kernel CUDA durations (torch.profiler) of the
nvlink dispatch (FP8) + combine pair, with and without the hook, DeepSeek-V3 decode shape (2 ranks,
128 tokens, hidden 7168, top-8, 256 experts), then the steady-state time of one pair: a CUDA graph
of ``N`` back-to-back pairs, start aligned across ranks, divided by ``N``.
Run on the device machine: ``PYTHONPATH=src python3 scripts/profile_ll.py [tokens]`` (gpu_check.sh profile);
``PROFILE_WORLD=1``: one rank (a single GPU: the kernels' local work and launches without the link)."""
import os
import sys

import torch
import torch.distributed as dist

from epcomm import Buffer
from epcomm.bench.timing import make_barrier, make_start
from epcomm.testing import gpu_cases as G
from epcomm.testing.inputs import Case
from epcomm.testing.launcher import parallel_launch

M, H, E, K = 128, 7168, 256, 8


def main(ctx, tokens, variants):
    from epcomm.backends import nvlink_ll

    r = ctx.world_size
    hint = Buffer.get_low_latency_rdma_size_hint(M, H, r, E)
    _, fast = G.make_buffers(ctx.group, num_rdma_bytes=hint, low_latency_mode=True)
    case = Case(num_ranks=r, tokens=(tokens,) * r, hidden=H, num_topk=K, num_experts=E, seed=3)
    x, topk, w = G.ll_inputs(case, ctx.rank, fast.device)[:3]
    y = torch.randn(E // r, r * M, H, device=fast.device).to(torch.bfloat16)
    out = {}

    def pair(hook):
        if hook:
            rx, cnt, hd, ev, rcv = fast.low_latency_dispatch(x, topk, M, E, use_fp8=True, return_recv_hook=True)
            rcv()
            o, ev, rcv = fast.low_latency_combine(y, topk, w, hd, return_recv_hook=True)
            rcv()
        else:
            rx, cnt, hd, ev, _ = fast.low_latency_dispatch(x, topk, M, E, use_fp8=True)
            fast.low_latency_combine(y, topk, w, hd)

    barrier, start = make_barrier(None, fast.device), make_start(None, fast.device, graphs=True)

    for name, tune in variants:
        saved = dict(nvlink_ll.TUNE)
        nvlink_ll.TUNE.update(tune)
        try:
            for hook in ((False, True) if name == "default" else (False,)):
                for _ in range(5):
                    pair(hook)
                torch.cuda.synchronize()
                dist.barrier()
                acts = [torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=acts) as prof:
                    for _ in range(20):
                        pair(hook)
                    torch.cuda.synchronize()
                rows = [(ev.key, ev.count, ev.device_time_total / max(ev.count, 1)) for ev in prof.key_averages()
                        if ev.device_time_total > 0]
                out[(name, hook, "kernels")] = sorted(rows, key=lambda t: -t[2] * t[1])[:8]
            # steady state: N pairs in one graph, aligned start
            n = 20
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                pair(False)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            dist.barrier()
            with torch.cuda.graph(g):
                for _ in range(n):
                    pair(False)
            times = []
            for it in range(12):
                barrier()
                start()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                b.synchronize()
                if it >= 2:
                    times.append(a.elapsed_time(b) * 1e3 / n)
            times.sort()
            out[(name, "pair_us")] = times[len(times) // 2]
            del g
        finally:
            nvlink_ll.TUNE.clear()
            nvlink_ll.TUNE.update(saved)
    return out


VARIANTS = [
    ("default", {}),
    ("recv_split2", dict(recv_split=2)),
    ("send_gc16", dict(send_gc=16)),
    ("csend_b512_w4", dict(csend_block=512)),
    ("crecv_b512", dict(crecv_block=512)),
    ("warps8", dict(recv_warps=8, csend_warps=8, crecv_warps=8)),
    ("fused", dict(fused_dispatch=True, fused_combine=True)),
]

if __name__ == "__main__":
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else M
    res = parallel_launch(int(os.environ.get("PROFILE_WORLD", "2")), main, tokens, VARIANTS, backend="nccl",
                          timeout_s=300)
    for name, _ in VARIANTS:
        for rank, o in enumerate(res):
            for hook in ((False, True) if name == "default" else (False,)):
                print(f"--- {name} rank {rank} hook={hook}: kernel, calls, avg us")
                for key, cnt, us in o[(name, hook, "kernels")]:
                    print(f"   {key[:60]:60s} {cnt:5d} {us:9.1f}")
    print(f"variant                          pair us by rank ({len(res)} ranks, {tokens} tokens)"
          "  [graph of 20 dispatch+combine pairs]")
    for name, _ in VARIANTS:
        print(f"{name:32s} " + " ".join(f"{o[(name, 'pair_us')]:8.1f}" for o in res))
