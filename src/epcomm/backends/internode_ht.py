"""High-throughput mode of the internode backend, hierarchical (kernels/internode_ht.py and
internode_ht_combine.py): a token crosses the network at most once per destination node, to the rank
with the sender's local index there, which forwards it over NVLink; combine reduces in the node first,
then one partial sum per token and node crosses back.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``, ``C``
channels, ``N`` ranks per node, ``P = R/N`` nodes, ``TM`` the most tokens any rank dispatches.

The layout exchange: ``_hn_prep`` computes the call's layout from ``is_token_in_rank`` in one launch
(each token's row for every rank and node, the channel prefix) and stages every rank's row for every
other (its counts per rank, its ``num_tokens_per_rank``, its token count, its messages per node, its
channel prefix and expert counts for that rank); ``_hn_notify`` puts them, NVSHMEM puts with signals into
a small region of its own (``InternodeBackend.notify_off``).
The handle's tensors come from the rows in one kernel (the nvlink backend's ``_handle_kernel``, which also
checks the expert ids), bit-identical to the reference's. Then the call's one host synchronisation
copies the rows back (counts, the per-expert list, the checks that raise on every rank); with
``num_worst_tokens`` there is none: the slots are sized by the areas (``_worst_tm``), every kernel loops
over the rows its device-side counts give, the checks record in the error word, and dispatch + combine
can be captured in a CUDA graph. The payload travels as rows of int32 words the send kernel packs from
the inputs (``x | scales | topk_idx (int64) | weights | source index``, each followed for the relays by
its position in every rank's block) and the gather unpacks into the outputs, with the ids made local
and the padding as the reference's: no torch packing on either side.
Cached dispatch replays the layout stored with the handle (``recv_src_idx._epcomm_ht``).

HT region of the symmetric buffer (``InternodeBackend.ht_off``, ``ht_bytes``): 2 parities of signal
words, then four equal areas: dispatch parity 0 and 1 (staging ``TM`` messages, RDMA receive ``P x TM``
messages, NVL receive ``R x TM`` rows), combine parity 0 and 1 (relay ``P x N x TM`` rows, staging and
final ``P x TM`` partial sums). Parities alternate per call: a dispatch's on the host (a graph replays
the captured one; each dispatch's exchange orders it after every rank's previous calls, so that is
safe), a combine's on the device by its count of combines (kernels/internode_ht_combine.py says why a graph
of combines alone is then safe). The signal words are counters and a combine's rows carry that count
as their marker, so no area needs resetting and a replayed graph finds no stale rows.
"""

from __future__ import annotations

import torch

from .. import layout
from ..kernels.launch import Launcher, Ptr
from ..layout import DispatchHandle
from .base import DispatchArgs, DispatchResult, bad_expert_id

_BLOCK = 1024
# Data-moving kernels take Config.num_sms programs (fewer where there are fewer rows), each looping over
# its rows: a captured call's grid is fixed, so it cannot follow the rows that arrive
# levels (int32, per parity): forward (waits D_RDMA), gather (D_FWD), relay (C_REL), final (C_FIN)
_L_FWD, _L_GATHER, _L_RELAY, _L_FINAL = 0, 2, 4, 6
# Launch parameters of the kernels that move tokens (EPCOMM_TUNE=iht.<key>=<n>): warps a program, rows a
# step (``*_rb``) and words a row a step (``*_block``). With at most num_sms programs a kernel, each step
# moves a tile of rows (64 KB for the copies, as the nvlink engine's measured copy kernels) so that
# enough bytes are in flight per SM. Measured on H100, 2 virtual nodes under MPS, DSv3, 24 SMs
# (2026-11-25, graph replays): a row a step (4 KB) ran ~4 GB/s a program (dispatch FP8 2191 us, combine
# 4213 us); tiles of 16 rows: 792 / 1803 us; 16 warps for send and forward: dispatch FP8 660 us; 32-row
# tiles were slower (999 / 4081 us), and so was a 1024-word relay/final tile (combine 1868 us).
TUNE = dict(send_warps=16, send_rb=16, send_block=1024, fwd_warps=16, fwd_rb=16, fwd_block=1024,
            gather_warps=16, gather_rb=16, gather_block=1024, csend_warps=8, csend_rb=16, csend_block=1024,
            relay_warps=16, relay_rb=16, relay_block=512, final_warps=16, final_rb=16, final_block=512)
_T_SEND, _T_FWD, _T_GATHER, _T_CSEND, _T_RELAY, _T_FINAL, _T_NOTIFY = range(7)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _knobs(config) -> tuple[int, int]:
    """``(programs, tokens per put)`` of a call: ``Config.num_sms`` (every data-moving kernel takes at most
    that many programs, so at most that many SMs) and ``num_max_rdma_chunked_send_tokens`` (tokens per put
    across nodes); a call without a config (a backend called directly) takes DeepEP's default 20 SMs and
    one token a put."""
    if config is None:
        return 20, 1
    return max(1, config.num_sms), max(1, config.num_max_rdma_chunked_send_tokens)


def _align(n: int, a: int = 128) -> int:
    return (n + a - 1) // a * a


def _dispatch_areas(tm: int, w: int, mw: int, r_: int, p_: int) -> tuple[int, int, int]:
    """Offsets in a dispatch area (relative to its start) of the node slots and the rank slots, and
    the bytes it needs: the staged messages ``[tm, mw]``, one slot per node, one per rank (words).
    In nodes of one rank (``r_ == p_``) there are no rank slots: the gather reads the node slots
    (nothing to forward)."""
    rdma = _align(tm * mw * 4)
    nvl = rdma + _align(p_ * tm * mw * 4)
    return rdma, nvl, nvl + (r_ * tm * w * 4 if r_ > p_ else 0)


def _combine_areas(tm: int, cw: int, fw: int, n_: int, p_: int) -> tuple[int, int, int]:
    """Offsets in a combine area of the relay's staging and the final partials, and the bytes it
    needs: a slot of ``[tm, cw]`` per rank, then ``[tm, fw]`` per node twice (words)."""
    stage = _align(p_ * n_ * tm * cw * 4)
    fin = stage + _align(p_ * tm * fw * 4)
    return stage, fin, fin + p_ * tm * fw * 4


def _combine_words(h: int, k: int, n_: int) -> tuple[int, int]:
    """Words of a combine's relay row (BF16 ``x``, ``k`` weights, marker) and of its partial sum: float32
    (``h`` words, the weights, marker), or the relay row itself in nodes of one rank (``_hc_relay``'s
    ``DIRECT``: a sum of one row, sent as BF16)."""
    cw = (2 * h + 3) // 4 + k + 1
    return cw, cw if n_ == 1 else h + k + 1


def high_throughput_bytes(num_tokens: int, hidden: int, num_topk: int, num_ranks: int, ranks_per_node: int,
                          round_mib: bool = True) -> int:
    """The high-throughput buffer (``num_nvl_bytes``, plus ``num_rdma_bytes`` outside low-latency
    mode) this path needs for batches of up to ``num_tokens`` per rank: four areas (dispatch and
    combine, two parities each), each the larger of a BF16 dispatch with top-k (the staged rows, one
    slot per node, one per rank of the node) and a combine (a slot per rank, two per node), plus the
    signals. Rounded up to MiB unless ``round_mib`` is false; nodes of one rank need the most.
    Example: 4096 tokens of 7168 with top-8 at 2 ranks in nodes of 1 -> 1348 MiB (the combine is the
    larger part)."""
    r_, n_ = num_ranks, ranks_per_node
    p_, tm = r_ // n_, max(1, num_tokens)
    w = (2 * hidden + 12 * num_topk + 4 + 3) // 4  # x, topk_idx (int64), weights, token index
    dispatch = _dispatch_areas(tm, w, w + r_, r_, p_)[2]
    combine = _combine_areas(tm, *_combine_words(hidden, num_topk, n_), n_, p_)[2]
    need = 4 * max(dispatch, combine) + 2 * _align((2 * p_ + 2 * n_) * 8)
    return (need + (1 << 20) - 1) >> 20 << 20 if round_mib else need


def _go(launcher: Launcher, name: str, grid: tuple, *args, **consts) -> None:
    """Launch with a key that fixes what Triton specialises on: integer arguments (1, divisible by 16,
    64-bit; the offsets and sizes here change with the call's shapes) and per-call tensors' dtype and
    16-byte alignment (a slice of a fresh tensor need not be aligned; kernels/launch.py)."""
    key = (name,) + tuple((a == 1, a % 16 == 0, a >= 1 << 31) if type(a) is int
                          else a & 15 == 0 if type(a) is Ptr  # a level word's address: alignment varies
                          else (a.dtype, a.data_ptr() & 15 == 0) if type(a) is torch.Tensor else None for a in args)
    launcher(key, grid, *args, **consts)


class _Info:
    """What a handle's later calls (cached dispatch, combine) need of its dispatch's layout exchange, kept
    on the device (a captured call has no host copy of it): ``side [R, 1 + P]`` every rank's token count
    and its messages per node; ``rel [T, R]`` each token's row in each rank's block from here; ``npos
    [T, P]`` its row among the messages for each node (-1: not sent there); ``tm`` the rows of every
    slot."""

    def __init__(self, side: torch.Tensor, rel: torch.Tensor, npos: torch.Tensor, tm: int, worst: bool) -> None:
        self.side = side
        self.rel = rel
        self.npos = npos
        self.tm = tm
        self.worst = worst  # slots sized by the areas (num_worst_tokens), not by the calls' tokens


class InternodeHighThroughput:
    def __init__(self, be) -> None:
        from ..kernels import internode_ht as ih
        from ..kernels import internode_ht_combine as ihc
        from ..kernels import nvshmem
        from ..kernels.ht_notify import _handle_kernel

        self.be = be
        r_, n_ = be.num_ranks, be.ranks_per_node
        self.p_nodes = r_ // n_
        # nodes of one rank: nothing to forward (the gather reads the node slots) and the relay's rows are
        # already the partial sums (sent as BF16); the kernels' DIRECT
        self.direct = n_ == 1
        dev = be.device
        self.levels = torch.zeros(10, dtype=torch.int32, device=dev)
        self.tickets = torch.zeros(8, dtype=torch.int32, device=dev)
        self.p_table, self.p_err = Ptr(be.ptr_table), Ptr(be.err)
        self.p_lv = [Ptr(self.levels[i:]) for i in range(10)]
        self.p_t = [Ptr(self.tickets[i:]) for i in range(7)]
        sim = be.sim
        self.k_notify = Launcher(nvshmem.nvshmem_kernel(ih._hn_notify_kernel, sim))
        self.k_handle = Launcher(_handle_kernel)
        self.k_prep = Launcher(ih._hn_prep_kernel)
        self.k_send = Launcher(nvshmem.nvshmem_kernel(ih._hd_send_kernel, sim))
        self.k_fwd = Launcher(ih._hd_forward_kernel)
        self.k_gather = Launcher(ih._hd_gather_kernel)
        self.k_csend = Launcher(ihc._hc_send_kernel)
        self.k_relay = Launcher(nvshmem.nvshmem_kernel(ihc._hc_relay_kernel, sim))
        self.k_final = Launcher(ihc._hc_final_kernel)
        # the layout exchange's region (InternodeBackend: signals, staging, two receive parities) and the
        # private copy of the rows received (what the handle kernel and the host read)
        self.s_words = be.notify_s
        self.nsig = be.notify_off
        self.n_stage_off = be.notify_off + _align(2 * r_ * 8)
        self.n_recv_stride = _align(r_ * self.s_words * 4)
        self.n_recv_off = self.n_stage_off + self.n_recv_stride
        self.n_stage = be.symm[self.n_stage_off:self.n_stage_off + r_ * self.s_words * 4].view(torch.int32).view(
            r_, self.s_words)
        self.n_rows = torch.zeros(r_, self.s_words, dtype=torch.int32, device=dev)
        sig_words = 2 * self.p_nodes + 2 * n_
        self.sig_stride = _align(sig_words * 8)
        self.sig = [be.ht_off + p * self.sig_stride for p in (0, 1)]
        start = be.ht_off + 2 * self.sig_stride
        self.area_bytes = (be.ht_bytes - 2 * self.sig_stride) // 4 // 128 * 128
        self.areas = [start + q * self.area_bytes for q in range(4)]  # dispatch p0, p1, combine p0, p1
        self.d_calls = 0
        self.peak_bytes = 0
        self._caps: dict = {}
        self._dummies: dict = {}

    def _need(self, need: int, what: str, record: bool = True) -> None:
        if record:
            self.peak_bytes = max(self.peak_bytes, 4 * need + 2 * self.sig_stride)  # what this rank has needed
        if need > self.area_bytes:
            buf = self.be._buf()
            raise ValueError(f"num_nvl_bytes={buf.num_nvl_bytes if buf else '?'} is too small for this {what}: the "
                             f"internode backend needs {4 * need + 2 * self.sig_stride} bytes of high-throughput "
                             "buffer (num_nvl_bytes, plus num_rdma_bytes outside low-latency mode)")

    def _worst_tm(self, w: int, h: int, k: int) -> int:
        """The slots' rows for calls with ``num_worst_tokens`` (no host copy of the token counts): as many
        as the areas hold, for the dispatch (``w`` words per row) and its combine (BF16 ``h``, ``k``
        weights); the same on every rank (equal buffers). Example: 2 ranks in nodes of 1, 32 MiB
        buffer, H = 128, K = 4 -> 3129 rows (BF16 with top-k: 77 words a row)."""
        key = (w, h, k)
        tm = self._caps.get(key)
        if tm is None:
            r_, n_, p_ = self.be.num_ranks, self.be.ranks_per_node, self.p_nodes
            cw, fw = _combine_words(h, k, n_)

            def need(x):
                return max(_dispatch_areas(x, w, w + r_, r_, p_)[2], _combine_areas(x, cw, fw, n_, p_)[2])

            lo, hi = 0, self.area_bytes // 4 + 1  # need(lo) fits, need(hi) does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if need(mid) <= self.area_bytes else (lo, mid)
            tm = self._caps[key] = lo
        return tm

    @property
    def _timer(self) -> bool:
        return not self.be.sim

    # ------------------------------------------------------------------ dispatch

    def _exchange(self, a: DispatchArgs, is_in: torch.Tensor, check: bool, sms: int):
        """The layout exchange: ``_hn_prep`` computes this call's layout from ``is_in`` and stages this rank's
        row for every rank (counts per rank, ``num_tokens_per_rank``, token count, messages per node, the
        channel prefix and the expert counts for that rank), ``_hn_notify`` puts the rows (``sms`` programs at
        most). Returns every
        rank's row for this one (``[R, S]`` int32, a private tensor the next exchange overwrites), ``rel
        [T, R]``, ``npos [T, P]`` and the channel prefix matrix ``[R, C]``."""
        be = self.be
        r_, n_, p_ = be.num_ranks, be.ranks_per_node, self.p_nodes
        t, c = is_in.shape[0], a.num_channels
        lx = a.num_tokens_per_expert.numel() // r_
        dev = is_in.device
        rel = torch.empty(t, r_, dtype=torch.int32, device=dev)
        npos = torch.empty(t, p_, dtype=torch.int32, device=dev)
        cpm = torch.empty(r_, c, dtype=torch.int32, device=dev)
        ntpr = a.num_tokens_per_rank.to(torch.int32)
        ntpe = a.num_tokens_per_expert.to(torch.int32)
        _go(self.k_prep, "prep", (min(r_, sms),), is_in.view(torch.int8), t, r_, n_, c, max((t + c - 1) // c, 1),
            ntpr, ntpe, lx, self.n_stage, self.s_words, rel, npos, cpm, BLOCK=_BLOCK, R_POW2=_pow2(r_))
        _go(self.k_notify, "notify", (min(r_, sms),), be.rank, r_, self.s_words, 2 * r_ + 1 + p_ + c + lx, self.p_table,
            self.n_stage_off, self.n_recv_off, self.n_recv_stride, self.nsig, self.n_rows, self.p_lv[8],
            self.p_t[_T_NOTIFY], self.p_err, be.timeout_ns, BLOCK=_BLOCK, CHECK=check, HAS_TIMER=self._timer,
            SIM=be.sim)
        return self.n_rows, rel, npos, cpm

    def _dummy(self, dtype: torch.dtype) -> torch.Tensor:
        """A one-element tensor standing for an absent input or output (never read or written)."""
        d = self._dummies.get(dtype)
        if d is None:
            d = self._dummies[dtype] = torch.zeros(1, dtype=dtype, device=self.be.device)
        return d

    def _move(self, x: torch.Tensor, scales: torch.Tensor | None, topk_idx: torch.Tensor | None,
              topk_weights: torch.Tensor | None, src: bool, info: _Info, rows: int, rpm: torch.Tensor,
              knobs: tuple[int, int], lx: int = 1):
        """Tokens ``x [T, H]`` (their scales, top-k ids and weights, and where ``src`` their index) to the ranks
        the handle's layout (``info``) names, through the relays; the send kernel packs each message from
        them, the gather unpacks what arrived. Returns ``(recv_x, recv_scales, recv_topk_idx,
        recv_topk_weights, recv_src_idx)`` (None where there was no input), ``rows`` rows in (source rank,
        token) order (``rpm``: the rank prefix matrix), the ids made local (``lx`` experts a rank); rows
        past those that arrived
        padded as the reference pads them (``num_worst_tokens``)."""
        be = self.be
        r_, me, n_, p_ = be.num_ranks, be.rank, be.ranks_per_node, self.p_nodes
        dev = x.device
        t, h = x.shape
        i32 = self._dummy(torch.int32)
        xw = x.contiguous().view(torch.int32)  # [T, XW]: every input as int32 words (rows of 16-byte multiples)
        g = scales.shape[1] if scales is not None else 0
        k = topk_idx.shape[1] if topk_idx is not None else 0
        sw = scales.contiguous().view(torch.int32) if scales is not None else i32
        idw = topk_idx.contiguous().view(torch.int32) if topk_idx is not None else i32
        ww = topk_weights.contiguous().view(torch.int32) if topk_idx is not None else i32
        nsrc = int(src)
        w = xw.shape[1] + g + 3 * k + nsrc
        tm = info.tm
        mw = w + r_
        npos = info.npos
        self.last_npos = npos  # [T, P]: each token's row for each node (-1: not sent there); the tests read it
        parity = self.d_calls % 2
        self.d_calls += 1
        base, sig = self.areas[parity], self.sig[parity]
        stage_off = base
        rdma_rel, nvl_rel, need = _dispatch_areas(tm, w, mw, r_, p_)
        rdma_off, nvl_off = base + rdma_rel, base + nvl_rel
        slot_words = tm * mw
        nvl_slot_words = tm * w
        self._need(need, "dispatch", record=not info.worst)
        timer = self._timer
        sms, ch = knobs
        rb = TUNE["send_rb"]
        _go(self.k_send, "send", (max(1, min(-(-t // rb), sms)),), xw, sw, idw, ww, info.rel.contiguous(), npos, t,
            xw.shape[1], g, k, nsrc, r_, ch, me, n_, p_, self.p_table, stage_off, rdma_off, slot_words, sig,
            self.p_t[_T_SEND], BLOCK=TUNE["send_block"], RB=rb, S_POW2=_pow2(max(g, 2 * k, r_, 1)), SIM=be.sim,
            num_warps=TUNE["send_warps"])
        i, b = me % n_, me // n_
        side = info.side
        direct = self.direct
        if not direct:
            rb = TUNE["fwd_rb"]
            _go(self.k_fwd, "fwd", (max(1, min(-(-tm // rb), sms)),), side[i:, 1 + b:], n_ * side.stride(0), w, mw,
                me, n_, p_, r_, self.p_table, rdma_off, slot_words, nvl_off, nvl_slot_words, sig,
                self.p_lv[_L_FWD + parity], self.p_t[_T_FWD], self.p_err, be.timeout_ns, BLOCK=TUNE["fwd_block"],
                RB=rb, N_POW2=_pow2(n_), HAS_TIMER=timer, num_warps=TUNE["fwd_warps"])
        recv_x = torch.empty(rows, h, dtype=x.dtype, device=dev)
        recv_s = torch.empty(rows, g, dtype=torch.float32, device=dev) if scales is not None else None
        recv_id = torch.empty(rows, k, dtype=torch.int64, device=dev) if topk_idx is not None else None
        recv_w = torch.empty(rows, k, dtype=torch.float32, device=dev) if topk_idx is not None else None
        recv_src = torch.empty(rows, dtype=torch.int32, device=dev) if src else None
        rb = TUNE["gather_rb"]
        _go(self.k_gather, "gather", (max(1, min(-(-rows // rb), sms)),), rpm[:, me:], r_, rows,
            recv_x.view(torch.int32), recv_s.view(torch.int32) if recv_s is not None else i32,
            recv_id if recv_id is not None else self._dummy(torch.int64),
            recv_w if recv_w is not None else self._dummy(torch.float32), recv_src if src else i32,
            xw.shape[1], g, k, nsrc, me * lx, lx, me, n_, p_, r_, (rdma_off if direct else nvl_off) // 4,
            slot_words if direct else nvl_slot_words, mw if direct else w, self.p_table, sig,
            self.p_lv[_L_GATHER + parity], self.p_t[_T_GATHER], self.p_err, be.timeout_ns, BLOCK=TUNE["gather_block"],
            RB=rb, R_POW2=_pow2(r_), K_POW2=_pow2(max(k, 1)), G_POW2=_pow2(max(g, 1)), DIRECT=direct, HAS_TIMER=timer,
            num_warps=TUNE["gather_warps"])
        be.check_mirror()
        return recv_x, recv_s, recv_id, recv_w, recv_src

    def dispatch(self, a: DispatchArgs) -> DispatchResult:
        from .nvlink_params import C_MAX, L_MAX

        be = self.be
        r_, me, p_ = be.num_ranks, be.rank, self.p_nodes
        dev = a.x.device
        t, h = a.x.shape
        e = a.num_tokens_per_expert.numel()
        lx = e // r_
        c = a.num_channels
        if lx > L_MAX or c > C_MAX:
            raise ValueError(f"the internode backend supports up to {L_MAX} local experts and {C_MAX} channels, "
                             f"got L={lx}, C={c}")
        worst = a.num_worst_tokens
        k = a.topk_idx.shape[1] if a.topk_idx is not None else 0
        g_ = a.x_scales.shape[1] if a.x_scales is not None else 0
        w = h * a.x.element_size() // 4 + g_ + 3 * k + 1  # a row's words: x, scales, ids (int64), weights, index
        if worst:
            tm = self._worst_tm(w, h, k)
            if t > tm:  # (before the exchange: the other ranks then stop at its deadline, naming this one)
                raise ValueError(f"num_nvl_bytes={be.ht_bytes} holds {tm} tokens of this shape per rank with "
                                 f"num_worst_tokens, got {t} (internode_ht.high_throughput_bytes)")
        is_in = a.is_token_in_rank.contiguous()
        knobs = (max(1, a.num_sms), max(1, a.rdma_chunk))  # (as _knobs gives them for a Config)
        sms = knobs[0]
        g, rel, npos, cpm = self._exchange(a, is_in, bool(worst), sms)
        s_ = self.s_words
        rpm = torch.empty(r_, r_, dtype=torch.int32, device=dev)
        recv_cp = torch.empty(r_, c, dtype=torch.int32, device=dev)
        send_head = torch.empty(t, r_, dtype=torch.int32, device=dev)
        tb = 128
        topk = a.topk_idx.contiguous() if a.topk_idx is not None else None
        # the handle's tensors from the exchanged rows in one launch (the nvlink backend's kernel), which also
        # checks the expert ids and, with num_worst_tokens, the rows arriving
        _go(self.k_handle, "handle", (max(1, min(64, sms, (t + tb - 1) // tb)),), g, s_, g[:, 2 * r_ + 1 + p_:], s_,
            c, rel, t, r_, me, rpm, recv_cp, send_head, self.p_err, worst, topk if topk is not None else send_head, k,
            e, CHECK_WORST=bool(worst), R_POW2=_pow2(r_), C_POW2=_pow2(c), TB=tb, CHECK_TOPK=topk is not None,
            K_POW2=_pow2(k), num_warps=4)
        side = g[:, 2 * r_:2 * r_ + 1 + p_].clone()
        bad_id = None
        lst: list = []
        if worst:
            rows = worst
        else:
            gh = g.to("cpu", copy=True)  # the call's one host synchronisation
            bad_id = bad_expert_id(be, be.err_host.tolist())
            counts = gh[:, :r_]
            said = gh[:, r_:2 * r_]
            bad = (counts != said).any(1).nonzero().flatten().tolist()
            if bad:  # every rank sees every rank's pair, so all of them raise, and none waits on a peer
                s0 = bad[0]
                raise ValueError(f"num_tokens_per_rank={said[s0].tolist()} does not match is_token_in_rank, "
                                 f"which sends {counts[s0].tolist()} tokens per rank"
                                 + ("" if s0 == me else f" (on rank {s0})"))
            tm = max(1, int(gh[:, 2 * r_].max()))
            rows = int(counts[:, me].sum())
            c0 = 2 * r_ + 1 + p_ + c
            lst = layout.align_up(gh[:, c0:c0 + lx].sum(0), a.expert_alignment).tolist()
        info = _Info(side, rel, npos, tm, bool(worst))
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = self._move(
            a.x, a.x_scales, a.topk_idx, a.topk_weights, True, info, rows, rpm, knobs, lx)
        if bad_id is not None:
            raise ValueError(f"topk_idx holds expert id {bad_id}, outside [-1, {e}) for num_experts={e}")
        recv_src_idx._epcomm_ht = info
        handle = DispatchHandle(rpm, cpm, recv_cp, recv_src_idx, a.is_token_in_rank, send_head)
        return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, lst, handle)

    @staticmethod
    def _info(handle: DispatchHandle) -> _Info:
        info = getattr(handle.recv_src_idx, "_epcomm_ht", None)
        if info is None:
            raise ValueError("handle must come from this Buffer's dispatch (internode backend)")
        return info

    def cached_dispatch(self, x, x_scales, handle: DispatchHandle, config=None):
        info = self._info(handle)
        rows = handle.recv_src_idx.numel()
        recv_x, recv_s, _, _, _ = self._move(x, x_scales, None, None, False, info, rows, handle.rank_prefix_matrix,
                                             _knobs(config))
        return recv_x, recv_s

    # ------------------------------------------------------------------ combine

    def combine(self, x, handle: DispatchHandle, topk_weights, bias, config=None):
        be = self.be
        info = self._info(handle)
        r_, me, n_, p_ = be.num_ranks, be.rank, be.ranks_per_node, self.p_nodes
        dev = x.device
        rows = handle.recv_src_idx.numel()
        t = handle.is_token_in_rank.shape[0]
        h = x.shape[1]
        k = topk_weights.shape[1] if topk_weights is not None else 0
        xw = x[:rows].contiguous().view(torch.int32)  # [rows, H/2]: BF16 pairs
        ww = topk_weights[:rows].contiguous().view(torch.int32) if topk_weights is not None else xw
        cw, fw = _combine_words(h, k, n_)
        direct = self.direct
        tm = info.tm
        src_tok = handle.recv_src_idx
        if src_tok.dtype != torch.int32 or not src_tok.is_contiguous():
            src_tok = src_tok.to(torch.int32).contiguous()
        # parity 0's offsets: the kernels add the parity's (the device's count of combines, mod 2)
        base, sig = self.areas[2], self.sig[0]
        par_bytes, sig_par = self.areas[3] - self.areas[2], self.sig[1] - self.sig[0]
        rel_off = base
        rel_slot_words = tm * cw
        stage_rel, fin_rel, need = _combine_areas(tm, cw, fw, n_, p_)
        stage_off, fin_off = base + stage_rel, base + fin_rel
        fin_slot_words = tm * fw
        self._need(need, "combine", record=not info.worst)
        timer = self._timer
        sms, ch = _knobs(config)
        rb = TUNE["csend_rb"]
        _go(self.k_csend, "csend", (max(1, min(-(-rows // rb), sms)),), xw, ww, h // 2, k,
            handle.rank_prefix_matrix[:, me:], r_, src_tok, rows, cw, self.p_lv[9], me, n_, p_, r_, self.p_table,
            rel_off, rel_slot_words, sig, par_bytes, sig_par, self.p_t[_T_CSEND], BLOCK=TUNE["csend_block"], RB=rb,
            R_POW2=_pow2(r_), K_POW2=_pow2(max(k, 1)), num_warps=TUNE["csend_warps"])
        side = info.side
        rb = TUNE["relay_rb"]
        _go(self.k_relay, "relay", (max(1, min(-(-tm // rb), sms)),), side, side.stride(0), h, k, cw, fw, ch,
            self.p_lv[9], me, n_, p_, self.p_table, rel_off, rel_slot_words, stage_off, fin_off, fin_slot_words, sig,
            par_bytes, sig_par, self.p_lv[_L_RELAY], self.p_t[_T_RELAY], self.p_err, be.timeout_ns,
            BLOCK=TUNE["relay_block"], RB=rb, N_POW2=_pow2(n_), K_POW2=_pow2(max(k, 1)), DIRECT=direct,
            HAS_TIMER=timer, SIM=be.sim, num_warps=TUNE["relay_warps"])
        out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
        w_out = torch.empty(t, k, dtype=torch.float32, device=dev) if topk_weights is not None else None
        bs = [b_.contiguous() for b_ in bias]  # the biases, added in the kernel as the reference adds them
        rb = TUNE["final_rb"]
        _go(self.k_final, "final", (max(1, min(-(-t // rb), sms)),), out, w_out if w_out is not None else out,
            *(bs + [out, out])[:2], t, h, k, fw, self.p_lv[9],
            me, n_, p_, self.p_table, fin_off, fin_slot_words, sig, par_bytes, sig_par, self.p_lv[_L_FINAL],
            self.p_t[_T_FINAL], self.p_err, be.timeout_ns, BLOCK=TUNE["final_block"], RB=rb, P_POW2=_pow2(p_),
            K_POW2=_pow2(max(k, 1)), HAS_W=w_out is not None, PBF16=direct, NB=len(bs), HAS_TIMER=timer,
            num_warps=TUNE["final_warps"])
        be.check_mirror()
        return out, w_out
