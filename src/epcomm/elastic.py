"""``ElasticBuffer`` and ``EPHandle``: DeepEP V2's API (v2.1.0) as a second front door to epcomm's engine.

``ElasticBuffer`` holds a ``Buffer`` as its engine (the same backend selection, backends, streams and
events) and adds only the V2 surface: sizing and the call sequence; the argument checks are in
``elastic_args.py``, the V2 steps themselves in ``elastic_engine.py`` and the layout math in
``elastic_layout.py``. A call of a kind seen before skips its checks and runs the plan its first call
left (as ``Buffer``'s calls do). docs/v2.md says what differs from DeepEP.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``LE = E/R``,
``M`` = ``num_max_tokens_per_rank``, ``N`` contiguous rows, ``X`` expanded rows, ``P`` scale packs.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from . import _env
from . import _validate as V
from . import elastic_args as A
from . import elastic_chains as chains
from . import elastic_engine as engine
from . import elastic_layout as EL
from ._agree import Agreement
from .backends import deadline
from .backends.errors import gave_up
from .elastic_extras import ElasticExtras
from .elastic_handle import EPHandle
from .event import EventHandle, EventOverlap
from .runtime import Runtime

log = logging.getLogger(__name__)

topk_idx_t = torch.int64  # DeepEP's top-k index dtype (int64 unless DeepEP is built otherwise)


class ElasticBuffer(ElasticExtras):
    """DeepEP V2's ``ElasticBuffer`` over epcomm's engine (see the module docstring and docs/v2.md)."""

    # DeepEP's device rule (``deep_ep.ElasticBuffer`` sets it: the current CUDA device whatever the group's
    # backend), else epcomm's (CUDA where the group moves CUDA tensors)
    _cuda_whatever_the_group = False
    # a subclass's own backend instead of the selection rule's: ``make(runtime) -> Backend`` (epcomm.testing's rigs)
    _make_backend = None

    def __init__(self, group, num_bytes: int | None = None, num_cpu_bytes: int = 0, num_max_tokens_per_rank: int = 0,
                 hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False,
                 **legacy):
        # pre-release DeepGEMM spelled the timeouts gpu_timeout_secs / cpu_timeout_secs: both are accepted
        for old, new in (("gpu_timeout_secs", "num_gpu_timeout_secs"), ("cpu_timeout_secs", "num_cpu_timeout_secs")):
            if old in legacy:
                if new == "num_gpu_timeout_secs":
                    num_gpu_timeout_secs = legacy.pop(old)
                else:
                    num_cpu_timeout_secs = legacy.pop(old)
        if legacy:
            raise TypeError(f"ElasticBuffer() got unexpected keyword argument(s) {sorted(legacy)}")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
        V.int_arg("num_cpu_bytes", num_cpu_bytes, 0)
        m = V.int_arg("num_max_tokens_per_rank", num_max_tokens_per_rank, 0)
        h = V.int_arg("hidden", hidden, 0)
        k = V.int_arg("num_topk", num_topk, 0)
        if k > EL.MAX_TOPK:
            raise ValueError(f"num_topk must be <= {EL.MAX_TOPK}, got {k}")
        V.int_arg("sl_idx", sl_idx, 0)
        V.int_arg("num_allocated_qps", num_allocated_qps, 0)
        for name, v in (("num_cpu_timeout_secs", num_cpu_timeout_secs), ("num_gpu_timeout_secs", num_gpu_timeout_secs)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if num_bytes is not None:
            V.int_arg("num_bytes", num_bytes, 0)
            if num_bytes % EL.ALIGNMENT:
                raise ValueError(f"num_bytes must be a multiple of 2 MiB ({EL.ALIGNMENT}), got {num_bytes}")
        if num_cpu_bytes:
            if num_bytes is None:
                raise ValueError(f"num_cpu_bytes={num_cpu_bytes} needs num_bytes")
            if num_cpu_bytes % EL.ALIGNMENT or num_cpu_bytes > num_bytes:
                raise ValueError(f"num_cpu_bytes must be a multiple of 2 MiB and <= num_bytes={num_bytes}, "
                                 f"got {num_cpu_bytes}")
        self.group = group
        self.rank_idx = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        if self.num_ranks > EL.MAX_RANKS:
            raise ValueError(f"at most {EL.MAX_RANKS} ranks are supported, the group has {self.num_ranks}")
        self.allow_hybrid_mode = A.flag("allow_hybrid_mode", allow_hybrid_mode)
        self.allow_multiple_reduction = A.flag("allow_multiple_reduction", allow_multiple_reduction)
        self.prefer_overlap_with_compute = A.flag("prefer_overlap_with_compute", prefer_overlap_with_compute)
        self.deterministic = A.flag("deterministic", deterministic)  # rows are always in routing order
        self.explicitly_destroy = A.flag("explicitly_destroy", explicitly_destroy)
        self.use_fp8_dispatch = A.flag("use_fp8_dispatch", use_fp8_dispatch)
        self.num_max_tokens_per_rank = m
        self.hidden, self.num_topk = h, k
        self.sl_idx = sl_idx
        self.num_cpu_timeout_secs, self.num_gpu_timeout_secs = num_cpu_timeout_secs, num_gpu_timeout_secs
        # a direct layout on every topology: rows grouped by source rank (docs/v2.md)
        self.num_allocated_qps = num_allocated_qps or 17

        staging = EL.staging_bytes(self.num_ranks, m, h, k) if m and h else (num_bytes or 0)
        # the backend (reference, nvlink, internode) that moves every byte, chosen as Buffer's is;
        # num_allocated_qps is its num_qps_per_rank (NVSHMEM's RC connections per peer on internode)
        self._rt = Runtime(group, num_nvl_bytes=staging, num_qps_per_rank=num_allocated_qps or 24,
                           cuda_whatever_the_group=self._cuda_whatever_the_group, make_backend=self._make_backend,
                           elastic_shape=(m, h, k or EL.MAX_TOPK) if m and h else None)
        self._backend, self._streams = self._rt.backend, self._rt.streams  # (this buffer's names for its runtime's)
        on_gpu = self._rt.device.type == "cuda"
        self._rt.set_timeout(num_gpu_timeout_secs if on_gpu else num_cpu_timeout_secs,
                             "num_gpu_timeout_secs" if on_gpu else "num_cpu_timeout_secs")
        self._host_checks = self._rt.host_checks
        self.device = self._rt.device
        nodes = self._rt.node_map[0]
        self.num_rdma_ranks = len(set(nodes))
        self.num_nvlink_ranks = self.num_ranks // self.num_rdma_ranks
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        # sized as DeepEP sizes it (BF16 whatever use_fp8_dispatch: an FP8-sized buffer then takes BF16 too)
        self.num_bytes = num_bytes if num_bytes is not None else self._size_for(m, h, k, False)
        self.num_cpu_bytes = num_cpu_bytes
        self.nccl_comm_handle = None
        self.runtime = self._rt
        self._destroyed = False
        self._sms_cache: dict = {}
        self._fast: dict = {}  # kind of fresh dispatch -> its run (dispatch)
        self._capturing = V.capturing_fn(self.device)  # (without torch.cuda's Python layer)
        self._fits: set = set()  # (M, H, K, FP8) whose layout fits num_bytes
        self._agree = Agreement(group, self.rank_idx)  # the arguments every rank passes alike, met once per kind
        self.device_sms = device_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                                        if self.device.type == "cuda" else 0)
        kernels = None  # the V2 steps as torch operations (the reference backend on CPU) ...
        if self.device.type == "cuda" or self._backend.name != "reference":  # ... else as Triton kernels
            from .backends.elastic_kernels import Kernels

            kernels = Kernels()
        self._steps = engine.Steps(self._backend, kernels, self.rank_idx, self.num_ranks, device_sms)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        deadline.prepare_native(self.group, self.rank_idx, self.device, True, self._host_timeout_s())
        from . import native

        # a call's kind from its tensors: _validate.signatures, or in one C++ call (native.key_functions)
        self._sigs = native.key_functions(self.device)[0]
        self._meet("ElasticBuffer/barrier")
        log.info("epcomm rank %d: ElasticBuffer on backend %s, %d bytes", self.rank_idx, self._backend.name,
                 self.num_bytes)

    # ------------------------------------------------------------------ sizes and helpers

    def _size_for(self, m: int, h: int, k: int, fp8: bool) -> int:
        return EL.buffer_bytes(self.num_ranks, self.num_nvlink_ranks, m, h, k, fp8, 1, self.allow_multiple_reduction)

    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """``num_bytes`` for these MoE settings (2 MiB-aligned; DeepEP's formula for the direct layout).
        Collective: every rank of ``group`` calls it (it learns the nodes of the group)."""
        from .backends.internode import group_nodes

        V.int_arg("num_max_tokens_per_rank", num_max_tokens_per_rank, 0)
        V.int_arg("hidden", hidden, 0)
        V.int_arg("num_topk", num_topk, 0)
        r = dist.get_world_size(group)
        nodes = len(set(group_nodes(group)[0]))
        return EL.buffer_bytes(r, r // nodes, num_max_tokens_per_rank, hidden, num_topk, bool(use_fp8_dispatch), 1,
                               bool(allow_multiple_reduction))

    def get_physical_domain_size(self) -> tuple[int, int]:
        """``(nodes, ranks a node)`` of the group (hosts, or ``EPCOMM_GPUS_PER_NODE``)."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        """``(1, R)``: epcomm lays rows out as DeepEP's direct mode on every topology (docs/v2.md)."""
        return 1, self.num_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """SMs for the dispatch and combine kernels (``elastic_layout.theoretical_num_sms``); on CPU, the
        number a V1 ``Buffer`` uses (20). Cached per arguments."""
        key = (num_experts, num_topk, num_scaleout_topk, rdma_gbs, nvlink_gbs, sm_read_gbs, sm_write_gbs)
        got = self._sms_cache.get(key)
        if got is None:
            got = self._sms_cache[key] = self._num_sms(*key)
        return got

    def _num_sms(self, num_experts, num_topk, num_scaleout_topk, rdma_gbs, nvlink_gbs, sm_read_gbs, sm_write_gbs):
        V.num_experts(num_experts, self.num_ranks)
        V.int_arg("num_topk", num_topk, 1)
        if num_scaleout_topk:
            raise ValueError(f"num_scaleout_topk must be 0 (as in DeepEP), got {num_scaleout_topk}")
        if self.device.type != "cuda":
            return 20
        props = torch.cuda.get_device_properties(self.device)
        if not nvlink_gbs:  # NVLink 4 (SM90: 450 GB/s a direction), NVLink 3 before it; 90% of it
            nvlink_gbs = (450.0 if props.major >= 9 else 300.0) * 0.9
        return EL.theoretical_num_sms(self.num_ranks, num_experts, num_topk, props.multi_processor_count,
                                      self.prefer_overlap_with_compute, nvlink_gbs, sm_read_gbs, sm_write_gbs)

    _num_sms_override = 0  # set_num_sms

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """What ``num_sms=0`` means from now on, for every ElasticBuffer (0: the model again). DeepEP V2 has
        no such method (Megatron-LM's flex dispatcher calls it); here it does what the caller means."""
        ElasticBuffer._num_sms_override = V.int_arg("new_num_sms", new_num_sms, 0)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        V.int_arg("num_sms", num_sms, 1)
        return EL.theoretical_num_qps(num_sms, False, self.num_allocated_qps)

    @staticmethod
    def capture() -> EventHandle:
        """An ``EventHandle`` recorded on the current stream (``previous_event=``)."""
        return EventHandle()

    def get_comm_stream(self):
        """The communication stream (None on CPU, where every call completes synchronously)."""
        return self._streams.comm

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Every rank of the group meets here, after its device finished what it was given: the GPU work any rank
        enqueued before the barrier is done before any rank's later work starts, as DeepEP's barrier kernel orders
        it on the stream (here the host waits too, whatever ``use_comm_stream`` and ``sequential``). A host meeting
        alone would let a peer's later kernels read memory this rank's earlier copies were still writing.
        ``with_cpu_sync``: the device is also synchronised after."""
        self._check_alive()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._meet("ElasticBuffer.barrier")
        if with_cpu_sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _meet(self, phase: str) -> None:
        """Every rank of the group meets here, or ``PeerTimeoutError`` naming this rank and ``phase`` after
        the host deadline (``EPCOMM_TIMEOUT_S`` where set, else ``num_cpu_timeout_secs``)."""
        deadline.barrier(self.group, self.rank_idx, phase, self._host_timeout_s())

    def _agreed(self, call: str, fields: tuple, capturing: bool) -> None:
        """A call of a kind not seen before: ``fields`` (the arguments every rank passes alike) compared across the
        group, ``ValueError`` on every rank where they differ (``_agree``); not while a CUDA graph is captured."""
        if not capturing:
            self._agree.check(call, fields, self._host_timeout_s)

    def _host_timeout_s(self) -> float:
        """The deadline of the host's waits: ``EPCOMM_TIMEOUT_S`` where set, else ``num_cpu_timeout_secs`` (each
        named by a wait that passes it)."""
        return _env.timeout_s(_env.Seconds(self.num_cpu_timeout_secs, "num_cpu_timeout_secs"))

    def destroy(self) -> None:
        """Release the engine's buffers (for buffers made with ``explicitly_destroy=True``); collective."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() is for ElasticBuffers made with explicitly_destroy=True")
        if self._destroyed:
            return
        if not gave_up(self.group):  # (after a deadline the ranks are out of step: no collective teardown)
            self.barrier(with_cpu_sync=True)
        self._x_release()  # the experimental calls' plans (elastic_extras.py): NVSHMEM frees collectively
        self._rt.destroy()
        self._fast.clear()
        self._destroyed = True
        self.runtime = None

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this ElasticBuffer was destroyed")

    def _run(self, fn, inputs, previous_event):
        """``fn()`` on the communication stream after ``previous_event`` (else after the current stream), on
        the current stream where there is no communication stream (CPU); returns ``(result, EventOverlap)``.
        (A call without ``async_with_compute_stream`` runs on the current stream: :meth:`_on_current`.)"""
        streams = self._streams
        if streams.comm is None:
            return fn(), EventOverlap()
        prev = None if previous_event is None else EventOverlap(previous_event)
        return streams.run(fn, inputs, prev, True, False)

    def _on_current(self, previous_event) -> None:
        """Before a call on the current stream: it waits for ``previous_event`` and for the communication
        stream's pending work (nothing to do without a communication stream, on CPU)."""
        streams = self._streams
        if streams.comm is not None:
            if previous_event is not None:
                previous_event.current_stream_wait()
            streams.sync()

    # ------------------------------------------------------------------ dispatch and combine

    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                 num_experts=None, num_max_tokens_per_rank=None, expert_alignment=None, num_sms: int = 0,
                 num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False, handle=None,
                 do_handle_copy: bool = True, do_cpu_sync=None, do_expand: bool = False,
                 do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        """Send each token to the ranks of its experts. ``x``: ``[T, H]`` (BF16) or ``(x, sf)`` (FP8 with
        ``sf [T, P]`` of 4-byte packs, fp32 or int32, moved as they are). Returns ``(recv_x, recv_topk_idx,
        recv_topk_weights, EPHandle, EventOverlap)``: contiguous ``recv_x [N, H]``, ``recv_topk_idx
        int64[N, K]`` (local ids, -1 elsewhere), ``recv_topk_weights f32[N, K]`` (local lanes, 0 elsewhere);
        expanded (``do_expand``) ``recv_x [X, H]``, ``recv_topk_idx`` None, ``recv_topk_weights f32[X]``.
        Without CPU sync ``N = R*M`` and ``X`` is the worst case; the handle's prefix sums say which rows
        are real. See docs/v2.md.

        A dispatch of a kind seen before (``elastic_args.dispatch_key``) skips its checks (unless expert ids are
        checked on the host) and runs the plan its first call left (``elastic_engine.dispatch_plan`` /
        ``cached_plan``)."""
        cum = cumulative_local_expert_recv_stats
        prev, before = previous_event, previous_event_before_epilogue
        capturing = self._capturing()  # (a captured call's plan may differ: HTDispatch.fuses_layout)
        try:
            data, sf = (x, None) if isinstance(x, torch.Tensor) else x
            key = A.dispatch_key(data, sf, topk_idx, topk_weights, cum, handle, (
                num_experts, num_max_tokens_per_rank, expert_alignment, num_sms, num_qps, async_with_compute_stream,
                allocate_on_comm_stream, do_handle_copy, do_cpu_sync, do_expand, do_zero_padding,
                use_tma_aligned_col_major_sf, ElasticBuffer._num_sms_override, prev is None, before is None,
                capturing), self._sigs)
            go = self._fast.get(key)
        except (AttributeError, TypeError, ValueError):  # not tensors, or not hashable: the checks say which
            key = go = None
        if go is not None and not self._host_checks and (handle is None or A.owned(handle, self)):
            if prev is not None or before is not None:
                prev, before = A.events(prev, before, allocate_on_comm_stream)
            return go(data, sf, topk_idx, topk_weights, cum, handle, prev, before)
        self._check_alive()
        data, sf, expand, zero_pad, async_, tma, prev, before = A.common(
            self, x, do_expand, do_zero_padding, async_with_compute_stream, allocate_on_comm_stream,
            use_tma_aligned_col_major_sf, prev, before, num_sms, num_qps)
        sfs = (None, None) if sf is None else (sf.dtype, sf.shape[1])
        if handle is not None:
            A.cached(self, handle, data, sf, topk_idx, topk_weights, cum, num_experts, num_max_tokens_per_rank,
                     expert_alignment, do_cpu_sync, expand)
            self._agreed("ElasticBuffer.dispatch with a handle", (
                ("x.dtype", data.dtype), ("x.shape[1]", data.shape[1]), ("sf.dtype", sfs[0]), ("sf.shape[1]", sfs[1]),
                ("topk_weights given", topk_weights is not None)), capturing)
            if go is None:
                go = self._cached_go(engine.cached_plan(self._steps, expand, data, sf, topk_weights, zero_pad, tma), async_)
        else:
            e, m, a, sync, k = A.fresh(self, data, sf, topk_idx, topk_weights, cum, num_experts,
                                       num_max_tokens_per_rank, expert_alignment, do_cpu_sync)
            sms = num_sms or ElasticBuffer._num_sms_override or self.get_theoretical_num_sms(e, k)
            self._agreed("ElasticBuffer.dispatch", (
                ("x.dtype", data.dtype), ("x.shape[1]", data.shape[1]), ("sf.dtype", sfs[0]), ("sf.shape[1]", sfs[1]),
                ("topk_idx.shape[1]", k), ("topk_weights given", topk_weights is not None), ("num_experts", e),
                ("num_max_tokens_per_rank", m), ("num_sms", sms)), capturing)
            if go is None:
                plan = engine.dispatch_plan(self._steps, data, sf, topk_idx, topk_weights, e, m, a, sms, expand, sync,
                                            zero_pad, tma, cum, A.flag("do_handle_copy", do_handle_copy), capturing)
                go = self._fresh_go(plan, async_, (expand, e, a, m, sms))
        self._keep(key, go)
        return go(data, sf, topk_idx, topk_weights, cum, handle, prev, before)

    def _fresh_go(self, plan, async_: bool, kind: tuple):
        """A fresh dispatch's call of ``plan``: ``go(x, sf, topk_idx, topk_weights, cum, None[, prev, before])``
        -> the five results; ``kind``: the handle's ``(do_expand, E, alignment, M, num_sms)``. Without
        ``async_``, the plan straight on the current stream (no closure, no stream switch)."""
        if not async_:
            def go(data, sf, topk_idx, topk_weights, cum, _handle, prev=None, before=None):
                self._on_current(prev)
                rx, rsf, ridx, rw, fields, state = plan(data, sf, topk_idx, topk_weights, cum, before)
                hd = EPHandle(*kind, *fields)
                hd._state, hd._owner = state, self
                return (rx if rsf is None else (rx, rsf)), ridx, rw, hd, EventOverlap()
            return go

        def go(data, sf, topk_idx, topk_weights, cum, _handle, prev=None, before=None):
            def fn():
                return plan(data, sf, topk_idx, topk_weights, cum, before)

            (rx, rsf, ridx, rw, fields, state), ev = self._run(fn, [data, sf, topk_idx, topk_weights], prev)
            if ev.event is not None:  # the handle's tensors were made on the communication stream
                for v in fields:
                    if isinstance(v, torch.Tensor) and v.is_cuda:
                        v.record_stream(torch.cuda.current_stream())
            hd = EPHandle(*kind, *fields)
            hd._state, hd._owner = state, self
            return (rx if rsf is None else (rx, rsf)), ridx, rw, hd, ev
        return go

    def _cached_go(self, plan, async_: bool):
        """A cached dispatch's call of ``plan`` (as :meth:`_fresh_go`'s, on the handle given)."""
        if not async_:
            def go(data, sf, _topk_idx, topk_weights, _cum, hd, prev=None, before=None):
                self._on_current(prev)
                rx, rsf, ridx, rw = plan(hd._state, data, sf, topk_weights, before)
                return (rx if rsf is None else (rx, rsf)), ridx, rw, hd, EventOverlap()
            return go

        def go(data, sf, _topk_idx, topk_weights, _cum, hd, prev=None, before=None):
            def fn():
                return plan(hd._state, data, sf, topk_weights, before)

            (rx, rsf, ridx, rw), ev = self._run(fn, [data, sf, topk_weights], prev)
            return (rx if rsf is None else (rx, rsf)), ridx, rw, hd, ev
        return go

    def _keep(self, key, go) -> None:
        """Keep ``go`` (a call's plan, checked) for the repeats of ``key`` (None: arguments that are not a kind)."""
        if key is not None:
            if len(self._fast) >= 256:  # bounded, whatever the callers vary
                self._fast.clear()
            self._fast[key] = go

    def combine(self, x, handle, topk_weights=None, bias=None, num_sms: int = 0, num_qps: int = 0,
                previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False):
        """Bring the expert outputs back and reduce them: ``x bf16`` in the handle's layout (contiguous: the
        dispatch's ``N`` rows, each already the sum of its local experts; expanded: ``X`` rows), never
        multiplied by weights. ``topk_weights`` (f32 ``[N, K]`` or ``[X]``) travel back; ``bias``: None,
        one or two ``bf16[T, H]``. Returns ``(combined_x bf16[T, H], combined_topk_weights f32[T, K] or None,
        EventOverlap)``. The sum: float32, biases first, then each rank's partial at its highest top-k lane,
        in lane order, one BF16 rounding (docs/v2.md). A combine of a kind seen before
        (``elastic_args.combine_key``) skips its checks; it runs on the handle given."""
        prev, before = previous_event, previous_event_before_epilogue
        try:
            key = A.combine_key(x, handle, topk_weights, bias, (num_sms, num_qps, async_with_compute_stream,
                                                                allocate_on_comm_stream, prev is None, before is None),
                                self._sigs)
            go = self._fast.get(key)
        except (AttributeError, TypeError):  # not tensors, or not hashable: the checks say which
            key = go = None
        if go is not None and A.owned(handle, self):
            if prev is not None or before is not None:
                prev, before = A.events(prev, before, allocate_on_comm_stream)
            return go(x, handle, topk_weights, bias, prev, before)
        self._check_alive()
        async_, prev, before = A.combine(self, x, handle, topk_weights, bias, async_with_compute_stream,
                                         allocate_on_comm_stream, prev, before, num_sms, num_qps)
        self._agreed("ElasticBuffer.combine", (("x.shape[1]", x.shape[1]),
                                               ("topk_weights given", topk_weights is not None),
                                               ("num_sms", num_sms or handle.num_sms)), self._capturing())
        if go is None:
            go = self._combine_go(handle.do_expand, async_, num_sms)
        self._keep(key, go)
        return go(x, handle, topk_weights, bias, prev, before)

    def _combine_go(self, expand: bool, async_: bool, num_sms: int):
        """A combine's call: ``go(x, handle, topk_weights, bias[, prev, before])`` -> the three results."""
        multi = self.allow_multiple_reduction
        if not async_:
            from . import native

            # after this kind's first uncaptured call bound its launches, it may be one native.Chain call
            # (expanded: where each token's local rows are summed; elastic_chains.combine_chain), where no
            # event is waited for inside it
            dev = self.device
            chain = native.Later((multi or not expand) and native.wanted(dev),
                                 lambda *a: chains.combine_chain(self._steps, *a, expand=expand))

            def go(x, handle, topk_weights, bias, prev=None, before=None):
                self._on_current(prev)
                ch = chain.value
                if ch is not None and before is None:
                    out, w = ch(x, topk_weights, () if bias is None else A.biases(bias), handle._state,
                                handle.topk_idx)
                    return out, w, EventOverlap()
                st, biases, sms = handle._state, () if bias is None else A.biases(bias), num_sms or handle.num_sms
                out, w = engine.combine(self._steps, x, st, handle.topk_idx, handle.num_experts,
                                        handle.num_max_tokens_per_rank, expand, topk_weights, biases, multi, before,
                                        sms)
                if not chain.done and before is None and not V.is_capturing(dev):
                    chain.ready(x, st, handle.topk_idx, handle.num_experts, handle.num_max_tokens_per_rank,
                                topk_weights, biases, sms)
                return out, w, EventOverlap()
            return go

        def go(x, handle, topk_weights, bias, prev=None, before=None):
            biases = A.biases(bias)

            def fn():
                return engine.combine(self._steps, x, handle._state, handle.topk_idx, handle.num_experts,
                                      handle.num_max_tokens_per_rank, expand, topk_weights, biases, multi, before,
                                      num_sms or handle.num_sms)

            (out, w), ev = self._run(fn, [x, topk_weights, *biases], prev)
            return out, w, ev
        return go
