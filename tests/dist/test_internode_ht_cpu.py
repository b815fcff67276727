"""Tier 2: the internode backend's hierarchical high-throughput path — host code and Triton kernels under
the interpreter, the NVSHMEM device calls simulated — on CPU processes in virtual nodes
(``EPCOMM_GPUS_PER_NODE``), against the reference backend (``epcomm.testing.cpu_internode``).

- Two nodes of one rank (every transfer between ranks crosses the simulated network): BF16 and FP8
  dispatch bitwise with top-k ids and weights, the handle, cached dispatch, ``num_worst_tokens``,
  combine (with bias) and its weights within the budget, a rank that sends nothing and a hot expert;
  the device-side checks of calls with ``num_worst_tokens`` (no host synchronisation): a wrong
  ``num_tokens_per_rank`` and too few ``num_worst_tokens``, raised by that call or the next.
- Four ranks in two nodes of two (the forwarding path): everything above (but the FP8
  ``num_worst_tokens`` check of the looping chunk case, for time), and the hierarchy itself: each
  token crosses to a node at most once (messages per node = ``num_tokens_per_rdma_rank`` from
  ``get_dispatch_layout``, fewer than the (token, rank) pairs when a token has two ranks in one node),
  forwarded in the node. Four nodes of one rank: BF16 and FP8 and the chunk cases (nothing forwarded).
- ``Config``'s RDMA chunk (rows per put across nodes), dispatch's and combine's: 1, and 3 and 2 (chunks
  that split a channel's rows unevenly) with ``num_sms=2`` (one channel of several blocks and chunks;
  in nodes of two one program forwards, then receives), BF16 with bias and FP8 with ``num_worst_tokens``.
- Three combines in a row on one handle, each of its own expert outputs against the reference's; then
  every free word counts every call (each consumer freed its slots once a call).
- A slow peer (its launches start half a second late), in two nodes of one and in one node of two (no
  network: the relay forwards by stores, the final reads its node's partials only): every consumer
  reaches rows before they are sent and must wait for them; a consumer that read one tile before its counter said failed here (the
  forwarder, the receiver, the relay and the final each tried; elsewhere only as timing allows).
- Nodes of one rank (two, four): the paired combine and the split roles (as more nodes than pair take them)
  give the same bits, modes alternating on one handle, at 4, 2 and 6 programs (``_pair_and_split``).
- A rank that never sends gives the deadline error naming the rank and the phase (two nodes of one; two
  nodes of two, where the waits are the relay's forward and its node peer's receive).
- A dispatch's rows stored into a relay's slot counted 24 at a time (``TUNE["d_p2p_rows"]``; else as the puts'
  chunks) in the stores' runs of two nodes of one and of two.
- Senders and relays to another node either stage and put (``TUNE["p2p"]`` off, as over RDMA) or store into
  the peer's slot (on: every peer's buffer is mapped here, as NVSHMEM maps the peers of one host): two nodes
  of one, the slow peer and two nodes of two run both ways (the stores' runs with fewer cases), and each
  check asserts which ran (simulated puts, or none). A direct row written to the wrong slot failed the
  three store runs.
- Every run: no simulated put was overtaken by a signal to its PE or left undelivered
  (``cpu_internode.check_delivery``). The simulation is as weak as NVSHMEM (``kernels/nvshmem_sim.py``),
  so a kernel that signals before its puts are fenced fails here: without the sender's fence between a
  block's puts and its count the relay reads poisoned rows, without the relay's the final sum is NaN.

NVSHMEM itself is tier 3's (``tests/gpu/test_internode_nvshmem.py``). Shapes are tiny: the interpreter
runs every program in Python. All checks of a world size (2, 4) run in one launch, one test each.
"""
import importlib.util
import os
import uuid

import harness
import pytest

# (not importorskip: the ranks must set TRITON_INTERPRET before anything imports Triton)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the interpreter)")


def _ht(ctx, gpus_per_node, full=True):
    import torch

    from epcomm import Buffer
    from epcomm.testing import cpu_internode
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.inputs import Case

    r = ctx.world_size
    ref = Buffer(ctx.group)
    fast = cpu_internode.internode_buffer(ctx.group, num_nvl_bytes=32 << 20)
    assert fast.backend_name == "internode" and fast._backend.ranks_per_node == gpus_per_node
    cases = [Case(num_ranks=r, tokens=tuple(5 + 3 * i for i in range(r)), hidden=128, num_topk=4,
                  num_experts=4 * r, seed=1),
             Case(num_ranks=r, tokens=tuple(0 if i == 0 else 7 for i in range(r)), hidden=256, num_topk=2,
                  num_experts=2 * r, hot_expert=1, seed=2)]
    from epcomm import Config
    # the Buffer's default config first (20 SMs: 10 channels, mostly of a token or none), then 4 SMs (two
    # channels; every program runs in Python here, and a call costs in proportion), RDMA chunks of 5 and 4
    four = (Config(4, 6, 256, 5, 128), Config(4, 6, 256, 4, 128))
    checks = [(cases[0], False, 0, None), (cases[0], True, 0, four)]  # (case, FP8, num_worst_tokens, configs)
    if full:
        checks += [(cases[0], False, sum(cases[0].tokens) + 3, four), (cases[1], False, 0, four)]
    sent = []
    for case, fp8, worst, cfgs in checks:
        G.check_ht_case(ref, fast, case, ctx.rank, fp8, worst=worst, with_bias=not fp8 and not worst, configs=cfgs)
        # the hierarchy: one message per (token, destination node)
        npos = fast._backend._ht.last_npos
        _, per_node, _, in_rank, _ = fast.get_dispatch_layout(G.device_inputs(case, ctx.rank, "cpu")[2],
                                                              case.num_experts)
        # (one node: the layout has no per-node count; every token that goes anywhere goes to it once)
        per_node = per_node.tolist() if per_node is not None else [int(in_rank.any(1).sum())]
        sent.append(((npos >= 0).sum(0).tolist(), per_node, int(in_rank.sum())))
    # Config's RDMA chunk (rows per put across nodes; dispatch and combine apart) and num_sms (programs
    # per launch): one row a put, and chunks that split the rows unevenly. The second runs 33+ tokens a
    # rank in one channel (2 programs: one sender, one forwarder and receiver): blocks of TUNE's 16 rows,
    # each sent in chunks of 3 counted from the channel's first row, the chunk a block leaves partial (16,
    # 32: not multiples of 3) sent with the next block's
    from epcomm.backends.internode_ht import TUNE
    assert TUNE["dispatch_rb"] == TUNE["combine_rb"] == 16  # (what the sizes below assume)
    # (fresh seeds: rows a kernel failed to write would otherwise still hold an earlier call's equal rows)
    import dataclasses
    for it, (sms, d_chunk, c_chunk) in enumerate(((4, 1, 1), (2, 3, 2))):
        cfgs = (Config(sms, 6, 256, d_chunk, 128), Config(sms, 6, 256, c_chunk, 128))
        big = dataclasses.replace(cases[0], tokens=tuple(33 + 5 * i for i in range(r))) if it else cases[0]
        G.check_ht_case(ref, fast, dataclasses.replace(big, seed=20 + it), ctx.rank, False, with_bias=True,
                        configs=cfgs)
        if full and (r == 2 or not it):  # (four ranks: the looping case in BF16 only, for time)
            G.check_ht_case(ref, fast, dataclasses.replace(big, seed=30 + it), ctx.rank, True,
                            worst=sum(big.tokens) + 3, configs=cfgs)
    if not full:
        cpu_internode.check_delivery()
        return _check_sent(ctx, sent)
    # combines in a row on one handle (the combine areas alternate by the device's count of combines): each
    # call its own expert outputs, each against the reference's combine of them (a combine that read an
    # earlier call's area would return that call's sums)
    case = cases[0]
    xin, x, topk, w = G.device_inputs(case, ctx.rank, "cpu")
    res = G._dispatch(fast, xin, topk, w, case.num_experts, config=four[0])
    rref = G._dispatch(ref, xin, topk, w, case.num_experts, config=four[0])
    for k in range(3):
        y = (res[0].float() * (1 + k) - k / 4).to(torch.bfloat16)
        out = fast.combine(y, res[4], topk_weights=res[2], config=four[1])[0]
        G._combine_check(out, ref.combine(y, rref[4], topk_weights=rref[2])[0], ref, y, rref[4],
                         f"combine {k} of 3 in a row, rank {ctx.rank}")
    # every consumer freed its slots once per call: at each producer, the free words of its consumers
    # (internode_ht.ctr_words) count every dispatch and every combine so far
    _check_free_words(fast, ctx.rank)
    # high_throughput_bytes is what these calls needed (the largest BF16 case, big), to the byte; far less
    # is a ValueError naming the size
    from epcomm.backends.internode_ht import high_throughput_bytes
    need = max(high_throughput_bytes(max(c.tokens), c.hidden, c.num_topk, r, gpus_per_node, round_mib=False)
               for c in {c for c, _, _, _ in checks} | {big})
    assert fast._backend._ht.peak_bytes == need, (fast._backend._ht.peak_bytes, need)
    small = cpu_internode.internode_buffer(ctx.group, num_nvl_bytes=64 << 10)
    try:
        G._dispatch(small, xin, topk, w, case.num_experts)
    except ValueError as e:
        assert "num_nvl_bytes=65536 is too small" in str(e), e
    else:
        raise AssertionError("a 64 KiB buffer took the dispatch")
    # num_tokens_per_rank that disagrees with is_token_in_rank on rank 1 only: found in the layout
    # exchange, so both ranks raise (none is left waiting for the other's rows)
    per_rank, _, per_expert, in_rank, _ = fast.get_dispatch_layout(topk, case.num_experts)
    if ctx.rank == 1:
        per_rank = per_rank + 1
    try:
        fast.dispatch(xin, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                      num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, config=four[0])
    except ValueError as e:
        assert "does not match is_token_in_rank" in str(e) and ("(on rank 1)" in str(e)) == (ctx.rank != 1), e
    else:
        raise AssertionError("a wrong num_tokens_per_rank was accepted")
    # with num_worst_tokens nothing comes back to the host (capturable): the exchange kernel checks the
    # counts on the device, and the call raises once it sees the error word's host mirror (on a GPU: that
    # call or the next), on both ranks, naming rank 1
    try:
        fast.dispatch(xin, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                      topk_idx=topk, topk_weights=w, num_worst_tokens=sum(case.tokens), config=four[0])
        G._dispatch(fast, xin, topk, w, case.num_experts, config=four[0])
    except ValueError as e:
        assert "num_tokens_per_rank on rank 1 says" in str(e) and "found on the device" in str(e), e
    else:
        raise AssertionError("a wrong num_tokens_per_rank was accepted with num_worst_tokens")
    _layout_of_other_ids(ctx, cpu_internode, ref, case, four, xin, topk, w)
    # too few num_worst_tokens: error 9 on the rank that receives more, at its next call
    few = cpu_internode.internode_buffer(ctx.group, num_nvl_bytes=32 << 20)
    try:
        G._dispatch(few, xin, topk, w, case.num_experts, num_worst_tokens=2, config=four[0])
        G._dispatch(few, xin, topk, w, case.num_experts, config=four[0])
    except RuntimeError as e:
        assert "num_worst_tokens=2 but" in str(e), e
    else:
        raise AssertionError("num_worst_tokens=2 was accepted")
    cpu_internode.check_delivery()
    return _check_sent(ctx, sent)


def _layout_of_other_ids(ctx, cpu_internode, ref, case, four, xin, topk, w):
    """Rank 1 passes the layout of other ids (its ids moved to its own experts): the handle kernel finds the lowest
    token whose is_token_in_rank row is not the ids' ranks (error 12), read at the call's synchronisation; the call
    completes on every rank (so the buffer stays in step), then raises on rank 1."""
    import torch

    from epcomm import layout
    from epcomm.testing import gpu_cases as G

    odd = cpu_internode.internode_buffer(ctx.group, num_nvl_bytes=32 << 20)
    e = case.num_experts
    lx = e // ctx.world_size
    other = torch.where(topk >= 0, topk % lx + lx * ctx.rank, topk) if ctx.rank == 1 else topk
    per_rank, _, per_expert, in_rank, _ = odd.get_dispatch_layout(other, e)
    diff = (layout.dispatch_layout(topk, e, ctx.world_size)[2] != in_rank).nonzero().tolist()
    try:
        odd.dispatch(xin, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                     topk_idx=topk, topk_weights=w, config=four[0])
        got = "none"
    except ValueError as err:
        got = str(err)
    if ctx.rank == 1:
        assert diff, "rank 1's ids all had their experts on rank 1: the case checks nothing"
        assert got == (f"is_token_in_rank does not match topk_idx at token {diff[0][0]}, rank {diff[0][1]}: pass the "
                       "layout get_dispatch_layout made from this topk_idx"), (got, diff)
    else:
        assert got == "none", got
    G.check_ht_case(ref, odd, case, ctx.rank, False, configs=four)  # still in step


def _check_sent(ctx, sent):
    """One message per (token, destination node); at two nodes of two, some token went to two ranks of one
    node (summed over the ranks: else the case would not show the hierarchy)."""
    import torch
    import torch.distributed as dist

    fewer = 0
    for per_node_sent, per_node_layout, pairs in sent:
        assert per_node_sent == per_node_layout, sent
        fewer += sum(per_node_sent) < pairs
    if int(os.environ["EPCOMM_GPUS_PER_NODE"]) > 1:
        total = torch.tensor([fewer])
        dist.all_reduce(total, group=ctx.group)
        assert int(total) > 0, "no token went to two ranks of one node: the case does not show the hierarchy"


def _check_free_words(buf, rank):
    """The free words at this rank (``kernels/internode_ht.py``): each of its consumers raised its own once
    per call (``F_RD[b]`` by relay node ``b``, ``F_NV[j]`` by receiver ``j``, ``F_CS[i]`` by relay ``i``,
    ``F_FN[a]`` by source node ``a``), so each equals the count of dispatches or combines."""
    import torch

    from epcomm.backends.nvlink_params import C_MAX
    from epcomm.kernels.internode_ht import ctr_words

    be, ht = buf._backend, buf._backend._ht
    r, n = be.num_ranks, be.ranks_per_node
    _, _, _, f_rd, f_nv, f_cs, f_fn, total = ctr_words(r, n, C_MAX)
    words = be.symm[ht.ctr_off:ht.ctr_off + 8 * total].view(torch.int64)
    dc, cc = int(ht.state[1]), int(ht.state[2])
    b, i = rank // n, rank % n
    got = {"F_RD": [int(words[f_rd + x]) for x in range(r // n) if x != b],
           "F_NV": [int(words[f_nv + x]) for x in range(n) if x != i],
           "F_CS": [int(words[f_cs + x]) for x in range(n) if x != i],
           "F_FN": [int(words[f_fn + x]) for x in range(r // n) if x != b]}
    want = {k: [dc if k in ("F_RD", "F_NV") else cc] * len(v) for k, v in got.items()}
    assert dc > 0 and cc > 0 and got == want, (rank, dc, cc, got)


def _tuned(tune, fn):
    """``fn()`` with the entries ``tune`` in ``TUNE`` (restored after it); with ``p2p`` off it made simulated
    NVSHMEM puts (staging and puts to the other nodes), on none (every peer is mapped here: stores)."""
    from epcomm.backends.internode_ht import TUNE
    from epcomm.kernels import nvshmem_sim

    old = dict(TUNE)
    TUNE.update(tune)
    before = nvshmem_sim.stats["puts"]
    try:
        fn()
    finally:
        TUNE.update(old)
    puts = nvshmem_sim.stats["puts"] - before
    assert (puts > 0) == (not tune["p2p"]), f"{tune}: {puts} simulated puts"


def _slow_peer(ctx, gpus_per_node):
    """The last rank starts each of its dispatch and combine launches late (its host sleeps 0.5 s first,
    more than a whole call of the others takes here, ~0.2 s): the others' consumers reach every chunk
    before it is sent, so each must wait for its rows (one that read what its counter does not yet count
    would take the zeros or the earlier call's rows of the slot).
    Two nodes of one (the network's consumers: forwarder, final) or one node of two (the node's: receiver,
    relay): BF16 with bias and top-k, FP8 with num_worst_tokens, a cached dispatch, and a config of 2 SMs
    (one channel of several blocks and chunks)."""
    import time

    from epcomm import Buffer, Config
    from epcomm.testing import cpu_internode
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.inputs import Case

    r = ctx.world_size
    ref = Buffer(ctx.group)
    fast = cpu_internode.internode_buffer(ctx.group, num_nvl_bytes=32 << 20)
    if ctx.rank == r - 1:
        ht = fast._backend._ht_impl()
        for name in ("k_dispatch", "k_combine"):
            launch = getattr(ht, name)
            setattr(ht, name, lambda *a, _launch=launch, **kw: (time.sleep(0.5), _launch(*a, **kw)))
    case = Case(num_ranks=r, tokens=tuple(20 + 7 * i for i in range(r)), hidden=128, num_topk=4, num_experts=4 * r,
                seed=41)
    G.check_ht_case(ref, fast, case, ctx.rank, False, with_bias=True,
                    configs=(Config(4, 6, 256, 4, 128), Config(4, 6, 256, 1, 128)))
    cfgs = (Config(2, 6, 256, 3, 128), Config(2, 6, 256, 5, 128))
    G.check_ht_case(ref, fast, Case(**{**case.__dict__, "seed": 42}), ctx.rank, True, worst=sum(case.tokens),
                    configs=cfgs)
    cpu_internode.check_delivery()


def _pair_and_split(ctx, gpus_per_node):
    """Nodes of one rank: the paired combine (``kernels/internode_ht_pair.py``: every program copies half a
    channel's rows to the other nodes, then reduces half a channel of its own tokens) gives the bits of the
    split roles (relays and finals apart, as in more than ``internode_ht._PAIR_NODES`` nodes, made so here by
    setting that to 1; both sum the nodes' rows in node order), with top-k weights and two biases, each call
    on expert outputs of its own (a final that read a row before its count said would take an earlier call's),
    modes alternating on one handle (the counters of both stay in step), and against the reference within the
    budget. Combines of 4 programs (two channels: a unit each), 2 (a program's second unit waits on the
    first's half) and 6 (two programs idle); each call says which mode ran. A half cut one token later (the
    first token of the second half reduced with the first) failed here."""
    import torch

    from epcomm import Buffer, Config
    from epcomm.backends import internode_ht
    from epcomm.testing import cpu_internode
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.inputs import Case

    r = ctx.world_size
    ref = Buffer(ctx.group)
    fast = cpu_internode.internode_buffer(ctx.group, num_nvl_bytes=32 << 20)
    case = Case(num_ranks=r, tokens=tuple(37 + 8 * i for i in range(r)), hidden=128, num_topk=4, num_experts=4 * r,
                seed=51)
    xin, x, topk, w = G.device_inputs(case, ctx.rank, "cpu")
    four = Config(4, 6, 256, 3, 128)
    res = G._dispatch(fast, xin, topk, w, case.num_experts, config=four)
    rref = G._dispatch(ref, xin, topk, w, case.num_experts, config=four)
    gb = torch.Generator()
    gb.manual_seed(ctx.rank + 5)
    bias = tuple(torch.randn(x.shape, generator=gb).to(torch.bfloat16) for _ in range(2))
    nodes = internode_ht._PAIR_NODES
    try:
        for k, sms in enumerate((4, 2, 6)):
            y = (res[0].float() * (1 + k) - k / 3).to(torch.bfloat16)
            outs = []
            for pair in (1, 0, 1):
                internode_ht._PAIR_NODES = nodes if pair else 1  # (1: no number of nodes pairs)
                cfg = Config(sms, 6, 256, 2, 128)
                outs.append(fast.combine(y, res[4], topk_weights=res[2], bias=bias, config=cfg))
                assert fast._backend._ht.last_pair == pair, (pair, sms)
            for o, ow, _ in outs[1:]:
                assert torch.equal(o.view(torch.int16), outs[0][0].view(torch.int16)), (sms, ctx.rank)
                assert torch.equal(ow, outs[0][1]), f"combined weights, {sms} SMs, rank {ctx.rank}"
    finally:
        internode_ht._PAIR_NODES = nodes
    G._combine_check(outs[0][0], ref.combine(y, rref[4], topk_weights=rref[2], bias=bias)[0], ref, y, rref[4],
                     f"paired combine, rank {ctx.rank}", bias)
    cpu_internode.check_delivery()


def _absent_relay(ctx, gpus_per_node):
    """The last rank joins the layout exchange of a dispatch but never runs its kernels. Two nodes of one
    rank: rank 0's receive waits for its send (the gather reads what node 1's rank put, nothing is
    forwarded) and gives up. Two nodes of two (rank 3 absent): rank 1, its relay in node 0, waits for its
    send in the forward, and rank 2, its node's peer, waits for its forward in the gather; both give up
    naming rank 3 (rank 0, whose relays are ranks 0 and 1, may wait on rank 1 meanwhile)."""
    from epcomm.backends.base import PeerTimeoutError
    from epcomm.testing import cpu_internode
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.inputs import Case

    r, last = ctx.world_size, ctx.world_size - 1
    # (four processes share the cores: a present peer may be descheduled for longer than 1e3 polls)
    fast = cpu_internode.internode_buffer(ctx.group, spins=1e3 if r == 2 else 4e3, num_nvl_bytes=32 << 20)
    case = Case(num_ranks=r, tokens=(4,) * r, hidden=128, num_topk=2, num_experts=2 * r, seed=3)
    xin, x, topk, w = G.device_inputs(case, ctx.rank, "cpu")
    if ctx.rank == last:
        ht = fast._backend._ht_impl()
        ht._move = lambda *a, **k: (_ for _ in ()).throw(RuntimeError(f"rank {last} stops after the notify"))
        try:
            G._dispatch(fast, xin, topk, w, case.num_experts)
        except RuntimeError as e:
            assert str(e) == f"rank {last} stops after the notify", e
            return
        raise AssertionError("the absent rank's dispatch did not stop")
    try:
        G._dispatch(fast, xin, topk, w, case.num_experts)
    except PeerTimeoutError as e:
        if r == 2 or ctx.rank in (1, 2):
            assert f"rank {last}" in str(e) and "dispatch/receive-data" in str(e), (ctx.rank, str(e))
        else:  # rank 0 (whose relays are ranks 0 and 1) may wait on rank 1 meanwhile
            assert "dispatch/receive-data" in str(e), (ctx.rank, str(e))
        return
    assert r == 4 and ctx.rank == 0, f"rank {ctx.rank}: no error"


# Every check of a world size runs in one launch (a launch costs seconds of process start and imports), in
# this order, each with its own EPCOMM_GPUS_PER_NODE (read when a Buffer is built), and is reported as its
# own test; the deadline checks come last (the ranks leave them at different times). A failed check stops
# its rank: later ones report "not run".
# ``tune``: TUNE entries for the check. Every rank's buffer is mapped in every process here (as NVSHMEM maps
# the peers of one host), so with ``p2p`` on the senders and relays store into the other nodes' slots (no
# simulated put), off they stage and put as over RDMA (the path whose fences the weak simulation checks);
# ``_tuned`` asserts which one ran.
CHECKS = {
    2: [("two-virtual-nodes", _ht, 1, {"tune": {"p2p": False}}),  # one message per (token, rank)
        # the same rows by stores, counted 24 at a time (d_p2p_rows: Config's chunk at most 5 here)
        ("two-virtual-nodes[p2p]", _ht, 1, {"tune": {"p2p": True, "d_p2p_rows": 24}, "full": False}),
        ("one-node-of-two", _ht, 2, {}),     # no sender: forwarders store to the peer, receivers unpack
        ("slow-peer[two-nodes-of-one]", _slow_peer, 1, {"tune": {"p2p": False}}),
        ("slow-peer[two-nodes-of-one,p2p]", _slow_peer, 1, {"tune": {"p2p": True}}),
        ("slow-peer[one-node-of-two]", _slow_peer, 2, {}),
        ("pair-and-split[two-nodes-of-one]", _pair_and_split, 1, {"tune": {"p2p": False}}),
        ("pair-and-split[two-nodes-of-one,p2p]", _pair_and_split, 1, {"tune": {"p2p": True}}),
        ("deadline", _absent_relay, 1, {})],
    # four nodes of one: nothing forwarded, the relay's rows go as BF16, three remote nodes a rank
    4: [("four-nodes-of-one", _ht, 1, {"full": False, "tune": {"p2p": False}}),
        ("four-ranks-in-two-nodes", _ht, 2, {"tune": {"p2p": False}}),
        ("four-ranks-in-two-nodes[p2p]", _ht, 2, {"tune": {"p2p": True, "d_p2p_rows": 24}, "full": False}),
        ("pair-and-split[four-nodes-of-one]", _pair_and_split, 1, {"tune": {"p2p": True}}),
        ("deadline-two-nodes-of-two", _absent_relay, 2, {})],
}
TAG = uuid.uuid4().hex[:12]  # this session's shared-memory files


def _rank(ctx, tag):
    from epcomm.testing import cpu_nvlink

    cpu_nvlink.install(tag, ctx.rank, ctx.world_size, ctx.group)

    def one(fn, gpus_per_node, kw):
        def run(ctx):
            os.environ["EPCOMM_GPUS_PER_NODE"] = str(gpus_per_node)
            kw2 = dict(kw)
            tune = kw2.pop("tune", None)
            if tune is None:
                fn(ctx, gpus_per_node, **kw2)
            else:
                _tuned(tune, lambda: fn(ctx, gpus_per_node, **kw2))
        return run

    return harness.run_checks(ctx, [(name, one(*rest)) for name, *rest in CHECKS[ctx.world_size]], env={})


def start_early(items):  # (tests/conftest.py) this module's launches, in the background (tests/dist/background.py)
    harness.queue_gloo_once(dict.fromkeys((_rank, it.callspec.params["world"], TAG) for it in items), timeout_s=600)


stop_early = harness.stop_early


@pytest.mark.parametrize("world,name", [(w, n) for w, checks in CHECKS.items() for n, *_ in checks])
def test_internode_high_throughput_on_cpu_processes(world, name):
    harness.report(harness.launch_gloo_once(_rank, world, TAG, timeout_s=600), name)
