"""Soak: thousands of mixed epcomm calls, each checked against the reference, with memory and plan caches watched.

(What each check compares with what: epcomm/testing/soak.py. ElasticBuffer's calls are checked against the V2 oracles,
which the reference backend is held to.)

Every iteration runs one check, its kind and arguments drawn from one seeded generator on every rank: V1
high-throughput dispatch (BF16/FP8) + combine + cached dispatch, the same with num_worst_tokens, low-latency
dispatch + combine (BF16/FP8, hook or not, zero-copy or out=), ElasticBuffer dispatch of both layouts (CPU sync or
not) with its cached replay, ElasticBuffer dispatch + combine. Token counts are drawn per rank from 1 to the
maximum (sometimes 0). The run stops after --calls calls of the fast library (a check makes two to four). After
the warm-up (--warmup of the calls) the GPU memory in use and the resident memory must stay within a budget of
the warm-up's peak, and every plan cache within its bound (epcomm/testing/soak_watch.py says how and why).

One line per rank at the end, with the rate past the warm-up (calls a second once the kernels have compiled: what
a longer run keeps); the JSON report has the seconds by check kind and the host's seconds in the fast calls by call
kind, for the whole run and past the warm-up. The exit status is non-zero on any failure, which the output names.

    # one GPU, two ranks under MPS (scripts/gpu_check.sh soak starts a private MPS daemon and runs this)
    EPCOMM_TEST_SHARE_GPU=1 python scripts/soak.py --world 2 --calls 10000 --json soak.json
    # one rank per GPU
    python scripts/soak.py --world 2
    # CPU: the nvlink backend's kernels under the Triton interpreter (slow: few calls, small shapes)
    python scripts/soak.py --device cpu --world 2 --calls 30
    # under torchrun (one process per GPU): it takes the world from there
    torchrun --standalone --nproc-per-node 2 scripts/soak.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
if os.path.isdir(os.path.join(_SRC, "epcomm")):
    sys.path.insert(0, os.path.abspath(_SRC))  # this tree's epcomm (the ranks inherit sys.path)


def parse(argv=None) -> argparse.Namespace:
    from epcomm.testing.soak import KINDS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="ranks to spawn (default 2); under torchrun, its world")
    ap.add_argument("--calls", type=int, default=10000, help="calls of the fast library, at least (default 10000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="cuda (NCCL; gloo with EPCOMM_TEST_SHARE_GPU=1) or cpu (gloo, the CPU rig); default: "
                         "cuda where there is a GPU")
    ap.add_argument("--hidden", type=int, default=0, help="hidden size (default 2048 on GPUs, 128 on the CPU)")
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="V1 high-throughput tokens a rank, at most (default 1024 on GPUs, 8 on the CPU)")
    ap.add_argument("--ll-max-tokens", type=int, default=0,
                    help="the low-latency buffer's num_max_dispatch_tokens_per_rank (default 128; CPU 8)")
    ap.add_argument("--v2-max-tokens", type=int, default=0,
                    help="the ElasticBuffer's num_max_tokens_per_rank (default 128; CPU 8)")
    ap.add_argument("--warmup", type=float, default=0.3, help="share of the calls before memory must stay flat")
    ap.add_argument("--sample-every", type=int, default=0, help="calls between memory samples (default calls/50)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"a subset of {','.join(KINDS)}")
    ap.add_argument("--json", default=None, help="write every rank's report, memory series included, here")
    ap.add_argument("--profile", default="", help="rank 0's run under cProfile: its 40 costliest functions to this file")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are stopped")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    from epcomm.testing import launcher
    from epcomm.testing.soak import Options, run_rank, summary

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("soak: --device cuda needs a GPU (or use --device cpu)", file=sys.stderr)
        return 2
    try:
        opts = Options(calls=args.calls, seed=args.seed, device=device, hidden=args.hidden,
                       max_tokens=args.max_tokens, ll_max_tokens=args.ll_max_tokens, v2_max_tokens=args.v2_max_tokens,
                       warmup=args.warmup, sample_every=args.sample_every,
                       kinds=tuple(k for k in args.kinds.split(",") if k), profile=args.profile, tag=f"soak-{uuid.uuid4().hex[:8]}")
    except ValueError as e:
        print(f"soak: {e}", file=sys.stderr)
        return 2
    backend = "nccl" if device == "cuda" else "gloo"
    world = launcher.env_world()
    first = world is None or world.rank == 0
    try:
        if world is not None:
            with launcher.from_env(world):
                reports = launcher.parallel_launch(world.world_size, run_rank, opts, backend=backend)
        else:
            reports = launcher.parallel_launch(args.world, run_rank, opts, backend=backend, timeout_s=args.timeout)
    except launcher.RankError as e:
        if first:
            print(f"soak FAILED on rank {e.rank}:\n{e}", file=sys.stderr)
        return 1
    if not first:
        return 0
    for rep in reports:
        print(summary(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"options": vars(args), "device": device, "reports": reports}, f)
    failed = [rep["rank"] for rep in reports if rep["failures"]]
    print(f"soak {'FAILED on ranks ' + str(failed) if failed else 'passed'}: {reports[0]['calls']} calls, "
          f"{sum(sum(rep['checks'].values()) for rep in reports[:1])} checks a rank")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
