"""The tiled steps of ``ElasticBuffer``'s kernels under TRITON_INTERPRET=1 on CPU, with tiles small enough that
every loop of them runs several times (the DSv3 tiles cover the sims' small rows in one step):

- every check of ``sim_elastic.py`` (the kernels against their torch twins, bitwise) with the expanded
  layout's scan at 16 rows a step (``LBN``) and the expanded copy at 4 rows x 32 bytes a step;
- the combine transport (``_combine_impl_kernel``) as rank 0 of two, one process: rows into both ranks'
  areas at tiles of 2 rows x 8 words, rows of 5 to 37 words (the column loop's last step masked), rows
  sent nowhere (``dst = -1``), programs with no rows; also rows read in place from two sources (``x`` with
  its row stride, then the weights: the nvlink contiguous combine's, with padding after them); against the
  rows placed by hand.

Run by ``tests/unit/test_elastic_launches.py``; alone: ``PYTHONPATH=src python tests/unit/sims/sim_elastic_tiles.py``."""
import os
import runpy

import epcomm.testing.interp  # noqa: F401  (sets TRITON_INTERPRET=1; must come before triton)
import torch  # noqa: E402

from epcomm.backends import elastic_kernels as ek  # noqa: E402
from epcomm.backends import nvlink_v2  # noqa: E402
from epcomm.kernels import v2  # noqa: E402
from epcomm.testing.compare import assert_bitwise  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def transport(seed: int, n: int, words: int, slots: int, programs: int, rb: int, block: int, parts=None) -> None:
    """Rank 0 of 2 sends ``n`` rows of ``words`` int32 words: row ``i`` to rank ``dst[i] // slots``, slot
    ``dst[i] % slots`` of block 0 (``-1``: nowhere). ``parts = (XW, XS, KW, KS)``: each row read in place from
    two sources, ``XW`` words of ``x`` (rows ``XS`` apart) then ``KW`` of ``wts`` (rows ``KS`` apart), the
    rest of the row (padding) left unwritten; None: packed rows of ``words``. Rank 1's ``free`` word is
    raised by hand (its program 0 would). Checks both areas, the flags (rank 0's program 0 announced
    ``free`` on both ranks, every program counted ``data`` on both) and that nothing outside block 0 was
    written."""
    g = torch.Generator().manual_seed(seed)
    r_, me, w = 2, 0, words * 4
    xw, xs, kw, ks = parts if parts is not None else (words, words, 0, 0)
    flags_off, area_off = 0, 256
    size = area_off + r_ * slots * w
    bufs = [torch.zeros(size, dtype=torch.uint8) for _ in range(r_)]
    ptr_table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    flags = bufs[me][:8 * r_].view(torch.int32)
    flags[1] = 1  # free[1]: rank 1 has read its area (its program 0's signal)
    x = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, xs), generator=g, dtype=torch.int32)
    wts = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, max(ks, 1)), generator=g, dtype=torch.int32)
    # the row as a pack would make it (padding: the zeros the areas start with)
    rows = torch.cat([x[:, :xw], wts[:, :kw], torch.zeros(n, words - xw - kw, dtype=torch.int32)], 1)
    perm = torch.randperm(r_ * slots, generator=g)[:n]
    dst = torch.where(torch.rand(n, generator=g) < 0.2, torch.full((n,), -1), perm).to(torch.int64)
    epoch, err = torch.zeros(2, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    _, consts = nvlink_v2.transport_launch(w, programs, False, parts)
    consts.update(RB=rb, BLOCK=block, HAS_TIMER=False)
    consts.pop("num_warps")
    v2._combine_impl_kernel[(programs, 1, 1)](x, wts, dst, n, slots, ptr_table, area_off, flags_off, flags, epoch, me,
                                               r_, err, 1 << 20, **consts)
    what = f"transport n={n} words={words} parts={parts} slots={slots} P={programs} tile={rb}x{block}"
    want = [torch.zeros(size, dtype=torch.uint8) for _ in range(r_)]
    for i in range(n):
        d = int(dst[i])
        if d >= 0:
            at = area_off + (me * slots + d % slots) * w
            want[d // slots][at:at + w] = rows[i].view(torch.uint8)
    for q in range(r_):
        assert_bitwise(bufs[q][area_off:], want[q][area_off:], f"{what}: rank {q}'s area")
        got = bufs[q][:8 * r_].view(torch.int32).tolist()
        assert got[0] == 1 and got[r_ + me] == programs, f"{what}: rank {q}'s flags {got}"
    assert int(err[0]) == 0, f"{what}: error word {err.tolist()}"
    print("ok", what)


if __name__ == "__main__":
    ek.LBN, ek.COPY_RB, ek.COPY_BLOCK = 16, 4, 32
    CASES = [dict(seed=1, n=23, words=37, slots=16, programs=3, rb=2, block=8),
             dict(seed=2, n=9, words=5, slots=8, programs=7, rb=2, block=4),
             dict(seed=3, n=0, words=8, slots=4, programs=2, rb=2, block=8),
             dict(seed=4, n=31, words=16, slots=16, programs=2, rb=4, block=8),
             # x and weights read in place (the nvlink contiguous combine): strided x rows, weights of 3 or 8
             # words, padding after them, the x columns' last step masked
             dict(seed=5, n=23, words=28, slots=16, programs=3, rb=2, block=8, parts=(21, 24, 3, 3)),
             dict(seed=6, n=17, words=32, slots=16, programs=2, rb=4, block=8, parts=(24, 24, 8, 10)),
             dict(seed=7, n=0, words=16, slots=4, programs=2, rb=2, block=8, parts=(8, 8, 8, 8))]
    print("plan", len(CASES), "+ sim_elastic")  # sim_elastic's own plan line follows: the test adds them
    for kw in CASES:
        transport(**kw)
    runpy.run_path(os.path.join(HERE, "sim_elastic.py"), run_name="__main__")
