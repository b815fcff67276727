"""The low-latency half of ``Buffer`` (``low_latency_mode=True``): dispatch and combine of at most
``M`` tokens a rank into a fixed per-expert layout, the zero-copy combine buffer, and the shrink mask.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``,
``M`` = ``num_max_dispatch_tokens_per_rank``.

Two receive areas alternate call by call (``_ll_parity``), so the results of at most two low-latency
calls may be alive at once; a third call reuses the first one's area. The zero-copy combine buffer is
a single region: write into it only after the previous combine returned (docs/api.md, low-latency).

A call is checked in full the first time its kind is seen (``_ll_dispatch_first``,
``_ll_combine_first``); its backend launches are kept (``_remember``), and a repeat of the same kind
(shapes, dtypes, devices, flags; not values) runs them without the checks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import _validate as V
from .backends.base import LowLatencyCombineArgs, LowLatencyDispatchArgs
from .event import EventOverlap


class LowLatencyMethods:
    """The low-latency and shrink-mask methods of ``Buffer`` (a base class of it; not used alone).

    They use what ``Buffer.__init__`` sets: ``group_size``, ``device``, ``low_latency_mode``,
    ``num_rdma_bytes``, ``enable_shrink``, ``_backend``, ``_streams``, ``_host_checks``, ``_mask``,
    ``_ll_calls``, ``_ll_shape``, ``_ll_sizes``, ``_ll_fast``, ``_check_alive`` and ``_agreed``."""

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
        """Low-latency dispatch of ``x bf16[T, H]`` (``T <= M``) to the experts of ``topk_idx int64[T, K]``.

        Returns ``(recv_x, recv_count int32[L], handle, event, hook)``: ``recv_x`` is ``bf16[L, R*M, H]``,
        or with ``use_fp8`` the pair ``(fp8[L, R*M, H], f32[L, R*M, H/128])``; expert ``l``'s first
        ``recv_count[l]`` rows are filled. ``hook`` is None unless ``return_recv_hook``: then the call only
        sends, and calling ``hook()`` receives."""
        cum, wst = cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats
        try:  # the repeat of a call seen before: its launches, made once (the checks passed then)
            key = None
            if type(num_max_dispatch_tokens_per_rank) is int and type(num_experts) is int:
                # (the tensors' part: Buffer._sigs, one C++ call where the extension is built)
                key = (self._sigs(x, topk_idx, cum, wst), num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                       round_scale, use_ue8m0, self._ll_calls & 1, return_recv_hook, async_finish)
        except (AttributeError, TypeError):  # not tensors: the checks below say which
            key = None
        run = self._ll_fast.get(key)
        if run is not None and not self._streams.comm_pending:
            self._ll_calls += 1
            (recv_x, recv_count, handle), receive = run(x, topk_idx, cum, wst)
            if return_recv_hook:
                return recv_x, recv_count, handle, _NO_EVENT, receive
            receive()
            return recv_x, recv_count, handle, _NO_EVENT, None
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
        if not self.enable_shrink:  # (a masked rank may never arrive: the backend's exchange names M instead)
            self._agreed("low_latency_dispatch", (("num_max_dispatch_tokens_per_rank", m), ("x.shape[1]", h),
                                                  ("num_experts", e), ("use_fp8", bool(use_fp8))))
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
        """Low-latency combine of the expert outputs ``x bf16[L, R*M, H]`` (the layout dispatch returned)
        back to their tokens: each token's rows weighted by ``topk_weights f32[T, K]`` and summed. Returns
        ``(combined_x bf16[T, H], event, hook)``; ``out`` (``bf16[T, H]``) receives the result if given.

        ``use_logfmt`` is accepted for compatibility; the payload always travels as lossless BF16."""
        wst = combine_wait_recv_cost_stats
        try:  # the repeat of a call seen before (as in low_latency_dispatch); the handle by identity
            key = (id(handle), self._sigs(None if zero_copy else x, topk_idx, topk_weights, out, wst),
                   bool(zero_copy), self._ll_calls & 1, return_recv_hook, async_finish)
        except (AttributeError, TypeError):  # not tensors: the checks below say which
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
