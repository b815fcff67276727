"""Argument checks shared by ``Buffer`` and ``epcomm.ops`` (each call's whole set: ``dispatch_args``,
``ll_dispatch_args``, ``ll_combine_args``): ``TypeError``/``ValueError`` naming the
argument and the offending value. Shape and dtype checks never synchronise with the GPU; value
checks (``topk_idx`` range) do, so they are skipped while a CUDA graph is being captured."""

from __future__ import annotations

import torch

from .config import MAX_TOPK
from .layout import DispatchHandle, LowLatencyHandle, dispatch_layout


def is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _not_capturing() -> bool:
    return False


def capturing_fn(device: torch.device):
    """``is_capturing(device)`` as a function of no argument, for the calls a buffer makes on its device: on a CUDA
    device PyTorch's own check of the current stream (what ``torch.cuda.is_current_stream_capturing`` calls)."""
    if device.type != "cuda":
        return _not_capturing
    return getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def int_arg(name: str, v, minimum: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {v!r}")
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def tensor(name: str, t, dtype: torch.dtype | tuple[torch.dtype, ...], dim: int | None = None,
           device: torch.device | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {want}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device.type != device.type:
        raise ValueError(f"{name} must be on {device}, got a tensor on {t.device}")
    return t


def shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def rows_agree(named) -> None:
    """The arguments ``named`` (``(name, value)`` pairs) that hold one row per token must agree on the row count;
    else ``ValueError`` naming the one that disagrees with the others: the count most of them hold is right
    (a tie: the first named is blamed). Values that are not 2-D tensors (``[T, ...]``, as every such argument is)
    are left to their own checks.

    Example: ``x`` of 63 rows and ``topk_idx``, ``is_token_in_rank`` of 64 (their layout) give "x has 63 rows but
    topk_idx has 64"; ``x`` of 63 rows and ``topk_idx`` of 64 alone, the same."""
    rows = [(n, v.shape[0]) for n, v in named if isinstance(v, torch.Tensor) and v.dim() == 2]
    distinct: list = []  # (compared, not hashed: under torch.compile the counts may be symbolic)
    for _, r in rows:
        if not any(r == d for d in distinct):
            distinct.append(r)
    if len(distinct) < 2:
        return
    counts = [sum(1 for _, r in rows if r == d) for d in distinct]
    right = [d for d, c in zip(distinct, counts) if c == max(counts)]
    if len(right) == 1:
        bad = next((n, r) for n, r in rows if r != right[0])
    else:  # a tie
        bad = rows[0]
    good = next((n, r) for n, r in rows if r != bad[1])
    raise ValueError(f"{bad[0]} has {bad[1]} rows but {good[0]} has {good[1]}")


def num_experts(e, num_ranks: int) -> int:
    int_arg("num_experts", e, 1)
    if e % num_ranks != 0:
        raise ValueError(f"num_experts={e} must be divisible by the number of ranks ({num_ranks})")
    return e


def topk_idx(t, num_tokens: int | None, e: int, device: torch.device, name: str = "topk_idx",
             check_values: bool = True) -> torch.Tensor:
    """Shape/dtype always; the value range only with ``check_values`` (a host sync on CUDA: backends
    that check on the device pass False and report a bad id at their next synchronisation)."""
    tensor(name, t, torch.int64, 2, device)
    if num_tokens is not None and t.shape[0] != num_tokens:
        raise ValueError(f"{name} must have {num_tokens} rows (one per token), got shape {tuple(t.shape)}")
    if t.shape[1] > MAX_TOPK:
        raise ValueError(f"{name} has top-k {t.shape[1]}; at most {MAX_TOPK} is supported")
    if check_values and t.numel() and not is_capturing(t.device):
        lo, hi = int(t.min()), int(t.max())
        if lo < -1 or hi >= e:
            bad = lo if lo < -1 else hi
            raise ValueError(f"{name} holds expert id {bad}, outside [-1, {e}) for num_experts={e}")
    return t


def topk_weights(t, idx: torch.Tensor, device: torch.device, name: str = "topk_weights") -> torch.Tensor:
    tensor(name, t, torch.float32, 2, device)
    shape(name, t, tuple(idx.shape))
    return t


def hidden(h: int, fp8: bool, what: str = "x") -> None:
    if fp8 and h % 128 != 0:
        raise ValueError(f"FP8 needs the hidden size of {what} to be a multiple of 128, got {h}")
    if not fp8 and h % 8 != 0:
        raise ValueError(f"the hidden size of {what} must be a multiple of 8 (16-byte rows), got {h}")


def dispatch_x(x, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``bf16[T, H]`` or ``(float8_e4m3fn[T, H], float32[T, H/128])`` → ``(x, scales or None)``."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"x as a tuple must be (fp8 data, scales), got {len(x)} items")
        data, scales = x
        tensor("x[0]", data, torch.float8_e4m3fn, 2, device)
        tensor("x[1]", scales, torch.float32, 2, device)
        t, h = data.shape
        hidden(h, True, "x[0]")
        shape("x[1]", scales, (t, h // 128))
        return data, scales
    tensor("x", x, torch.bfloat16, 2, device)
    hidden(x.shape[1], False)
    return x, None


def dispatch_args(t: int, r_: int, device, host_checks: bool, num_tokens_per_rank, num_tokens_per_rdma_rank,
                  is_token_in_rank, num_tokens_per_expert, idx, weights, expert_alignment,
                  num_worst_tokens) -> int:
    """The argument checks of a high-throughput dispatch without a handle (``t`` tokens, ``r_`` ranks);
    expert ids' values only with ``host_checks``. Returns the number of experts."""
    if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
        missing = [n for n, v in (("num_tokens_per_rank", num_tokens_per_rank),
                                  ("is_token_in_rank", is_token_in_rank),
                                  ("num_tokens_per_expert", num_tokens_per_expert)) if v is None]
        raise ValueError("dispatch without a handle needs num_tokens_per_rank, is_token_in_rank and "
                         "num_tokens_per_expert (from get_dispatch_layout); got None for "
                         f"{', '.join(missing)}")
    if num_tokens_per_rdma_rank is not None:
        tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, torch.int32, 1, device)
    tensor("num_tokens_per_rank", num_tokens_per_rank, torch.int32, 1, device)
    shape("num_tokens_per_rank", num_tokens_per_rank, (r_,))
    tensor("is_token_in_rank", is_token_in_rank, torch.bool, 2, device)
    shape("is_token_in_rank", is_token_in_rank, (t, r_))
    tensor("num_tokens_per_expert", num_tokens_per_expert, torch.int32, 1, device)
    e = num_tokens_per_expert.numel()
    num_experts(e, r_)
    if (idx is None) != (weights is None):
        raise ValueError("topk_idx and topk_weights must be given together, got "
                         f"topk_idx={'None' if idx is None else 'a tensor'}, "
                         f"topk_weights={'None' if weights is None else 'a tensor'}")
    if idx is not None:
        topk_idx(idx, t, e, device, check_values=host_checks)
        topk_weights(weights, idx, device)
    int_arg("expert_alignment", expert_alignment, 1)
    int_arg("num_worst_tokens", num_worst_tokens, 0)
    return e


def layout_mismatch(idx: torch.Tensor, is_token_in_rank: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                    r_: int) -> str | None:
    """What in ``is_token_in_rank bool[T, R]`` and ``num_tokens_per_expert int32[E]`` is not the layout of ``idx
    int64[T, K]`` (``get_dispatch_layout``'s; ids in range, checked before), for a ``ValueError``; None where they
    are. A layout made from other ids would send rows where none of their experts is. A host synchronisation on
    CUDA: for the reference backend, which checks it in its layout exchange (the GPU backends check
    ``is_token_in_rank`` on the device: error 12).

    Example (R = 2, E = 4): ``idx = [[0, 3], [1, -1]]`` has the layout ``is_token_in_rank = [[1, 1], [1, 0]]``,
    ``num_tokens_per_expert = [1, 1, 0, 1]``; ``is_token_in_rank = [[1, 0], [1, 0]]`` gives "is_token_in_rank
    does not match topk_idx: token 0 goes to ranks [0, 1] by topk_idx but to [0] by is_token_in_rank; ..."."""
    e = num_tokens_per_expert.numel()
    _, per_expert, in_rank = dispatch_layout(idx, e, r_)
    fix = "; pass the layout get_dispatch_layout made from this topk_idx"
    if not torch.equal(in_rank, is_token_in_rank):
        tok = int((in_rank != is_token_in_rank).any(1).nonzero()[0, 0])
        return (f"is_token_in_rank does not match topk_idx: token {tok} goes to ranks "
                f"{in_rank[tok].nonzero().flatten().tolist()} by topk_idx but to "
                f"{is_token_in_rank[tok].nonzero().flatten().tolist()} by is_token_in_rank" + fix)
    given = num_tokens_per_expert.to(per_expert.dtype)
    if not torch.equal(per_expert, given):
        ex = int((per_expert != given).nonzero()[0, 0])
        return (f"num_tokens_per_expert does not match topk_idx: expert {ex} has {int(per_expert[ex])} tokens by "
                f"topk_idx but {int(given[ex])} by num_tokens_per_expert" + fix)
    return None


def ll_dispatch_args(r_: int, device, host_checks: bool, x, idx, num_max_dispatch_tokens_per_rank,
                     n_experts, use_fp8, round_scale, use_ue8m0, cumulative_local_expert_recv_stats,
                     dispatch_wait_recv_cost_stats) -> tuple[int, int, int]:
    """The argument checks of ``low_latency_dispatch`` but the buffer's size (``r_`` ranks); returns
    ``(M, H, E)``."""
    m = int_arg("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
    e = num_experts(n_experts, r_)
    tensor("x", x, torch.bfloat16, 2, device)
    t, h = x.shape
    rows_agree((("x", x), ("topk_idx", idx)))
    if t > m:
        raise ValueError(f"x has {t} tokens, more than num_max_dispatch_tokens_per_rank={m}")
    hidden(h, bool(use_fp8))
    topk_idx(idx, t, e, device, check_values=host_checks)
    if use_ue8m0 and not (use_fp8 and round_scale):
        raise ValueError(f"use_ue8m0=True needs use_fp8=True and round_scale=True, got use_fp8={use_fp8}, "
                         f"round_scale={round_scale}")
    if round_scale and not use_fp8:
        raise ValueError(f"round_scale=True needs use_fp8=True, got use_fp8={use_fp8}")
    lx = e // r_
    if cumulative_local_expert_recv_stats is not None:
        tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, torch.int32, 1,
                 device)
        shape("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, (lx,))
    if dispatch_wait_recv_cost_stats is not None:
        tensor("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, torch.int64, 1,
                 device)
        shape("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, (r_,))
    return m, h, e


def ll_combine_args(r_: int, device, host_checks: bool, x, idx, weights, out,
                    combine_wait_recv_cost_stats, m: int, h: int, e: int) -> None:
    """The argument checks of ``low_latency_combine`` but the buffer's size (``m, h, e`` from the handle)."""
    lx = e // r_
    tensor("x", x, torch.bfloat16, 3, device)
    shape("x", x, (lx, r_ * m, h))
    topk_idx(idx, None, e, device, check_values=host_checks)
    t = idx.shape[0]
    if t > m:
        raise ValueError(f"topk_idx has {t} tokens, more than num_max_dispatch_tokens_per_rank={m}")
    topk_weights(weights, idx, device)
    if out is not None:
        tensor("out", out, torch.bfloat16, 2, device)
        shape("out", out, (t, h))
    if combine_wait_recv_cost_stats is not None:
        tensor("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, torch.int64, 1,
                 device)
        shape("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, (r_,))


def biases(given, t: int, h: int, device: torch.device) -> tuple:
    """A combine's ``bias``: None, one ``bf16[T, H]`` tensor, or a tuple/list of one or two (entries may be
    None, as DeepEP accepts ``(bias_0, None)``). Returns them as a tuple, None entries kept."""
    out = () if given is None else (tuple(given) if isinstance(given, (tuple, list)) else (given,))
    if len(out) > 2:
        raise ValueError(f"bias takes one or two tensors, got {len(out)}")
    for i, b in enumerate(out):
        if b is not None:
            tensor(f"bias[{i}]", b, torch.bfloat16, 2, device)
            shape(f"bias[{i}]", b, (t, h))
    return out


def tensor_signature(t) -> tuple | None:
    """A tensor's part of a call signature (shape, dtype, device index): the argument checks depend on no
    more; None for None. A call whose signature passed the checks before skips them."""
    return None if t is None else (t.shape, t.dtype, t.get_device())


def repeat_signature(t) -> tuple:
    """What a repeated call must share with the first of its kind, for one tensor argument: shape,
    dtype, device index, alignment (Triton specialises on it) and contiguity (``Buffer._remember``)."""
    return t.shape, t.dtype, t.get_device(), t.data_ptr() & 15, t.is_contiguous()


def call_signature(t) -> tuple | None:
    """``repeat_signature``, None for None (an optional argument)."""
    return None if t is None else repeat_signature(t)


def signatures(*ts) -> tuple:
    """Each argument's :func:`call_signature`: the part of a call's kind its tensors make (``native.key_functions``
    gives the same distinctions in one C++ call)."""
    return tuple(map(call_signature, ts))


def rows_signature(t) -> tuple | None:
    """``call_signature`` but the row count (``shape[0]``): the high-throughput combine's x and weights,
    a handle's received rows, whose count is no part of a kind of call."""
    return None if t is None else (t.shape[1:], t.dtype, t.get_device(), t.data_ptr() & 15, t.is_contiguous())


def row_signatures(*ts) -> tuple:
    """Each argument's :func:`rows_signature` (None for None)."""
    return tuple(None if t is None else rows_signature(t) for t in ts)


def as_dispatch_handle(handle) -> DispatchHandle:
    if isinstance(handle, DispatchHandle):
        return handle
    if isinstance(handle, (tuple, list)) and len(handle) == 6:
        return DispatchHandle(*handle)
    raise TypeError(f"handle must be the handle dispatch returned, got {type(handle).__name__}")


def as_low_latency_handle(handle) -> LowLatencyHandle:
    if isinstance(handle, LowLatencyHandle):
        return handle
    if isinstance(handle, (tuple, list)) and len(handle) == 5:
        return LowLatencyHandle(*handle)
    raise TypeError(f"handle must be the handle low_latency_dispatch returned, got {type(handle).__name__}")


def tensors_in(obj) -> list[torch.Tensor]:
    """The tensors in ``obj`` (a tensor, or tuples/lists/NamedTuples of them and other values); lists
    of plain numbers (e.g. the per-expert counts) are not walked item by item."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)) and obj and not isinstance(obj[0], (int, float)):
        return [t for o in obj for t in tensors_in(o)]
    return []
