"""Tier 1: ``epcomm._agree``'s encoding of a call's collective kind and the messages of a disagreement, on
hand-made rows (what ``deadline.all_gather_ints`` returns, by rank)."""

from __future__ import annotations

import torch

from epcomm import _agree

FIELDS = (("x.dtype", torch.bfloat16), ("x.shape[1]", 256), ("topk_idx.shape[1]", None), ("num_experts", 16),
          ("use_fp8", True))


def _rows(*per_rank):
    return [_agree._encode(call, fields) for call, fields in per_rank]


def _with(over: dict):
    """``FIELDS`` with the values of ``over`` (by argument)."""
    return tuple((n, over.get(n, v)) for n, v in FIELDS)


def test_a_kind_is_a_fixed_number_of_words():
    row = _agree._encode("dispatch", FIELDS)
    assert len(row) == _agree._WORDS == len(_agree._encode("combine", ()))
    assert row[1:12] == [5, _agree._DTYPE, 0, _agree._INT, 256, _agree._NONE, 0, _agree._INT, 16, _agree._BOOL, 1]


def test_ranks_that_agree_say_nothing():
    assert _agree.disagreement("dispatch", FIELDS, _rows(("dispatch", FIELDS)) * 3, 1) is None


def test_the_argument_and_every_value_are_named_this_rank_first():
    rows = _rows(("dispatch", FIELDS), ("dispatch", _with({"num_experts": 32})))
    assert _agree.disagreement("dispatch", FIELDS, rows, 0) == (
        "num_experts=16 on rank 0 but 32 on rank 1: it must be the same on every rank (dispatch)")
    assert _agree.disagreement("dispatch", _with({"num_experts": 32}), rows, 1) == (
        "num_experts=32 on rank 1 but 16 on rank 0: it must be the same on every rank (dispatch)")
    # several arguments, several ranks; dtypes, None and bools by name
    odd = _with({"x.dtype": torch.float8_e4m3fn, "topk_idx.shape[1]": 4, "use_fp8": False})
    rows = _rows(("dispatch", FIELDS), ("dispatch", odd), ("dispatch", odd), ("dispatch", FIELDS))
    assert _agree.disagreement("dispatch", FIELDS, rows, 3) == (
        "x.dtype=torch.bfloat16 on rank 3 but torch.float8_e4m3fn on ranks 1, 2; topk_idx.shape[1]=None on rank 3 but "
        "4 on ranks 1, 2; use_fp8=True on rank 3 but False on ranks 1, 2: it must be the same on every rank (dispatch)")


def test_another_operation_is_named():
    rows = _rows(("dispatch", FIELDS), ("low_latency_dispatch", (("num_max_dispatch_tokens_per_rank", 8),)))
    assert _agree.disagreement("dispatch", FIELDS, rows, 0) == (
        "rank 0 calls dispatch but rank 1 calls low_latency_dispatch: every rank must make the same calls in the "
        "same order")
