"""Run the layout kernel of ``Buffer.get_dispatch_layout`` on the nvlink backend
(``kernels/ht_layout._layout_kernel``, launched as ``backends.nvlink_params.layout_launch`` and
``kernels.ht_layout.chunking`` say) under TRITON_INTERPRET=1 on CPU against ``layout.dispatch_layout``,
bitwise: ids outside ``[0, E)`` (``-1`` and bad ones), no tokens, one token, top-k 1 and not a power of two,
experts not a multiple of a group's 32, more ranks than a group's 8, repeated experts in a row; token
counts of many chunks, a count not a multiple of the chunk, chunks of several tiles (more tokens than
``CP2`` tiles), chunks of several rank tiles. Each shape runs twice on one scratch, as the backend's plan
does: the first time on partial counts of junk (only the tickets must start at 0), the second on a third
of the tokens (fewer chunks: the rows the first call left must not count) and other routings; the tickets
reset themselves (they must be back to 0 after each launch). Run by ``tests/unit/test_ht_kernels.py``;
alone: ``PYTHONPATH=src python tests/unit/sims/sim_ht_layout.py``."""
import epcomm.testing.interp  # noqa: F401  (sets TRITON_INTERPRET=1; must come before triton)
import torch  # noqa: E402

from epcomm import layout  # noqa: E402
from epcomm.backends.nvlink_params import layout_launch  # noqa: E402
from epcomm.kernels.ht_layout import _layout_kernel, chunking, scratch_words  # noqa: E402
from epcomm.testing.compare import assert_bitwise  # noqa: E402

# (T, K, E, R); with their chunks: (0 and 1: one chunk), (37 of 8: 1 chunk of 128), (300 of 8, 2 ranks:
# 3 chunks of 128, the last of 44), (70 of 8, 12 ranks: rank tiles of 64, two a chunk), (1100 of 32: 18
# chunks of 64 tokens, two tiles of 32 each, the last chunk 12 tokens), (4500 of 8: 18 chunks of 256, the
# last of 148; then 1500: 12 chunks of 128)
CASES = [(0, 4, 8, 2), (1, 8, 256, 8), (3, 2, 4, 2), (37, 8, 64, 4), (100, 6, 48, 3), (50, 1, 8, 8),
         (33, 9, 40, 5), (70, 8, 24, 12), (300, 8, 256, 2), (1100, 32, 40, 4), (4500, 8, 72, 1)]


def launch(topk, E, R, scratch=None):
    """One launch as the backend's plan makes it; returns the outputs (filled with junk first) and the
    scratch (made where None: tickets 0, junk partial counts)."""
    T, K = topk.shape
    ng, nr, consts = layout_launch(K, E, R)
    cp2 = consts["CP2"]
    if scratch is None:
        scratch = torch.zeros(scratch_words(ng, cp2, R, E), dtype=torch.int32)
        scratch[:cp2 * (R + E)] = 12345  # the partial counts need no zeroing
    nch, s = chunking(T, consts["TBE"], cp2)
    per_rank = torch.full((R,), -7, dtype=torch.int32)
    per_expert = torch.full((E,), -7, dtype=torch.int32)
    in_rank = torch.ones(T, R, dtype=torch.bool)
    _layout_kernel[(nch * ng,)](topk, T, s, K, E, E // R, R, per_rank, per_expert, in_rank.view(torch.int8),
                                scratch[:cp2 * (R + E)], scratch[cp2 * (R + E):], nr, ng, **consts)
    assert scratch[cp2 * (R + E):].eq(0).all(), f"tickets not back to 0: {scratch[cp2 * (R + E):].tolist()}"
    return (per_rank, per_expert, in_rank), scratch


def run(T, K, E, R, seed):
    g = torch.Generator().manual_seed(seed)
    scratch = None
    for call, t in enumerate((T, T // 3)):
        topk = torch.randint(-3, E + 3, (t, K), generator=g)  # ids below -1 and at or past E too
        if t > 1 and K > 1:
            topk[1, :] = topk[1, 0]  # one expert twice in a row: counted per entry, once per rank
        got, scratch = launch(topk, E, R, scratch)
        want = layout.dispatch_layout(topk, E, R)
        names = ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank")
        for a, b, name in zip(got, want, names):
            assert_bitwise(a, b, f"{name} T={t} K={K} E={E} R={R} call {call}")


def main() -> None:
    print("plan", len(CASES))  # the test asks for one "ok" line each
    for i, (T, K, E, R) in enumerate(CASES):
        run(T, K, E, R, seed=i)
        print("ok", f"T={T} K={K} E={E} R={R}")


if __name__ == "__main__":
    main()
