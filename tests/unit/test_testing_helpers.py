"""Tier 1 (no process group): the test helpers themselves. ``epcomm.testing.compare`` must catch a
one-bit change (bitwise) and a real reduction error (budget) while passing a correctly rounded
float32-accumulated sum; ``epcomm.testing.inputs`` must build the scenarios its ``Case`` flags
promise (deterministic from the seed, -1 entries, a token with no expert, a hot expert, an empty
rank, self-identifying payload rows).
"""

from __future__ import annotations

import pytest
import torch

from epcomm.testing.compare import (
    any_true,
    assert_bitwise,
    assert_bitwise_all,
    assert_fp8_within_one_step,
    assert_within_budget,
    differs,
    reduction_budget,
)
from epcomm.testing.inputs import Case, expected_dispatch, make_topk, make_x

# ----------------------------------------------------------------------------- assert_bitwise


def flip_lowest_bit(t: torch.Tensor, index: int) -> torch.Tensor:
    out = t.clone()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    flat = out.view(-1).view(ints)
    flat[index] ^= 1
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int32, torch.int64])
def test_assert_bitwise_catches_one_bit(dtype):
    a = (torch.randn(5, 16, generator=torch.Generator().manual_seed(0)) * 10).to(dtype)
    assert_bitwise(a, a.clone(), "same")
    b = flip_lowest_bit(a, 37)
    with pytest.raises(AssertionError, match=r"x: 1 of 80 elements differ; rows \[2\] of 5; first at \(2, 5\)"):
        assert_bitwise(b, a, "x")


def test_assert_bitwise_shapes_dtypes_and_signed_zero():
    a = torch.zeros(4, 8)
    with pytest.raises(AssertionError, match=r"shape \(4, 8\) != expected \(8, 4\)"):
        assert_bitwise(a, a.t().contiguous(), "s")
    with pytest.raises(AssertionError, match="dtype torch.float32 != expected torch.bfloat16"):
        assert_bitwise(a, a.bfloat16(), "d")
    with pytest.raises(AssertionError, match="1 of 32 elements differ"):
        b = a.clone()
        b[1, 1] = -0.0
        assert_bitwise(b, a, "signed zero")  # == would call these equal; bitwise does not
    nan = torch.full((3,), float("nan"))
    assert_bitwise(nan, nan.clone(), "identical NaN patterns are equal")
    assert_bitwise(torch.empty(0, 3), torch.empty(0, 3), "empty")
    # non-contiguous inputs compare by value
    assert_bitwise(a.t(), a.t().contiguous(), "transposed")


def test_assert_bitwise_all_reports_the_first_difference_in_order():
    a = torch.arange(12, dtype=torch.float32).view(3, 4)
    ok = (a, a.clone(), "same")
    assert_bitwise_all([ok, (torch.empty(0), torch.empty(0), "empty"), ok])
    one = (flip_lowest_bit(a, 5), a, "first")
    shape = (a, a[:2], "second")
    with pytest.raises(AssertionError, match=r"^first: 1 of 12 elements differ; rows \[1\] of 3; first at \(1, 1\)"):
        assert_bitwise_all([ok, one, shape])  # a value difference before a shape difference: the value's message
    with pytest.raises(AssertionError, match=r"^second: shape \(3, 4\) != expected \(2, 4\)"):
        assert_bitwise_all([ok, shape, one])
    assert differs(a, a[:2]) is True and differs(torch.empty(0), torch.empty(0)) is False
    assert not any_true([False, differs(a, a.clone()), differs(a.int(), a.int())])
    assert any_true([differs(a, a.clone()), differs(*one[:2])])


def test_fp8_within_one_step_counts_codes():
    codes = torch.tensor([0x00, 0x80, 0x10, 0x10, 0x90, 0x7E], dtype=torch.uint8)
    near = torch.tensor([0x80, 0x00, 0x11, 0x0F, 0x91, 0x7D], dtype=torch.uint8)  # signed zeros; one step each way
    assert_fp8_within_one_step(near.view(torch.float8_e4m3fn), codes.view(torch.float8_e4m3fn), "near")
    far = near.clone()
    far[3] = 0x0E
    with pytest.raises(AssertionError, match=r"far: 1 of 6 FP8 values differ by more than one step; first at \(3,\): "
                                             r"code 14 != 16"):
        assert_fp8_within_one_step(far.view(torch.float8_e4m3fn), codes.view(torch.float8_e4m3fn), "far")
    sign = near.clone()
    sign[2] = 0x90  # the same magnitude, the other sign
    with pytest.raises(AssertionError, match="more than one step"):
        assert_fp8_within_one_step(sign.view(torch.float8_e4m3fn), codes.view(torch.float8_e4m3fn), "sign")


# ----------------------------------------------------------------------------- assert_within_budget


def bf16_terms(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 256, generator=g).to(torch.bfloat16) for _ in range(n)]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_budget_passes_a_correct_float32_sum(n):
    terms = bf16_terms(n, seed=n)
    acc = torch.zeros(64, 256)
    for t in terms:
        acc += t.float()
    actual = acc.to(torch.bfloat16)
    ref = sum(t.double() for t in terms)
    abs_sum = sum(t.double().abs() for t in terms)
    assert_within_budget(actual, ref, abs_sum, n, "float32 sum")


def test_budget_fails_on_real_errors():
    terms = bf16_terms(4, seed=9)
    ref = sum(t.double() for t in terms)
    abs_sum = sum(t.double().abs() for t in terms)
    # a dropped term
    with pytest.raises(AssertionError, match="outside the budget"):
        assert_within_budget(sum(t.float() for t in terms[:3]).bfloat16(), ref, abs_sum, 4, "dropped term")
    # one element off by two bf16 ulps
    actual = sum(t.float() for t in terms).bfloat16()
    bad = actual.clone()
    i = int(actual.float().abs().argmax())
    bad.view(-1).view(torch.int16)[i] += 2
    with pytest.raises(AssertionError, match=r"1 of 16384 elements outside the budget"):
        assert_within_budget(bad, ref, abs_sum, 4, "two ulps")
    # accumulating in bf16 instead of float32 (a typical kernel bug) is caught
    acc = torch.zeros(64, 256, dtype=torch.bfloat16)
    for t in terms:
        acc += t
    with pytest.raises(AssertionError, match="outside the budget"):
        assert_within_budget(acc, ref, abs_sum, 4, "bf16 accumulation")
    with pytest.raises(AssertionError, match="NaN"):
        nan = actual.clone()
        nan[0, 0] = float("nan")
        assert_within_budget(nan, ref, abs_sum, 4, "nan")
    with pytest.raises(AssertionError, match="shape"):
        assert_within_budget(actual[:10], ref, abs_sum, 4, "shape")


def test_budget_is_half_an_ulp_plus_accumulation():
    ref = torch.tensor([1.0, 1.5, 3.0], dtype=torch.float64)
    b = reduction_budget(torch.zeros(3, dtype=torch.float64), ref, torch.bfloat16, 4)
    # bf16 has 8 significant bits: half an ulp at [1, 2) is 2**-8, at [2, 4) 2**-7
    assert torch.all(b >= torch.tensor([2.0 ** -8, 2.0 ** -8, 2.0 ** -7], dtype=torch.float64))
    assert torch.all(b < 2 * torch.tensor([2.0 ** -8, 2.0 ** -8, 2.0 ** -7], dtype=torch.float64))
    b2 = reduction_budget(torch.full((3,), 100.0, dtype=torch.float64), ref, torch.bfloat16, 4)
    assert torch.allclose(b2 - b, torch.full((3,), 4 * 2.0 ** -24 * 100.0, dtype=torch.float64))


# ----------------------------------------------------------------------------- inputs


def test_inputs_are_deterministic_and_tagged():
    case = Case(3, (9, 0, 13), hidden=256, num_topk=4, num_experts=12, seed=5)
    for r in range(3):
        i1, w1 = make_topk(case, r)
        i2, w2 = make_topk(case, r)
        assert torch.equal(i1, i2) and torch.equal(w1, w2)
        assert i1.dtype == torch.int64 and w1.dtype == torch.float32
        assert i1.shape == (case.tokens_of(r), 4)
        x = make_x(case, r)
        assert x.dtype == torch.bfloat16 and x.shape == (case.tokens_of(r), 256)
        assert torch.equal(x, make_x(case, r))
        if x.shape[0]:
            assert bool((x[:, 0] == r).all())
            assert torch.equal(x[:, 1].float(), torch.arange(x.shape[0], dtype=torch.float32))
    assert not torch.equal(make_x(case, 0), make_x(case, 2)[:9])


def test_topk_scenarios():
    case = Case(4, (60,) * 4, num_topk=4, num_experts=16, seed=1, drop_prob=0.2, hot_expert=5, empty_rank=2)
    idx, w = make_topk(case, 1)
    assert bool((idx[0] == -1).all()), "token 0 selects no expert"
    assert bool((idx == -1).any(dim=1)[1:].any()), "some -1 entries besides token 0"
    assert bool(((idx >= 8) & (idx < 12)).sum() == 0), "no token selects an expert of the empty rank"
    assert bool((w[idx < 0] == 0).all()) and bool((w[idx >= 0] > 0).all())
    hot = int((idx == 5).any(dim=1).sum())
    assert hot >= 60 // 4, f"the hot expert takes only {hot} of 60 tokens"
    for row in idx.tolist():
        chosen = [e for e in row if e >= 0]
        assert len(chosen) == len(set(chosen)), f"repeated expert in {row}"
    no_drop = Case(2, (5, 5), num_experts=4, num_topk=4, drop_prob=0.0, no_expert_token=False)
    idx, _ = make_topk(no_drop, 0)
    assert bool((idx >= 0).all())


def test_expected_dispatch_hand_checked():
    # Rebuild rank 1's expectation by brute force over every (source rank, token).
    case = Case(2, (7, 6), hidden=16, num_topk=2, num_experts=4, seed=3)
    exp = expected_dispatch(case, 1)
    rows, src, idx = [], [], []
    for r in range(2):
        topk, _ = make_topk(case, r)
        x = make_x(case, r)
        for t in range(topk.shape[0]):
            if any(int(e) in (2, 3) for e in topk[t]):
                rows.append(x[t])
                src.append(t)
                idx.append([int(e) - 2 if int(e) in (2, 3) else -1 for e in topk[t]])
    assert torch.equal(exp["recv_x"], torch.stack(rows))
    assert exp["recv_src_idx"].tolist() == src
    assert exp["recv_topk_idx"].tolist() == idx
    per = [sum(int((make_topk(case, r)[0] == e).sum()) for r in range(2)) for e in (2, 3)]
    assert exp["per_expert"].tolist() == per
