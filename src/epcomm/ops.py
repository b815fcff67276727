"""Differentiable, functional dispatch and combine, registered as ``torch.library`` custom ops.

Letters: ``T`` tokens on this rank, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks,
``L = E / R`` local experts, ``C`` channels, ``N`` rows this rank receives (data-dependent, or
``num_worst_tokens`` when that is > 0).

Three ops live in the ``epcomm`` namespace, each with a fake (meta) implementation so that
``torch.compile`` and ``FakeTensorMode`` can trace them, and with autograd formulas:

- ``epcomm::dispatch``: ``d recv_x -> d x`` is a **combine** of the received-row gradients (the
  adjoint of "copy each token to every rank holding one of its experts" is "sum what those ranks
  send back"); ``d recv_topk_weights -> d topk_weights`` is combine's weight path, each slot taken
  from the one rank that holds its expert. ``topk_idx`` has no gradient.
- ``epcomm::combine``: ``d combined_x -> d x`` is a **cached dispatch** of the output gradient;
  ``d combined_topk_weights -> d topk_weights`` rides in the same cached dispatch (the float32 rows
  travel as raw bytes next to the BF16 gradient, so it is one exchange, bit-exact).
- ``epcomm::cached_dispatch``: its backward is a combine.

An op cannot take a ``Buffer`` (not a tensor), so it takes an int ``buffer_id``:
:func:`register_buffer` gives one (idempotent; the wrappers call it for you). The registry holds
weak references, so it never keeps a ``Buffer`` alive. Under ``torch.compile`` the first sight of a
Buffer is one graph break (registration must really run); with ``fullgraph=True`` call
:func:`register_buffer` once before the first compiled call.

The Python wrappers :func:`dispatch`, :func:`combine` and :func:`cached_dispatch` are the API:

    >>> out = epcomm.ops.dispatch(buf, x, topk_idx, topk_weights, num_experts=E)
    >>> y = experts(out.recv_x, out.recv_topk_idx, out.recv_topk_weights)   # bf16[N, H]
    >>> z = epcomm.ops.combine(buf, y, out.handle).combined_x                # bf16[T, H]
    >>> z.float().sum().backward()                                          # x.grad, topk_weights.grad

These ops are collectives: every rank must call them in the same order, and backward must run on
every rank through the same ops with the same ``requires_grad`` pattern (``x`` and
``topk_weights`` each requiring grad on all ranks or on none), since each backward is itself a
collective. They are marked side-effectful so that a compiler never drops one on some ranks only.
``num_channels`` (``C``) in the handle shapes is ``Buffer.get_dispatch_config(R).num_channels``,
read when the op runs (or is traced): change ``Buffer.set_num_sms`` only between compilations.
"""

from __future__ import annotations

import itertools
import weakref
from typing import NamedTuple

import torch

from . import _validate as V
from .buffer import Buffer
from .config import MAX_TOPK
from .layout import DispatchHandle

__all__ = [
    "CombineOutput",
    "DispatchOutput",
    "cached_dispatch",
    "combine",
    "dispatch",
    "get_buffer",
    "register_buffer",
]

# ----------------------------------------------------------------------------- buffer registry

_BUFFERS: dict[int, weakref.ref] = {}
_IDS = itertools.count(1)
# The id lives on the Buffer as a *string*: torch.compile reads it as a constant and guards on it,
# whereas an int attribute would turn into a symbolic int once a second Buffer shows up.
_KEY_ATTR = "_epcomm_ops_key"


def register_buffer(buffer: Buffer) -> int:
    """Return the int id the ``epcomm::*`` ops use for ``buffer`` (the same id on every call).

    The wrappers call it for you. Under ``torch.compile`` a Buffer's first registration is a graph
    break (it must really happen, not be traced), so with ``fullgraph=True`` call this once first.
    """
    if not isinstance(buffer, Buffer):
        raise TypeError(f"buffer must be an epcomm.Buffer, got {type(buffer).__name__}")
    key = getattr(buffer, _KEY_ATTR, None)
    if key is None:
        bid = next(_IDS)
        _BUFFERS[bid] = weakref.ref(buffer)
        key = str(bid)
        setattr(buffer, _KEY_ATTR, key)
    return int(key)


@torch.compiler.disable
def _register_key(buffer) -> str:
    register_buffer(buffer)
    return getattr(buffer, _KEY_ATTR)


def _buffer_id(buffer) -> int:
    """``register_buffer`` in a form torch.compile traces to a constant: a graph break only the
    first time it sees a Buffer, and a string (never a symbolic int) crossing that break."""
    return int(getattr(buffer, _KEY_ATTR, None) or _register_key(buffer))


def get_buffer(buffer_id: int) -> Buffer:
    """The live ``Buffer`` registered under ``buffer_id``; ``ValueError`` if there is none."""
    ref = _BUFFERS.get(buffer_id)
    buf = ref() if ref is not None else None
    if buf is None:
        raise ValueError(f"buffer_id={buffer_id!r} names no live Buffer: get ids from epcomm.ops.register_buffer")
    return buf


# ----------------------------------------------------------------------------- argument checks
# Shape and dtype only (they work on fake tensors and never synchronise); value checks
# (topk_idx in [-1, E)) happen in Buffer when the op really runs.


def _check_dispatch(buf: Buffer, x, topk_idx, topk_weights, num_experts, num_worst_tokens) -> None:
    V.tensor("x", x, torch.bfloat16, 2, buf.device)
    V.hidden(x.shape[1], False)
    V.tensor("topk_idx", topk_idx, torch.int64, 2, buf.device)
    V.rows_agree((("x", x), ("topk_idx", topk_idx)))
    if topk_idx.shape[1] > MAX_TOPK:
        raise ValueError(f"topk_idx has top-k {topk_idx.shape[1]}; at most {MAX_TOPK} is supported")
    V.topk_weights(topk_weights, topk_idx, buf.device)
    V.num_experts(num_experts, buf.group_size)
    V.int_arg("num_worst_tokens", num_worst_tokens, 0)


def _as_handle(handle) -> DispatchHandle:
    if isinstance(handle, DispatchHandle):
        return handle
    if isinstance(handle, (tuple, list)) and len(handle) == 6 and all(isinstance(t, torch.Tensor) for t in handle):
        return DispatchHandle(*handle)
    raise TypeError(f"handle must be the DispatchHandle dispatch returned, got {type(handle).__name__}")


def _check_handle(buf: Buffer, h: DispatchHandle) -> None:
    r_ = buf.group_size
    V.tensor("handle.rank_prefix_matrix", h.rank_prefix_matrix, torch.int32, 2, buf.device)
    V.shape("handle.rank_prefix_matrix", h.rank_prefix_matrix, (r_, r_))
    V.tensor("handle.recv_src_idx", h.recv_src_idx, torch.int32, 1, buf.device)
    V.tensor("handle.is_token_in_rank", h.is_token_in_rank, torch.bool, 2, buf.device)
    if h.is_token_in_rank.shape[1] != r_:
        raise ValueError(f"handle.is_token_in_rank must have {r_} columns (one per rank), got shape "
                         f"{tuple(h.is_token_in_rank.shape)}")


def _check_rows(name: str, t: torch.Tensor, dtype: torch.dtype, rows, buf: Buffer) -> None:
    V.tensor(name, t, dtype, 2, buf.device)
    if t.shape[0] != rows:
        raise ValueError(f"{name} must have the {rows} rows of the handle, got shape {tuple(t.shape)}")


def _check_combine(buf: Buffer, x, h: DispatchHandle, topk_weights) -> None:
    _check_handle(buf, h)
    _check_rows("x", x, torch.bfloat16, h.recv_src_idx.shape[0], buf)
    V.hidden(x.shape[1], False)
    if topk_weights is not None:
        _check_rows("topk_weights", topk_weights, torch.float32, h.recv_src_idx.shape[0], buf)


def _check_cached_dispatch(buf: Buffer, x, h: DispatchHandle) -> None:
    _check_handle(buf, h)
    _check_rows("x", x, torch.bfloat16, h.is_token_in_rank.shape[0], buf)
    V.hidden(x.shape[1], False)


def _fresh(outputs: list[torch.Tensor], inputs: list) -> list[torch.Tensor]:
    """Custom-op outputs may not alias inputs or each other: clone any that share storage (and every
    empty one: empty tensors carved from one buffer share its storage, and cloning them is free)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor) and t.numel()}
    out = []
    for t in outputs:
        if t.numel() == 0:
            t = t.clone()
        else:
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = t.clone()
                ptr = t.untyped_storage().data_ptr()
            seen.add(ptr)
        out.append(t)
    return out


def _count_per_expert(recv_topk_idx: torch.Tensor, num_local: int) -> torch.Tensor:
    """``int64[N, K]`` local ids (``-1`` = elsewhere) → ``int32[L]`` (selections per local expert)."""
    bins = torch.where(recv_topk_idx >= 0, recv_topk_idx, torch.full_like(recv_topk_idx, num_local))
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=recv_topk_idx.device)
    counts.scatter_add_(0, bins.reshape(-1), torch.ones_like(bins).reshape(-1))
    return counts[:num_local].to(torch.int32)


# ----------------------------------------------------------------------------- the ops

_HANDLE_ARGS = ("Tensor rank_prefix_matrix, Tensor channel_prefix_matrix, Tensor recv_channel_prefix_matrix, "
                "Tensor recv_src_idx, Tensor is_token_in_rank, Tensor send_head")


@torch.library.custom_op(
    "epcomm::dispatch", mutates_args=(),
    schema="(int buffer_id, Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, "
           "int num_worst_tokens) -> (Tensor, Tensor, Tensor, Tensor, " + ", ".join(["Tensor"] * 6) + ")",
)
def _dispatch_op(buffer_id, x, topk_idx, topk_weights, num_experts, num_worst_tokens):
    """Returns ``(recv_x bf16[N, H], recv_topk_idx int64[N, K], recv_topk_weights f32[N, K],
    num_recv_tokens_per_expert int32[L], *handle)`` (the six ``DispatchHandle`` tensors)."""
    buf = get_buffer(buffer_id)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=num_worst_tokens)
    counts = _count_per_expert(recv_idx, num_experts // buf.group_size)
    return tuple(_fresh([recv_x, recv_idx, recv_w, counts, *handle], [x, topk_idx, topk_weights]))


@_dispatch_op.register_fake
def _(buffer_id, x, topk_idx, topk_weights, num_experts, num_worst_tokens):
    buf = get_buffer(buffer_id)
    _check_dispatch(buf, x, topk_idx, topk_weights, num_experts, num_worst_tokens)
    t, h = x.shape
    k = topk_idx.shape[1]
    r_ = buf.group_size
    c = buf.get_dispatch_config(r_).num_channels
    n = num_worst_tokens if num_worst_tokens > 0 else torch.library.get_ctx().new_dynamic_size()
    i32 = {"dtype": torch.int32, "device": x.device}
    return (
        x.new_empty(n, h), topk_idx.new_empty(n, k), topk_weights.new_empty(n, k),
        torch.empty(num_experts // r_, **i32),
        torch.empty(r_, r_, **i32), torch.empty(r_, c, **i32), torch.empty(r_, c, **i32), torch.empty(n, **i32),
        torch.empty(t, r_, dtype=torch.bool, device=x.device), torch.empty(t, r_, **i32),
    )


@torch.library.custom_op(
    "epcomm::combine", mutates_args=(),
    schema=f"(int buffer_id, Tensor x, {_HANDLE_ARGS}, Tensor? topk_weights) -> (Tensor, Tensor)",
)
def _combine_op(buffer_id, x, rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
                recv_src_idx, is_token_in_rank, send_head, topk_weights):
    """Returns ``(combined_x bf16[T, H], combined_topk_weights f32[T, K])``; ``f32[T, 0]`` without
    ``topk_weights`` (an op cannot return ``None``)."""
    buf = get_buffer(buffer_id)
    handle = DispatchHandle(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
                            is_token_in_rank, send_head)
    out, w, _ = buf.combine(x, handle, topk_weights=topk_weights)
    if w is None:
        w = torch.zeros(is_token_in_rank.shape[0], 0, dtype=torch.float32, device=x.device)
    return tuple(_fresh([out, w], [x, *handle, topk_weights]))


@_combine_op.register_fake
def _(buffer_id, x, rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
      is_token_in_rank, send_head, topk_weights):
    buf = get_buffer(buffer_id)
    handle = DispatchHandle(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
                            is_token_in_rank, send_head)
    _check_combine(buf, x, handle, topk_weights)
    t = is_token_in_rank.shape[0]
    k = 0 if topk_weights is None else topk_weights.shape[1]
    return x.new_empty(t, x.shape[1]), torch.empty(t, k, dtype=torch.float32, device=x.device)


@torch.library.custom_op(
    "epcomm::cached_dispatch", mutates_args=(),
    schema=f"(int buffer_id, Tensor x, {_HANDLE_ARGS}) -> Tensor",
)
def _cached_dispatch_op(buffer_id, x, rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
                        recv_src_idx, is_token_in_rank, send_head):
    """``x bf16[T, H]`` → ``recv_x bf16[N, H]`` laid out as the dispatch that made the handle."""
    buf = get_buffer(buffer_id)
    handle = DispatchHandle(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
                            is_token_in_rank, send_head)
    recv_x = buf.dispatch(x, handle=handle)[0]
    return _fresh([recv_x], [x, *handle])[0]


@_cached_dispatch_op.register_fake
def _(buffer_id, x, rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
      is_token_in_rank, send_head):
    buf = get_buffer(buffer_id)
    handle = DispatchHandle(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
                            is_token_in_rank, send_head)
    _check_cached_dispatch(buf, x, handle)
    return x.new_empty(recv_src_idx.shape[0], x.shape[1])


# ----------------------------------------------------------------------------- autograd


def _f32_as_bf16(w: torch.Tensor) -> torch.Tensor:
    """``f32[T, K]`` → ``bf16[T, 2K']`` (the same bytes, ``K'`` = ``K`` rounded up to 4 so rows stay
    16-byte multiples). Dispatch is a byte copy, so the float32 values arrive exactly."""
    k = w.shape[1]
    pad = (-k) % 4
    if pad:
        w = torch.cat([w, w.new_zeros(w.shape[0], pad)], dim=1)
    return w.contiguous().view(torch.bfloat16)


def _bf16_as_f32(b: torch.Tensor, k: int) -> torch.Tensor:
    return b.contiguous().view(torch.float32)[:, :k]


def _dispatch_setup(ctx, inputs, output):
    ctx.buffer_id = inputs[0]
    ctx.x_shape = inputs[1].shape
    ctx.w_shape = inputs[3].shape
    ctx.save_for_backward(output[1], *output[4:])


def _dispatch_backward(ctx, grad_recv_x, _g_idx, grad_recv_w, *_g_rest):
    recv_idx, *handle = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[1], ctx.needs_input_grad[3]
    if not (need_x or need_w):
        return None, None, None, None, None, None
    n = handle[3].shape[0]
    if grad_recv_x is None:
        grad_recv_x = torch.zeros(n, ctx.x_shape[1], dtype=torch.bfloat16, device=recv_idx.device)
    w = None
    if need_w:
        # A slot's weight reached only the rank holding its expert; elsewhere it was zeroed (a constant).
        w = torch.zeros_like(recv_idx, dtype=torch.float32) if grad_recv_w is None else grad_recv_w
        w = torch.where(recv_idx >= 0, w, torch.zeros_like(w)).contiguous()
    gx, gw = torch.ops.epcomm.combine(ctx.buffer_id, grad_recv_x.contiguous(), *handle, w)
    return None, (gx if need_x else None), None, (gw if need_w else None), None, None


def _combine_setup(ctx, inputs, output):
    ctx.buffer_id = inputs[0]
    ctx.x_shape = inputs[1].shape
    ctx.k = None if inputs[8] is None else inputs[8].shape[1]
    ctx.save_for_backward(*inputs[2:8])


def _combine_backward(ctx, grad_out, grad_w):
    handle = ctx.saved_tensors
    need_x = ctx.needs_input_grad[1]
    need_w = ctx.k is not None and ctx.needs_input_grad[8]
    none_handle = (None,) * 6
    if not (need_x or need_w):
        return (None, None, *none_handle, None)
    t, h = handle[4].shape[0], ctx.x_shape[1]
    parts = []
    if need_x:
        if grad_out is None:
            grad_out = torch.zeros(t, h, dtype=torch.bfloat16, device=handle[4].device)
        parts.append(grad_out)
    if need_w:
        if grad_w is None:
            grad_w = torch.zeros(t, ctx.k, dtype=torch.float32, device=handle[4].device)
        parts.append(_f32_as_bf16(grad_w))
    send = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=1)
    recv = torch.ops.epcomm.cached_dispatch(ctx.buffer_id, send, *handle)
    gx = recv[:, :h] if need_x else None
    gw = _bf16_as_f32(recv[:, h if need_x else 0:], ctx.k) if need_w else None
    return (None, gx, *none_handle, gw)


def _cached_dispatch_setup(ctx, inputs, output):
    ctx.buffer_id = inputs[0]
    ctx.save_for_backward(*inputs[2:8])


def _cached_dispatch_backward(ctx, grad_recv):
    handle = ctx.saved_tensors
    if not ctx.needs_input_grad[1]:
        return (None,) * 8
    gx, _ = torch.ops.epcomm.combine(ctx.buffer_id, grad_recv.contiguous(), *handle, None)
    return (None, gx, *(None,) * 6)


torch.library.register_autograd("epcomm::dispatch", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd("epcomm::combine", _combine_backward, setup_context=_combine_setup)
torch.library.register_autograd("epcomm::cached_dispatch", _cached_dispatch_backward,
                                setup_context=_cached_dispatch_setup)

# Collectives: a compiler must never drop one as dead code (some ranks would then wait forever).
_has_side_effect = getattr(torch.fx.node, "has_side_effect", None)
if _has_side_effect is not None:
    for _op in (torch.ops.epcomm.dispatch.default, torch.ops.epcomm.combine.default,
                torch.ops.epcomm.cached_dispatch.default):
        _has_side_effect(_op)


# ----------------------------------------------------------------------------- Python API


class DispatchOutput(NamedTuple):
    """What :func:`dispatch` returns.

    - ``recv_x bf16[N, H]``: rows by source rank ascending, then source token ascending.
    - ``recv_topk_idx int64[N, K]``: local expert ids ``0..L-1``, ``-1`` where not on this rank
      (and on the padding rows past the real count when ``num_worst_tokens > 0``).
    - ``recv_topk_weights f32[N, K]``: zero wherever ``recv_topk_idx == -1``.
    - ``num_recv_tokens_per_expert int32[L]``: selections per local expert (a tensor: no host sync).
    - ``handle``: the :class:`~epcomm.DispatchHandle` for :func:`combine` / :func:`cached_dispatch`.
    """

    recv_x: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor
    num_recv_tokens_per_expert: torch.Tensor
    handle: DispatchHandle


class CombineOutput(NamedTuple):
    """What :func:`combine` returns: ``combined_x bf16[T, H]``; ``combined_topk_weights f32[T, K]``,
    or ``None`` when no ``topk_weights`` were given."""

    combined_x: torch.Tensor
    combined_topk_weights: torch.Tensor | None


def dispatch(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             num_experts: int, num_worst_tokens: int = 0) -> DispatchOutput:
    """Send each token to every rank holding one of its experts; differentiable in ``x`` and
    ``topk_weights`` (the backward is a combine).

    - ``x bf16[T, H]`` (``H`` a multiple of 8), ``topk_idx int64[T, K]`` (``-1`` = no expert),
      ``topk_weights f32[T, K]``, ``num_experts`` = ``E`` (a multiple of ``R``).
    - ``num_worst_tokens > 0``: every output has exactly that many rows (no data-dependent shape,
      what ``torch.compile`` and CUDA graphs like best); it must be at least the real count.
      ``0``: ``N`` is the real count (an unbacked size under ``torch.compile``).

    Same layout as ``Buffer.dispatch`` (bit-identical). Returns a :class:`DispatchOutput`.
    """
    bid = _buffer_id(buffer)
    _check_dispatch(buffer, x, topk_idx, topk_weights, num_experts, num_worst_tokens)
    out = torch.ops.epcomm.dispatch(bid, x, topk_idx, topk_weights, num_experts, num_worst_tokens)
    return DispatchOutput(out[0], out[1], out[2], out[3], DispatchHandle(*out[4:]))


def combine(buffer: Buffer, x: torch.Tensor, handle: DispatchHandle,
            topk_weights: torch.Tensor | None = None) -> CombineOutput:
    """For each original token, the float32 sum of the rows returned by every rank that received
    it, rounded to BF16; differentiable in ``x`` and ``topk_weights`` (the backward is a cached
    dispatch).

    - ``x bf16[N, H]`` in the order :func:`dispatch` produced; ``handle`` from that dispatch.
    - ``topk_weights f32[N, K]`` (optional) are summed per slot the same way.

    Returns a :class:`CombineOutput`: ``combined_x bf16[T, H]``, ``combined_topk_weights f32[T, K]``
    or ``None``.
    """
    bid = _buffer_id(buffer)
    h = _as_handle(handle)
    _check_combine(buffer, x, h, topk_weights)
    out, w = torch.ops.epcomm.combine(bid, x, *h, topk_weights)
    return CombineOutput(out, None if topk_weights is None else w)


def cached_dispatch(buffer: Buffer, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """``x bf16[T, H]`` → ``recv_x bf16[N, H]``, laid out as the dispatch that made ``handle``
    (no routing exchange); differentiable in ``x`` (the backward is a combine)."""
    bid = _buffer_id(buffer)
    h = _as_handle(handle)
    _check_cached_dispatch(buffer, x, h)
    return torch.ops.epcomm.cached_dispatch(bid, x, *h)
