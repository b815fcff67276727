"""One rank of a two-rank job, as its own ``python`` process (``tests/dist/test_timeout_exit.py`` and
``tests/gpu/test_timeout_exit_gpu.py`` start them with :func:`run`):
``python timeout_rank.py RANK INIT_FILE ROLE TRANSPORT``. ``EPCOMM_TIMEOUT_S`` comes from the environment.

Transports: ``gloo`` (CPU tensors), ``shared`` (both ranks on GPU 0, joined by gloo for CPU and CUDA
tensors, as ``EPCOMM_TEST_SHARE_GPU=1`` does; the Buffer runs nvlink unless ``EPCOMM_BACKEND`` says),
``nccl`` (rank ``r`` on GPU ``r``).

Roles of rank 0 (the one that waits):
- ``caught``: dispatches, catches the ``PeerTimeoutError``, writes it to stderr, calls ``destroy()`` and
  ``dist.destroy_process_group()``, and ends normally (exit code 0);
- ``uncaught``: dispatches and lets the error end the script (exit code 1);
- ``build``: builds its Buffer (the rank exchange), the error uncaught.
Roles of rank 1 (the peer): ``idle`` builds its Buffer and sleeps; ``dies`` builds its Buffer and exits at
once (``os._exit``); ``absent`` joins the process group only, and sleeps. Both ranks first make one dispatch
and combine together (the kind's arguments exchanged; on GPUs kernels compiled, connections made), so the
bound measures the deadline and the exit only.

Rank 0 writes ``waiting at <time.time()>`` to stderr just before the call that waits.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from epcomm import Buffer
from epcomm.testing.inputs import Case, make_topk, make_x
from epcomm.testing.launcher import SAFE_ENV

CASE = Case(2, (6, 7), hidden=128, num_topk=2, num_experts=4, seed=1, no_expert_token=False, drop_prob=0.0)


def main(rank: int, init_file: str, role: str, transport: str) -> None:
    device = torch.device("cpu")
    if transport == "gloo":
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    elif transport == "shared":
        os.environ.update(SAFE_ENV)
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        dist.init_process_group("cpu:gloo,cuda:gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    else:
        os.environ.update(SAFE_ENV)
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2, device_id=device)
    if role == "absent":
        time.sleep(300)
        return
    if role == "build":
        print(f"waiting at {time.time()}", file=sys.stderr, flush=True)
        Buffer(dist.group.WORLD)
        return
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=64 << 20, explicitly_destroy=True)
    idx, w = (t.to(device) for t in make_topk(CASE, rank))
    x = make_x(CASE, rank).to(device)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, CASE.num_experts)
    args = {"num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank, "num_tokens_per_expert": per_expert,
            "topk_idx": idx, "topk_weights": w}
    # one call together first (its kind's first call exchanges the arguments; on GPUs kernels compiled and
    # connections made), outside the bound: the call that waits is a repeat, whose wait is the dispatch's own
    recv_x, _, _, _, handle, _ = buf.dispatch(x, **args)
    buf.combine(recv_x, handle)
    if device.type == "cuda":
        torch.cuda.synchronize()
    if role == "idle":
        time.sleep(300)
        return
    if role == "dies":
        os._exit(0)
    print(f"waiting at {time.time()}", file=sys.stderr, flush=True)
    try:
        buf.dispatch(x, **args)
        if device.type == "cuda":
            torch.cuda.synchronize()
    except TimeoutError as e:
        if role == "uncaught":
            raise
        print(f"caught {type(e).__name__} on {buf.backend_name}: {e}", file=sys.stderr, flush=True)
        buf.destroy()
        try:
            dist.destroy_process_group()
        except Exception as err:  # noqa: BLE001 - an aborted group (NCCL) may refuse; the exit is what counts
            print(f"destroy_process_group: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        print(f"torn down at {time.time()}", file=sys.stderr, flush=True)


def run(cases: dict, tmp_path_factory, environ: dict, transport: str, start_s: float = 120.0,
        bound_s: float = 60.0) -> dict:
    """Start every case of ``cases`` (``{name: (rank 0's role, rank 1's role, ...)}``) at once, two processes
    each, with ``environ``; wait for each rank 0 (at most ``start_s + bound_s`` in all), then kill what is
    left. Returns ``{name: (exit code or None if still running, seconds from 'waiting at' to exit, stderr)}``."""
    env = dict(os.environ, **environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    runs = {}
    for i, (case, (role0, role1, *_)) in enumerate(cases.items()):
        d = tmp_path_factory.mktemp(f"case{i}")
        procs = []
        for rank, role in ((0, role0), (1, role1)):
            err = open(d / f"stderr{rank}", "w+")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen([sys.executable, os.path.abspath(__file__), str(rank),
                                            str(d / "rendezvous"), role, transport],
                                           env=env, stdout=subprocess.DEVNULL, stderr=err), err))
        runs[case] = procs
    out = {}
    try:
        end = time.monotonic() + start_s + bound_s
        for case, ((p0, err0), _) in runs.items():
            try:
                p0.wait(timeout=max(end - time.monotonic(), 1))
                exited = time.time()
            except subprocess.TimeoutExpired:
                exited = None
            err0.seek(0)
            text = err0.read()
            started = re.search(r"waiting at ([0-9.]+)", text)
            took = exited - float(started.group(1)) if exited is not None and started else None
            out[case] = (p0.returncode, took, text)
    finally:
        for procs in runs.values():
            for p, err in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
                err.close()
    return out


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else "gloo")
