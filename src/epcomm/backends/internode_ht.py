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

Both dispatch and combine are one launch each of ``Config.num_sms`` programs whose roles (senders,
forwarders or relays, receivers or finals) run at once, channel by channel, each consumer waiting on
per-channel row counters for the rows it reads (kernels/internode_ht.py: channels, counters, roles).

HT region of the symmetric buffer (``InternodeBackend.ht_off``, ``ht_bytes``): the counter words
(``internode_ht.ctr_words``, no parity: counters only grow), then four equal areas: dispatch parity 0 and 1
(staging and RDMA receive ``(P-1) x TM`` messages each, NVL receive ``P x (N-1) x TM`` rows), combine
parity 0 and 1 (relay ``P x (N-1) x TM`` rows, staging ``(P-1) x TM`` and final ``(P-1 + [N > 1]) x TM``
partial sums). Parities alternate per call by the device's count of calls (dispatches and combines
apart), so a replayed graph alternates too; a producer writes a parity's area only after its consumer
has raised its free word for the call that used it before.
"""

from __future__ import annotations

import torch

from .. import layout
from ..kernels.launch import Launcher, Ptr
from ..layout import DispatchHandle
from .base import DispatchArgs, DispatchResult, input_error
from .internode_ht_sizes import (  # noqa: F401 (high_throughput_bytes: this module's public name too)
    _align,
    _combine_areas,
    _combine_words,
    _counter_bytes,
    _dispatch_areas,
    high_throughput_bytes,
    roles,
)

_BLOCK = 1024
# Launch parameters (EPCOMM_TUNE=iht.<key>=<n>): warps a program, rows a step (``*_rb``), words a row a step
# (``*_block``, at most; fewer where rows are narrower), and the weights by which each launch's num_sms
# programs are split between its roles (dispatch: senders, forwarders, receivers; combine: senders,
# relays, finals; a role with nothing to do in this layout gets none). The stage-by-stage kernels this
# replaced were measured on H100, 2 virtual nodes under MPS, DSv3, 24 SMs (2026-11-25, graph replays): a
# row a step (4 KB) ran ~4 GB/s a program; tiles of 16 rows and 16 warps were the fastest tried.
# Work comes in units of a channel (12 at 24 SMs), each moved in order by one program (its counters count
# rows in order): in nodes of one rank, 12 sender and 12 forwarder units, equal, and the rank's own rows
# spread in tiles over all programs after their role's work (docs/internode.md, "Cost model"); a forwarder
# takes its own node's units (no wait) before the other nodes'. ``p2p`` (on): senders and relays store
# straight into a peer's slot where NVSHMEM maps that peer's buffer, counting rows by a release atomic; off:
# staging and NVSHMEM puts to every other node, as over RDMA (what peers across RDMA always take: the switch
# runs that path on one host, as tier 2 and tier 3 do). ``d_p2p_rows`` (0): a dispatch's rows stored into a
# relay's slot are counted at least that many at a time (0: Config's RDMA chunk, as puts). In nodes of one
# rank (at most ``_PAIR_NODES`` nodes, ``2 * channels <= C_MAX``; Config's even num_sms) every program of the
# combine copies, then reduces, half a channel (``kernels/internode_ht_pair.py``), as nvlink's push, then
# reduce; else relays and finals apart (``c_relay``, ``c_final``, a channel each). ``final_block`` columns a
# step of the paired reduction, ``c_stages`` its loads in flight (Triton's software pipeline, as the nvlink
# reduce's; 1 where they would not fit).
TUNE = dict(dispatch_warps=16, dispatch_rb=16, dispatch_block=1024, combine_warps=16, combine_rb=16,
            combine_block=512, d_send=1, d_forward=1, d_receive=1, c_send=1, c_relay=2, c_final=2, p2p=True,
            d_p2p_rows=0, final_block=512, c_stages=3)
_PAIR_NODES = 16
_T_NOTIFY, _T_DISPATCH, _T_COMBINE = range(3)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _final_stages(tiles: int, fblock: int) -> int:
    """The pipeline depth of the paired combine's reduction (``TUNE["c_stages"]``): 1 where its stages would not
    fit in shared memory (Triton keeps ``stages - 1`` steps of loads there, each ``tiles`` BF16 tiles of
    ``combine_rb x fblock``: a row per node, unrolled to a power of two, and each bias; as the nvlink reduce
    budgets its own, ``nvlink_params.reduce_stages``). Example: 2 nodes, no bias, 512 columns, 3 stages -> 3
    (64 KiB; sm_90 compile: 65536 bytes of shared memory); 2 nodes and 2 biases at 1024 columns -> 1 (256 KiB)."""
    from .nvlink_params import SMEM_BUDGET

    s = max(1, TUNE["c_stages"])
    return s if (s - 1) * tiles * TUNE["combine_rb"] * fblock * 2 <= SMEM_BUDGET else 1


def _knobs(config) -> tuple[int, int]:
    """``(programs, tokens per put)`` of a call: ``Config.num_sms`` (each launch takes that many programs,
    so at most that many SMs) and ``num_max_rdma_chunked_send_tokens`` (tokens per put across nodes);
    a call without a config (a backend called directly) takes DeepEP's default 20 SMs and one token a put."""
    if config is None:
        return 20, 1
    return max(1, config.num_sms), max(1, config.num_max_rdma_chunked_send_tokens)


def _go(launcher: Launcher, name: str, grid: tuple, *args, **consts) -> None:
    """Launch with a key that fixes what Triton specialises on: integer arguments (1, divisible by 16,
    64-bit; the offsets and sizes here change with the call's shapes) and per-call tensors' dtype and
    16-byte alignment (a slice of a fresh tensor need not be aligned; kernels/launch.py)."""
    key = (name,) + tuple((a == 1, a % 16 == 0, a >= 1 << 31) if type(a) is int
                          else a & 15 == 0 if type(a) is Ptr  # a state word's address: alignment varies
                          else (a.dtype, a.data_ptr() & 15 == 0) if type(a) is torch.Tensor else None for a in args)
    launcher(key, grid, *args, **consts)


class _Info:
    """What a handle's later calls (cached dispatch, combine) need of its dispatch's layout, kept on the
    device (a captured call has no host copy of it): ``rel [T, R]`` each token's row in each rank's block
    from here; ``npos [T, P]`` its row among the messages for each node (-1: not sent there); ``nco [P, C]``
    this rank's channel prefix for each node, ``ncp [R, C]`` each source's for this rank's node; ``pc``
    tokens a channel here, ``c`` channels;
    ``tbl [P-1, TM, N]`` (nodes of more than one rank) the positions at this node's ranks of each row this
    relay forwarded (the combine's relay sums by them); ``tm`` the rows of every slot."""

    def __init__(self, rel: torch.Tensor, npos: torch.Tensor, nco: torch.Tensor, ncp: torch.Tensor, pc: int, c: int,
                 tbl, tm: int, worst: bool) -> None:
        self.rel, self.npos, self.nco, self.ncp, self.pc, self.c, self.tbl = rel, npos, nco, ncp, pc, c, tbl
        self.tm = tm
        self.worst = worst  # slots sized by the areas (num_worst_tokens), not by the calls' tokens


class InternodeHighThroughput:
    def __init__(self, be) -> None:
        from ..kernels import internode_ht as ih
        from ..kernels import internode_ht_combine as ihc
        from ..kernels import nvshmem
        from ..kernels.ht_notify import _handle_kernel
        from .nvlink_params import C_MAX

        self.be = be
        r_, n_ = be.num_ranks, be.ranks_per_node
        self.p_nodes = r_ // n_
        self.cm = C_MAX
        dev = be.device
        # device state: [notify level, dispatches, combines], tickets (notify, dispatch, combine), and the
        # counters' private bases (int32, one per counter word)
        self.state = torch.zeros(4, dtype=torch.int32, device=dev)
        self.tickets = torch.zeros(4, dtype=torch.int32, device=dev)
        self.bases = torch.zeros(ih.ctr_words(r_, n_, C_MAX)[-1], dtype=torch.int32, device=dev)
        self.p_table, self.p_err = Ptr(be.ptr_table), Ptr(be.err)
        # the kernels take every row to start 16-byte aligned (kernels/internode_ht_rows.py): the areas'
        # offsets are multiples of 128 bytes, the symmetric buffers' bases must be multiples of 16
        odd = [(r, hex(p)) for r, p in enumerate(be.ptr_table.tolist()) if p % 16]
        if odd:
            raise RuntimeError(f"symmetric buffers not 16-byte aligned (rank, address): {odd}")
        self.p_lv = [Ptr(self.state[i:]) for i in range(3)]
        self.p_t = [Ptr(self.tickets[i:]) for i in range(3)]
        self.p_bases = Ptr(self.bases)
        sim = be.sim
        self.k_notify = Launcher(nvshmem.nvshmem_kernel(ih._hn_notify_kernel, sim))
        self.k_handle = Launcher(_handle_kernel)
        self.k_prep = Launcher(ih._hn_prep_kernel)
        self.k_dispatch = Launcher(nvshmem.nvshmem_kernel(ih._internode_dispatch_impl_kernel, sim))
        self.k_combine = Launcher(nvshmem.nvshmem_kernel(ihc._hc_kernel, sim))
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
        self.ctr_off = be.ht_off
        self.ctr_bytes = _counter_bytes(r_, n_)
        start = be.ht_off + self.ctr_bytes
        self.area_bytes = max(0, be.ht_bytes - self.ctr_bytes) // 4 // 128 * 128
        self.areas = [start + q * self.area_bytes for q in range(4)]  # dispatch p0, p1, combine p0, p1
        self.peak_bytes = 0
        self._caps: dict = {}
        self._dummies: dict = {}

    def _need(self, need: int, what: str, record: bool = True) -> None:
        if record:
            self.peak_bytes = max(self.peak_bytes, 4 * need + self.ctr_bytes)  # what this rank has needed
        if need > self.area_bytes:
            buf = self.be._buf()
            raise ValueError(f"num_nvl_bytes={buf.num_nvl_bytes if buf else '?'} is too small for this {what}: the "
                             f"internode backend needs {4 * need + self.ctr_bytes} bytes of high-throughput "
                             "buffer (num_nvl_bytes, plus num_rdma_bytes outside low-latency mode)")

    def _worst_tm(self, w: int, h: int, k: int) -> int:
        """The slots' rows for calls with ``num_worst_tokens`` (no host copy of the token counts): as many
        as the areas hold, for the dispatch (``w`` words per row) and its combine (BF16 ``h``, ``k``
        weights); the same on every rank (equal buffers). Example: 2 ranks in nodes of 1, 32 MiB
        buffer, H = 128, K = 4 -> 13103 rows (BF16 with top-k: 77 words a row, padded to 80)."""
        key = (w, h, k)
        tm = self._caps.get(key)
        if tm is None:
            r_, n_, p_ = self.be.num_ranks, self.be.ranks_per_node, self.p_nodes
            cw, fw = _combine_words(h, k, n_)

            def need(x):
                return max(_dispatch_areas(x, w, r_, n_)[2], _combine_areas(x, cw, fw, n_, p_)[2])

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
        channel prefix and the expert counts for that rank, the channel prefix for its node),
        ``_hn_notify`` puts the rows (``sms`` programs at most). Returns every rank's row for this one
        (``[R, S]`` int32, a private tensor the next exchange overwrites), ``rel [T, R]``, ``npos [T, P]``,
        the channel prefix matrix ``[R, C]`` and the tokens a channel."""
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
        pc = max((t + c - 1) // c, 1)
        _go(self.k_prep, "prep", (min(r_, sms),), is_in.view(torch.int8), t, r_, n_, c, pc, ntpr, ntpe, lx,
            self.n_stage, self.s_words, rel, npos, cpm, BLOCK=_BLOCK, R_POW2=_pow2(r_))
        _go(self.k_notify, "notify", (min(r_, sms),), be.rank, r_, self.s_words, 2 * r_ + 1 + p_ + 2 * c + lx,
            self.p_table, self.n_stage_off, self.n_recv_off, self.n_recv_stride, self.nsig, self.n_rows, self.p_lv[0],
            self.p_t[_T_NOTIFY], self.p_err, be.timeout_ns, BLOCK=_BLOCK, CHECK=check, HAS_TIMER=self._timer,
            SIM=be.sim)
        return self.n_rows, rel, npos, cpm, pc

    def _dummy(self, dtype: torch.dtype) -> torch.Tensor:
        """A one-element tensor standing for an absent input or output (never read or written)."""
        d = self._dummies.get(dtype)
        if d is None:
            d = self._dummies[dtype] = torch.zeros(1, dtype=dtype, device=self.be.device)
        return d

    def _move(self, x: torch.Tensor, scales: torch.Tensor | None, topk_idx: torch.Tensor | None,
              topk_weights: torch.Tensor | None, src: bool, info: _Info, rows: int, handle: DispatchHandle,
              knobs: tuple[int, int], lx: int = 1, save: bool = False):
        """Tokens ``x [T, H]`` (their scales, top-k ids and weights, and where ``src`` their index) to the ranks
        the handle's layout (``info``, the handle's prefix matrices) names, through the relays, in one
        launch: the senders pack each message from the inputs, forwarders and receivers unpack what
        arrives into the outputs (``_save``: the forwarders keep the positions the combine needs in
        ``info.tbl``). Returns ``(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx)``
        (None where there was no input), ``rows`` rows in (source rank, token) order, the ids made local
        (``lx`` experts a rank); rows past those that arrived padded as the reference pads them
        (``num_worst_tokens``)."""
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
        self.last_npos = info.npos  # [T, P]: each token's row for each node (-1: not sent there); the tests read it
        rdma_rel, nvl_rel, need = _dispatch_areas(tm, w, r_, n_)
        self._need(need, "dispatch", record=not info.worst)
        sms, ch = knobs
        recv_x = torch.empty(rows, h, dtype=x.dtype, device=dev)
        recv_s = torch.empty(rows, g, dtype=torch.float32, device=dev) if scales is not None else None
        recv_id = torch.empty(rows, k, dtype=torch.int64, device=dev) if topk_idx is not None else None
        recv_w = torch.empty(rows, k, dtype=torch.float32, device=dev) if topk_idx is not None else None
        recv_src = torch.empty(rows, dtype=torch.int32, device=dev) if src else None
        (s_lo, s_n), (f_lo, f_n), (v_lo, v_n) = roles(sms, [TUNE["d_send"] * (p_ > 1), TUNE["d_forward"],
                                                            TUNE["d_receive"] * (n_ > 1)])
        _go(self.k_dispatch, "dispatch", (sms,), xw, sw, idw, ww, info.rel, info.npos, info.nco, t, info.pc, info.c,
            xw.shape[1], g, k, nsrc, handle.rank_prefix_matrix[:, me:], handle.recv_channel_prefix_matrix, info.ncp,
            recv_x.view(torch.int32), recv_s.view(torch.int32) if recv_s is not None else i32,
            recv_id if recv_id is not None else self._dummy(torch.int64),
            recv_w if recv_w is not None else self._dummy(torch.float32), recv_src if src else i32, rows, me * lx, lx,
            me, n_, p_, r_, ch, max(ch, TUNE["d_p2p_rows"]), self.p_table, self.areas[0], self.area_bytes, rdma_rel,
            nvl_rel, tm, self.ctr_off, self.cm, info.tbl if info.tbl is not None else i32, int(save), self.p_bases,
            self.p_lv[1],
            self.p_t[_T_DISPATCH], self.p_err, be.timeout_ns, s_lo, s_n, f_lo, f_n, v_lo, v_n, int(TUNE["p2p"]),
            int(n_ == 1), BLOCK=min(TUNE["dispatch_block"], _pow2(w)), RB=TUNE["dispatch_rb"],
            N_POW2=_pow2(n_),
            K_POW2=_pow2(max(k, 1)), G_POW2=_pow2(max(g, 1)), S_POW2=_pow2(max(g, 2 * k, n_, 1)),
            HAS_TIMER=self._timer, SIM=be.sim, num_warps=TUNE["dispatch_warps"])
        be.check_mirror()
        return recv_x, recv_s, recv_id, recv_w, recv_src

    def dispatch(self, a: DispatchArgs) -> DispatchResult:
        from .nvlink_params import C_MAX, L_MAX

        be = self.be
        r_, me, n_, p_ = be.num_ranks, be.rank, be.ranks_per_node, self.p_nodes
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
        g, rel, npos, cpm, pc = self._exchange(a, is_in, bool(worst), sms)
        s_ = self.s_words
        rpm = torch.empty(r_, r_, dtype=torch.int32, device=dev)
        recv_cp = torch.empty(r_, c, dtype=torch.int32, device=dev)
        send_head = torch.empty(t, r_, dtype=torch.int32, device=dev)
        tb = 128
        topk = a.topk_idx.contiguous() if a.topk_idx is not None else None
        # the handle's tensors from the exchanged rows in one launch (the nvlink backend's kernel), which also
        # checks the expert ids, is_token_in_rank against them and, with num_worst_tokens, the rows arriving
        _go(self.k_handle, "handle", (max(1, min(64, sms, (t + tb - 1) // tb)),), g, s_, g[:, 2 * r_ + 1 + p_:], s_,
            c, rel, t, r_, me, rpm, recv_cp, send_head, self.p_err, worst, topk if topk is not None else send_head, k,
            e, is_in.view(torch.int8), lx, CHECK_WORST=bool(worst), R_POW2=_pow2(r_), C_POW2=_pow2(c), TB=tb, CHECK_TOPK=topk is not None,
            K_POW2=_pow2(k), num_warps=4)
        c1 = 2 * r_ + 1 + p_ + c + lx  # (the next exchange overwrites both)
        nco = self.n_stage[::n_, c1:c1 + c].clone()  # this rank's channel prefix for each node, as staged
        ncp = g[:, c1:c1 + c].clone()  # each source's channel prefix for this node
        late = None  # an input error found on the device: raised once the call is done
        lst: list = []
        if worst:
            rows = worst
        else:
            gh = g.to("cpu", copy=True)  # the call's one host synchronisation
            late = input_error(be, be.err_host.tolist())
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
        tbl = torch.empty((p_ - 1) * tm * n_, dtype=torch.int32, device=dev) if n_ > 1 and p_ > 1 else None
        info = _Info(rel, npos, nco, ncp, pc, c, tbl, tm, bool(worst))
        handle = DispatchHandle(rpm, cpm, recv_cp, None, a.is_token_in_rank, send_head)
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = self._move(
            a.x, a.x_scales, a.topk_idx, a.topk_weights, True, info, rows, handle, knobs, lx, save=True)
        if late is not None:
            raise late
        recv_src_idx._epcomm_ht = info
        handle = handle._replace(recv_src_idx=recv_src_idx)
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
        recv_x, recv_s, _, _, _ = self._move(x, x_scales, None, None, False, info, rows, handle, _knobs(config))
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
        xc = x[:rows].contiguous()
        ww = topk_weights[:rows].contiguous().view(torch.int32) if topk_weights is not None else self._dummy(
            torch.int32)
        cw, fw = _combine_words(h, k, n_)
        tm = info.tm
        stage_rel, fin_rel, need = _combine_areas(tm, cw, fw, n_, p_)
        self._need(need, "combine", record=not info.worst)
        sms, ch = _knobs(config)
        pair = int(n_ == 1 and 1 < p_ <= _PAIR_NODES and 2 * info.c <= self.cm and sms % 2 == 0)
        (s_lo, s_n), (r_lo, r_n), (f_lo, f_n) = roles(sms, [TUNE["c_send"] * (n_ > 1), TUNE["c_relay"],
                                                            TUNE["c_final"]])
        fblock = min(TUNE["final_block"], _pow2(h))
        self.last_pair = pair  # (the tests read which mode ran)
        out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
        w_out = torch.empty(t, k, dtype=torch.float32, device=dev) if topk_weights is not None else None
        bs = [b_.contiguous() for b_ in bias]  # the biases, added in the kernel as the reference adds them
        i32 = self._dummy(torch.int32)
        _go(self.k_combine, "combine", (sms,), xc, xc.view(torch.int32), ww, rows, h, k, info.rel, info.npos, info.nco,
            t, info.pc, info.c, handle.rank_prefix_matrix[:, me:], handle.recv_channel_prefix_matrix, info.ncp,
            info.tbl if info.tbl is not None else i32, out, w_out if w_out is not None else out, *(bs + [out, out])[:2],
            me, n_, p_, r_, ch, self.p_table, self.areas[2], self.area_bytes, stage_rel, fin_rel, tm, self.ctr_off,
            self.cm, self.p_bases, self.p_lv[2], self.p_t[_T_COMBINE], self.p_err, be.timeout_ns, s_lo, s_n, r_lo,
            r_n, f_lo, f_n, int(TUNE["p2p"]), pair, BLOCK=min(TUNE["combine_block"], _pow2(h)), FBLOCK=fblock,
            RB=TUNE["combine_rb"], K_POW2=_pow2(max(k, 1)), P_POW2=_pow2(p_), HAS_W=w_out is not None, NB=len(bs),
            STAGES=_final_stages(_pow2(p_) + len(bs), fblock), HAS_TIMER=self._timer,
            SIM=be.sim, num_warps=TUNE["combine_warps"])
        be.check_mirror()
        return out, w_out
