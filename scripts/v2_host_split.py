"""Where the host time of a repeated ``ElasticBuffer`` no-sync dispatch goes, in layers, on one GPU (world 1).

For a repeated contiguous no-sync dispatch (``bench/probe_calls.v2_calls``' ``dc fp8`` and ``dc``: 4096 tokens at
DSv3 shapes) whose plan is one merged native chain (``Kernels.merged``), each round times, call by call in turn
and each after a ``torch.cuda.synchronize()``:

- ``whole``: ``ElasticBuffer.dispatch(...)`` as a caller makes it;
- ``merged``: the merged chain's Python entry (``go(x, scales, topk_idx, w, cum)``: the chain call, then the
  backend's result and recv_meta's outputs built in Python, as a call does before
  ``elastic_chains.FlatResults`` builds its results by position);
- ``chain``: the extension's ``Chain.run`` alone (outputs made by ``at::empty``, the kernels launched);
- ``outputs``: the same outputs made by the extension's ``Outputs.make`` (no launch);
- ``launch``: one launch of a one-element kernel through PyTorch (``torch.Tensor.zero_``), for scale;
- ``calib``: ``epcomm bench``'s calibration workload (``bench/timing``), to place the round in the CPU's phase.

So ``whole - merged`` is ``ElasticBuffer``'s Python around the plan, ``merged - chain`` the results built in
Python, ``chain - outputs`` the launches in C++, ``outputs`` the allocations. Medians per round; no result is
checked here (``epcomm bench`` checks these calls).

    python3 scripts/v2_host_split.py --calls 300 --rounds 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", default="dc fp8,dc")
    ap.add_argument("--json", default=None)
    ap.add_argument("--rig", action="store_true", help="on the CPU rig (bench/hostprobe.install; dry chains): "
                    "the script's own check on a machine without a GPU")
    a = ap.parse_args()

    import torch

    from epcomm import native
    from epcomm.backends import elastic_kernels
    from epcomm.bench import probe_calls as pc
    from epcomm.bench import timing

    made: list = []
    merged = elastic_kernels.Kernels.merged

    def keep(*args, **kw):
        go = merged(*args, **kw)
        made.append(go)
        return go

    elastic_kernels.Kernels.merged = staticmethod(keep)
    t, m, h, k, e = 4096, 4096, 7168, 8, 256
    if a.rig:
        from epcomm.bench import hostprobe

        hostprobe.install()
    dev = torch.device("cpu") if a.rig else torch.device("cuda", 0)
    buf = pc.v2_buffer(m, h, k, a.rig)
    sync = (lambda: None) if a.rig else torch.cuda.synchronize
    calib = timing.calibration_work(dev)
    one = torch.zeros(1, device=dev)
    out: dict = {"rounds": []}
    calls = pc.v2_calls(buf, t, m, h, k, e)  # (every kind's first calls: its plan and merged chain made)
    for kind in a.kinds.split(","):
        _, call = calls[kind]
        for _ in range(3):
            call()
        sync()
        gos = [g for g in made if g is not None]
        if not gos:
            print(f"{kind}: no merged chain was made (native extension: {native._state.get('why')})")
            return 1
        stash: dict = {}
        cells = {}
        for g in gos:  # each chain's call recorded once: which is this kind's, its stream and values
            c = dict(zip(g.raw.__code__.co_freevars, g.raw.__closure__))["run"]
            cells[id(g)] = (g, c, c.cell_contents)

            def rec(*vals, g=g, real=c.cell_contents):
                stash.setdefault("go", g)
                return stash.setdefault("made", real(*stash.setdefault("vals", vals)))
            c.cell_contents = rec
        call()
        sync()
        for g, c, real in cells.values():
            c.cell_contents = real
        if "go" not in stash:
            print(f"{kind}: its call ran no merged chain")
            return 1
        go = stash["go"]
        ch, real = go.chain, cells[id(go)][2]
        vals = stash["vals"]
        stream, rest = vals[0], vals[1:]
        go_args = (rest[0], rest[1], rest[2], rest[3], rest[8])
        outs = native.module().Outputs(*ch.spec)
        shapes = ch.spec[0]
        rows = next((stash["made"][i].shape[j] for i, sh in enumerate(shapes) for j, v in enumerate(sh) if v < 0), 0)
        kinds = {
            "whole": call,
            "merged": lambda: go(*go_args),
            "chain": lambda: real(stream, *rest),
            "outputs": lambda: outs.make(rows),
            "launch": one.zero_,
        }
        kinds["calib"] = calib
        for r in range(a.rounds):
            samples = {n: [] for n in kinds}
            for _ in range(a.calls):
                for n, f in kinds.items():
                    sync()
                    t0 = time.perf_counter_ns()
                    f()
                    samples[n].append((time.perf_counter_ns() - t0) / 1e3)
            row = {"kind": kind, "round": r, **{n: round(statistics.median(v), 2) for n, v in samples.items()}}
            out["rounds"].append(row)
            print(json.dumps(row))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
