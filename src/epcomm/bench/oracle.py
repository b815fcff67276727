"""The oracle's results on the input set a benchmark verifies its timed calls on, and the comparisons.

Every timed call is checked against the reference backend (the oracle) on the same inputs, the way it
was timed (eager or graph replay): dispatch bitwise (low-latency FP8 data within one e4m3 rounding
step of the reference's cast, the same rule as the case check), combine within the BF16 budget of a
float32 reduction (``testing/compare.py``).

Letters: ``T`` tokens per rank, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``,
``M`` low-latency max tokens per rank.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .. import layout
from ..testing.compare import assert_bitwise, assert_fp8_within_one_step, assert_within_budget
from .cases import BenchCase
from .timing import NotChecked


@dataclasses.dataclass
class HTExpect:
    """The reference's high-throughput results on input set ``set_index`` (``workloads.check_ht``)."""
    recv_x: torch.Tensor                          # bf16 rows received
    recv_fp8: tuple[torch.Tensor, torch.Tensor]   # fp8 rows and scales received
    combined: torch.Tensor                        # float64: combine(dispatch(x)) exactly
    combined_abs: torch.Tensor                    # float64: the same of |x| (the reduction budget)
    num_ranks: int
    set_index: int = 0

    def _set(self, s: int) -> None:
        if s != self.set_index:
            raise NotChecked(f"the reference ran on set {self.set_index}, not set {s}")

    def dispatch(self, s: int, out, fp8: bool, what: str) -> None:
        """Bitwise the reference's rows (the first ``N`` of a padded ``num_worst_tokens`` result)."""
        self._set(s)
        recv = out[0]
        if fp8:
            n = self.recv_fp8[0].shape[0]
            assert_bitwise(recv[0][:n], self.recv_fp8[0], f"{what} fp8 recv_x")
            assert_bitwise(recv[1][:n], self.recv_fp8[1], f"{what} fp8 recv scales")
        else:
            n = self.recv_x.shape[0]
            assert_bitwise(recv[:n], self.recv_x, f"{what} bf16 recv_x")

    def combine(self, s: int, out, what: str) -> None:
        """combine(dispatch(x)) = x * (ranks the token went to), within the BF16 reduction budget."""
        self._set(s)
        assert_within_budget(out[0], self.combined, self.combined_abs, self.num_ranks, what)


def canonical_ll(recv_x: tuple[torch.Tensor, torch.Tensor], recv_count: torch.Tensor, handle) -> dict:
    """The valid rows of a low-latency FP8 dispatch, sorted by (expert, source rank, source token),
    copied out (the receive buffers are reused two calls later). Rows within a source block may
    arrive in any order; this makes two backends' results comparable bitwise."""
    q, sc = recv_x
    lx, rm, _ = q.shape
    m = handle.num_max_dispatch_tokens_per_rank
    begin, count = layout.unpack_layout_range(handle.layout_range)
    slot = torch.arange(rm, device=q.device).unsqueeze(0)
    valid = slot < recv_count.to(torch.int64).unsqueeze(1)
    src_rank = torch.full((lx, rm), -1, dtype=torch.int64, device=q.device)
    for r in range(begin.shape[1]):
        lo, n = begin[:, r:r + 1], count[:, r:r + 1]
        src_rank = torch.where((slot >= lo) & (slot < lo + n), r, src_rank)
    experts = torch.arange(lx, device=q.device).unsqueeze(1)
    key = (experts * begin.shape[1] + src_rank) * m + handle.recv_src_info.to(torch.int64)
    key = key[valid]
    order = torch.argsort(key)
    return {"recv_count": recv_count.clone(), "block_count": count.clone(), "key": key[order],
            "q": q.view(torch.uint8)[valid][order], "scales": sc[valid][order], "valid": valid}


@dataclasses.dataclass
class LLExpect:
    """The reference backend's results on low-latency input set ``set_index`` (:func:`ll_expect`)."""
    set_index: int
    canon: dict                  # canonical_ll of the reference's dispatch (without "valid")
    valid: torch.Tensor          # bool[L, R*M]: the reference's filled slots
    src_info: torch.Tensor       # int32[L, R*M]: the reference's recv_src_info
    layout_range: torch.Tensor   # int64[L, R]
    combined: torch.Tensor       # float64[T, H]: combine of the set's y through the reference's slots, exactly
    combined_abs: torch.Tensor   # float64[T, H]: the same of |w * y| (the reduction budget)
    num_terms: int               # 2K: K products and K additions in float32

    def _set(self, s: int) -> None:
        if s != self.set_index:
            raise NotChecked(f"the reference ran on set {self.set_index}, not set {s}")

    def dispatch(self, s: int, out, what: str) -> None:
        """``out``: a low-latency dispatch's result; bitwise the reference's rows (FP8 data within one
        e4m3 step, as the case check), up to the order within a source block."""
        self._set(s)
        canon = canonical_ll(out[0], out[1], out[2])
        for field in ("recv_count", "block_count", "key", "scales"):
            assert_bitwise(canon[field], self.canon[field], f"{what} {field}")
        assert_fp8_within_one_step(canon["q"], self.canon["q"], f"{what} q")

    def combine(self, s: int, out, what: str) -> None:
        """``out``: ``(combined bf16[T, H], the handle it combined through)``; the handle must place the
        rows where the reference did (else the reference's result is not this call's: NotChecked)."""
        self._set(s)
        combined, handle = out
        valid = self.valid
        if not (torch.equal(handle.layout_range.cpu(), self.layout_range)
                and torch.equal(handle.recv_src_info.cpu()[valid], self.src_info[valid])):
            raise NotChecked("this backend's slots differ from the reference's (allowed), so its combine of "
                             "the same expert outputs has no reference result")
        assert_within_budget(combined, self.combined, self.combined_abs, self.num_terms, what)


def _all_gather(group, t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.stack(parts)


def ll_expect(ref, st, case: BenchCase, group, set_index: int) -> LLExpect:
    """The reference Buffer ``ref``'s dispatch of ``st`` (a ``workloads.LLSet``), and the exact (float64)
    combine of ``st.y`` through the reference's slots: each rank sums ``w * y[slot]`` over the slots it
    holds per (source rank, token) and sends the partial sums to the token's owner. Collective (every
    rank, same order)."""
    m, e, k = case.tokens, case.experts, case.topk
    r_, me = dist.get_world_size(group), dist.get_rank(group)
    lx = e // r_
    recv_x, recv_count, handle, _, _ = ref.low_latency_dispatch(st.x, st.topk_idx, m, e, use_fp8=True)
    canon = canonical_ll(recv_x, recv_count, handle)
    valid = canon.pop("valid")
    ids_all = _all_gather(group, st.topk_idx)            # [R, T, K]
    w_all = _all_gather(group, st.topk_weights)          # [R, T, K]
    begin, count = layout.unpack_layout_range(handle.layout_range)
    dev = st.y.device
    slot = torch.arange(r_ * m, device=dev).unsqueeze(0)
    src_rank = torch.full((lx, r_ * m), -1, dtype=torch.int64, device=dev)
    for r in range(r_):
        lo, n = begin[:, r:r + 1].to(dev), count[:, r:r + 1].to(dev)
        src_rank = torch.where((slot >= lo) & (slot < lo + n), r, src_rank)
    l_idx, s_idx = valid.to(dev).nonzero(as_tuple=True)
    r_of, t_of = src_rank[l_idx, s_idx], handle.recv_src_info.to(dev)[l_idx, s_idx].to(torch.int64)
    sel = ids_all[r_of, t_of] == (me * lx + l_idx).unsqueeze(1)
    w = (w_all[r_of, t_of].double() * sel).sum(1, keepdim=True)
    rows = st.y[l_idx, s_idx].double() * w
    part = torch.zeros(r_ * m, 2, case.hidden, dtype=torch.float64, device=dev)  # rows r*M.. go to rank r
    part[:, 0].index_add_(0, r_of * m + t_of, rows)
    part[:, 1].index_add_(0, r_of * m + t_of, rows.abs())
    back = torch.empty_like(part)  # block q: rank q's partial sums for this rank's tokens
    dist.all_to_all_single(back, part, group=group)
    back = back.view(r_, m, 2, case.hidden).sum(0)[:st.topk_idx.shape[0]].cpu()
    return LLExpect(set_index, canon, valid.cpu(), handle.recv_src_info.cpu().clone(),
                    handle.layout_range.cpu().clone(), back[:, 0], back[:, 1], 2 * k)
