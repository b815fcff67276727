"""Run the high-throughput kernels under TRITON_INTERPRET=1 on CPU with R simulated ranks in one
process (peer buffers are plain CPU tensors), against the reference oracle. Run by
``tests/unit/test_kernel_sims.py``; alone: ``pip install "triton>=3.4,<3.8"; PYTHONPATH=src python
tests/unit/sims/sim_ht.py``."""
import epcomm.testing.interp  # noqa: F401  (sets TRITON_INTERPRET=1; must come before triton)
import torch  # noqa: E402
from epcomm import layout  # noqa: E402
from epcomm.backends import nvlink_params as nv  # noqa: E402
from epcomm.kernels import ht  # noqa: E402
from epcomm.testing.inputs import Case, make_topk, make_x, expected_dispatch  # noqa: E402
from epcomm.testing.compare import assert_bitwise  # noqa: E402


def _wrap32(v):
    return (v + 2 ** 31) % 2 ** 32 - 2 ** 31


def _p2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def run(R=3, T=(7, 0, 5), H=64, K=3, E=6, C=2, fp8=False, worst=0, start=0, ce_chunks=4):
    """``start``: every per-call counter (and the flags that follow it) starts there, e.g. 2**31 - 1 so
    that the counters and the copy-engine data flags (NC per call) cross the int32 wrap in this call.
    The transfers are the copy engine's, emulated (copies, then the flag kernels); the SM push runs inside the
    receive kernels (``PUSH``, ``_combine_kernel``), whose programs wait on each other across ranks: the
    tier-2 runs (tests/dist/test_nvlink_cpu.py, one process a rank) cover it."""
    case = Case(num_ranks=R, tokens=T, hidden=H, num_topk=K, num_experts=E, seed=1, hot_expert=1)
    L = E // R
    meta_src = nv._align((R + nv.L_MAX + nv.C_MAX) * 4, 16)
    list_src = nv._align(nv.T_LIST_CAP * 4, 16)
    meta_off = nv._align(nv.NUM_CTRS * R * 4)
    list_off = nv._align(meta_off + 2 * R * meta_src)
    ht_off = nv._align(list_off + 2 * R * list_src)
    cap = 16
    row_words = H // 2
    g = 0
    d_slot = 1 << 16
    c_slot = 1 << 16
    dx = ht_off
    ds = dx + cap * row_words * 4
    dk = ds + cap * g * 4
    dw = dk + cap * K * 8
    cx = ht_off + R * d_slot
    cw = cx + cap * H * 2
    total = cx + R * c_slot
    symm = [torch.zeros(total, dtype=torch.uint8) for _ in range(R)]
    table = torch.tensor([s.data_ptr() for s in symm], dtype=torch.int64)
    st = []
    for me in range(R):
        topk, w = make_topk(case, me)
        x = make_x(case, me)
        per_rank, per_e, in_rank = layout.dispatch_layout(topk, E, R)
        st.append(dict(topk=topk, w=w, x=x, per_rank=per_rank, per_e=per_e, in_rank=in_rank,
                       nctr=torch.zeros(R, dtype=torch.int32), ctrs=torch.zeros(16, dtype=torch.int32),
                       tickets=torch.zeros(8, dtype=torch.int32), err=torch.zeros(6, dtype=torch.int32),
                       src_lists=torch.zeros(R, 64, dtype=torch.int32),
                       shr=torch.empty(T[me], R, dtype=torch.int32), cpm=torch.empty(R, C, dtype=torch.int32),
                       counts=torch.zeros(R, R, dtype=torch.int32), pe=torch.zeros(R, L, dtype=torch.int32),
                       toks=torch.zeros(R, dtype=torch.int32),
                       chan=torch.zeros(R, C, dtype=torch.int32)))
    if start:
        for me in range(R):
            st[me]["nctr"].fill_(start)
            st[me]["ctrs"].fill_(start)
            flags = symm[me][:nv.NUM_CTRS * R * 4].view(torch.int32).view(nv.NUM_CTRS, R)
            flags[ht.NOTIFY.value] = start
            flags[ht.DDATA.value] = flags[ht.CDATA.value] = _wrap32(start * nv.NC)
            flags[ht.DCONSUMED.value] = flags[ht.CCONSUMED.value] = start
    for phase in ("send", "recv"):
        for me in range(R):
            s = st[me]
            ht._notify_kernel[(R,)](
                s["in_rank"].view(torch.int8), T[me], R, me, s["per_rank"], s["per_e"], L, C,
                max((T[me] + C - 1) // C, 1), table, 0, meta_off, R * meta_src, meta_src, list_off, R * list_src,
                list_src, s["nctr"], s["shr"], s["cpm"], s["counts"], s["pe"], s["chan"], s["toks"], s["src_lists"],
                s["src_lists"].stride(0), s["err"], 100, BLOCK=4, R_POW2=4, DO_SEND=phase == "send",
                DO_RECV=phase == "recv", HAS_TIMER=False)
            if phase == "recv":
                s["nctr"] -= 0
    # the transfer: the copy engine emulated (copies, then NC flag kernels)
    for me in range(R):
        s = st[me]
        xw = s["x"].view(torch.int32)
        for j in range(R):
            if j == me:
                continue
            def put(off, arr):
                b = arr.numel() * arr.element_size()
                symm[j][off + me * d_slot: off + me * d_slot + b] = arr.reshape(-1).view(torch.uint8)
            put(dx, xw)
            put(dk, s["topk"]); put(dw, s["w"])
        step = nv.NC // ce_chunks  # each copy carries ``step`` NC-chunks and raises the flag by that
        for c in range(0, nv.NC, step):
            ht._ce_signal_kernel[(1,)](table, 0, ht.DDATA, R, me, s["ctrs"][nv.DSEND:], step,
                                       int(c + step == nv.NC))
    outs = []
    for me in range(R):
        s = st[me]
        assert s["err"][0] == 0, s["err"]
        exp = expected_dispatch(case, me)
        n = int(s["counts"][:, me].sum())
        assert n == exp["recv_x"].shape[0]
        rows = worst or n
        out_src = torch.empty(rows, dtype=torch.int32)
        out_x = torch.empty(rows, row_words, dtype=torch.int32)
        out_k = torch.empty(rows, K, dtype=torch.int64)
        out_w = torch.empty(rows, K, dtype=torch.float32)
        stage_x = symm[me][dx:dx + R * d_slot].view(torch.int32)
        stage_k = symm[me][dk:dk + R * d_slot].view(torch.int64)
        stage_w = symm[me][dw:dw + R * d_slot].view(torch.float32)
        ht._dispatch_impl_kernel[(3,)](
            s["x"].view(torch.int32), stage_w, s["topk"], s["w"], row_words, 0, K,
            s["counts"], R, me, R, me * L, L, s["toks"], s["src_lists"], s["src_lists"].stride(0), rows,
            stage_x, d_slot // 4, stage_w, d_slot // 4, stage_k, d_slot // 8, stage_w, d_slot // 4,
            out_x, stage_w, 0, 1, out_k, out_w, out_src, table, 0, s["ctrs"][nv.DRECV:], s["tickets"][0:],
            s["err"], 100, s["err"], 0, 0, 0, 0, 0, 0, s["ctrs"][nv.DSEND:], s["tickets"][4:], CACHED=False, IS_PREFIX=False, HAS_SCALES=False, HAS_TOPK=True, NC=nv.NC, RB=4,
            BLOCK=16, R_POW2=4,
            K_POW2=4, G_POW2=1, HAS_TIMER=False)
        assert s["err"][0] == 0, s["err"]
        assert_bitwise(out_x.view(torch.bfloat16)[:n], exp["recv_x"], f"recv_x rank {me}")
        assert_bitwise(out_k[:n], exp["recv_topk_idx"], "topk")
        assert_bitwise(out_w[:n], exp["recv_topk_weights"], "w")
        assert_bitwise(out_src[:n], exp["recv_src_idx"], "src")
        if worst:
            assert (out_k[n:] == -1).all() and (out_src[n:] == -1).all()
        # the handle's tensors by the handle kernel, against the layout module
        rpm = torch.empty(R, R, dtype=torch.int32)
        rcp = torch.empty(R, C, dtype=torch.int32)
        sh = torch.empty(T[me], R, dtype=torch.int32)
        in8 = s["in_rank"].view(torch.int8)
        ht._handle_kernel[(2,)](s["counts"], R, s["chan"], C, C, s["shr"], T[me], R, me, rpm, rcp, sh, s["err"], worst,
                                s["topk"], K, E, in8, E // R, CHECK_WORST=bool(worst), R_POW2=4, C_POW2=_p2(C), TB=2,
                                CHECK_TOPK=bool(worst), K_POW2=_p2(K))
        assert s["err"][0] == 0, s["err"]
        rpm_ref = s["counts"].cumsum(0).to(torch.int32)
        assert_bitwise(rpm, rpm_ref, "rank_prefix_matrix")
        assert_bitwise(rcp, layout.recv_channel_prefix_matrix(rpm_ref, s["chan"], me), "recv_channel_prefix_matrix")
        assert_bitwise(s["cpm"], layout.channel_prefix_matrix(s["in_rank"], C), "cpm")
        assert_bitwise(sh, layout.send_head(s["in_rank"], rpm_ref, me), "send_head")
        if worst and n:  # one row fewer allowed than arrived: error 9 with (observed, bound)
            err = torch.zeros(6, dtype=torch.int32)
            ht._handle_kernel[(1,)](s["counts"], R, s["chan"], C, C, s["shr"], T[me], R, me, rpm, rcp, sh, err, n - 1,
                                    s["topk"], K, E, in8, E // R, CHECK_WORST=True, R_POW2=4, C_POW2=_p2(C), TB=2)
            assert err[:4].tolist() == [9, -1, n, n - 1], err
        if worst and T[me]:  # an expert id out of range in the last tile: error 10 with the id and E
            for bad in (E + 3, -4):
                err, topk = torch.zeros(6, dtype=torch.int32), s["topk"].clone()
                topk[T[me] - 1, K - 1] = bad
                ht._handle_kernel[(2,)](s["counts"], R, s["chan"], C, C, s["shr"], T[me], R, me, rpm, rcp, sh, err,
                                        worst, topk, K, E, in8, E // R, CHECK_WORST=True, R_POW2=4, C_POW2=_p2(C), TB=2,
                                        CHECK_TOPK=True, K_POW2=_p2(K))
                assert err[:4].tolist() == [10, -1, bad, E], err
        if worst and T[me]:  # is_token_in_rank not the layout of the ids: error 12 with the lowest (token, rank)
            for tok, rank in ((T[me] - 1, R - 1), (0, 0)):
                err, wrong = torch.zeros(6, dtype=torch.int32), s["in_rank"].clone()
                wrong[tok, rank] = ~wrong[tok, rank]
                ht._handle_kernel[(2,)](s["counts"], R, s["chan"], C, C, s["shr"], T[me], R, me, rpm, rcp, sh, err,
                                        worst, s["topk"], K, E, wrong.view(torch.int8), E // R, CHECK_WORST=True,
                                        R_POW2=4, C_POW2=_p2(C), TB=2, CHECK_TOPK=True, K_POW2=_p2(K))
                assert err[:4].tolist() == [12, -1, tok, rank], (err, tok, rank)
        outs.append(dict(x=out_x.view(torch.bfloat16)[:rows], w=out_w, rpm=rpm, sh=sh))
    assert all(bool((s["counts"] == st[0]["counts"]).all()) for s in st)
    # combine: expert outputs = received rows * 2; each owner's block by the emulated copy engine; reduce
    for me in range(R):
        s, o = st[me], outs[me]
        y = (o["x"].float() * 2).to(torch.bfloat16)
        o["y"] = y
        col = o["rpm"][:, me].tolist()
        for i in range(R):
            lo, hi = (col[i - 1] if i else 0), col[i]
            if i != me and hi > lo:
                rows, ws = y[lo:hi].reshape(-1).view(torch.uint8), o["w"][lo:hi].reshape(-1).view(torch.uint8)
                symm[i][cx + me * c_slot:cx + me * c_slot + rows.numel()] = rows
                symm[i][cw + me * c_slot:cw + me * c_slot + ws.numel()] = ws
        ht._ce_signal_kernel[(1,)](table, 0, ht.CDATA, R, me, s["ctrs"][nv.CSEND:], nv.NC, 1)
    for me in range(R):
        s, o = st[me], outs[me]
        out = torch.empty(T[me], H, dtype=torch.bfloat16)
        out_w = torch.empty(T[me], K, dtype=torch.float32)
        bias = torch.randn(T[me], H).to(torch.bfloat16)
        ht._reduce_kernel[(2,)](o["y"], H, T[me], R, me, o["sh"], o["rpm"], o["w"], K, o["y"].shape[0],
                                symm[me][cx:cx + R * c_slot].view(torch.bfloat16), c_slot // 2,
                                symm[me][cw:cw + R * c_slot].view(torch.float32), c_slot // 4,
                                bias, bias, out, out_w, table, 0, s["ctrs"][nv.CRECV:], s["tickets"][1:], s["err"], 100,
                                HAS_W=True, NUM_BIAS=1, NC=nv.NC, TB=2, BLOCK=16, R_POW2=4, K_POW2=4, HAS_TIMER=False)
        assert s["err"][0] == 0, s["err"]
        ref = torch.zeros(T[me], H)
        for j in range(R):
            ref[s["in_rank"][:, j]] += (s["x"][s["in_rank"][:, j]].float() * 2).to(torch.bfloat16).float()
        ref = ref + bias.float()
        # The interpreter converts float32 -> bf16 by truncation (the GPU rounds to nearest even):
        trunc = (ref.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
        assert_bitwise(out, trunc, f"combine rank {me}")
        assert_bitwise(out_w, s["w"], f"combine weights rank {me}")
    print("ok", R, T, "start", start)


if __name__ == "__main__":
    RUNS = [  # every check; the test asks for one "ok" line each
        dict(),
        dict(R=2, T=(9, 4), worst=20),
        dict(R=1, T=(6,)),
        dict(start=2 ** 31 - 1),  # counters, parities and data flags cross the int32 wrap
        dict(R=2, T=(9, 4), worst=20, start=2 ** 31 - 1),
        dict(ce_chunks=1, start=2 ** 31 - 1),  # one copy-engine copy per call (TUNE ce_chunks), over the wrap
        dict(R=2, T=(9, 4), ce_chunks=2),
    ]
    print("plan", len(RUNS))
    for kw in RUNS:
        run(**kw)
