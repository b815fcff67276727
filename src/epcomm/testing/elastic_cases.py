"""Inputs and oracles for ``ElasticBuffer`` (DeepEP V2's API), used by the tier-2 and tier-3 tests.

Every rank's inputs come from one seed, so any rank computes what it must receive and what its combine
must return from the inputs alone, not with the library's layout code: a source rank's tokens selected by
mask, a reduction lane by lane in DeepEP's order over all tokens at once (``expected_reduce`` is the same
reduction written as loops over tokens; tests/unit/test_elastic_oracles.py holds the oracles to the loops
they replaced). Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts,
``R`` ranks, ``LE = E/R``, ``M`` max tokens a rank.
"""

from __future__ import annotations

import dataclasses
import functools

import torch


@dataclasses.dataclass(frozen=True)
class V2Case:
    num_ranks: int
    tokens: tuple[int, ...]   # T of every rank
    hidden: int = 256
    num_topk: int = 4
    num_experts: int = 8
    masked: float = 0.2       # share of top-k lanes set to -1
    seed: int = 0

    @property
    def m(self) -> int:
        return max(max(self.tokens), 1)


def inputs(case: V2Case, rank: int, sf_kind: str = "bf16"):
    """``(x, sf or None, topk_idx int64[T, K], topk_weights f32[T, K])`` of ``rank``. ``sf_kind``: ``bf16``
    (no scales), ``fp32`` (FP8 + fp32 per 128: ``[T, H/128]``) or ``ue8m0`` (FP8 + int32 packs, ``[T, H/128]``
    ints holding four UE8M0 bytes each, arbitrary bits: the library must move them untouched)."""
    g = torch.Generator().manual_seed(case.seed * 1000 + rank)
    t, h, k, e = case.tokens[rank], case.hidden, case.num_topk, case.num_experts
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    idx = idx.to(torch.int64)
    idx[torch.rand(t, k, generator=g) < case.masked] = -1
    w = torch.rand(t, k, generator=g)
    w[idx < 0] = 0
    if sf_kind == "bf16":
        return x, None, idx, w
    q = (torch.randn(t, h, generator=g) * 8).clamp(-440, 440).to(torch.float8_e4m3fn)
    if sf_kind == "fp32":
        return q, torch.rand(t, h // 128, generator=g) + 0.5, idx, w
    return q, torch.randint(-2**31, 2**31 - 1, (t, h // 128), generator=g, dtype=torch.int64).to(torch.int32), idx, w


def bias(case: V2Case, rank: int, n: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(case.seed * 1000 + 500 + rank)
    t = case.tokens[rank]
    scale = 2.0 ** (torch.arange(t, dtype=torch.float32).view(t, 1) * 7 % 20 - 10)
    return tuple((torch.randn(t, case.hidden, generator=g) * scale).to(torch.bfloat16) for _ in range(n))


def expert_output(gid: int, lane: int, hidden: int) -> torch.Tensor:
    """What expert lane ``lane`` of source token ``gid`` (``src_rank * M + token``) returns: ``bf16[H]``.
    Lanes 0 and 1 return ``+B`` and ``-B`` (``B`` about ``2**12``), so a float32 sum that adds the bias or
    small lanes before they cancel loses those bits: the order of the reduction shows in the result."""
    if lane < 2:
        return torch.full((hidden,), (1 - 2 * lane) * 2.0 ** 12 * (1 + (gid % 3) / 4), dtype=torch.bfloat16)
    return (_waves(hidden)[(gid * 7 + lane * 3) % 101] * 2.0 ** ((gid * 5 + lane * 11) % 8 - 4)).to(torch.bfloat16)


@functools.lru_cache(maxsize=8)
def _waves(hidden: int) -> torch.Tensor:
    """``float32[101, H]``: row ``c`` is ``sin((1..H) * (c + 1) / 97)``, each row computed alone (the same values
    whatever the batch: a row never depends on how a vectorised ``sin`` splits a longer tensor)."""
    h = torch.arange(1, hidden + 1, dtype=torch.float32)
    return torch.stack([torch.sin(h * (c + 1) / 97) for c in range(101)])


def expert_outputs(gid: torch.Tensor, lane: torch.Tensor, hidden: int) -> torch.Tensor:
    """:func:`expert_output` of every ``(gid[i], lane[i])`` (int64 tensors of one shape ``S``): ``bf16[*S, H]``."""
    gid, lane = gid.long(), lane.long()
    big = ((1 - 2 * lane) * 2.0 ** 12 * (1 + (gid % 3) / 4)).to(torch.float32)
    scale = torch.pow(2.0, ((gid * 5 + lane * 11) % 8 - 4).double()).to(torch.float32)
    small = _waves(hidden)[(gid * 7 + lane * 3) % 101] * scale.unsqueeze(-1)
    return torch.where((lane < 2).unsqueeze(-1), big.unsqueeze(-1), small).to(torch.bfloat16)


def expected_dispatch(case: V2Case, rank: int, sf_kind: str, alignment: int):
    """What ``rank`` receives, in source rank then source token order: ``dict`` with ``gid`` (list),
    ``x``, ``sf`` (None for BF16; ``[0, H/128]`` where no row arrives), ``local`` (int64[N, K]), ``w`` (f32[N, K],
    local lanes), ``counts`` (real per local expert), ``expanded`` (list over local experts of lists of ``(row,
    lane)``), ``starts`` (aligned)."""
    le = case.num_experts // case.num_ranks
    lo = rank * le
    gid, xs, sfs, loc, ws = [], [], [], [], []
    for s in range(case.num_ranks):
        x, sf, idx, w = inputs(case, s, sf_kind)
        here = (idx >= lo) & (idx < lo + le)
        sel = here.any(1).nonzero().flatten()  # the tokens with a lane here, in token order
        gid += (s * case.m + sel).tolist()
        xs.append(x[sel])
        sfs.append(None if sf is None else sf[sel])
        loc.append(torch.where(here, idx - lo, torch.full_like(idx, -1))[sel])
        ws.append(torch.where(here, w, torch.zeros_like(w))[sel])
    local = torch.cat(loc)
    # every local expert's (row, lane) pairs in row, then lane order
    expanded = [[(n, j) for n, j in (local == l).nonzero().tolist()] for l in range(le)]
    counts = [len(v) for v in expanded]
    starts, at = [], 0
    for c in counts:
        starts.append(at)
        at += (c + alignment - 1) // alignment * alignment
    return {
        "gid": gid, "local": local, "counts": counts, "starts": starts, "expanded": expanded,
        "x": torch.cat(xs), "sf": None if sf_kind == "bf16" else torch.cat(sfs), "w": torch.cat(ws),
    }


def _reduce(vals: torch.Tensor, idx: torch.Tensor, num_local_experts: int, multi: bool,
            acc: torch.Tensor) -> torch.Tensor:
    """DeepEP's reduction of per-lane values ``bf16[T, K, H]`` (lanes with ``idx < 0`` ignored) onto ``acc``
    (float32 ``[T, H]``), lane by lane for every token at once: with ``multi`` a rank's lanes summed first (lane
    order, from zero, one BF16 rounding) and added at its highest lane; lanes in order; one BF16 rounding.
    Lanes skipped are left out of a sum (``where``), not added as zeros (``-0.0 + 0.0`` is ``+0.0``)."""
    t, k, h = vals.shape
    valid = idx >= 0
    rank_of = torch.where(valid, idx // num_local_experts, torch.full_like(idx, -1))
    for j in range(k):
        if not multi:
            acc = torch.where(valid[:, j:j + 1], acc + vals[:, j].float(), acc)
            continue
        same = valid & (rank_of == rank_of[:, j:j + 1])  # [T, K]: the lanes of lane j's rank
        last = valid[:, j] & ~same[:, j + 1:].any(1)  # lane j is its rank's highest
        if not bool(last.any()):
            continue
        part = torch.zeros(t, h)
        for i in range(k):
            part = torch.where(same[:, i:i + 1], part + vals[:, i].float(), part)
        acc = torch.where(last.unsqueeze(1), acc + part.to(torch.bfloat16).float(), acc)
    return acc.to(torch.bfloat16)


def expected_combine(case: V2Case, rank: int, n_bias: int, multi: bool) -> torch.Tensor:
    """DeepEP's reduction for ``rank``'s tokens, each expert lane returning :func:`expert_output`: float32
    from ``bias0 + bias1``; with ``multi`` every rank's lanes summed first (in lane order, from zero, one
    BF16 rounding) and added at that rank's highest lane; lanes in order; one BF16 rounding at the end."""
    _, _, idx, _ = inputs(case, rank)
    le = case.num_experts // case.num_ranks
    t, k, h = case.tokens[rank], case.num_topk, case.hidden
    if t == 0:
        return torch.zeros(0, h, dtype=torch.bfloat16)
    b = bias(case, rank, n_bias)
    acc = (b[0].float() + b[1].float()) if n_bias == 2 else (b[0].float() if n_bias else torch.zeros(t, h))
    gid = (rank * case.m + torch.arange(t)).unsqueeze(1).expand(t, k)
    vals = expert_outputs(gid, torch.arange(k).expand(t, k), h)
    return _reduce(vals, idx, le, multi, acc)


def combine_input(hd, recv_topk_idx, num_rows: int, hidden: int, num_x_rows: int) -> torch.Tensor:
    """The expert outputs a rank hands to combine for a dispatch's handle ``hd`` (valid rows from the handle
    only): contiguous, each row the lane-ordered float32 sum of its local lanes rounded once; expanded,
    each (row, lane)'s output at its slot. Rows that are not real hold NaN, which must not reach a result."""
    meta = hd.recv_src_metadata.cpu()
    n = int(hd.psum_num_recv_tokens_per_scaleup_rank[-1])
    k = meta.shape[1] - 2
    do_expand = recv_topk_idx is None
    x = torch.full((num_x_rows if do_expand else num_rows, hidden), float("nan"), dtype=torch.bfloat16)
    gid = meta[:n, 0].long()
    if do_expand:
        slot = meta[:n, 2:2 + k].long()
        rows, lanes = (slot >= 0).nonzero(as_tuple=True)  # row, then lane order (a slot written twice: the last)
        x[slot[rows, lanes]] = expert_outputs(gid[rows], lanes, hidden)
    elif n:
        local = recv_topk_idx[:n].cpu()
        vals = expert_outputs(gid.unsqueeze(1).expand(n, k), torch.arange(k).expand(n, k), hidden)
        acc = torch.zeros(n, hidden)
        for j in range(k):
            acc = torch.where((local[:, j] >= 0).unsqueeze(1), acc + vals[:, j].float(), acc)
        x[:n] = acc.to(torch.bfloat16)
    return x


def expected_reduce(values: torch.Tensor, topk_idx: torch.Tensor, num_local_experts: int, multi: bool,
                    biases: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """DeepEP's reduction of per-lane values ``bf16[T, K, H]`` (``-1`` lanes ignored), written as loops: float32
    from ``bias0 + bias1``; with ``multi`` a rank's lanes summed first (lane order, from zero, one BF16
    rounding) and added at its highest lane; lanes in order; one BF16 rounding."""
    t, k, h = values.shape
    out = []
    for i in range(t):
        acc = torch.zeros(h)
        for b in biases:
            acc = b[i].float() if b is biases[0] else acc + b[i].float()
        lanes = [j for j in range(k) if int(topk_idx[i, j]) >= 0]
        for j in lanes:
            if not multi:
                acc = acc + values[i, j].float()
                continue
            d = int(topk_idx[i, j]) // num_local_experts
            same = [q for q in lanes if int(topk_idx[i, q]) // num_local_experts == d]
            if j == max(same):
                part = torch.zeros(h)
                for q in same:
                    part = part + values[i, q].float()
                acc = acc + part.to(torch.bfloat16).float()
        out.append(acc.to(torch.bfloat16))
    return torch.stack(out) if out else torch.zeros(0, h, dtype=torch.bfloat16)


def _eq(what, got, want):
    """``got`` equals ``want`` (shape, and values by ``torch.equal``; FP8 by its bytes), compared on ``got``'s
    device (``want`` moved there); a failure names ``what`` and the first values of both."""
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    same = got.shape == want.shape and torch.equal(got, want.to(got.device))
    if not same:
        got, want = got.cpu(), want.cpu()
        raise AssertionError(f"{what}: got {got.shape} {got.flatten()[:8]}, want {want.shape} {want.flatten()[:8]}")


def _expanded_differs(hd, rx, rw, rsf, want) -> bool:
    """Whether an expanded dispatch's slots, rows, weights (and scales) differ from ``want`` (the oracle's): every
    (row, lane) of every local expert in one comparison on the device, one value read back. True where a slot
    lies outside the received rows (the one-by-one comparison then says which)."""
    pairs = [(row, j, want["starts"][l] + i) for l, rl in enumerate(want["expanded"]) for i, (row, j) in enumerate(rl)]
    if not pairs:
        return False
    row, lane, slot = (torch.tensor(v, dtype=torch.int64) for v in zip(*pairs))
    outs = (rx, rw) if rsf is None else (rx, rw, rsf)
    if int(slot.max()) >= min(t.shape[0] for t in outs) or rx.shape[1:] != want["x"].shape[1:] or (
            rsf is not None and rsf.shape[1:] != want["sf"].shape[1:]):
        return True
    dev = rx.device
    wx, ww = want["x"][row], want["w"][row, lane]
    d_row, d_lane, d_slot = row.to(dev), lane.to(dev), slot.to(dev)
    bad = [hd.recv_src_metadata[d_row, 2 + d_lane].long() != d_slot]
    if rx.dtype == torch.float8_e4m3fn:
        bad.append(rx[d_slot].view(torch.uint8) != wx.view(torch.uint8).to(dev))
    else:
        bad.append(rx[d_slot] != wx.to(dev))
    bad.append(rw[d_slot] != ww.to(dev))
    if rsf is not None:
        bad.append(rsf[d_slot] != want["sf"][row].to(dev))
    return bool(torch.stack([b.any() for b in bad]).any())


def _expanded_one_by_one(hd, rx, rw, rsf, want, le: int) -> None:
    """The expanded dispatch's (row, lane) pairs compared one by one, expert by expert: the first difference
    raises, naming its row and lane or its slot (run where :func:`_expanded_differs` found one)."""
    for l in range(le):
        for i, (row, j) in enumerate(want["expanded"][l]):
            slot = want["starts"][l] + i
            assert int(hd.recv_src_metadata[row, 2 + j]) == slot, f"slot of row {row} lane {j}"
            _eq(f"expanded x[{slot}]", rx[slot], want["x"][row])
            _eq(f"expanded w[{slot}]", rw[slot], want["w"][row, j])
            if rsf is not None:
                _eq(f"expanded sf[{slot}]", rsf[slot], want["sf"][row])
    raise AssertionError("the expanded rows differ from the oracle's where no one-by-one comparison finds it")


def _padding_rows(starts, counts, aligned) -> torch.Tensor:
    """The rows of an expanded dispatch that only pad an expert to its alignment (int64)."""
    pad = [torch.arange(s + c, s + a) for s, c, a in zip(starts, counts, aligned)]
    return torch.cat(pad) if pad else torch.zeros(0, dtype=torch.int64)


def check_dispatch(buf, case, rank, sf_kind, expand, alignment, sync):
    """One dispatch of ``buf`` against :func:`expected_dispatch` (valid rows bitwise, counts, prefix sums,
    slots, scale strides), then a cached replay (same rows; zero padding) and a second dispatch."""
    x, sf, idx, w = (None if t is None else t.to(buf.device) for t in inputs(case, rank, sf_kind))
    want = expected_dispatch(case, rank, sf_kind, alignment)
    kw = {"topk_idx": idx, "topk_weights": w, "num_experts": case.num_experts, "num_max_tokens_per_rank": case.m,
              "expert_alignment": alignment, "do_expand": expand, "do_cpu_sync": sync, "use_tma_aligned_col_major_sf": expand}
    xin = x if sf is None else (x, sf)
    rx, ridx, rw, hd, ev = buf.dispatch(xin, **kw)
    assert ev.event is None
    rsf = None
    if sf is not None:
        rx, rsf = rx
    n = len(want["gid"])
    psum = hd.psum_num_recv_tokens_per_scaleup_rank
    assert int(psum[-1]) == n, f"psum {psum.tolist()} != {n} rows"
    assert hd.num_unaligned_recv_tokens_per_expert.tolist() == want["counts"]
    _eq("gid", hd.recv_src_metadata[:n, 0], torch.tensor(want["gid"], dtype=torch.int32))
    aligned = [(c + alignment - 1) // alignment * alignment for c in want["counts"]]
    if sync:
        assert hd.num_recv_tokens_per_expert_list == aligned and hd.num_recv_tokens == n
    else:
        assert hd.num_recv_tokens_per_expert_list == [] and hd.num_recv_tokens == case.num_ranks * case.m
    le = case.num_experts // case.num_ranks
    if not expand:
        assert rx.shape[0] == (n if sync else case.num_ranks * case.m)
        _eq("recv_x", rx[:n], want["x"])
        _eq("recv_topk_idx", ridx[:n], want["local"])
        _eq("recv_topk_weights", rw[:n], want["w"])
        if sf is not None:
            _eq("recv_sf", rsf[:n], want["sf"])
        assert hd.psum_num_recv_tokens_per_expert.tolist() == torch.tensor(aligned).cumsum(0).tolist()
    else:
        assert ridx is None and rw.dim() == 1
        ends = [s + c for s, c in zip(want["starts"], want["counts"])]
        assert hd.psum_num_recv_tokens_per_expert.tolist() == ends
        if _expanded_differs(hd, rx, rw, rsf, want):
            _expanded_one_by_one(hd, rx, rw, rsf, want, le)
        if sf is not None:
            assert rsf.stride() == (1, (rx.shape[0] + 3) // 4 * 4), f"sf strides {rsf.stride()}"
    # a replay on the handle lands in the same rows; with zero padding the gaps are zero
    rx2, ridx2, rw2, hd2, _ = buf.dispatch(xin, handle=hd, topk_weights=w, do_expand=expand,
                                           do_zero_padding=expand)
    assert hd2 is hd
    if sf is not None:
        rx2, _rsf2 = rx2
    if not expand:
        _eq("cached x", rx2[:n], rx[:n])
        _eq("cached w", rw2[:n], rw[:n])
        _eq("cached idx", ridx2[:n], ridx[:n])
    else:
        valid = hd.recv_src_metadata[:n, 2:]
        valid = valid[valid >= 0].long()
        _eq("cached expanded x", rx2[valid], rx[valid])
        _eq("cached expanded w", rw2[valid], rw[valid])
        pad = _padding_rows(want["starts"], want["counts"], aligned).to(rx2.device)
        if bool(torch.stack([rx2[pad[pad < rx2.shape[0]]].view(torch.uint8).any(),
                             rw2[pad[pad < rw2.shape[0]]].any()]).any()):
            for l in range(le):
                a, b = ends[l], want["starts"][l] + aligned[l]
                assert not rx2[a:b].view(torch.uint8).any() and not rw2[a:b].any(), f"padding of expert {l} not zero"
    # deterministic: a second dispatch gives the same rows
    rx3 = buf.dispatch(xin, **kw)[0]
    if sf is not None:
        rx3 = rx3[0]
    if not expand:
        _eq("second dispatch", rx3[:n], rx[:n])
    else:
        _eq("second dispatch", rx3[valid], rx[valid])
    return hd, ridx, rw


def check_combine(buf, case, rank, expand, n_bias, alignment, sync, num_sms: int = 0):
    """A dispatch (``num_sms``: the call's, 0 the buffer's choice), then a combine of
    :func:`combine_input` against :func:`expected_combine`, weights back."""
    x, _, idx, w = (None if t is None else t.to(buf.device) for t in inputs(case, rank))
    rx, ridx, rw, hd, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=case.num_experts,
                                       num_max_tokens_per_rank=case.m, expert_alignment=alignment,
                                       do_expand=expand, do_cpu_sync=sync, num_sms=num_sms)
    y = combine_input(hd, ridx, rx.shape[0], case.hidden, rx.shape[0]).to(buf.device)
    b = tuple(t.to(buf.device) for t in bias(case, rank, n_bias))
    multi = buf.allow_multiple_reduction
    send_w = rw if (multi or not expand) else None
    out, ow, _ = buf.combine(y, hd, topk_weights=send_w, bias=(b[0] if n_bias == 1 else (b if b else None)))
    _eq(f"combine expand={expand} biases={n_bias} multi={multi}", out, expected_combine(case, rank, n_bias,
                                                                                      multi or not expand))
    if send_w is not None:
        _eq("weights back", ow, w)
    else:
        assert ow is None
