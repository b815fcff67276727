"""The internode backend on CPU processes: its host code and its Triton kernels under the interpreter,
the NVSHMEM device calls simulated (``kernels/nvshmem.py``, ``SIM=True``), every rank's symmetric
buffer mapped into every process (``testing/cpu_nvlink.py``: call its ``install`` first in a fresh
process). Virtual nodes (``EPCOMM_GPUS_PER_NODE``) decide which peers are on another node, i.e. which
writes go through the simulated NVSHMEM puts and which through plain stores.

What it checks: the host code (layouts, offsets, signal levels across calls, parities), the kernels'
logic with real peers running concurrently, the split between NVSHMEM and direct peers. What it
cannot: NVSHMEM itself (transport, ordering on a real network: tier 3), GPU memory ordering, timing.
"""

from __future__ import annotations


def internode_backend(spins: float = 2e5):
    """``make(runtime)``: the internode backend, simulated, for a front end's ``_make_backend``; a wait gives up
    after ``spins`` polls (the deadline error then names the phase and the peer)."""

    def make(rt):
        from ..backends.internode import InternodeBackend

        be = InternodeBackend(rt, sim=True)
        be.timeout_s = spins / 1e9  # the interpreter's waits count polls (timeout_ns of them)
        return be

    return make


def internode_buffer(group, spins: float = 2e5, **kw):
    """A ``Buffer`` on ``group`` (gloo) whose backend is the internode backend, simulated; a wait gives
    up after ``spins`` polls (the deadline error then names the phase and the peer)."""
    from .. import Buffer

    class OnInternode(Buffer):
        _make_backend = staticmethod(internode_backend(spins))

    return OnInternode(group, **kw)


def check_delivery() -> dict:
    """Raise ``AssertionError`` if a put of this process was overtaken by a signal to its PE (a missing
    fence or quiet: ``kernels/nvshmem_sim.py``) or is still undelivered once the kernels are done;
    return the simulation's counts (puts, early landings, overtaken)."""
    from ..kernels import nvshmem_sim

    stats, left = dict(nvshmem_sim.stats), nvshmem_sim.pending()
    if stats["overtaken"] or left:
        raise AssertionError(f"simulated NVSHMEM: {stats['overtaken']} put(s) overtaken by a signal to their "
                             f"PE (no fence or quiet between them), {left} not delivered after the kernels; "
                             f"{stats}")
    return stats
