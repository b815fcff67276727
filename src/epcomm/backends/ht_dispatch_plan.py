"""One kind of high-throughput dispatch, planned (``HTDispatch._make_dispatch``): :class:`DispatchPlan` holds
its launches (the exchange ``notify`` and the receive ``gather``, bound once: :class:`Launch`), the specs of
its outputs, the chains that make them and launch in one C++ call (``native.Chain``, from the second call of
a kind on), and ``run``, the call itself: a closure over what it reads, each a local of the plan's making, so
that a call looks up no attribute of the plan.

The phases of a call and the backend it runs on: ``backends/ht_dispatch.py``.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``, ``C``
channels, ``N`` received rows, ``G = H/128``.
"""

from __future__ import annotations

import torch

from .. import native
from ..kernels.ht_layout import fused_words
from ..kernels.launch import Direct, Launcher, Ptr
from ..layout import DispatchHandle
from ..native import ROWS, Outputs
from .base import DispatchArgs, DispatchResult, input_error
from .nvlink_params import C_MAX, L_MAX, TIMER, TUNE, _host_counts, _pow2

# programs of the exchange kernel that only check expert ids (a tile of 128 rows each, at most this many;
# they wait for nothing): DSv3's 4096 tokens take 32, one tile each. With the fused layout
# (fuses_layout) they also compute the layout, before the rank programs.
NOTIFY_CHECK_PROGRAMS = 32
# the fused layout's ticket and epoch flag: slots 4 and 5 of the backend's tickets (zeroed with the backend,
# as nctr is; slots 0-3: nvlink_params.T_GATHER .. T_CPUSH); slot 6 the ticket before the host's done word
T_LAYOUT, T_HOST = 4, 6


def words(t: torch.Tensor) -> torch.Tensor:
    """Rows as the int32 words the kernels copy (an 8-bit dtype through uint8)."""
    return t.view(torch.uint8).view(torch.int32) if t.element_size() == 1 else t.view(torch.int32)


def bools(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int8)


class Launch:
    """``kernels/launch.Direct`` whose per-call tensors go in as the caller has them once it is bound (the
    C launcher takes their addresses; the binding fixed the dtypes). Until then, and wherever it never
    binds (``EPCOMM_VERIFY_LAUNCH``, the interpreter), each goes through its view in ``views`` (a function
    per hole, or None), as the kernel's argument types need."""

    __slots__ = ("go", "views")

    def __init__(self, go: Direct, views: tuple) -> None:
        self.go, self.views = go, views

    @classmethod
    def named(cls, prepared, args: dict, holes: dict) -> Launch:
        """The launch of ``prepared`` with ``args`` by the kernel's parameter names (``Direct.named``);
        ``holes`` maps each per-call parameter's name to its view (or None), in the order a call passes them."""
        return cls(Direct.named(prepared, args, tuple(holes)), tuple(holes.values()))

    def step(self, grid: tuple, holes: tuple):
        """The launch as a ``native.Chain``'s step (``Direct.step``)."""
        return self.go.step(grid, holes)

    def __call__(self, grid: int, *tensors) -> None:
        go = self.go
        fast = go.fast
        if fast is not None:
            fast(grid, 1, 1, *tensors)
            return
        if go.launch is None:
            tensors = tuple(t if v is None else v(t) for t, v in zip(tensors, self.views))
        go(grid, 1, 1, *tensors)


class DispatchPlan:
    """A dispatch like ``a`` on backend ``be`` (``HTDispatch``), planned: ``run(x, x_scales, topk_idx,
    topk_weights, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert) -> DispatchResult``
    (``HTDispatch.dispatch_run``).

    ``notify`` and ``gather`` are its launches; ``head_specs`` and ``row_specs`` its outputs (the handle's,
    made before the exchange; the rows', after the count), ``heads`` and ``rows_out`` their
    ``native.Outputs`` (a GPU); ``chain`` (a ``num_worst_tokens`` call: one ``native.Chain``) and ``sync_chain`` (a synchronised one: two,
    around the host's read of the counts) what :meth:`make_chain` and :meth:`sync_chains` make after the first
    call bound the launches. ``run.native`` (where a call can be one chain): its parts for a caller that joins a
    launch to that chain (``elastic_engine``): ``(chain_parts, start, result, num_worst_tokens, notify's
    Prepared)``."""

    def __init__(self, be, key, a: DispatchArgs, push: bool, ce: bool, scratch_rows: int = 0,
                 fused: bool = False) -> None:
        r_, dev = be.num_ranks, be.device
        t, h = a.x.shape
        e = a.num_tokens_per_expert.numel()
        lx, c = e // r_, a.num_channels
        if lx > L_MAX or c > C_MAX:
            raise ValueError(f"the nvlink backend supports up to {L_MAX} local experts and {C_MAX} channels, "
                             f"got L={lx}, C={c}")
        k = a.topk_idx.shape[1] if a.topk_idx is not None else 0
        g = a.x_scales.shape[1] if a.x_scales is not None else 0
        self.be, self.key, self.push, self.ce, self.scratch_rows, self.fused = be, key, push, ce, scratch_rows, fused
        self.t, self.h, self.e, self.lx, self.c, self.k, self.g = t, h, e, lx, c, k, g
        self.has_s, self.has_topk = a.x_scales is not None, a.topk_idx is not None
        self.lay = be._ht_layout(t, h * a.x.element_size(), g, k, h)
        self.n_worst, self.alignment, self.num_sms, self.x_dtype = (a.num_worst_tokens, a.expert_alignment, a.num_sms,
                                                                    a.x.dtype)
        counts, per_expert, chan, toks = be._notify_views(lx, c)
        self.notify = self._notify_launch(counts, per_expert, chan, toks)
        self.bulk = not push and r_ > 1  # the transport's own transfer (the copy engine)
        self.gather = be._gather_plan(key, h, self.x_dtype, t, self.lay, g, k, lx, push, self.has_s, self.has_topk,
                                      counts, toks)
        self._outputs(dev)
        # with num_worst_tokens and no transport of its own (the fused push, or one rank) a call is its outputs and
        # two launches: after the first call bound them, one native.Chain call; a synchronised one two chains
        # around the host's read of the counts
        own = self.heads is not None and self.heads.native and not self.bulk and not ce
        worst_ok = own and bool(self.n_worst) and (self.keep_k is None or self.n_worst <= scratch_rows)
        self.chain = native.Later(worst_ok, self.make_chain)
        self.sync_chain = native.Later(own and not self.n_worst, self.sync_chains)
        helpers = self._helpers()
        self.run = self._runner(*helpers)
        if worst_ok:  # (a chain's parts, for a caller that joins a launch: elastic_engine)
            _, start, result = helpers[:3]
            self.run.native = (self.chain_parts, start, result, self.n_worst, self.notify.go.p)

    def _notify_launch(self, counts, per_expert, chan, toks) -> Launch:
        """The exchange's launch (``_dispatch_notify_kernel``) and its grid (``notify_grid``)."""
        be, t, r_, e, k, c, lx, fused = self.be, self.t, self.be.num_ranks, self.e, self.k, self.c, self.lx, self.fused
        tb, cp2 = 128, NOTIFY_CHECK_PROGRAMS
        # the exchange's programs, one a rank (one under the interpreter, which runs programs one after
        # another: see the kernel), then programs that only check expert ids, a tile of tb rows each; with
        # the fused layout those come first (at least one: T = 0 still writes the zero counts)
        rp = r_ if TIMER else 1
        tiles = min((t + tb - 1) // tb, cp2 if TIMER else 1) if self.has_topk else 0
        self.notify_grid = rp + (max(tiles, 1) if fused else tiles)
        part, lay_ptr, own_rank, own_expert = be.p_err, be.p_err, None, None  # (unread without the fused layout)
        if fused:
            assert self.has_topk, "the fused layout reads topk_idx"
            scratch = be._scratch("fused layout", (fused_words(cp2, r_, e),), torch.int32)
            part, lay_ptr = scratch, Ptr(be.tickets[T_LAYOUT:])
            at = (cp2 + 1) * (r_ + e + 2)
            own_rank, own_expert = scratch[at:at + r_], scratch[at + r_:]
        worst = self.n_worst
        return Launch.named(be.k["_dispatch_notify_kernel"].prepared((lx, c, k, e), dict(
            BLOCK=TUNE["notify_block"], R_POW2=_pow2(r_), C_POW2=_pow2(c), K_POW2=_pow2(k), TB=tb,
            CHECK_WORST=bool(worst), CHECK_TOPK=self.has_topk, HOST_COUNTS=not worst, HAS_TIMER=TIMER,
            FUSED_LAYOUT=fused, EB=min(_pow2(e), 256), CP2=cp2, num_warps=TUNE["notify_warps"])), dict(
            is_in_ptr=None, T=t, R=r_, me=be.rank, ntpr_ptr=own_rank, ntpe_ptr=own_expert, L=lx, C=c,
            per_chan=max((t + c - 1) // c, 1), ptr_table=be.p_table, flags_off=be.flags_off,
            meta_off=be.meta_off, meta_parity_bytes=be.meta_parity_bytes, meta_src_bytes=be.meta_src_bytes,
            list_off=be.list_off, list_parity_bytes=be.list_parity_bytes, list_src_bytes=be.list_src_bytes,
            nctr_ptr=be.p_nctr, cpm_ptr=None, counts_ptr=counts, per_expert_ptr=per_expert, chan_ptr=chan,
            tok_ptr=toks, src_lists_ptr=be.p_src_lists, src_lists_stride=be.src_lists.stride(0),
            err_ptr=be.p_err, timeout_ns=be._timeout_ns, rpm_ptr=None, rcp_ptr=None, send_head_ptr=None,
            num_worst=worst, topk_ptr=be.p_err, K=k, E=e, host_addr_ptr=be.p_host_counts, RP=rp,
            part_ptr=part, lay_ptr=lay_ptr, done_ptr=Ptr(be.tickets[T_HOST:])), dict(
            is_in_ptr=bools, **({} if fused else dict(ntpr_ptr=None, ntpe_ptr=None)), cpm_ptr=None,
            rpm_ptr=None, rcp_ptr=None, send_head_ptr=None, **(dict(topk_ptr=None) if self.has_topk else {})))

    def _outputs(self, dev) -> None:
        """The call's outputs, each a tensor of its own: by torch.empty each, or (``native.wanted``: on a GPU)
        in one C++ call a group (``native.Outputs``): the handle's before the exchange, the rows' after the
        count; with ``scratch_rows`` the received ids and the channel matrices the backend's scratch (``keep_k``,
        ``keep_cp``)."""
        i32, f32, r_, c, t = torch.int32, torch.float32, self.be.num_ranks, self.c, self.t
        k, g, h = self.k, self.g, self.h
        has_s, has_topk = self.has_s, self.has_topk
        self.keep_k = self.keep_cp = None
        if self.scratch_rows:
            if has_topk:
                self.keep_k = self.be._scratch("recv_topk_idx", (self.scratch_rows, k), torch.int64)
            self.keep_cp = self.be._scratch("channel_prefix_matrices", (2, r_, c), i32).unbind(0)
        self.heads = self.rows_out = None
        self.head_specs = ([((r_, c), i32)] * 2 if self.keep_cp is None else []) \
            + [((r_, r_), i32), ((t, r_), i32)] + ([((t, r_), torch.bool)] if self.fused else [])
        self.row_specs = [((ROWS, h), self.x_dtype)] + ([((ROWS, g), f32)] if has_s else []) \
            + ([((ROWS, k), torch.int64)] if has_topk and self.keep_k is None else []) \
            + ([((ROWS, k), f32)] if has_topk else []) + [((ROWS,), i32)]
        # (natively the handle's tensors, and the rows' ids, weights and sources, are views of one allocation)
        self.head_pack = range(len(self.head_specs))
        self.row_pack = range(1 + has_s, len(self.row_specs))
        if native.wanted(dev):
            self.heads = Outputs(dev, self.head_specs, True, self.head_pack)
            self.rows_out = Outputs(dev, self.row_specs, True, self.row_pack)

    # ------------------------------------------------------------------ chains (made once)

    def chain_parts(self, rows_base=None, n_rows=None, is_in_src=None):
        """``(specs, packed, steps, sources)`` of the call as a chain: its values ``x, scales, topk, w, ntpr,
        is_in, ntpe`` (run's arguments) and the gather's grid; ``sources`` of the handle's rank_prefix_matrix,
        send_head, recv_src_idx and the received ids (``rpm``, ``send_head``, ``src``, ``out_k``: a
        consumer's launch in one chain with this one, ``elastic_engine``) and of the received rows, scales and
        weights (``x``, ``s``, ``w``; None where absent); None where a launch cannot be a
        chain's step. With ``rows_base`` (a synchronised call's second chain: :meth:`sync_chains`): only the
        gather's step, its outputs from ``rows_base``, its rows ``n_rows`` and is_token_in_rank
        ``is_in_src``."""
        fused, has_s, has_topk = self.fused, self.has_s, self.has_topk
        keep_k, keep_cp = self.keep_k, self.keep_cp
        nh = len(self.head_specs)
        at_is_in = native.out(nh - 1) if fused else native.addr(5)
        cp = [native.out(0), native.out(1)] if keep_cp is None else [native.const(v) for v in keep_cp]
        rpm, sh = native.out(nh - 2 - fused), native.out(nh - 1 - fused)
        n_holes = ([at_is_in] + ([] if fused else [native.addr(4), native.addr(6)]) + [cp[0], rpm, cp[1], sh]
                   + ([native.addr(2)] if has_topk else []))
        base = nh if rows_base is None else rows_base
        orow = iter(range(base, base + len(self.row_specs)))
        out_x = native.out(next(orow))
        out_s = native.out(next(orow)) if has_s else None
        out_k = (native.out(next(orow)) if keep_k is None else native.const(keep_k)) if has_topk \
            else None
        out_w = native.out(next(orow)) if has_topk else None
        out_src = native.out(next(orow))
        g_is_in = at_is_in if is_in_src is None else is_in_src
        g_holes = ([native.addr(0)] + ([native.addr(1)] if has_s else [])
                   + ([native.addr(2), native.addr(3)] if has_topk else [])
                   + [native.const(self.n_worst) if n_rows is None else n_rows, out_x]
                   + ([out_s] if has_s else []) + ([out_k, out_w] if has_topk else []) + [out_src]
                   + ([g_is_in] if self.push else []))
        one = native.const(1)
        g_step = self.gather.step((native.num(7 if rows_base is None else 6), one, one), tuple(g_holes))
        if rows_base is not None:
            return None if g_step is None else (self.row_specs, list(self.row_pack), [g_step], None)
        steps = [self.notify.step((native.const(self.notify_grid), one, one), tuple(n_holes)), g_step]
        if any(st is None for st in steps):
            return None
        return (self.head_specs + self.row_specs, [*self.head_pack, *(nh + i for i in self.row_pack)], steps,
                dict(rpm=rpm, send_head=sh, src=out_src, out_k=out_k, x=out_x, s=out_s, w=out_w))

    def make_chain(self):
        """A num_worst_tokens call as one ``native.Chain`` (None where a launch cannot be a step)."""
        got = self.chain_parts()
        if got is None:
            return None
        specs, packed, steps, _ = got
        return native.Chain(self.be.device, specs, native.const(self.n_worst), steps, 8, packed=packed,
                            stream=self.notify.go.p.chain_stream())

    def sync_chains(self):
        """A synchronised call's two chains: ``(heads, rows)``: ``heads(x, scales, topk, w, ntpr, is_in,
        ntpe)`` makes the handle's tensors and launches the exchange; after the host read the counts,
        ``rows(x, scales, topk, w, n_rows, is_in, grid)`` makes the rows and launches the gather. None where a
        launch cannot be a chain's step."""
        got = self.chain_parts()
        b = self.chain_parts(0, native.num(4), native.addr(5))
        if got is None or b is None:
            return None
        dev, stream = self.be.device, self.notify.go.p.chain_stream()
        return (native.Chain(dev, self.head_specs, native.const(0), [got[2][0]], 7,
                             packed=list(self.head_pack), stream=stream),
                native.Chain(dev, self.row_specs, native.num(4), b[2], 7, packed=b[1], stream=stream))

    # ------------------------------------------------------------------ the call

    def _helpers(self):
        """``(begin, start, result, heads_of, rows_of, ids)``: the parts of a call, closures over this plan's
        values (no attribute of the plan read per call)."""
        be, push, n_worst, num_sms = self.be, self.push, self.n_worst, self.num_sms
        fused, has_s, has_topk = self.fused, self.has_s, self.has_topk
        keep_k, keep_cp, scratch_rows, k, dev, nh = (self.keep_k, self.keep_cp, self.scratch_rows, self.k,
                                                     self.be.device, len(self.head_specs))
        err_view = be._err_view

        def begin():
            """What every call does first: the error word, the call's SMs."""
            if err_view[0]:
                be._check_error()
            be._call_sms = num_sms  # the call's Config.num_sms bounds every grid of the call

        def start(grid=[]):  # noqa: B006 - the grid of a plan whose Config fixes num_sms, kept at its first call
            """:func:`begin`, then the gather's grid of a num_worst_tokens call."""
            begin()
            if grid:
                return grid[0]
            g = be._gather_grid(push, n_worst)
            if num_sms:  # (else Buffer.num_sms, which a caller may change between calls: nvlink.num_sms)
                grid.append(g)
            return g

        def heads_of(made, is_in):
            """``(cpm, recv_cp, rpm, send_head, is_in)`` of the handle's tensors ``made`` (``heads``'
            specs)."""
            if keep_cp is None:
                cpm, recv_cp, rpm, send_head = made[:4]
            else:
                (cpm, recv_cp), (rpm, send_head) = keep_cp, made[:2]
            return cpm, recv_cp, rpm, send_head, (made[nh - 1] if fused else is_in)

        def rows_of(made, n_rows):
            """``(out_x, out_s, out_k, out_w, out_src)`` of the rows ``made`` (``rows_out``' specs), the ids
            the plan's scratch where it holds ``n_rows``."""
            out_x, out_src = made[0], made[-1]
            out_s = made[1] if has_s else None
            out_k = out_w = None
            if has_topk:
                out_w = made[-2]
                out_k = made[-3] if keep_k is None else ids(n_rows)
            return out_x, out_s, out_k, out_w, out_src

        def ids(n_rows):
            """The received ids: the plan's scratch (``keep_k``) where it holds ``n_rows``, else fresh (more
            rows: peers with a larger M)."""
            if n_rows <= scratch_rows:
                return keep_k if n_rows == scratch_rows else keep_k[:n_rows]
            return torch.empty(n_rows, k, dtype=torch.int64, device=dev)

        def result(made, is_in):
            """The DispatchResult of a num_worst_tokens chain's outputs (``made``: the heads', then the
            rows')."""
            cpm, recv_cp, rpm, send_head, is_in = heads_of(made[:nh], is_in)
            out_x, out_s, out_k, out_w, out_src = rows_of(made[nh:], n_worst)
            return DispatchResult(out_x, out_s, out_k, out_w, [],
                                  DispatchHandle(rpm, cpm, recv_cp, out_src, is_in, send_head))

        return begin, start, result, heads_of, rows_of, ids

    def _runner(self, begin, start, result, heads_of, rows_of, ids):
        """The call, ``run`` (:class:`DispatchPlan`), a closure over this plan's values and
        :meth:`_helpers`'."""
        be, r_, dev, i32, f32 = self.be, self.be.num_ranks, self.be.device, torch.int32, torch.float32
        t, h, lx, c, k, g, lay = self.t, self.h, self.lx, self.c, self.k, self.g, self.lay
        x_dtype, push, ce, bulk = self.x_dtype, self.push, self.ce, self.bulk
        fused, has_s, has_topk = self.fused, self.has_s, self.has_topk
        n_worst, alignment, scratch_rows, keep_k, keep_cp = (self.n_worst, self.alignment, self.scratch_rows,
                                                             self.keep_k, self.keep_cp)
        notify, notify_grid, gather = self.notify, self.notify_grid, self.gather
        heads, rows_out = self.heads, self.rows_out
        chain, sync_chain = self.chain, self.sync_chain
        err_view, host_view, done_view, await_counts = (be._err_view, be._notify_view, be._done_view,
                                                         be._await_counts)

        def run(x, scales, topk, w, ntpr, is_in, ntpe):
            ch = chain.value
            if ch is not None:
                Launcher.launches += 2
                return result(ch(x, scales, topk, w, ntpr, is_in, ntpe, start()), is_in)
            begin()
            if not n_worst:
                done_view[0] = 0  # (the exchange sets it once the counts are in: await_counts polls it)
            sc = sync_chain.value
            if heads is not None:
                cpm, recv_cp, rpm, send_head, is_in = heads_of(
                    heads() if sc is None else sc[0](x, scales, topk, w, ntpr, is_in, ntpe), is_in)
            else:
                if keep_cp is None:
                    cpm = torch.empty(r_, c, dtype=i32, device=dev)
                    recv_cp = torch.empty(r_, c, dtype=i32, device=dev)
                else:
                    cpm, recv_cp = keep_cp
                rpm = torch.empty(r_, r_, dtype=i32, device=dev)
                send_head = torch.empty(t, r_, dtype=i32, device=dev)
                if fused:  # (the kernel writes it; the handle keeps it)
                    is_in = torch.empty(t, r_, dtype=torch.bool, device=dev)
            if fused:
                nargs = (is_in, cpm, rpm, recv_cp, send_head, topk)
            else:
                nargs = (is_in, ntpr, ntpe, cpm, rpm, recv_cp, send_head, *((topk,) if has_topk else ()))
            if sc is not None:  # (the chain launched the exchange)
                Launcher.launches += 1
            else:
                if bulk:  # (the copy engine's copies: never with the fused layout, an SM-push plan's)
                    be._bulk_dispatch(words(x), scales, topk, w, lay, synchronised=not n_worst)
                notify(notify_grid, *nargs)
            host_col = late = None
            if n_worst:  # no host synchronisation: expert ids are checked on the device (error word)
                n_rows, lst = n_worst, []
            else:
                # The contract's one synchronisation: the exchange kernel writes the counts into pinned host
                # words, and a kernel that records an error (a bad expert id, checked there too) the error
                # word's host mirror, then sets the done word: once it is set, a few list operations (no torch
                # op per value), while the kernel still makes the handle's prefixes.
                await_counts()
                if err_view[0]:
                    late = input_error(be, err_view.tolist())
                host_col, n_rows, lst = _host_counts(host_view, r_, lx, alignment)
            grid = be._gather_grid(push, n_rows)
            if sc is not None and keep_k is not None and n_rows > scratch_rows:
                sc = None  # (more rows than the scratch ids hold: fresh ones, through the launch of Python)
            if rows_out is not None:
                made = rows_out(n_rows) if sc is None else sc[1](x, scales, topk, w, n_rows, is_in, grid)
                out_x, out_s, out_k, out_w, out_src = rows_of(made, n_rows)
            else:
                out_x = torch.empty(n_rows, h, dtype=x_dtype, device=dev)
                out_s = torch.empty(n_rows, g, dtype=f32, device=dev) if has_s else None
                out_w = torch.empty(n_rows, k, dtype=f32, device=dev) if has_topk else None
                out_src = torch.empty(n_rows, dtype=i32, device=dev)
                out_k = None if not has_topk else ids(n_rows) if keep_k is not None else \
                    torch.empty(n_rows, k, dtype=torch.int64, device=dev)
            if sc is not None:  # (the chain launched the gather)
                Launcher.launches += 1
            else:
                gather(grid, x, *((scales,) if has_s else ()),
                       *((topk, w) if has_topk else ()), n_rows, out_x, *((out_s,) if has_s else ()),
                       *((out_k, out_w) if has_topk else ()), out_src, *((is_in,) if push else ()))
            if ce:
                be._join_ce()
            if late is not None:
                # A bad expert id, or a layout not of the ids: every rank still finished this exchange (ids out of
                # range were ignored by the layout), so the Buffer stays in step; report the argument.
                raise late
            if host_col is not None:
                # The combine's copy-engine path needs the block bounds on the host
                # (rank_prefix_matrix[:, me]); keep them on the handle.
                rpm._epcomm_host_col = host_col
            chain.ready()  # (the first call bound the launches: from the next, chain calls)
            sync_chain.ready()
            return DispatchResult(out_x, out_s, out_k, out_w, lst,
                                  DispatchHandle(rpm, cpm, recv_cp, out_src, is_in, send_head))

        return run
