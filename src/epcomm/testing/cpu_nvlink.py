"""The nvlink backend on CPU processes: its host code and its Triton kernels (under the interpreter)
with every rank in its own process, so tier 2 checks it against the reference without a GPU.

How: each rank's symmetric buffer is a shared-memory file that *every* rank maps at the same fixed
virtual address, so the peer pointers the kernels compute are valid in every process, as with CUDA
symmetric memory; the kernels run under ``TRITON_INTERPRET=1`` (set before Triton loads: call
:func:`install` first in a fresh process); CUDA streams, events and pinned memory are stand-ins (the
interpreter finishes a launch before the next starts, so stream order holds trivially); waits count
spins instead of nanoseconds (``backends.nvlink_params.TIMER``).

What it checks: the host code (layouts, offsets, flag levels across calls, host arithmetic) and the
kernels' logic with real peers running concurrently. What it cannot: GPU memory ordering, the copy
engine, CUDA graphs, timing. One numeric difference: Triton 3.6's interpreter converts float32 to
bf16 by truncation (the GPU rounds to nearest), so a bf16 result may be one more ulp away: combine
checks here allow one extra rounding of the output (``extra_rel=2**-8``), as the GPU checks do.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys
import types
import zlib

import torch
import torch.distributed as dist

_BASE = 0x5E0000000000  # well above a typical Python heap, below the usual mmap area
_ALIGN = 1 << 21
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_MAP_FIXED_NOREPLACE = 0x100000


class _SharedSymm:
    """``torch.distributed._symmetric_memory`` for CPU ranks: allocation ``k`` of ``n`` bytes puts
    rank ``r``'s buffer at ``base_k + r * align(n)`` in every process (files under /dev/shm)."""

    def __init__(self, tag: str, rank: int, world: int, group):
        self.tag, self.rank, self.world, self.group = tag, rank, world, group
        self.next = _BASE + (zlib.crc32(tag.encode()) % 64) * (1 << 36)  # the same in every process
        self.pending: dict[int, tuple[int, int]] = {}  # id(tensor) -> (base, stride)
        self.keep: list = []

    def _path(self, base: int, r: int) -> str:
        return f"/dev/shm/epcomm-{self.tag}-{base:x}-{r}"

    def _map(self, path: str, addr: int, n: int, create: bool) -> torch.Tensor:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, n)
            got = _libc.mmap(addr, n, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED_NOREPLACE, fd, 0)
            if got != addr:
                raise OSError(ctypes.get_errno(), f"could not map {path} at {addr:#x} (got {got})")
        finally:
            os.close(fd)
        arr = (ctypes.c_uint8 * n).from_address(addr)
        self.keep.append(arr)
        return torch.frombuffer(arr, dtype=torch.uint8)

    def empty(self, n, dtype=torch.uint8, device=None):
        stride = (n + _ALIGN - 1) // _ALIGN * _ALIGN
        base = self.next
        self.next += self.world * stride
        t = self._map(self._path(base, self.rank), base + self.rank * stride, n, create=True)
        t = t.view(dtype) if dtype != torch.uint8 else t
        self.pending[t.data_ptr()] = (base, stride)
        return t

    def rendezvous(self, t, group_name):
        base, stride = self.pending.pop(t.data_ptr())
        n = t.numel() * t.element_size()
        dist.barrier(group=self.group)  # every rank's file exists
        bufs = []
        for r in range(self.world):
            bufs.append(t.view(torch.uint8) if r == self.rank
                        else self._map(self._path(base, r), base + r * stride, n, create=False))
        dist.barrier(group=self.group)
        for r in range(self.world):  # mapped everywhere: the names can go
            if r == self.rank:
                os.unlink(self._path(base, r))
        return types.SimpleNamespace(buffer_ptrs=[b.data_ptr() for b in bufs],
                                     get_buffer=lambda r, shape, dtype: bufs[r].view(dtype).view(shape))


class Stream:
    """``torch.cuda.Stream`` stand-in: on a CPU every call is done when it returns."""

    cuda_stream = 0

    def wait_stream(self, other):
        pass

    def wait_event(self, ev):
        pass

    def synchronize(self):
        pass


class Event:
    """``torch.cuda.Event`` stand-in."""

    def __init__(self, *a, **k):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True


def cuda_stand_ins(set_attr=setattr, capturing=lambda: False, sms: int = 8) -> None:
    """Replace the ``torch.cuda`` calls the nvlink backend makes (streams, events, synchronisation,
    capture state, SM count) and ``Tensor.record_stream`` / ``pin_memory`` by CPU stand-ins, through
    ``set_attr`` (``setattr``, or pytest's ``monkeypatch.setattr`` to undo them)."""
    c = torch.cuda
    set_attr(c, "Stream", lambda *a, **k: Stream())
    set_attr(c, "current_stream", lambda *a, **k: Stream())
    set_attr(c, "stream", lambda s: contextlib.nullcontext())
    set_attr(c, "set_stream", lambda s: None)
    set_attr(c, "Event", Event)
    set_attr(c, "synchronize", lambda *a, **k: None)
    set_attr(c, "is_current_stream_capturing", capturing)
    set_attr(c, "get_device_properties", lambda *a: types.SimpleNamespace(multi_processor_count=sms))
    set_attr(torch.Tensor, "record_stream", lambda self, s: None)
    set_attr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)


def install(tag: str, rank: int, world: int, group) -> None:
    """In this (fresh, disposable) process: the interpreter, the stand-ins and the shared symmetric
    memory. Call before anything imports Triton."""
    os.environ["TRITON_INTERPRET"] = "1"
    from . import interp  # noqa: F401  (the interpreter's NumPy 2 fix)

    symm = _SharedSymm(tag, rank, world, group)
    mod = types.ModuleType("torch.distributed._symmetric_memory")
    mod.empty, mod.rendezvous = symm.empty, symm.rendezvous
    sys.modules["torch.distributed._symmetric_memory"] = mod
    torch.distributed._symmetric_memory = mod
    cuda_stand_ins()


def nvlink_buffer(group, spins: float = 2e5, **kw):
    """A ``Buffer`` on ``group`` (gloo) whose backend is the nvlink backend (kernels interpreted);
    a wait gives up after ``spins`` polls (the deadline error then names the phase and the peer)."""
    from .. import Buffer
    from ..backends.nvlink import NVLinkBackend

    buf = Buffer(group, **kw)
    buf._backend.destroy()
    buf._backend = NVLinkBackend(buf)
    buf._backend.timeout_s = spins / 1e9  # the interpreter's waits count spins (timeout_ns of them)
    buf._host_checks = False
    from ..buffer import _key_functions

    buf._sigs, buf._rsigs = _key_functions(buf.device)  # (as Buffer derives them for its device)
    return buf
