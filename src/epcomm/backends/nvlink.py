"""The nvlink backend: one node, Triton kernels over torch symmetric memory (CUDA backend).

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``,
``C`` channels, ``N`` received rows, ``M`` low-latency max tokens per rank.

Symmetric buffer (one allocation per Buffer, made once at construction)::

    [flags int32[16*R]][meta: 2 parities x R sources x (R + L_MAX + C_MAX + T_LIST_CAP) int32]
    [high-throughput region: num_nvl_bytes = dispatch staging (R slots) | combine staging (R slots)]
    [low-latency region: num_rdma_bytes, laid out by layout.low_latency_buffer_layout]

High-throughput dispatch, eager: the copy engine copies this rank's whole batch (rows, FP8 scales,
top-k) into slot ``me`` of every peer's dispatch staging (zero SMs; it overlaps the notify step and
the host synchronisation), then a one-program kernel raises the peers' data flags. ``notify``
exchanges counts and send lists through the peers' meta areas; the host reads the counts (the
contract's one synchronisation; none with ``num_worst_tokens``); ``gather`` builds ``recv_x`` in
(source rank, token) order from local x and the staging slots. Captured in a CUDA graph (or with
``EPCOMM_HT_TRANSFER=sm``) the gather kernel pushes the batch itself, while it copies its own block
(``_fused_push``). Combine: each rank copies the block of rows it received from owner ``i`` into slot
``me`` of ``i``'s combine staging (copy engine when the block bounds are known on the host and the
call is not captured, else an SM push kernel), and ``reduce`` sums rank by rank in float32. Flow
control: a sender waits until every receiver consumed the previous contents of its slot. Launch
parameters and host arithmetic: ``nvlink_params.py``.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import weakref
import zlib

import torch
import torch.distributed as dist

from .. import _env
from ..kernels.launch import Ptr
from ..layout import DispatchHandle
from .base import Backend, DispatchArgs, DispatchResult, PeerTimeoutError
from .nvlink_params import (
    C_MAX,
    CRECV,
    CSEND,
    DEFAULT_NVL_BYTES,
    DRECV,
    DSEND,
    L_MAX,
    NC,
    NUM_CTRS,
    T_CPUSH,
    T_DPUSH,
    T_GATHER,
    T_LIST_CAP,
    T_REDUCE,
    TIMER,
    TUNE,
    _align,
    _ce_step,
    _chunk_rows,
    _host_counts,
    _pow2,
    apply_tune,
    reduce_stages,
    torch_to_tl,
)

log = logging.getLogger(__name__)



_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _aligned(*tensors) -> int:
    """Bit ``i`` set where per-call tensor ``i`` (or None) is not 16-byte aligned: Triton specialises a
    kernel on its pointers' alignment, so this joins the launch key (kernels/launch.py)."""
    bits = 0
    for i, t in enumerate(tensors):
        if t is not None and type(t) is not Ptr and t.data_ptr() & 15:
            bits |= 1 << i
    return bits


def availability(buf) -> tuple[bool, str]:
    """Whether this Buffer's ranks can use the nvlink backend, and why (collective: all ranks call)."""
    try:
        import torch.distributed._symmetric_memory
        import triton  # noqa: F401
    except ImportError as e:
        return False, f"needs triton and torch symmetric memory ({e}); pip install triton"
    if torch.cuda.get_device_capability(buf.device)[0] < 8:
        return False, "needs an SM80+ GPU"
    rows: list = [None] * buf.group_size
    dist.all_gather_object(rows, (zlib.crc32(socket.gethostname().encode()), buf.device.index), group=buf.group)
    if len({r[0] for r in rows}) != 1:
        return False, "ranks span several hosts"
    devs = [r[1] for r in rows]
    for d in devs:
        if d != buf.device.index and not torch.cuda.can_device_access_peer(buf.device.index, d):
            return False, f"GPU {buf.device.index} has no peer access to GPU {d}"
    return True, f"all {buf.group_size} ranks on one host with peer access"


class NVLinkBackend(Backend):
    name = "nvlink"
    checks_topk_on_device = True

    @classmethod
    def create(cls, buf) -> NVLinkBackend:
        return cls(buf)

    def __init__(self, buf):
        import torch.distributed._symmetric_memory as symm_mem

        super().__init__(buf.group, buf.rank, buf.group_size, buf.device, buf.timeout_s)
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
        # the notify output, then (16-byte aligned) the error word: the synchronisation copies both at once
        n_notify = r_ * r_ + r_ * L_MAX + r_ * C_MAX + r_
        self.err_at = _align(n_notify, 4)
        words = torch.zeros(self.err_at + 8, dtype=torch.int32, device=self.device)
        self.notify_out, self.err = words[:n_notify], words[self.err_at:self.err_at + 6]
        self.err[4:].view(torch.int64).fill_(self.err_host.data_ptr())
        self.src_lists = torch.empty(r_, T_LIST_CAP, dtype=torch.int32, device=self.device)
        self.notify_host = torch.zeros(self.err_at + 4, dtype=torch.int32, device="cpu").pin_memory()
        self._sync_copy = (self.notify_host, words[:self.err_at + 4])  # (to, from)
        self._notify_view = self.notify_host.numpy()
        self._streams: dict = {}  # raw CUDA stream -> its torch Stream (_current_stream)
        self.ce_stream = torch.cuda.Stream(self.device)
        self._sync_event = torch.cuda.Event()  # the eager dispatch's one host synchronisation
        self._ready_event = torch.cuda.Event()  # TUNE["notify_first"]: the inputs are ready
        self._views: dict = {}  # see _view
        self.sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.transfer = _env.ht_transfer()  # "ce" (copy engine eagerly), "sm" or "ce-always"
        from . import nvlink_ll

        over = _env.tune()
        apply_tune({k: v for k, v in over.items() if not k.startswith("ll.")})
        apply_tune({k[3:]: v for k, v in over.items() if k.startswith("ll.")}, nvlink_ll.TUNE, "ll.")
        self.flag_words = torch.zeros(2, dtype=torch.int32, device=self.device)  # TUNE["ce_flag"] == "copy"
        self._bind_kernels()
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self._ll = None

    # ------------------------------------------------------------------ helpers

    def _bind_kernels(self) -> None:
        """The kernels' launchers and the persistent buffers as addresses (kernels/launch.py): made once,
        so a call makes no slice or view of them."""
        from ..kernels import ht
        from ..kernels.launch import Launcher

        self.k = {name: Launcher(getattr(ht, name)) for name in (
            "_push_kernel", "_ce_wait_kernel", "_ce_signal_kernel", "_ce_flag_value_kernel", "_gather_kernel",
            "_notify_kernel", "_handle_kernel", "_combine_push_kernel", "_reduce_kernel")}
        self.p_table, self.p_err, self.p_nctr = Ptr(self.ptr_table), Ptr(self.err), Ptr(self.nctr)
        self.p_ctr = {i: Ptr(self.ctrs[i:]) for i in (DSEND, DRECV, CSEND, CRECV)}
        self.p_tk = {i: Ptr(self.tickets[i:]) for i in (T_GATHER, T_REDUCE, T_DPUSH, T_CPUSH)}
        self.p_src_lists = Ptr(self.src_lists)

    @property
    def num_sms(self) -> int:
        buf = self._buf()
        return buf.num_sms if buf is not None else 20

    def _current_stream(self) -> torch.cuda.Stream:
        """``torch.cuda.current_stream()``, cached by the raw stream (torch's lookup of the current device
        and the Stream object it builds cost tens of microseconds of host time per call)."""
        if _raw_stream is None:  # a CPU build of torch (the tests' stand-ins)
            return torch.cuda.current_stream()
        raw = _raw_stream(self.device.index)
        s = self._streams.get(raw)
        if s is None:
            s = self._streams[raw] = torch.cuda.current_stream(self.device)
        return s

    @contextlib.contextmanager
    def _on(self, stream):
        """Work queued inside goes on ``stream`` (``torch.cuda.stream`` without its current-device lookups)."""
        prev = self._current_stream()
        torch.cuda.set_stream(stream)
        try:
            yield
        finally:
            torch.cuda.set_stream(prev)

    def _check_error(self, word: list[int] | None = None) -> None:
        """Raise if a kernel recorded an error (``word``: a fresh copy of the error word; default: the
        host mirror, which the recording kernel wrote)."""
        if word is None:
            if not self._err_view[0]:  # the host mirror, as a NumPy view: no torch call per check
                return
            word = self.err_host.tolist()
        from ..kernels.common import PHASES

        if word[0] == 10:
            raise ValueError(f"topk_idx holds expert id {word[2]}, outside [-1, {word[3]}) for num_experts={word[3]} "
                             "(found on the device; this Buffer is now unusable)")
        if word[0] == 6:
            # each rank announces its M in word `rank` of its own flag area (nvlink_ll.py)
            off = self.flags_off + 5 * self.num_ranks * 4
            ms = [int(self.peers[r][off + 4 * r:off + 4 * r + 4].view(torch.int32).item())
                  for r in range(self.num_ranks)]
            if len(set(ms)) > 1:
                raise ValueError("num_max_dispatch_tokens_per_rank differs across ranks: "
                                 + ", ".join(f"{m} on rank {r}" for r, m in enumerate(ms)))
        if word[0] == 9:
            raise RuntimeError(f"epcomm rank {self.rank}: num_worst_tokens={word[3]} but {word[2]} tokens arrived; "
                               "raise num_worst_tokens (this Buffer is now unusable)")
        if word[0]:
            phase = PHASES.get(word[0], f"phase {word[0]}")
            raise PeerTimeoutError(self.rank, phase, word[1], self.timeout_s,
                                   f"flag {word[2]} < expected {word[3]}; this Buffer is now unusable")

    @property
    def _timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)

    def _ht_layout(self, t_rows: int, row_bytes: int, g: int, k: int, h_comb: int) -> dict:
        """Offsets (bytes from the start of the symmetric buffer) of the staging slots for this call."""
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
        return {
            "cap": cap, "d_slot": d_slot, "c_slot": c_slot, "dx": d0, "ds": ds, "dk": dk, "dw": dw,
            "cx": c0, "cw": c0 + cap * h_comb * 2,
        }

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
            no[r_ * r_ + r_ * L_MAX:r_ * r_ + r_ * L_MAX + r_ * c].view(r_, c), no[r_ * r_ + r_ * L_MAX + r_ * C_MAX:])))

    # ------------------------------------------------------------------ dispatch

    def _bulk_dispatch(self, x_words: torch.Tensor, scales, topk, w, lay: dict, is_in: torch.Tensor,
                       fused: bool = False, synchronised: bool = False, ready=None) -> None:
        """Send this rank's batch into slot ``me`` of every peer's dispatch staging (by copy engine; or
        by SMs, where ``fused`` leaves the SM push to the gather kernel: ``_fused_push``). ``ready``: an
        event recorded on the current stream when the inputs were ready (the copies wait for it, not
        for work queued after it, such as the notify kernel)."""
        from ..kernels import ht

        r_, me = self.num_ranks, self.rank
        if r_ == 1 or (fused and self._fused_push()):
            return
        if not self._use_ce():
            # Rows and their per-token arrays (scales, top-k ids, weights) by SMs, one kernel.
            grid = (max(1, self.num_sms),)
            has_s, has_k = scales is not None and scales.numel() > 0, topk is not None and topk.numel() > 0
            g = scales.shape[1] if has_s else 0
            k = topk.shape[1] if has_k else 0
            key = (x_words.shape[1], g, k, _aligned(x_words, scales, topk, w, is_in))
            self.k["_push_kernel"](key, grid, x_words, x_words.shape[1], x_words.shape[0], r_, me,
                                   is_in.view(torch.int8), self.p_table, self.flags_off, ht.DDATA.value,
                                   ht.DCONSUMED.value, lay["dx"], lay["d_slot"], self.p_ctr[DSEND],
                                   self.p_tk[T_DPUSH], self.p_err, 2, self._timeout_ns,
                                   scales if has_s else self.p_err, g, topk if has_k else self.p_err,
                                   w if has_k else self.p_err, k, lay["ds"], lay["dk"], lay["dw"],
                                   NC=NC, RB=TUNE["push_rb"], BLOCK=TUNE["push_block"],
                                  HAS_TIMER=TIMER, ELEM=torch_to_tl(x_words.dtype), HAS_SCALES=has_s,
                                  HAS_TOPK=has_k, G_POW2=_pow2(g), K_POW2=_pow2(k), num_warps=TUNE["push_warps"])
            return
        if ready is not None:
            self.ce_stream.wait_event(ready)
        else:
            self.ce_stream.wait_stream(self._current_stream())
        t = x_words.shape[0]
        per, step = _chunk_rows(t), _ce_step(synchronised)
        with self._on(self.ce_stream):
            self.k["_ce_wait_kernel"](DSEND, (1,), self.p_table, self.flags_off, ht.DCONSUMED.value, r_, me,
                                      self.p_ctr[DSEND], self.p_err, 2, self._timeout_ns, HAS_TIMER=TIMER)
            side = [(scales, "ds"), (topk, "dk"), (w, "dw")]
            for c in range(0, NC, step):
                lo, hi = min(c * per, t), min((c + step) * per, t)
                for j in range(r_):
                    if j == me:
                        continue
                    if c == 0:  # the small per-token arrays travel with the first chunk
                        for arr, key in side:
                            if arr is not None and arr.numel():
                                b = arr.numel() * arr.element_size()
                                self._slot_view(j, lay[key], lay["d_slot"], me, b).copy_(
                                    arr.reshape(-1).view(torch.uint8))
                    if hi > lo:
                        rb = x_words.shape[1] * 4
                        self._slot_view(j, lay["dx"] + lo * rb, lay["d_slot"], me, (hi - lo) * rb).copy_(
                            x_words[lo:hi].reshape(-1).view(torch.uint8))
                self._ce_raise(ht.DDATA, DSEND, step, c + step)
        for arr in (x_words, scales, topk, w):
            if arr is not None:
                arr.record_stream(self.ce_stream)

    def _ce_raise(self, slot: int, ctr: int, inc: int, done: int) -> None:
        """On the copy-engine stream, behind a chunk's copies: raise every peer's data flag ``slot`` by
        ``inc`` chunks (``done`` of ``NC`` sent this call; the last advances counter ``ctr``). By a flag
        kernel (release add), or with ``TUNE["ce_flag"] == "copy"`` by 4-byte copy-engine copies of the
        new value, queued behind the data copies on the same stream (a variant to test whether the copy
        engine keeps a flag behind its data under graph replay)."""
        from ..kernels import ht

        r_, me, last = self.num_ranks, self.rank, int(done == NC)
        if TUNE["ce_flag"] != "copy":
            self.k["_ce_signal_kernel"](ctr, (1,), self.p_table, self.flags_off, int(slot), r_, me, self.p_ctr[ctr],
                                        inc, last)
            return
        word = self.flag_words[int(int(slot) == int(ht.CDATA)):][:1]
        self.k["_ce_flag_value_kernel"](ctr, (1,), self.p_ctr[ctr], word, done, last, NC=NC)
        src = word.view(torch.uint8)
        for j in range(r_):
            if j != me:
                off = self.flags_off + (int(slot) * r_ + me) * 4
                self._view(("flag", j, int(slot)), lambda j=j, off=off: self.peers[j][off:off + 4]).copy_(src)

    def _use_ce(self) -> bool:
        """Bulk bytes by copy engine, unless EPCOMM_HT_TRANSFER=sm or the call is being captured in a CUDA
        graph (``ce-always``: under capture too, to diagnose). Under graph replay the copy-engine branch
        (a forked stream: copies, then a flag kernel) let the receiver read the last rows of a chunk
        before they arrived (tier 3 on nvidia-h200-x2, third session of 2026-11-22: the rows at the
        end of chunks 0-2 held the previous replay's data, every replay; a stream memory barrier
        between copy and flag did not change it); SM push was correct there. The fourth session's
        probe (scripts/ce_graph_probe.py, 512 tokens) saw no stale rows in any copy-engine variant."""
        if self.transfer == "sm":
            return False
        return self.transfer == "ce-always" or not torch.cuda.is_current_stream_capturing()

    def _fused_push(self) -> bool:
        """A non-cached dispatch without the copy engine pushes inside the gather kernel (its programs
        push and copy the own block at once, then copy the peers' rows), unless TUNE["fused_push"] is off."""
        return self.num_ranks > 1 and not self._use_ce() and TUNE["fused_push"]

    def _join_ce(self) -> None:
        if self.num_ranks > 1 and self._use_ce():
            self._current_stream().wait_stream(self.ce_stream)

    def _gather(self, x_words, scales, topk, w, lay, counts, is_prefix: bool, n_rows: int, lo_expert: int,
                lx: int, out_src: torch.Tensor, cached: bool, g: int, k: int, toks: torch.Tensor | None,
                is_in: torch.Tensor):

        dev = self.device
        out_x = torch.empty(n_rows, x_words.shape[1], dtype=x_words.dtype, device=dev)
        out_s = out_k = out_w = None
        if scales is not None:
            out_s = torch.empty(n_rows, g, dtype=torch.float32, device=dev)
        if topk is not None and not cached:
            out_k = torch.empty(n_rows, k, dtype=torch.int64, device=dev)
            out_w = torch.empty(n_rows, k, dtype=torch.float32, device=dev)
        row = x_words.shape[1]
        stage_x = self._local(lay["dx"], lay["d_slot"], x_words.dtype)
        stage_s = self._local(lay["ds"], lay["d_slot"], torch.float32)
        stage_k = self._local(lay["dk"], lay["d_slot"], torch.int64)
        stage_w = self._local(lay["dw"], lay["d_slot"], torch.float32)
        dummy_f = stage_s
        rb = TUNE["gather_rb"]
        push = not cached and self._fused_push()
        # with the push every program must be resident at once (at most one per SM: a num_sms above the
        # GPU's SM count would leave programs waiting on programs that cannot start); the Triton
        # interpreter (CPU runs) runs programs one after another, so there the fused kernel is one program
        fused_grid = min(self.num_sms, self.sm_count) if TIMER else 1
        grid = (max(1, fused_grid if push else min(self.num_sms, (n_rows + rb - 1) // rb)),)
        has_k = topk is not None and topk.numel() > 0
        key = (row, g, k, lx, cached, _aligned(x_words, scales, topk, w, counts, is_in))
        self.k["_gather_kernel"](
            key, grid,
            x_words, scales if scales is not None else dummy_f, topk if topk is not None else stage_k,
            w if w is not None else dummy_f, row, g, k,
            counts, self.num_ranks, self.rank, self.num_ranks, lo_expert, lx,
            toks if toks is not None else self.p_nctr,
            self.p_src_lists, self.src_lists.stride(0), n_rows,
            stage_x, lay["d_slot"] // x_words.element_size(), stage_s, lay["d_slot"] // 4, stage_k,
            lay["d_slot"] // 8, stage_w, lay["d_slot"] // 4,
            out_x, out_s if out_s is not None else dummy_f, g, 1,
            out_k if out_k is not None else stage_k, out_w if out_w is not None else dummy_f, out_src,
            self.p_table, self.flags_off, self.p_ctr[DRECV], self.p_tk[T_GATHER], self.p_err, self._timeout_ns,
            is_in.view(torch.int8) if push else self.p_err, x_words.shape[0], lay["dx"], lay["d_slot"], lay["ds"],
            lay["dk"], lay["dw"], self.p_ctr[DSEND], self.p_tk[T_DPUSH],
            PUSH=push, PUSH_RB=TUNE["push_rb"], PUSH_BLOCK=TUNE["push_block"], ELEM=torch_to_tl(x_words.dtype),
            PUSH_TOPK=push and has_k,
            CACHED=cached, IS_PREFIX=is_prefix, HAS_SCALES=scales is not None, HAS_TOPK=out_k is not None,
            NC=NC, RB=rb, BLOCK=TUNE["gather_block"], R_POW2=_pow2(self.num_ranks), K_POW2=_pow2(k), G_POW2=_pow2(g),
            HAS_TIMER=TIMER, STAGES=TUNE["gather_stages"], ONE_LOAD=TUNE["gather_one_load"],
            PREFETCH=TUNE["gather_prefetch"],
            num_warps=TUNE["gather_warps"],
        )
        return out_x, out_s, out_k, out_w

    def dispatch(self, a: DispatchArgs) -> DispatchResult:

        self._check_error()
        r_, me, dev = self.num_ranks, self.rank, self.device
        t, h = a.x.shape
        e = a.num_tokens_per_expert.numel()
        lx = e // r_
        c = a.num_channels
        if lx > L_MAX or c > C_MAX:
            raise ValueError(f"the nvlink backend supports up to {L_MAX} local experts and {C_MAX} channels, "
                             f"got L={lx}, C={c}")
        k = a.topk_idx.shape[1] if a.topk_idx is not None else 0
        g = a.x_scales.shape[1] if a.x_scales is not None else 0
        x_words = a.x.view(torch.uint8).view(torch.int32) if a.x.element_size() == 1 else a.x.view(torch.int32)
        lay = self._ht_layout(t, x_words.shape[1] * 4, g, k, h)
        scales = a.x_scales.contiguous() if a.x_scales is not None else None
        topk = a.topk_idx.contiguous() if a.topk_idx is not None else None
        w = a.topk_weights.contiguous() if a.topk_weights is not None else None
        is_in = a.is_token_in_rank.contiguous()
        send_head_rel = torch.empty(t, r_, dtype=torch.int32, device=dev)
        cpm = torch.empty(r_, c, dtype=torch.int32, device=dev)
        counts, per_expert, chan, toks = self._notify_views(lx, c)
        per_chan = max((t + c - 1) // c, 1)

        ntpr, ntpe = a.num_tokens_per_rank, a.num_tokens_per_expert
        key = (lx, c, k, e, _aligned(is_in, ntpr, ntpe, topk))

        def notify():
            self.k["_notify_kernel"](
                key, (r_,),
                is_in.view(torch.int8), t, r_, me, ntpr, ntpe, lx, c, per_chan,
                self.p_table, self.flags_off, self.meta_off, self.meta_parity_bytes, self.meta_src_bytes,
                self.list_off, self.list_parity_bytes, self.list_src_bytes,
                self.p_nctr, send_head_rel, cpm, counts, per_expert, chan, toks, self.p_src_lists,
                self.src_lists.stride(0), self.p_err, self._timeout_ns,
                BLOCK=TUNE["notify_block"], R_POW2=_pow2(r_), DO_SEND=True, DO_RECV=True, HAS_TIMER=TIMER,
                num_warps=TUNE["notify_warps"],
            )

        bulk = dict(fused=True, synchronised=not a.num_worst_tokens)
        if TUNE["notify_first"]:
            # the exchange of counts runs while the host queues the copies (the synchronisation below then
            # waits less); the copies wait for the inputs only, through an event recorded before notify
            self._ready_event.record(self._current_stream())
            notify()
            self._bulk_dispatch(x_words, scales, topk, w, lay, is_in, ready=self._ready_event, **bulk)
        else:
            self._bulk_dispatch(x_words, scales, topk, w, lay, is_in, **bulk)
            notify()
        # The handle's tensors need only the notify outputs: their kernel is queued before the
        # synchronisation, so its launch is not on the host's path between the counts and the gather.
        rpm = torch.empty(r_, r_, dtype=torch.int32, device=dev)
        recv_cp = torch.empty(r_, c, dtype=torch.int32, device=dev)
        send_head = torch.empty(t, r_, dtype=torch.int32, device=dev)

        def handle_kernel():
            tb = 128
            self.k["_handle_kernel"](
                key, (max(1, min(self.num_sms, (t + tb - 1) // tb)),),
                counts, chan, c, send_head_rel, t, r_, me, rpm, recv_cp, send_head, self.p_err, a.num_worst_tokens,
                topk if topk is not None else send_head, k, e, CHECK_WORST=bool(a.num_worst_tokens),
                R_POW2=_pow2(r_), C_POW2=_pow2(c), TB=tb, CHECK_TOPK=topk is not None, K_POW2=_pow2(k), num_warps=4)

        host_col = None
        bad_id = None
        if a.num_worst_tokens:
            # no host synchronisation: expert ids are checked by the handle kernel (error word)
            n_rows = a.num_worst_tokens
            lst = []
            handle_kernel()
        else:
            # The contract's one synchronisation: the counts and the error word (with the handle kernel's
            # check of the expert ids) come back in one copy; after it, a few NumPy operations on the pinned
            # words (no torch op per value).
            handle_kernel()
            dst, src = self._sync_copy
            dst.copy_(src, non_blocking=True)
            self._sync_event.record(self._current_stream())
            self._sync_event.synchronize()
            vals = self._notify_view
            word = vals[self.err_at:self.err_at + 4].tolist()
            if word[0] == 10:
                # A bad expert id (the layout ignored it): the exchange still completes on every rank, so the
                # Buffer stays in step; the ValueError comes after it. The error word is cleared.
                bad_id = word[2]
                self.err[:4].zero_()
                self.err_host.zero_()
            elif word[0]:
                self._check_error(word)
            host_col, n_rows, lst = _host_counts(vals, r_, lx, me, a.expert_alignment)
        out_src = torch.empty(n_rows, dtype=torch.int32, device=dev)
        out_x, out_s, out_k, out_w = self._gather(x_words, scales, topk, w, lay, counts, False, n_rows, me * lx, lx,
                                                  out_src, False, g, k, toks, is_in)
        self._join_ce()
        if bad_id is not None:
            # A bad expert id: every rank still finished this exchange (ids out of range were ignored
            # by the layout), so the Buffer stays in step; report the argument.
            raise ValueError(f"topk_idx holds expert id {bad_id}, outside [-1, {e}) for num_experts={e}")
        recv_x = out_x.view(torch.uint8).view(a.x.dtype) if a.x.element_size() == 1 else out_x.view(a.x.dtype)
        recv_x = recv_x.view(n_rows, h)
        handle = DispatchHandle(rpm, cpm, recv_cp, out_src, a.is_token_in_rank, send_head)
        if host_col is not None:
            # The combine's copy-engine path needs the block bounds on the host (rank_prefix_matrix[:, me]);
            # keep them on the handle.
            rpm._epcomm_host_col = host_col
        return DispatchResult(recv_x, out_s, out_k, out_w, lst, handle)

    def cached_dispatch(self, x, x_scales, handle: DispatchHandle):
        self._check_error()
        t, h = x.shape
        g = x_scales.shape[1] if x_scales is not None else 0
        x_words = x.view(torch.uint8).view(torch.int32) if x.element_size() == 1 else x.view(torch.int32)
        lay = self._ht_layout(t, x_words.shape[1] * 4, g, 0, h)
        scales = x_scales.contiguous() if x_scales is not None else None
        is_in = handle.is_token_in_rank.contiguous()
        self._bulk_dispatch(x_words, scales, None, None, lay, is_in)
        n_rows = handle.recv_src_idx.numel()
        out_x, out_s, _, _ = self._gather(x_words, scales, None, None, lay, handle.rank_prefix_matrix, True, n_rows,
                                          0, 0, handle.recv_src_idx, True, g, 0, None, is_in)
        self._join_ce()
        recv_x = out_x.view(torch.uint8).view(x.dtype) if x.element_size() == 1 else out_x.view(x.dtype)
        return recv_x.view(n_rows, h), out_s

    # ------------------------------------------------------------------ combine

    def combine(self, x, handle: DispatchHandle, topk_weights, bias):
        from ..kernels import ht

        self._check_error()
        r_, me, dev = self.num_ranks, self.rank, self.device
        t = handle.is_token_in_rank.shape[0]
        h = x.shape[1]
        k = topk_weights.shape[1] if topk_weights is not None else 0
        lay = self._ht_layout(t, 0, 0, k, h)
        rpm = handle.rank_prefix_matrix
        x = x.contiguous()
        w = topk_weights.contiguous() if topk_weights is not None else None
        host_prefix = getattr(rpm, "_epcomm_host_col", None)
        if r_ > 1:
            if host_prefix is not None and self._use_ce():
                self.ce_stream.wait_stream(self._current_stream())
                with self._on(self.ce_stream):
                    self.k["_ce_wait_kernel"](CSEND, (1,), self.p_table, self.flags_off, ht.CCONSUMED.value, r_, me,
                                              self.p_ctr[CSEND], self.p_err, 4, self._timeout_ns, HAS_TIMER=TIMER)
                    col = host_prefix
                    step = _ce_step()
                    for c in range(0, NC, step):
                        for i in range(r_):
                            if i == me:
                                continue
                            start = col[i - 1] if i > 0 else 0
                            rows = col[i] - start
                            per = _chunk_rows(rows)
                            lo, hi = min(c * per, rows), min((c + step) * per, rows)
                            if hi > lo:
                                src = x[start + lo:start + hi]
                                self._slot_view(i, lay["cx"] + lo * h * 2, lay["c_slot"], me, src.numel() * 2).copy_(
                                    src.reshape(-1).view(torch.uint8))
                                if w is not None:
                                    ws = w[start + lo:start + hi]
                                    self._slot_view(i, lay["cw"] + lo * k * 4, lay["c_slot"], me, ws.numel() * 4).copy_(
                                        ws.reshape(-1).view(torch.uint8))
                        self._ce_raise(ht.CDATA, CSEND, step, c + step)
                x.record_stream(self.ce_stream)
                if w is not None:
                    w.record_stream(self.ce_stream)
            else:
                xw = x.view(torch.int32)
                self.k["_combine_push_kernel"](
                    (h, k, _aligned(xw, w, rpm)), (max(1, self.num_sms),),
                    xw, w if w is not None else self.p_err, xw.shape[1], k, r_, me, rpm,
                    self.p_table, self.flags_off, lay["cx"], lay["c_slot"], lay["cw"], lay["c_slot"],
                    self.p_ctr[CSEND], self.p_tk[T_CPUSH], self.p_err, self._timeout_ns, x.shape[0],
                    HAS_W=w is not None, NC=NC, RB=TUNE["cpush_rb"], BLOCK=TUNE["cpush_block"], K_POW2=_pow2(k),
                    HAS_TIMER=TIMER, num_warps=TUNE["cpush_warps"],
                )
        out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
        out_w = torch.empty(t, k, dtype=torch.float32, device=dev) if w is not None else None
        stage_x = self._local(lay["cx"], lay["c_slot"], torch.bfloat16)
        stage_w = self._local(lay["cw"], lay["c_slot"], torch.float32)
        b0 = bias[0] if len(bias) > 0 else out
        b1 = bias[1] if len(bias) > 1 else out
        tb = TUNE["reduce_tb"]
        grid = (max(1, min(self.num_sms, (t + tb - 1) // tb)),)
        send_head, rpm, b0, b1 = handle.send_head.contiguous(), rpm.contiguous(), b0.contiguous(), b1.contiguous()
        self.k["_reduce_kernel"](
            (h, k, _aligned(x, send_head, rpm, w, b0, b1)), grid,
            x, h, t, r_, me, send_head, rpm, w if w is not None else stage_w, k,
            x.shape[0],
            stage_x, lay["c_slot"] // 2, stage_w, lay["c_slot"] // 4,
            b0, b1, out, out_w if out_w is not None else stage_w,
            self.p_table, self.flags_off, self.p_ctr[CRECV], self.p_tk[T_REDUCE], self.p_err, self._timeout_ns,
            HAS_W=w is not None, NUM_BIAS=len(bias), NC=NC, TB=tb, BLOCK=TUNE["reduce_block"], R_POW2=_pow2(r_),
            K_POW2=_pow2(k), HAS_TIMER=TIMER, STAGES=reduce_stages(_pow2(r_), tb, TUNE["reduce_block"]),
            num_warps=TUNE["reduce_warps"],
        )
        self._join_ce()
        return out, out_w

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

    def low_latency_zero_copy_buffer(self, handle):
        return self._ll_impl().zero_copy_buffer(handle)

    def clean_low_latency_buffer(self) -> None:
        self._ll_impl().clean()

    def destroy(self) -> None:
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self.peers = self.nvl_buffer = self.rdma_buffer = None
        self._views = {}  # views into the symmetric buffer keep it alive
        self.symm = self.hdl = None
