"""Seeded inputs and single-process oracles for distributed tests and benchmarks.

All ranks' inputs come from one seed: ``make_inputs(case, rank)`` is a pure function, so any rank can
rebuild what any peer sends and compute what it must receive without communicating. Payload rows
identify themselves: column 0 holds the source rank and column 1 the token index (both exact in
BF16 for values < 256), the rest is random.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import layout


@dataclasses.dataclass(frozen=True)
class Case:
    """One routing scenario. ``tokens`` may differ per rank (a tuple of R ints)."""

    num_ranks: int
    tokens: tuple[int, ...]
    hidden: int = 256
    num_topk: int = 4
    num_experts: int = 16
    seed: int = 0
    drop_prob: float = 0.1       # chance that a top-k slot is -1
    hot_expert: int | None = None  # this expert takes about a third of the tokens
    empty_rank: int | None = None  # no token selects an expert on this rank
    no_expert_token: bool = True   # token 0 of every rank selects no expert

    def tokens_of(self, rank: int) -> int:
        return self.tokens[rank]


def to_device(obj, device):
    """``obj`` on ``device``: a tensor keeps its dtype, shape and strides (a column-major or strided
    view stays so, where ``Tensor.to`` would make a strided view contiguous); a tuple or list is moved
    item by item (a tuple comes back as a plain tuple); ``None`` stays ``None``. A tensor already on
    ``device`` is returned as it is, so on the CPU this is the identity. Not for expanded (stride 0)
    tensors.

    Tests generate inputs on the CPU (the functions below) and move them with this, so every device
    gets the same values.
    """
    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        device = torch.device(device)
        if obj.device == device:
            return obj
        out = torch.empty_strided(obj.shape, obj.stride(), dtype=obj.dtype, device=device)
        out.copy_(obj)
        return out
    if isinstance(obj, (tuple, list)):
        items = [to_device(o, device) for o in obj]
        return items if isinstance(obj, list) else tuple(items)
    raise TypeError(f"to_device takes a tensor, a tuple or list of them, or None; got {type(obj).__name__}")


def _gen(case: Case, rank: int, salt: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed((case.seed * 1_000_003 + rank * 7919 + salt) & 0x7FFFFFFF)
    return g


def make_topk(case: Case, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_idx int64[T, K], topk_weights float32[T, K])`` for ``rank``; distinct experts per row."""
    t, k, e = case.tokens_of(rank), case.num_topk, case.num_experts
    g = _gen(case, rank, 1)
    allowed = torch.ones(e, dtype=torch.bool, device="cpu")
    if case.empty_rank is not None:
        lx = e // case.num_ranks
        allowed[case.empty_rank * lx:(case.empty_rank + 1) * lx] = False
    pool = allowed.nonzero().squeeze(1)
    kk = min(k, pool.numel())
    scores = torch.rand(t, pool.numel(), generator=g, dtype=torch.float32, device="cpu")
    if case.hot_expert is not None and bool(allowed[case.hot_expert]):
        hot_col = int((pool == case.hot_expert).nonzero())
        hot_rows = torch.rand(t, generator=g, dtype=torch.float32, device="cpu") < 0.34
        scores[hot_rows, hot_col] = 2.0
    idx = pool[scores.topk(kk, dim=1).indices] if t else torch.empty(0, kk, dtype=torch.int64, device="cpu")
    if kk < k:
        idx = torch.cat([idx, torch.full((t, k - kk), -1, dtype=torch.int64, device="cpu")], 1)
    drop = torch.rand(t, k, generator=g, dtype=torch.float32, device="cpu") < case.drop_prob
    idx = idx.masked_fill(drop, -1)
    if case.no_expert_token and t > 0:
        idx[0] = -1
    w = torch.rand(t, k, generator=g, dtype=torch.float32, device="cpu") + 0.1
    w = w.masked_fill(idx < 0, 0.0)
    return idx.to(torch.int64), w.to(torch.float32)


def make_x(case: Case, rank: int) -> torch.Tensor:
    """``bf16[T, H]`` random rows (never zeros) tagged with (rank, token) in columns 0 and 1."""
    t, h = case.tokens_of(rank), case.hidden
    g = _gen(case, rank, 2)
    x = torch.randn(t, h, generator=g, dtype=torch.float32, device="cpu").to(torch.bfloat16)
    if h >= 2 and t:
        x[:, 0] = float(rank)
        x[:, 1] = torch.arange(t, dtype=torch.float32, device="cpu").remainder(256)
    return x


def expected_dispatch(case: Case, me: int, xs: list[torch.Tensor] | None = None) -> dict:
    """What rank ``me`` must receive, computed from every rank's regenerated inputs.

    Returns ``recv_x`` (rank-major, token-ascending rows), ``recv_topk_idx`` (local ids),
    ``recv_topk_weights``, ``recv_src_idx`` and ``per_expert`` (int64[L], unaligned).
    """
    r_, e = case.num_ranks, case.num_experts
    lx = e // r_
    rows, idxs, ws, srcs = [], [], [], []
    per_expert = torch.zeros(lx, dtype=torch.int64)
    for i in range(r_):
        topk, w = make_topk(case, i)
        x = make_x(case, i) if xs is None else xs[i]
        _, per_e, in_rank = layout.dispatch_layout(topk, e, r_)
        sel = in_rank[:, me].nonzero().squeeze(1)
        rows.append(x[sel])
        li, lw = layout.local_topk(topk[sel], w[sel], me, lx)
        idxs.append(li)
        ws.append(lw)
        srcs.append(sel.to(torch.int32))
        per_expert += per_e[me * lx:(me + 1) * lx].to(torch.int64)
    return {"recv_x": torch.cat(rows), "recv_topk_idx": torch.cat(idxs), "recv_topk_weights": torch.cat(ws),
            "recv_src_idx": torch.cat(srcs), "per_expert": per_expert}
