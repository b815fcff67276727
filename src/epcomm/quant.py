"""Per-token, per-128-channel FP8 (e4m3) casts, power-of-two scales and UE8M0 packing. Pure torch.

Letters: ``T`` tokens, ``H`` hidden (a multiple of 128 for FP8), ``G = H / 128`` scale groups.

The arithmetic here is the definition every kernel must reproduce:
``amax = max(max|x[t, g*128:(g+1)*128]|, 1e-4)``, ``scale = amax / 448`` (rounded *up* to a power of
two when ``round_scale``), ``q = fp8(x / scale)``; ``x ≈ q * scale``.

Example (one token, H = 128, every value 1.0):
    amax = 1.0, scale = 1/448 ≈ 0.002232; q = 448.0 everywhere; with round_scale the scale
    becomes 2**-8 = 0.00390625 and q = 256.0.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
GROUP = 128


def check_fp8_hidden(hidden: int, what: str = "x") -> None:
    if hidden % GROUP != 0:
        raise ValueError(f"FP8 needs the hidden size of {what} to be a multiple of {GROUP}, got {hidden}")


def fp8_scales(x: torch.Tensor, round_scale: bool = False) -> torch.Tensor:
    """float32[T, G] scales of ``x: [T, H]`` (any float dtype)."""
    t, h = x.shape
    check_fp8_hidden(h)
    amax = x.float().abs().view(t, h // GROUP, GROUP).amax(dim=-1).clamp_min(AMAX_FLOOR)
    # A tensor divisor: true IEEE division on every device (a Python-number divisor becomes a
    # multiplication by its reciprocal on CUDA, which rounds differently).
    scale = amax / torch.full_like(amax, FP8_MAX)
    if round_scale:
        scale = round_up_pow2(scale)
    return scale


def round_up_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= ``scale`` (positive normal float32), exactly: keep the exponent when
    the mantissa is zero, else add one to it. (``exp2(ceil(log2(s)))`` can round log2 down to an
    integer for ``s`` just above a power of two.)"""
    bits = scale.contiguous().view(torch.int32)
    up = (bits & 0x7F800000) + torch.where((bits & 0x7FFFFF) != 0, 0x800000, 0)
    return up.to(torch.int32).view(torch.float32).view(scale.shape)


def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [T, H]`` → ``(float8_e4m3fn[T, H], float32[T, H/128])`` with ``x ≈ q * scale``."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    t, h = x.shape
    scale = fp8_scales(x, round_scale)
    q = (x.float().view(t, h // GROUP, GROUP) / scale.unsqueeze(-1)).view(t, h)
    return q.to(torch.float8_e4m3fn), scale


def per_token_cast_back(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`per_token_cast_to_fp8`: ``q: fp8[..., H]``, ``scale: f32[..., H/128]``."""
    h = q.shape[-1]
    check_fp8_hidden(h, "q")
    g = h // GROUP
    if scale.shape[-1] != g:
        raise ValueError(f"scale must have H/128={g} columns, got shape {tuple(scale.shape)}")
    out = q.float().reshape(*q.shape[:-1], g, GROUP) * scale.float().unsqueeze(-1)
    return out.reshape(q.shape).to(dtype)


def pack_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales ``[..., G]`` → ``int32[..., ceil(G/4)]``.

    Each byte is the biased float32 exponent of one scale; group ``4*i + j`` lands in byte ``j``
    (little-endian) of int ``i``. Missing groups (G not a multiple of 4) pack as zero bytes.
    Example: scales ``[2**-8, 2**-7, 1.0, 2.0]`` → bytes ``[119, 120, 127, 128]`` → one int32
    ``119 | 120 << 8 | 127 << 16 | 128 << 24``.
    """
    if scale.dtype != torch.float32:
        raise TypeError(f"scale must be float32, got {scale.dtype}")
    bits = scale.contiguous().view(torch.int32)
    if bool(((bits & 0x7FFFFF) != 0).any()):
        raise ValueError("pack_ue8m0 needs power-of-two scales (use round_scale=True)")
    exp = ((bits >> 23) & 0xFF).to(torch.uint8)
    g = exp.shape[-1]
    pad = (-g) % 4
    if pad:
        exp = torch.nn.functional.pad(exp.to(torch.int32), (0, pad)).to(torch.uint8)
    # Through a flat view: a tensor with a size-1 dim counts as contiguous with any stride there,
    # which view(dtype) rejects.
    return exp.contiguous().reshape(-1).view(torch.int32).view(*exp.shape[:-1], exp.shape[-1] // 4)


def unpack_ue8m0(packed: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``int32[..., ceil(G/4)]`` → float32 power-of-two scales ``[..., G]``."""
    if packed.dtype != torch.int32:
        raise TypeError(f"packed must be int32, got {packed.dtype}")
    # Low-latency dispatch returns packed scales as a transposed view ([L, R*M, 1] with a stride of
    # R*M in the last dim): go through a flat view so view(dtype) accepts it.
    # (A tensor with at most one element counts as contiguous with any strides, and view(dtype) would then
    # reject its last stride: an expert that received 0 or 1 rows. Those get fresh strides.)
    flat = packed.contiguous().reshape(-1)
    if flat.numel() <= 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    raw = flat.view(torch.uint8).view(*packed.shape[:-1], packed.shape[-1] * 4)
    exp = raw[..., :num_groups].to(torch.int32)
    return (exp << 23).view(torch.float32)
