"""The waits on peers that epcomm issues itself (collectives, barriers, the rank exchanges), each with a
deadline (``EPCOMM_TIMEOUT_S``) and a ``PeerTimeoutError`` naming this rank and the phase.

Ranks exchange tensors, never pickled objects: ``dist.all_gather_object`` needs NumPy, which is not a
dependency of epcomm (:func:`all_gather_ints`, :func:`all_gather_bytes`).

How a wait is bounded, by the process group's backend for the tensors' device:

- **gloo**: the operation itself carries the deadline (its options' ``timeout``), so gloo ends it when
  the deadline passes. Nothing of it stays queued in the process group: a gloo operation left waiting
  would keep a worker thread of the group blocked until the peer goes away, and the group's teardown
  (``destroy_process_group``, or the interpreter's exit) joins that thread.
- **NCCL** (and any other backend): the host polls the work until the deadline. The operation then
  stays queued on the GPU, so the group is aborted (``ProcessGroup.abort``): later use of the group
  raises instead of queueing behind it, and its teardown does not wait for the peer.

Either way the group is recorded as given up (``base.gave_up``): a Buffer's ``destroy()`` then skips its
collective teardown, which would wait on the peer again.

Who is missing (a collective's timeout names the ranks that never arrived, :class:`_RollCall`): a wait that
is still open after its first ``grace`` (``_grace``: a quarter of the deadline, at most 1 s) announces this
rank's arrival in the process group's store (one key a rank, the wait's phase and count in its name; calls
that finish sooner write nothing). The operation itself ends ``grace`` before the deadline; then the rank
reads, for up to ``grace``, which ranks announced: every rank that arrived before the operation gave up has
by then. The ones that did not are named, and the whole wait still ends at the deadline.

Not bounded here: torch's symmetric-memory rendezvous and NVSHMEM's start-up (they wait through the
process group's store, up to the group's own timeout). epcomm runs a bounded barrier right before them,
so every rank is known to have arrived, and :func:`watch` logs an error naming the rank and the phase if
one still outlasts the deadline.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import datetime
import logging
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions

from .errors import PeerLostError, PeerTimeoutError

log = logging.getLogger(__name__)


def backend_for(group, device: torch.device) -> str:
    """The name of ``group``'s backend for tensors on ``device`` ("gloo", "nccl", ...).

    Example: a group made with ``"cpu:gloo,cuda:gloo"`` gives "gloo" for CUDA tensors; one made with
    ``"nccl"`` gives "nccl"."""
    name = str(dist.get_backend(group)).lower()
    if ":" not in name:
        return name
    per_device = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
    return per_device.get(device.type, name)


def exchange_device(group) -> torch.device:
    """Where the group's small exchanges run: the current CUDA device where NCCL serves CPU tensors too (a
    plain NCCL group), else the CPU (gloo, or a test's "fake" group)."""
    if backend_for(group, torch.device("cpu")) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Finished gloo operations, kept referenced from Python for a while (see :func:`_retire`).
_RETIRED: collections.deque = collections.deque(maxlen=64)  # (when, work)
_SETTLE_S = 0.05


def _retire(work) -> None:
    """Keep ``work`` (a finished gloo operation) referenced from Python.

    gloo runs a collective on a worker thread of the process group, which drops its own reference to the
    work a moment after ``wait()`` has returned here. If that reference is the last one, the work's
    tensors are freed on the worker thread, which must take the GIL to release their Python objects; at
    interpreter exit that thread is then terminated mid-destructor, and the process aborts ("terminate
    called without an active exception", SIGABRT) although every call succeeded. Holding the work here
    makes the worker's reference never the last: the work is freed later, on a Python thread, once it is
    ``_SETTLE_S`` old (so the tensors of recent calls only are held)."""
    now = time.monotonic()
    while _RETIRED and now - _RETIRED[0][0] > _SETTLE_S:
        _RETIRED.popleft()
    _RETIRED.append((now, work))


@atexit.register
def _settle() -> None:
    """At exit, give gloo's worker threads a moment to drop the works they just finished (``_retire``)
    while the interpreter still runs; then free them here, on the main thread."""
    if _RETIRED and time.monotonic() - _RETIRED[-1][0] < _SETTLE_S:
        time.sleep(_SETTLE_S)
    _RETIRED.clear()


def _timeout(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_s)


def _grace(timeout_s: float) -> float:
    """How long a collective's wait runs before this rank announces its arrival, and how long it reads the
    others' announcements after the operation gave up (which it does that long before the deadline).
    Example: 1 s of a 10 s deadline, 0.25 s of a 1 s one."""
    return min(1.0, timeout_s / 4)


def _op_timeout(timeout_s: float) -> datetime.timedelta:
    """A gloo operation's own deadline: ``timeout_s`` less the roll call's ``_grace`` after it."""
    return _timeout(timeout_s - _grace(timeout_s))


_WAITS: dict = {}  # (group name, phase) -> how many collective waits of that phase this rank has begun


class _RollCall:
    """Which ranks of ``group`` arrived at this rank's current wait of ``phase`` (a collective's): each announces
    itself in the group's store under a key of the phase and of its count of such waits (the same on every rank
    in step), only when its wait is slow (:meth:`arrive`); :meth:`missing` reads who did not. Any failure of
    the store (none, a test's fake group, a store that went away with its host) leaves the ranks unknown."""

    __slots__ = ("announced", "group", "prefix")

    def __init__(self, group, phase: str):
        name = getattr(group, "group_name", "")
        n = _WAITS.get((name, phase), 0)
        _WAITS[(name, phase)] = n + 1
        self.group, self.prefix, self.announced = group, f"epcomm/arrived/{phase}/{n}/", False

    def _store(self):
        get = getattr(dist.distributed_c10d, "_get_process_group_store", None)
        return get(self.group) if get is not None else None

    def arrive(self) -> None:
        """Announce this rank's arrival (once)."""
        if self.announced:
            return
        self.announced = True
        try:
            self._store().set(self.prefix + str(dist.get_rank(self.group)), "1")
        except Exception as e:  # noqa: BLE001 - the roll call is a courtesy: the timeout is raised anyway
            log.debug("epcomm: no arrival announced for %s (%s)", self.prefix, e)

    def missing(self, within_s: float) -> tuple[int, ...] | None:
        """The ranks that have not announced their arrival, polled for up to ``within_s`` seconds while some
        are missing; None where the store cannot say."""
        try:
            self.arrive()
            store, me, n = self._store(), dist.get_rank(self.group), dist.get_world_size(self.group)
            end = time.monotonic() + within_s
            while True:
                gone = tuple(r for r in range(n) if r != me and not store.check([self.prefix + str(r)]))
                if not gone or time.monotonic() >= end:
                    return gone
                time.sleep(min(0.02, within_s / 8))
        except Exception as e:  # noqa: BLE001 - as in arrive
            log.debug("epcomm: no roll call for %s (%s)", self.prefix, e)
            return None


def issue_all_gather(group, out: list[torch.Tensor], src: torch.Tensor, timeout_s: float):
    """``dist.all_gather(out, src, group, async_op=True)``; on gloo the operation ends itself before ``timeout_s``
    (``_op_timeout``: :func:`wait` spends the rest on the roll call)."""
    if backend_for(group, src.device) == "gloo":
        opts = AllgatherOptions()
        opts.timeout = _op_timeout(timeout_s)
        return group.allgather([out], [src], opts)
    return dist.all_gather(out, src, group=group, async_op=True)


def issue_all_to_all(group, recv: torch.Tensor, send: torch.Tensor, recv_counts: list[int],
                     send_counts: list[int], timeout_s: float):
    """``dist.all_to_all_single`` with uneven splits, async; on gloo the operation ends itself before ``timeout_s``
    (as :func:`issue_all_gather`'s)."""
    if backend_for(group, send.device) == "gloo":
        opts = AllToAllOptions()
        opts.timeout = _op_timeout(timeout_s)
        return group.alltoall_base(recv, send, list(recv_counts), list(send_counts), opts)
    return dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group, async_op=True)


def abort(group) -> None:
    """Abort ``group`` (an operation of epcomm's stays queued on it on the GPU); log, never raise."""
    try:
        if hasattr(group, "abort"):
            group.abort()
        else:  # older torch
            dist.distributed_c10d._abort_process_group(group)
        log.warning("epcomm: process group %s aborted: an operation of epcomm's on it passed its deadline",
                    getattr(group, "group_name", "?"))
    except Exception as e:  # noqa: BLE001 - best effort: the PeerTimeoutError is what the caller reports
        log.warning("epcomm: could not abort process group %s after a deadline (%s)",
                    getattr(group, "group_name", "?"), e)


def wait(work, group, device: torch.device, me: int, phase: str, timeout_s: float,
         peer: int | None = None) -> None:
    """Wait for ``work`` (an async operation on ``group`` with tensors on ``device``) until ``timeout_s``;
    past it raise ``PeerTimeoutError(me, phase, peer)``; a transport failure (a peer's connection
    closed) raises ``PeerLostError``. Either records ``group`` as given up. Without ``peer`` (a collective)
    the error names the ranks that never arrived (:class:`_RollCall`); a gloo operation must then have been
    issued by ``issue_*``, which end it before the deadline, leaving the roll call its time."""
    if work is None:
        return
    backend = backend_for(group, device)
    if backend not in ("gloo", "nccl"):  # another backend (a test's "fake" group): its own wait
        work.wait()
        return
    roll = _RollCall(group, phase) if peer is None else None
    grace = _grace(timeout_s)
    if backend == "nccl":
        # the work completes on the GPU: poll its end so the host never blocks past the deadline
        start = time.monotonic()
        deadline = start + timeout_s - (grace if roll is not None else 0.0)
        while not work.is_completed():
            now = time.monotonic()
            if roll is not None and now - start > grace:
                roll.arrive()
            if now > deadline:
                err = PeerTimeoutError(me, phase, peer, timeout_s, group=group,
                                       ranks=None if roll is None else roll.missing(grace))
                abort(group)
                raise err
            time.sleep(0)
        work.wait()
        return
    start = time.monotonic()
    try:
        if roll is None:
            work.wait(timeout=_timeout(timeout_s))
        else:
            try:  # (a wait that times out leaves the operation running: it ends at its own deadline)
                work.wait(timeout=_timeout(grace))
            except RuntimeError as e:
                if not _timed_out(e):
                    raise
                roll.arrive()
                work.wait(timeout=_timeout(timeout_s))
    except RuntimeError as e:
        _retire(work)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        late = time.monotonic() - start >= timeout_s - 2 * grace
        ranks = None if roll is None else roll.missing(grace)
        # a peer that arrived and gave up at its own deadline closes its connections: where that ends this
        # wait near its deadline and ranks never arrived, they are the cause
        if _timed_out(e) or (late and ranks):
            raise PeerTimeoutError(me, phase, peer, timeout_s, first, group=group, ranks=ranks) from None
        raise PeerLostError(me, phase, peer, first, group=group, ranks=ranks) from None
    _retire(work)


def _timed_out(e: BaseException) -> bool:
    first = str(e).strip().splitlines()[0].lower() if str(e).strip() else ""
    return "timed out" in first or "timeout" in first


def all_gather_ints(group, values: list[int], me: int, phase: str, timeout_s: float) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank), by rank: an ``int64`` all-gather on the
    group's exchange device, bounded by ``timeout_s`` (a ``PeerTimeoutError`` naming ``me`` and ``phase``).

    Example: ranks 0 and 1 passing ``[7, 0]`` and ``[7, 1]`` both get ``[[7, 0], [7, 1]]``."""
    device = exchange_device(group)
    n = dist.get_world_size(group)
    src = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(src) for _ in range(n)]
    wait(issue_all_gather(group, out, src, timeout_s), group, device, me, phase, timeout_s)
    return torch.stack(out).cpu().tolist() if values else [[] for _ in range(n)]


NATIVE_BUILD_S = 900.0  # seconds: covers building native.py's extension once on a machine (~25-40 s seen)


def prepare_native(group, me: int, device, tune: bool, timeout_s: float) -> None:
    """Where plans on ``device`` make their outputs natively (``native.wanted``), load or build the extension now,
    then meet every rank under a deadline that covers a build (``NATIVE_BUILD_S``, or ``timeout_s`` if longer):
    called before a buffer's first collective, so no rank's first dispatch waits on a compiler while its peers
    wait for it in a kernel, and a rank that builds while its peers load from the cache keeps them waiting here."""
    from .. import native

    if native.wanted(device, tune):
        native.module()
        barrier(group, me, "Buffer/after loading the native output helper", max(timeout_s, NATIVE_BUILD_S))


def barrier(group, me: int, phase: str, timeout_s: float) -> None:
    """Every rank of ``group`` reached this point, or ``PeerTimeoutError`` naming ``me`` and ``phase``
    after ``timeout_s`` (an all-gather of each rank's number, which is checked)."""
    got = [r[0] for r in all_gather_ints(group, [dist.get_rank(group)], me, phase, timeout_s)]
    assert got == list(range(len(got))), f"{phase}: barrier gathered ranks {got}"


def all_gather_bytes(group, data: bytes, me: int, phase: str, timeout_s: float) -> list[bytes]:
    """Every rank's ``data`` (any length), by rank: sizes, then the padded bytes, as ``uint8`` tensors
    (no NumPy, unlike ``dist.all_gather_object``)."""
    sizes = [s[0] for s in all_gather_ints(group, [len(data)], me, phase, timeout_s)]
    device = exchange_device(group)
    src = torch.zeros(max(max(sizes), 1), dtype=torch.uint8)
    if data:
        src[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    src = src.to(device)
    out = [torch.empty_like(src) for _ in sizes]
    wait(issue_all_gather(group, out, src, timeout_s), group, device, me, phase, timeout_s)
    got = []
    for t, size in zip(out, sizes):
        t = t.cpu()
        got.append(ctypes.string_at(t.data_ptr(), size) if size else b"")
    return got


@contextlib.contextmanager
def watch(me: int, phase: str, timeout_s: float):
    """For a wait epcomm cannot bound itself (torch's symmetric-memory rendezvous, NVSHMEM's start-up):
    if the block outlasts ``timeout_s``, log an error naming ``me`` and ``phase`` (the block goes on
    waiting: it is bounded only by the process group's own timeout)."""
    def overdue():
        log.error("epcomm rank %d: %s has waited %g s for the other ranks and has no deadline of its own "
                  "(it waits up to the process group's timeout); is every rank building this Buffer?",
                  me, phase, timeout_s)

    timer = threading.Timer(timeout_s, overdue)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
