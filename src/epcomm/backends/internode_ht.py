"""High-throughput mode of the internode backend, hierarchical (kernels/internode_ht.py): a token crosses
the network at most once per destination node, to the rank with the sender's local index there, which
forwards it over NVLink; combine reduces in the node first, then one partial sum per token and node
crosses back.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``, ``C``
channels, ``N`` ranks per node, ``P = R/N`` nodes, ``TM`` the most tokens any rank dispatches.

The host part: the layout exchange (``notify``: counts per rank, channel prefixes, per-expert counts,
each rank's token count and per-node counts) is one ``all_gather`` over the group, as the reference
backend's, and is the call's one host synchronisation; the handle is computed from it as the reference
computes it, so it is identical. The payload travels as opaque rows: the reference's packing
(``x | scales | topk_idx | weights | source index``), each followed for the relays by its position in
every rank's block, so ``recv_x`` and the rest are unpacked exactly as the reference unpacks them.
Cached dispatch replays the layout stored with the handle (``recv_src_idx._epcomm_ht``).

HT region of the symmetric buffer (``InternodeBackend.ht_off``, ``ht_bytes``): 2 parities of signal
words, then four equal areas: dispatch parity 0 and 1 (staging ``TM`` messages, RDMA receive ``P x TM``
messages, NVL receive ``R x TM`` rows), combine parity 0 and 1 (relay ``P x N x TM`` rows, staging and
final ``P x TM`` partial sums). Parities alternate per call (dispatch and combine counted apart); the
signal words are counters, so no area needs resetting. ``num_worst_tokens`` pads as the reference does
(the notify still synchronises with the host: these calls are not capturable in a CUDA graph here).
"""

from __future__ import annotations

import torch

from .. import layout
from ..kernels.launch import Launcher, Ptr
from ..layout import DispatchHandle
from .base import DispatchArgs, DispatchResult
from .reference import _pack, _pad_rows, _unpack, check_worst, pack_dispatch_rows, unpack_dispatch_rows

_BLOCK = 1024
# levels (int32, per parity): forward (waits D_RDMA), gather (D_FWD), relay (C_REL), final (C_FIN)
_L_FWD, _L_GATHER, _L_RELAY, _L_FINAL = 0, 2, 4, 6
_T_SEND, _T_FWD, _T_GATHER, _T_CSEND, _T_RELAY, _T_FINAL = range(6)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _align(n: int, a: int = 128) -> int:
    return (n + a - 1) // a * a


def _dispatch_areas(tm: int, w: int, mw: int, r_: int, p_: int) -> tuple[int, int, int]:
    """Offsets in a dispatch area (relative to its start) of the node slots and the rank slots, and
    the bytes it needs: the staged messages ``[tm, mw]``, one slot per node, one per rank (words)."""
    rdma = _align(tm * mw * 4)
    nvl = rdma + _align(p_ * tm * mw * 4)
    return rdma, nvl, nvl + r_ * tm * w * 4


def _combine_areas(tm: int, cw: int, fw: int, n_: int, p_: int) -> tuple[int, int, int]:
    """Offsets in a combine area of the relay's staging and the final partials, and the bytes it
    needs: a slot of ``[tm, cw]`` per rank, then ``[tm, fw]`` per node twice (words)."""
    stage = _align(p_ * n_ * tm * cw * 4)
    fin = stage + _align(p_ * tm * fw * 4)
    return stage, fin, fin + p_ * tm * fw * 4


def high_throughput_bytes(num_tokens: int, hidden: int, num_topk: int, num_ranks: int, ranks_per_node: int,
                          round_mib: bool = True) -> int:
    """The high-throughput buffer (``num_nvl_bytes``, plus ``num_rdma_bytes`` outside low-latency
    mode) this path needs for batches of up to ``num_tokens`` per rank: four areas (dispatch and
    combine, two parities each), each the larger of a BF16 dispatch with top-k (the staged rows, one
    slot per node, one per rank of the node) and a combine (a slot per rank, two per node), plus the
    signals. Rounded up to MiB unless ``round_mib`` is false; nodes of one rank need the most.
    Example: 4096 tokens of 7168 with top-8 at 2 ranks in nodes of 1 -> 2244 MiB (the combine's
    float32 partials are the larger part)."""
    r_, n_ = num_ranks, ranks_per_node
    p_, tm = r_ // n_, max(1, num_tokens)
    w = (2 * hidden + 12 * num_topk + 4 + 3) // 4  # x, topk_idx (int64), weights, token index
    dispatch = _dispatch_areas(tm, w, w + r_, r_, p_)[2]
    combine = _combine_areas(tm, (2 * hidden + 3) // 4 + num_topk + 1, hidden + num_topk + 1, n_, p_)[2]
    need = 4 * max(dispatch, combine) + 2 * _align((2 * p_ + 2 * n_) * 8)
    return (need + (1 << 20) - 1) >> 20 << 20 if round_mib else need


def _go(launcher: Launcher, name: str, grid: tuple, *args, **consts) -> None:
    """Launch with a key that fixes what Triton specialises on: integer arguments (1, divisible by 16,
    64-bit; the offsets and sizes here change with the call's shapes) and per-call tensors' 16-byte
    alignment (a slice of a fresh tensor need not be aligned; kernels/launch.py)."""
    key = (name,) + tuple((a == 1, a % 16 == 0, a >= 1 << 31) if type(a) is int
                          else a.data_ptr() & 15 == 0 if type(a) is torch.Tensor else None for a in args)
    launcher(key, grid, *args, **consts)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """``int32`` like ``mask [T, X]``: the row's index among the set rows of its column, -1 where unset.
    Example: ``[[1, 0], [1, 1], [0, 1]] -> [[0, -1], [1, 0], [-1, 1]]``."""
    m = mask.to(torch.int32)
    return torch.where(mask, m.cumsum(0, dtype=torch.int32) - 1, torch.full_like(m, -1))


class _Info:
    """What a handle's later calls (cached dispatch, combine) need of its dispatch's layout exchange."""

    def __init__(self, tokens: list[int], node_cnt: torch.Tensor, tm: int, counts: torch.Tensor) -> None:
        self.tokens = tokens  # T of every rank
        self.node_cnt = node_cnt  # [R, P]: tokens rank s sends to node b
        self.tm = tm
        self.counts = counts  # [R, R] int64 on the host: tokens rank s sends to rank d (no device read later)
        self.src_rank: torch.Tensor | None = None  # combine's source rank per received row, made once


class InternodeHighThroughput:
    def __init__(self, be) -> None:
        from ..kernels import internode_ht as ih
        from ..kernels import nvshmem

        self.be = be
        r_, n_ = be.num_ranks, be.ranks_per_node
        self.p_nodes = r_ // n_
        dev = be.device
        self.levels = torch.zeros(8, dtype=torch.int32, device=dev)
        self.tickets = torch.zeros(8, dtype=torch.int32, device=dev)
        self.p_table, self.p_err = Ptr(be.ptr_table), Ptr(be.err)
        self.p_lv = [Ptr(self.levels[i:]) for i in range(8)]
        self.p_t = [Ptr(self.tickets[i:]) for i in range(6)]
        sim = be.sim
        self.k_send = Launcher(nvshmem.nvshmem_kernel(ih._hd_send_kernel, sim))
        self.k_fwd = Launcher(ih._hd_forward_kernel)
        self.k_gather = Launcher(ih._hd_gather_kernel)
        self.k_csend = Launcher(ih._hc_send_kernel)
        self.k_relay = Launcher(nvshmem.nvshmem_kernel(ih._hc_relay_kernel, sim))
        self.k_final = Launcher(ih._hc_final_kernel)
        sig_words = 2 * self.p_nodes + 2 * n_
        self.sig_stride = _align(sig_words * 8)
        self.sig = [be.ht_off + p * self.sig_stride for p in (0, 1)]
        start = be.ht_off + 2 * self.sig_stride
        self.area_bytes = (be.ht_bytes - 2 * self.sig_stride) // 4 // 128 * 128
        self.areas = [start + q * self.area_bytes for q in range(4)]  # dispatch p0, p1, combine p0, p1
        self.d_calls = 0
        self.c_calls = 0
        self.peak_bytes = 0

    def _need(self, need: int, what: str) -> None:
        self.peak_bytes = max(self.peak_bytes, 4 * need + 2 * self.sig_stride)  # what this rank has needed
        if need > self.area_bytes:
            buf = self.be._buf()
            raise ValueError(f"num_nvl_bytes={buf.num_nvl_bytes if buf else '?'} is too small for this {what}: the "
                             f"internode backend needs {4 * need + 2 * self.sig_stride} bytes of high-throughput "
                             "buffer (num_nvl_bytes, plus num_rdma_bytes outside low-latency mode)")

    @property
    def _timer(self) -> bool:
        return not self.be.sim

    # ------------------------------------------------------------------ dispatch

    def _move(self, words: torch.Tensor, is_in: torch.Tensor, counts: torch.Tensor, info: _Info) -> torch.Tensor:
        """The payload rows ``words [T, W]`` (int32) to the ranks ``is_in`` names, through the relays:
        returns this rank's received rows ``[n, W]`` in (source rank, token) order."""
        be = self.be
        r_, me, n_, p_ = be.num_ranks, be.rank, be.ranks_per_node, self.p_nodes
        dev = be.device
        t, w = words.shape
        tm = info.tm
        mw = w + r_
        msg = torch.cat([words, _positions(is_in)], dim=1).contiguous()
        npos = _positions(is_in.view(t, p_, n_).any(2)).contiguous()
        self.last_npos = npos  # [T, P]: each token's row for each node (-1: not sent there); the tests read it
        parity = self.d_calls % 2
        self.d_calls += 1
        base, sig = self.areas[parity], self.sig[parity]
        stage_off = base
        rdma_rel, nvl_rel, need = _dispatch_areas(tm, w, mw, r_, p_)
        rdma_off, nvl_off = base + rdma_rel, base + nvl_rel
        slot_words = tm * mw
        nvl_slot_words = tm * w
        self._need(need, "dispatch")
        timer = self._timer
        _go(self.k_send, "send", (max(t, 1),), msg, npos, t, mw, me, n_, p_, self.p_table, stage_off, rdma_off,
                    slot_words, sig, self.p_t[_T_SEND], BLOCK=_BLOCK, SIM=be.sim)
        i = me % n_
        b = me // n_
        cnt = info.node_cnt[[a * n_ + i for a in range(p_)], b].to(torch.int32)
        _go(self.k_fwd, "fwd", (p_, max(1, int(cnt.max()))), cnt.to(dev), w, mw, me, n_, p_, r_, self.p_table,
                   rdma_off, slot_words, nvl_off, nvl_slot_words, sig, self.p_lv[_L_FWD + parity], self.p_t[_T_FWD],
                   self.p_err, be.timeout_ns, BLOCK=_BLOCK, HAS_TIMER=timer)
        recv_counts = counts[:, me].tolist()
        n = sum(recv_counts)
        offs = [torch.arange(c_, dtype=torch.int64) * w + (nvl_off // 4 + s * nvl_slot_words)
                for s, c_ in enumerate(recv_counts)]
        off = torch.cat(offs).to(dev) if n else torch.zeros(1, dtype=torch.int64, device=dev)
        out = torch.empty(n, w, dtype=torch.int32, device=dev)
        _go(self.k_gather, "gather", (max(n, 1),), off, n, out, w, me, n_, p_, self.p_table, sig,
                      self.p_lv[_L_GATHER + parity], self.p_t[_T_GATHER], self.p_err, be.timeout_ns, BLOCK=_BLOCK,
                      HAS_TIMER=timer)
        be.check_mirror()
        return out

    def dispatch(self, a: DispatchArgs) -> DispatchResult:
        be = self.be
        r_, me, n_, p_ = be.num_ranks, be.rank, be.ranks_per_node, self.p_nodes
        dev = a.x.device
        t = a.x.shape[0]
        e = a.num_tokens_per_expert.numel()
        lx = e // r_
        c = a.num_channels
        is_in = a.is_token_in_rank.contiguous()
        counts_here = is_in.sum(0, dtype=torch.int64)
        cpm = layout.channel_prefix_matrix(is_in, c)
        to_node = is_in.view(t, p_, n_).any(2).sum(0, dtype=torch.int64)  # [P]
        extra = torch.zeros(r_, 2, dtype=torch.int64, device=dev)
        extra[:, 0] = t
        extra[::n_, 1] = to_node  # tokens to node b in the row of rank b*N
        meta = torch.cat([counts_here.view(r_, 1), cpm.to(torch.int64),
                          a.num_tokens_per_expert.to(torch.int64).view(r_, lx), extra,
                          a.num_tokens_per_rank.to(torch.int64).view(r_, 1)], dim=1)
        g = be._ref._all_gather(meta, "dispatch/notify").cpu()  # [src, dst, 1 + C + L + 3]: the host sync
        counts = g[:, :, 0]
        bad = (counts != g[:, :, -1]).any(1).nonzero().flatten().tolist()
        if bad:  # every rank sees every rank's pair, so all of them raise, and none waits on a peer
            s_ = bad[0]
            raise ValueError(f"num_tokens_per_rank={g[s_, :, -1].tolist()} does not match is_token_in_rank, "
                             f"which sends {counts[s_].tolist()} tokens per rank"
                             + ("" if s_ == me else f" (on rank {s_})"))
        rank_prefix = layout.rank_prefix_matrix(counts)
        recv_cp = layout.recv_channel_prefix_matrix(rank_prefix, g[:, me, 1:1 + c], me)
        per_expert = layout.align_up(g[:, me, 1 + c:1 + c + lx].sum(0), a.expert_alignment)
        tokens = g[:, 0, 1 + c + lx].tolist()
        info = _Info(tokens, g[:, ::n_, 2 + c + lx], max(1, max(tokens)), counts)
        n = int(counts[:, me].sum())
        check_worst(counts, a.num_worst_tokens)
        recv = self._move(pack_dispatch_rows(a).view(torch.int32), is_in, counts, info).view(torch.uint8)
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = unpack_dispatch_rows(
            recv, a, me, lx, a.num_worst_tokens or n)
        recv_src_idx._epcomm_ht = info
        handle = DispatchHandle(rank_prefix.to(dev), cpm.to(dev), recv_cp.to(dev), recv_src_idx, is_in,
                                layout.send_head(is_in, rank_prefix.to(dev), me))
        lst = [] if a.num_worst_tokens else per_expert.tolist()
        return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, lst, handle)

    @staticmethod
    def _info(handle: DispatchHandle) -> _Info:
        info = getattr(handle.recv_src_idx, "_epcomm_ht", None)
        if info is None:
            raise ValueError("handle must come from this Buffer's dispatch (internode backend)")
        return info

    def cached_dispatch(self, x, x_scales, handle: DispatchHandle):
        info = self._info(handle)
        parts = [x] + ([x_scales] if x_scales is not None else [])
        recv = self._move(_pack(parts).view(torch.int32), handle.is_token_in_rank.contiguous(),
                          info.counts, info).view(torch.uint8)
        specs = [(x.dtype, (x.shape[1],))] + ([(torch.float32, (x_scales.shape[1],))] if x_scales is not None else [])
        fields = _unpack(recv, specs)
        rows = handle.recv_src_idx.numel()
        recv_x = _pad_rows(fields[0], rows, 0)
        recv_scales = _pad_rows(fields[1], rows, 0) if x_scales is not None else None
        return recv_x, recv_scales

    # ------------------------------------------------------------------ combine

    def combine(self, x, handle: DispatchHandle, topk_weights, bias):
        be = self.be
        info = self._info(handle)
        r_, me, n_, p_ = be.num_ranks, be.rank, be.ranks_per_node, self.p_nodes
        dev = x.device
        counts = info.counts
        n = int(counts[:, me].sum())
        t = handle.is_token_in_rank.shape[0]
        h = x.shape[1]
        k = topk_weights.shape[1] if topk_weights is not None else 0
        parts = [x[:n]] + ([topk_weights[:n]] if topk_weights is not None else [])
        rows = _pack(parts).view(torch.int32)  # [n, H/2 + K]
        cw = rows.shape[1] + 1
        fw = h + k + 1
        tm = info.tm
        if info.src_rank is None:  # once per handle: later combines on it reuse the device tensor
            info.src_rank = torch.repeat_interleave(torch.arange(r_, dtype=torch.int32), counts[:, me]).to(dev)
        src_rank = info.src_rank
        src_tok = handle.recv_src_idx[:n].to(torch.int32).contiguous()
        parity = self.c_calls % 2
        self.c_calls += 1
        call_id = self.c_calls
        base, sig = self.areas[2 + parity], self.sig[parity]
        rel_off = base
        rel_slot_words = tm * cw
        stage_rel, fin_rel, need = _combine_areas(tm, cw, fw, n_, p_)
        stage_off, fin_off = base + stage_rel, base + fin_rel
        fin_slot_words = tm * fw
        self._need(need, "combine")
        timer = self._timer
        _go(self.k_csend, "csend", (max(n, 1),), rows.contiguous(), src_rank, src_tok, n, cw, call_id, me, n_, p_,
                     self.p_table, rel_off, rel_slot_words, sig, self.p_t[_T_CSEND], BLOCK=_BLOCK)
        tok = torch.tensor(info.tokens, dtype=torch.int32, device=dev)
        _go(self.k_relay, "relay", (p_, tm), tok, h, k, cw, fw, call_id, me, n_, p_, self.p_table, rel_off,
                     rel_slot_words, stage_off, fin_off, fin_slot_words, sig, self.p_lv[_L_RELAY + parity],
                     self.p_t[_T_RELAY], self.p_err, be.timeout_ns, BLOCK=_BLOCK, K_POW2=_pow2(max(k, 1)),
                     HAS_TIMER=timer, SIM=be.sim)
        out = torch.empty(t, h, dtype=torch.float32, device=dev)
        w_out = torch.empty(t, k, dtype=torch.float32, device=dev) if topk_weights is not None else None
        _go(self.k_final, "final", (max(t, 1),), out, w_out if w_out is not None else out, t, h, k, fw, call_id,
                     me, n_, p_, self.p_table, fin_off, fin_slot_words, sig, self.p_lv[_L_FINAL + parity],
                     self.p_t[_T_FINAL], self.p_err, be.timeout_ns, BLOCK=_BLOCK, K_POW2=_pow2(max(k, 1)),
                     HAS_W=w_out is not None, HAS_TIMER=timer)
        be.check_mirror()
        for b_ in bias:
            out += b_.float()
        return out.to(x.dtype), w_out
