"""The AGRS all-gather session (DeepEP V2, experimental): inside a session, ``all_gather`` of one or more tensors
gives ``[R, ...]`` per tensor, gathered into the session's buffer (every rank's part at ``offset + nbytes * rank``)
and valid until the session ends; ``agrs_get_inplace_tensor`` hands out this rank's part of the next all-gather's
place, so a tensor written there is not copied again. The plans behind ``ElasticBuffer.agrs_set_config`` /
``create_agrs_session`` / ``destroy_agrs_session`` / ``all_gather`` (``elastic_extras.py``, which keeps the
session's offsets and slots), built by ``Backend.agrs_plan`` at each ``agrs_set_config``.

Every rank makes the same all-gathers in the same order (it is a collective). ``run`` returns the wait, which
makes the caller's stream wait for the data; ``end`` (at ``destroy_agrs_session``) tells the peers this rank is
done with the session's buffer and waits until every peer is, so that the next session's writes into it cannot
overtake a reader.

- reference (any group, CPU included): one ``torch.distributed`` all-gather a tensor, issued asynchronously into
  the session buffer (through the CPU where gloo serves CUDA tensors); the wait waits for it (a deadline).
- nvlink: the data moves by the copy engine (``copy_`` of this rank's part into every peer's buffer, on the
  buffer's communication stream: 0 SMs), then ``_agrs_handshake_kernel`` (one program, so one SM while it waits)
  raises this rank's signal for the slot at every peer and waits for theirs. The caller's stream waits for its
  event. The session end is the same handshake on the session signals.
- internode: this rank's part is copied into its own place of the session buffer (copy engine), then
  ``_agrs_put_nvshmem_kernel`` (one program a peer) puts it to every peer by NVSHMEM, fences and signals, and
  ``_agrs_wait_signals_kernel`` (one program) waits for every peer's signal. The session end: the same two kernels
  with no data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from . import deadline
from .extras import ErrorWord, Symmetric, staged, timeout_ns, timer, wait_device, wait_s

PHASE_GATHER = 14  # kernels.common.PHASES
PHASE_END = 15


@dataclasses.dataclass(frozen=True, kw_only=True)
class AGRSConfig:
    """``num_max_session_bytes`` (aligned up to 32, as DeepEP: the session's gathered bytes, each tensor's ``R *
    nbytes`` aligned up to 32) and ``num_max_all_gathers_per_session`` (at most 32), for rank ``rank`` of
    ``num_ranks``."""

    num_ranks: int
    rank: int
    num_max_session_bytes: int
    num_max_all_gathers_per_session: int


class AGRSPlan:
    """The interface: ``local`` (``uint8[num_max_session_bytes]``, this rank's session buffer), ``run``, ``end``,
    ``sms_held``, ``release``."""

    def __init__(self, be, cfg: AGRSConfig, comm=None):
        self.be, self.cfg, self.comm = be, cfg, comm
        self.uses = [0] * 32  # all-gathers so far in each slot
        self.ended = 0  # sessions ended

    def run(self, tensors: list[torch.Tensor], offsets: list[int], slot: int, inplace: list[bool]) -> Callable:
        """All-gather ``tensors[k]`` (contiguous) into ``local[offsets[k]:]`` as ``[R, nbytes]``; ``inplace[k]``:
        ``tensors[k]`` already is this rank's part there. Returns the wait."""
        raise NotImplementedError

    def end(self) -> None:
        raise NotImplementedError

    def sms_held(self) -> int:
        return 0

    def release(self) -> None:
        """Free what the plan holds."""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class ReferenceAGRS(AGRSPlan):
    """``torch.distributed`` all-gathers (module docstring)."""

    def __init__(self, be, cfg, comm=None):
        super().__init__(be, cfg, comm)
        self.local = torch.zeros(cfg.num_max_session_bytes, dtype=torch.uint8, device=be.device)
        self.cpu = staged(be.group, be.device)
        self.pending: list[Callable] = []

    def run(self, tensors, offsets, slot, inplace):
        be, r_ = self.be, self.cfg.num_ranks
        self.uses[slot] += 1
        issued = []
        for t, off, inpl in zip(tensors, offsets, inplace):
            n = t.numel() * t.element_size()
            if not n:
                continue
            region = self.local[off:off + r_ * n].view(r_, n)
            src = _bytes(t).clone()  # (the caller may write t again before the wait; in place, it is part of region)
            if self.cpu:
                src, outs = src.cpu(), [torch.empty(n, dtype=torch.uint8) for _ in range(r_)]
            else:
                outs = list(region.unbind(0))
            issued.append((deadline.issue_all_gather(be.group, outs, src, wait_s(be)), outs, region))
        done = []

        def wait():
            if done:
                return
            for work, outs, region in issued:
                deadline.wait(work, be.group, wait_device(be.group, be.device), be.rank, "all_gather/receive-data",
                              wait_s(be))
                if self.cpu:
                    region.copy_(torch.stack(outs))
            done.append(True)
        self.pending.append(wait)
        return wait

    def end(self):
        for wait in self.pending:
            wait()
        self.pending.clear()
        self.ended += 1

    def release(self):
        self.local = None


class _DeviceAGRS(AGRSPlan):
    """What the nvlink and internode plans share: the symmetric buffer (signals, then data), the error word."""

    nvshmem = False

    def __init__(self, be, cfg, comm=None):
        super().__init__(be, cfg, comm)
        from ..kernels import agrs as K

        r_ = cfg.num_ranks
        self.data_off = K.data_off(r_)
        self.sym = Symmetric(be, self.data_off + cfg.num_max_session_bytes, "agrs_set_config", nvshmem=self.nvshmem)
        self.local = self.sym.local[self.data_off:self.data_off + cfg.num_max_session_bytes]
        self.err = ErrorWord(be)
        self.slot_offs = [K.slot_off(j, r_) for j in range(K.MAX_SLOTS)]
        self.session_off = K.session_off(r_)

    def _on_comm(self, fn, inputs: list[torch.Tensor]):
        """``fn()`` on the communication stream after the caller's (in order where there is none); returns the
        wait: the caller's stream waits for what ``fn`` queued."""
        comm = self.comm
        if comm is None:
            fn()
            return self.err.check
        cur = torch.cuda.current_stream(self.be.device)
        comm.wait_stream(cur)
        for t in inputs:
            t.record_stream(comm)
        with torch.cuda.stream(comm):
            fn()
            ev = torch.cuda.Event()
            ev.record(comm)

        def wait():
            torch.cuda.current_stream(self.be.device).wait_event(ev)
            self.err.check()
        return wait

    def end(self):
        self.err.check()
        self.ended += 1
        self._on_comm(lambda: self._handshake(self.session_off, self.ended, PHASE_END, [], []), [])

    def release(self):
        self.local = None
        self.sym.release()


class NVLinkAGRS(_DeviceAGRS):
    """Copy engine into the peers' buffers, then a one-program handshake (module docstring)."""

    def __init__(self, be, cfg, comm=None):
        super().__init__(be, cfg, comm)
        from ..kernels import agrs as K
        from ..kernels.launch import Launcher

        self.k = Launcher(K._agrs_handshake_kernel)

    def sms_held(self):
        return 1

    def run(self, tensors, offsets, slot, inplace):
        self.err.check()
        r_, me, d = self.cfg.num_ranks, self.cfg.rank, self.data_off
        self.uses[slot] += 1
        target = self.uses[slot]

        def go():
            for i in range(r_):
                r = (me + i) % r_
                for t, off, inpl in zip(tensors, offsets, inplace):
                    n = t.numel() * t.element_size()
                    if n and not (inpl and r == me):
                        at = d + off + n * me
                        self.sym.peers[r][at:at + n].copy_(_bytes(t))
            self._handshake(self.slot_offs[slot], target, PHASE_GATHER, [], [])
        return self._on_comm(go, tensors)

    def _handshake(self, sig_off, target, phase, _offs, _sizes):
        be = self.be
        self.k(None, (1, 1, 1), self.sym.ptr_table, be.rank, be.num_ranks, sig_off, target, self.err.err, phase,
               timeout_ns(be), HAS_TIMER=timer())


class InternodeAGRS(_DeviceAGRS):
    """Own part copied into the session buffer, then NVSHMEM puts with signals, one program a peer."""

    nvshmem = True

    def __init__(self, be, cfg, comm=None):
        super().__init__(be, cfg, comm)
        from ..kernels import agrs as K
        from ..kernels.launch import Launcher
        from ..kernels.nvshmem import nvshmem_kernel

        self.k_put = Launcher(nvshmem_kernel(K._agrs_put_nvshmem_kernel, be.sim))
        # a plain kernel: it polls its own signal words, no NVSHMEM call (nvshmem_kernel refuses it)
        self.k_wait = Launcher(K._agrs_wait_signals_kernel)
        self.none = torch.zeros(1, dtype=torch.int64, device=be.device)

    def sms_held(self):
        return self.cfg.num_ranks - 1

    def run(self, tensors, offsets, slot, inplace):
        self.err.check()
        me = self.cfg.rank
        self.uses[slot] += 1
        target = self.uses[slot]
        sizes = [t.numel() * t.element_size() for t in tensors]
        offs = [self.data_off + off for off in offsets]

        def go():
            for t, off, n, inpl in zip(tensors, offsets, sizes, inplace):
                if n and not inpl:
                    self.local[off + n * me:off + n * me + n].copy_(_bytes(t))
            self._handshake(self.slot_offs[slot], target, PHASE_GATHER, offs, sizes)
        return self._on_comm(go, tensors)

    def _handshake(self, sig_off, target, phase, offs, sizes):
        be = self.be
        if offs:
            o = torch.tensor(offs, dtype=torch.int64, device=be.device)
            s = torch.tensor(sizes, dtype=torch.int64, device=be.device)
        else:
            o = s = self.none
        self.k_put(None, (be.num_ranks - 1, 1, 1), self.sym.ptr_table, be.rank, be.num_ranks, o, s, len(offs), sig_off,
                   SIM=be.sim)
        self.k_wait(None, (1, 1, 1), self.sym.ptr_table, be.rank, be.num_ranks, sig_off, target, self.err.err, phase,
                    timeout_ns(be), HAS_TIMER=timer())
