"""Run the internode high-throughput layout kernel (``kernels/internode_ht._hn_prep_kernel``) under
TRITON_INTERPRET=1 on CPU against torch formulas: ``rel`` and ``npos`` (each token's row among the set
rows of a rank's / a node's column), the channel prefix matrix (``layout.channel_prefix_matrix``) and
the staged exchange rows (with each rank's node's channel prefix), bitwise, for ranks in nodes of 1-4, no tokens, fewer tokens than channels and
several blocks of tokens, fewer programs than ranks. Run by ``tests/unit/test_kernel_sims.py``; alone:
``PYTHONPATH=src python tests/unit/sims/sim_internode_prep.py``."""
import epcomm.testing.interp  # noqa: F401  (sets TRITON_INTERPRET=1; must come before triton)
import torch  # noqa: E402

from epcomm import layout  # noqa: E402
from epcomm.kernels.internode_ht import _hn_prep_kernel  # noqa: E402
from epcomm.testing.compare import assert_bitwise  # noqa: E402


def positions(mask: torch.Tensor) -> torch.Tensor:
    """The row's index among the set rows of its column, -1 where unset.
    Example: ``[[1, 0], [1, 1], [0, 1]] -> [[0, -1], [1, 0], [-1, 1]]``."""
    m = mask.to(torch.int32)
    return torch.where(mask, m.cumsum(0, dtype=torch.int32) - 1, torch.full_like(m, -1))


def run(T, R, N, C, L, block, seed, programs=None):
    g = torch.Generator().manual_seed(seed)
    is_in = torch.rand(T, R, generator=g) < 0.4
    if T:
        is_in[0] = False  # a token for no rank
    P = R // N
    ntpr = is_in.sum(0, dtype=torch.int32) + torch.arange(R, dtype=torch.int32)  # any values: copied
    ntpe = torch.randint(0, 50, (R * L,), generator=g, dtype=torch.int32)
    S = 2 * R + 1 + P + 2 * C + L + 3
    stage = torch.full((R, S), -7, dtype=torch.int32)
    rel = torch.full((T, R), -9, dtype=torch.int32)
    npos = torch.full((T, P), -9, dtype=torch.int32)
    cpm = torch.full((R, C), -9, dtype=torch.int32)
    _hn_prep_kernel[(programs or R,)](is_in.view(torch.int8), T, R, N, C, max((T + C - 1) // C, 1), ntpr, ntpe, L,
                                      stage, S, rel, npos, cpm, BLOCK=block, R_POW2=1 << max(0, R - 1).bit_length())
    what = f"T={T} R={R} N={N} C={C} block={block} programs={programs or R}"
    assert_bitwise(rel, positions(is_in), f"rel {what}")
    node = is_in.view(T, P, N).any(2)
    assert_bitwise(npos, positions(node), f"npos {what}")
    want_cpm = layout.channel_prefix_matrix(is_in, C)
    assert_bitwise(cpm, want_cpm, f"cpm {what}")
    want = torch.full((R, S), -7, dtype=torch.int32)  # the exchange rows as the torch staging wrote them
    want[:, :R] = is_in.sum(0, dtype=torch.int32)
    want[:, R:2 * R] = ntpr
    want[:, 2 * R] = T
    want[:, 2 * R + 1:2 * R + 1 + P] = node.sum(0, dtype=torch.int32)
    c0 = 2 * R + 1 + P
    want[:, c0:c0 + C] = want_cpm
    want[:, c0 + C:c0 + C + L] = ntpe.view(R, L)
    want[:, c0 + C + L:c0 + 2 * C + L] = layout.channel_prefix_matrix(node, C).repeat_interleave(N, 0)
    assert_bitwise(stage, want, f"stage {what}")
    print("ok", what)


if __name__ == "__main__":
    RUNS = [  # every check; the test asks for one "ok" line each
        dict(T=37, R=2, N=1, C=4, L=3, block=16, seed=1),  # several blocks, nodes of one
        dict(T=50, R=4, N=2, C=6, L=2, block=16, seed=2),  # nodes of two
        dict(T=3, R=4, N=4, C=8, L=1, block=16, seed=3),  # one node; fewer tokens than channels
        dict(T=0, R=2, N=1, C=3, L=2, block=16, seed=4),  # no tokens
        dict(T=100, R=8, N=4, C=5, L=4, block=32, seed=5),  # channels of 20 across blocks of 32
        dict(T=60, R=8, N=2, C=4, L=2, block=16, seed=6, programs=3),  # fewer programs than ranks (num_sms)
    ]
    print("plan", len(RUNS))
    for kw in RUNS:
        run(**kw)
