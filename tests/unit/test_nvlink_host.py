"""Tier 1: the nvlink backend's host-side arithmetic (after the dispatch synchronisation, copy-engine chunks)."""
import pytest
import torch

from epcomm import layout
from epcomm.backends import nvlink_params as nv
from epcomm.backends.nvlink_params import _host_counts


def test_host_counts_match_the_tensor_formulas():
    g = torch.Generator().manual_seed(3)
    for r_, lx, alignment in ((1, 4, 1), (2, 3, 8), (4, 16, 128), (8, 32, 7)):
        counts = torch.randint(0, 5000, (r_, r_), generator=g)
        per_expert = torch.randint(0, 900, (r_, lx), generator=g)
        vals = counts.flatten().tolist() + per_expert.flatten().tolist()
        for me in range(r_):
            prefix, n_rows, lst = _host_counts(vals, r_, lx, me, alignment)
            assert prefix == counts[:, me].cumsum(0).tolist()
            assert n_rows == int(counts[:, me].sum())
            assert lst == layout.align_up(per_expert.sum(0), alignment).tolist()


def test_host_counts_example():
    assert _host_counts([3, 1, 2, 4, 1, 0, 2, 2], 2, 2, 1, 2) == ([1, 5], 5, [4, 2])


def test_copy_engine_chunks(monkeypatch):
    """Rows per NC-chunk (the receiver's unit) and NC-chunks per copy-engine copy (TUNE ce_chunks)."""
    assert nv._chunk_rows(4096) == 1024 and nv._chunk_rows(0) == 1 and nv._chunk_rows(5) == 2
    monkeypatch.setitem(nv.TUNE, "ce_chunks", 4)
    assert nv._ce_step() == 1
    monkeypatch.setitem(nv.TUNE, "ce_chunks", 1)
    assert nv._ce_step() == 4  # one copy carries all four chunks and raises the flag by 4
    monkeypatch.setitem(nv.TUNE, "ce_chunks", 3)
    with pytest.raises(ValueError, match="must divide NC=4, got 3"):
        nv._ce_step()


def test_layout_kernel_launch():
    """The layout kernel's programs: up to 8 ranks each, then up to 32 experts each (kernels/ht_layout.py)."""
    assert nv.layout_launch(8, 256, 2) == (9, 1, dict(K_POW2=8, RB=2, EB=32, TBR=256, TBE=128))
    grid, nr, c = nv.layout_launch(3, 24, 12)  # 12 ranks: two rank programs; 24 experts: one
    assert (grid, nr, c["RB"], c["EB"], c["K_POW2"]) == (3, 2, 8, 32, 4)
