"""Tier 1: argument checks of ``epcomm._validate`` that need no process group, on hand-made tensors."""

from __future__ import annotations

import re

import pytest
import torch

from epcomm import _validate as V


def _t(rows: int, cols: int = 2) -> torch.Tensor:
    return torch.zeros(rows, cols)


@pytest.mark.parametrize("named, message", [
    # x one row short of the ids and the layout made from them: x is named, not the layout
    ([("x", _t(63)), ("topk_idx", _t(64)), ("is_token_in_rank", _t(64))], "x has 63 rows but topk_idx has 64"),
    # the layout is the odd one out
    ([("x", _t(64)), ("topk_idx", _t(64)), ("is_token_in_rank", _t(63))], "is_token_in_rank has 63 rows but x has 64"),
    # a tie: the first named is blamed, the other named beside it
    ([("x", _t(63)), ("topk_idx", _t(64))], "x has 63 rows but topk_idx has 64"),
    ([("sf", _t(5)), ("x", _t(4))], "sf has 5 rows but x has 4"),
    # None and tensors that are not 2-D are left to their own checks
    ([("x", _t(7)), ("topk_idx", None), ("is_token_in_rank", torch.zeros(8)), ("x[1]", _t(6))],
     "x has 7 rows but x[1] has 6"),
])
def test_rows_name_the_argument_that_disagrees(named, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        V.rows_agree(named)


def test_rows_that_agree_pass():
    V.rows_agree([("x", _t(3)), ("topk_idx", _t(3, 4)), ("x[1]", None), ("is_token_in_rank", [1, 2])])


def test_a_layout_of_other_ids_is_named():
    """R = 2, E = 4 (L = 2): the worked example of ``layout_mismatch``'s docstring."""
    idx = torch.tensor([[0, 3], [1, -1]])
    in_rank = torch.tensor([[True, True], [True, False]])
    per_expert = torch.tensor([1, 1, 0, 1], dtype=torch.int32)
    assert V.layout_mismatch(idx, in_rank, per_expert, 2) is None
    assert V.layout_mismatch(idx, torch.tensor([[True, False], [True, False]]), per_expert, 2) == (
        "is_token_in_rank does not match topk_idx: token 0 goes to ranks [0, 1] by topk_idx but to [0] by "
        "is_token_in_rank; pass the layout get_dispatch_layout made from this topk_idx")
    # the same ranks, other experts: the counts tell
    assert V.layout_mismatch(idx, in_rank, torch.tensor([0, 2, 0, 1], dtype=torch.int32), 2) == (
        "num_tokens_per_expert does not match topk_idx: expert 0 has 1 tokens by topk_idx but 0 by "
        "num_tokens_per_expert; pass the layout get_dispatch_layout made from this topk_idx")
