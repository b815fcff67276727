"""The argument checks of ``ElasticBuffer``'s calls (DeepEP V2's API) and the kinds of call they depend on.

A call's checks depend only on its kind: the tensors' shapes, dtypes, devices, contiguity and 16-byte
alignment, the handle's layout, and every other argument (:func:`dispatch_key`, :func:`combine_key`);
not on values, unless expert ids are checked on the host. ``ElasticBuffer`` checks a kind's first call
here and keeps its plan for the repeats. Each check raises ``TypeError``/``ValueError`` naming the
argument and the offending value.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``LE = E/R``,
``M`` = ``num_max_tokens_per_rank``.
"""

from __future__ import annotations

import torch

from . import _validate as V
from . import elastic_layout as EL
from .elastic_handle import EPHandle
from .event import EventHandle, EventOverlap


def flag(name: str, v) -> bool:
    if v is True or v is False:  # (the common case, first: one comparison)
        return v
    if not isinstance(v, (bool, int)) or isinstance(v, int) and not isinstance(v, bool) and v not in (0, 1):
        raise TypeError(f"{name} must be a bool, got {v!r}")
    return bool(v)


def event(name: str, ev):
    if ev is None or isinstance(ev, EventHandle):
        return ev
    if isinstance(ev, EventOverlap):  # DeepEP wants the raw EventHandle; an EventOverlap is harmless here
        return ev.event if isinstance(ev.event, EventHandle) or ev.event is None else _Recorded(ev.event)
    raise TypeError(f"{name} must be an EventHandle (ElasticBuffer.capture()), got {type(ev).__name__}")


class _Recorded:
    """A ``torch.cuda.Event`` behind ``EventHandle``'s interface."""

    def __init__(self, ev):
        self.event = ev

    def current_stream_wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)

    def wait(self, stream=None) -> None:
        self.event.wait(stream)


# ----------------------------------------------------------------------------- kinds of call


def dispatch_key(data, sf, topk_idx, topk_weights, cum, handle, rest: tuple, sigs=V.signatures) -> tuple:
    """The kind of a dispatch (``rest``: its other arguments, as given): what its checks and its plan depend
    on. A fresh dispatch's includes ``topk_idx`` and ``cum``; a cached one's the handle's layout and top-k
    shape (its owner is checked at each call: :func:`owned`). ``sigs``: ``_validate.signatures`` or the extension's.
    Raises ``AttributeError``/``TypeError`` for arguments that are not what they should be (the checks then say
    which)."""
    if handle is None:
        return sigs(data, sf, topk_weights, topk_idx, cum), rest
    return (sigs(data, sf, topk_weights), rest, handle.do_expand, handle.num_experts, handle.expert_alignment,
            handle.num_max_tokens_per_rank, handle.topk_idx.shape, topk_idx is None, cum is None)


def combine_key(x, handle, topk_weights, bias, rest: tuple, sigs=V.signatures) -> tuple:
    """The kind of a combine (as :func:`dispatch_key`'s): the handle's layout and rows, ``x``, the weights and
    the biases."""
    st = handle._state
    return ("combine", sigs(x, topk_weights), sigs(bias) if bias is None or isinstance(bias, torch.Tensor) else
            (len(bias), sigs(*bias)), handle.do_expand, handle.topk_idx.shape, handle.num_experts,
            handle.num_max_tokens_per_rank, handle.num_sms, st.num_rows, st.num_expanded, rest)


def owned(handle, eb) -> bool:
    """``handle`` is an ``EPHandle`` that a dispatch of ``eb`` returned."""
    return type(handle) is EPHandle and handle._owner is eb and handle._state is not None


def biases(bias) -> tuple:
    """``bias`` (None, a tensor, or one or two of them, None allowed) as a tuple of the tensors given."""
    if bias is None:
        return ()
    return tuple(b for b in (bias if isinstance(bias, (tuple, list)) else (bias,)) if b is not None)


# ----------------------------------------------------------------------------- checks


def common(eb, x, do_expand, do_zero_padding, async_with_compute_stream, allocate_on_comm_stream, tma,
           previous_event, before_epilogue, num_sms, num_qps):
    """The checks of every dispatch: ``x`` (BF16 ``[T, H]``, or the FP8 pair ``(x, sf)``), the flags, the events
    and the SM and QP counts. Returns ``(x data, sf or None, do_expand, do_zero_padding, async, tma, previous event, event
    before the epilogue)``."""
    if isinstance(x, (tuple, list)) and len(x) != 2:
        raise ValueError(f"x as a tuple must be (x, sf), got {len(x)} items")
    data, sf = (x if isinstance(x, (tuple, list)) else (x, None))
    # DeepEP V2's dtypes: x BF16, or the FP8 pair (x float8_e4m3fn, sf of 4-byte packs)
    want = torch.bfloat16 if sf is None else torch.float8_e4m3fn
    if isinstance(data, torch.Tensor) and data.dtype != want:
        raise TypeError(f"x must have dtype torch.bfloat16, or be the FP8 pair (x, sf), got {data.dtype}"
                        if sf is None else f"x of the pair (x, sf) must have dtype torch.float8_e4m3fn, got {data.dtype}")
    V.tensor("x", data, want, 2, eb.device)
    if sf is not None:
        if not isinstance(sf, torch.Tensor) or sf.element_size() != 4:
            raise TypeError(f"sf must be a tensor of 4-byte scale packs (fp32 or int32), got "
                            f"{getattr(sf, 'dtype', type(sf).__name__)}")
        V.tensor("sf", sf, sf.dtype, 2, eb.device)  # (its rows: against x's and topk_idx's, fresh / cached)
    expand = flag("do_expand", do_expand)
    zero_pad = flag("do_zero_padding", do_zero_padding)
    async_ = flag("async_with_compute_stream", async_with_compute_stream)
    alloc = flag("allocate_on_comm_stream", allocate_on_comm_stream)
    tma = flag("use_tma_aligned_col_major_sf", tma)
    if zero_pad and not expand:
        raise ValueError("do_zero_padding=True needs do_expand=True")
    prev, before = events(previous_event, before_epilogue, alloc)
    sms_qps(eb, num_sms, num_qps)
    return data, sf, expand, zero_pad, async_, tma, prev, before


def fresh(eb, data, sf, topk_idx, topk_weights, cum, num_experts, m, expert_alignment, do_cpu_sync):
    """The checks of a dispatch without a handle (after :func:`common`). Returns ``(E, M, alignment, CPU
    sync, K)``."""
    t, h = data.shape
    e = V.num_experts(num_experts, eb.num_ranks) if num_experts is not None else None
    if e is None:
        raise ValueError("num_experts is required without a handle, got None")
    if e > EL.MAX_EXPERTS or e // eb.num_ranks > EL.MAX_LOCAL_EXPERTS:
        raise ValueError(f"num_experts={e} exceeds the limits ({EL.MAX_EXPERTS} experts, "
                         f"{EL.MAX_LOCAL_EXPERTS} a rank)")
    m = tokens_arg(eb, m, t)
    a = 1 if expert_alignment is None else V.int_arg("expert_alignment", expert_alignment, 1)
    sync = True if do_cpu_sync is None else flag("do_cpu_sync", do_cpu_sync)
    if topk_idx is None:
        raise ValueError("topk_idx is required without a handle, got None")
    V.rows_agree((("x", data), ("topk_idx", topk_idx), ("sf", sf)))
    V.topk_idx(topk_idx, t, e, eb.device, check_values=eb._host_checks)
    k = topk_idx.shape[1]
    if k < 1:
        raise ValueError(f"topk_idx must have 1 to {EL.MAX_TOPK} columns, got shape {tuple(topk_idx.shape)}")
    if eb._host_checks and k > 1 and t and not V.is_capturing(eb.device):
        s = torch.sort(topk_idx, 1).values
        dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any(1)
        if bool(dup.any()):
            row = int(dup.nonzero()[0, 0])
            raise ValueError(f"topk_idx repeats an expert within token {row}: {topk_idx[row].tolist()}")
    if topk_weights is not None:
        V.topk_weights(topk_weights, topk_idx, eb.device)
    if cum is not None:
        V.tensor("cumulative_local_expert_recv_stats", cum, torch.int32, 1, eb.device)
        V.shape("cumulative_local_expert_recv_stats", cum, (e // eb.num_ranks,))
    check_fits(eb, m, h, k, sf is not None)
    return e, m, a, sync, k


def cached(eb, hd, data, sf, topk_idx, topk_weights, cum, num_experts, m, a, do_cpu_sync, do_expand) -> None:
    """The checks of a dispatch on a handle (after :func:`common`)."""
    if not isinstance(hd, EPHandle) or hd._state is None:
        raise TypeError(f"handle must be the EPHandle a dispatch returned, got {type(hd).__name__}")
    if hd._owner is not eb:
        raise ValueError("handle was made by another ElasticBuffer")
    if topk_idx is not None:
        raise ValueError("topk_idx must be None with a handle (the handle's is used)")
    if do_cpu_sync:
        raise ValueError(f"do_cpu_sync={do_cpu_sync!r} cannot be used with a cached handle")
    if cum is not None:
        raise ValueError("cumulative_local_expert_recv_stats must be None with a cached handle")
    for name, given, own in (("num_experts", num_experts, hd.num_experts),
                             ("expert_alignment", a, hd.expert_alignment),
                             ("num_max_tokens_per_rank", m, hd.num_max_tokens_per_rank)):
        if given is not None and given != own:
            raise ValueError(f"{name}={given!r} differs from the handle's {own}")
    if do_expand != hd.do_expand:
        raise ValueError(f"do_expand={do_expand} differs from the handle's layout (do_expand={hd.do_expand})")
    t, k = hd.topk_idx.shape
    if data.shape[0] != t:
        raise ValueError(f"x has {data.shape[0]} tokens but the handle was made for {t}")
    V.rows_agree((("sf", sf), ("x", data)))  # (x agrees with the handle: a tie blames sf)
    if topk_weights is not None:
        V.topk_weights(topk_weights, hd.topk_idx, eb.device)
    check_fits(eb, hd.num_max_tokens_per_rank, data.shape[1], k, sf is not None)


def combine(eb, x, handle, topk_weights, bias, async_with_compute_stream, allocate_on_comm_stream, previous_event,
            before_epilogue, num_sms, num_qps):
    """The checks of a combine. Returns ``(async, previous event, event before the epilogue)``."""
    if not isinstance(handle, EPHandle) or handle._state is None:
        raise TypeError(f"handle must be the EPHandle a dispatch returned, got {type(handle).__name__}")
    if handle._owner is not eb:
        raise ValueError("handle was made by another ElasticBuffer")
    st = handle._state
    V.tensor("x", x, torch.bfloat16, 2, eb.device)
    t, k = handle.topk_idx.shape
    expand = handle.do_expand
    if expand and x.shape[0] < st.num_expanded:
        raise ValueError(f"x must cover the {st.num_expanded} expanded rows of the dispatch, got shape "
                         f"{tuple(x.shape)}")
    if not expand and x.shape[0] != st.num_rows:
        raise ValueError(f"x must have the {st.num_rows} rows the dispatch returned, got shape {tuple(x.shape)}")
    if topk_weights is not None:
        if expand and not eb.allow_multiple_reduction:
            raise ValueError("topk_weights cannot travel back through an expanded combine with "
                             "allow_multiple_reduction=False (every row travels on its own)")
        V.tensor("topk_weights", topk_weights, torch.float32, 1 if expand else 2, eb.device)
        want = (x.shape[0],) if expand else (st.num_rows, k)
        V.shape("topk_weights", topk_weights, want)
    given = () if bias is None else (tuple(bias) if isinstance(bias, (tuple, list)) else (bias,))
    if len(given) > 2:
        raise ValueError(f"bias takes one or two tensors, got {len(given)}")
    for i, b in enumerate(given):
        if b is not None:
            V.tensor(f"bias[{i}]", b, torch.bfloat16, 2, eb.device)
            V.shape(f"bias[{i}]", b, (t, x.shape[1]))
    async_ = flag("async_with_compute_stream", async_with_compute_stream)
    prev, before = events(previous_event, before_epilogue, flag("allocate_on_comm_stream", allocate_on_comm_stream))
    sms_qps(eb, num_sms, num_qps)
    return async_, prev, before


def events(previous_event, before_epilogue, alloc: bool):
    prev = event("previous_event", previous_event)
    before = event("previous_event_before_epilogue", before_epilogue)
    if previous_event is not None and not alloc:
        raise ValueError("previous_event needs allocate_on_comm_stream=True (as in DeepEP)")
    return prev, before


def sms_qps(eb, num_sms, num_qps) -> None:
    V.int_arg("num_sms", num_sms, 0)
    V.int_arg("num_qps", num_qps, 0)
    if num_qps > eb.num_allocated_qps:
        raise ValueError(f"num_qps={num_qps} exceeds num_allocated_qps={eb.num_allocated_qps}")
    if eb.device_sms and num_sms > eb.device_sms:
        raise ValueError(f"num_sms={num_sms} exceeds the device's SMs")


def tokens_arg(eb, m, t: int) -> int:
    m = eb.num_max_tokens_per_rank if m is None else V.int_arg("num_max_tokens_per_rank", m, 1)
    if m < 1:
        raise ValueError("num_max_tokens_per_rank must be given (here or to the constructor), got 0")
    if t > m:
        raise ValueError(f"x has {t} tokens, more than num_max_tokens_per_rank={m}")
    return m


def check_fits(eb, m: int, h: int, k: int, fp8: bool) -> None:
    if (m, h, k, fp8) in eb._fits:
        return
    need = eb._size_for(m, h, k, fp8)
    if need > eb.num_bytes:
        raise ValueError(f"num_bytes={eb.num_bytes} is too small for num_max_tokens_per_rank={m}, hidden={h}, "
                         f"num_topk={k}: get_buffer_size_hint gives {need}")
    eb._fits.add((m, h, k, fp8))
