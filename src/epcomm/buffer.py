"""``Buffer``: the DeepEP-compatible surface. It validates arguments, owns the communication stream,
events and buffers, picks a backend and delegates; it contains no transport code.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``,
``N`` received tokens, ``M`` = ``num_max_dispatch_tokens_per_rank``.

The low-latency methods and the shrink mask live in ``buffer_ll.LowLatencyMethods``, a base class.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from . import _validate as V
from . import layout
from ._agree import Agreement
from .backends.base import DispatchArgs
from .buffer_ll import LowLatencyMethods
from .config import Config
from .event import EventOverlap
from .runtime import Runtime

log = logging.getLogger(__name__)


def _scales_copied(run):
    """``run`` (a backend's dispatch plan) taking non-contiguous FP8 scales (its second argument), copied
    contiguous each call; None for None."""
    if run is None:
        return None

    def copied(x, scales, *rest):
        return run(x, scales.contiguous(), *rest)

    return copied


def _key_functions(device: torch.device) -> tuple:
    """``(signatures, row_signatures)``: a call's kind from its tensors, in one C++ call where plans on
    ``device`` are native (``native.key_functions``), else ``_validate``'s."""
    from . import native

    return native.key_functions(device)


class Buffer(LowLatencyMethods):
    """Dispatch and combine MoE tokens across the ranks of ``group``: DeepEP V1's ``Buffer``.

    High-throughput calls (``get_dispatch_layout``, ``dispatch``, ``combine``) move any number of tokens;
    low-latency calls (``low_latency_dispatch``, ``low_latency_combine``, from ``LowLatencyMethods``)
    need ``low_latency_mode=True`` and ``num_rdma_bytes`` of at least
    ``get_low_latency_rdma_size_hint``. Bad arguments raise ``ValueError``/``TypeError`` naming them.
    The whole contract (returns, errors, device and dtype rules): docs/api.md."""

    num_sms: int = 20
    # DeepEP's device rule: the current CUDA device whatever the group's backend (deep_ep.Buffer sets it:
    # vLLM builds its DeepEP Buffers on a gloo group); epcomm's own rule: CUDA where the group moves CUDA
    _cuda_whatever_the_group = False
    # a subclass's own backend instead of the selection rule's: ``make(runtime) -> Backend`` (epcomm.testing's rigs)
    _make_backend = None

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None):
        if group is None:
            if comm is not None:
                raise ValueError("comm (an MPI communicator) is not supported: pass a torch.distributed group")
            raise ValueError("group must be a torch.distributed process group, got None")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes = V.int_arg("num_nvl_bytes", num_nvl_bytes, 0)
        self.num_rdma_bytes = V.int_arg("num_rdma_bytes", num_rdma_bytes, 0)
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = V.int_arg("num_qps_per_rank", num_qps_per_rank, 1)
        self.allow_nvlink_for_low_latency_mode = bool(allow_nvlink_for_low_latency_mode)
        self.allow_mnnvl = bool(allow_mnnvl)
        self.use_fabric = bool(use_fabric)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)

        self._rt = Runtime(group, num_nvl_bytes=self.num_nvl_bytes, num_rdma_bytes=self.num_rdma_bytes,
                           low_latency_mode=self.low_latency_mode, num_qps_per_rank=self.num_qps_per_rank,
                           allow_nvlink_for_low_latency_mode=self.allow_nvlink_for_low_latency_mode,
                           cuda_whatever_the_group=self._cuda_whatever_the_group, num_sms=lambda: type(self).num_sms,
                           make_backend=self._make_backend)
        self.device, self.timeout_s, self.node_map = self._rt.device, self._rt.timeout_s, self._rt.node_map
        self._backend, self._streams = self._rt.backend, self._rt.streams  # (this Buffer's own names for its runtime's)
        self._host_checks = self._rt.host_checks
        self._mask = torch.zeros(self.group_size, dtype=torch.int32, device=self.device)
        self._ll_calls = 0
        # (M, H, E) of the low-latency calls since the last clean
        self._ll_shape: tuple[int, int, int] | None = None
        self._ll_sizes: dict = {}  # (M, H, E) -> get_low_latency_rdma_size_hint, checked once per shape
        self._ll_fast: dict = {}  # low-latency call key -> the backend's launches for it (_remember)
        self._checked: set = set()  # call signatures (shapes, dtypes, arguments) whose shape/dtype/flag checks passed
        self._ht_fast: dict = {}  # high-throughput call key -> the backend's plan for it (_keep)
        self._sigs, self._rsigs = _key_functions(self.device)  # (a call's tensors' kind; without their row counts)
        self._agree = Agreement(group, self.rank)  # the arguments every rank passes alike, met once per kind
        self._nvl_ok: set = set()  # (config, hidden bytes) that fit num_nvl_bytes
        self._default_configs: dict = {}  # (combine, num_sms) -> the default Config
        self._destroyed = False

    # ------------------------------------------------------------------ static helpers

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True where the Triton kernels can target SM90 (a Hopper or newer GPU is visible)."""
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        V.int_arg("new_num_sms", new_num_sms, 2)
        if new_num_sms % 2 != 0:
            raise ValueError(f"new_num_sms must be even, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An ``EventOverlap`` recorded on the current stream (an empty one on CPU)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream())
            return EventOverlap(ev)
        return EventOverlap()

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config.default_dispatch(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config.default_combine(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of ``num_rdma_bytes`` the low-latency mode needs (a multiple of 128)."""
        V.int_arg("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        V.int_arg("hidden", hidden, 1)
        V.int_arg("num_ranks", num_ranks, 1)
        V.num_experts(num_experts, num_ranks)
        return layout.low_latency_buffer_layout(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                                num_experts).total

    # ------------------------------------------------------------------ instance helpers

    @property
    def backend_name(self) -> str:
        return self._backend.name

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this epcomm Buffer was destroyed")

    def get_comm_stream(self):
        """The communication stream (``None`` on CPU, where everything completes synchronously)."""
        return self._streams.comm

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A view of this rank's communication buffer as ``dtype`` (optionally shaped ``size``)."""
        self._check_alive()
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        V.int_arg("offset", offset, 0)
        raw = self._backend.rdma_buffer if use_rdma_buffer else self._backend.nvl_buffer
        if offset > raw.numel():
            raise ValueError(f"offset={offset} is past the end of the {raw.numel()}-byte buffer")
        raw = raw[offset:]
        esz = dtype.itemsize
        usable = raw[: raw.numel() // esz * esz].view(dtype)
        if size is None:
            return usable
        numel = 1
        for s in size:
            numel *= int(s)
        if numel > usable.numel():
            raise ValueError(f"size={tuple(size)} needs {numel * esz} bytes but the buffer has {raw.numel()} "
                             f"past offset={offset}")
        return usable[:numel].view(size)

    def destroy(self) -> None:
        """Release the communication buffers (needed with ``explicitly_destroy=True``)."""
        if self._destroyed:
            return
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() is for Buffers made with explicitly_destroy=True")
        self._rt.destroy()
        self._ll_fast.clear()
        self._ht_fast.clear()
        self._destroyed = True

    # ------------------------------------------------------------------ high-throughput

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """``topk_idx int64[T, K]`` → ``(num_tokens_per_rank int32[R], num_tokens_per_rdma_rank int32[nodes]
        or None, num_tokens_per_expert int32[E], is_token_in_rank bool[T, R], event)``. The per-node
        counts exist where the group spans several nodes (hosts, or ``EPCOMM_GPUS_PER_NODE``): None on
        one node, as in DeepEP. A backend with a layout kernel (``dispatch_layout``) computes the same
        values in one launch."""
        self._check_alive()
        key = None
        if not self._host_checks and type(num_experts) is int:
            try:  # a repeat of a kind checked before skips the checks (they read nothing but the key's parts)
                key = ("layout", self._sigs(topk_idx), num_experts)
            except (AttributeError, TypeError):  # not a tensor: the checks say so
                key = None
        if key is None or key not in self._checked:
            V.num_experts(num_experts, self.group_size)
            V.topk_idx(topk_idx, None, num_experts, self.device, check_values=self._host_checks)
            if key is not None and len(self._checked) < 4096:
                self._checked.add(key)
        kernel, per_node_of = self._backend.dispatch_layout, self._rt.ranks_per_node

        def fn():
            per_rank, per_expert, in_rank = kernel(topk_idx, num_experts)
            per_node = None if per_node_of is None else layout.tokens_per_node(in_rank, per_node_of)
            return per_rank, per_node, per_expert, in_rank

        if self._streams.now(previous_event, async_finish, allocate_on_comm_stream):
            return (*fn(), EventOverlap())
        (per_rank, per_node, per_expert, in_rank), ev = self._streams.run(fn, [topk_idx], previous_event,
                                                                           async_finish, allocate_on_comm_stream)
        return per_rank, per_node, per_expert, in_rank, ev

    def _config(self, config, combine: bool) -> Config:
        if config is None:
            c = self._default_configs.get((combine, Buffer.num_sms))
            if c is None:
                c = (self.get_combine_config if combine else self.get_dispatch_config)(self.group_size)
                self._default_configs[(combine, Buffer.num_sms)] = c
            return c
        if not isinstance(config, Config):
            raise TypeError(f"config must be an epcomm.Config, got {type(config).__name__}")
        return config

    def _check_nvl_bytes(self, config: Config, hidden_bytes: int) -> None:
        if (config, hidden_bytes) in self._nvl_ok:
            return
        need = config.get_nvl_buffer_size_hint(hidden_bytes, self.group_size)
        if self.num_nvl_bytes and need > self.num_nvl_bytes:
            raise ValueError(f"num_nvl_bytes={self.num_nvl_bytes} is too small: this config needs {need} "
                             f"(Config.get_nvl_buffer_size_hint({hidden_bytes}, {self.group_size}))")
        self._nvl_ok.add((config, hidden_bytes))

    def _agreed(self, call: str, fields: tuple) -> None:
        """The first call of a kind: ``fields`` (the arguments every rank must pass alike) compared across the
        group, ``ValueError`` on every rank where they differ (``_agree``); not while a CUDA graph is captured."""
        if not V.is_capturing(self.device):
            self._agree.check(call, fields, self.timeout_s)

    def _keep(self, key, run) -> None:
        """Keep ``run`` (a backend's plan for high-throughput calls like this one) for the repeats of ``key``."""
        if len(self._ht_fast) >= 4096:  # bounded, whatever the callers vary
            self._ht_fast.clear()
        self._ht_fast[key] = run

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """High-throughput dispatch of ``x`` (``bf16[T, H]``, or ``(fp8[T, H], f32[T, H/128])``) to every rank
        holding one of its experts. Returns ``(recv_x, recv_topk_idx int64[N, K], recv_topk_weights f32[N, K],
        num_recv_tokens_per_expert_list, handle, event)``: the ``N`` rows this rank receives, ordered by
        source rank then token, with FP8 in giving FP8 out. With ``handle`` (cached mode) it reuses an
        earlier layout and returns ``(recv_x, None, None, None, None, event)``.

        A call of a kind seen before (shapes, dtypes, devices, alignment, contiguity, flags, Config; not
        values) skips its checks and runs the backend's plan for that kind, where it has one."""
        self._check_alive()
        if handle is not None:
            return self._cached_dispatch(x, handle, config, previous_event, async_finish, allocate_on_comm_stream)
        ntpr, is_in, ntpe = num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert
        idx, w = topk_idx, topk_weights
        data, scales = x if isinstance(x, (tuple, list)) and len(x) == 2 else (x, None)
        key = None
        if not self._host_checks and type(expert_alignment) is int and type(num_worst_tokens) is int:
            try:  # (a bool is an int too: type() rules it out above)
                key = ("htd", self._sigs(data, scales, ntpr, num_tokens_per_rdma_rank, is_in, ntpe, idx, w),
                       expert_alignment, num_worst_tokens, config, Buffer.num_sms)
            except (AttributeError, TypeError):  # not tensors: the checks say which
                key = None
        run = self._ht_fast.get(key)
        if run is None:
            run, data, scales = self._dispatch_first(key, x, ntpr, num_tokens_per_rdma_rank, is_in, ntpe, idx, w,
                                                     expert_alignment, num_worst_tokens, config)
        if self._streams.now(previous_event, async_finish, allocate_on_comm_stream):
            res, ev = run(data, scales, idx, w, ntpr, is_in, ntpe), EventOverlap()
        else:
            res, ev = self._streams.run(lambda: run(data, scales, idx, w, ntpr, is_in, ntpe),
                                        [data, scales, idx, w], previous_event, async_finish, allocate_on_comm_stream)
        recv_x = res.recv_x if res.recv_x_scales is None else (res.recv_x, res.recv_x_scales)
        return recv_x, res.recv_topk_idx, res.recv_topk_weights, res.num_recv_tokens_per_expert_list, res.handle, ev

    def _dispatch_first(self, key, x, ntpr, ntpr_rdma, is_in, ntpe, idx, w, expert_alignment: int,
                        num_worst_tokens: int, config):
        """A dispatch of a kind not seen before, checked; returns ``(run, x data, x scales)``, ``run`` the
        backend's plan for its kind (kept for the repeats of ``key``) or a call of ``Backend.dispatch``."""
        first = key not in self._checked  # (never None here without host checks; with them, checked every call)
        if first:  # the arguments of one row a token against each other first: the one that disagrees is named
            fp8 = isinstance(x, (tuple, list)) and len(x) == 2
            V.rows_agree((("x[0]", x[0]) if fp8 else ("x", x), ("topk_idx", idx), ("is_token_in_rank", is_in),
                          ("x[1]", x[1] if fp8 else None)))
        data, scales = V.dispatch_x(x, self.device)
        t, h = data.shape
        config = self._config(config, combine=False)
        self._check_nvl_bytes(config, h * data.element_size())
        if first:
            V.dispatch_args(t, self.group_size, self.device, self._host_checks, ntpr, ntpr_rdma, is_in, ntpe, idx,
                            w, expert_alignment, num_worst_tokens)
            self._agreed("dispatch", (("x.dtype", data.dtype), ("x.shape[1]", h),
                                      ("x[1].shape[1]", None if scales is None else scales.shape[1]),
                                      ("topk_idx.shape[1]", None if idx is None else idx.shape[1]),
                                      ("num_experts", ntpe.numel()), ("config.num_sms", config.num_sms)))
            if key is not None and len(self._checked) < 4096:  # (a kind: its checks and its agreement passed)
                self._checked.add(key)
        args = DispatchArgs(data, scales, idx, w, ntpr, is_in, ntpe, expert_alignment, num_worst_tokens,
                            config.num_channels, config.num_sms, config.num_max_rdma_chunked_send_tokens)
        plan = self._backend.dispatch_run
        run = None
        if key is not None and all(
                v is None or v.is_contiguous() for v in (data, ntpr, is_in, ntpe, idx, w)):
            if scales is None or scales.is_contiguous():
                run = plan(args)
            else:  # column-major FP8 scales (as DeepEP's tests pass them): the plan's, copied each call
                run = _scales_copied(plan(dataclasses.replace(args, x_scales=scales.contiguous())))
        if run is None:
            return (lambda *_: self._backend.dispatch(args)), data, scales
        self._keep(key, run)
        return run, data, scales

    def _cached_dispatch(self, x, handle, config, previous_event, async_finish, allocate_on_comm_stream):
        handle = V.as_dispatch_handle(handle)
        data, scales = x if isinstance(x, (tuple, list)) and len(x) == 2 else (x, None)
        key = None
        if not self._host_checks:
            try:  # (the received row count is no part of a kind)
                key = ("htc", self._sigs(data, scales, handle.is_token_in_rank, handle.rank_prefix_matrix),
                       self._rsigs(handle.recv_src_idx), config, Buffer.num_sms)
            except (AttributeError, TypeError):  # not tensors: the checks say which
                key = None
        run = self._ht_fast.get(key)
        if run is None:
            run, data, scales, handle = self._cached_first(key, x, handle, config)
        if self._streams.now(previous_event, async_finish, allocate_on_comm_stream):
            (rx, rs), ev = run(data, scales, handle), EventOverlap()
        else:
            (rx, rs), ev = self._streams.run(lambda: run(data, scales, handle), [data, scales], previous_event,
                                             async_finish, allocate_on_comm_stream)
        return (rx if rs is None else (rx, rs)), None, None, None, None, ev

    def _cached_first(self, key, x, handle, config):
        data, scales = V.dispatch_x(x, self.device)
        t, h = data.shape
        config = self._config(config, combine=False)
        self._check_nvl_bytes(config, h * data.element_size())
        if handle.is_token_in_rank.shape[0] != t:
            raise ValueError(f"x has {t} tokens but the handle was made for {handle.is_token_in_rank.shape[0]}")
        if key not in self._checked:
            self._agreed("dispatch with a handle", (("x.dtype", data.dtype), ("x.shape[1]", h),
                                                    ("x[1].shape[1]", None if scales is None else scales.shape[1]),
                                                    ("config.num_sms", config.num_sms)))
            if key is not None and len(self._checked) < 4096:
                self._checked.add(key)
        plan = self._backend.cached_dispatch_run
        run = None
        if key is not None and all(v is None or v.is_contiguous() for v in (
                data, handle.rank_prefix_matrix, handle.recv_src_idx, handle.is_token_in_rank)):
            if scales is None or scales.is_contiguous():
                run = plan(data, scales, handle, config)
            else:
                run = _scales_copied(plan(data, scales.contiguous(), handle, config))
        if run is None:
            return (lambda x_, s_, hd: self._backend.cached_dispatch(x_, s_, hd, config)), data, scales, handle
        self._keep(key, run)
        return run, data, scales, handle

    def combine(self, x: torch.Tensor, handle, topk_weights: torch.Tensor | None = None, bias=None,
                config: Config | None = None, previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """High-throughput combine: ``x bf16[N, H]``, in the order dispatch returned, goes back to its
        tokens and each token's rows are summed (the backward of dispatch). Returns ``(combined_x
        bf16[T, H], combined_topk_weights f32[T, K] or None, event)``."""
        self._check_alive()
        handle = V.as_dispatch_handle(handle)
        w = topk_weights
        biases = () if bias is None else (bias if isinstance(bias, (tuple, list)) else (bias,))
        key = None
        try:  # a kind seen before skips its checks (the row counts never do)
            key = ("htcb", self._rsigs(x, w), len(biases), self._sigs(*biases, handle.rank_prefix_matrix,
                                                                       handle.send_head),
                   handle.is_token_in_rank.shape[0], config, Buffer.num_sms)
            n = handle.recv_src_idx.numel()
            run = self._ht_fast.get(key)
            if run is not None and (x.shape[0] != n or (w is not None and w.shape[0] != n)):
                run = None  # (the checks below say which)
        except (AttributeError, TypeError):  # not tensors: the checks say which
            key = run = None
        if run is None:
            run, biases = self._combine_first(key, x, handle, w, biases, config)
        elif biases:
            biases = tuple(b for b in biases if b is not None)  # DeepEP accepts (bias_0, None)
        if self._streams.now(previous_event, async_finish, allocate_on_comm_stream):
            (out, w), ev = run(x, handle, w, biases), EventOverlap()
        else:
            (out, w), ev = self._streams.run(lambda: run(x, handle, w, biases), [x, w, *biases], previous_event,
                                             async_finish, allocate_on_comm_stream)
        return out, w, ev

    def _combine_first(self, key, x, handle, w, biases, config):
        """A combine of a kind not seen before, checked; returns ``(run, biases)`` (as ``_dispatch_first``)."""
        n = handle.recv_src_idx.numel()
        t = handle.is_token_in_rank.shape[0]
        first = key not in self._checked
        if first:
            V.tensor("x", x, torch.bfloat16, 2, self.device)
            V.hidden(x.shape[1], False)
            if w is not None:
                V.tensor("topk_weights", w, torch.float32, 2, self.device)
            V.biases(biases, t, x.shape[1], self.device)
        if x.shape[0] != n:
            raise ValueError(f"x must have the {n} rows dispatch returned, got shape {tuple(x.shape)}")
        if w is not None and w.shape[0] != n:
            raise ValueError(f"topk_weights must have {n} rows, got shape {tuple(w.shape)}")
        config = self._config(config, combine=True)
        self._check_nvl_bytes(config, x.shape[1] * x.element_size())
        if first:
            self._agreed("combine", (("x.shape[1]", x.shape[1]), ("topk_weights given", w is not None),
                                     ("config.num_sms", config.num_sms)))
            if key is not None and len(self._checked) < 4096:  # (a kind: its checks and its agreement passed)
                self._checked.add(key)
        biases = tuple(b for b in biases if b is not None)  # DeepEP accepts (bias_0, None)
        plan = self._backend.combine_run
        run = None
        if key is not None and all(
                v is None or v.is_contiguous() for v in (x, w, handle.rank_prefix_matrix, handle.send_head, *biases)):
            run = plan(x, handle, w, biases, config)
        if run is None:
            return (lambda x_, hd, w_, b_: self._backend.combine(x_, hd, w_, b_, config)), biases
        self._keep(key, run)
        return run, biases
