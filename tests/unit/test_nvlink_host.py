"""Tier 1: the nvlink backend's host-side arithmetic after the dispatch synchronisation."""
import torch

from epcomm import layout
from epcomm.backends.nvlink import _host_counts


def test_host_counts_match_the_tensor_formulas():
    g = torch.Generator().manual_seed(3)
    for r_, lx, alignment in ((1, 4, 1), (2, 3, 8), (4, 16, 128), (8, 32, 7)):
        counts = torch.randint(0, 5000, (r_, r_), generator=g)
        per_expert = torch.randint(0, 900, (r_, lx), generator=g)
        vals = counts.flatten().tolist() + per_expert.flatten().tolist()
        for me in range(r_):
            cnt, n_rows, lst = _host_counts(vals, r_, lx, me, alignment)
            assert cnt == counts.tolist()
            assert n_rows == int(counts[:, me].sum())
            assert lst == layout.align_up(per_expert.sum(0), alignment).tolist()


def test_host_counts_example():
    assert _host_counts([3, 1, 2, 4, 1, 0, 2, 2], 2, 2, 1, 2) == ([[3, 1], [2, 4]], 5, [4, 2])
