"""Time variants of the internode high-throughput kernels in one run: two ranks (one GPU shared under MPS, or
two GPUs), DSv3 (4096 tokens a rank, hidden 7168, top-8 of 256 experts), ``--num-sms`` programs, CUDA-graph
replays of the three capturable operations (dispatch BF16 and FP8 with ``num_worst_tokens``, combine BF16),
as ``epcomm bench`` times them (``bench.timing.measure``). One Buffer; a variant is a set of
``backends/internode_ht.TUNE`` entries (read at each launch), so every variant runs in the same processes on
the same buffers, and the variants alternate round by round (``--rounds``): MPS makes single runs noisy.
Each variant's timed outputs are checked against the reference backend's (bitwise dispatch, combine within
the budget).

Usage (the ranks' environment as for ``epcomm bench --backend internode`` under MPS)::

    EPCOMM_TEST_SHARE_GPU=1 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 EPCOMM_GPUS_PER_NODE=1 \\
        python3 scripts/internode_ht_variants.py --out $OUT/variants.jsonl

``--variants`` replaces the default list: ``name:key=v/key=v;name2:...`` (``TUNE`` keys; ``old:`` with
no keys runs a tree as it is: with ``--src`` another commit's tree, e.g. the one before issue 28's changes).
``--ops`` times only the listed operations (``combine-bf16,dispatch-bf16-worst,dispatch-fp8-worst``).
Prints one line per (variant, op): the median over rounds of each round's time (a round's time: the slowest
rank's median).
``--cpu``: a dry run of this script on two CPU processes (the simulated backend, ``testing/cpu_internode``,
and a small case; wall-clock times of the interpreter, meaningless as timings).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# the epcomm tree to time: this checkout's, or ``--src DIR`` (another tree's src, e.g. a commit unpacked by
# ``git archive``; every rank process re-reads it here)
_SRC = (sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv[:-1]
        else os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
sys.path.insert(0, os.path.abspath(_SRC))

# (name, TUNE overrides): the paired combine (every program copies, then reduces: in nodes of one rank, at
# most 16 nodes and 64 channels) unpipelined, as it is, with wider reduction steps, and over NVSHMEM puts. The
# dispatch's stored rows counted 32 or 64 at a time ride along (``d_p2p_rows``: only the dispatch reads it,
# only the combine the others). (The split combine roles lost to the paired ones at fc7014e, one H100 under
# MPS: ~630 us against ~380; docs/internode.md.)
VARIANTS = [
    ("pair-s1+d32", dict(c_stages=1, d_p2p_rows=32)),
    ("pair", dict()),
    ("pair-b1024+d64", dict(final_block=1024, d_p2p_rows=64)),
    ("pair-puts", dict(p2p=False)),
]
OPS = ("combine-bf16", "dispatch-bf16-worst", "dispatch-fp8-worst")


def _parse(spec: str) -> list:
    out = []
    for part in filter(None, spec.split(";")):
        name, _, kv = part.partition(":")
        out.append((name, {k: int(v) for k, v in (x.split("=") for x in filter(None, kv.split("/")))}))
    return out


def _rank(ctx, variants, rounds, iters, warmup, sms, cpu_tag, want=OPS):
    if cpu_tag:
        from epcomm.testing import cpu_nvlink

        cpu_nvlink.install(cpu_tag, ctx.rank, ctx.world_size, ctx.group)
    import torch
    import torch.distributed as dist

    from epcomm import Buffer
    from epcomm.backends.internode_ht import TUNE, high_throughput_bytes
    from epcomm.bench import timing, workloads
    from epcomm.bench.cases import CASE_SETS, BenchCase
    from epcomm.bench.runner import ht_nvl_bytes

    case = CASE_SETS["ht-dsv3"][0] if not cpu_tag else BenchCase("small", "ht", 24, 256, 4, 16)
    r = ctx.world_size
    Buffer.set_num_sms(sms)
    n = int(os.environ.get("EPCOMM_GPUS_PER_NODE", "1"))
    # (as epcomm bench sizes it)
    nbytes = max(ht_nvl_bytes(case, r), high_throughput_bytes(case.tokens, case.hidden, case.topk, r, n))
    if cpu_tag:
        from epcomm.testing import cpu_internode

        ref, fast = Buffer(ctx.group), cpu_internode.internode_buffer(ctx.group, num_nvl_bytes=nbytes)
    else:
        from epcomm.testing.gpu_cases import make_buffers

        ref, fast = make_buffers(ctx.group, fast="internode", num_nvl_bytes=nbytes)
    sets = workloads.make_ht_sets(case, ctx.rank, r, ctx.device, 2)
    sv = timing.checked_set(warmup, iters, len(sets))
    verdict, expect = workloads.check_ht({"reference": ref, "internode": fast}, sets[sv], sv)
    rows, default = [], dict(TUNE)
    for rnd in range(rounds):
        for name, over in variants:
            TUNE.clear()
            TUNE.update(default, **over)
            ops = [op for op in workloads.ht_ops(fast, sets, expect=expect) if f"{op.op}-{op.dtype}" in want]
            for op in ops:
                t0 = time.time()
                m = timing.measure(op, num_sets=len(sets), iters=iters, warmup=warmup, group=ctx.group,
                                   device=ctx.device)
                st = m.stats[0]
                rows.append(dict(variant=name, tune=over, round=rnd, op=f"{op.op}-{op.dtype}",
                                 method=m.method, median_us=st.median * 1e6, p10_us=st.p10 * 1e6, p90_us=st.p90 * 1e6,
                                 check=m.verified, wall_s=round(time.time() - t0, 2)))
            dist.barrier(group=ctx.group)
    TUNE.clear()
    TUNE.update(default)
    if not cpu_tag:
        torch.cuda.synchronize()
    import epcomm

    return {"rank": ctx.rank, "case_check": verdict, "rows": rows, "tree": os.path.dirname(epcomm.__file__)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="", help="name:key=v/key=v;... (default: the built-in list)")
    ap.add_argument("--ops", default=",".join(OPS), help="operations to time (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--num-sms", type=int, default=24)
    ap.add_argument("--timeout", type=float, default=420.0)
    ap.add_argument("--out", default="")
    ap.add_argument("--src", default="", help="the src directory of the epcomm tree to time (default: this one)")
    ap.add_argument("--cpu", action="store_true",
                    help="dry run on CPU processes (simulated backend, small case)")
    a = ap.parse_args()
    from epcomm.testing.launcher import parallel_launch

    variants = _parse(a.variants) if a.variants else VARIANTS
    want = tuple(filter(None, a.ops.split(",")))
    if not want or set(want) - set(OPS):
        ap.error(f"--ops: a comma list of {', '.join(OPS)}, got {a.ops!r}")
    tag = f"ihv{os.getpid()}" if a.cpu else ""
    res = parallel_launch(2, _rank, variants, a.rounds, a.iters, a.warmup, a.num_sms, tag, want,
                          backend="gloo" if a.cpu else "nccl", timeout_s=a.timeout)
    print("epcomm from", res[0]["tree"], "| case check:", {r["rank"]: r["case_check"] for r in res})
    # a round's time of an op: the slowest rank's median; then the median over rounds
    by = {}
    for r in res:
        for row in r["rows"]:
            by.setdefault((row["variant"], row["op"], row["round"]), []).append(row)
    table = {}
    for (v, op, rnd), rr in by.items():
        table.setdefault((v, op), []).append(max(x["median_us"] for x in rr))
    fails = [(k, x["check"]) for k, rr in by.items() for x in rr if x["check"] not in ("pass", None)
             and not str(x["check"]).startswith("not checked")]
    print(f"{'variant':<16} {'op':<20} {'median over rounds us':>22}  rounds")
    for (v, op), ts in table.items():
        print(f"{v:<16} {op:<20} {statistics.median(ts):>22.1f}  {' '.join(f'{t:.0f}' for t in ts)}")
    if a.out:
        with open(a.out, "w") as f:
            for r in res:
                for row in r["rows"]:
                    f.write(json.dumps(dict(row, rank=r["rank"], env={k: v for k, v in os.environ.items()
                                                                      if k.startswith("EPCOMM_")})) + "\n")
    if fails:
        print("FAILED checks:", fails[:10])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
