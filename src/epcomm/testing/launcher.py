"""One process launcher for every distributed test, demo and benchmark.

``parallel_launch(world_size, fn, *args)`` starts ``world_size`` processes (spawned; see start-up), joins
them through a ``file://`` rendezvous in a fresh temporary directory (no fixed port), calls
``fn(ctx, *args)`` in each, and returns the list of per-rank return values. An exception in any rank
is re-raised in the parent as ``RankError`` naming the rank, with the remote traceback; a rank that
does not finish within ``timeout_s`` is killed and reported. The process group is destroyed in
``finally``.

Shared-GPU mode (``EPCOMM_TEST_SHARE_GPU=1``, for machines with fewer GPUs than ranks): an "nccl" launch
places rank r on GPU ``r % device_count`` and joins the ranks through gloo for both CPU and CUDA
tensors (``cpu:gloo,cuda:gloo``; NCCL refuses two ranks on one GPU), with torch symmetric memory told
that ranks may share a device. The ranks' kernels then time-share the GPU: the mode checks
correctness of the multi-rank paths, its timings mean nothing.

Start-up: a spawned rank is a fresh interpreter that imports torch itself, about 2 s of CPU a rank and
a launch. After ``fork_from_server()`` (the test suite calls it, ``tests/conftest.py``), a launch forks its
ranks from a server process that imported torch and epcomm once, where its environment allows
(``epcomm.testing.fork_servers``; ``parallel_launch(server=...)`` names a server of its own); else it spawns.

Under ``torchrun`` (one process per rank, on one node or many) nothing is spawned: ``env_world()`` reads
the world torchrun put in the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), and ``env_launch(world, world_size, fn, *args)`` joins it
(``init_method="env://"``), runs ``fn(ctx, *args)`` in this process and returns every rank's result, by
rank, on every rank (pickled, exchanged as tensors: no NumPy needed). Inside ``with from_env(world):`` a ``parallel_launch`` call
goes there instead of spawning (how ``epcomm check`` reaches it); outside, ``parallel_launch`` spawns as
it always did, whatever the environment holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import os
import pickle
import queue
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .fork_servers import SAFE_ENV, fork_from_server, start_method, starting  # noqa: F401  (fork_from_server: API)


class RankError(RuntimeError):
    """A rank raised; ``rank`` and the remote traceback are in the message."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} failed:\n{message}")
        self.rank = rank


def _last_line(text: str) -> str:
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


# what a rank's wait raises when a peer failed and left (gloo: the connection closed; NCCL: the deadline passed)
_WAITED_ON_PEER = ("PeerLostError", "PeerTimeoutError")


def _cause(errors: dict) -> int:
    """The rank whose failure to report: the lowest one that did not fail waiting on a peer (a rank that raises and
    leaves makes its peers' next wait fail, often before its own report arrives), else the lowest."""
    own = [r for r in sorted(errors) if not any(n in _last_line(errors[r]) for n in _WAITED_ON_PEER)]
    return own[0] if own else min(errors)


@dataclasses.dataclass
class RankContext:
    rank: int
    world_size: int
    device: torch.device
    backend: str
    group: Any


@dataclasses.dataclass(frozen=True)
class EnvWorld:
    """This process's place in a world that a launcher such as ``torchrun`` started."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def env_world(environ: dict | None = None) -> EnvWorld | None:
    """The world in ``environ`` (default ``os.environ``), or ``None`` where neither ``RANK`` nor
    ``WORLD_SIZE`` is set. Once either is set, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` must all be, as torchrun sets them (``LOCAL_WORLD_SIZE``
    defaults to ``WORLD_SIZE``); a missing or malformed one is a ``ValueError`` naming it and its value.

    Example: ``env_world({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
    "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})`` is rank 1 of 2, the only rank on its node.
    """
    env = os.environ if environ is None else environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise ValueError(f"RANK/WORLD_SIZE are set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                         "not: launch with torchrun (or set all of "
                         f"{', '.join(TORCHRUN_VARIABLES)}), or unset RANK and WORLD_SIZE to spawn local processes")

    def number(key: str, default: str | None = None, minimum: int = 0) -> int:
        raw = env.get(key) or default
        try:
            v = int(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be an integer, got {raw!r}") from None
        if v < minimum:
            raise ValueError(f"{key} must be >= {minimum}, got {v}")
        return v

    world = EnvWorld(rank=number("RANK"), world_size=number("WORLD_SIZE", minimum=1),
                     local_rank=number("LOCAL_RANK"),
                     local_world_size=number("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE"), minimum=1),
                     master_addr=env["MASTER_ADDR"], master_port=number("MASTER_PORT", minimum=1))
    if world.rank >= world.world_size:
        raise ValueError(f"RANK must be < WORLD_SIZE={world.world_size}, got {world.rank}")
    if world.local_rank >= world.local_world_size:
        raise ValueError(f"LOCAL_RANK must be < LOCAL_WORLD_SIZE={world.local_world_size}, got {world.local_rank}")
    return world


_FROM_ENV: EnvWorld | None = None


@contextlib.contextmanager
def from_env(world: EnvWorld):
    """Inside the block, ``parallel_launch`` runs on ``world`` in this process (``env_launch``)."""
    global _FROM_ENV
    before, _FROM_ENV = _FROM_ENV, world
    try:
        yield world
    finally:
        _FROM_ENV = before


def env_launch(world: EnvWorld, world_size: int, fn: Callable, *args, backend: str | None = None,
               pg_timeout_s: float = 120.0) -> list:
    """Run ``fn(ctx, *args)`` as rank ``world.rank`` of the torchrun world; every rank's result, by rank.

    ``backend``: ``"nccl"`` (this rank on ``cuda:LOCAL_RANK``), ``"gloo"`` (CPU tensors), or ``None``
    (NCCL where CUDA is available). The process group is made here (``env://``) and destroyed before
    returning unless one already existed, which is then used as the world. An exception in ``fn`` is
    raised here as ``RankError`` naming this rank; the other ranks learn of it when torchrun stops them.
    """
    if world_size != world.world_size:
        raise ValueError(f"world_size={world_size} but the launcher started WORLD_SIZE={world.world_size} "
                         "processes: leave the world size to the launcher")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo' under a launcher, got {backend!r}")
    os.environ.update(SAFE_ENV)
    kw = {}
    if backend == "nccl":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if world.local_world_size > n:
            raise ValueError(f"LOCAL_WORLD_SIZE={world.local_world_size} processes on this node need as many "
                             f"GPUs for NCCL, {n} visible")
        torch.cuda.set_device(world.local_rank)
        device = torch.device("cuda", world.local_rank)
        kw = {"device_id": device}
    else:
        device = torch.device("cpu")
    made = not dist.is_initialized()
    if made:
        dist.init_process_group(backend, init_method="env://", rank=world.rank, world_size=world.world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s), **kw)
    try:
        ctx = RankContext(world.rank, world.world_size, device, backend, dist.group.WORLD)
        try:
            out = fn(ctx, *args)
        except BaseException as e:  # noqa: BLE001 - re-raised with the rank, as parallel_launch does
            if _skip_message(e) is not None:
                raise  # pytest.skip in this rank: the test skips
            raise RankError(world.rank, traceback.format_exc()) from None
        return _all_gather_results(dist.group.WORLD, world.rank, out, pg_timeout_s)
    finally:
        if made:
            dist.destroy_process_group()


def _all_gather_results(group, rank: int, out, timeout_s: float) -> list:
    """Every rank's ``out``, by rank: pickled and exchanged as tensors (``dist.all_gather_object`` needs
    NumPy, which the reference backend does not: an install with ``--no-deps`` may lack it)."""
    from ..backends import deadline

    blobs = deadline.all_gather_bytes(group, pickle.dumps(out), rank, "the launcher's result exchange", timeout_s)
    return [pickle.loads(b) for b in blobs]


def _skip_message(exc: BaseException) -> str | None:
    """The reason of a ``pytest.skip`` (``exc`` is pytest's skip exception), else None."""
    outcomes = sys.modules.get("_pytest.outcomes")
    if outcomes is not None and isinstance(exc, outcomes.Skipped):
        return str(exc.msg if hasattr(exc, "msg") else exc)
    return None


def share_gpu(world_size: int) -> bool:
    """Whether an "nccl" launch of ``world_size`` ranks runs in shared-GPU mode (see the module doc)."""
    return (os.environ.get("EPCOMM_TEST_SHARE_GPU", "") not in ("", "0") and torch.cuda.is_available()
            and torch.cuda.device_count() < world_size)


def _stack_file(init_file: str, rank: int) -> str:
    return f"{init_file}.stack-{rank}"


def _worker(rank, world_size, init_file, backend, pg_timeout_s, fn, args, results, dump_at=None, env=None):
    if env is not None:  # forked from the server: the launch's environment, not the server's
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(SAFE_ENV)
    # A rank that does not finish in time leaves every thread's Python stack in a file the parent puts
    # into the error, so a hang says where it hangs: the parent asks with SIGUSR1, and a watchdog thread
    # (independent of signal delivery, which a thread blocked in the driver may not see) writes it
    # shortly before the parent's deadline.
    stack = open(_stack_file(init_file, rank), "w")  # noqa: SIM115 - open for the process's lifetime
    faulthandler.enable(file=stack, all_threads=True)  # a fatal signal (abort, segfault) leaves its stacks too
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)
    if dump_at is not None:  # wall-clock time, shortly before the parent's deadline
        faulthandler.dump_traceback_later(max(dump_at - time.time(), 1.0), file=stack)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device = torch.device("cuda", torch.cuda.current_device())
            kw = {"device_id": device}
            if share_gpu(world_size):
                os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
                backend, kw = "cpu:gloo,cuda:gloo", {}
        else:
            device = torch.device("cpu")
            kw = {}
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s), **kw,
        )
        if backend == "gloo":
            # Gloo's full mesh is connected when every rank has returned from init_process_group, not when
            # this one has: a rank whose target ends at once (a skip, an early error) could exit while a
            # peer still completed its pairs, which then failed with "connectFullMesh failed ... Connection
            # closed by peer" (~2 % of such launches on a loaded 2-core host). One barrier first.
            dist.barrier()
        ctx = RankContext(rank, world_size, device, backend, dist.group.WORLD)
        try:
            out = fn(ctx, *args)
        except BaseException as e:  # noqa: BLE001 - reported to the parent with the rank
            # Report before tearing the group down: destroying it while a peer still waits in a
            # collective can block, and the error must not wait for that.
            skip = _skip_message(e)
            results.put((rank, "skip", skip) if skip is not None else (rank, "error", traceback.format_exc()))
            return
        results.put((rank, "ok", out))
        faulthandler.cancel_dump_traceback_later()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the result is already reported
            pass
    except BaseException as e:  # noqa: BLE001 - reported to the parent with the rank
        skip = _skip_message(e)
        results.put((rank, "skip", skip) if skip is not None else (rank, "error", traceback.format_exc()))


def parallel_launch(world_size: int, fn: Callable, *args, backend: str | None = None,
                    timeout_s: float = 300.0, pg_timeout_s: float = 120.0, grace_s: float = 10.0,
                    server: str = "", environ: dict | None = None) -> list:
    """Run ``fn(ctx, *args)`` on ``world_size`` fresh processes; return their results by rank.
    Once a rank failed or skipped, the others get ``grace_s`` seconds to report, then their stacks are
    taken and they are stopped. ``server``: the named fork server the ranks fork from, where it runs
    (``fork_from_server``); ``environ``: the environment the ranks start with (default ``os.environ``).
    Inside ``with from_env(world):`` it runs on that launcher-made world instead (``env_launch``)."""
    if not grace_s > 0:
        raise ValueError(f"grace_s must be > 0, got {grace_s!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if _FROM_ENV is not None:
        return env_launch(_FROM_ENV, world_size, fn, *args, backend=backend, pg_timeout_s=pg_timeout_s)
    if backend is None:
        backend = ("nccl" if torch.cuda.is_available()
                   and (torch.cuda.device_count() >= world_size or share_gpu(world_size)) else "gloo")
    os.environ.update(SAFE_ENV)
    environ = {**(os.environ if environ is None else environ), **SAFE_ENV}
    method, server_obj = start_method(environ, server)
    # a forked rank takes ``environ`` first thing; a spawned one inherits this process's, which must then be it
    env = environ if method == "forkserver" else None
    if method == "spawn" and environ != dict(os.environ):
        raise ValueError("parallel_launch(environ=...) with an environment this process's fork server cannot "
                         "start ranks in: it spawns them, with this process's environment")
    ctx = mp.get_context(method)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="epcomm-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, backend, pg_timeout_s, fn, args, results,
                                                   time.time() + max(timeout_s - 5.0, 0.5 * timeout_s), env),
                        daemon=False)
            for r in range(world_size)
        ]
        with starting(server_obj):
            for p in procs:
                p.start()
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        skips: dict[int, str] = {}  # pytest.skip in a rank: the reason
        deadline = time.monotonic() + timeout_s
        while len(out) + len(errors) + len(skips) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and r not in out and r not in errors and r not in skips]
                # A process that died without reporting (segfault, os._exit) is an error too.
                for r in dead:
                    try:
                        rank, status, value = results.get(timeout=2.0)
                    except queue.Empty:
                        errors[r] = f"process exited with code {procs[r].exitcode} without a result"
                        continue
                    {"ok": out, "skip": skips}.get(status, errors)[rank] = value
                continue
            {"ok": out, "skip": skips}.get(status, errors)[rank] = value
            if errors or skips:  # one rank failed or skipped: give the others a moment to report, then stop
                deadline = min(deadline, time.monotonic() + grace_s)
        stuck = [r for r in range(world_size)
                 if r not in out and r not in errors and r not in skips and procs[r].is_alive()]
        stacks = _dump_stacks(procs, stuck, init_file)
        for r in stuck:  # their stacks are taken: waiting for them to end would only wait
            procs[r].kill()
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
        if errors:
            first = _cause(errors)
            also = "".join(f"\nrank {r} also failed: {_last_line(errors[r])}" for r in sorted(errors) if r != first)
            raise RankError(first, errors[first] + also + stacks)
        if skips:  # no rank failed: the test skips, as it would have in one process
            import pytest

            first = min(skips)
            pytest.skip(f"rank {first}: {skips[first]}")
        missing = [r for r in range(world_size) if r not in out]
        if missing:
            raise RankError(missing[0], f"ranks {missing} did not finish within {timeout_s:.0f} s" + stacks)
        return [out[r] for r in range(world_size)]


def _proc_state(pid: int) -> str:
    """The kernel's view of a process: its state and each thread's state and wait channel (Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("State:")), "?")
        threads = []
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int)[:16]:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()[0]
            try:
                with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                    wchan = f.read().strip() or "-"
            except OSError:
                wchan = "?"
            threads.append(f"{tid}:{st}/{wchan}")
        return f"state {state}; threads " + " ".join(threads)
    except (OSError, StopIteration, IndexError):
        return "state unknown"


def _dump_stacks(procs, ranks: list[int], init_file: str) -> str:
    """Ask the still-running ``ranks`` for their Python stacks (SIGUSR1, see ``_worker``); the text."""
    if not ranks or not hasattr(signal, "SIGUSR1"):
        return ""
    for r in ranks:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(1.0)
    parts = []
    for r in ranks:
        try:
            with open(_stack_file(init_file, r)) as f:
                text = f.read()
        except OSError:
            text = ""
        parts.append(f"\n--- rank {r} was still running ({_proc_state(procs[r].pid)}); its Python stacks:\n"
                     + (text[-12000:] or "(none written)"))
    return "".join(parts)
