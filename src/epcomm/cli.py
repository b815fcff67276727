"""The ``epcomm`` command line: ``bench``, ``env``, ``check``, ``model``.

    epcomm bench                      # CPU: small + sweep-small on 4 gloo ranks; GPUs: the DSv3 cases
    epcomm bench --cases ht-dsv3 --num-sms 24 --out bench.jsonl --plot plots/
    epcomm bench --api v2 --cases ht-dsv3 --num-sms 4,8,12,24    # DeepEP V2's ElasticBuffer, an SM sweep
    epcomm bench --cases sweep --mode ht --iters 100
    epcomm bench --ab base=../old,new=. --rounds 3 --cases ll-dsv3 --out ab.jsonl   # two trees, alternated
    epcomm env [--probe]              # GPUs, NVLink/peer access, symmetric memory, versions, variables
    epcomm check                      # 2 gloo ranks (or the GPUs): dispatch + combine vs the oracle
    epcomm model --ep 8,16,32,64,128,256 --plot model.png      # predicted times against EP size (docs/model.md)
    epcomm model --check --out benchmarks/model/check.jsonl    # the model against DeepEP's published tables
    torchrun --nnodes 2 --nproc-per-node 8 ... -m epcomm check   # bench/check take the world from torchrun

Under torchrun (``RANK``/``WORLD_SIZE`` set) ``bench`` and ``check`` spawn nothing: each process is one
rank of the launcher's world, and rank 0 prints (a failing rank prints its own failure).

The library logs; this module is the only place that prints.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from . import _env


def _int_at_least(minimum: int, what: str):
    """argparse type: an int >= ``minimum``; the message names the value."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
        return v

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_nonnegative_int = _int_at_least(0, "an integer >= 0")


def _int_list(s: str) -> list[int]:
    """``"1,4,16"`` → ``[1, 4, 16]``."""
    parts = [p for p in s.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of positive integers, got {s!r}")
    return [_positive_int(p.strip()) for p in parts]


def _name_list(s: str) -> list[str]:
    names = [p.strip() for p in s.split(",") if p.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of case names, got {s!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    from .bench.cases import CASE_SETS, DEFAULT_CPU, DEFAULT_GPU, case_names

    p = argparse.ArgumentParser(prog="epcomm", description="epcomm: MoE dispatch/combine across GPUs "
                                "(a DeepEP-compatible Buffer). Subcommands: bench, env, check, model.")
    p.add_argument("--log-level", default=None,
                   help="log level for epcomm's loggers (default: EPCOMM_LOG_LEVEL or WARNING)")
    sub = p.add_subparsers(dest="command", metavar="{bench,env,check,model}")

    b = sub.add_parser("bench", help="time dispatch/combine on every path, side by side with the reference",
                       description="Time dispatch/combine on the backend a Buffer picks and on the reference "
                       "backend (NCCL on GPUs, gloo on CPU) in one run; prints a table (last).")
    b.add_argument("--cases", type=_name_list, default=None,
                   help=f"comma-separated case sets: {', '.join(case_names())} "
                   f"(default: {','.join(DEFAULT_GPU)} on GPUs, {','.join(DEFAULT_CPU)} on CPU)")
    b.add_argument("--list", action="store_true", help="list the case sets and exit")
    b.add_argument("--mode", choices=("ht", "ll", "both"), default="both",
                   help="high-throughput, low-latency or both (default both)")
    b.add_argument("--tokens", type=_int_list, default=None,
                   help="tokens per rank, comma-separated: each selected case runs at each value")
    b.add_argument("--hidden", type=_positive_int, default=None, help="hidden size (a multiple of 128)")
    b.add_argument("--topk", type=_positive_int, default=None, help="experts per token")
    b.add_argument("--experts", type=_positive_int, default=None, help="experts in total (divisible by ranks)")
    b.add_argument("--backend", choices=("auto", "reference", "nvlink", "internode"), default="auto",
                   help="backend to time (default: what Buffer picks); the reference is always timed too")
    b.add_argument("--api", choices=("v1", "v2", "both"), default="v1",
                   help="v1: DeepEP V1's Buffer (default); v2: DeepEP V2's ElasticBuffer, both layouts, with and "
                   "without CPU sync, each op checked as timed against a reference-backend ElasticBuffer "
                   "(bench/v2.py; default cases: ht-dsv3 on GPUs, small on CPU); both: the V1 rows (with "
                   "'<dtype>-worst-layout': get_dispatch_layout + a num_worst_tokens dispatch, the work a V2 dispatch "
                   "does), then the V2 rows of the high-throughput cases, in one run")
    b.add_argument("--num-sms", type=_int_list, default=None,
                   help="v1: Buffer.set_num_sms (one even value); v2: ElasticBuffer's num_sms, a comma list "
                   "sweeps it (default: get_theoretical_num_sms); both: a list sweeps V2 only, one value sets both")
    b.add_argument("--iters", type=_positive_int, default=None, help="timed iterations (default 50 GPU, 20 CPU)")
    b.add_argument("--warmup", type=_nonnegative_int, default=None, help="warm-up iterations (default 10 GPU, 3 CPU)")
    b.add_argument("--sets", type=_positive_int, default=4, help="input sets rotated between iterations (default 4)")
    b.add_argument("--world-size", type=_positive_int, default=None,
                   help="ranks (default: every GPU; 4 gloo processes on CPU; under torchrun: WORLD_SIZE)")
    b.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: GPUs when CUDA is available, else CPU ranks on gloo")
    b.add_argument("--cached", action="store_true",
                   help="time high-throughput dispatch with a handle (DeepEP's tuning loop) instead of a full one")
    b.add_argument("--no-graph", action="store_true", help="never capture CUDA graphs (time eager launches)")
    b.add_argument("--no-check", action="store_true", help="skip the correctness check before timing")
    b.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    b.add_argument("--out", default=None, metavar="PATH", help="write the rows as JSONL to PATH")
    b.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots to DIR (needs epcomm[plot])")
    b.add_argument("--profile", default=None, metavar="DIR",
                   help="also profile every operation's eager call: a cProfile table of the host path and a "
                   "torch.profiler table per operation and rank, written to DIR")
    b.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    b.add_argument("--ab", default=None, metavar="TREE_A,TREE_B",
                   help="A/B: this bench on two source trees (PATH or LABEL=PATH, each with src/epcomm), "
                   "alternated run by run for --rounds rounds, one subprocess each; rows tagged by tree, "
                   "commit and round, then a per-case summary (bench/ab.py)")
    b.add_argument("--rounds", type=_positive_int, default=3, help="A/B rounds, at least 3 (default 3)")
    b.add_argument("--ab-commits", default=None, metavar="SHA_A,SHA_B",
                   help="A/B: the trees' commits where they have no .git (SHA or SHA+dirty; empty: unknown)")
    b.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are killed (default 1800)")
    b.set_defaults(case_sets=CASE_SETS)

    e = sub.add_parser("env", help="what this machine offers: GPUs, peer access, symmetric memory, versions",
                       description="Print GPUs, NVLink topology and peer access, symmetric-memory backends, "
                       "versions, the variables that matter, and which backend a Buffer would choose.")
    e.add_argument("--probe", action="store_true",
                   help="try CUDA symmetric memory on a 1-rank NCCL group (GPU machines)")

    c = sub.add_parser("check", help="quick self-test: dispatch + combine vs the oracle, PASS/FAIL",
                       description="Launch 2 gloo ranks (or one per GPU), dispatch and combine a small case, "
                       "and verify against epcomm.testing.inputs.expected_dispatch.")
    c.add_argument("--world-size", type=_positive_int, default=None,
                   help="ranks (default 2 on CPU, every GPU; under torchrun: WORLD_SIZE)")
    c.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    _model_parser(sub)
    return p


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}")
    return v


def _nonnegative_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {s!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {s!r}")
    return v


def _model_parser(sub) -> None:
    from .model import PRESETS, Links

    d = Links()
    m = sub.add_parser("model", help="predict dispatch/combine times at EP 8-256 from link figures and routing",
                       description="A cost model (docs/model.md): HT hierarchical (one network copy per token and "
                       "node, then NVLink) and LL direct (one message per selection), from byte counts, link rates "
                       "and latencies. Prints the assumptions and a table of predicted time against EP size.")
    m.add_argument("--ep", type=_int_list, default=[8, 16, 32, 64, 128, 256], help="EP sizes (default 8..256)")
    m.add_argument("--mode", choices=("ht", "ll", "both"), default="both")
    m.add_argument("--tokens", type=_positive_int, default=None, help="tokens per rank (default: HT 4096, LL 128)")
    m.add_argument("--hidden", type=_positive_int, default=7168)
    m.add_argument("--topk", type=_positive_int, default=8)
    m.add_argument("--experts", type=_positive_int, default=256)
    m.add_argument("--dtype", choices=("fp8", "bf16"), default="fp8", help="dispatch payload (combine is bf16)")
    m.add_argument("--routing", default="node-limited", metavar="uniform|node-limited|FILE.pt",
                   help="uniform (exact), node-limited (DeepSeek-V3's top --topk-groups nodes, sampled), or a "
                   "torch.save'd int64 [T, K] / [R, T, K] tensor of expert ids (default node-limited)")
    m.add_argument("--topk-groups", type=_positive_int, default=4, help="nodes per token, node-limited (default 4)")
    m.add_argument("--source-rank", type=_nonnegative_int, default=0, help="the rank a [T, K] file's ids come from")
    m.add_argument("--samples", type=_positive_int, default=8192, help="tokens sampled for node-limited routing")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--preset", choices=sorted(PRESETS), default="h800-cx7",
                   help="link figures to start from (default h800-cx7: DeepEP's published machine)")
    for name, what in (("nvlink-gbps", "NVLink GB/s per GPU per direction"), ("nic-gbps", "network GB/s per GPU"),
                       ("nvlink-efficiency", "fraction of the NVLink peak reached"),
                       ("nic-efficiency", "fraction of the network peak reached"),
                       ("nvlink-latency-us", "one-way NVLink latency"), ("nic-latency-us", "one-way network latency"),
                       ("launch-us", "per kernel launch"), ("hbm-gbps", "local copy GB/s (read + write)")):
        m.add_argument(f"--{name}", type=_nonnegative_float if name.endswith("-us") else _positive_float, default=None,
                       help=f"{what} (h800-cx7: {getattr(d, name.replace('-', '_')):g})")
    m.add_argument("--gpus-per-node", type=_positive_int, default=None, help=f"(h800-cx7: {d.gpus_per_node})")
    m.add_argument("--qps-per-peer", type=_positive_int, default=None, help=f"queue pairs per peer ({d.qps_per_peer})")
    m.add_argument("--nic-ports", type=_positive_int, default=None, help=f"ports per NIC ({d.nic_ports})")
    m.add_argument("--uncached", action="store_true", help="HT dispatch with the count exchange (default: cached)")
    m.add_argument("--ll-messages", choices=("expert", "rank"), default="expert",
                   help="LL: one message per (token, expert) as DeepEP, or per (token, rank) as epcomm's nvlink")
    m.add_argument("--ll-kernels", type=_positive_int, default=1, help="launches per LL call (DeepEP 1, epcomm 2)")
    m.add_argument("--no-nvlink-ll", action="store_true", help="LL: same-node peers through the network too")
    m.add_argument("--check", action="store_true",
                   help="instead: the model against DeepEP's published tables and our measured rows, with errors")
    m.add_argument("--out", default=None, metavar="PATH", help="write the rows to PATH (.jsonl or .csv)")
    m.add_argument("--plot", default=None, metavar="PNG", help="plot predicted time against EP size (matplotlib)")


def _pick_device(choice: str) -> str:
    import torch

    if choice == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA GPU is visible")
        return "cuda"
    if choice == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 1 else "cpu"


def _launcher_world(world_size: int | None):
    """The torchrun world this process belongs to (``None`` when it was not started by a launcher);
    ``--world-size`` may only repeat its size."""
    from .testing.launcher import env_world

    world = env_world()
    if world is not None and world_size not in (None, world.world_size):
        raise ValueError(f"--world-size {world_size}, but the launcher started WORLD_SIZE={world.world_size} "
                         "processes: under torchrun the world size is the launcher's")
    return world


def _list_cases(case_sets) -> None:
    from .bench.cases import ALIASES

    for name, cases in case_sets.items():
        print(f"{name}:")
        for c in cases:
            print(f"  {c.mode} T={c.tokens} H={c.hidden} K={c.topk} E={c.experts}"
                  + (" +hook" if c.hook else "") + (f" drop={c.drop_prob}" if c.drop_prob else ""))
    for name, names in ALIASES.items():
        print(f"{name}: {', '.join(names)}")


def cmd_bench(args) -> int:
    import torch

    from .bench import report, table
    from .bench.cases import DEFAULT_CPU, DEFAULT_GPU, resolve_cases
    from .bench.progress import Progress
    from .bench.runner import BenchPlan, run_bench

    if args.list:
        _list_cases(args.case_sets)
        return 0
    if args.ab:
        from .bench import ab

        from .testing.launcher import env_world

        if args.plot or args.profile or env_world() is not None:
            raise ValueError("--ab runs each tree as its own epcomm bench: not with --plot, --profile or torchrun")
        return ab.main(args)
    if args.ab_commits:
        raise ValueError("--ab-commits goes with --ab")
    launched = _launcher_world(args.world_size)
    device = _pick_device(args.device)
    gpu = device == "cuda"
    world = launched.world_size if launched else args.world_size or (torch.cuda.device_count() if gpu else 4)
    speaker = launched is None or launched.rank == 0  # under torchrun rank 0 prints and writes
    v2 = args.api == "v2"
    names = args.cases or (["ht-dsv3" if gpu else "small"] if v2 else list(DEFAULT_GPU if gpu else DEFAULT_CPU))
    if args.api == "both" and args.mode == "ll":
        raise ValueError("--api both times V2 at the high-throughput cases' shapes, not with --mode ll")
    # V2 times the high-throughput cases' shapes (bench/v2.py)
    mode = ("ht" if args.mode == "both" else args.mode) if v2 else args.mode
    if v2 and mode != "ht":
        raise ValueError(f"--api v2 times the high-throughput cases' shapes, not --mode {args.mode}")
    cases = resolve_cases(names, world_size=world, mode=mode, tokens=args.tokens, hidden=args.hidden,
                          topk=args.topk, experts=args.experts)
    if args.backend == "nvlink" and not gpu:
        raise ValueError("--backend nvlink needs CUDA GPUs (this run is on CPU ranks)")
    num_sms, sweep = None, ()
    if args.api != "v1":
        if args.cached:
            raise ValueError(f"--cached is a V1 option (not with --api {args.api})")
        sweep = tuple(args.num_sms or ())
    # V1's Buffer.set_num_sms: one even value (with --api both, a list sweeps V2 only and V1 keeps its default)
    if not v2 and args.num_sms is not None and (args.api == "v1" or len(args.num_sms) == 1):
        if len(args.num_sms) != 1:
            raise ValueError(f"--num-sms takes one value with --api v1 (a list sweeps ElasticBuffer's num_sms "
                             f"with --api v2), got {','.join(map(str, args.num_sms))}")
        num_sms = args.num_sms[0]
        if num_sms % 2:
            raise ValueError(f"--num-sms must be even, got {num_sms}")
    if args.plot:  # fail before the run, not after it
        from .bench.plot import _matplotlib

        _matplotlib()
    plan = BenchPlan(cases=tuple(cases), backend=args.backend,
                     iters=args.iters or (50 if gpu else 20),
                     warmup=args.warmup if args.warmup is not None else (10 if gpu else 3),
                     sets=args.sets, num_sms=num_sms, graphs=not args.no_graph, cached=args.cached,
                     check=not args.no_check, seed=args.seed, api=args.api, num_sms_sweep=sweep,
                     profile=str(Path(args.profile).resolve()) if args.profile else None)
    progress = Progress(enabled=not args.no_progress and speaker)
    result = run_bench(plan, world_size=world, device=device, progress=progress, timeout_s=args.timeout,
                       world=launched)
    failed = [r for r in result.rows if r["check"] not in ("pass", "skipped")]
    if not speaker:
        return 1 if failed else 0
    if args.out:
        path = report.write_jsonl(args.out, result.rows)
        print(f"wrote {len(result.rows)} rows to {path}")
    if args.plot:
        from .bench.plot import plot_rows

        for p in plot_rows(result.rows, args.plot):
            print(f"wrote {p}")
    if failed:
        print(f"{len(failed)} rows FAILED their correctness check (see the check column)")
    print(table.render_header(result.env, result.ce_gbps, result.rows))
    print(table.render_table(result.rows))
    print(table.render_summary(result.rows))
    return 1 if failed else 0


def cmd_env(args) -> int:
    from .doctor import env_report

    print(env_report(probe=args.probe), end="")
    return 0


def cmd_check(args) -> int:
    from .doctor import run_check
    from .testing.launcher import from_env

    launched = _launcher_world(args.world_size)
    if launched is None:
        ok, text = run_check(args.world_size, args.device)
        print(text)
        return 0 if ok else 1
    device = _pick_device(args.device)
    with from_env(launched):  # run_check's launch joins torchrun's world instead of spawning
        ok, text = run_check(launched.world_size, device)
    if launched.rank == 0 or not ok:
        print(text if launched.rank == 0 else f"rank {launched.rank}: {text}")
    return 0 if ok else 1


def cmd_model(args) -> int:
    import dataclasses

    from . import model

    if args.plot:  # fail before the work, not after it
        from .bench.plot import _matplotlib

        _matplotlib()
    if args.check:
        rows = model.check_rows(samples=args.samples, seed=args.seed)
        print(f"links: {', '.join(f'{k}: {v}' for k, v in model.PRESETS.items())}")
        print(f"calibrated from the rows marked so: {model.calibrate(args.samples, args.seed)}")
        print(model.render_check(rows))
        checks = [abs(r["error"]) for r in rows if r["role"] == "check" and r["machine"] == "h800-cx7"]
        print(f"DeepEP V1 published rows not used for calibration: {len(checks)}, mean |error| "
              f"{100 * sum(checks) / len(checks):.1f}%, max {100 * max(checks):.1f}%")
        if args.out:
            print(f"wrote {len(rows)} rows to {model.write_rows(args.out, rows)}")
        if args.plot:
            links = model.PRESETS["h800-cx7"]
            ht, ll = model.Workload(tokens=4096), model.Workload(tokens=128)
            eps = [8, 16, 32, 64, 128, 256]  # routed as the published rows were: HT node-limited, LL uniform
            sweep = (model.sweep(links, ht, None, eps, "node-limited", samples=args.samples, seed=args.seed)
                     + model.sweep(links, None, ll, eps, "uniform"))
            notes = model.assumptions(links, ht, ll, "HT node-limited (each token's best 4 nodes, fewer where "
                                      "there are fewer; DeepEP's internode test), LL uniform (its low-latency test)")
            print(f"wrote {model.plot(sweep, args.plot, notes, rows)}")
        return 0
    overrides = {k: getattr(args, k) for k in ("nvlink_gbps", "nic_gbps", "nvlink_efficiency", "nic_efficiency",
                                               "nvlink_latency_us", "nic_latency_us", "launch_us", "hbm_gbps",
                                               "gpus_per_node", "qps_per_peer", "nic_ports")
                 if getattr(args, k) is not None}
    links = dataclasses.replace(model.PRESETS[args.preset], **overrides)
    common = {"hidden": args.hidden, "topk": args.topk, "experts": args.experts, "dtype": args.dtype,
              "cached": not args.uncached, "messages": args.ll_messages, "nvlink_ll": not args.no_nvlink_ll,
              "ll_kernels": args.ll_kernels}
    ht = model.Workload(tokens=args.tokens or 4096, **common) if args.mode in ("ht", "both") else None
    ll = model.Workload(tokens=args.tokens or 128, **common) if args.mode in ("ll", "both") else None
    rows = model.sweep(links, ht, ll, args.ep, args.routing, topk_groups=args.topk_groups, samples=args.samples,
                       seed=args.seed, source_rank=args.source_rank)
    routing = {"uniform": "uniform (exact)", "node-limited": f"node-limited: each token's best {args.topk_groups} "
               f"nodes (fewer where there are fewer), {args.samples} sampled tokens, seed {args.seed}"}.get(
        args.routing, f"file {args.routing}, ids of rank {args.source_rank} (or of every rank)")
    notes = model.assumptions(links, ht, ll, routing)
    for r in rows:
        r["assumptions"] = notes
    print("\n".join(f"# {n}" for n in notes))
    print(model.render_table(rows))
    if args.out:
        print(f"wrote {len(rows)} rows to {model.write_rows(args.out, rows)}")
    if args.plot:
        print(f"wrote {model.plot(rows, args.plot, notes)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = (args.log_level or _env.log_level() or "WARNING").upper()
    logging.basicConfig(level=getattr(logging, level, logging.WARNING), format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return 2
    handler = {"bench": cmd_bench, "env": cmd_env, "check": cmd_check, "model": cmd_model}[args.command]
    try:
        return handler(args)
    except (ValueError, TypeError, ImportError) as e:
        print(f"epcomm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
