"""Pipeline send/recv (DeepEP V2, experimental): a tensor from a rank to one of its ring neighbours (``(r - 1) % R``
and ``(r + 1) % R``), up to ``num_max_inflight_tensors`` tensors in flight a direction under credit flow control,
received bit-exact into the tensor ``pp_recv`` is given. The plans behind ``ElasticBuffer.pp_set_config`` /
``pp_send`` / ``pp_recv`` (``elastic_extras.py``), built by ``Backend.pp_plan`` at each ``pp_set_config``.

A send returns once the tensor is copied out (the caller may reuse it after its stream reaches that point); a
receive fills its tensor in stream order. Both run on the caller's stream. The byte counts of a send and its
receive must agree: a mismatch raises ``ValueError`` (after which the plan is unusable: ``pp_set_config`` makes a
new one). Every tensor sent must be received before the next ``pp_set_config``.

- reference (any group, CPU included): each send is one ``torch.distributed`` send of a fixed-size message
  (a 32-byte header with the byte count, then the payload padded to ``num_max_tensor_bytes``), kept in a queue a
  destination; a send that finds ``num_max_inflight_tensors`` of them in flight first waits for the oldest (a
  deadline naming the peer). A receive is one receive of that size. 0 SMs of the caller's.
- nvlink: ``_pp_send_impl_kernel`` stores the tensor straight into the receiver's slot (SM stores over NVLink),
  ``_pp_recv_impl_kernel`` copies it out (``kernels/pp.py`` has the protocol). Each holds ``num_sms`` SMs while it
  runs (0: every SM of the device, as DeepEP; at most one a 8 KiB chunk).
- internode: the send copies into this rank's send staging and puts it with its data signal (one NVSHMEM
  put-with-signal: RDMA to another node); the credit comes back as an NVSHMEM signal. SMs as nvlink.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from . import deadline
from .extras import ErrorWord, Symmetric, staged, timeout_ns, timer, wait_device, wait_s

HEADER = 32
TAG = 0x5050  # the reference's point-to-point tag ("PP")
BLOCK = 2048  # words a chunk of the kernels' copies


def align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPConfig:
    """``num_max_tensor_bytes`` (aligned up to 32, as DeepEP) and ``num_max_inflight_tensors`` a direction, for
    rank ``rank`` of ``num_ranks`` (at least 2)."""

    num_ranks: int
    rank: int
    num_max_tensor_bytes: int
    num_max_inflight_tensors: int

    def __post_init__(self):
        if self.num_ranks < 2:
            raise ValueError(f"pipeline send/recv needs a group of at least 2 ranks, got {self.num_ranks}")

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.num_ranks

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.num_ranks

    @property
    def slot_bytes(self) -> int:
        return HEADER + align(self.num_max_tensor_bytes, 32)

    def lane(self, receiver: int, sender: int) -> int:
        """The receiver's lane for what ``sender`` sends: 0 from its previous rank, else 1 (at ``R = 2`` always 0).

        Example: ``R = 4``: ``lane(2, 1) == 0``, ``lane(2, 3) == 1``; ``R = 2``: ``lane(0, 1) == 0``."""
        return 0 if sender == (receiver - 1) % self.num_ranks else 1


class PPPlan:
    """The interface: ``send``, ``recv``, ``sms_held``, ``release``."""

    def __init__(self, be, cfg: PPConfig):
        self.be, self.cfg = be, cfg

    def send(self, t: torch.Tensor, dst: int, num_sms: int) -> None:
        raise NotImplementedError

    def recv(self, t: torch.Tensor, src: int, num_sms: int) -> None:
        raise NotImplementedError

    def sms_held(self, num_sms: int, nbytes: int) -> int:
        return 0

    def release(self) -> None:
        """Wait for what is still in flight (a deadline naming the peer), free what the plan holds."""


class ReferencePP(PPPlan):
    """``torch.distributed`` point-to-point (module docstring)."""

    def __init__(self, be, cfg):
        super().__init__(be, cfg)
        self.in_flight: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.cpu = staged(be.group, be.device)
        self.msg_bytes = cfg.slot_bytes

    def _message(self) -> torch.Tensor:
        return torch.empty(self.msg_bytes, dtype=torch.uint8, device="cpu" if self.cpu else self.be.device)

    def _wait(self, work, peer: int, phase: str) -> None:
        be = self.be
        deadline.wait(work, be.group, wait_device(be.group, be.device), be.rank, phase, wait_s(be), peer=peer)

    def send(self, t, dst, num_sms):
        q = self.in_flight[dst]
        while q and q[0][0].is_completed():
            self._wait(q.popleft()[0], dst, "pp_send/wait-for-free-slot")
        while len(q) >= self.cfg.num_max_inflight_tensors:
            self._wait(q.popleft()[0], dst, "pp_send/wait-for-free-slot")
        msg = self._message()
        n = t.numel() * t.element_size()
        msg[:8].view(torch.int64).fill_(n)
        if n:
            msg[HEADER:HEADER + n].copy_(t.reshape(-1).view(torch.uint8))
        q.append((self.be.group.send([msg], dst, TAG), msg))

    def recv(self, t, src, num_sms):
        msg = self._message()
        self._wait(self.be.group.recv([msg], src, TAG), src, "pp_recv/receive-data")
        got, n = int(msg[:8].view(torch.int64).item()), t.numel() * t.element_size()
        if got != n:
            raise ValueError(f"pp_recv: rank {src} sent a tensor of {got} bytes, this receive takes {n}")
        if n:
            t.reshape(-1).view(torch.uint8).copy_(msg[HEADER:HEADER + n])

    def release(self):
        from .errors import gave_up

        for dst, q in self.in_flight.items():
            while q and not gave_up(self.be.group):  # (after a deadline the ranks are out of step: drop them)
                self._wait(q.popleft()[0], dst, "pp_set_config/wait-for-sends-in-flight")
        self.in_flight.clear()


class _DevicePP(PPPlan):
    """What the nvlink and internode plans share: the symmetric buffer, counters, error word, launch shape."""

    nvshmem = False

    def __init__(self, be, cfg):
        super().__init__(be, cfg)
        n = 2 * cfg.num_max_inflight_tensors * cfg.slot_bytes
        self.send_off = 128 + n
        self.sym = Symmetric(be, 128 + n * (2 if self.nvshmem else 1), "pp_set_config", nvshmem=self.nvshmem)
        self.ctr = torch.zeros(4, dtype=torch.int32, device=be.device)  # sends on lanes 0, 1; receives on 0, 1
        tickets = torch.zeros(2, dtype=torch.int32, device=be.device)
        self.t_send, self.t_recv = tickets[0:1], tickets[1:2]
        self.err = ErrorWord(be)
        self.device_sms = (torch.cuda.get_device_properties(be.device).multi_processor_count
                           if be.device.type == "cuda" else 8)

    def sms_held(self, num_sms, nbytes):
        from ..kernels.pp import programs, word_type

        size, _ = word_type(nbytes, 0)
        return programs(num_sms, self.device_sms, nbytes // size, BLOCK)

    def _args(self, t: torch.Tensor, num_sms: int):
        from ..kernels.pp import programs, word_type

        n = t.numel() * t.element_size()
        size, ty = word_type(n, t.data_ptr())
        words = t.reshape(-1).view(torch.uint8).view({4: torch.int32, 2: torch.int16, 1: torch.int8}[size])
        return n, words, ty, (programs(num_sms, self.device_sms, n // size, BLOCK), 1, 1)

    def send(self, t, dst, num_sms):
        self.err.check()
        cfg = self.cfg
        n, words, ty, grid = self._args(t, num_sms)
        lane = cfg.lane(dst, cfg.rank)
        aligned = t.data_ptr() % 16 == 0  # (the slots are: 128 + k * slot_bytes + 32 from a 128-aligned base)
        self.k_send((ty, aligned, n >= 2**31), grid, words, words.numel(), n, *self._peer_args(dst, lane), self.ctr,
                    self.t_send, self.err.err, timeout_ns(self.be), ELEM=ty, BLOCK=BLOCK, HAS_TIMER=timer(),
                    ALIGNED=aligned, **self.extra)

    def recv(self, t, src, num_sms):
        self.err.check()
        cfg = self.cfg
        n, words, ty, grid = self._args(t, num_sms)
        lane = cfg.lane(cfg.rank, src)
        aligned = t.data_ptr() % 16 == 0
        self.k_recv((ty, aligned, n >= 2**31), grid, words, words.numel(), n, self.sym.ptr_table, cfg.rank, src, lane,
                    cfg.num_max_inflight_tensors, cfg.slot_bytes, self.ctr, self.t_recv, self.err.err,
                    timeout_ns(self.be), ELEM=ty, BLOCK=BLOCK, HAS_TIMER=timer(), ALIGNED=aligned, **self.extra)

    def release(self):
        self.sym.release()


class NVLinkPP(_DevicePP):
    """Slots in torch symmetric memory; SM stores into the receiver's slot (module docstring)."""

    def __init__(self, be, cfg):
        super().__init__(be, cfg)
        from ..kernels import pp as K
        from ..kernels.launch import Launcher

        self.k_send, self.k_recv = Launcher(K._pp_send_impl_kernel), Launcher(K._pp_recv_impl_kernel)
        self.extra = {}

    def _peer_args(self, dst, lane):
        cfg = self.cfg
        return self.sym.ptr_table, cfg.rank, dst, lane, cfg.num_max_inflight_tensors, cfg.slot_bytes


class InternodePP(_DevicePP):
    """Slots and send staging in NVSHMEM symmetric memory; put-with-signal, credits by NVSHMEM signals."""

    nvshmem = True

    def __init__(self, be, cfg):
        super().__init__(be, cfg)
        from ..kernels import pp as K
        from ..kernels.launch import Launcher
        from ..kernels.nvshmem import nvshmem_kernel

        self.k_send = Launcher(nvshmem_kernel(K._pp_send_impl_nvshmem_kernel, be.sim))
        self.k_recv = Launcher(nvshmem_kernel(K._pp_recv_impl_nvshmem_kernel, be.sim))
        self.extra = {"SIM": be.sim}

    def _peer_args(self, dst, lane):
        cfg = self.cfg
        return self.sym.ptr_table, cfg.rank, dst, lane, cfg.num_max_inflight_tensors, cfg.slot_bytes, self.send_off
