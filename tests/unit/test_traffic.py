"""Tier 1: ``epcomm.testing.traffic``, the rows a checked call received from other ranks (what the
GPU tests assert so that a case that moved nothing across ranks cannot pass), on hand-made handles."""

import torch

from epcomm.layout import layout_range
from epcomm.testing.traffic import ht_remote_rows, ll_remote_rows


def test_ll_remote_rows_worked_example():
    # rank 0 received, per [local expert, source rank]: expert 0 3 rows from itself and 2 from rank 1,
    # expert 1 one row from itself
    count, begin = torch.tensor([[3, 2], [1, 0]]), torch.tensor([[0, 3], [0, 1]])
    assert int(ll_remote_rows(layout_range(begin, count), 0)) == 2
    # the same counts received by rank 1: 3 + 1 rows from rank 0 are the remote ones
    assert int(ll_remote_rows(layout_range(begin, count), 1)) == 4
    assert int(ll_remote_rows(layout_range(begin, torch.tensor([[3, 0], [1, 0]])), 0)) == 0  # own rows only


def test_ht_remote_rows_worked_example():
    # [i, j]: rows ranks 0..i send to rank j
    rpm = torch.tensor([[4, 1, 0], [9, 1, 2], [10, 3, 2]], dtype=torch.int32)
    assert int(ht_remote_rows(rpm, 0)) == 6  # column [4, 9, 10]: 4 own, 5 from rank 1, 1 from rank 2
    assert int(ht_remote_rows(rpm, 1)) == 3  # column [1, 1, 3]: 1 from rank 0, none own, 2 from rank 2
    assert int(ht_remote_rows(rpm, 2)) == 2  # column [0, 2, 2]: 2 from rank 1, none own
    assert int(ht_remote_rows(torch.tensor([[5, 0], [5, 7]]), 1)) == 0  # own rows only
