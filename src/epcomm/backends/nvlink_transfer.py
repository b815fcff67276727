"""The nvlink backend's transfer phase: moving a rank's rows into its peers' staging slots over
NVLink by the copy engine (``EPCOMM_HT_TRANSFER=ce``, eager calls: many copies, then a one-program flag kernel
per chunk). Otherwise (the default, and calls captured in a CUDA graph) the receive kernels push with SMs
themselves (``_fused_push``; the combine kernel in ``ht_combine``).

``NVLinkTransfer`` is a mixin of ``NVLinkBackend`` (backends/nvlink.py), which owns the state it uses:
the symmetric buffer and its peer views, the counters and tickets, the launchers ``k``, the copy-engine
stream. The high-throughput orchestration (ht_dispatch.py, ht_combine.py) calls it through
``_bulk_dispatch``, ``_fused_push``, ``_join_ce`` and ``_combine_send``; another transport implements
those four.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``R`` ranks.
"""

from __future__ import annotations

import torch

from .nvlink_params import CSEND, DSEND, NC, TIMER, _ce_step, _chunk_rows


class NVLinkTransfer:
    def _bulk_dispatch(self, x_words: torch.Tensor, scales, topk, w, lay: dict,
                       synchronised: bool = False) -> None:
        """Send this rank's batch into slot ``me`` of every peer's dispatch staging by the copy engine (where
        the gather kernel does not push it itself: ``_fused_push``)."""
        from ..kernels import ht

        r_, me = self.num_ranks, self.rank
        if r_ == 1:
            return
        self.ce_stream.wait_stream(self._current_stream())
        t = x_words.shape[0]
        per, step = _chunk_rows(t), _ce_step(synchronised)
        with self._on(self.ce_stream):
            self.k["_ce_wait_kernel"](DSEND, (1,), self.p_table, self.flags_off, ht.DCONSUMED.value, r_, me,
                                      self.p_ctr[DSEND], self.p_err, 2, self._timeout_ns, HAS_TIMER=TIMER)
            side = [(scales, "ds"), (topk, "dk"), (w, "dw")]
            for c in range(0, NC, step):
                lo, hi = min(c * per, t), min((c + step) * per, t)
                for j in range(r_):
                    if j == me:
                        continue
                    if c == 0:  # the small per-token arrays travel with the first chunk
                        for arr, key in side:
                            if arr is not None and arr.numel():
                                b = arr.numel() * arr.element_size()
                                self._slot_view(j, lay[key], lay["d_slot"], me, b).copy_(
                                    arr.reshape(-1).view(torch.uint8))
                    if hi > lo:
                        rb = x_words.shape[1] * 4
                        self._slot_view(j, lay["dx"] + lo * rb, lay["d_slot"], me, (hi - lo) * rb).copy_(
                            x_words[lo:hi].reshape(-1).view(torch.uint8))
                self._ce_raise(ht.DDATA, DSEND, step, c + step)
        for arr in (x_words, scales, topk, w):
            if arr is not None:
                arr.record_stream(self.ce_stream)

    def _ce_raise(self, slot: int, ctr: int, inc: int, done: int) -> None:
        """On the copy-engine stream, behind a chunk's copies: raise every peer's data flag ``slot`` by
        ``inc`` chunks (``done`` of ``NC`` sent this call; the last advances counter ``ctr``) by a flag
        kernel (release add)."""
        self.k["_ce_signal_kernel"](ctr, (1,), self.p_table, self.flags_off, int(slot), self.num_ranks,
                                    self.rank, self.p_ctr[ctr], inc, int(done == NC))

    def _use_ce(self) -> bool:
        """Bulk bytes by copy engine, unless EPCOMM_HT_TRANSFER=sm or the call is being captured in a CUDA
        graph. Under graph replay the copy-engine branch
        (a forked stream: copies, then a flag kernel) let the receiver read the last rows of a chunk
        before they arrived (tier 3 on nvidia-h200-x2, third session of 2026-11-22: the rows at the
        end of chunks 0-2 held the previous replay's data, every replay; a stream memory barrier
        between copy and flag did not change it); SM push was correct there. The fourth session's
        probe (d36aacd, 512 tokens; BENCHMARKS.md Findings) saw no stale rows in any copy-engine variant."""
        if self.transfer == "sm":
            return False
        return not torch.cuda.is_current_stream_capturing()

    def _fused_push(self) -> bool:
        """A dispatch without the copy engine pushes inside the gather kernel (its programs push and copy the
        own block at once, then copy the peers' rows)."""
        return self.num_ranks > 1 and not self._use_ce()

    def _join_ce(self) -> None:
        if self.num_ranks > 1 and self._use_ce():
            self._current_stream().wait_stream(self.ce_stream)

    def _combine_send(self, x, w, k: int, h: int, rpm, host_prefix, lay: dict) -> None:
        """Combine's transfer: the block of rows this rank received from owner ``i`` (rows ``[rpm[i-1][me],
        rpm[i][me])`` of ``x``, with their weights) into slot ``me`` of ``i``'s combine staging, then ``i``'s
        data flag raised, by the copy engine: the block bounds are on the host (``host_prefix``: ``rpm[:,
        me]`` from the dispatch's synchronisation) and the call is not captured (else the combine kernel
        pushes them itself: ``ht_combine``)."""
        from ..kernels import ht

        r_, me = self.num_ranks, self.rank
        self.ce_stream.wait_stream(self._current_stream())
        with self._on(self.ce_stream):
            self.k["_ce_wait_kernel"](CSEND, (1,), self.p_table, self.flags_off, ht.CCONSUMED.value, r_, me,
                                      self.p_ctr[CSEND], self.p_err, 4, self._timeout_ns, HAS_TIMER=TIMER)
            col = host_prefix
            step = _ce_step()
            for c in range(0, NC, step):
                for i in range(r_):
                    if i == me:
                        continue
                    start = col[i - 1] if i > 0 else 0
                    rows = col[i] - start
                    per = _chunk_rows(rows)
                    lo, hi = min(c * per, rows), min((c + step) * per, rows)
                    if hi > lo:
                        src = x[start + lo:start + hi]
                        self._slot_view(i, lay["cx"] + lo * h * 2, lay["c_slot"], me,
                                        src.numel() * 2).copy_(src.reshape(-1).view(torch.uint8))
                        if w is not None:
                            ws = w[start + lo:start + hi]
                            self._slot_view(i, lay["cw"] + lo * k * 4, lay["c_slot"], me,
                                            ws.numel() * 4).copy_(ws.reshape(-1).view(torch.uint8))
                self._ce_raise(ht.CDATA, CSEND, step, c + step)
        x.record_stream(self.ce_stream)
        if w is not None:
            w.record_stream(self.ce_stream)
