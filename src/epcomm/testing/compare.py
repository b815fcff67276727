"""Comparisons by the nature of the op: dispatch is a copy (bitwise), combine a reduction (a budget
derived from the output dtype's rounding plus float32 accumulation).

Each comparison runs where its tensors live (on a GPU for GPU results: no copy of the data to the host)
and reads one flag back; only a failure copies the tensors to the host, for its message. Tensors on two
devices are compared on the host."""

from __future__ import annotations

import torch

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _together(actual: torch.Tensor, expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both detached, on one device: their own, or the host where they differ."""
    actual, expected = actual.detach(), expected.detach()
    if actual.device != expected.device:
        return actual.cpu(), expected.cpu()
    return actual, expected


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous, as integers of its element size where it is a floating or one-byte type (so that
    NaN patterns and signed zeros compare by their bits)."""
    t = t.contiguous()
    if t.element_size() == 1 or t.is_floating_point():
        return t.view(_INTS[t.element_size()])
    return t


def differs(actual: torch.Tensor, expected: torch.Tensor):
    """Whether ``actual`` and ``expected`` differ bitwise: ``True`` where their shapes or dtypes differ, ``False``
    where both are empty, else a 0-d bool tensor on their device (not read back: callers gather several)."""
    actual, expected = _together(actual, expected)
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return True
    if actual.numel() == 0:
        return False
    return (_bits(actual) != _bits(expected)).any()


def any_true(flags) -> bool:
    """Whether any of ``flags`` (bools and 0-d bool tensors, on any devices) is true: one host read a device."""
    by_device: dict = {}
    for f in flags:
        if isinstance(f, bool):
            if f:
                return True
            continue
        by_device.setdefault(f.device, []).append(f)
    return any(bool(torch.stack(fs).any()) for fs in by_device.values())


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal shapes, dtypes and bytes (NaN patterns included)."""
    if any_true([differs(actual, expected)]):
        _raise_bitwise(actual.detach().cpu(), expected.detach().cpu(), what)


def assert_bitwise_all(checks) -> None:
    """:func:`assert_bitwise` of every ``(actual, expected, what)`` in ``checks``, compared together with one
    host read a device where all pass; where any fails, the first that fails, in order, raises its message."""
    checks = list(checks)
    if any_true([differs(a, e) for a, e, _ in checks]):
        for a, e, what in checks:
            assert_bitwise(a, e, what)
        raise AssertionError("assert_bitwise_all: a comparison failed that none of its checks repeats: "
                             + ", ".join(w for _, _, w in checks))


def _raise_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """The message of a failed :func:`assert_bitwise` (host tensors)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {actual.dtype} != expected {expected.dtype}")
    diff = _bits(actual) != _bits(expected)
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
    """``|actual - ref64| <= budget`` element-wise (in float64, on ``actual``'s device); ``extra_rel`` widens by a
    stated relative term of ``sum|terms|`` (e.g. for pre-rounded partial sums) and must be justified by the
    caller."""
    dev = actual.device
    actual64 = actual.detach().double()
    ref64 = ref64.detach().to(dev).double()
    if actual64.shape != ref64.shape:
        raise AssertionError(f"{what}: shape {tuple(actual64.shape)} != expected {tuple(ref64.shape)}")
    abs64 = terms_abs_sum.detach().to(dev).double()
    budget = reduction_budget(abs64, ref64, actual.dtype, num_terms)
    budget = budget + extra_rel * abs64
    bad = (actual64 - ref64).abs() > budget
    nan, out = torch.stack([torch.isnan(actual64).any(), bad.any()]).tolist()
    if nan:
        raise AssertionError(f"{what}: NaN in the result")
    if out:
        actual64, ref64, budget, bad = actual64.cpu(), ref64.cpu(), budget.cpu(), bad.cpu()
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements outside the budget; first at "
                             f"{first}: got {actual64[first].item()}, expected {ref64[first].item()}, "
                             f"budget {budget[first].item():.3g}")


def fp8_within_one_step(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Element-wise (bool, on the tensors' device): the FP8 (e4m3) values ``actual`` and ``expected`` (of one
    shape) are equal up to one rounding step, as :func:`assert_fp8_within_one_step` says."""
    a = actual.detach().contiguous().view(torch.uint8).to(torch.int16)
    b = expected.detach().contiguous().view(torch.uint8).to(torch.int16)
    same_sign = (a & 0x80) == (b & 0x80)
    close = (a & 0x7F) - (b & 0x7F)
    return (same_sign & (close.abs() <= 1)) | (((a & 0x7F) == 0) & ((b & 0x7F) == 0))


def assert_fp8_within_one_step(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """FP8 (e4m3) values equal up to one rounding step: same sign and magnitude codes at most one
    apart (e4m3 codes are ordered by magnitude), i.e. the two casts rounded the same real number to
    neighbouring representable values. Anything further apart fails."""
    actual, expected = _together(actual, expected)
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    ok = fp8_within_one_step(actual, expected)
    if not bool(ok.all()):
        ok = ok.cpu()
        a = actual.cpu().contiguous().view(torch.uint8)
        b = expected.cpu().contiguous().view(torch.uint8)
        first = tuple(int(i) for i in (~ok).nonzero()[0])
        raise AssertionError(f"{what}: {int((~ok).sum())} of {ok.numel()} FP8 values differ by more than one step; "
                             f"first at {first}: code {int(a[first])} != {int(b[first])}")
