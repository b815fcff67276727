"""Tier 1: the nvlink backend's host-side arithmetic (after the dispatch synchronisation, copy-engine chunks)."""
import pytest
import torch

from epcomm import layout
from epcomm.backends import nvlink_params as nv
from epcomm.backends.nvlink_params import _host_counts


def test_host_counts_from_the_kernels_words():
    """The host's read of the exchange kernel's words (``[rank_prefix_matrix[:, me]][rows per local expert]``: the
    kernel's sums are checked by sims/sim_ht_fused_layout.py): the prefix, the row count, the per-expert list
    rounded up to the alignment, from a NumPy view as from a list."""
    g = torch.Generator().manual_seed(3)
    for r_, lx, alignment in ((1, 4, 1), (2, 3, 8), (4, 16, 128), (8, 32, 7)):
        col = torch.randint(0, 5000, (r_,), generator=g).cumsum(0)
        per_expert = torch.randint(0, 900, (lx,), generator=g)
        words = torch.cat([col, per_expert, torch.randint(0, 9, (5,), generator=g)]).to(torch.int32)
        for vals in (words.tolist(), words.numpy()):
            prefix, n_rows, lst = _host_counts(vals, r_, lx, alignment)
            assert prefix == col.tolist() and n_rows == int(col[-1])
            assert lst == layout.align_up(per_expert, alignment).tolist()
            assert all(type(v) is int for v in prefix + lst)


def test_host_counts_example():
    assert _host_counts([1, 5, 4, 1], 2, 2, 2) == ([1, 5], 5, [4, 2])


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
    """The layout kernel's groups: up to 8 ranks each, then up to 32 experts each (kernels/ht_layout.py);
    the rank programs' tile divides the expert programs' (a chunk is a multiple of both)."""
    assert nv.layout_launch(8, 256, 2) == (9, 1, dict(K_POW2=8, RB=2, EB=32, TBR=128, TBE=128, CP2=32))
    ng, nr, c = nv.layout_launch(3, 24, 12)  # 12 ranks: two rank groups; 24 experts: one
    assert (ng, nr, c["RB"], c["EB"], c["K_POW2"], c["TBR"], c["TBE"]) == (3, 2, 8, 32, 4, 128, 256)
    for k in range(1, 33):
        for r_ in range(1, 17):
            c = nv.layout_launch(k, 8 * r_, r_)[2]
            assert c["TBE"] % c["TBR"] == 0 and c["TBR"] * c["K_POW2"] * c["RB"] <= 4096, (k, r_, c)


def test_layout_kernel_chunking():
    """Token chunks of the layout kernel per call: a multiple of the expert tile, at most CP2 of them, at
    least one (no tokens: one empty chunk, which writes the zero counts), together just covering T."""
    from epcomm.kernels.ht_layout import chunking

    assert chunking(4096, 128, 32) == (32, 128)  # DeepSeek-V3 (K = 8): 32 chunks of one tile
    assert chunking(5000, 128, 32) == (20, 256)
    assert chunking(0, 128, 32) == chunking(1, 128, 32) == chunking(128, 128, 32) == (1, 128)
    assert chunking(129, 128, 32) == (2, 128)
    for t in range(0, 20000, 37):
        nch, s = chunking(t, 64, 32)
        assert 1 <= nch <= 32 and s % 64 == 0 and (nch - 1) * s < max(t, 1) <= nch * s, (t, nch, s)
        assert s == 64 or 32 * (s - 64) < t, (t, nch, s)  # the smallest multiple of the tile that does
