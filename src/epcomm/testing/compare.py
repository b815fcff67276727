"""Comparisons by the nature of the op: dispatch is a copy (bitwise), combine a reduction (a budget
derived from the output dtype's rounding plus float32 accumulation)."""

from __future__ import annotations

import torch


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal shapes, dtypes and bytes (NaN patterns included)."""
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {actual.dtype} != expected {expected.dtype}")
    if actual.numel() == 0:
        return
    a = actual.contiguous().view(torch.uint8) if actual.element_size() == 1 else actual.contiguous()
    b = expected.contiguous().view(torch.uint8) if expected.element_size() == 1 else expected.contiguous()
    if actual.is_floating_point() and actual.element_size() > 1:
        a = a.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()])
        b = b.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[expected.element_size()])
    diff = (a != b)
    if bool(diff.any()):
        first = tuple(int(i) for i in diff.nonzero()[0])
        rows = ""
        if diff.dim() > 1:  # which rows: a pattern (every chunk's first row, a tail) often names the cause
            bad = diff.reshape(diff.shape[0], -1).any(1).nonzero().flatten().tolist()
            rows = f"; rows {bad[:16]}{' ...' if len(bad) > 16 else ''} of {diff.shape[0]}"
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} elements differ{rows}; first at {first}: "
                             f"{actual[first].item()} != {expected[first].item()}")


# Machine epsilon (``torch.finfo(dtype).eps``, the gap after 1.0): rounding to nearest errs by at most
# ``eps / 2`` relative (bf16 keeps 8 significant bits, so eps = 2**-7).
_EPS = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}


def reduction_budget(terms_abs_sum: torch.Tensor, ref: torch.Tensor, out_dtype: torch.dtype,
                     num_terms: int) -> torch.Tensor:
    """Per-element error bound of a sum of ``num_terms`` terms accumulated in float32 and rounded to
    ``out_dtype``: half an ulp of the result (relative ``eps/2``) plus the float32 accumulation
    bound ``num_terms * 2**-24 * sum|terms|``, plus the smallest subnormal step."""
    eps_out = _EPS[out_dtype]
    return (eps_out / 2) * ref.abs() + num_terms * 2.0 ** -24 * terms_abs_sum + 1e-30


def assert_within_budget(actual: torch.Tensor, ref64: torch.Tensor, terms_abs_sum: torch.Tensor, num_terms: int,
                         what: str, extra_rel: float = 0.0) -> None:
    """``|actual - ref64| <= budget`` element-wise; ``extra_rel`` widens by a stated relative term of
    ``sum|terms|`` (e.g. for pre-rounded partial sums) and must be justified by the caller."""
    actual64 = actual.detach().cpu().double()
    ref64 = ref64.detach().cpu().double()
    if actual64.shape != ref64.shape:
        raise AssertionError(f"{what}: shape {tuple(actual64.shape)} != expected {tuple(ref64.shape)}")
    if bool(torch.isnan(actual64).any()):
        raise AssertionError(f"{what}: NaN in the result")
    budget = reduction_budget(terms_abs_sum.cpu().double(), ref64, actual.dtype, num_terms)
    budget = budget + extra_rel * terms_abs_sum.cpu().double()
    err = (actual64 - ref64).abs()
    bad = err > budget
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements outside the budget; first at "
                             f"{first}: got {actual64[first].item()}, expected {ref64[first].item()}, "
                             f"budget {budget[first].item():.3g}")


def assert_fp8_within_one_step(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """FP8 (e4m3) values equal up to one rounding step: same sign and magnitude codes at most one
    apart (e4m3 codes are ordered by magnitude), i.e. the two casts rounded the same real number to
    neighbouring representable values. Anything further apart fails."""
    a = actual.detach().cpu().contiguous().view(torch.uint8).to(torch.int16)
    b = expected.detach().cpu().contiguous().view(torch.uint8).to(torch.int16)
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)} != expected {tuple(b.shape)}")
    same_sign = (a & 0x80) == (b & 0x80)
    close = (a & 0x7F) - (b & 0x7F)
    ok = (same_sign & (close.abs() <= 1)) | (((a & 0x7F) == 0) & ((b & 0x7F) == 0))
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0]
        first = tuple(int(i) for i in bad)
        raise AssertionError(f"{what}: {int((~ok).sum())} of {ok.numel()} FP8 values differ by more than one step; "
                             f"first at {first}: code {int(a[first])} != {int(b[first])}")
