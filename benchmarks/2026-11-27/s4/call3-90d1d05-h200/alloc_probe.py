# Diagnostic: host time of eager V2 dispatches at world 1 and what the CUDA caching allocator does.
import os, time, statistics, sys
import torch, torch.distributed as dist
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29581")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
torch.cuda.set_device(0)
import epcomm
T, H, K, E = 4096, 7168, 8, 256
eb = epcomm.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True)
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
idx = (torch.rand(T, E, device="cuda", generator=g)).topk(K, -1).indices.to(torch.int64)
w = torch.rand(T, K, device="cuda", generator=g)
def stats():
    s = torch.cuda.memory_stats()
    return {k: s.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")}
def run(label, keep, expand, sync, handle_copy=True, n=30):
    outs = []
    kw = dict(topk_idx=idx, topk_weights=w, num_experts=E, num_max_tokens_per_rank=T, num_sms=24, do_expand=expand,
              do_cpu_sync=sync, do_handle_copy=handle_copy, expert_alignment=128 if expand else 1)
    for _ in range(5):
        o = eb.dispatch(x, **kw)
    del o
    torch.cuda.synchronize()
    s0 = stats(); ts = []
    out = None
    for i in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        o = eb.dispatch(x, **kw)
        ts.append((time.perf_counter_ns() - t0) / 1e3)
        if keep:
            out = o
        del o
    torch.cuda.synchronize()
    s1 = stats()
    d = {k: s1[k] - s0[k] for k in s0}
    print(f"{label:50s} host us median {statistics.median(ts):7.1f} p10 {sorted(ts)[n//10]:7.1f}  allocator deltas over {n}: {d}", flush=True)
for rep in range(2):
    run("contiguous no-sync, previous kept", True, False, False)
    run("contiguous no-sync, previous freed", False, False, False)
    run("contiguous no-sync, no handle copy, previous kept", True, False, False, handle_copy=False)
    run("contiguous sync, previous kept", True, False, True)
    run("expanded no-sync, previous kept", True, True, False)
eb.destroy()
dist.destroy_process_group()
