"""Tier 1: the small outputs of the nvlink backend's high-throughput calls are views of one allocation
(``arena.Block``) that never overlap one another, and the received rows (and their scales) are allocations
of their own: a caller drops ``recv_x`` long before the handle, so no block may keep the rows alive.

On ``test_nvlink_orchestration``'s rig (the kernels are not run: the host synchronisation reads zero
rows, so here it is told ``SYNC_ROWS`` rows; with ``num_worst_tokens``, ``R * T``).
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from test_nvlink_orchestration import E, K, R, T, _args, make_rig  # noqa: E402

from epcomm.backends import ht_dispatch  # noqa: E402
from epcomm.backends import nvlink_params as params  # noqa: E402

SYNC_ROWS = 37  # rows the synchronised dispatch is told it receives (odd: its parts' offsets still aligned)


@pytest.fixture
def be(monkeypatch):
    b = make_rig(monkeypatch).b[0]
    b.transfer = "sm"
    return b


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _apart(named: dict) -> None:
    """Each tensor contiguous and 16-byte aligned; no two of them share a byte."""
    spans = []
    for name, t in named.items():
        assert t.is_contiguous(), name
        if t.numel():
            assert t.data_ptr() % 16 == 0, (name, t.data_ptr())
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name))
    spans.sort()
    for a, b in itertools.pairwise(spans):
        assert a[1] <= b[0], f"{a[2]} and {b[2]} overlap: {spans}"


def _small(res) -> dict:
    h = res.handle
    return {"rank_prefix_matrix": h.rank_prefix_matrix, "channel_prefix_matrix": h.channel_prefix_matrix,
            "recv_channel_prefix_matrix": h.recv_channel_prefix_matrix, "recv_src_idx": h.recv_src_idx,
            "send_head": h.send_head, "recv_topk_idx": res.recv_topk_idx,
            "recv_topk_weights": res.recv_topk_weights}


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("worst", [0, R * T])
def test_dispatch_outputs_are_apart_and_the_rows_alone(be, monkeypatch, worst, fp8):
    counts = ht_dispatch._host_counts
    monkeypatch.setattr(ht_dispatch, "_host_counts", lambda *a: counts(*a)[:1] + (SYNC_ROWS, counts(*a)[2]))
    a = _args(worst=worst, fp8=fp8)
    be.dispatch(a)  # (the first call binds the launches)
    res, again = be.dispatch(a), be.dispatch(a)
    n, c = worst or SYNC_ROWS, a.num_channels
    small = _small(res)
    want = {"rank_prefix_matrix": (torch.int32, (R, R)), "channel_prefix_matrix": (torch.int32, (R, c)),
            "recv_channel_prefix_matrix": (torch.int32, (R, c)), "recv_src_idx": (torch.int32, (n,)),
            "send_head": (torch.int32, (T, R)), "recv_topk_idx": (torch.int64, (n, K)),
            "recv_topk_weights": (torch.float32, (n, K))}
    assert {k: (t.dtype, tuple(t.shape)) for k, t in small.items()} == want
    _apart(dict(small, recv_x=res.recv_x, **({"recv_x_scales": res.recv_x_scales} if fp8 else {})))
    handle_storages = {_storage(t) for t in small.values()}
    assert len(handle_storages) == (1 if worst else 2)  # one Block (two: before and after the synchronisation)
    assert _storage(res.recv_x) not in handle_storages
    if fp8:
        assert _storage(res.recv_x_scales) not in handle_storages | {_storage(res.recv_x)}
    # each call's outputs are its own: the next call's Block is fresh memory
    assert not handle_storages & {_storage(t) for t in _small(again).values() if t.numel()}


def test_fused_layout_dispatch_outputs_are_apart(be, monkeypatch):
    """``ElasticBuffer``'s plan (scratch ids and channel matrices, the exchange computing is_token_in_rank):
    the handle's is_token_in_rank joins the Block; the scratch ones stay the backend's."""
    monkeypatch.setitem(params.TUNE, "v2_fused_layout", True)
    a = _args(worst=R * T)
    run = be.dispatch_run(a, scratch_rows=R * T, fused_layout=True)
    ts = (a.x, None, a.topk_idx, a.topk_weights, None, None, None)
    run(*ts)
    res = run(*ts)
    small = dict(_small(res), is_token_in_rank=res.handle.is_token_in_rank)
    assert res.handle.is_token_in_rank.dtype == torch.bool and res.handle.is_token_in_rank.shape == (T, R)
    _apart(dict(small, recv_x=res.recv_x))
    block = _storage(res.handle.rank_prefix_matrix)
    assert {_storage(small[k]) for k in ("send_head", "recv_src_idx", "recv_topk_weights", "is_token_in_rank")} \
        == {block}
    assert _storage(res.recv_topk_idx) != block and _storage(res.handle.channel_prefix_matrix) != block
    assert _storage(res.recv_x) != block


def test_layout_outputs_are_apart(be):
    topk = _args().topk_idx
    be.dispatch_layout(topk, E)
    per_rank, per_expert, in_rank = be.dispatch_layout(topk, E)
    assert (per_rank.dtype, per_rank.shape, per_expert.dtype, per_expert.shape, in_rank.dtype, in_rank.shape) == (
        torch.int32, (R,), torch.int32, (E,), torch.bool, (T, R))
    _apart({"per_rank": per_rank, "per_expert": per_expert, "in_rank": in_rank})
    again = be.dispatch_layout(topk, E)
    assert _storage(again[0]) != _storage(per_rank)
    # scratch counts: the plan's own, is_token_in_rank a fresh allocation apart from them
    per_rank, per_expert, in_rank = be.dispatch_layout(topk, E, scratch_counts=True)
    _apart({"per_rank": per_rank, "per_expert": per_expert, "in_rank": in_rank})
    assert _storage(in_rank) != _storage(per_rank)
