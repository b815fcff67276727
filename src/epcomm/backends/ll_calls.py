"""What both low-latency engines (``nvlink_ll.LowLatencyEngine``, ``internode_ll.InternodeLowLatency``)
keep per kind of call, so a repeat costs a key lookup and its launches.

A kind of call is everything that decides its launches besides the per-call tensors: shapes, dtypes,
flags, parities, and the 16-byte alignment of every per-call tensor (Triton specialises pointers on
it; ``kernels/launch.py``). The first call of a kind builds a ``_Call`` through the engine's
``_dispatch_call`` / ``_combine_call``; ``dispatch_run`` / ``combine_run`` hand its ``run`` to
``Buffer``'s repeat path. Outputs are two persistent sets that alternate by parity, like the receive
areas (results of at most two low-latency calls are alive at once). A ``run`` launches through
``launch_cell``: once bound, a repeat's launch writes its tensors' addresses into a prebuilt argument list
and calls Triton's C launcher, and nothing else (a placeholder where a kind has no tensor is written once).

An engine sets ``backend_name``, calls ``_init_calls(num_ranks, device)``, and provides ``_plan`` (a
``Plan`` per ``(M, H, E)``, from ``get_plan``), ``_dispatch_call``, ``_combine_call`` and ``_announce`` (M in the place where a peer with another M is
named); ``_after_send`` runs after an unplanned call's send (default: nothing).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import layout
from ..kernels.launch import Direct, Launcher
from ..layout import LowLatencyHandle
from .base import LowLatencyCombineArgs, LowLatencyDispatchArgs, LowLatencyDispatchResult

_MAX_KINDS = 4096  # the token count is part of a dispatch's kind: bounded, in case it takes every value


class Plan:
    """What a low-latency call of one ``(M, H, E)`` needs besides its tensors, computed once: the layout,
    the offsets of both parities' areas and signal words, and the kernels' integer arguments.

    ``be``: the backend (``num_ranks``, ``ll_off``: where the low-latency region starts in its symmetric
    buffer). Signal words sit in each parity's area (``layout``'s ``signal_offset``), or, with
    ``sig_base``, in both parities' ``3R`` uint64 words from there (the internode backend)."""

    def __init__(self, be, m: int, h: int, e: int, lay, sig_base: int | None = None) -> None:
        r_ = be.num_ranks
        self.m, self.h, self.e, self.lay = m, h, e, lay
        self.lx = e // r_
        self.g = (h + 127) // 128
        self.area = [be.ll_off + lay.parity_offset(p) for p in (0, 1)]
        self.sig = ([a + lay.signal_offset for a in self.area] if sig_base is None
                    else [sig_base + p * 3 * r_ * 8 for p in (0, 1)])
        self.zero_copy = None  # the zero-copy combine buffer's view (the engine's zero_copy_buffer)


def get_plan(plans: dict, be, m: int, h: int, e: int, sig_base: int | None = None) -> Plan:
    """``plans[(m, h, e)]``, made on first use after checking that ``be.rdma_bytes`` holds its layout."""
    p = plans.get((m, h, e))
    if p is None:
        lay = layout.low_latency_buffer_layout(m, h, be.num_ranks, e)
        if lay.total > be.rdma_bytes:
            raise ValueError(f"num_rdma_bytes={be.rdma_bytes} is too small: M={m}, H={h}, E={e} need "
                             f"{lay.total} (Buffer.get_low_latency_rdma_size_hint)")
        p = plans[(m, h, e)] = Plan(be, m, h, e, lay, sig_base)
    return p


class _Call:
    """The launches and fixed arguments of one kind of low-latency call, made on its first occurrence."""


def launch_cell(d: Direct, gx: int, gy: int, gz: int, chain: torch.device | None = None) -> list:
    """``[go]``: ``go[0](*holes)`` launches ``d`` on the grid ``(gx, gy, gz)``, its holes filled with per-call
    tensors or, where a kind of call has none, a persistent buffer's ``Ptr`` (which must then be the same
    ``Ptr`` at every call through this cell). Until ``d`` is bound (always, while verifying or under the
    interpreter) ``go[0]`` launches through ``d``; from the first call that binds it, ``go[0]`` is a closure
    over a copy of ``d``'s prebuilt argument list, the ``Ptr`` holes written once, that writes only the
    tensors' addresses and calls the C launcher: per launch, a ``data_ptr()`` per tensor and no ``zip``,
    ``isinstance`` or hole for a placeholder (``Direct``'s generic loop was a third of a repeat's host time).
    ``chain``, the engine's device where the native extension is wanted (``native.wanted``):
    from then on the launch is a ``native.Chain`` of one step instead, every hole read by the extension (an
    address, or the ``Ptr``'s int), the fixed parameters packed once: no argument of Triton's launcher parsed
    per call."""
    cell: list = []

    def first(*holes) -> None:
        d(gx, gy, gz, *holes)
        ch = _chain(d, chain, gx, gy, gz, len(holes)) if chain is not None else None
        if ch is not None:
            run, stream, dev = ch.run, ch.get_stream, ch.dev

            def go(*holes) -> None:
                Launcher.launches += 1
                run(stream(dev), *holes)

            cell[0] = go
        elif d.launch is not None:
            cell[0] = _bound(d, gx, gy, gz, holes)

    cell.append(first)
    return cell


def _chain(d: Direct, device: torch.device, gx: int, gy: int, gz: int, n: int):
    """``d`` (bound) as a ``native.Chain`` of one launch on ``(gx, gy, gz)`` whose ``n`` values are its holes;
    None where it cannot be one (``Direct.step``)."""
    from .. import native

    c = native.const
    st = d.step((c(gx), c(gy), c(gz)), tuple(native.addr(i) for i in range(n)))
    return None if st is None else native.Chain(device, [], c(0), [st], n, stream=d.p.chain_stream())


def _bound(d: Direct, gx: int, gy: int, gz: int, holes: tuple):
    """``launch_cell``'s closure for a bound ``d``, whose holes took ``holes`` at the binding call."""
    a, launch, stream, dev, f = list(d.args), d.launch, d.get_stream, d.dev, d.first
    live = []
    for i, (j, t) in enumerate(zip(d.holes, holes)):
        if isinstance(t, int):
            a[f + j] = t  # a persistent buffer's address (a Ptr), fixed for the kind
        else:
            live.append((f + j, i))
    live = tuple(live)

    def go(*holes) -> None:
        for j, i in live:
            a[j] = holes[i].data_ptr()
        Launcher.launches += 1
        launch(gx, gy, gz, stream(dev), *a)

    return go


def _align(t: torch.Tensor | None):
    """A per-call tensor's part of the key: its 16-byte alignment (True where absent)."""
    return t is None or t.data_ptr() & 15


class LowLatencyCalls:
    backend_name = "?"

    def _init_calls(self, num_ranks: int, device: torch.device) -> None:
        self._ranks, self._device = num_ranks, device
        self._m_word = None  # the M last announced (written when it changes)
        self._dcalls: dict = {}  # (kind, T) -> _Call (dispatch)
        self._ccalls: dict = {}  # kind -> _Call (combine)
        self._outs: dict = {}  # (M, H, E, parity, fp8, ue8m0) -> the dispatch outputs of that parity
        self._couts: dict = {}  # (M, H, parity) -> the combine output of that parity (M rows)

    def _after_send(self) -> None:
        """Runs after the send of a call that did not come through the repeat path."""

    # ------------------------------------------------------------------ outputs

    def _dispatch_outputs(self, pl, parity: int, use_fp8: bool, ue8m0: bool):
        """The outputs of a dispatch on ``parity``, allocated once: two sets alternate call by call."""
        key = (pl.m, pl.h, pl.e, parity, use_fp8, ue8m0)
        out = self._outs.get(key)
        if out is None:
            r_, dev, lx, h, g = self._ranks, self._device, pl.lx, pl.h, pl.g
            rm = r_ * pl.m
            # the receive kernels write the rows as int32 words: allocated as words, viewed as the payload
            words = torch.empty(lx, rm, h // (4 if use_fp8 else 2), dtype=torch.int32, device=dev)
            if use_fp8:
                sc = torch.empty(lx, (g + 3) // 4 if ue8m0 else g, rm,
                                 dtype=torch.int32 if ue8m0 else torch.float32, device=dev)
                recv_x = (words.view(torch.float8_e4m3fn), sc.transpose(1, 2))
            else:
                sc, recv_x = None, words.view(torch.bfloat16)
            recv_src = torch.empty(lx, rm, dtype=torch.int32, device=dev)
            recv_range = torch.empty(lx, r_, dtype=torch.int64, device=dev)
            recv_count = torch.empty(lx, dtype=torch.int32, device=dev)
            recv_src._epcomm_ll_parity = parity  # which area holds this dispatch's slots (combine reads them)
            result = LowLatencyDispatchResult(recv_x, recv_count, LowLatencyHandle(recv_src, recv_range,
                                              pl.m, h, pl.e))
            out = self._outs[key] = (result, words, sc, recv_src, recv_range, recv_count)
        return out

    def _combine_output(self, m: int, h: int, parity: int, t: int) -> torch.Tensor:
        """The first ``t`` rows of the combine output of ``parity`` (like the dispatch outputs: two
        alternate, one per parity)."""
        full = self._couts.get((m, h, parity))
        if full is None:
            full = self._couts[(m, h, parity)] = torch.empty(m, h, dtype=torch.bfloat16, device=self._device)
        return full[:t]

    # ------------------------------------------------------------------ dispatch

    def dispatch_run(self, a: LowLatencyDispatchArgs):
        """``run(x, topk, cum, wst) -> (result, receive)``: the launches of dispatches like ``a`` (same
        shapes, dtypes, flags, parity and alignment; ``x`` and ``topk`` contiguous), made once."""
        x, topk = a.x, a.topk_idx
        t, h = x.shape
        cum, wst = a.cumulative_local_expert_recv_stats, a.dispatch_wait_recv_cost_stats
        # (the token count only sizes the grids: the kernels do not specialise on it)
        key = (a.num_max_dispatch_tokens_per_rank, h, a.num_experts, topk.shape[1], a.parity, a.use_fp8,
               a.round_scale, a.use_ue8m0, cum is None, wst is None, a.mask is None, a.hook,
               _align(x), _align(topk), _align(cum), _align(wst))
        c = self._dcalls.get((key, t))
        if c is None:
            if len(self._dcalls) > _MAX_KINDS:
                self._dcalls.clear()
            c = self._dcalls[(key, t)] = self._dispatch_call(a, t, h, topk.shape[1], key)
        if self._m_word != c.m:
            self._announce(c.m)
        return c.run

    def dispatch(self, a: LowLatencyDispatchArgs):
        """Send now; returns ``(result, receive)``: ``receive()`` launches the receive side."""
        x, topk = a.x.contiguous(), a.topk_idx.contiguous()
        if x is not a.x or topk is not a.topk_idx:
            a = dataclasses.replace(a, x=x, topk_idx=topk)
        res = self.dispatch_run(a)(x, topk, a.cumulative_local_expert_recv_stats, a.dispatch_wait_recv_cost_stats)
        self._after_send()
        return res

    # ------------------------------------------------------------------ combine

    def combine_run(self, a: LowLatencyCombineArgs):
        """``run(y, topk, w, out, wst) -> (out, receive)``: the launches of combines like ``a`` (same
        shapes, dtypes, flags, parities and alignment; the tensors contiguous), made once."""
        hd = a.handle
        d_parity = getattr(hd.recv_src_info, "_epcomm_ll_parity", None)
        if d_parity is None:
            raise ValueError(f"handle must come from this Buffer's low_latency_dispatch ({self.backend_name} "
                             "backend)")
        y, topk, w = a.x, a.topk_idx, a.topk_weights
        t, k = topk.shape
        m, h, e = hd.num_max_dispatch_tokens_per_rank, hd.hidden, hd.num_experts
        wst = a.combine_wait_recv_cost_stats
        key = (m, h, e, t, k, a.parity, d_parity, a.out is None, wst is None, a.mask is None, a.hook,
               _align(y), _align(topk), _align(w), _align(a.out), _align(wst))
        c = self._ccalls.get(key)
        if c is None:
            if len(self._ccalls) > _MAX_KINDS:
                self._ccalls.clear()
            c = self._ccalls[key] = self._combine_call(a, m, h, e, t, k, d_parity, key)
        return c.run

    def combine(self, a: LowLatencyCombineArgs):
        """Send now; returns ``(out, receive)``."""
        y, topk, w = a.x.contiguous(), a.topk_idx.contiguous(), a.topk_weights.contiguous()
        if y is not a.x or topk is not a.topk_idx or w is not a.topk_weights:
            a = dataclasses.replace(a, x=y, topk_idx=topk, topk_weights=w)
        res = self.combine_run(a)(y, topk, w, a.out, a.combine_wait_recv_cost_stats)
        self._after_send()
        return res
