"""``Buffer``: the DeepEP-compatible surface. It validates arguments, owns the communication stream,
events and buffers, picks a backend and delegates; it contains no transport code.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``,
``N`` received tokens, ``M`` = ``num_max_dispatch_tokens_per_rank``.

Low-latency buffers: two receive areas alternate call by call, so the results of at most two
low-latency calls may be alive at once (a third call reuses the first one's area). The zero-copy
combine buffer is a single region: write into it only after the previous combine returned.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist

from . import _env
from . import _validate as V
from . import layout
from .backends import select_backend
from .backends.internode import group_nodes
from .backends.base import DispatchArgs, LowLatencyCombineArgs, LowLatencyDispatchArgs
from .config import Config
from .event import EventOverlap
from .streams import CallStreams

log = logging.getLogger(__name__)




class Buffer:
    """Dispatch and combine MoE tokens across the ranks of ``group`` (see API.md)."""

    num_sms: int = 20
    # DeepEP's device rule: the current CUDA device whatever the group's backend (deep_ep.Buffer sets it:
    # vLLM builds its DeepEP Buffers on a gloo group); epcomm's own rule: CUDA where the group moves CUDA
    _cuda_whatever_the_group = False

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

        level = _env.log_level()
        if level:
            logging.getLogger("epcomm").setLevel(level.upper())
        backend_name = str(dist.get_backend(group)).lower()
        # CUDA where the group moves CUDA tensors: NCCL, or gloo named for CUDA too ("cpu:gloo,cuda:gloo")
        cuda_group = "nccl" in backend_name or "cuda:gloo" in backend_name or self._cuda_whatever_the_group
        if cuda_group and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.timeout_s = _env.timeout_s(10.0 if self.device.type == "cuda" else 30.0)
        self._streams = CallStreams(self.device)  # the communication stream and the order of calls
        # the node of every rank (hosts, or EPCOMM_GPUS_PER_NODE; collective, read once): the backend
        # selection uses it, and get_dispatch_layout counts tokens per node where there are several
        self.node_map = group_nodes(group)
        n_nodes = len(set(self.node_map[0]))
        self._ranks_per_node = self.group_size // n_nodes if n_nodes > 1 else None
        self._backend, why = select_backend(self)
        # Range checks of expert ids need the values on the host: done here unless the backend checks
        # them on the device (then a bad id raises at its next synchronisation, never a hang or a crash).
        self._host_checks = not getattr(self._backend, "checks_topk_on_device", False)
        log.info("epcomm rank %d: backend %s (%s)", self.rank, self._backend.name, why)
        self._mask = torch.zeros(self.group_size, dtype=torch.int32, device=self.device)
        self._ll_calls = 0
        # (M, H, E) of the low-latency calls since the last clean
        self._ll_shape: tuple[int, int, int] | None = None
        self._ll_sizes: dict = {}  # (M, H, E) -> get_low_latency_rdma_size_hint, checked once per shape
        self._ll_fast: dict = {}  # low-latency call key -> the backend's launches for it (_remember)
        self._checked: set = set()  # call signatures (shapes, dtypes, arguments) whose shape/dtype/flag checks passed
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
        self._backend.destroy()
        self._ll_fast.clear()
        self._destroyed = True

    # ------------------------------------------------------------------ streams and events



    # ------------------------------------------------------------------ high-throughput

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """``topk_idx int64[T, K]`` → ``(num_tokens_per_rank int32[R], num_tokens_per_rdma_rank int32[nodes]
        or None, num_tokens_per_expert int32[E], is_token_in_rank bool[T, R], event)``. The per-node
        counts exist where the group spans several nodes (hosts, or ``EPCOMM_GPUS_PER_NODE``): None on
        one node, as in DeepEP."""
        self._check_alive()
        V.num_experts(num_experts, self.group_size)
        V.topk_idx(topk_idx, None, num_experts, self.device, check_values=self._host_checks)

        def fn():
            per_rank, per_expert, in_rank = layout.dispatch_layout(topk_idx, num_experts, self.group_size)
            per_node = None if self._ranks_per_node is None else layout.tokens_per_node(in_rank,
                                                                                         self._ranks_per_node)
            return per_rank, per_node, per_expert, in_rank

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

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """High-throughput dispatch; see API.md. Returns ``(recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event)``."""
        self._check_alive()
        data, scales = V.dispatch_x(x, self.device)
        t, h = data.shape
        config = self._config(config, combine=False)
        self._check_nvl_bytes(config, h * data.element_size())
        if handle is not None:
            handle = V.as_dispatch_handle(handle)
            if handle.is_token_in_rank.shape[0] != t:
                raise ValueError(f"x has {t} tokens but the handle was made for {handle.is_token_in_rank.shape[0]}")

            def cached():
                return self._backend.cached_dispatch(data, scales, handle, config)

            (rx, rs), ev = self._streams.run(cached, [data, scales], previous_event, async_finish,
                                     allocate_on_comm_stream)
            return (rx if rs is None else (rx, rs)), None, None, None, None, ev

        try:
            sig = None
            if type(expert_alignment) is int and type(num_worst_tokens) is int:  # a bool is an int too
                ts = V.tensor_signature
                sig = ("htd", data.shape, data.dtype, data.get_device(), ts(scales), ts(num_tokens_per_rank),
                       ts(num_tokens_per_rdma_rank), ts(is_token_in_rank), ts(num_tokens_per_expert), ts(topk_idx),
                       ts(topk_weights), expert_alignment, num_worst_tokens, config)
        except AttributeError:  # not tensors: the checks say which
            sig = None
        if sig not in self._checked or self._host_checks:  # else these shapes and arguments passed before
            V.dispatch_args(t, self.group_size, self.device, self._host_checks, num_tokens_per_rank,
                            num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                            topk_weights, expert_alignment, num_worst_tokens)
            if sig is not None and len(self._checked) < 4096:
                self._checked.add(sig)
        args = DispatchArgs(data, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                            num_tokens_per_expert, expert_alignment, num_worst_tokens, config.num_channels,
                            config.num_sms, config.num_max_rdma_chunked_send_tokens)
        res, ev = self._streams.run(lambda: self._backend.dispatch(args), [data, scales, topk_idx, topk_weights],
                            previous_event, async_finish, allocate_on_comm_stream)
        recv_x = res.recv_x if res.recv_x_scales is None else (res.recv_x, res.recv_x_scales)
        return recv_x, res.recv_topk_idx, res.recv_topk_weights, res.num_recv_tokens_per_expert_list, res.handle, ev


    def combine(self, x: torch.Tensor, handle, topk_weights: torch.Tensor | None = None, bias=None,
                config: Config | None = None, previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """High-throughput combine; see API.md. Returns ``(combined_x bf16[T, H],
        combined_topk_weights f32[T, K] or None, event)``."""
        self._check_alive()
        handle = V.as_dispatch_handle(handle)
        n = handle.recv_src_idx.numel()
        t = handle.is_token_in_rank.shape[0]
        biases = () if bias is None else (bias if isinstance(bias, (tuple, list)) else (bias,))
        try:  # shapes, dtypes and devices that passed before skip their checks (the row counts never do)
            w = topk_weights
            sig = ("htc", x.shape[1:], x.dtype, x.get_device(),
                   None if w is None else (w.shape[1:], w.dtype, w.get_device()), t, config,
                   tuple(V.tensor_signature(b) for b in biases))
        except AttributeError:  # not tensors: the checks say which
            sig = None
        if sig not in self._checked:
            V.tensor("x", x, torch.bfloat16, 2, self.device)
            V.hidden(x.shape[1], False)
            if topk_weights is not None:
                V.tensor("topk_weights", topk_weights, torch.float32, 2, self.device)
            if len(biases) > 2:
                raise ValueError(f"bias takes one or two tensors, got {len(biases)}")
            for i, b in enumerate(biases):
                if b is not None:
                    V.tensor(f"bias[{i}]", b, torch.bfloat16, 2, self.device)
                    V.shape(f"bias[{i}]", b, (t, x.shape[1]))
            if sig is not None and len(self._checked) < 4096:
                self._checked.add(sig)
        if x.shape[0] != n:
            raise ValueError(f"x must have the {n} rows dispatch returned, got shape {tuple(x.shape)}")
        if topk_weights is not None and topk_weights.shape[0] != n:
            raise ValueError(f"topk_weights must have {n} rows, got shape {tuple(topk_weights.shape)}")
        config = self._config(config, combine=True)
        self._check_nvl_bytes(config, x.shape[1] * x.element_size())
        biases = tuple(b for b in biases if b is not None)  # DeepEP accepts (bias_0, None)
        (out, w), ev = self._streams.run(lambda: self._backend.combine(x, handle, topk_weights, tuple(biases), config),
                                 [x, topk_weights, *biases], previous_event, async_finish,
                                 allocate_on_comm_stream)
        return out, w, ev

    # ------------------------------------------------------------------ low-latency

    def _ll_check(self, m: int, h: int, e: int) -> None:
        if not self.low_latency_mode:
            raise ValueError("low-latency calls need a Buffer made with low_latency_mode=True, "
                             f"this one has low_latency_mode={self.low_latency_mode}")
        need = self._ll_sizes.get((m, h, e))
        if need is None:
            need = self._ll_sizes[(m, h, e)] = self.get_low_latency_rdma_size_hint(m, h, self.group_size, e)
        if self.num_rdma_bytes < need:
            raise ValueError(f"num_rdma_bytes={self.num_rdma_bytes} is too small for M={m}, H={h}, E={e}: "
                             f"get_low_latency_rdma_size_hint gives {need}")

    def _shrink_mask(self) -> torch.Tensor | None:
        return self._mask if self.enable_shrink else None

    def _ll_parity(self) -> int:
        p = self._ll_calls % 2
        self._ll_calls += 1
        return p

    def _ll_run(self, send: Callable, inputs: list, async_finish: bool, return_recv_hook: bool):
        if async_finish and return_recv_hook:
            raise ValueError("async_finish=True and return_recv_hook=True are mutually exclusive")
        if return_recv_hook:
            self._streams.sync()
            result, receive = send()
            return result, EventOverlap(), receive

        def both():
            result, receive = send()
            receive()
            return result

        if async_finish:
            result, ev = self._streams.run(both, inputs, None, True, False)
        else:
            self._streams.sync()
            result, ev = both(), EventOverlap()
        return result, ev, None

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Low-latency dispatch; see API.md. Returns ``(recv_x, recv_count, handle, event, hook)``."""
        cum, wst = cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats
        try:  # the repeat of a call seen before: its launches, made once (the checks passed then)
            key = None
            if type(num_max_dispatch_tokens_per_rank) is int and type(num_experts) is int:
                key = (x.shape, x.dtype, x.get_device(), x.data_ptr() & 15, x.is_contiguous(),
                       topk_idx.shape, topk_idx.dtype, topk_idx.get_device(), topk_idx.data_ptr() & 15,
                       topk_idx.is_contiguous(), num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                       round_scale, use_ue8m0, None if cum is None else V.repeat_signature(cum),
                       None if wst is None else V.repeat_signature(wst), self._ll_calls & 1,
                       return_recv_hook, async_finish)
        except AttributeError:  # not tensors: the checks below say which
            key = None
        run = self._ll_fast.get(key)
        if run is not None and not self._streams.comm_pending:
            self._ll_calls += 1
            res, receive = run(x, topk_idx, cum, wst)
            if return_recv_hook:
                return res.recv_x, res.recv_count, res.handle, _NO_EVENT, receive
            receive()
            return res.recv_x, res.recv_count, res.handle, _NO_EVENT, None
        return self._ll_dispatch_first(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cum, wst,
                                       use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook, key)

    def _ll_dispatch_first(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cum, wst, use_fp8,
                           round_scale, use_ue8m0, async_finish, return_recv_hook, key):
        """A low-latency dispatch with every check; it leaves its launches for the repeats of its key."""
        self._check_alive()
        m, h, e = V.ll_dispatch_args(self.group_size, self.device, self._host_checks, x, topk_idx,
                                     num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
                                     use_ue8m0, cum, wst)
        self._ll_check(m, h, e)
        if self._ll_shape is not None and self._ll_shape != (m, h, e):
            # The low-latency areas and flags are laid out for one shape (as in DeepEP): a new shape on a
            # live buffer could overwrite a peer that is still in the last call, or wait on stale flags.
            raise ValueError("low-latency shape (num_max_dispatch_tokens_per_rank, hidden, num_experts) changed "
                             f"from {self._ll_shape} to {(m, h, e)}; call clean_low_latency_buffer({m}, {h}, {e}) "
                             "on every rank first")
        args = LowLatencyDispatchArgs(x, topk_idx, m, e, bool(use_fp8), bool(round_scale), bool(use_ue8m0),
                                      cum, wst,
                                      self._ll_parity(), self._shrink_mask(), hook=bool(return_recv_hook))
        if async_finish:
            res, ev, hook = self._ll_run(lambda: self._backend.low_latency_dispatch(args), [x, topk_idx],
                                         async_finish, return_recv_hook)
        else:
            self._streams.sync()
            run = None
            if x.is_contiguous() and topk_idx.is_contiguous():
                run = self._backend.low_latency_dispatch_run(args)
            if run is None:
                res, receive = self._backend.low_latency_dispatch(args)
            else:
                res, receive = run(x, topk_idx, cum, wst)
                self._remember(key, run)
            ev = _NO_EVENT
            hook = receive if return_recv_hook else receive()
        self._ll_shape = (m, h, e)  # after the call: one that raised (e.g. M differing across ranks) sets nothing
        return res.recv_x, res.recv_count, res.handle, ev, hook

    def _remember(self, key, entry) -> None:
        """Keep ``entry`` (a backend's launches for calls like this one) for the repeats of ``key``."""
        if key is not None and not self._host_checks:
            if len(self._ll_fast) >= 4096:  # bounded, whatever the callers vary
                self._ll_fast.clear()
            self._ll_fast[key] = entry

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None):
        """Low-latency combine; see API.md. Returns ``(combined_x bf16[T, H], event, hook)``.

        ``use_logfmt`` is accepted for compatibility; the payload always travels as lossless BF16."""
        wst = combine_wait_recv_cost_stats
        try:  # the repeat of a call seen before (as in low_latency_dispatch); the handle by identity
            key = (id(handle), None if zero_copy else V.repeat_signature(x), topk_idx.shape, topk_idx.dtype,
                   topk_idx.get_device(), topk_idx.data_ptr() & 15, topk_idx.is_contiguous(), topk_weights.shape,
                   topk_weights.dtype, topk_weights.get_device(), topk_weights.data_ptr() & 15,
                   topk_weights.is_contiguous(), None if out is None else V.repeat_signature(out),
                   None if wst is None else V.repeat_signature(wst), bool(zero_copy), self._ll_calls & 1,
                   return_recv_hook, async_finish)
        except AttributeError:  # not tensors: the checks below say which
            key = None
        entry = self._ll_fast.get(key)
        if entry is not None and entry[0] is handle and not self._streams.comm_pending:
            self._ll_calls += 1
            res, receive = entry[1](x if entry[2] is None else entry[2], topk_idx, topk_weights, out, wst)
            if return_recv_hook:
                return res, _NO_EVENT, receive
            receive()
            return res, _NO_EVENT, None
        return self._ll_combine_first(x, topk_idx, topk_weights, handle, zero_copy, async_finish,
                                      return_recv_hook, out, wst, key)

    def _ll_combine_first(self, x, topk_idx, topk_weights, handle, zero_copy, async_finish, return_recv_hook,
                          out, wst, key):
        """A low-latency combine with every check; it leaves its launches for the repeats of its key."""
        self._check_alive()
        given = handle
        handle = V.as_low_latency_handle(handle)
        m, h, e = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        self._ll_check(m, h, e)
        zc = None
        if zero_copy:
            x = zc = self._backend.low_latency_zero_copy_buffer(handle)
        V.ll_combine_args(self.group_size, self.device, self._host_checks, x, topk_idx, topk_weights, out,
                          wst, m, h, e)
        args = LowLatencyCombineArgs(x, topk_idx, topk_weights, handle, out, wst,
                                     self._ll_parity(), self._shrink_mask(), hook=bool(return_recv_hook))
        if async_finish:
            return self._ll_run(lambda: self._backend.low_latency_combine(args), [x, topk_idx, topk_weights],
                                async_finish, return_recv_hook)
        self._streams.sync()
        run = None
        if x.is_contiguous() and topk_idx.is_contiguous() and topk_weights.is_contiguous() and (
                out is None or out.is_contiguous()):
            run = self._backend.low_latency_combine_run(args)
        if run is None:
            res, receive = self._backend.low_latency_combine(args)
        else:
            res, receive = run(x, topk_idx, topk_weights, out, wst)
            if given is handle:  # a handle object of ours: its identity keys the repeats
                self._remember(key, (handle, run, zc))
        return res, _NO_EVENT, receive if return_recv_hook else receive()

    def get_next_low_latency_combine_buffer(self, handle) -> torch.Tensor:
        """``bf16[L, R*M, H]``: write expert outputs here, then call combine with ``zero_copy=True``."""
        self._check_alive()
        handle = V.as_low_latency_handle(handle)
        self._ll_check(handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        return self._backend.low_latency_zero_copy_buffer(handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Reset the low-latency signal state; every rank calls it together."""
        self._check_alive()
        m = V.int_arg("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        h = V.int_arg("hidden", hidden, 1)
        e = V.num_experts(num_experts, self.group_size)
        self._ll_check(m, h, e)
        self._backend.clean_low_latency_buffer()
        self._ll_calls = 0
        self._ll_shape = None
        self._ll_fast.clear()

    # ------------------------------------------------------------------ shrink (fault tolerance)

    def _check_shrink(self) -> None:
        if not self.enable_shrink:
            raise ValueError(f"the mask API needs a Buffer made with enable_shrink=True, this one has "
                             f"enable_shrink={self.enable_shrink}")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask ``rank_to_mask``: masked ranks are skipped by low-latency calls."""
        self._check_shrink()
        V.int_arg("rank_to_mask", rank_to_mask, 0)
        if rank_to_mask >= self.group_size:
            raise ValueError(f"rank_to_mask={rank_to_mask} is not a rank of this {self.group_size}-rank group")
        self._mask[rank_to_mask] = 1 if mask else 0

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Copy the mask (``int32[R]``, 1 = masked) into ``mask_status``."""
        self._check_shrink()
        V.tensor("mask_status", mask_status, torch.int32, 1, self.device)
        V.shape("mask_status", mask_status, (self.group_size,))
        mask_status.copy_(self._mask)

    def low_latency_clean_mask_buffer(self) -> None:
        self._check_shrink()
        self._mask.zero_()


_NO_EVENT = EventOverlap()  # what a synchronous call returns as its event (holds nothing)






