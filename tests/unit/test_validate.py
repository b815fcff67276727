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
