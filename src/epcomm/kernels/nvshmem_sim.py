"""NVSHMEM's delivery rules for the tier-2 simulation (``kernels/nvshmem.py`` with ``SIM=True`` under the
Triton interpreter): plain Python, called from the simulated device functions, one state per process
(a process is one PE in tier 2).

NVSHMEM promises little about when a put lands (its memory-ordering section): ``nvshmem_fence`` orders
the puts issued before it to a PE before those issued after it to the same PE, ``nvshmem_quiet``
completes every put issued before it, and a put-with-signal makes *its own* data visible before its
signal. A plain put with no fence or quiet between it and a later signal to its PE may land after that
signal. The simulation is that weak:

- :func:`put` reads the source at once (a blocking put returns when the source may be reused) into a
  pending queue; the destination is written only when the put is *delivered*;
- :func:`quiet` and :func:`fence` deliver the calling program's pending puts, in a random order (puts to
  one PE with no fence between them are not ordered; delivering now is one order a fence allows);
  :func:`progress` (a program about to wait) delivers every pending put; at any call one pending put
  may land early, at random (probability ``EARLY_P``);
- :func:`put_signal_data` writes its own data at once (its caller raises the signal next). Puts to the
  same PE still pending (from any program of this process) are *overtaken*: their destination bytes
  become 0xFF at once (a put in flight leaves its destination undefined; the poison makes a stale read
  show even where the old bytes equal the new ones) and they land ``GRACE_S`` seconds later, from a
  timer thread, whatever the issuing program does meanwhile. A receiver that trusted the signal reads
  the poison: a kernel that signals before its data is fenced fails in tier 2, and ``stats["overtaken"]``
  counts it (tier 2 checks it stays 0).

The one liberty taken: an overtaken put lands late even past a later quiet of its program (NVSHMEM
would complete it there). Only a put that a signal to its own PE overtook is treated so, which our
kernels never do; delaying the quiet instead would hide the bug, since every rank sends and would wait
alike.

Programs are told apart by their ids (the interpreter runs a grid's programs one after another): the
quiet of one program does not complete another's puts (NVSHMEM's device quiet is documented per
calling PE; the simulation takes the narrower reading, which our kernels' "every program calls quiet
before its ticket" satisfies either way). :func:`pending` and :func:`flush` let a test see puts that no
kernel completed and wait for the late ones.
"""

from __future__ import annotations

import ctypes
import random
import threading

GRACE_S = 1.0  # an overtaken put lands this long after the signal that overtook it
EARLY_P = 0.25  # chance, at each call, that one pending put not overtaken lands early


class _Put:
    __slots__ = ("data", "dst", "pe", "prog")

    def __init__(self, prog, pe, dst, data):
        self.prog, self.pe, self.dst, self.data = prog, pe, dst, data


_pending: list[_Put] = []
_late: list[threading.Timer] = []  # overtaken puts not landed yet
_rng = random.Random(0x5EED)
stats = {"puts": 0, "early": 0, "overtaken": 0}  # this process's counts (tests read them)


def _int(v) -> int:
    """A Python int from an interpreter value (a ``tl.tensor`` of one element, or an int)."""
    if isinstance(v, int):
        return v
    import numpy as np  # (the interpreter's: present wherever a kernel runs interpreted)

    h = getattr(v, "handle", None)
    return int(np.asarray(h.data if h is not None else v).reshape(-1)[0])


def _prog(p0, p1, p2) -> tuple[int, int, int]:
    return _int(p0), _int(p1), _int(p2)


def _deliver(p: _Put) -> None:
    ctypes.memmove(p.dst, p.data, len(p.data))


def _early() -> None:
    if _pending and _rng.random() < EARLY_P:
        _deliver(_pending.pop(_rng.randrange(len(_pending))))
        stats["early"] += 1


def _deliver_where(keep) -> None:
    """Deliver (in a random order) and drop the pending puts for which ``keep`` is False."""
    global _pending
    go = [p for p in _pending if not keep(p)]
    _pending = [p for p in _pending if keep(p)]
    _rng.shuffle(go)
    for p in go:
        _deliver(p)


def put(dst, src, nbytes, pe, p0, p1, p2) -> None:
    """A put of ``nbytes`` from address ``src`` to address ``dst`` (in PE ``pe``'s buffer) by program
    ``(p0, p1, p2)``: the bytes are read now, written when delivered."""
    _early()
    n = _int(nbytes)
    if n > 0:
        _pending.append(_Put(_prog(p0, p1, p2), _int(pe), _int(dst), ctypes.string_at(_int(src), n)))
        stats["puts"] += 1


def put_signal_data(dst, src, nbytes, pe) -> None:
    """The data of a put-with-signal to PE ``pe``, written now (the caller raises the signal next); the
    puts to ``pe`` still pending are overtaken by that signal."""
    global _pending
    _early()
    pe = _int(pe)
    over = [p for p in _pending if p.pe == pe]
    if over:
        _pending = [p for p in _pending if p.pe != pe]
        for p in over:
            ctypes.memset(p.dst, 0xFF, len(p.data))
        stats["overtaken"] += len(over)
        t = threading.Timer(GRACE_S, lambda: [_deliver(p) for p in over])
        t.daemon = True
        t.start()
        _late.append(t)
    n = _int(nbytes)
    if n > 0:
        ctypes.memmove(_int(dst), ctypes.string_at(_int(src), n), n)


def quiet(p0, p1, p2) -> None:
    """Program ``(p0, p1, p2)``'s puts delivered."""
    me = _prog(p0, p1, p2)
    _deliver_where(lambda p: p.prog != me)


fence = quiet  # ordering per PE: delivering now is one order that satisfies it


def progress() -> None:
    """Every pending put delivered (a program that waits lets the network make progress)."""
    _deliver_where(lambda p: False)


def pending() -> int:
    """Puts issued in this process and not delivered yet (overtaken ones included)."""
    _late[:] = [t for t in _late if t.is_alive()]
    return len(_pending) + len(_late)


def flush() -> None:
    """Every put of this process delivered, the overtaken ones once they land."""
    progress()
    for t in _late:
        t.join()
