"""Tier 1 (no process group): ``epcomm.quant`` — per-token, per-128-channel FP8 (e4m3) casts,
power-of-two scales and UE8M0 packing. Hand-worked values, round trips within the e4m3 error budget
(2**-4 of the group amax: e4m3 keeps 4 significant bits), and the bad-input errors.
"""

from __future__ import annotations

import pytest
import torch

from epcomm import quant

FP8 = torch.float8_e4m3fn


def f32(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def group_amax(x: torch.Tensor) -> torch.Tensor:
    t, h = x.shape
    return x.double().abs().view(t, h // 128, 128).amax(-1).clamp_min(1e-4)


def e4m3_violations(x: torch.Tensor, back: torch.Tensor) -> int:
    """Elements whose round-trip error exceeds 2**-4 of their group's amax."""
    t, h = x.shape
    err = (back.double() - x.double()).abs().view(t, h // 128, 128)
    return int((err > 2.0 ** -4 * group_amax(x).unsqueeze(-1)).sum())


def random_x(t=16, h=512, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    # groups of very different magnitude, so a scale shared across groups would fail
    mag = 10.0 ** torch.randint(-3, 4, (t, h // 128), generator=g).double()
    return (x.double() * mag.repeat_interleave(128, dim=1)).float()


# ----------------------------------------------------------------------------- hand-worked values


def test_all_ones_docstring_example():
    x = torch.ones(1, 128, dtype=torch.bfloat16)
    q, s = quant.per_token_cast_to_fp8(x)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (1, 1)
    assert bits_equal(s, f32([[1.0]]) / 448.0)
    assert torch.equal(q.float(), torch.full((1, 128), 448.0))
    q, s = quant.per_token_cast_to_fp8(x, round_scale=True)
    assert bits_equal(s, f32([[2.0 ** -8]]))  # 1/448 = 0.00223 rounds *up* to 2**-8 = 0.0039
    assert torch.equal(q.float(), torch.full((1, 128), 256.0))


def test_exact_scale_and_per_group_independence():
    x = torch.zeros(2, 256)
    x[0, 0], x[0, 1], x[0, 200] = -3.5, 0.5, 1.0   # group 0 amax 3.5, group 1 amax 1
    x[1, 130] = 7.0                                 # token 1: group 0 all zero, group 1 amax 7
    q, s = quant.per_token_cast_to_fp8(x)
    # 3.5 / 448 = 2**-7 exactly; 7 / 448 = 2**-6; a zero group takes the 1e-4 floor
    assert bits_equal(s, torch.stack([torch.stack([f32(2.0 ** -7), f32(1.0) / 448]),
                                      torch.stack([f32(1e-4) / 448, f32(2.0 ** -6)])]))
    qf = q.float()
    assert qf[0, 0] == -448.0 and qf[0, 1] == 64.0 and qf[0, 200] == 448.0
    assert qf[1, 130] == 448.0 and int((qf[1] != 0).sum()) == 1
    back = quant.per_token_cast_back(q, s, torch.float32)
    assert torch.equal(back, x)  # every value here is exactly representable
    # round_scale keeps an exact power of two and rounds the others up
    _, sr = quant.per_token_cast_to_fp8(x, round_scale=True)
    assert bits_equal(sr, torch.stack([torch.stack([f32(2.0 ** -7), f32(2.0 ** -8)]),
                                       torch.stack([f32(2.0 ** -22), f32(2.0 ** -6)])]))


def test_scales_are_amax_over_448():
    x = random_x()
    s = quant.fp8_scales(x)
    expected = group_amax(x).float() / 448.0
    assert bits_equal(s, expected)
    q, s2 = quant.per_token_cast_to_fp8(x)
    assert bits_equal(s2, expected)
    # the largest element of every group maps to +-448 exactly
    qmax = q.float().abs().view(16, 4, 128).amax(-1)
    assert torch.equal(qmax, torch.full((16, 4), 448.0))


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_within_e4m3_budget(round_scale, dtype):
    x = random_x(seed=1).to(dtype)
    q, s = quant.per_token_cast_to_fp8(x, round_scale=round_scale)
    back = quant.per_token_cast_back(q, s, torch.float32)
    assert e4m3_violations(x, back) == 0
    # The check can fail: a scale off by a factor 2 (a plausible kernel bug) breaks it.
    assert e4m3_violations(x, quant.per_token_cast_back(q, s * 2, torch.float32)) > 0
    # ...and so does quantising with the wrong group (scales of the neighbouring group).
    assert e4m3_violations(x, quant.per_token_cast_back(q, s.roll(1, dims=1), torch.float32)) > 0
    # Default cast back is to bf16
    assert quant.per_token_cast_back(q, s).dtype == torch.bfloat16


def test_round_scale_gives_powers_of_two_not_below_amax_over_448():
    x = random_x(seed=2)
    s = quant.fp8_scales(x, round_scale=True)
    mant = s.view(torch.int32) & 0x7FFFFF
    assert int(mant.abs().sum()) == 0, "round_scale must give powers of two"
    exact = quant.fp8_scales(x)
    assert bool((s >= exact).all()) and bool((s < 2 * exact).all())
    q, _ = quant.per_token_cast_to_fp8(x, round_scale=True)
    qmax = q.float().abs().view(16, 4, 128).amax(-1)
    assert bool((qmax >= 224).all()) and bool((qmax <= 448).all())  # amax/scale in (224, 448], then rounded


def test_round_scale_just_above_a_power_of_two():
    # amax = 1.75 + 2**-22 -> amax / 448 is the float32 right after 2**-8 (log2 of it rounds to -8.0 in
    # float32, so exp2(ceil(log2(s))) would give 2**-8 < s); the smallest power of two >= s is 2**-7.
    x = torch.zeros(1, 128)
    x[0, 0] = 1.75 + 2.0 ** -22
    s = quant.fp8_scales(x)
    assert int(s.view(torch.int32)) == int(f32(2.0 ** -8).view(torch.int32)) + 1
    assert bits_equal(quant.fp8_scales(x, round_scale=True), f32([[2.0 ** -7]]))
    q, _ = quant.per_token_cast_to_fp8(x, round_scale=True)
    assert float(q.float()[0, 0]) == 224.0  # 1.75 * 128, no saturation


def test_cast_back_accepts_leading_dims_and_transposed_scales():
    x = random_x(t=6, h=256, seed=3)
    q, s = quant.per_token_cast_to_fp8(x)
    s_cm = s.t().contiguous().t()  # column-major, as low-latency dispatch returns
    a = quant.per_token_cast_back(q.view(2, 3, 256), s_cm.view(2, 3, 2), torch.float32)
    b = quant.per_token_cast_back(q, s, torch.float32)
    assert torch.equal(a.view(6, 256), b)


def test_zero_tokens():
    q, s = quant.per_token_cast_to_fp8(torch.zeros(0, 256))
    assert q.shape == (0, 256) and s.shape == (0, 2)


# ----------------------------------------------------------------------------- UE8M0


def test_pack_ue8m0_hand_worked():
    s = f32([[2.0 ** -8, 2.0 ** -7, 1.0, 2.0]])
    # biased exponents 119, 120, 127, 128 -> bytes of one little-endian int32
    packed = quant.pack_ue8m0(s)
    assert packed.dtype == torch.int32 and packed.shape == (1, 1)
    assert int(packed) == (119 | 120 << 8 | 127 << 16 | 128 << 24) - 2 ** 32 == -2139129737
    # G = 5: the fifth exponent (2**-10 -> 117) opens a second int, padded with zero bytes
    packed5 = quant.pack_ue8m0(f32([[2.0 ** -8, 2.0 ** -7, 1.0, 2.0, 2.0 ** -10]]))
    assert packed5.tolist() == [[-2139129737, 117]]


def test_ue8m0_round_trip():
    x = random_x(t=8, h=1024, seed=4)  # G = 8 -> 2 ints per token
    s = quant.fp8_scales(x, round_scale=True)
    packed = quant.pack_ue8m0(s)
    assert packed.shape == (8, 2)
    assert bits_equal(quant.unpack_ue8m0(packed, 8), s)
    # leading dims and a transposed (non-contiguous) input
    s3 = s.view(2, 4, 8).transpose(0, 1)
    assert bits_equal(quant.unpack_ue8m0(quant.pack_ue8m0(s3), 8), s3.contiguous())
    # the layout low-latency dispatch returns: [L, R*M, 1] as a transposed view of [L, 1, R*M]
    s1 = s[:, :4].reshape(2, 4, 4)
    packed_t = torch.zeros(2, 1, 4, dtype=torch.int32).transpose(1, 2)
    packed_t.copy_(quant.pack_ue8m0(s1))
    assert packed_t.stride() == (4, 1, 4)
    assert bits_equal(quant.unpack_ue8m0(packed_t, 4), s1)
    assert torch.equal(quant.pack_ue8m0(quant.unpack_ue8m0(packed_t, 4)), packed_t)
    # an expert that received 0 or 1 rows: a slice of that layout (tensors of at most one element count
    # as contiguous with any strides)
    assert quant.unpack_ue8m0(packed_t[0, :0], 4).shape == (0, 4)
    one = packed_t[1, :1]
    assert one.shape == (1, 1) and one.contiguous().reshape(-1).stride() == (4,)
    assert bits_equal(quant.unpack_ue8m0(one, 4), s1[1, :1])
    # G not a multiple of 4
    s6 = s[:, :6]
    assert bits_equal(quant.unpack_ue8m0(quant.pack_ue8m0(s6), 6), s6.contiguous())


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs():
    with pytest.raises(ValueError, match="multiple of 128, got 200"):
        quant.per_token_cast_to_fp8(torch.zeros(2, 200))
    with pytest.raises(ValueError, match=r"x must be 2-D.*\(256,\)"):
        quant.per_token_cast_to_fp8(torch.zeros(256))
    with pytest.raises(ValueError, match=r"H/128=2 columns.*\(3, 3\)"):
        quant.per_token_cast_back(torch.zeros(3, 256, dtype=FP8), torch.ones(3, 3))
    with pytest.raises(ValueError, match="power-of-two"):
        quant.pack_ue8m0(f32([[1.0 / 448]]))
    with pytest.raises(TypeError, match="float32, got torch.float64"):
        quant.pack_ue8m0(torch.ones(1, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="int32, got torch.int64"):
        quant.unpack_ue8m0(torch.zeros(1, 1, dtype=torch.int64), 4)
