"""Argument checks shared by ``Buffer`` and ``epcomm.ops``: ``TypeError``/``ValueError`` naming the
argument and the offending value. Shape and dtype checks never synchronise with the GPU; value
checks (``topk_idx`` range) do, so they are skipped while a CUDA graph is being captured."""

from __future__ import annotations

import torch

from .config import MAX_TOPK


def is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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
