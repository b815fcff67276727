"""Is an eager call's host time bimodal within one process, and what moves with it?

One GPU process at world 1 (NCCL). Every step times, each in ``epcomm bench``'s position (its barrier, its
one-element all_reduce, an event recorded; ``bench/hostprobe.bench_position``): the fixed torch workload the bench
calibrates with (``calib``), a 128-token LL dispatch and combine (``bench/probe_calls.ll_calls``), a 4096-token
HT ``num_worst_tokens`` dispatch (``ht_calls``' ``worst``) and an ElasticBuffer contiguous no-sync FP8 dispatch
(``v2_calls``' ``dc fp8``). Around each timed call it reads the thread's CPU, its page faults and context switches
(``getrusage(RUSAGE_THREAD)``) and whether a garbage collection ran. Every ``--measure-every`` steps it also times
the bench's own LL dispatch op through ``bench/timing.measure`` (as ``epcomm bench`` does: 5 + 20 iterations, 4
input sets) and records its host median beside the samples.

    python3 scripts/host_modes.py --steps 3000 --out samples.jsonl
    python3 scripts/host_modes.py --summary samples.jsonl[.gz]

The summary splits each kind's samples into windows of ``--window`` steps and prints per window the median µs and
what happened in its calls (faults, switches, collections, CPUs), so a slow phase can be read against them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time

_RU = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def _cpu() -> int:
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def _usage() -> tuple:
    r = resource.getrusage(_RU)
    return r.ru_minflt, r.ru_majflt, r.ru_nvcsw, r.ru_nivcsw


def _threads() -> list:
    """``[tid, name, cpu ticks (user + system), last cpu]`` of each of this process's threads."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
            v = rest.split()
            out.append([int(tid), head.split("(", 1)[1], int(v[11]) + int(v[12]), int(v[36])])
        except (OSError, IndexError, ValueError):
            pass
    return out


def _cpu_busy() -> list:
    """Each CPU's busy ticks (all but idle and iowait) from /proc/stat."""
    out = []
    with open("/proc/stat") as f:
        for ln in f:
            if ln.startswith("cpu") and ln[3].isdigit():
                v = [int(x) for x in ln.split()[1:]]
                out.append(sum(v) - v[3] - v[4])
    return out


def _python_work(n: int = 400):
    """A pure-Python workload (no torch, no syscalls): the CPU's own speed."""
    def work():
        s = 0
        for i in range(n):
            s += i * i
        return s
    return work


def _kinds(tokens_ll: int, tokens_ht: int) -> dict:
    from epcomm.bench import probe_calls as pc

    h, k, e = 7168, 8, 256
    ll = pc.gpu_buffer(tokens_ll, h, e)
    kinds = {f"ll {kind}": v for kind, v in pc.ll_calls(ll, tokens_ll, tokens_ll, h, k, e).items()}
    ht = pc.ht_buffer(tokens_ht, h, k, False)
    kinds["ht worst"] = pc.ht_calls(ht, tokens_ht, h, k, e)["worst"]
    v2 = pc.v2_buffer(tokens_ht, h, k, False)
    kinds["v2 dc fp8"] = pc.v2_calls(v2, tokens_ht, tokens_ht, h, k, e)["dc fp8"]
    return ll, kinds


def _bench_op(buf, tokens: int):
    import torch
    import torch.distributed as dist

    from epcomm.bench import workloads
    from epcomm.bench.cases import BenchCase

    case = BenchCase("ll-dsv3", "ll", tokens, 7168, 8, 256)
    sets = workloads.make_ll_sets(case, 0, 1, torch.device("cuda", torch.cuda.current_device()), 4)
    op = workloads.ll_ops(buf, sets, case)[0]
    return op, dist.group.WORLD


def run(steps: int, out: str, measure_every: int, tokens_ll: int, tokens_ht: int) -> None:
    import torch

    from epcomm.bench import hostprobe, timing

    ll, kinds = _kinds(tokens_ll, tokens_ht)
    dev = torch.device("cuda", torch.cuda.current_device())
    one = torch.zeros(1, device=dev)
    kinds = {"calib": (None, timing.calibration_work(dev)), "python": (None, _python_work()),
             "empty x8": (None, lambda: [torch.empty(64, dtype=torch.int32, device=dev) for _ in range(8)]),
             "launch": (None, lambda: one.add_(1)), **kinds}
    before = hostprobe.bench_position()
    op, group = _bench_op(ll, tokens_ll)
    collected = [0]
    gc.callbacks.append(lambda phase, info: collected.__setitem__(0, collected[0] + (phase == "start")))
    clock, t0 = time.perf_counter_ns, time.perf_counter()
    with open(out, "w") as f:
        f.write(json.dumps({"env": {"commit": os.environ.get("EPCOMM_COMMIT"), "device": torch.cuda.get_device_name(),
                                    "torch": torch.__version__, "cpus": os.cpu_count(),
                                    "affinity": sorted(os.sched_getaffinity(0)), "siblings": _siblings()}}) + "\n")
        for i in range(steps):
            if measure_every and i % measure_every == 0:
                m = timing.measure(op, num_sets=4, iters=20, warmup=5, group=group, device=dev, use_graphs=False)
                f.write(json.dumps({"i": i, "t": time.perf_counter() - t0, "kind": "bench ll dispatch",
                                    "host_us": m.host[0] * 1e6, "calib_us": m.calib * 1e6}) + "\n")
            if i % 50 == 0:
                f.write(json.dumps({"i": i, "t": time.perf_counter() - t0, "kind": "threads", "threads": _threads(),
                                    "busy": _cpu_busy()}) + "\n")
            for kind, (prep, call) in kinds.items():
                if prep is not None:
                    prep()
                before()
                cpu0, u0, g0 = _cpu(), _usage(), collected[0]
                a = clock()
                call()
                ns = clock() - a
                u1, cpu1 = _usage(), _cpu()
                f.write(json.dumps({"i": i, "t": round(time.perf_counter() - t0, 4), "kind": kind, "ns": ns,
                                    "cpu": [cpu0, cpu1], "flt": u1[0] - u0[0], "mflt": u1[1] - u0[1],
                                    "vcsw": u1[2] - u0[2], "icsw": u1[3] - u0[3], "gc": collected[0] - g0}) + "\n")
    torch.cuda.synchronize()


def _siblings() -> dict:
    out = {}
    for c in range(os.cpu_count() or 0):
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
                out[c] = f.read().strip()
        except OSError:
            pass
    return out


def _launched(ctx, *args) -> None:
    run(*args)


def summary(path: str, window: int) -> None:
    import gzip

    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        rows = [json.loads(ln) for ln in f]
    env = rows[0].get("env", {})
    print("env", env)
    kinds: dict = {}
    for r in rows[1:]:
        kinds.setdefault(r["kind"], []).append(r)
    th = kinds.pop("threads", [])
    if th:
        print("threads sampled every 50 steps: per window, the threads that used CPU (ticks, last cpus) and each "
              "cpu's busy ticks")
        for w in range(0, len(th) - 1, max(window // 50, 1)):
            a, b = th[w], th[min(w + max(window // 50, 1), len(th) - 1)]
            before = {t[0]: t[2] for t in a["threads"]}
            used = [(t[1], t[2] - before.get(t[0], 0), t[3]) for t in b["threads"] if t[2] - before.get(t[0], 0) > 0]
            busy = [y - x for x, y in zip(a["busy"], b["busy"])]
            print(f"  steps {a['i']:5d}-{b['i']:5d} threads " + ", ".join(f"{n}:{d}@{c}" for n, d, c in used)
                  + "  busy " + " ".join(str(x) for x in busy))
    for kind, rs in kinds.items():
        if "ns" not in rs[0]:
            print(f"{kind}: " + " ".join(f"{r['host_us']:.1f}[{r['calib_us']:.1f}]" for r in rs))
            continue
        us = [r["ns"] / 1e3 for r in rs]
        print(f"{kind}: median {statistics.median(us):.1f} us over {len(us)}")
        for w in range(0, len(rs), window):
            part = rs[w:w + window]
            u = sorted(r["ns"] / 1e3 for r in part)
            slow = [r for r in part if r["ns"] / 1e3 > 1.5 * u[len(u) // 2]]
            cpus = sorted({c for r in part for c in r["cpu"]})
            moved = sum(r["cpu"][0] != r["cpu"][1] for r in part)
            print(f"  steps {part[0]['i']:5d}-{part[-1]['i']:5d} t {part[0]['t']:6.1f}s  median {u[len(u) // 2]:7.1f}"
                  f"  p10 {u[len(u) // 10]:7.1f}  p90 {u[9 * len(u) // 10]:7.1f}"
                  f"  faults/call {sum(r['flt'] for r in part) / len(part):6.2f}"
                  f"  vcsw {sum(r['vcsw'] for r in part):4d} icsw {sum(r['icsw'] for r in part):4d}"
                  f"  gc {sum(r['gc'] for r in part):3d}  moved {moved:3d}  cpus {cpus[:8]}{'...' if len(cpus) > 8 else ''}"
                  f"  slow calls with faults {sum(r['flt'] > 0 for r in slow)}/{len(slow)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--out", default="host_modes.jsonl")
    ap.add_argument("--measure-every", type=int, default=200)
    ap.add_argument("--tokens-ll", type=int, default=128)
    ap.add_argument("--tokens-ht", type=int, default=4096)
    ap.add_argument("--launched", action="store_true", help="run in a rank process (epcomm's launcher), as the bench")
    ap.add_argument("--summary", metavar="JSONL")
    ap.add_argument("--window", type=int, default=250)
    a = ap.parse_args(argv)
    if a.summary:
        summary(a.summary, a.window)
        return 0
    args = (a.steps, a.out, a.measure_every, a.tokens_ll, a.tokens_ht)
    if a.launched:  # in a rank process, as epcomm bench runs its world-1 ranks
        from epcomm.testing.launcher import parallel_launch

        parallel_launch(1, _launched, *args, backend="nccl", timeout_s=3600)
    else:
        run(*args)
    summary(a.out, a.window)
    return 0


if __name__ == "__main__":
    sys.exit(main())
