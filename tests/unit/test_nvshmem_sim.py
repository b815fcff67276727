"""Tier 1: the delivery rules of tier 2's simulated NVSHMEM (``kernels/nvshmem_sim.py``), called directly on
host buffers (what the simulated device functions of ``kernels/nvshmem.py`` call under the interpreter).

Worked example (``test_signal_overtakes_pending_puts``): program 0 puts ``"new"`` to PE 1 and then
signals PE 1 with no fence or quiet between: the destination reads ``0xFF`` at once and ``"new"``
only ``GRACE_S`` later; a put to PE 2 pending at that moment is not overtaken and lands at its quiet.
"""
import ctypes

import pytest

from epcomm.kernels import nvshmem_sim as sim


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """Empty queues and counts, no early landings (``EARLY_P`` is tested on its own), a short grace."""
    monkeypatch.setattr(sim, "_pending", [])
    monkeypatch.setattr(sim, "_late", [])
    monkeypatch.setattr(sim, "stats", {"puts": 0, "early": 0, "overtaken": 0})
    monkeypatch.setattr(sim, "EARLY_P", 0.0)
    monkeypatch.setattr(sim, "GRACE_S", 0.05)
    yield
    sim.flush()


def _buf(data: bytes):
    b = ctypes.create_string_buffer(data, len(data))
    return b, ctypes.addressof(b)


def test_put_reads_its_source_now_and_lands_at_its_programs_quiet():
    src, s = _buf(b"abc")
    dst, d = _buf(b"...")
    sim.put(d, s, 3, 1, 0, 0, 0)
    src.raw = b"xyz"  # a blocking put returns when its source may be reused
    sim.quiet(1, 0, 0)  # another program's quiet does not complete it
    assert dst.raw == b"..." and sim.pending() == 1
    sim.quiet(0, 0, 0)
    assert dst.raw == b"abc" and sim.pending() == 0 and sim.stats["puts"] == 1


def test_fence_and_progress_deliver():
    _, s = _buf(b"abc")
    dst, d = _buf(b"...")
    dst2, d2 = _buf(b"...")
    sim.put(d, s, 3, 1, 0, 0, 0)
    sim.put(d2, s, 3, 1, 2, 0, 0)
    sim.fence(0, 0, 0)
    assert (dst.raw, dst2.raw) == (b"abc", b"...")
    sim.progress()  # a waiting program: every pending put lands
    assert dst2.raw == b"abc" and sim.pending() == 0


def test_signal_overtakes_pending_puts():
    _, s = _buf(b"new")
    dst, d = _buf(b"old")
    dst2, d2 = _buf(b"old")
    sig_dst, sd = _buf(b"..")
    _, ss = _buf(b"ok")
    sim.put(d, s, 3, 1, 0, 0, 0)  # to PE 1
    sim.put(d2, s, 3, 2, 0, 0, 0)  # to PE 2
    sim.put_signal_data(sd, ss, 2, 1)  # signal to PE 1: its own data lands now
    assert sig_dst.raw == b"ok"
    assert dst.raw == b"\xff\xff\xff" and sim.stats["overtaken"] == 1  # in flight: poison, not "old"
    assert dst2.raw == b"old" and sim.pending() == 2  # PE 2's put: still pending, not overtaken
    sim.quiet(0, 0, 0)  # lands PE 2's put; the overtaken one lands only after the grace
    assert dst2.raw == b"new" and dst.raw == b"\xff\xff\xff"
    sim.flush()
    assert dst.raw == b"new" and sim.pending() == 0


def test_a_put_may_land_early(monkeypatch):
    monkeypatch.setattr(sim, "EARLY_P", 1.0)
    _, s = _buf(b"abc")
    dst, d = _buf(b"...")
    sim.put(d, s, 3, 1, 0, 0, 0)
    assert dst.raw == b"..."
    sim.put(d, s, 0, 1, 0, 0, 0)  # the next call: the pending put lands early
    assert dst.raw == b"abc" and sim.stats["early"] == 1 and sim.pending() == 0
