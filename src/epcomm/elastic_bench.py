"""Superseded: use ``epcomm bench --api v2`` (bench/v2.py), which times the same V2 cases and checks every
row as timed against a reference-backend ``ElasticBuffer``, and records the device, commit and environment::

    epcomm bench --api v2 --cases ht-dsv3 --num-sms 4,8,12,24 --out v2.jsonl
    EPCOMM_TEST_SHARE_GPU=1 epcomm bench --api v2 --cases ht-dsv3 --num-sms 4,8,12,24 --world-size 2

This older script checks nothing and its rows record no environment: do not publish its figures. It
stays only for its quick side-by-side of the V1 high-throughput graph pair in the same process (``epcomm
bench`` times V1's graph rows in its own run)::

    python -m epcomm.elastic_bench --ranks 2                     # one GPU per rank (or gloo CPU ranks)
    EPCOMM_TEST_SHARE_GPU=1 python -m epcomm.elastic_bench --ranks 2   # ranks sharing a GPU

Cases, at the DeepSeek-V3 shape by default (``--tokens 4096 --hidden 7168 --topk 8 --experts 256``):
V2 dispatch (contiguous and expanded, FP8 with fp32 per-128 scales or BF16, with and without CPU sync) and
combine, each eager (``host_us``, ``us``) and, without CPU sync, replayed from a CUDA graph (``graph_us``);
the V1 high-throughput dispatch + combine graph (``num_worst_tokens``); ``--sms`` sweeps ``num_sms``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _timed(fn, iters: int, sync) -> tuple[float, float]:
    """(median host µs of one call, median µs of one call to a device sync)."""
    host, full = [], []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e6)
        full.append((t2 - t0) * 1e6)
    return statistics.median(host), statistics.median(full)


def _v2_case(buf, xin, kw: dict, iters: int, sync, graph: bool) -> dict:
    """One V2 case: eager dispatch and combine times, and (``graph``) a captured pair's replay time."""
    import torch

    from epcomm.testing import gpu_cases as G

    rx, _, _, hd, _ = buf.dispatch(xin, **kw)
    y = torch.zeros((rx[0] if isinstance(rx, tuple) else rx).shape[0], buf.hidden, dtype=torch.bfloat16,
                    device=buf.device)
    d_host, d_us = _timed(lambda: buf.dispatch(xin, **kw), iters, sync)
    c_host, c_us = _timed(lambda: buf.combine(y, hd), iters, sync)
    row = {"dispatch_host_us": d_host, "dispatch_us": d_us, "combine_host_us": c_host, "combine_us": c_us}
    if graph:
        g, _ = G.capture(lambda: (buf.dispatch(xin, **kw), buf.combine(y, hd)))
        row["graph_dispatch_combine_us"] = _timed(g.replay, iters, sync)[1]
    return row


def _v1_graph(ctx, buf, q, sf, idx, w, e: int, iters: int, sync) -> float:
    """The V1 high-throughput FP8 dispatch + combine (``num_worst_tokens``) replayed from a graph: µs."""
    import torch

    from epcomm import Buffer
    from epcomm.testing import gpu_cases as G

    v1 = Buffer(ctx.group, num_nvl_bytes=buf._engine.num_nvl_bytes)
    per_rank, _, per_expert, in_rank, _ = v1.get_dispatch_layout(idx, e)
    cfg = Buffer.get_dispatch_config(ctx.world_size)

    def pair():
        r = v1.dispatch((q, sf), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                        num_worst_tokens=q.shape[0] * ctx.world_size, config=cfg)
        return v1.combine(torch.zeros(r[0][0].shape[0], q.shape[1], dtype=torch.bfloat16, device=q.device), r[4])

    g, _ = G.capture(pair)
    return _timed(g.replay, iters, sync)[1]


def _rank(ctx, a):
    import torch

    from epcomm import ElasticBuffer
    from epcomm.quant import per_token_cast_to_fp8

    dev = ctx.device
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator(device="cpu").manual_seed(ctx.rank)
    t, h, k, e = a.tokens, a.hidden, a.topk, a.experts
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(dev)
    w = torch.rand(t, k, generator=g).to(dev)
    q, sf = per_token_cast_to_fp8(x, False)
    buf = ElasticBuffer(ctx.group, num_max_tokens_per_rank=t, hidden=h, num_topk=k, explicitly_destroy=True)
    rows = []
    base = {"ranks": ctx.world_size, "tokens": t, "hidden": h, "topk": k, "experts": e}
    for sms in a.sms:
        for fp8 in (True, False):
            for expand in (False, True):
                for sync_cpu in (True, False):
                    kw = {"topk_idx": idx, "topk_weights": w, "num_experts": e, "num_sms": sms, "do_expand": expand,
                          "expert_alignment": 128 if expand else 1, "do_cpu_sync": sync_cpu}
                    row = _v2_case(buf, (q, sf) if fp8 else x, kw, a.iters, sync, cuda and not sync_cpu)
                    rows.append({"api": "v2", "backend": buf._backend.name, **base, "num_sms": sms, "fp8": fp8,
                                 "expand": expand, "cpu_sync": sync_cpu, **row})
        if cuda:  # the V1 high-throughput pair in a graph, for reference
            gr = _v1_graph(ctx, buf, q, sf, idx, w, e, a.iters, sync)
            rows.append({"api": "v1", "backend": buf._backend.name, **base, "num_sms": sms, "fp8": True,
                         "graph_dispatch_combine_us": gr})
    buf.destroy()
    return rows


def main(argv=None) -> int:
    from epcomm.testing.launcher import parallel_launch

    p = argparse.ArgumentParser(prog="python -m epcomm.elastic_bench", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--sms", type=int, nargs="+", default=[0], help="num_sms values (0: the model's choice)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--backend", default=None, help="process group backend (default: nccl with GPUs, else gloo)")
    a = p.parse_args(argv)
    for row in parallel_launch(a.ranks, _rank, a, backend=a.backend, timeout_s=1800)[0]:
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
