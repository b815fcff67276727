"""Tier 1: the ``ElasticBuffer`` oracles of ``epcomm.testing.elastic_cases``, computed for every token at once,
give bit for bit what the same oracles written as loops over tokens and lanes give (the loops below are
those oracles as they were): the expert outputs, what a rank receives (rows, scales, local ids, weights,
counts, the expanded (row, lane) order), the expert outputs handed to combine for a handle, and the expected
combine, with 0-2 biases, one or several reductions a rank. (One difference: where no row arrives, FP8's scales
are an empty ``[0, H/128]`` tensor, which the loops gave as None: a check of such a dispatch then failed on None.)
The loop versions were the oracles the tier-2
and tier-3 tests held the reference backend and the fast backends to; the batched ones replace them there.
"""

from __future__ import annotations

import types

import pytest
import torch

from epcomm.testing import elastic_cases as C

# ----------------------------------------------------------------------------- the oracles as loops


def loop_expert_output(gid: int, lane: int, hidden: int) -> torch.Tensor:
    if lane < 2:
        return torch.full((hidden,), (1 - 2 * lane) * 2.0 ** 12 * (1 + (gid % 3) / 4), dtype=torch.bfloat16)
    scale = 2.0 ** ((gid * 5 + lane * 11) % 8 - 4)
    return (torch.sin(torch.arange(1, hidden + 1, dtype=torch.float32) * ((gid * 7 + lane * 3) % 101 + 1) / 97)
            * scale).to(torch.bfloat16)


def loop_expected_dispatch(case, rank, sf_kind, alignment):
    le = case.num_experts // case.num_ranks
    lo = rank * le
    gid, xs, sfs, loc, ws = [], [], [], [], []
    for s in range(case.num_ranks):
        x, sf, idx, w = C.inputs(case, s, sf_kind)
        for t in range(case.tokens[s]):
            here = (idx[t] >= lo) & (idx[t] < lo + le)
            if not bool(here.any()):
                continue
            gid.append(s * case.m + t)
            xs.append(x[t])
            sfs.append(None if sf is None else sf[t])
            loc.append(torch.where(here, idx[t] - lo, torch.full_like(idx[t], -1)))
            ws.append(torch.where(here, w[t], torch.zeros_like(w[t])))
    k, h = case.num_topk, case.hidden
    local = torch.stack(loc) if loc else torch.zeros(0, k, dtype=torch.int64)
    expanded = [[(n, j) for n in range(local.shape[0]) for j in range(k) if int(local[n, j]) == l] for l in range(le)]
    counts = [len(v) for v in expanded]
    starts, at = [], 0
    for c in counts:
        starts.append(at)
        at += (c + alignment - 1) // alignment * alignment
    return {
        "gid": gid, "local": local, "counts": counts, "starts": starts, "expanded": expanded,
        "x": torch.stack(xs) if xs else torch.zeros(0, h, dtype=C.inputs(case, rank, sf_kind)[0].dtype),
        "sf": None if sf_kind == "bf16" else (torch.stack(sfs) if sfs else None),
        "w": torch.stack(ws) if ws else torch.zeros(0, k),
    }


def loop_expected_combine(case, rank, n_bias, multi):
    _, _, idx, _ = C.inputs(case, rank)
    le = case.num_experts // case.num_ranks
    b = C.bias(case, rank, n_bias)
    out = []
    for t in range(case.tokens[rank]):
        acc = (b[0][t].float() + b[1][t].float()) if n_bias == 2 else (b[0][t].float() if n_bias else
                                                                      torch.zeros(case.hidden))
        gid = rank * case.m + t
        lanes = [j for j in range(case.num_topk) if int(idx[t, j]) >= 0]
        for j in lanes:
            if not multi:
                acc = acc + loop_expert_output(gid, j, case.hidden).float()
                continue
            d = int(idx[t, j]) // le
            same = [i for i in lanes if int(idx[t, i]) // le == d]
            if j != max(same):
                continue
            part = torch.zeros(case.hidden)
            for i in same:
                part = part + loop_expert_output(gid, i, case.hidden).float()
            acc = acc + part.to(torch.bfloat16).float()
        out.append(acc.to(torch.bfloat16))
    return torch.stack(out) if out else torch.zeros(0, case.hidden, dtype=torch.bfloat16)


def loop_combine_input(hd, recv_topk_idx, num_rows, hidden, num_x_rows):
    meta = hd.recv_src_metadata.cpu()
    n = int(hd.psum_num_recv_tokens_per_scaleup_rank[-1])
    k = meta.shape[1] - 2
    do_expand = recv_topk_idx is None
    local = None if do_expand else recv_topk_idx.cpu()
    x = torch.full((num_x_rows if do_expand else num_rows, hidden), float("nan"), dtype=torch.bfloat16)
    for r in range(n):
        gid = int(meta[r, 0])
        if do_expand:
            for j in range(k):
                if int(meta[r, 2 + j]) >= 0:
                    x[int(meta[r, 2 + j])] = loop_expert_output(gid, j, hidden)
        else:
            acc = torch.zeros(hidden)
            for j in range(k):
                if int(local[r, j]) >= 0:
                    acc = acc + loop_expert_output(gid, j, hidden).float()
            x[r] = acc.to(torch.bfloat16)
    return x


# ----------------------------------------------------------------------------- the comparisons


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


CASES = [C.V2Case(num_ranks=2, tokens=(13, 7), hidden=256, num_topk=8, num_experts=16, masked=0.2, seed=3),
         C.V2Case(num_ranks=3, tokens=(0, 9, 20), hidden=384, num_topk=4, num_experts=6, masked=0.5, seed=8),
         C.V2Case(num_ranks=2, tokens=(0, 0), hidden=128, num_topk=3, num_experts=8, seed=1)]


def test_expert_outputs_are_the_loops():
    for h in (128, 2048):
        gid = torch.arange(0, 700, 3)
        lane = gid % 8
        got = C.expert_outputs(gid, lane, h)
        want = torch.stack([loop_expert_output(int(g), int(j), h) for g, j in zip(gid, lane)])
        assert same_bits(got, want), h
        assert all(same_bits(C.expert_output(int(g), int(j), h), want[i]) for i, (g, j) in enumerate(zip(gid, lane)))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_expected_dispatch_is_the_loops(case):
    for rank in range(case.num_ranks):
        for sf_kind, alignment in (("bf16", 1), ("fp32", 4), ("ue8m0", 128)):
            got = C.expected_dispatch(case, rank, sf_kind, alignment)
            want = loop_expected_dispatch(case, rank, sf_kind, alignment)
            assert got.keys() == want.keys()
            for key in ("gid", "counts", "starts", "expanded"):
                assert got[key] == want[key], (key, rank, sf_kind)
            if sf_kind != "bf16" and want["sf"] is None:  # no row arrives: the loops gave None, now no scales
                sf = C.inputs(case, rank, sf_kind)[1]
                assert got["sf"].shape == (0, sf.shape[1]) and got["sf"].dtype == sf.dtype, got["sf"]
                want["sf"] = got["sf"]
            for key in ("x", "local", "w", "sf"):
                assert (got[key] is None) == (want[key] is None), key
                assert got[key] is None or same_bits(got[key], want[key]), (key, rank, sf_kind)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_expected_combine_is_the_loops(case):
    for rank in range(case.num_ranks):
        for n_bias in (0, 1, 2):
            for multi in (False, True):
                assert same_bits(C.expected_combine(case, rank, n_bias, multi),
                                 loop_expected_combine(case, rank, n_bias, multi)), (rank, n_bias, multi)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_combine_input_is_the_loops(case):
    """For a handle made from the oracle's own dispatch: contiguous (sums of local lanes) and expanded (a slot a
    (row, lane), aligned to 4), rows past the received ones NaN."""
    for rank in range(case.num_ranks):
        want = C.expected_dispatch(case, rank, "bf16", 4)
        n, k = len(want["gid"]), case.num_topk
        meta = torch.full((n + 3, 2 + k), -1, dtype=torch.int32)
        meta[:n, 0] = torch.tensor(want["gid"], dtype=torch.int32)
        for l, pairs in enumerate(want["expanded"]):
            for i, (row, j) in enumerate(pairs):
                meta[row, 2 + j] = want["starts"][l] + i
        hd = types.SimpleNamespace(recv_src_metadata=meta,
                                   psum_num_recv_tokens_per_scaleup_rank=torch.tensor([n], dtype=torch.int32))
        rows = sum((c + 3) // 4 * 4 for c in want["counts"]) + 5
        for recv_idx in (None, torch.cat([want["local"], torch.full((3, k), -1)])):
            got = C.combine_input(hd, recv_idx, n + 3, case.hidden, rows)
            assert same_bits(got, loop_combine_input(hd, recv_idx, n + 3, case.hidden, rows)), (rank, recv_idx is None)
