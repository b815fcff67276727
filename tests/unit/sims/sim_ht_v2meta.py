"""Run the gather (``kernels/ht_receive._dispatch_impl_kernel``) with ``V2META`` (``TUNE["v2_meta_in_gather"]``:
``ElasticBuffer``'s contiguous no-sync dispatch writes ``recv_meta``'s outputs there) under TRITON_INTERPRET=1
on CPU, one receiving rank of ``R`` (its peers' rows already in its staging, their data flags raised), against the
path it replaces: the same gather without ``V2META`` then ``Kernels.recv_meta`` (``_recv_meta_kernel``), and where
every id is in range the torch twin ``elastic_layout.recv_meta``: every output bitwise, padding rows included, the
gather's own outputs unchanged by the flag. Ranks 1, 2, 4; tokens 0, 1, odd, over one token tile; odd K;
alignment 1 and 128; cumulative statistics on and off; the top-k copy on and off; ids ``-1``, below ``-1`` and past
``E``; the SM push (its own block by the push loop) and the plain gather. Every case launches twice on one counts
scratch, which must be back at 0 after each launch. Run by ``tests/unit/test_ht_kernels.py``; alone:
``PYTHONPATH=src python tests/unit/sims/sim_ht_v2meta.py``."""
import epcomm.testing.interp  # noqa: F401  (sets TRITON_INTERPRET=1; must come before triton)
import torch  # noqa: E402
import triton.language as tl  # noqa: E402

from epcomm import elastic_layout as EL  # noqa: E402
from epcomm.backends import elastic_kernels as ek  # noqa: E402
from epcomm.backends import nvlink_params as nv  # noqa: E402
from epcomm.backends.ht_v2meta import V2Meta, gather_consts  # noqa: E402
from epcomm.kernels import ht  # noqa: E402
from epcomm.testing.compare import assert_bitwise  # noqa: E402
from meta_compare import assert_meta  # noqa: E402

META = ek.Kernels()  # the reference path's launches (its own counts scratch)
PART = torch.zeros(EL.MAX_LOCAL_EXPERTS, dtype=torch.int32)  # the gather's counts scratch, shared by every case
H, D_SLOT = 16, 1 << 14  # bf16 columns; bytes of a source's staging slot (x, ids, weights: regions of their own)


def _p2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def _ids(g, t, k, e, bad):
    """``int64[T, K]``: distinct ids in ``[0, E)`` a token, ``-1`` lanes, and with ``bad`` also ``-4`` and ``E + 3``."""
    ids = torch.stack([torch.randperm(e + k, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    ids = torch.where(ids < e, ids, -1).to(torch.int64)
    if bad and t:
        ids[t // 2, 0], ids[t - 1, k - 1] = -4, e + 3
    return ids


def case(seed, r, me, tokens, k, le, m, a, cum, copy_topk, bad=False, push=False):
    """Rank ``me`` of ``r`` receives ``tokens[i]`` rows from source ``i`` (its own: ``x``, ``topk``; a peer's:
    random rows in its staging) into ``N = r * m`` rows (the rest padding)."""
    g = torch.Generator().manual_seed(seed)
    e, t = r * le, tokens[me]
    row = H // 2  # int32 words a row
    symm = [torch.zeros(nv.NUM_CTRS * r * 4 + 4 * D_SLOT * r, dtype=torch.uint8) for _ in range(r)]
    flags = symm[me][:nv.NUM_CTRS * r * 4].view(torch.int32)
    flags.fill_(1 << 20)  # every peer's data in, every slot handed back (no wait in either launch)
    dx = nv.NUM_CTRS * r * 4
    dk, dw = dx + r * D_SLOT, dx + 2 * r * D_SLOT
    stage_x = symm[me][dx:dk].view(torch.int32)
    stage_k = symm[me][dk:dw].view(torch.int64)
    stage_w = symm[me][dw:dw + r * D_SLOT].view(torch.float32)
    table = torch.tensor([s.data_ptr() for s in symm], dtype=torch.int64)
    for i in range(r):  # the peers' rows, as their pushes or copies left them
        stage_x.view(r, -1)[i, :tokens[i] * row] = torch.randint(-2**31, 2**31 - 1, (tokens[i] * row,), generator=g,
                                                                  dtype=torch.int64).to(torch.int32)
        stage_k.view(r, -1)[i, :tokens[i] * k] = _ids(g, tokens[i], k, e, bad).reshape(-1)
        stage_w.view(r, -1)[i, :tokens[i] * k] = torch.rand(tokens[i] * k, generator=g)
    x = torch.randint(-2**31, 2**31 - 1, (t, row), generator=g, dtype=torch.int64).to(torch.int32)
    topk, w = _ids(g, t, k, e, bad), torch.rand(t, k, generator=g)
    counts = torch.zeros(r, r, dtype=torch.int32)
    counts[:, me] = torch.tensor(tokens, dtype=torch.int32)
    lists = torch.zeros(r, max(max(tokens), 1), dtype=torch.int32)
    for i in range(r):  # each source's tokens for me: a random subset of its T, in order
        lists[i, :tokens[i]] = torch.randperm(tokens[i], generator=g).to(torch.int32).sort().values
    toks = torch.tensor(tokens, dtype=torch.int32)
    is_in = (torch.rand(t, r, generator=g) < 0.5).to(torch.int8)
    send_head = torch.randint(0, r * m, (t, r), generator=g, dtype=torch.int32)
    n = r * m
    stats = [None, None] if not cum else [torch.arange(le, dtype=torch.int32) * 3 for _ in range(2)]
    rpm = counts.cumsum(0, dtype=torch.int32)
    what = f"v2meta r={r} me={me} T={tokens} k={k} le={le} m={m} a={a} cum={cum} copy={copy_topk} bad={bad} " \
           f"push={push}"
    base = None
    for call in range(2):
        ctrs, tickets, err = torch.zeros(16, dtype=torch.int32), torch.zeros(8, dtype=torch.int32), \
            torch.zeros(6, dtype=torch.int32)
        outs = []
        for v2 in (False, True):
            out_x = torch.full((n, row), 7, dtype=torch.int32)
            out_k = torch.full((n, k), 7, dtype=torch.int64)
            out_w = torch.full((n, k), 7.0)
            out_src = torch.full((n,), 7, dtype=torch.int32)
            v2args = (err,) * 12 + (0, 0)
            if v2:  # recv_meta's outputs as the engine allocates them, garbage first: each must be written
                got, margs, _ = META.meta_outputs(n, t, k, le, r, torch.device("cpu"), copy_topk, stats[0])
                for o in got:
                    if o is not None and o.numel():
                        o.fill_(-77)
                v2args = (*margs[:8], PART, margs[9], send_head, margs[10], m, a)
            consts = gather_consts(V2Meta(m, a, cum, copy_topk), _p2(le)) if v2 else {}
            ht._dispatch_impl_kernel[(2 if push else 3,)](
                x, w, topk, w, row, 0, k, counts, r, me, r, me * le, le, toks, lists, lists.stride(0), n,
                stage_x, D_SLOT // 4, stage_w, D_SLOT // 4, stage_k, D_SLOT // 8, stage_w, D_SLOT // 4,
                out_x, w, 0, 1, out_k, out_w, out_src, table, 0, ctrs[nv.DRECV:], tickets[0:], err, 100,
                is_in, t, dx, D_SLOT, dx, dk, dw, ctrs[nv.DSEND:], tickets[4:], *v2args,
                CACHED=False, IS_PREFIX=False, HAS_SCALES=False, HAS_TOPK=True, NC=nv.NC, RB=4, BLOCK=8,
                R_POW2=_p2(r), K_POW2=_p2(k), G_POW2=1, HAS_TIMER=False, PUSH=push, PUSH_RB=2, PUSH_BLOCK=8,
                ELEM=tl.int32, PUSH_TOPK=push, V2_TB=4, **consts)
            assert err[0] == 0, (what, err)
            assert not PART.any(), f"{what}, call {call}: the counts scratch is not back at 0: {PART.tolist()}"
            assert tickets.eq(0).all(), (what, tickets)
            outs.append((out_x, out_k, out_w, out_src))
            if not v2:  # the path it replaces: the meta kernel after the gather
                base = META.recv_meta(rpm, me, out_src, out_k, send_head, topk, m, le, a, 0, False, stats[1],
                                      copy_topk)
        for name, p, q in zip(("x", "topk", "w", "src"), *outs):
            assert_bitwise(q, p, f"{what}, call {call}: the gather's {name} with V2META")
        assert_meta(got, base, f"{what}, call {call}", stats if cum else None)
        if not bad:  # (the twin reads send_head at every id's rank: ids in range only)
            cum_t = None if not cum else stats[1] - base.counts
            want = EL.recv_meta(rpm, me, outs[0][3], outs[0][1], send_head, topk, m, le, a, 0, False, cum_t,
                                copy_topk)
            assert_meta(got, want, f"{what}, call {call} (twin)")
    print("ok", what)


RUNS = [
    dict(seed=1, r=1, me=0, tokens=(0,), k=3, le=5, m=4, a=1, cum=False, copy_topk=False),
    dict(seed=2, r=1, me=0, tokens=(1,), k=3, le=5, m=3, a=128, cum=True, copy_topk=True),
    dict(seed=3, r=1, me=0, tokens=(9,), k=5, le=3, m=11, a=4, cum=True, copy_topk=False, bad=True, push=True),
    dict(seed=4, r=2, me=1, tokens=(7, 5), k=3, le=4, m=9, a=1, cum=False, copy_topk=True, push=True),
    dict(seed=5, r=2, me=0, tokens=(13, 0), k=7, le=3, m=13, a=128, cum=True, copy_topk=True, bad=True),
    dict(seed=6, r=4, me=2, tokens=(3, 0, 6, 1), k=3, le=2, m=7, a=2, cum=True, copy_topk=False, push=True),
    dict(seed=7, r=4, me=3, tokens=(2, 5, 4, 0), k=5, le=3, m=5, a=1, cum=False, copy_topk=True, bad=True),
    dict(seed=8, r=2, me=0, tokens=(37, 20), k=3, le=6, m=40, a=128, cum=True, copy_topk=True),  # T over 8 tiles
]

if __name__ == "__main__":
    print("plan", len(RUNS))
    for kw in RUNS:
        case(**kw)
