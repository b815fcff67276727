"""A/B of the eager high-throughput host path in one process, call by call (one GPU, world 1).

Separate processes on the lent hosts differ by up to 50 % in host time (2026-11-25), more than a host
change is worth; here both trees run in one process, alternating call by call. The old tree is
imported as ``epcomm_base`` (every import inside the package is relative):

    git archive <sha> src | tar -x -C .baseline
    mkdir -p /tmp/abroot && cp -r .baseline/src/epcomm /tmp/abroot/epcomm_base
    PYTHONPATH=src python3 scripts/ab_host.py

Prints, per operation (DSv3: 4096 tokens, hidden 7168, top-8 of 256 experts, BF16, 24 SMs), the
median host time and CUDA-event time of each tree over 240 calls each.
"""
import os
import statistics
import sys
import time

sys.path.insert(0, "/tmp/abroot")
import torch, torch.distributed as dist
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29535")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
import epcomm, epcomm_base
t, h, e, k = 4096, 7168, 256, 8
g = torch.Generator(device="cuda"); g.manual_seed(1)
sets = []
for i in range(4):
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    topk = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, device="cuda", generator=g)
    sets.append((x, topk, w))
def make(mod):
    mod.Buffer.set_num_sms(24)
    buf = mod.Buffer(dist.group.WORLD, int(2e9), 0)
    lays = [buf.get_dispatch_layout(s_[1], e) for s_ in sets]
    def disp(i):
        x, topk, w = sets[i % 4]; ntr, _, nte, isin, _ = lays[i % 4]
        return buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=isin, num_tokens_per_expert=nte, topk_idx=topk, topk_weights=w)
    for i in range(5): disp(i)
    outs = [disp(i) for i in range(4)]
    return {"dispatch": disp, "cached": lambda i: buf.dispatch(sets[i % 4][0], handle=outs[i % 4][4]),
            "combine": lambda i: buf.combine(outs[i % 4][0], outs[i % 4][4], outs[i % 4][2])}
A, B = make(epcomm_base), make(epcomm)
s, e_ = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
res = {(w, op): ([], []) for w in "AB" for op in A}
for i in range(240):
    for op in A:
        for w, ops in (("A", A), ("B", B)) if i % 2 else (("B", B), ("A", A)):
            torch.cuda.synchronize()
            s.record(); t0 = time.perf_counter(); ops[op](i); t1 = time.perf_counter(); e_.record()
            torch.cuda.synchronize()
            res[(w, op)][0].append((t1 - t0) * 1e6); res[(w, op)][1].append(s.elapsed_time(e_) * 1e3)
for op in A:
    a, b = res[("A", op)], res[("B", op)]
    print(f"{op:9} before: host {statistics.median(a[0]):6.1f} events {statistics.median(a[1]):6.1f} | "
          f"after: host {statistics.median(b[0]):6.1f} events {statistics.median(b[1]):6.1f}")
