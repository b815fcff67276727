"""The nvlink backend: one node, Triton kernels over torch symmetric memory (CUDA backend).

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``,
``C`` channels, ``N`` received rows, ``M`` low-latency max tokens per rank.

Symmetric buffer (one allocation per Buffer, made once at construction)::

    [flags int32[16*R]][meta: 2 parities x R sources x (R + L_MAX + C_MAX + T_LIST_CAP) int32]
    [high-throughput region: num_nvl_bytes = dispatch staging (R slots) | combine staging (R slots)]
    [low-latency region: num_rdma_bytes, laid out by layout.low_latency_buffer_layout]

High-throughput dispatch (``ht_dispatch.py``): one kernel exchanges counts and send lists through the
peers' meta areas and builds the handle (``_dispatch_notify_kernel``); the host reads the counts, which
that kernel wrote into pinned host words (the contract's one synchronisation; none with
``num_worst_tokens``); ``gather`` builds ``recv_x`` in (source rank, token) order from local x and the
staging slots, and by default (``EPCOMM_HT_TRANSFER=sm``) pushes this rank's batch into slot ``me`` of
every peer's dispatch staging itself, while it copies its own block (``_fused_push``; cached dispatches
too). With ``EPCOMM_HT_TRANSFER=ce`` eager calls move the batch by the copy engine instead (zero SMs;
one-program kernels raise the peers' data flags). Combine (``ht_combine.py``): each rank's block of rows
received from owner ``i`` goes into slot ``me`` of ``i``'s combine staging and ``reduce`` sums rank by
rank in float32, both in one kernel (``_combine_kernel``), or by the copy engine then ``_reduce_kernel``
(``ce``, block bounds known on the host, not captured). Flow control: a sender waits until every
receiver consumed the previous contents of its slot. Each kind of call is planned once (launches bound,
arguments resolved); ``get_dispatch_layout`` is one kernel too (``dispatch_layout``). Launch
parameters and host arithmetic: ``nvlink_params.py``.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
import weakref
import zlib

import torch

from .. import _env
from ..kernels.launch import Ptr
from . import deadline, nvlink_v2
from .base import Backend, checked_run, gave_up, raise_error_word
from .ht_combine import HTCombine
from .ht_dispatch import HTDispatch
from .nvlink_params import (
    C_MAX,
    CRECV,
    CSEND,
    DEFAULT_NVL_BYTES,
    DRECV,
    DSEND,
    L_MAX,
    NUM_CTRS,
    T_CPUSH,
    T_DPUSH,
    T_GATHER,
    T_LIST_CAP,
    T_REDUCE,
    _align,
    apply_tune,
)
from .nvlink_transfer import NVLinkTransfer

log = logging.getLogger(__name__)



_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def availability(buf) -> tuple[bool, str]:
    """Whether this Buffer's ranks can use the nvlink backend, and why (collective: all ranks call)."""
    try:
        import numpy  # noqa: F401  (the host path reads pinned words through NumPy views)
        import torch.distributed._symmetric_memory
        import triton  # noqa: F401
    except ImportError as e:
        return False, f"needs triton, numpy and torch symmetric memory ({e}); pip install triton numpy"
    if torch.cuda.get_device_capability(buf.device)[0] < 8:
        return False, "needs an SM80+ GPU"
    rows = deadline.all_gather_ints(buf.group, [zlib.crc32(socket.gethostname().encode()), buf.device.index],
                                    buf.rank, "Buffer/nvlink availability", buf.timeout_s)
    if len({r[0] for r in rows}) != 1:
        return False, "ranks span several hosts"
    devs = [r[1] for r in rows]
    for d in devs:
        if d != buf.device.index and not torch.cuda.can_device_access_peer(buf.device.index, d):
            return False, f"GPU {buf.device.index} has no peer access to GPU {d}"
    return True, f"all {buf.group_size} ranks on one host with peer access"


class NVLinkBackend(HTDispatch, HTCombine, NVLinkTransfer, Backend):
    name = "nvlink"
    checks_topk_on_device = True

    @classmethod
    def create(cls, buf) -> NVLinkBackend:
        return cls(buf)

    def __init__(self, buf):
        import torch.distributed._symmetric_memory as symm_mem

        super().__init__(buf.group, buf.rank, buf.group_size, buf.device, buf.timeout_s)
        self.wait_s = buf.timeout_s  # the host's waits (barriers), in seconds even where timeout_s counts spins
        self._buf = weakref.ref(buf)
        r_ = self.num_ranks
        self.nvl_bytes = _align(buf.num_nvl_bytes or DEFAULT_NVL_BYTES)
        self.rdma_bytes = _align(buf.num_rdma_bytes)
        self.flags_off = 0
        self.meta_src_bytes = _align((r_ + L_MAX + C_MAX + 1) * 4, 16)
        self.list_src_bytes = _align(T_LIST_CAP * 4, 16)
        self.meta_off = _align(NUM_CTRS * r_ * 4)
        self.meta_parity_bytes = r_ * self.meta_src_bytes
        self.list_off = _align(self.meta_off + 2 * self.meta_parity_bytes)
        self.list_parity_bytes = r_ * self.list_src_bytes
        self.ht_off = _align(self.list_off + 2 * self.list_parity_bytes)
        self.ll_off = _align(self.ht_off + self.nvl_bytes)
        total = _align(self.ll_off + self.rdma_bytes)
        self.symm = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
        self.symm.zero_()
        # torch's rendezvous has no deadline: every rank passes a bounded barrier first (deadline.watch logs
        # a rendezvous that still outlasts the deadline)
        self.barrier("Buffer/before the symmetric-memory rendezvous")
        with deadline.watch(self.rank, "the symmetric-memory rendezvous", self.wait_s):
            self.hdl = symm_mem.rendezvous(self.symm, self.group.group_name)
        self.ptr_table = torch.tensor(list(self.hdl.buffer_ptrs), dtype=torch.int64, device=self.device)
        self.peers = [self.hdl.get_buffer(r, (total,), torch.uint8) if r != self.rank else self.symm
                      for r in range(r_)]
        self.nvl_buffer = self.symm[self.ht_off:self.ht_off + buf.num_nvl_bytes]
        self.rdma_buffer = self.symm[self.ll_off:self.ll_off + buf.num_rdma_bytes]
        self.ctrs = torch.zeros(NUM_CTRS, dtype=torch.int32, device=self.device)
        self.nctr = torch.zeros(r_, dtype=torch.int32, device=self.device)
        self.tickets = torch.zeros(8, dtype=torch.int32, device=self.device)
        # error word [code, peer, observed, target, host-mirror address (int64)]; kernels that record an
        # error also write the pinned (device-mapped) mirror, so no call needs a copy to learn of it
        self.err_host = torch.zeros(4, dtype=torch.int32, device="cpu").pin_memory()
        self._err_view = self.err_host.numpy()
        # the notify output, then the error word (16-byte aligned, for its int64 mirror address)
        n_notify = r_ * r_ + r_ * L_MAX + r_ * C_MAX + r_
        self.err_at = _align(n_notify, 4)
        words = torch.zeros(self.err_at + 8, dtype=torch.int32, device=self.device)
        self.notify_out, self.err = words[:n_notify], words[self.err_at:self.err_at + 6]
        self.err[4:].view(torch.int64).fill_(self.err_host.data_ptr())
        self.src_lists = torch.empty(r_, T_LIST_CAP, dtype=torch.int32, device=self.device)
        # the counts the synchronising dispatch reads (counts[R][R], then per_expert[R][L]) and the done word
        # after them: the exchange kernel writes them here, pinned and device-mapped, through the addresses in
        # host_counts_addr (of the counts, of the done word)
        n_host = r_ * r_ + r_ * L_MAX
        self.notify_host = torch.zeros(n_host + 1, dtype=torch.int32, device="cpu").pin_memory()
        self._notify_view = self.notify_host.numpy()
        self._done_view = self._notify_view[n_host:]
        at = self.notify_host.data_ptr()
        self.host_counts_addr = torch.tensor([at, at + 4 * n_host], dtype=torch.int64, device=self.device)
        self._stream_cache: dict = {}  # raw CUDA stream -> its torch Stream (_current_stream)
        self._layouts: dict = {}  # (row bytes, G, K, H) -> _ht_layout's offsets
        self._plans: dict = {}  # kind of high-throughput call -> its run (ht_dispatch.py, ht_combine.py)
        # device memory a plan owns that a captured CUDA graph may still use after the plans are cleared
        # (the layout kernel's scratch): kept for the backend's life
        self._pinned: list = []
        self._scratches: dict = {}  # ht_dispatch._scratch: a dispatch's outputs that ElasticBuffer reads once
        self.ce_stream = torch.cuda.Stream(self.device)
        self._views: dict = {}  # see _view
        self.sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.transfer = _env.ht_transfer()  # "sm" (default) or "ce" (copy engine eagerly)
        from . import nvlink_ll

        over = {k: v for k, v in _env.tune().items() if not k.startswith(("iht.", "ill."))}  # (internode's)
        apply_tune({k: v for k, v in over.items() if not k.startswith("ll.")})
        apply_tune({k[3:]: v for k, v in over.items() if k.startswith("ll.")}, nvlink_ll.TUNE, "ll.")
        deadline.prepare_native(self.group, self.rank, self.device, True, self.wait_s)
        self._bind_kernels()
        self._ll = None
        self.barrier("Buffer/barrier")

    # ------------------------------------------------------------------ helpers

    def _bind_kernels(self) -> None:
        """The kernels' launchers and the persistent buffers as addresses (kernels/launch.py): made once,
        so a call makes no slice or view of them."""
        from ..kernels import ht_layout, ht_notify, ht_receive, ht_transfer
        from ..kernels.launch import Launcher

        self.k = {name: Launcher(getattr(mod, name)) for mod, names in (
            (ht_transfer, ("_ce_wait_kernel", "_ce_signal_kernel")),
            (ht_receive, ("_dispatch_impl_kernel", "_reduce_kernel", "_combine_kernel")),
            (ht_notify, ("_dispatch_notify_kernel",)), (ht_layout, ("_layout_kernel",))) for name in names}
        self.p_table, self.p_err, self.p_nctr = Ptr(self.ptr_table), Ptr(self.err), Ptr(self.nctr)
        self.p_host_counts = Ptr(self.host_counts_addr)
        self.p_ctr = {i: Ptr(self.ctrs[i:]) for i in (DSEND, DRECV, CSEND, CRECV)}
        self.p_tk = {i: Ptr(self.tickets[i:]) for i in (T_GATHER, T_REDUCE, T_DPUSH, T_CPUSH)}
        self.p_src_lists = Ptr(self.src_lists)

    _call_sms = None  # Config.num_sms of the high-throughput call in progress (set by each call)

    @property
    def num_sms(self) -> int:
        """SMs (programs) a high-throughput call may use: its ``Config.num_sms`` (a caller's tuned
        ``Config`` is honoured, as DeepEP's tuning loop passes one), else ``Buffer.num_sms``."""
        if self._call_sms:
            return self._call_sms
        buf = self._buf()
        return buf.num_sms if buf is not None else 20

    def _current_stream(self) -> torch.cuda.Stream:
        """``torch.cuda.current_stream()``, cached by the raw stream (torch's lookup of the current device
        and the Stream object it builds cost tens of microseconds of host time per call)."""
        if _raw_stream is None:  # a CPU build of torch (the tests' stand-ins)
            return torch.cuda.current_stream()
        raw = _raw_stream(self.device.index)
        s = self._stream_cache.get(raw)
        if s is None:
            s = self._stream_cache[raw] = torch.cuda.current_stream(self.device)
        return s

    def _await_counts(self) -> None:
        """Return once the synchronised dispatch's exchange kernel set the host's done word (its counts, and an
        error's host mirror, are then in pinned memory), polling it as DeepEP's host polls its received counts:
        the host goes on while the kernel still makes the handle's prefixes, and no event is recorded.

        The kernel's own waits on peers have their deadline (an expired one records its error, then the done
        word is set as ever). Past ``wait_s`` of polling (the GPU still busy with earlier work, or a launch that
        failed) the host synchronises the stream instead: it waits on as before polling came in, or raises the
        launch's CUDA error."""
        done = self._done_view
        if done[0]:
            return
        clock = time.perf_counter
        end = clock() + self.wait_s
        while not done[0]:
            if clock() > end:
                self._current_stream().synchronize()
                if not done[0]:
                    raise RuntimeError(f"epcomm rank {self.rank}: the dispatch's exchange kernel ended without "
                                       "setting its done word")
                return

    @contextlib.contextmanager
    def _on(self, stream):
        """Work queued inside goes on ``stream`` (``torch.cuda.stream`` without its device lookups)."""
        prev = self._current_stream()
        torch.cuda.set_stream(stream)
        try:
            yield
        finally:
            torch.cuda.set_stream(prev)

    def _check_error(self, word: list[int] | None = None) -> None:
        """Raise if a kernel recorded an error (``word``: a fresh copy of the error word; default: the
        host mirror, which the recording kernel wrote). ``base.raise_error_word`` says what each code means."""
        if word is None:
            if not self._err_view[0]:  # the host mirror, as a NumPy view: no torch call per check
                return
            word = self.err_host.tolist()
        raise_error_word(self, word, self._announced_ms, "flag")

    def _announced_ms(self) -> list[int]:
        """Every rank's low-latency M: each rank announces it in word ``rank`` of its own flag area
        (nvlink_ll.py)."""
        off = self.flags_off + 5 * self.num_ranks * 4
        return [int(self.peers[r][off + 4 * r:off + 4 * r + 4].view(torch.int32).item()) for r in range(self.num_ranks)]

    @property
    def _timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)

    def _ht_layout(self, t_rows: int, row_bytes: int, g: int, k: int, h_comb: int) -> dict:
        """Offsets (bytes from the start of the symmetric buffer) of the staging slots for this call
        (computed once per row shape; ``t_rows`` is checked against the slots' capacity)."""
        lay = self._layouts.get((row_bytes, g, k, h_comb))
        if lay is not None and t_rows <= lay["cap"]:
            return lay
        r_ = self.num_ranks
        half = self.nvl_bytes // 2
        d_slot = half // r_ // 256 * 256
        c_slot = d_slot
        d_tok = row_bytes + g * 4 + k * 12
        c_tok = h_comb * 2 + k * 4
        # a slot holds cap rows, then cap rows of scales, top-k ids and weights, each array 16-byte aligned
        # (an int64 view of the ids needs it: with FP8 at hidden 128, cap * (row + scale bytes) can be odd
        # multiples of 4)
        cap = min(T_LIST_CAP, (d_slot - 48) // max(d_tok, 1), c_slot // max(c_tok, 1))
        if t_rows > cap:
            need = 2 * r_ * t_rows * max(d_tok, c_tok)
            raise ValueError(f"num_nvl_bytes={self._buf().num_nvl_bytes} holds at most {cap} tokens per rank for "
                             f"this shape; {t_rows} were given (about {need} bytes needed)")
        d0 = self.ht_off
        c0 = self.ht_off + half
        ds = d0 + _align(cap * row_bytes, 16)
        dk = ds + _align(cap * g * 4, 16)
        dw = dk + _align(cap * k * 8, 16)
        lay = self._layouts[(row_bytes, g, k, h_comb)] = {
            "cap": cap, "d_slot": d_slot, "c_slot": c_slot, "dx": d0, "ds": ds, "dk": dk, "dw": dw,
            "cx": c0, "cw": c0 + cap * h_comb * 2,
        }
        return lay

    def _slot_view(self, rank: int, off: int, slot_bytes: int, src: int, nbytes: int) -> torch.Tensor:
        start = off + src * slot_bytes
        return self.peers[rank][start:start + nbytes]

    def _view(self, key, make):
        """A view of a persistent buffer, made once per ``key`` (each slice or view is a torch call, tens
        of microseconds apiece on the eager path's host)."""
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = make()
        return v

    def _local(self, off: int, slot_bytes: int, dtype: torch.dtype):
        """All R slots of one staging array, as ``dtype`` (slot ``i`` at ``i * slot_bytes``), as a kernel
        argument (``launch.Ptr``; its tensor is ``.tensor``)."""
        return self._view(("local", off, slot_bytes, dtype),
                          lambda: Ptr(self.symm[off:off + self.num_ranks * slot_bytes].view(dtype)))

    def _notify_views(self, lx: int, c: int):
        """``counts[R][R]``, ``per_expert[R][lx]``, ``chan[R][c]`` and ``toks[R]`` in the notify output,
        as kernel arguments (``launch.Ptr``)."""
        r_, no = self.num_ranks, self.notify_out
        return self._view(("notify", lx, c), lambda: tuple(Ptr(v) for v in (
            no[:r_ * r_].view(r_, r_), no[r_ * r_:r_ * r_ + r_ * lx].view(r_, lx),
            no[r_ * r_ + r_ * L_MAX:r_ * r_ + r_ * L_MAX + r_ * c].view(r_, c),
            no[r_ * r_ + r_ * L_MAX + r_ * C_MAX:])))










    # ------------------------------------------------------------------ low-latency

    def _ll_impl(self):
        if self._ll is None:
            from .nvlink_ll import LowLatencyEngine

            self._ll = LowLatencyEngine(self)
        return self._ll

    def low_latency_dispatch(self, args):
        self._check_error()
        return self._ll_impl().dispatch(args)

    def low_latency_combine(self, args):
        self._check_error()
        return self._ll_impl().combine(args)

    def low_latency_dispatch_run(self, args):
        self._check_error()
        return checked_run(self._ll_impl().dispatch_run(args), self._err_view, self._check_error)

    def low_latency_combine_run(self, args):
        self._check_error()
        return checked_run(self._ll_impl().combine_run(args), self._err_view, self._check_error)

    def low_latency_zero_copy_buffer(self, handle):
        return self._ll_impl().zero_copy_buffer(handle)

    def clean_low_latency_buffer(self) -> None:
        self._ll_impl().clean()

    def return_rows(self, rows, dst, slots: int, phase: str, num_sms: int = 0):
        """``ElasticBuffer``'s combine transport by stores into the owners' symmetric buffers (nvlink_v2.py)."""
        return nvlink_v2.return_rows(self, rows, dst, slots, phase, num_sms)

    def return_row_parts(self, x, wts, dst, slots: int, phase: str, num_sms: int = 0, skip_self: bool = False):
        """``return_rows`` of ``x`` and the top-k weights read in place (``nvlink_v2.return_row_parts``: the
        bytes a pack would build, no pack pass), or None where the caller must pack them: parts that do not
        move as 16-byte vectors, or a subclass that moves rows its own way (its ``return_rows``).
        ``skip_self``: this rank's own rows stay in ``x`` and ``wts`` (not stored into its area)."""
        if not self._own_transport():
            return None
        return nvlink_v2.return_row_parts(self, x, wts, dst, slots, phase, num_sms, skip_self)

    def row_parts_kind(self, x, wts, slots: int, num_sms: int = 0, skip_self: bool = False):
        """The kind of :meth:`return_row_parts` call this one is (``nvlink_v2.row_parts_kind``: its bound launches,
        for a combine's ``native.Chain``), None where that returns None."""
        if not self._own_transport():
            return None
        return nvlink_v2.row_parts_kind(self, x, wts, slots, num_sms, skip_self)

    def rows_kind(self, rows, slots: int, num_sms: int = 0):
        """The kind of :meth:`return_rows` call this one is (``nvlink_v2.rows_kind``), None where a subclass moves rows
        its own way."""
        if not self._own_transport():
            return None
        return nvlink_v2.rows_kind(self, rows, slots, num_sms)

    def _own_transport(self) -> bool:
        """Rows go back through this class's transport (a subclass with its own ``return_rows`` moves them its way)."""
        return type(self).return_rows is NVLinkBackend.return_rows

    # DeepEP V2's experimental calls: torch symmetric memory of their own (engram.py, pp.py, agrs.py)

    def engram_plan(self, cfg, comm=None):
        from .engram import NVLinkEngram

        return NVLinkEngram(self, cfg, comm)

    def pp_plan(self, cfg):
        from .pp import NVLinkPP

        return NVLinkPP(self, cfg)

    def agrs_plan(self, cfg, comm=None):
        from .agrs import NVLinkAGRS

        return NVLinkAGRS(self, cfg, comm)

    def barrier(self, phase: str) -> None:
        """Synchronise the device, then a barrier bounded by the deadline (``PeerTimeoutError`` naming
        ``phase``)."""
        torch.cuda.synchronize(self.device)
        deadline.barrier(self.group, self.rank, phase, self.wait_s)

    def destroy(self) -> None:
        if not gave_up(self.group):  # (after a deadline the ranks are out of step: no collective teardown)
            self.barrier("destroy/barrier")
        self.peers = self.nvl_buffer = self.rdma_buffer = None
        self._views = {}  # views into the symmetric buffer keep it alive
        self.symm = self.hdl = None
