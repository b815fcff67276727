"""DeepEP V1's eager high-throughput calls, timed the way ``epcomm bench`` times an eager call, on whichever library
``import deep_ep`` gives: DeepEP's own build (its tree on ``PYTHONPATH``) or epcomm (``EPCOMM_AS_DEEP_EP=1``).

Each iteration: a barrier, a one-element ``all_reduce``, then CUDA events around the call; "host" is the wall time
until the call returns. 24 SMs, DeepEP's default chunk sizes, DeepSeek-V3 shapes (4096 tokens, hidden 7168, top-8,
256 experts), 5 warm-up and 30 timed iterations; each rank's median, then the largest over ranks. This is the
anchor script of ``benchmarks/anchors/deepep-v1-h200x2-2026-11-23/deepep_eager.py`` with its ranks spawned here and
one option, ``--share-gpu``: every rank on GPU 0, a gloo process group (NCCL refuses two ranks on one GPU) and torch
symmetric memory told to accept that (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``); run it under an MPS daemon, as
``scripts/gpu_jobs.sh``'s ``mps:`` jobs do.

Usage::

    python scripts/deepep_eager.py [--ranks 2] [--share-gpu] [--label NAME] [--json FILE]

Prints one line a call; ``--json`` appends one JSON row a call (label, library, its file, commit, device, env).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

T, H, K, E = 4096, 7168, 8, 256


def _run(rank: int, args) -> None:
    import deep_ep

    dev = 0 if args.share_gpu else rank
    torch.cuda.set_device(dev)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    init = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '8371')}"
    if args.share_gpu:
        dist.init_process_group("cpu:gloo,cuda:gloo", init_method=init, world_size=args.ranks, rank=rank)
    else:
        dist.init_process_group("nccl", init_method=init, world_size=args.ranks, rank=rank,
                                device_id=torch.device("cuda", dev))
    buf = deep_ep.Buffer(dist.group.WORLD, int(1e9), 0)
    deep_ep.Buffer.set_num_sms(24)
    torch.manual_seed(rank)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    scores = torch.randn(T, E, device="cuda").abs() + 1
    idx = scores.topk(K, -1).indices.to(getattr(deep_ep, "topk_idx_t", torch.int64))
    w = torch.rand(T, K, device="cuda")
    xq = x.view(T, H // 128, 128).float()
    amax = xq.abs().amax(-1).clamp(min=1e-4)
    x_fp8 = ((xq * (448.0 / amax.unsqueeze(-1))).to(torch.float8_e4m3fn).view(T, H), (amax / 448.0).contiguous())
    one = torch.ones(1, device="cuda")

    def timed(fn, iters=30, warm=5):
        ts, hs = [], []
        for i in range(warm + iters):
            dist.barrier()
            dist.all_reduce(one)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            t0 = time.perf_counter()
            fn()
            h = (time.perf_counter() - t0) * 1e6
            e.record()
            torch.cuda.synchronize()
            if i >= warm:
                ts.append(s.elapsed_time(e) * 1e3)
                hs.append(h)
        med = torch.tensor([statistics.median(ts), statistics.median(hs)], device="cuda")
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        return med.tolist()

    def dispatch(xx, handle=None):
        if handle is not None:
            return buf.dispatch(xx, handle=handle)
        n_rank, n_rdma, n_exp, in_rank, _ = buf.get_dispatch_layout(idx, E)
        return buf.dispatch(xx, num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_rdma,
                            is_token_in_rank=in_rank, num_tokens_per_expert=n_exp, topk_idx=idx, topk_weights=w)

    rows = []
    for name, xx in (("bf16", x), ("fp8", x_fp8)):
        rows.append((f"dispatch {name} uncached (layout + dispatch)", *timed(lambda: dispatch(xx))))
        handle = dispatch(xx)[4]
        rows.append((f"dispatch {name} cached", *timed(lambda: dispatch(xx, handle))))
    recv_x, _, _, _, handle, _ = dispatch(x)
    rows.append(("combine bf16", *timed(lambda: buf.combine(recv_x, handle))))
    if rank == 0:
        lib = "epcomm" if "_deep_ep" in (deep_ep.__file__ or "") else "deepep"  # (epcomm/_deep_ep under the switch)
        env = {k: os.environ.get(k) for k in ("EPCOMM_AS_DEEP_EP", "EPCOMM_TUNE", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                                              "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                              "NVSHMEM_DISABLE_NVLS")}
        for r in rows:
            print(f"{args.label or lib} eager {r[0]:44s} {r[1]:8.1f} us   host {r[2]:8.1f} us", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(dict(label=args.label or lib, library=lib, file=deep_ep.__file__,
                                            commit=os.environ.get("EPCOMM_COMMIT") if lib == "epcomm" else None,
                                            device=torch.cuda.get_device_name(dev), ranks=args.ranks,
                                            share_gpu=args.share_gpu, op=r[0], us=r[1], host_us=r[2],
                                            env=env)) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--share-gpu", action="store_true", help="every rank on GPU 0, gloo (under MPS)")
    p.add_argument("--label", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.ranks < 1:
        p.error(f"--ranks must be >= 1, got {args.ranks}")
    if args.share_gpu:  # torch symmetric memory (epcomm's nvlink backend) must accept one device in several ranks
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    mp.spawn(_run, args=(args,), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
