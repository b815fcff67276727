"""Run the exchange kernel's fused layout (``ht_notify._dispatch_notify_kernel`` with ``FUSED_LAYOUT``, its tile
programs ``ht_layout.layout_tiles``; ``ElasticBuffer``'s eager dispatch: ``HTDispatch.fuses_layout``) under
TRITON_INTERPRET=1 on CPU against the separate layout kernel (``ht_layout._layout_kernel``) followed by the same
exchange kernel without it, bitwise: every output of the launch (``is_token_in_rank``, the two counts, the
received counts, per-expert counts, channel prefixes, token counts and send lists, the host words, the handle's
``rank_prefix_matrix``, ``recv_channel_prefix_matrix``, ``send_head``, the channel prefix, the counters, the
error word), and the layout against ``layout.dispatch_layout``.

Simulated ranks in one process (peer buffers are CPU tensors): the rank under test runs its kernel once its peers'
parts for the call are in its meta area (each peer's ``_notify_kernel`` sends, as in ``sim_ht.py``), every rank
in turn, with T of 0, 1, 127, 128 and 4500 (36 tiles on 32 tile programs: programs of two tiles), 1, 2 and 4
ranks, local experts not a power of two, experts over one histogram block (300 > 256), top-k not a power of
two, ids -1 everywhere and ids outside ``[-1, E)`` in some calls (error 10 with the same id as the unfused
kernel's check). Each rank runs two calls in a row on the same scratch and flags (a graph replay's state):
the second with another routing; the fused scratch starts as junk, the ticket must be back to 0 and the epoch
flag at the call's counter after each call; one case starts the counters at ``2**31 - 1`` (the epoch crosses
the int32 wrap). Run by ``tests/unit/test_ht_kernels.py``; alone:
``PYTHONPATH=src python tests/unit/sims/sim_ht_fused_layout.py``."""
import epcomm.testing.interp  # noqa: F401  (sets TRITON_INTERPRET=1; must come before triton)
import torch  # noqa: E402
from sim_ht_layout import launch as layout_launch  # noqa: E402

from epcomm import layout  # noqa: E402
from epcomm.backends import nvlink_params as nv  # noqa: E402
from epcomm.kernels.ht_common import NOTIFY  # noqa: E402
from epcomm.kernels.ht_layout import fused_words  # noqa: E402
from epcomm.kernels.ht_notify import _dispatch_notify_kernel, _notify_kernel  # noqa: E402
from epcomm.testing.compare import assert_bitwise  # noqa: E402

TB, CP2, BLOCK, C = 128, 32, 64, 3
META_SRC = nv._align((8 + nv.L_MAX + nv.C_MAX + 1) * 4, 16)  # (R + L + C + 1 words, R <= 8)
LIST_SRC = nv._align(nv.T_LIST_CAP * 4, 16)
# (T per rank, K, E, bad ids in call 0 of rank 0, counters' start)
CASES = [((0,), 3, 7, False, 0), ((1,), 3, 7, False, 0), ((127,), 3, 7, True, 0),
         ((128, 1), 4, 6, False, 0), ((4500, 37), 8, 6, True, 0), ((127, 0, 128, 5), 3, 20, False, 0),
         ((300, 64, 1, 9), 9, 300, True, 0), ((9, 4), 2, 6, False, 2 ** 31 - 1)]


def _p2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def _wrap32(v: int) -> int:
    return (v + 2 ** 31) % 2 ** 32 - 2 ** 31


def _topk(t, k, e, seed, bad):
    g = torch.Generator().manual_seed(seed)
    topk = torch.randint(-1, e, (t, k), generator=g)
    if bad and t:
        topk[t // 2, 0] = -3  # the lowest below -1 is reported
        topk[t - 1, k - 1] = e + 2
    return topk


class Rig:
    """The symmetric memory of ``R`` ranks and the per-rank state of the rank under test, ``me``."""

    def __init__(self, R, E, me, start):
        self.R, self.E, self.L, self.me = R, E, E // R, me
        self.meta_off = nv._align(nv.NUM_CTRS * R * 4)
        self.list_off = nv._align(self.meta_off + 2 * R * META_SRC)
        self.symm = [torch.zeros(nv._align(self.list_off + 2 * R * LIST_SRC), dtype=torch.uint8) for _ in range(R)]
        self.table = torch.tensor([s.data_ptr() for s in self.symm], dtype=torch.int64)
        for s in self.symm:  # every NOTIFY flag at the counters' start
            s[:nv.NUM_CTRS * R * 4].view(torch.int32).view(nv.NUM_CTRS, R)[NOTIFY.value] = start
        self.nctr = torch.full((R,), start, dtype=torch.int32)  # the rank under test's
        self.peer_nctr = [torch.full((R,), start, dtype=torch.int32) for _ in range(R)]
        self.lay = torch.tensor([0, start], dtype=torch.int32)  # fused: ticket, epoch (the last call's)
        self.words = torch.full((fused_words(CP2, R, E),), 12345, dtype=torch.int32)  # fused scratch: junk
        self.layout_scratch = None  # the separate layout kernel's
        self.err = torch.zeros(6, dtype=torch.int32)
        self.host = torch.zeros(R * R + R * self.L + 1, dtype=torch.int32)  # counts, per-expert, the done word
        self.host_addr = torch.tensor([self.host.data_ptr(), self.host.data_ptr() + 4 * (R * R + R * self.L)],
                                      dtype=torch.int64)
        self.done = torch.zeros(1, dtype=torch.int32)  # the ticket before the done word
        self.src_lists = torch.zeros(R, 8192, dtype=torch.int32)

    def peers_send(self, topks):
        """Every peer's part into every rank's meta area (``_notify_kernel``'s sends, the reference layout)."""
        R, L = self.R, self.L
        for i, topk in enumerate(topks):
            if i == self.me:
                continue
            t = topk.shape[0]
            per_rank, per_e, in_rank = layout.dispatch_layout(topk, self.E, R)
            z = torch.zeros(R, C, dtype=torch.int32)
            _notify_kernel[(R,)](in_rank.view(torch.int8), t, R, i, per_rank, per_e, L, C, max((t + C - 1) // C, 1),
                                 self.table, 0, self.meta_off, R * META_SRC, META_SRC, self.list_off, R * LIST_SRC,
                                 LIST_SRC, self.peer_nctr[i], torch.empty(t, R, dtype=torch.int32), z.clone(), z, z,
                                 z, z, z, 0, self.err, 100, BLOCK=BLOCK, R_POW2=_p2(R), DO_SEND=True, DO_RECV=False,
                                 HAS_TIMER=False)
            self.peer_nctr[i] += 1

    def call(self, topk, fused, worst):
        """One exchange kernel of the rank under test: fused, or the layout kernel then the unfused one."""
        R, L, E, me = self.R, self.L, self.E, self.me
        t, k = topk.shape
        q = max(1, min((t + TB - 1) // TB, CP2))
        at = (CP2 + 1) * (R + E + 2)
        if fused:
            in_rank = torch.ones(t, R, dtype=torch.bool)  # (junk: the kernel writes it)
            ntpr, ntpe = self.words[at:at + R], self.words[at + R:]
            grid, part = q + 1, self.words
        else:
            (ntpr, ntpe, in_rank), self.layout_scratch = layout_launch(topk, E, R, self.layout_scratch)
            grid, part = 1 + min((t + TB - 1) // TB, CP2), self.err
        out = dict(counts=torch.full((R, R), -7, dtype=torch.int32), pe=torch.full((R, L), -7, dtype=torch.int32),
                   chan=torch.full((R, C), -7, dtype=torch.int32), toks=torch.full((R,), -7, dtype=torch.int32),
                   cpm=torch.full((R, C), -7, dtype=torch.int32), rpm=torch.full((R, R), -7, dtype=torch.int32),
                   rcp=torch.full((R, C), -7, dtype=torch.int32), sh=torch.full((t, R), -7, dtype=torch.int32))
        self.host.fill_(-7)
        self.host[-1] = 0  # (the host clears the done word before the launch)
        _dispatch_notify_kernel[(grid,)](
            in_rank.view(torch.int8), t, R, me, ntpr, ntpe, L, C, max((t + C - 1) // C, 1), self.table, 0,
            self.meta_off, R * META_SRC, META_SRC, self.list_off, R * LIST_SRC, LIST_SRC, self.nctr, out["cpm"],
            out["counts"], out["pe"], out["chan"], out["toks"], self.src_lists, self.src_lists.stride(0), self.err,
            100, out["rpm"], out["rcp"], out["sh"], worst, topk, k, E, self.host_addr, 1, part, self.lay, self.done,
            BLOCK=BLOCK, R_POW2=_p2(R), C_POW2=_p2(C), K_POW2=_p2(k), TB=TB, CHECK_WORST=bool(worst),
            CHECK_TOPK=True, HOST_COUNTS=not worst, HAS_TIMER=False, FUSED_LAYOUT=fused, EB=min(_p2(E), 256),
            CP2=CP2)
        out.update(in_rank=in_rank.clone(), ntpr=ntpr.clone(), ntpe=ntpe.clone(), err=self.err[:4].clone(),
                   nctr=self.nctr.clone(), src=self.src_lists.clone(), host=self.host.clone())
        self.err.zero_()  # (as the host does after reporting error 10)
        return out


def run(T, K, E, bad, start):
    R = len(T)
    for me in range(R):
        rigs = {fused: Rig(R, E, me, start) for fused in (False, True)}
        for call in range(2):
            topks = [_topk(T[i], K, E, 100 * call + i, bad and call == 0 and i == 0) for i in range(R)]
            worst = sum(T) if call else 0  # the second call as a no-sync (graph) dispatch (its error-9 check)
            got = {}
            for fused, rig in rigs.items():
                rig.peers_send(topks)
                got[fused] = rig.call(topks[me], fused, worst)
            where = f"T={T} K={K} E={E} rank {me} call {call}"
            for name in got[False]:
                assert_bitwise(got[True][name], got[False][name], f"{name} {where}")
            want = layout.dispatch_layout(topks[me], E, R)
            for a, b, name in zip((got[True][n] for n in ("ntpr", "ntpe", "in_rank")), want,
                                  ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank")):
                assert_bitwise(a, b, f"{name} {where}")
            n0 = _wrap32(start + call)
            err = got[True]["err"].tolist()  # (the id of the lowest tile program that found one: equal above)
            if bad and call == 0 and me == 0 and T[0]:
                assert err[:2] == [10, -1] and err[2] in (-3, E + 2) and err[3] == E, (err, where)
            else:
                assert err == [0, 0, 0, 0], (err, where)
            lay = rigs[True].lay.tolist()
            assert lay == [0, _wrap32(n0 + 1)], f"ticket and epoch {lay} after {where}, counter start {n0}"
            assert got[True]["nctr"].eq(_wrap32(n0 + 1)).all(), (got[True]["nctr"], where)
            for fused, rig in rigs.items():  # the done word set by the last program, once, its ticket reset
                done = got[fused]["host"][-1].item()
                assert done == (0 if worst else 1), f"done word {done} after {where} fused {fused}"
                assert rig.done.item() == 0, f"done ticket {rig.done.item()} after {where} fused {fused}"
                if not worst:  # the host's words: rank_prefix_matrix[:, me], then the rows per local expert
                    lay = [layout.dispatch_layout(tk, E, R) for tk in topks]
                    lx = E // R
                    want = torch.cat([torch.stack([la[0][me] for la in lay]).cumsum(0),
                                      sum(la[1][me * lx:(me + 1) * lx] for la in lay)]).to(torch.int32)
                    assert_bitwise(got[fused]["host"][:R + lx], want, f"host words {where} fused {fused}")


def main() -> None:
    print("plan", len(CASES))  # the test asks for one "ok" line each
    for T, K, E, bad, start in CASES:
        run(T, K, E, bad, start)
        print("ok", f"T={T} K={K} E={E} bad ids {bad} start {start}")


if __name__ == "__main__":
    main()
