"""Engram (DeepEP V2, experimental): every rank's storage ``[N, H]`` readable by any rank, fetched by global
entry index. The plans behind ``ElasticBuffer.engram_write`` / ``engram_fetch`` (``elastic_extras.py``), one per
backend, built by ``Backend.engram_plan`` once per storage shape.

Letters: ``R`` ranks, ``N`` entries a rank, ``H`` hidden, ``T`` tokens, ``PE`` entries a token, ``PK`` scale packs
an entry. Global entry ``i`` is rank ``i // N``'s row ``i % N``. A fetch of ``indices int32[T, PE]`` gives
``data [T, PE * H]`` (a token's entries side by side, as DeepEP returns them) and, with FP8 storage, ``sf
[T, PE * PK]`` gathered from the replicated ``sf [R * N, PK]`` given to ``write`` (row-major, or with
``tma`` DeepEP's TMA-aligned column-major: strides ``(1, align(T, 4))``).

Where the rows live and who moves them:

- reference (any group, CPU included): ``write`` all-gathers every rank's storage into a replicated table
  (``R * N`` rows on every rank: R times the memory, no one-sided read exists in ``torch.distributed``), so a
  fetch is a local ``index_select`` and needs nothing from the peers. 0 SMs of communication.
- nvlink: the storage sits at the start of this rank's symmetric buffer (torch symmetric memory, sized by
  ``num_cpu_bytes``); ``_engram_fetch_impl_kernel`` loads each row from its owner over NVLink and stores it
  into the output (SM loads: the copy engine is no match for rows of a few hundred bytes scattered by index).
  It runs on the buffer's communication stream, so the caller's stream goes on until the hook; it holds
  ``num_qps`` programs (0: ``num_allocated_qps``; DeepEP: one QP, one SM) while it runs, at most one a row step.
  The output is the caller's own tensor.
- internode: storage and receive area in one NVSHMEM symmetric buffer (``num_cpu_bytes``, then ``num_bytes -
  num_cpu_bytes``); ``_engram_fetch_impl_nvshmem_kernel`` issues one NVSHMEM get a row (RDMA for another node,
  NVLink in the node) into the receive area, ``num_qps`` programs. The output is that area (DeepEP's
  contract: valid until the next fetch).

Index range: the reference checks it on the host before anything is read; the kernels check it on the device
(the row is not fetched; ``ValueError`` from the hook, or from the next Engram call where the kernel had not
finished when the hook ran).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from . import deadline
from .extras import ErrorWord, Symmetric, staged, wait_device, wait_s


def align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngramConfig:
    """One storage shape, the same on every rank: ``num_entries`` (``N``) rows of ``hidden`` (``H``) elements of
    ``dtype`` (BF16 or FP8 e4m3), ``num_sf_packs`` (``PK``, 0 without scales) 4-byte scale packs an entry;
    ``storage_bytes`` (``num_cpu_bytes``) and ``recv_bytes`` (``num_bytes - num_cpu_bytes``): the capacities."""

    num_ranks: int
    num_entries: int
    hidden: int
    dtype: torch.dtype
    num_sf_packs: int
    storage_bytes: int
    recv_bytes: int
    num_allocated_qps: int

    def __post_init__(self):
        if self.num_entries < 1 or self.hidden < 1:
            raise ValueError(f"Engram storage must be [N >= 1, H >= 1], got [{self.num_entries}, {self.hidden}]")
        if self.num_entries * self.row_bytes > self.storage_bytes:
            raise ValueError(f"Engram storage of {self.num_entries * self.row_bytes} bytes exceeds num_cpu_bytes="
                             f"{self.storage_bytes}")

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.dtype.itemsize

    @property
    def total(self) -> int:
        """``R * N``: the number of global entries."""
        return self.num_ranks * self.num_entries


def gather_scales(sf: torch.Tensor, indices: torch.Tensor, tma: bool) -> torch.Tensor:
    """``sf [R*N, PK]`` at ``indices [T, PE]`` as ``[T, PE * PK]``: row-major, or with ``tma`` at strides
    ``(1, align(T, 4))`` (DeepEP's TMA-aligned column-major). The reference's (and the oracle's) scales."""
    t, pe = indices.shape
    pk = sf.shape[1]
    rows = sf.index_select(0, indices.reshape(-1).long()).view(t, pe * pk)
    if not tma:
        return rows
    out = torch.empty_strided((t, pe * pk), (1, align(max(t, 1), 4)), dtype=sf.dtype, device=sf.device)
    out.copy_(rows)
    return out


def empty_scales(sf: torch.Tensor, t: int, cols: int, tma: bool) -> torch.Tensor:
    """An output for :func:`gather_scales`'s result, laid out as it lays it out."""
    if tma:
        return torch.empty_strided((t, cols), (1, align(max(t, 1), 4)), dtype=sf.dtype, device=sf.device)
    return torch.empty(t, cols, dtype=sf.dtype, device=sf.device)


class EngramPlan:
    """The interface: ``write`` (collective; the front end meets the ranks before and after), ``run`` (one-sided;
    returns the hook), ``sms_held``."""

    checks_on_device = False  # whether run() checks the index range itself (else the front end does, on the host)

    def __init__(self, be, cfg: EngramConfig, comm=None):
        self.be, self.cfg, self.comm = be, cfg, comm
        self.sf: torch.Tensor | None = None

    def write(self, storage: torch.Tensor, sf: torch.Tensor | None) -> None:
        raise NotImplementedError

    def run(self, indices: torch.Tensor, num_qps: int, tma: bool) -> Callable:
        raise NotImplementedError

    def sms_held(self, num_qps: int) -> int:
        """SMs a fetch holds while it runs (0: none of the caller's)."""
        return 0

    def release(self) -> None:
        """Free what the plan holds (its symmetric memory)."""


class ReferenceEngram(EngramPlan):
    """``torch.distributed`` only (gloo on CPU, NCCL on GPUs): the storage replicated by one all-gather."""

    def write(self, storage, sf):
        be, cfg = self.be, self.cfg
        src = storage.reshape(cfg.num_entries, -1).view(torch.uint8)
        if staged(be.group, src.device):
            src = src.cpu()
        out = [torch.empty_like(src) for _ in range(be.num_ranks)]
        work = deadline.issue_all_gather(be.group, out, src, wait_s(be))
        deadline.wait(work, be.group, wait_device(be.group, be.device), be.rank, "engram_write/all-gather", wait_s(be))
        self.table = torch.cat(out).to(be.device).view(cfg.dtype).view(cfg.total, cfg.hidden)
        self.sf = sf

    def run(self, indices, num_qps, tma):
        t, pe = indices.shape
        data = self.table.index_select(0, indices.reshape(-1).long()).view(t, pe * self.cfg.hidden)
        scales = None if self.sf is None else gather_scales(self.sf, indices, tma)
        return lambda: (data, scales)

    def release(self):
        self.table = None


class _DeviceEngram(EngramPlan):
    """What the nvlink and internode plans share: the symmetric buffer, the error word, the launch shape."""

    checks_on_device = True
    nvshmem = False

    def __init__(self, be, cfg, comm=None):
        super().__init__(be, cfg, comm)
        self.recv_off = align(cfg.storage_bytes, 128)
        self.sym = Symmetric(be, self.recv_off + (cfg.recv_bytes if self.nvshmem else 0), "engram_write",
                             nvshmem=self.nvshmem)
        self.err = ErrorWord(be)
        self._dummy = torch.zeros(1, dtype=torch.int32, device=be.device)  # the scale pointers without FP8

    def write(self, storage, sf):
        self.err.check()
        flat = storage.reshape(-1).view(torch.uint8)
        self.sym.local[:flat.numel()].copy_(flat)
        self.sf = sf

    def programs(self, num_qps: int, rows: int) -> int:
        return max(1, min(num_qps or self.cfg.num_allocated_qps, rows))

    def sms_held(self, num_qps):
        return num_qps or self.cfg.num_allocated_qps

    def run(self, indices, num_qps, tma):
        self.err.check()
        cfg = self.cfg
        t, pe = indices.shape
        rows = t * pe
        idx = indices.contiguous()
        data = self._output(t, pe)
        scales, sf_ts, sf_hs = None, 0, 0
        if self.sf is not None:
            scales = empty_scales(self.sf, t, pe * cfg.num_sf_packs, tma)
            sf_ts, sf_hs = scales.stride()
        comm = self.comm if rows else None
        if comm is not None:
            cur = torch.cuda.current_stream(self.be.device)
            comm.wait_stream(cur)
            for x in (idx, data, scales):
                if x is not None:
                    x.record_stream(comm)
            with torch.cuda.stream(comm):
                self._launch(idx, data, scales, rows, sf_ts, sf_hs, self.programs(num_qps, rows))
                ev = torch.cuda.Event()
                ev.record(comm)
        elif rows:
            self._launch(idx, data, scales, rows, sf_ts, sf_hs, self.programs(num_qps, rows))

        def hook():
            if comm is not None:
                torch.cuda.current_stream(self.be.device).wait_event(ev)
            self.err.check()
            return data, scales
        return hook

    def release(self):
        self.sym.release()


class NVLinkEngram(_DeviceEngram):
    """Storage in torch symmetric memory; SM loads of each row from its owner (module docstring)."""

    def __init__(self, be, cfg, comm=None):
        super().__init__(be, cfg, comm)
        from ..kernels import engram as K
        from ..kernels.launch import Launcher

        self.words, self.elem = K.row_words(cfg.row_bytes)
        self.w_pow2, self.rb = K.block_shape(self.words)
        self.k = Launcher(K._engram_fetch_impl_kernel)

    def _output(self, t, pe):
        return torch.empty(t, pe * self.cfg.hidden, dtype=self.cfg.dtype, device=self.be.device)

    def _launch(self, idx, data, scales, rows, sf_ts, sf_hs, progs):
        import triton

        cfg, pk = self.cfg, self.cfg.num_sf_packs
        has_sf = scales is not None
        steps = -(-rows // self.rb)
        key = (has_sf, idx.data_ptr() % 16 == 0, has_sf and self.sf.data_ptr() % 16 == 0)
        self.k(key, (min(progs, steps), 1, 1), idx, self.sym.ptr_table,
               data.view(torch.uint8).view(self.elem_dtype()), rows, cfg.num_entries, cfg.total, self.err.err,
               self.sf if has_sf else self._dummy, scales if has_sf else self._dummy, sf_ts, sf_hs,
               ROW_WORDS=self.words, W_POW2=self.w_pow2, RB=self.rb, ELEM=self.elem, PE=idx.shape[1], PK=pk,
               PK_POW2=triton.next_power_of_2(max(pk, 1)), HAS_SF=has_sf, ALIGNED=cfg.row_bytes % 16 == 0)

    def elem_dtype(self) -> torch.dtype:
        return {4: torch.int32, 2: torch.int16, 1: torch.int8}[self.cfg.row_bytes // self.words]


class InternodeEngram(_DeviceEngram):
    """Storage and receive area in NVSHMEM symmetric memory; one NVSHMEM get a row (module docstring)."""

    nvshmem = True

    def __init__(self, be, cfg, comm=None):
        super().__init__(be, cfg, comm)
        from ..kernels import engram as K
        from ..kernels.launch import Launcher
        from ..kernels.nvshmem import nvshmem_kernel

        self.sim = be.sim
        self.k = Launcher(nvshmem_kernel(K._engram_fetch_impl_nvshmem_kernel, be.sim))

    def _output(self, t, pe):
        n = t * pe * self.cfg.row_bytes
        area = self.sym.local[self.recv_off:self.recv_off + n]
        return area.view(self.cfg.dtype).view(t, pe * self.cfg.hidden)

    def _launch(self, idx, data, scales, rows, sf_ts, sf_hs, progs):
        import triton

        cfg, pk = self.cfg, self.cfg.num_sf_packs
        has_sf = scales is not None
        key = (has_sf, idx.data_ptr() % 16 == 0, has_sf and self.sf.data_ptr() % 16 == 0)
        self.k(key, (progs, 1, 1), idx, self.sym.ptr_table, self.be.rank,
               self.recv_off, rows, cfg.num_entries, cfg.total, self.err.err,
               self.sf if has_sf else self._dummy, scales if has_sf else self._dummy, sf_ts, sf_hs,
               ROW_BYTES=cfg.row_bytes, PE=idx.shape[1], PK=pk, PK_POW2=triton.next_power_of_2(max(pk, 1)),
               HAS_SF=has_sf, SIM=self.sim)


__all__ = ["EngramConfig", "EngramPlan", "InternodeEngram", "NVLinkEngram", "ReferenceEngram", "gather_scales"]
