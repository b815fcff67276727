"""Which kernels' code differs between two source trees, for the kernels one kind of call launches: each tree's
calls run on the CPU rig (``bench/hostprobe``: the nvlink backend at world 1, kernels not run), every kernel they
prepare is recorded with its constexprs and argument types, and each is compiled for sm_90 with Triton's own
compiler (no GPU needed); the PTX, without its debug lines, register numbers and labels, is compared. Each call kind
is then made once more and the grids of its launches (as the rig's no-op launcher and its dry chains get them) are
compared too.

Why: an A/B row that moves by 0.1-0.5 us can come from a kernel's code, its launch, or the machine. If every
kernel a call launches compiles to the same instructions in both trees, look at the launches and the machine.

Usage::

    python scripts/kernel_ptx_ab.py --tree base=/tmp/wt-d754d15 --tree head=. --api ll [--unfused] [--diff]

``--api``: ``ll`` (LL dispatch and combine at 1 and 128 tokens, with and without the receive hook), ``ht`` (``Buffer``'s HT calls) or ``v2``
(``ElasticBuffer``'s, 4096 tokens), DeepSeek-V3 shapes. ``--unfused``: the exchange kernel without the fused
layout (what a dispatch captured into a CUDA graph launches). ``--diff``: the differing kernels' PTX diff.
A tree is a directory with ``src/epcomm`` (``git archive SHA src | tar -x -C DIR``). Argument types are
inferred from the rig's tensors and ints (an address is taken as ``*i32``), the same way for both trees, so the
PTX is comparable between them rather than the exact PTX of a GPU host.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SIMS = os.path.join(HERE, "..", "tests", "unit", "sims")  # sm90.compile_kernel


def _arg_type(v) -> str:
    import torch

    if isinstance(v, torch.Tensor):
        return {torch.int32: "*i32", torch.int64: "*i64", torch.bfloat16: "*bf16", torch.float32: "*fp32",
                torch.uint8: "*u8", torch.int8: "*i8", torch.bool: "*i1", torch.int16: "*i16",
                torch.float8_e4m3fn: "*fp8e4nv"}.get(v.dtype, "*i8")
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "*i32" if abs(v) >= 2 ** 32 else "i64" if abs(v) >= 2 ** 31 else "i32"
    return "*i32"  # None, or an address object (kernels/launch.Ptr)


def _kernel_name(launcher) -> str:
    fn = launcher.fn
    return getattr(getattr(fn, "fn", fn), "__name__", launcher.name)


def record(api: str, unfused: bool, out: str) -> None:
    """In a tree's process: run ``api``'s calls on the rig and write ``[[name, consts, types], ...]``."""
    import inspect

    from epcomm.bench import hostprobe as hp
    from epcomm.kernels.launch import Launcher

    seen, types = [], {}
    prepared, bind = Launcher.prepared, Launcher._bind

    def prepared_(self, key, consts):
        seen.append((_kernel_name(self), dict(consts)))
        return prepared(self, key, consts)

    def bind_(self, k, grid, args, kw):
        params = list(inspect.signature(self.fn.fn).parameters) if hasattr(self.fn, "fn") else []
        types.setdefault(_kernel_name(self), {}).update({p: _arg_type(a) for p, a in zip(params, args)})
        return bind(self, k, grid, args, kw)

    Launcher.prepared, Launcher._bind = prepared_, bind_
    # the rig's C-launcher slot, wrapped before any launch binds it (a bound launch keeps the function it found)
    probe_rig = hp._rig() if hasattr(hp, "_rig") else hp  # (the rig's own module; older trees kept it in hostprobe)
    current, launch = [None], probe_rig._NoLaunch.launch

    def recording(*a):
        if current[0] is not None:
            current[0].append(list(a[:3]))
        return launch(*a)

    probe_rig._NoLaunch.launch = staticmethod(recording)
    from epcomm import native

    if hasattr(native, "Chain"):  # a chain (dry on the rig) launches its steps itself: their grids from last()
        chain_call = native.Chain.__call__

        def chain_recording(self, *vals):
            out = chain_call(self, *vals)
            if current[0] is not None:
                current[0].extend([list(step[0]) if isinstance(step, (list, tuple)) else step for step in self.last()])
            return out

        native.Chain.__call__ = chain_recording
    if unfused:
        from epcomm.backends import ht_dispatch

        ht_dispatch.HTDispatch.fuses_layout = lambda self, capturing=False: False
    hp.install()
    if api == "ll":
        buf = hp.cpu_buffer(128, 7168, 256)
        made = [hp.ll_calls(buf, t, 128, 7168, 8, 256, hook) for t in (1, 128) for hook in (False, True)]
    elif api == "ht":
        buf = hp.ht_buffer(4096, 7168, 8, True)
        made = [hp.ht_calls(buf, 4096, 7168, 8, 256)]
    else:
        buf = hp.v2_buffer(4096, 7168, 8, True)
        made = [hp.v2_calls(buf, 4096, 4096, 7168, 8, 256)]
    # each call kind once more, its launches' grids recorded as the (no-op) C launcher gets them, in order
    grids: dict = {}
    for i, calls in enumerate(made):
        for kind, (prep, call) in calls.items():
            if prep is not None:
                prep()
            current[0] = grids.setdefault(f"{kind} #{i}", [])
            try:
                call()
            finally:
                current[0] = None

    def plain(v):
        return v if isinstance(v, (bool, int, float)) else f"tl.{v}"

    with open(out, "w") as f:
        json.dump({"kernels": [[n, {k: plain(v) for k, v in c.items()}, types.get(n, {})] for n, c in seen],
                   "grids": grids}, f)


def _normalised(ptx: str) -> list[str]:
    lines = []
    for line in ptx.split(".section")[0].splitlines():  # (the debug sections come last)
        s = line.split("//")[0].strip()
        if not s or s.startswith((".loc", ".file")):
            continue
        s = re.sub(r"\$L__\w+", "L", s)
        s = re.sub(r"_param_\d+", "_param", s)
        lines.append(re.sub(r"%(r|rd|rs|p|f|fd|h|hh)\d+", r"%\1", s))
    return lines


def compile_all(recorded: str, out: str) -> None:
    """In a tree's process, without the rig: compile each recorded kernel variant; write ``{variant: lines}``."""
    import importlib
    import pkgutil

    import triton
    import triton.language as tl

    import epcomm.kernels as kernels_pkg

    sys.path.insert(0, SIMS)
    import compile_ht  # its argument types of the HT kernels (addresses the rig passes as plain ints)
    from sm90 import compile_kernel

    hand = {"_reduce_kernel": compile_ht.COMBINE, "_combine_kernel": compile_ht.COMBINE,
            "_dispatch_impl_kernel": compile_ht.GATHER}

    kernels = {}
    for m in pkgutil.iter_modules(kernels_pkg.__path__):
        try:
            mod = importlib.import_module(f"epcomm.kernels.{m.name}")
        except Exception as e:  # noqa: BLE001 - a module that needs what this machine lacks (NVSHMEM's bindings)
            print(f"(epcomm.kernels.{m.name} not imported: {type(e).__name__}: {e})", file=sys.stderr)
            continue
        for attr, v in vars(mod).items():
            if isinstance(v, triton.runtime.jit.JITFunction):
                kernels.setdefault(getattr(v.fn, "__name__", attr), v)
    result = {}
    with open(recorded) as f:
        entries = json.load(f)["kernels"]
    for name, consts, types in entries:
        consts = {k: getattr(tl, v[3:]) if isinstance(v, str) and v.startswith("tl.") else v
                  for k, v in consts.items()}
        warps = consts.pop("num_warps", 4)
        consts.pop("num_stages", None)
        variant = f"{name} w{warps} " + " ".join(f"{k}={v}" for k, v in sorted(consts.items()))
        if variant in result:
            continue
        fn = kernels.get(name)
        try:
            if fn is None:
                raise LookupError(f"no kernel named {name}")
            # an address the rig passed as an int ("*i32" here): the type compile_ht gives it, where it does
            known = dict(compile_ht.COMMON, **hand.get(name, {}))
            types = {k: known[k] if t == "*i32" and k in known else t for k, t in types.items()}
            types["timeout_ns"] = "i64"
            result[variant] = _normalised(compile_kernel(fn, types, consts, warps).asm["ptx"])
        except Exception as e:  # noqa: BLE001 - reported per variant
            why = [ln.strip() for ln in str(e).splitlines() if ln.strip() and ln.strip() != "^"]
            result[variant] = [f"(not compiled: {type(e).__name__}: {why[-1][:200] if why else ''})"]
    with open(out, "w") as f:
        json.dump(result, f)


def _tree_run(path: str, argv: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(path), "src"))
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode:  # (Triton prints a failed compile's whole IR on stderr: shown only when the step fails)
        sys.exit(f"{path}: {' '.join(argv[-3:])} failed ({done.returncode}):\n{done.stderr[-4000:]}")


def _digest(lines: list[str]) -> str:
    if len(lines) == 1 and lines[0].startswith("(not compiled"):
        return lines[0]
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:10]


def _base(variant: str) -> str:
    """A variant without the constexprs a tree has and the other has not (a switch's removal, an added flag)."""
    return variant.split(" ")[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", default=[], help="LABEL=PATH (twice)")
    p.add_argument("--api", choices=["ll", "ht", "v2"], default="ll")
    p.add_argument("--unfused", action="store_true")
    p.add_argument("--diff", action="store_true")
    p.add_argument("--record", nargs=1, help=argparse.SUPPRESS)
    p.add_argument("--compile", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.record:
        record(a.api, a.unfused, a.record[0])
        return 0
    if a.compile:
        compile_all(*a.compile)
        return 0
    if len(a.tree) != 2 or any("=" not in t for t in a.tree):
        p.error("give two trees, --tree LABEL=PATH each")
    trees = [t.split("=", 1) for t in a.tree]
    got, grids = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, path in trees:
            rec, out = os.path.join(tmp, f"{label}-rec.json"), os.path.join(tmp, f"{label}-ptx.json")
            _tree_run(path, ["--api", a.api, *(["--unfused"] if a.unfused else []), "--record", rec])
            _tree_run(path, ["--compile", rec, out])
            with open(out) as f:
                got[label] = json.load(f)
            with open(rec) as f:
                grids[label] = json.load(f)["grids"]
    (la, ga), (lb, gb) = got.items()
    kernels = sorted({_base(v) for v in (*ga, *gb)})
    counts: dict = {}
    for k in kernels:
        va, vb = ({_digest(v): (n, v) for n, v in g.items() if _base(n) == k} for g in (ga, gb))
        failed = any(h.startswith("(not compiled") for h in (*va, *vb))
        verdict = "NOT COMPARED" if failed else "same" if set(va) == set(vb) else "DIFFERS"
        counts[verdict] = counts.get(verdict, 0) + 1
        print(f"{k:48s} {la}: {sorted(va)}  {lb}: {sorted(vb)}  {verdict}")
        if a.diff and verdict != "same":
            for h in sorted(set(vb) - set(va)):
                name, lines = vb[h]
                # its counterpart: the variant of the same constexprs, else the one of most constexprs alike
                near = max(va.values(), key=lambda nv: len(set(nv[0].split()) & set(name.split())), default=("", []))
                print(f"--- {near[0]}\n+++ {name}")
                print("\n".join(difflib.unified_diff(near[1], lines, la, lb, lineterm="", n=2)))
    (_, gra), (_, grb) = grids.items()
    moved = [k for k in sorted(set(gra) | set(grb)) if gra.get(k) != grb.get(k)]
    for k in moved:
        print(f"launches of {k!r}: {la} {gra.get(k)}  {lb} {grb.get(k)}")
    print(f"{len(set(gra) | set(grb))} call kinds: " + (f"{len(moved)} launch other grids or other launches (above)"
                                                        if moved else "the same launches, with the same grids"))
    print(f"{len(kernels)} kernels: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) +
          " (same: every variant compiles to the same PTX in both trees)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
