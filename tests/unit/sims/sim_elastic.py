"""Run ``ElasticBuffer``'s kernels (``kernels/v2_dispatch.py``, ``kernels/v2.py``, launched by
``backends/elastic_kernels.py``) under TRITON_INTERPRET=1 on CPU against their torch twins (``elastic_layout``:
the reference the CPU backends run), bitwise, on random routings: the received rows' metadata and the expanded
layout (``recv_meta``: every field, padding rows included), the expanded copy (``expand_rows``, by expanded
row and by contiguous row: BF16 and FP8 with fp32 or int32
packs, packed rows, TMA-aligned scales, zero padding), the combine's rows (``local_reduce`` and ``pack_rows``) and its reduction (``ordered_reduce`` at the
master lanes, or every lane one call at a time), with biases and weights. Blocks of 16 rows, so every
kernel runs several. Run by ``tests/unit/test_elastic_layout.py``; alone:
``PYTHONPATH=src python tests/unit/sims/sim_elastic.py``."""
import epcomm.testing.interp  # noqa: F401  (sets TRITON_INTERPRET=1; must come before triton)
import torch  # noqa: E402

from epcomm import elastic_layout as EL  # noqa: E402
from epcomm.backends import elastic_kernels as ek  # noqa: E402
from epcomm.testing.compare import assert_bitwise  # noqa: E402

ek.BN = 16


def _routing(g, t, k, e, masked=0.25):
    """``int64[T, K]``: distinct experts a token, ``-1`` lanes."""
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    idx = idx.to(torch.int64)
    idx[torch.rand(t, k, generator=g) < masked] = -1
    return idx


def _received(g, r, me, m, k, le, sync):
    """Plausible backend results for rank ``me``: ``(rank_prefix_matrix, recv_src_idx, recv_local, N)``;
    padding rows hold garbage, as a worst-case dispatch leaves them."""
    counts = torch.randint(0, m + 1, (r, r), generator=g, dtype=torch.int32)
    rpm = counts.cumsum(0, dtype=torch.int32)
    real = int(rpm[-1, me])
    n = real if sync else r * m
    src = torch.randint(0, m, (n,), generator=g, dtype=torch.int32)
    local = torch.randint(-5, 2 * le, (n, k), generator=g)  # garbage on padding rows
    for i in range(real):
        row = torch.randperm(le + k, generator=g)[:k]
        local[i] = torch.where(row < le, row, torch.full_like(row, -1))
    return rpm, src, local, n


META_KERNELS = ek.Kernels()  # every recv_meta check on one: each launch must leave its counts' scratch at 0


def recv_meta(seed, r, me, m, k, le, alignment, expand, sync, cum, strided=False, copy_topk=False):
    """``strided``: the caller's top-k ids and statistics as strided views (the kernels read copies);
    ``copy_topk``: with the handle's copy of the top-k ids. The checks share one ``Kernels`` (and so the
    counts' scratch) and each runs twice: a launch that left its scratch dirty fails the next."""
    g = torch.Generator().manual_seed(seed)
    rpm, src, local, n = _received(g, r, me, m, k, le, sync)
    t = int(torch.randint(0, m + 1, (), generator=g))
    topk = _routing(g, t, k, r * le)
    send_head = torch.randint(0, m * r, (t, r), generator=g, dtype=torch.int32)
    x_rows = EL.worst_expanded_rows(r, m, k, le, alignment)
    stats = [None, None] if not cum else [torch.arange(le, dtype=torch.int32) for _ in range(2)]
    if strided:
        topk = topk.t().contiguous().t()
        stats[0] = torch.arange(le, dtype=torch.int32).repeat_interleave(2)[::2]
    what = f"recv_meta r={r} me={me} m={m} k={k} le={le} a={alignment} expand={expand} sync={sync} n={n}" + \
        (" strided" if strided else "") + (" copy_topk" if copy_topk else "")
    slot, kept = [], []  # (the second call takes the plan the first left in slot, where its tensors were contiguous)
    for call in range(2):
        got = META_KERNELS.recv_meta(rpm, me, src, local, send_head, topk, m, le, alignment, x_rows, expand,
                                     stats[0], copy_topk, slot)
        kept.append(got)  # (alive: the second call cannot reuse its memory)
        want = EL.recv_meta(rpm, me, src, local, send_head, topk, m, le, alignment, x_rows, expand, stats[1],
                            copy_topk)
        for name in EL.RecvMeta._fields:
            a, b = getattr(got, name), getattr(want, name)
            if b is None:
                assert a is None, f"{what}, call {call}: {name} should be None"
            else:
                assert_bitwise(a, b, f"{what}, call {call}: {name}")
        if cum:
            assert_bitwise(stats[0], stats[1], f"{what}, call {call}: cumulative stats")
    assert len(slot) == (not strided), f"{what}: slot {slot}"
    ptrs = [{a.untyped_storage().data_ptr() for a in rm if a is not None and a.numel()} for rm in kept]
    assert not ptrs[0] & ptrs[1], f"{what}: the second call's outputs share memory with the first's"
    print("ok", what)


def copy_epilogue(seed, dtype, p, packed, tma, zero_pad, with_w, by_row):
    """``by_row``: the copy by contiguous row, from the slots as the handle holds them (``recv_src_metadata[:,
    2:]``, rows ``K + 2`` apart); the last 3 rows are padding (no local lane)."""
    g = torch.Generator().manual_seed(seed)
    n, k, le, h, a = 37, 3, 4, 64, 4
    local = _routing(g, n, k, le + 3)
    local = torch.where(local < le, local, torch.full_like(local, -1))
    local[-3:] = -1
    lay = EL.expanded_layout(local, le, a, EL.align(n * k + (a - 1) * le, a) + 5)
    meta = torch.full((n, k + 2), -7, dtype=torch.int32)
    meta[:, 2:] = lay.slots
    x = torch.randint(0, 256, (n, h * dtype.itemsize), generator=g, dtype=torch.uint8).view(dtype)
    sf = torch.randint(-2**31, 2**31 - 1, (n, p), generator=g, dtype=torch.int64).to(torch.int32) if p else None
    w = torch.rand(n, k, generator=g) if with_w else None
    if packed:  # one byte row: x, the packs, the weights side by side (a cached dispatch's payload)
        buf = EL.pack_rows([x] + ([sf] if p else []) + ([w] if with_w else []))
        wd, xb = buf.shape[1], h * dtype.itemsize
        rows = (EL.Rows(buf, 0, wd), EL.Rows(buf, xb, wd) if p else None, EL.Rows(buf, xb + 4 * p, wd) if with_w
                else None)
    else:
        rows = (EL.Rows(x, 0, h * dtype.itemsize), EL.Rows(sf.view(torch.float32), 0, 4 * p) if p else None,
                EL.Rows(w, 0, 4 * k) if with_w else None)
    parts = (rows[0], dtype, h, rows[1], torch.int32, p, tma, rows[2])
    got = ek.Kernels().copy_epilogue(lay.source, k, zero_pad, 1, *parts, slots=meta[:, 2:] if by_row else None)
    want = EL.expand_rows(lay.source, k, zero_pad, *parts)
    what = f"copy_epilogue {dtype} p={p} packed={packed} tma={tma} zero={zero_pad} w={with_w} by_row={by_row}"
    real = lay.source >= 0  # padding rows are unspecified without zero padding
    for name, a, b in zip(("x", "sf", "w"), got, want):
        if b is None:
            assert a is None, f"{what}: {name}"
            continue
        assert a.stride() == b.stride() and a.dtype == b.dtype, f"{what}: {name} {a.stride()} {b.stride()}"
        assert_bitwise(a if zero_pad else a[real], b if zero_pad else b[real], f"{what}: {name}")
    print("ok", what)


def _combine_case(g, n, k, le, h, a):
    local = _routing(g, n, k, le + 2)
    local = torch.where(local < le, local, torch.full_like(local, -1))
    local[-2:] = -1  # padding rows
    lay = EL.expanded_layout(local, le, a, EL.align(n * k + (a - 1) * le, a))
    meta = torch.full((n, k + 2), -1, dtype=torch.int32)
    meta[:, 0] = torch.arange(n, dtype=torch.int32) * 3
    meta[-2:, 0] = -1
    meta[:, 2:] = lay.slots
    x = (torch.randn(lay.source.shape[0], h, generator=g) * 2.0 ** torch.randint(-8, 8, (lay.source.shape[0], 1),
                                                                               generator=g)).bfloat16()
    return meta, x


def pack(seed, mode, with_w):
    g = torch.Generator().manual_seed(seed)
    n, k, le, h = 23, 4, 3, 40
    meta, x = _combine_case(g, n, k, le, h, 2)
    slots = meta[:, 2:]
    kern = ek.Kernels()
    real = meta[:, 0] >= 0
    what = f"pack mode={mode} w={with_w}"
    if mode == 2:
        for j in range(k):
            rows, dst = kern.pack(x, meta, None, 2, j)
            s = slots[:, j].to(torch.int64)
            want_dst = torch.where((s >= 0) & real, meta[:, 0].to(torch.int64), torch.full_like(s, -1))
            assert_bitwise(dst, want_dst, f"{what} lane {j}: dst")
            sent = want_dst >= 0
            assert_bitwise(rows[sent], EL.pack_rows([x[s.clamp(min=0)]])[sent], f"{what} lane {j}: rows")
        print("ok", what)
        return
    if mode == 0:
        x = x[:n]
        w = torch.rand(n, k, generator=g) if with_w else None
        want = EL.pack_rows([x] + ([w] if with_w else []))
    else:
        w = torch.rand(x.shape[0], generator=g) if with_w else None
        parts = [EL.local_reduce(x, slots)]
        if with_w:
            s = slots.to(torch.int64)
            parts.append(torch.where(s >= 0, w[s.clamp(min=0)], torch.zeros(())))
        want = EL.pack_rows(parts)
    rows, _ = kern.pack(x, meta, w, mode)
    width = 2 * h + (4 * k if with_w else 0)
    assert_bitwise(rows[real][:, :width], want[real][:, :width], what)
    print("ok", what)


def reduce(seed, n_bias, with_w, master):
    g = torch.Generator().manual_seed(seed)
    r, m, t, k, le, h = 3, 5, 5, 4, 2, 40
    topk = _routing(g, t, k, r * le)
    width = EL.align(2 * h + (4 * k if with_w else 0), 16)
    got = torch.randint(0, 256, (r, m, width), generator=g, dtype=torch.uint8)
    vals = (torch.randn(r, m, h, generator=g) * 2.0 ** torch.randint(-8, 8, (r, m, 1), generator=g)).bfloat16()
    got[:, :, :2 * h] = vals.view(torch.uint8)
    bias = tuple((torch.randn(t, h, generator=g) * 64).bfloat16() for _ in range(n_bias))
    kern = ek.Kernels()
    flat = got.view(r * m, width)
    owner = torch.where(topk >= 0, topk // le, torch.zeros_like(topk))
    use = EL.master_lanes(topk, le) if master else topk >= 0
    tok = torch.arange(t)

    def lanes(j):
        row = flat[owner[:, j] * m + tok][:, :2 * h].contiguous().view(torch.bfloat16)
        return torch.where(use[:, j].unsqueeze(1), row, torch.zeros((), dtype=torch.bfloat16))

    want = EL.ordered_reduce(lanes, k, bias, (t, h), "cpu")
    what = f"reduce biases={n_bias} w={with_w} master={master}"
    if master:
        out, out_w = kern.reduce(got, topk.t().contiguous().t(), le, m, h, bias, (0, k), True, with_w)
        if with_w:
            wv = flat[:, 2 * h:2 * h + 4 * k].contiguous().view(torch.float32)[owner * m + tok.unsqueeze(1),
                                                                              torch.arange(k).unsqueeze(0)]
            assert_bitwise(out_w, torch.where(topk >= 0, wv, torch.zeros(())), f"{what}: weights")
    else:  # one call a lane, the float32 sum carried between calls
        acc, out = torch.empty(t, h), None
        for j in range(k):
            out, _ = kern.reduce(got, topk, le, m, h, bias, (j, j + 1), False, False, acc, j > 0, j < k - 1, out)
    assert_bitwise(out, want, what)
    print("ok", what)


if __name__ == "__main__":
    RUNS = [  # every check; the test asks for one "ok" line each
        *[(recv_meta, dict(seed=10 + i, r=r, me=me, m=m, k=k, le=le, alignment=a, expand=ex, sync=sy, cum=cu,
                           copy_topk=ct))
          for i, (r, me, m, k, le, a, ex, sy, cu, ct) in enumerate([
              (2, 1, 20, 3, 4, 1, False, True, False, True), (2, 0, 20, 3, 4, 4, True, False, True, False),
              (3, 2, 9, 4, 3, 4, True, True, False, True), (3, 1, 9, 2, 5, 128, True, False, False, False),
              (1, 0, 40, 3, 4, 1, True, True, True, False), (2, 1, 1, 1, 1, 1, True, False, False, True),
              (3, 0, 12, 3, 2, 2, False, False, True, False),
              (1, 0, 40, 4, 6, 3, False, False, True, True)])],
        (recv_meta, dict(seed=20, r=2, me=1, m=12, k=3, le=4, alignment=2, expand=True, sync=False, cum=True,
                         strided=True)),
        *[(copy_epilogue, dict(seed=30 + i, dtype=dt, p=p, packed=pk, tma=tm, zero_pad=z, with_w=w, by_row=br))
          for br in (False, True) for i, (dt, p, pk, tm, z, w) in enumerate([
              (torch.bfloat16, 0, False, False, False, True), (torch.bfloat16, 0, False, False, True, True),
              (torch.float8_e4m3fn, 3, False, True, True, False), (torch.float8_e4m3fn, 3, True, True, True, True),
              (torch.float8_e4m3fn, 5, True, False, False, True), (torch.bfloat16, 0, True, False, True, True)])],
        *[(pack, dict(seed=50 + i, mode=mo, with_w=w)) for i, (mo, w) in enumerate([
            (0, False), (0, True), (1, False), (1, True), (2, False)])],
        *[(reduce, dict(seed=60 + i, n_bias=b, with_w=w, master=ms)) for i, (b, w, ms) in enumerate([
            (0, False, True), (1, True, True), (2, True, True), (0, False, False), (2, False, False)])],
    ]
    print("plan", len(RUNS))
    for fn, kw in RUNS:
        fn(**kw)
