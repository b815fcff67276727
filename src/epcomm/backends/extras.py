"""What the plans of DeepEP V2's experimental calls share (Engram: ``engram.py``, pipeline send/recv:
``pp.py``, the AGRS all-gather: ``agrs.py``): the codes their kernels record, their own error word, their
symmetric memory, and the host side of the reference plans (staging through the CPU where gloo serves CUDA
tensors, bounded waits).

Each plan owns what it uses: its symmetric buffer (made by its collective configuration call: ``engram_write``,
``pp_set_config``, ``agrs_set_config``) and its error word, so none of them shares bytes with the dispatch and
combine staging or with each other (DeepEP lays all of them over its one buffer).

Letters: ``R`` ranks.
"""

from __future__ import annotations

import logging
import weakref

import torch

from . import deadline
from .errors import PeerTimeoutError

log = logging.getLogger(__name__)

# Codes the kernels of these plans record in their error word (``kernels.common.record_error``). Waits on a peer
# use the phases of ``kernels.common.PHASES`` (12-15); these two are bad data, raised as ValueError.
ENGRAM_BAD_INDEX = 16   # [16, -1, index, R*N]: an Engram index outside [0, R*N) (its row was not fetched)
PP_SIZE_MISMATCH = 17   # [17, peer, bytes sent, bytes this receive takes]


class ErrorWord:
    """A plan's error word (``kernels/common.py``): ``int32[6]`` on the device, ``[code, peer, observed, target,
    mirror address]``, the first four mirrored into pinned host memory by the kernel that records an error, so a
    call learns of it without a device synchronisation. ``be``: the backend (its ``rank``, ``timeout_s`` and
    ``group`` name a timeout)."""

    def __init__(self, be):
        self._be = weakref.ref(be)
        self.host = torch.zeros(4, dtype=torch.int32, device="cpu").pin_memory()
        self._view = self.host.numpy()  # (read without a torch call: every call checks it)
        words = torch.zeros(8, dtype=torch.int32, device=be.device)
        self.err = words[:6]
        self.err[4:].view(torch.int64).fill_(self.host.data_ptr())

    def check(self) -> None:
        """Raise what a kernel recorded: ``ValueError`` for bad data, ``PeerTimeoutError`` for a wait that gave up
        (naming the phase and the peer); nothing if the word is clear."""
        if not self._view[0]:
            return
        word = self.host.tolist()
        code, peer, observed, target = word
        if code == ENGRAM_BAD_INDEX:
            self.clear()  # bad input, not a broken transport: the plan stays usable
            raise ValueError(f"engram_fetch: indices holds {observed}, outside [0, {target}) (R * num_entries; found "
                             "on the device, that row was not fetched)")
        if code == PP_SIZE_MISMATCH:
            raise ValueError(f"pp_recv: rank {peer} sent a tensor of {observed} bytes, this receive takes {target} "
                             "(found on the device; nothing was copied and the slot is consumed)")
        be = self._be()
        if code < 0 or peer < 0:
            raise RuntimeError(f"epcomm rank {be.rank}: an error word of these calls reads {word}, which no epcomm "
                               "kernel records; this plan is now unusable")
        from ..kernels.common import PHASES

        raise PeerTimeoutError(be.rank, PHASES.get(code, f"phase {code}"), peer, be.timeout_s,
                               f"flag {observed} < expected {target}; this plan is now unusable (its configuring "
                               "call makes a new one)", group=be.group)

    def clear(self) -> None:
        self.err[:4].zero_()
        self.host.zero_()


def timer() -> bool:
    """Whether the kernels read a real clock (on a GPU), or count spins (the Triton interpreter)."""
    from .nvlink_params import TIMER

    return TIMER


def timeout_ns(be) -> int:
    """The kernels' deadline: nanoseconds on a GPU, spins under the interpreter (the CPU emulations set
    ``timeout_s`` to spins / 1e9)."""
    return int(be.timeout_s * 1e9)


def wait_s(be) -> float:
    """The host's deadline in seconds (a simulated backend's ``timeout_s`` counts spins; its ``wait_s`` is
    seconds)."""
    return getattr(be, "wait_s", be.timeout_s)


# ---------------------------------------------------------------------------------------------- symmetric memory

_NVSHMEM_BYTES = [0]  # NVSHMEM bytes the live plans of this process hold (their heap is the process's)


class Symmetric:
    """One symmetric buffer of ``nbytes`` for a plan: ``local`` (``uint8[nbytes]``, this rank's), ``peers[r]``
    (rank ``r``'s, mapped here; ``None`` where the transport maps none), ``ptr_table`` (``int64[R]`` of the bases,
    on the device: the kernels' peer addresses). Collective: every rank makes it at the same point.

    nvlink: torch symmetric memory (CUDA), a fresh allocation. internode: NVSHMEM's heap, which was sized when the
    backend started (``_env.nvshmem_settings``: its own buffer plus 256 MiB of headroom); an allocation the heap
    cannot hold raises ``RuntimeError`` naming ``NVSHMEM_SYMMETRIC_SIZE`` before anything is allocated."""

    def __init__(self, be, nbytes: int, what: str, nvshmem: bool = False):
        import torch.distributed._symmetric_memory as symm_mem

        nbytes = max(16, (nbytes + 127) // 128 * 128)
        me, r_ = be.rank, be.num_ranks
        self.nvshmem_bytes = 0
        if nvshmem:  # (torch's symmetric memory already runs on NVSHMEM: the backend switched it when it started)
            self._check_heap(be, nbytes, what)
            self.nvshmem_bytes = nbytes
        # torch's rendezvous has no deadline: every rank passes a bounded barrier first
        deadline.barrier(be.group, me, f"{what}/before the symmetric-memory rendezvous", wait_s(be))
        with deadline.watch(me, f"{what}: the symmetric-memory allocation and rendezvous", wait_s(be)):
            self.local = symm_mem.empty(nbytes, dtype=torch.uint8, device=be.device)
            self.hdl = symm_mem.rendezvous(self.local, be.group.group_name)
        _NVSHMEM_BYTES[0] += self.nvshmem_bytes
        self.local.zero_()
        ptrs = [int(p) for p in self.hdl.buffer_ptrs]
        self.ptr_table = torch.tensor(ptrs, dtype=torch.int64, device=be.device)
        self.peers = [self.local if r == me else (self.hdl.get_buffer(r, (nbytes,), torch.uint8) if ptrs[r] else None)
                      for r in range(r_)]
        self.nbytes = nbytes
        if be.device.type == "cuda":
            torch.cuda.synchronize(be.device)
        deadline.barrier(be.group, me, f"{what}/symmetric memory ready", wait_s(be))

    @staticmethod
    def _check_heap(be, nbytes: int, what: str) -> None:
        settings = getattr(be, "nvshmem_settings", None)  # (absent in the CPU simulation: no heap)
        if not settings or "NVSHMEM_SYMMETRIC_SIZE" not in settings:
            return
        heap = int(settings["NVSHMEM_SYMMETRIC_SIZE"][0])
        used = be.symm.numel() + _NVSHMEM_BYTES[0]  # (this buffer's and the plans'; other live buffers' are not seen)
        if used + nbytes > heap:
            raise RuntimeError(f"{what}: NVSHMEM's symmetric heap ({heap} bytes, NVSHMEM_SYMMETRIC_SIZE) holds "
                               f"{used} bytes already and cannot take {nbytes} more; set NVSHMEM_SYMMETRIC_SIZE to "
                               f"at least {used + nbytes + (256 << 20)} before the first buffer is made")

    def release(self) -> None:
        _NVSHMEM_BYTES[0] -= self.nvshmem_bytes
        self.nvshmem_bytes = 0
        self.peers = []
        self.local = self.hdl = None


# ---------------------------------------------------------------------------------------------- reference helpers


def staged(group, device: torch.device) -> bool:
    """Whether the reference plans move CUDA tensors through the CPU: a group whose backend for CUDA tensors is
    gloo (ranks sharing a GPU join through gloo), whose point-to-point calls take CPU tensors only."""
    return device.type == "cuda" and deadline.backend_for(group, device) == "gloo"


def wait_device(group, device: torch.device) -> torch.device:
    """The device whose backend runs the reference's operations on tensors of ``device`` (for ``deadline.wait``)."""
    return torch.device("cpu") if staged(group, device) else device
