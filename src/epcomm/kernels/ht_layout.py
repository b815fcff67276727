"""High-throughput kernel of ``Buffer.get_dispatch_layout`` on the GPU backends: the routing counts of
``layout.dispatch_layout`` in one launch (it is ~20 torch ops, a dozen of them kernels).

Letters: ``T`` tokens, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``.

Programs ``0 .. NR-1`` take ``RB`` ranks each and write ``is_token_in_rank[:, ranks]`` and
``num_tokens_per_rank[ranks]``; programs ``NR ..`` take ``EB`` experts each and count their entries
(``num_tokens_per_expert``). Each scans every token: no atomics, no zeroed output, nothing kept between
calls. An id outside ``[0, E)`` counts nowhere (the dispatch reports it), as in ``layout.dispatch_layout``.

Example (R = 2, E = 4, so L = 2; T = 3, K = 2): ``topk_idx = [[0, 3], [1, -1], [-1, -1]]`` gives
``is_token_in_rank = [[1, 1], [1, 0], [0, 0]]``, ``num_tokens_per_rank = [2, 1]``,
``num_tokens_per_expert = [1, 1, 0, 1]``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=['T'],
            do_not_specialize_on_alignment=['topk_ptr', 'per_rank_ptr', 'per_expert_ptr', 'in_rank_ptr'])
def _layout_kernel(topk_ptr, T, K, E, L, R, per_rank_ptr, per_expert_ptr, in_rank_ptr, NR,
                   K_POW2: tl.constexpr, RB: tl.constexpr, EB: tl.constexpr, TBR: tl.constexpr,
                   TBE: tl.constexpr):
    """``topk int64[T, K]`` -> ``per_rank int32[R]``, ``per_expert int32[E]``, ``in_rank int8[T, R]`` (the
    bytes of a bool tensor); ``NR`` rank programs of ``RB`` ranks, then expert programs of ``EB``."""
    pid = tl.program_id(0)
    kk = tl.arange(0, K_POW2)
    if pid < NR:
        rr = pid * RB + tl.arange(0, RB)
        rcnt = tl.zeros((RB,), dtype=tl.int32)
        for t0 in range(0, T, TBR):
            tt = (t0 + tl.arange(0, TBR)).to(tl.int64)
            mk = (tt[:, None] < T) & (kk[None, :] < K)
            ids = tl.load(topk_ptr + tt[:, None] * K + kk[None, :], mask=mk, other=-1)
            rank = tl.where(mk & (ids >= 0) & (ids < E), ids // L, -1)
            inr = tl.max((rank[:, :, None] == rr[None, None, :]).to(tl.int32), 1)  # [TBR, RB]
            tl.store(in_rank_ptr + tt[:, None] * R + rr[None, :], inr.to(tl.int8),
                     mask=(tt[:, None] < T) & (rr[None, :] < R))
            rcnt += tl.sum(inr, 0)
        tl.store(per_rank_ptr + rr, rcnt, mask=rr < R)
    else:
        e0 = (pid - NR) * EB
        ecnt = tl.zeros((EB,), dtype=tl.int32)
        for t0 in range(0, T, TBE):
            tt = (t0 + tl.arange(0, TBE)).to(tl.int64)
            mk = (tt[:, None] < T) & (kk[None, :] < K)
            ids = tl.load(topk_ptr + tt[:, None] * K + kk[None, :], mask=mk, other=-1)
            rel = (ids - e0).to(tl.int32)
            mine = mk & (rel >= 0) & (rel < EB) & (ids < E)
            ecnt += tl.histogram(tl.reshape(tl.where(mine, rel, 0), [TBE * K_POW2]), EB,
                                mask=tl.reshape(mine, [TBE * K_POW2]))
        ee = e0 + tl.arange(0, EB)
        tl.store(per_expert_ptr + ee, ecnt, mask=ee < E)
