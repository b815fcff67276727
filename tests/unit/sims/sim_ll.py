"""Run the low-latency kernels under TRITON_INTERPRET=1 on CPU with R simulated ranks in one process
(peer buffers are plain CPU tensors) against a direct oracle: dispatch placement bitwise (BF16 and
FP8 with plain / power-of-two / UE8M0 scales), combine within the bf16 budget, and shrink (a masked
rank is skipped). Run by ``tests/unit/test_kernel_sims.py``; alone: ``pip install "triton>=3.4,<3.8";
PYTHONPATH=src python tests/unit/sims/sim_ll.py``."""
import epcomm.testing.interp  # noqa: F401  (sets TRITON_INTERPRET=1; must come before triton)
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epcomm import layout, quant  # noqa: E402
from epcomm.kernels import ll  # noqa: E402
from epcomm.testing.compare import assert_bitwise, assert_within_budget  # noqa: E402
from epcomm.testing.inputs import Case, make_topk, make_x  # noqa: E402

OFF = 256  # LL region offset inside each simulated symmetric buffer


# The combine's owner and expert roles as kernels of their own (the library runs them inside
# _ll_combine_kernel, whose programs wait on each other's roles across ranks: one process runs each rank's
# roles one after another)
@triton.jit(do_not_specialize=['T'])
def _ll_combine_weights_kernel(topk_ptr, w_ptr, T, K, me, R, M, ptr_table, w_off, sig_off, ticket_ptr,
                               mask_ptr, SHRINK: tl.constexpr):
    """Owner role of the combine (``ll._ll_weights``): push this rank's (expert id, weight) pairs to every
    rank, then raise their weight flags (the last program)."""
    ll._ll_weights(tl.program_id(0), tl.num_programs(0), topk_ptr, w_ptr, T, K, me, R, M, ptr_table, w_off,
                   sig_off, ticket_ptr, mask_ptr, SHRINK)


@triton.jit
def _ll_combine_reduce_kernel(y_ptr, H, K, me, R, L, M, ptr_table, d_area_off, src_bytes, w_off, slot_off,
                              c_off, sig_off, CW, wlevel_ptr, ticket_ptr, err_ptr, timeout_ns, mask_ptr,
                              K_POW2: tl.constexpr, BLOCK: tl.constexpr, HAS_TIMER: tl.constexpr,
                              SHRINK: tl.constexpr):
    """Expert role of the combine (``ll._ll_reduce``). Program ``(r*M + t, s)``: if token ``t`` of rank ``r``
    has experts here, ``partial = Σ_k w[k] · y[slot(k)]`` in float32 over channels ``[s*CW, (s+1)*CW)``,
    written to rank ``r``'s combine area (after ``r``'s weights arrived); the last program raises the
    flags."""
    ll._ll_reduce(tl.program_id(0), tl.program_id(1), tl.num_programs(0) * tl.num_programs(1), y_ptr, H, K,
                  me, R, L, M, ptr_table, d_area_off, src_bytes, w_off, slot_off, c_off, sig_off, CW,
                  wlevel_ptr, ticket_ptr, err_ptr, timeout_ns, mask_ptr, K_POW2, BLOCK, HAS_TIMER, SHRINK)


INT_MAX = 2 ** 31 - 1


def run(R=3, M=6, H=256, E=6, K=3, tokens=(5, 0, 6), use_fp8=False, round_scale=False, ue8m0=False, masked=(),
        start=0, early_recv=False, bad_m_from=None):
    """``start``: every counter (flag words and levels of parity 0) starts there, e.g. ``INT_MAX`` to
    cross the int32 wrap in this call. ``early_recv``: rank 0's dispatch receive runs before any send
    and must time out (the flags say nothing arrived), not read the area. ``bad_m_from``: after the
    sends, the header of that source in rank 0's area says another M (as when a rank with another M
    wrote here); rank 0's receive must record code 6 and take nothing from it."""
    case = Case(num_ranks=R, tokens=tokens, hidden=H, num_topk=K, num_experts=E, seed=2, hot_expert=1)
    L, G, RM = E // R, H // 128, R * M
    lay = layout.low_latency_buffer_layout(M, H, R, E)
    symm = [torch.zeros(OFF + lay.total, dtype=torch.uint8) for _ in range(R)]
    table = torch.tensor([b.data_ptr() for b in symm], dtype=torch.int64)
    st = []
    for me in range(R):
        topk, w = make_topk(case, me)
        mask = torch.zeros(R, dtype=torch.int32)
        for r in masked:
            mask[r] = 1
        st.append(dict(topk=topk, w=w, x=make_x(case, me), levels=torch.zeros(8, dtype=torch.int32),
                       tickets=torch.zeros(16, dtype=torch.int32), err=torch.zeros(6, dtype=torch.int32), mask=mask))
    area, sig = OFF, OFF + lay.signal_offset
    alive = [r for r in range(R) if r not in masked]
    if start:
        for me in range(R):
            symm[me][sig:sig + 3 * R * 4].view(torch.int32).fill_(start)
            for i in (0, 2, 4):  # dispatch, combine-weights and combine-receive levels of parity 0
                st[me]["levels"][i] = start
    if early_recv:
        s = st[0]
        q = torch.zeros(L, RM, H, dtype=torch.bfloat16)
        src, rng, cnt = torch.full((L, RM), -1, dtype=torch.int32), torch.zeros(L, R, dtype=torch.int64), \
            torch.zeros(L, dtype=torch.int32)
        ll._ll_dispatch_recv_kernel[(L, R, 1)](
            table, area, lay.dispatch_src_bytes, lay.dispatch_msg_bytes, sig, area + lay.slot_offset, 0, R, L, M,
            H, G, K, q.view(torch.int32), cnt, src, rng, cnt, cnt, rng, s["levels"][0:], s["tickets"][5:],
            s["err"], 20, s["mask"], SHRINK=False, USE_FP8=False, UE8M0=False, HAS_CUM=False,
            HAS_WAIT=False, TB=4, QB=1, BLOCK=32, G_POW2=4, HAS_TIMER=False, K_POW2=4)
        assert s["err"][:4].tolist()[:2] == [6, 0], s["err"]  # timed out waiting for rank 0's own data first
        assert s["err"][3] == start + 1 if start != INT_MAX else s["err"][3] == -2 ** 31, s["err"]
        print("ok early receive times out", dict(start=start))
        return
    for me in alive:
        s = st[me]
        ll._ll_dispatch_send_kernel[(max(tokens[me], 1), (G + 1) // 2)](
            s["x"], s["topk"], tokens[me], H, G, K, me, R, L, E, M, table, area, lay.dispatch_src_bytes,
            lay.dispatch_msg_bytes, sig, s["tickets"][4:], s["err"], s["mask"], USE_FP8=use_fp8,
            ROUND_SCALE=round_scale, GC=2, K_POW2=4, R_POW2=4, SHRINK=bool(masked))
    if bad_m_from is not None:
        hdr = symm[0][area + bad_m_from * lay.dispatch_src_bytes:][:8].view(torch.int32)
        hdr[1] = M + 16
    outs = {}
    for me in alive:
        s = st[me]
        if bad_m_from is not None and me != 0:
            continue
        if use_fp8:
            q = torch.zeros(L, RM, H, dtype=torch.float8_e4m3fn)
            sc = torch.zeros(L, (G + 3) // 4 if ue8m0 else G, RM, dtype=torch.int32 if ue8m0 else torch.float32)
            words = q.view(torch.uint8).view(torch.int32)
        else:
            q = torch.zeros(L, RM, H, dtype=torch.bfloat16)
            sc = None
            words = q.view(torch.int32)
        src = torch.full((L, RM), -1, dtype=torch.int32)
        rng = torch.zeros(L, R, dtype=torch.int64)
        cnt = torch.zeros(L, dtype=torch.int32)
        ll._ll_dispatch_recv_kernel[(L, R, 2)](
            table, area, lay.dispatch_src_bytes, lay.dispatch_msg_bytes, sig, area + lay.slot_offset, me, R, L, M,
            H, G, K, words, sc if sc is not None else cnt, src, rng, cnt, cnt, rng, s["levels"][0:], s["tickets"][5:],
            s["err"], 50, s["mask"], SHRINK=bool(masked), USE_FP8=use_fp8, UE8M0=ue8m0, HAS_CUM=False,
            HAS_WAIT=False, TB=4, QB=1, BLOCK=32, G_POW2=4, HAS_TIMER=False, K_POW2=4)
        if bad_m_from is not None:
            assert s["err"][:4].tolist() == [6, bad_m_from, M + 16, M], s["err"]
            took = [int(rng[l_, bad_m_from]) & 0xFFFFFFFF for l_ in range(L)]
            assert took == [0] * L, took  # nothing taken from the source with the bad header
            print("ok a header with another M is refused", dict(source=bad_m_from))
            return
        assert int(s["err"][0]) == 0, s["err"]
        # oracle: per local expert, blocks by source rank, tokens ascending
        for l_ in range(L):
            e_ = me * L + l_
            begin = 0
            for r in range(R):
                if r in masked:
                    rows = torch.zeros(0, dtype=torch.int64)
                else:
                    rows = (st[r]["topk"] == e_).any(1).nonzero().squeeze(1)
                n = rows.numel()
                assert int(rng[l_, r]) == (begin << 32) | n, (me, l_, r, int(rng[l_, r]), begin, n)
                assert_bitwise(src[l_, begin:begin + n], rows.to(torch.int32), f"src rank {me} expert {l_} from {r}")
                xr = st[r]["x"][rows]
                if use_fp8:
                    eq, es = quant.per_token_cast_to_fp8(xr, round_scale)
                    assert_bitwise(q[l_, begin:begin + n], eq, f"fp8 rows rank {me} expert {l_} from {r}")
                    got_s = sc.transpose(1, 2)[l_, begin:begin + n]
                    want_s = quant.pack_ue8m0(es) if ue8m0 else es
                    assert_bitwise(got_s, want_s, f"scales rank {me} expert {l_} from {r}")
                else:
                    assert_bitwise(q[l_, begin:begin + n], xr, f"rows rank {me} expert {l_} from {r}")
                begin += n
            assert int(cnt[l_]) == begin
        outs[me] = dict(q=q, sc=sc, cnt=cnt)
    # combine: y = the received rows (dequantised) scaled per local expert
    for me in alive:
        o = outs[me]
        vals = o["q"].float() if not use_fp8 else o["q"].float() * (
            quant.unpack_ue8m0(o["sc"].transpose(1, 2).contiguous(), G) if ue8m0 else o["sc"].transpose(1, 2)
        ).repeat_interleave(128, dim=2)
        o["y"] = (vals * (1 + torch.arange(L).float() / 8).view(L, 1, 1)).to(torch.bfloat16)
    for me in alive:  # every owner pushes its weights before any expert side waits for them
        s = st[me]
        _ll_combine_weights_kernel[(max(tokens[me], 1),)](
            s["topk"], s["w"], tokens[me], K, me, R, M, table, area + lay.weights_offset, sig, s["tickets"][6:],
            s["mask"], SHRINK=bool(masked))
    for me in alive:
        s = st[me]
        _ll_combine_reduce_kernel[(R * M, 2)](
            outs[me]["y"], H, K, me, R, L, M, table, area, lay.dispatch_src_bytes, area + lay.weights_offset,
            area + lay.slot_offset, area + lay.combine_offset, sig, H // 2, s["levels"][2:], s["tickets"][7:],
            s["err"], 50, s["mask"], K_POW2=4, BLOCK=64, HAS_TIMER=False, SHRINK=bool(masked))
    for me in alive:
        s = st[me]
        out = torch.empty(tokens[me], H, dtype=torch.bfloat16)
        ll._ll_combine_recv_kernel[(max(1, tokens[me]), H // 64)](
            s["topk"], tokens[me], H, K, me, R, L, M, table, area + lay.combine_offset, sig, out, s["levels"],
            s["levels"][4:], s["tickets"][8:], s["err"], 50, s["mask"], K_POW2=4, R_POW2=4, BLOCK=64, HAS_WAIT=False,
            HAS_TIMER=False, SHRINK=bool(masked))
        assert int(s["err"][0]) == 0, s["err"]
        # oracle in float64: Σ_k w · y[expert_k, slot(t, k)] over experts on unmasked ranks
        ref = torch.zeros(tokens[me], H, dtype=torch.float64)
        terms = torch.zeros_like(ref)
        for t in range(tokens[me]):
            for k in range(K):
                e_ = int(s["topk"][t, k])
                if e_ < 0 or e_ // L in masked:
                    continue
                j, l_ = e_ // L, e_ % L
                # the row of (t, me) in expert l_ of rank j: block `me`, position of t among me's tokens
                rows = (s["topk"] == e_).any(1).nonzero().squeeze(1)
                begin = sum(int((st[r]["topk"] == e_).any(1).sum()) for r in range(me) if r not in masked)
                slot = begin + int((rows == t).nonzero())
                yrow = outs[j]["y"][l_, slot].double()
                ref[t] += float(s["w"][t, k]) * yrow
                terms[t] += abs(float(s["w"][t, k])) * yrow.abs()
        assert_within_budget(out, ref, terms, 2 * K, f"combine rank {me}", extra_rel=2.0 ** -8)
    print("ok", dict(R=R, tokens=tokens, fp8=use_fp8, round=round_scale, ue8m0=ue8m0, masked=masked, start=start))


if __name__ == "__main__":
    RUNS = [  # every check; the test asks for one "ok" line each
        dict(),
        dict(use_fp8=True),
        dict(use_fp8=True, round_scale=True, ue8m0=True, H=512, E=9, tokens=(4, 6, 1)),
        dict(R=2, tokens=(6, 3), E=4, K=2),
        dict(masked=(1,)),
        dict(start=INT_MAX),  # every counter crosses the int32 wrap in this call
        dict(start=INT_MAX, early_recv=True),
        dict(start=5, early_recv=True),
        dict(bad_m_from=2),
        dict(bad_m_from=0),  # its own header too
    ]
    print("plan", len(RUNS))
    for kw in RUNS:
        run(**kw)
