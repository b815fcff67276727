"""Kernel work on the high-throughput path: GPU time of the nvlink dispatch (num_worst_tokens, CUDA
graph) and combine (graph) and of the eager dispatch, for launch-parameter variants (backends/nvlink_params.py
``TUNE``), DeepSeek-V3 shape, 2 ranks, ranks' devices aligned before each timed replay.
``epcomm bench`` records the figures; this is for choosing parameters.
Run on the device machine: ``PYTHONPATH=src python3 scripts/ht_probe.py [tokens] [sms]``
(``PROBE_VARIANTS=default,p_rb16`` picks variants by name; ``PROBE_EAGER=0`` skips the eager rows;
``PROBE_ITERS`` sets the timed iterations, default 15: eager rows are host-bound and noisy, use more;
``PROBE_WORLD=1``: one rank on one GPU, the local kernels (notify, gather, reduce) without the link)."""
import os
import sys

import torch
import torch.distributed as dist

from epcomm.bench.timing import make_barrier, make_start
from epcomm.testing import gpu_cases as G
from epcomm.testing.inputs import Case
from epcomm.testing.launcher import parallel_launch

VARIANTS = [
    ("default", {}),
    # the SM push as its own kernel before notify, the gather after (no overlap of push and own block)
    ("nofuse", dict(fused_push=False)),
    # the tiles before the fourth session's probe (8 rows x 512 words everywhere, two masked loads)
    ("old_tiles", dict(gather_rb=8, gather_block=512, gather_warps=8, gather_stages=3, gather_one_load=False,
                       push_rb=8, push_block=512, reduce_tb=8, reduce_block=1024, reduce_warps=8)),
    ("g_prefetch", dict(gather_prefetch=True)),
    ("ce_sync1", dict(ce_chunks_sync=1)),  # eager rows: one copy before the synchronisation
    ("notify_first", dict(notify_first=True)),  # eager rows: the count exchange before the copies
    ("ce_sync1_nf", dict(ce_chunks_sync=1, notify_first=True)),
    ("p8x2048", dict(push_rb=8, push_block=2048)),
    ("c8_w16", dict(cpush_warps=16)),
    ("r_tb16_1024", dict(reduce_block=1024)),
    ("r_s1", dict(reduce_stages=1)),
    # the copy engine under capture too (timing only: correctness is gpu_check.sh cegraph's job)
    ("ce_graph", dict(transfer="ce-always")),
    ("ce_graph_copyflag", dict(transfer="ce-always", ce_flag="copy")),
    ("ce_graph_prefetch", dict(transfer="ce-always", gather_prefetch=True)),
    # bigger copy steps: a whole BF16 row (1792 words) per load, fewer dependent steps per tile
    ("g16x2048", dict(gather_block=2048)),
    ("g8x2048", dict(gather_rb=8, gather_block=2048)),
    ("g16x2048_pf", dict(gather_block=2048, gather_prefetch=True)),
    ("notify256", dict(notify_block=256, notify_warps=4)),
    ("notify4096", dict(notify_block=4096, notify_warps=8)),
    ("r_2048_s1", dict(reduce_block=2048, reduce_stages=1)),
    ("r_8x2048_s2", dict(reduce_tb=8, reduce_block=2048, reduce_stages=2)),
    ("r_1024_s1", dict(reduce_block=1024, reduce_stages=1)),
]
if os.environ.get("PROBE_VARIANTS"):  # e.g. PROBE_VARIANTS=default,p_rb16
    VARIANTS = [v for v in VARIANTS if v[0] in os.environ["PROBE_VARIANTS"].split(",")]


def _timed(fn, device, graphs, iters=int(os.environ.get("PROBE_ITERS", "15"))):
    """Median GPU us of ``fn`` with the ranks' devices aligned first, as ``epcomm bench`` does."""
    barrier, start = make_barrier(None, device), make_start(None, device, graphs)
    ts = []
    for it in range(iters + 3):
        barrier()
        start()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        if it >= 3:
            ts.append(a.elapsed_time(b) * 1000)
    ts.sort()
    return ts[len(ts) // 2]


def _variant(fast, case, rank, name, worst, rows):
    for fp8 in (False, True):
        xin, x, topk, w = G.device_inputs(case, rank, fast.device, fp8)
        pr, _, pe, ir, _ = fast.get_dispatch_layout(topk, 256)

        def d(nw=0):
            return fast.dispatch(xin, num_tokens_per_rank=pr, is_token_in_rank=ir, num_tokens_per_expert=pe,
                                 topk_idx=topk, topk_weights=w, num_worst_tokens=nw)
        tag = "fp8" if fp8 else "bf16"
        if os.environ.get("PROBE_EAGER", "1") == "1":  # PROBE_EAGER=0: graph rows only
            rows[(name, f"eager dispatch {tag}")] = _timed(d, fast.device, graphs=False)
        g, _ = G.capture(lambda: d(worst))
        rows[(name, f"graph dispatch {tag}")] = _timed(g.replay, fast.device, graphs=True)
        del g
        if not fp8:
            o = d()
            gc, _ = G.capture(lambda: fast.combine(o[0], o[4]))
            rows[(name, "graph combine bf16")] = _timed(gc.replay, fast.device, graphs=True)
            del gc


def _print_progress(name, rows):
    """Rank 0 prints the variant's figures as soon as both ranks have them (a variant that kills the
    process leaves the earlier ones on record)."""
    mine = {k[1]: v for k, v in rows.items() if k[0] == name}
    both = [None] * dist.get_world_size()
    dist.all_gather_object(both, mine)
    if dist.get_rank() == 0:
        print(f"{name:14s} " + "  ".join(f"{o} {max(r.get(o, float('nan')) for r in both):.1f}"
                                          for o in sorted(mine)), flush=True)


def main(ctx, tokens, sms):
    from epcomm import Buffer
    from epcomm.backends import nvlink

    Buffer.set_num_sms(sms)
    _, fast = G.make_buffers(ctx.group, num_nvl_bytes=2 << 30)
    case = Case(num_ranks=ctx.world_size, tokens=(tokens,) * ctx.world_size, hidden=7168, num_topk=8,
                num_experts=256, seed=1)
    rows = {}
    worst = tokens * ctx.world_size
    for name, tune in VARIANTS:
        saved, saved_transfer = dict(nvlink.TUNE), fast._backend.transfer
        tune = dict(tune)
        fast._backend.transfer = tune.pop("transfer", saved_transfer)  # EPCOMM_HT_TRANSFER for this variant
        nvlink.TUNE.update(tune)
        try:
            _variant(fast, case, ctx.rank, name, worst, rows)
            _print_progress(name, rows)
        except Exception as e:  # noqa: BLE001 - a variant that does not fit (e.g. shared memory) is reported
            print(f"rank {ctx.rank} variant {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            torch.cuda.synchronize()
            dist.barrier()
        finally:
            nvlink.TUNE.clear()
            nvlink.TUNE.update(saved)
            fast._backend.transfer = saved_transfer
    return rows


if __name__ == "__main__":
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    sms = int(sys.argv[2]) if len(sys.argv) > 2 else 24
    res = parallel_launch(int(os.environ.get("PROBE_WORLD", "2")), main, tokens, sms, backend="nccl", timeout_s=400)
    ops = sorted({k[1] for k in res[0]})
    print(f"sms={sms} tokens={tokens}; us, max over the {len(res)} ranks")
    print(f"{'variant':14s} " + " ".join(f"{o:>20s}" for o in ops))
    for name, _ in VARIANTS:
        print(f"{name:14s} " + " ".join(f"{max(r.get((name, o), float('nan')) for r in res):20.1f}" for o in ops))
