"""Run the layout kernel of ``Buffer.get_dispatch_layout`` on the nvlink backend
(``kernels/ht_layout._layout_kernel``, launched as ``backends.nvlink_params.layout_launch`` says)
under TRITON_INTERPRET=1 on CPU against ``layout.dispatch_layout``, bitwise: ids outside ``[0, E)`` (``-1`` and
bad ones), no tokens, top-k 1 and not a power of two, experts not a multiple of a program's 32, more
ranks than a program's 8, repeated experts in a row. Run by ``tests/unit/test_ht_kernels.py``; alone:
``PYTHONPATH=src python tests/unit/sims/sim_ht_layout.py``."""
import epcomm.testing.interp  # noqa: F401  (sets TRITON_INTERPRET=1; must come before triton)
import torch  # noqa: E402

from epcomm import layout  # noqa: E402
from epcomm.backends.nvlink_params import layout_launch  # noqa: E402
from epcomm.kernels.ht_layout import _layout_kernel  # noqa: E402
from epcomm.testing.compare import assert_bitwise  # noqa: E402

CASES = [(0, 4, 8, 2), (3, 2, 4, 2), (37, 8, 64, 4), (100, 6, 48, 3), (50, 1, 8, 8), (33, 9, 40, 5),
         (70, 8, 24, 12), (300, 8, 256, 2)]


def run(T, K, E, R, seed):
    g = torch.Generator().manual_seed(seed)
    topk = torch.randint(-3, E + 3, (T, K), generator=g)  # ids below -1 and at or past E too
    if T > 1 and K > 1:
        topk[1, :] = topk[1, 0]  # one expert twice in a row: counted per entry, once per rank
    grid, nr, consts = layout_launch(K, E, R)
    per_rank = torch.full((R,), -7, dtype=torch.int32)
    per_expert = torch.full((E,), -7, dtype=torch.int32)
    in_rank = torch.ones(T, R, dtype=torch.bool)
    _layout_kernel[(grid,)](topk, T, K, E, E // R, R, per_rank, per_expert, in_rank.view(torch.int8), nr, **consts)
    want = layout.dispatch_layout(topk, E, R)
    for got, ref, name in zip((per_rank, per_expert, in_rank), want, ("num_tokens_per_rank",
                                                                      "num_tokens_per_expert", "is_token_in_rank")):
        assert_bitwise(got, ref, f"{name} T={T} K={K} E={E} R={R}")


def main() -> None:
    print("plan", len(CASES))  # the test asks for one "ok" line each
    for i, (T, K, E, R) in enumerate(CASES):
        run(T, K, E, R, seed=i)
        print("ok", f"T={T} K={K} E={E} R={R}")


if __name__ == "__main__":
    main()
