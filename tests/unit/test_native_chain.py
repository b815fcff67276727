"""Tier 1: ``native.Chain`` (a call's outputs made and its kernels launched in one C++ call) and
``kernels/launch.Direct.step`` (a bound launch as a chain's step), without a GPU: a dry chain keeps each step's
grid and packed parameters of its last call (``Chain.last``) instead of launching. The GPU runs (tier 3, and
``epcomm bench``'s checked rows) launch the chains of the HT dispatch and of ``ElasticBuffer``'s ``recv_meta``."""
import struct
import types

import pytest
import torch

from epcomm import native as N
from epcomm.kernels.launch import Direct


def _p(src, size=8):
    return (*src, size)


def test_dry_chain_packs_every_kind_of_source():
    x = torch.arange(16, dtype=torch.int32)
    params = [_p(N.addr(0)), _p(N.addr(0, 16)), _p(N.out(1, 4)), _p(N.num(1), 4), _p(N.const(-3)), _p(N.addr(2)),
              _p(N.out(0))]
    steps = [(77, [_p(N.num(1), 4), _p(N.const(2), 4), _p(N.const(1), 4)], 128, 0, params),
             (78, [_p(N.const(9), 4)] * 3, 32, 0, [_p(N.out(0), 8)])]
    c = N.Chain(torch.device("cpu"), [((N.ROWS, 2), torch.int32), ((3,), torch.float32)], N.num(1), steps, 3,
                dry=True)
    for rows in (5, 0):
        outs = c(x, rows, None)
        assert [(tuple(o.shape), o.dtype) for o in outs] == [((rows, 2), torch.int32), ((3,), torch.float32)]
        got = c.last()
        o0, o1 = outs[0].data_ptr(), outs[1].data_ptr()
        assert got[0] == [rows, 2, 1, x.data_ptr(), x.data_ptr() + 16, o1 + 4, rows, 2 ** 64 - 3, 0, o0]
        assert got[1] == [9, 9, 9, o0]


def test_chain_checks_its_sources():
    dev = torch.device("cpu")
    step = (1, [_p(N.const(1), 4)] * 3, 32, 0, [_p(N.addr(2))])
    with pytest.raises(RuntimeError, match="call value 2 of 2"):
        N.Chain(dev, [((1,), torch.int32)], N.const(0), [step], 2, dry=True)
    step = (1, [_p(N.const(1), 4)] * 3, 32, 0, [_p(N.out(1))])
    with pytest.raises(RuntimeError, match="an output 1"):
        N.Chain(dev, [((1,), torch.int32)], N.const(0), [step], 2, dry=True)
    step = (1, [_p(N.const(1), 4)] * 3, 32, 0, [_p(N.num(0), 3)])
    with pytest.raises(RuntimeError, match="3 bytes"):
        N.Chain(dev, [((1,), torch.int32)], N.const(0), [step], 2, dry=True)
    c = N.Chain(dev, [((1,), torch.int32)], N.const(0), [(1, [_p(N.const(1), 4)] * 3, 32, 0, [])], 2, dry=True)
    with pytest.raises(RuntimeError, match="2 values, got 1"):
        c(None)


class _Bound:  # what Direct.step reads of a bound launch (kernels/launch._Bound)
    def __init__(self, types, tail=(), packed=(4, 1, 512), coop=False, pdl=False):
        self.types, self.tail, self.packed = types, tail, packed
        self.head = (coop, pdl, None, None, packed, None, None, None)
        self.launch, self.function = object(), 4242


class _Prepared:
    def __init__(self, b):
        self.b, self.fast = b, True


def _direct(template, holes, b):
    d = Direct.__new__(Direct)
    d.p, d.template, d.holes = _Prepared(b), tuple(template), tuple(holes)
    return d


def test_direct_step_follows_the_kernels_signature():
    t = torch.zeros(4, dtype=torch.int64)
    # (x ptr: hole, n i32: hole, scale fp32, flag constexpr, buf ptr: fixed tensor, none ptr, big i64, B constexpr)
    b = _Bound(("*i32", "i32", "fp32", "constexpr", "*fp32", "*i8", "i64", "constexpr"), tail=(64,))
    d = _direct((None, None, 0.5, True, t, None, -7), (0, 1), b)
    grid = (N.num(2), N.const(1), N.const(1))
    fn, g, block, smem, params = d.step(grid, (N.addr(0), N.num(1)))
    assert (fn, block, smem) == (4242, 128, 512)
    assert g == [(3, 2, 0, 4), (0, 0, 1, 4), (0, 0, 1, 4)]
    half = struct.unpack("<I", struct.pack("<f", 0.5))[0]
    assert params == [(1, 0, 0, 8), (3, 1, 0, 4), (0, 0, half, 4), (0, 0, t.data_ptr(), 8), (0, 0, 0, 8),
                      (0, 0, -7, 8), (0, 0, 0, 8), (0, 0, 0, 8)]  # the last two: the scratch pointers
    # and the packed step runs: the dry chain's parameters are those values
    c = N.Chain(torch.device("cpu"), [], N.const(0), [(fn, g, block, smem, params)], 3, dry=True)
    x = torch.ones(2)
    c(x, 11, 5)
    assert c.last() == [[5, 1, 1, x.data_ptr(), 11, half, t.data_ptr(), 0, 2 ** 64 - 7, 0, 0]]


@pytest.mark.parametrize("what", ["unbound", "cooperative", "pdl", "clusters", "unknown type", "holes"])
def test_direct_step_declines(what):
    b = _Bound(("*i32", "i32"), coop=what == "cooperative", pdl=what == "pdl",
               packed=(4, 2 if what == "clusters" else 1, 0))
    if what == "unknown type":
        b.types = ("*i32", "tensordesc<fp16[8]>")
    d = _direct((None, 3), (0,), b)
    if what == "unbound":
        d.p.fast = False
    holes = (N.addr(0), N.addr(1)) if what == "holes" else (N.addr(0),)
    assert d.step((N.const(1),) * 3, holes) is None


def test_merged_chain_feeds_the_dispatch_outputs_to_recv_meta():
    """``elastic_kernels.Kernels.merged``: recv_meta's launch joined to the dispatch's chain reads the dispatch's
    outputs (rank_prefix_matrix, recv_src_idx, send_head), its fixed received ids, the call's topk_idx and cum; a
    tail (an expanded dispatch's scatter) after both reads the dispatch's rows, recv_meta's output by name (at an
    offset) and makes outputs of its own, after theirs."""
    from epcomm.backends.elastic_kernels import Kernels

    i32 = torch.int32
    keep_k = torch.zeros(8, 2, dtype=torch.int64)
    ht_specs = [((2, 2), i32), ((4, 2), i32), ((N.ROWS, 16), torch.bfloat16), ((N.ROWS,), i32)]
    srcs = dict(rpm=N.out(0), send_head=N.out(1), src=N.out(3), out_k=N.const(keep_k.data_ptr()), x=N.out(2))
    ht_step = (11, [_p(N.num(7), 4), _p(N.const(1), 4), _p(N.const(1), 4)], 64, 0,
               [_p(N.addr(0)), _p(N.addr(2)), _p(N.out(2)), _p(N.out(3))])
    calls = []

    def result(made, is_in):
        calls.append(("result", len(made), is_in))
        return made

    ht_native = (lambda: (ht_specs, [0, 1, 3], [ht_step], srcs), lambda: 5, result, 8,
                 types.SimpleNamespace(chain_stream=lambda: (N.no_stream, None)))
    m_specs = [((3,), i32), ((8, 4), i32)]
    m_params = [_p(N.addr(j)) for j in range(6)] + [_p(N.out(0)), _p(N.out(1), 4), _p(N.const(9))]
    m_step = (12, [_p(N.const(3), 4)] * 3, 128, 0, m_params)
    meta_chain = (None, torch.zeros(4, dtype=i32), (m_specs, [0, 1], [m_step], lambda made: made,
                                                    {"counts": 0, "meta": 1}))
    x, topk = torch.ones(8, 16, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int64)
    cum = torch.zeros(3, dtype=i32)
    t_specs = [((5, 3), torch.float32)]

    def tail(srcs_, meta_out, own):  # (the dispatch's rows, recv_meta's "meta" 8 bytes on, its own output)
        return t_specs, [], (13, [_p(N.const(2), 4)] * 3, 32, 0,
                             [_p(srcs_["x"]), _p(meta_out("meta", 8)), _p(own(0))])

    for with_tail in (False, True):
        calls.clear()
        go = Kernels.merged(ht_native, meta_chain, dry=True, tail=tail if with_tail else None)
        res, rm, made = go(x, None, topk, torch.ones(4, 2), cum)
        assert len(res) == 4 and len(rm) == 2 and calls == [("result", 4, None)]
        assert tuple(res[2].shape) == (8, 16)  # the rows: num_worst_tokens
        ht_got, m_got, *t_got = go.chain.last()
        assert ht_got == [5, 1, 1, x.data_ptr(), topk.data_ptr(), res[2].data_ptr(), res[3].data_ptr()]
        assert m_got == [3, 3, 3, res[0].data_ptr(), res[3].data_ptr(), keep_k.data_ptr(), res[1].data_ptr(),
                         topk.data_ptr(), cum.data_ptr(), rm[0].data_ptr(), rm[1].data_ptr(), 9]
        if not with_tail:
            assert made == () and t_got == []
            continue
        assert len(made) == 1 and tuple(made[0].shape) == (5, 3) and made[0].dtype == torch.float32
        assert t_got == [[2, 2, 2, res[2].data_ptr(), rm[1].data_ptr() + 8, made[0].data_ptr()]]
    assert Kernels.merged(ht_native, meta_chain, dry=True, tail=lambda *a: None) is None  # (a tail that cannot be)


@pytest.mark.parametrize("api, kind, launches, args", [
    ("v2", "dc", 3, 0), ("ht", "worst", 2, 0), ("ht", "worst fp8", 2, 0), ("ht", "combine", 1, 0), ("ht", "cached", 1, 0),
    ("v2", "cached c", 2, 11),  # (V2's cached dispatch: the backend's gather a chain, its copy epilogue not)
    ("ht", "layout", 1, 0), ("ht", "dispatch", 2, 0)])  # (synchronised: two chains around the host's read)
def test_the_probe_rig_runs_the_chains(monkeypatch, own_group, api, kind, launches, args):
    """On the host probe's CPU rig with the extension (``EPCOMM_NATIVE=all``; chains dry there) a repeat of a
    call a chain serves hands Triton's launcher nothing (``args`` 0: every launch went through the chain; but
    V2's cached dispatch's copy epilogue) and makes two allocations (the received rows and one block of the
    small outputs; FP8: its scales too; a combine: its rows and its weights; a synchronised dispatch: the
    handle's block too; the layout: one block); with ``EPCOMM_NATIVE=0`` its launches go through Triton's
    launcher again."""
    from epcomm.bench import hostprobe

    monkeypatch.setenv("EPCOMM_NATIVE", "all")
    real = hostprobe.install
    monkeypatch.setattr(hostprobe, "install", lambda: real(monkeypatch.setattr, monkeypatch.setitem))
    got = hostprobe.probe("python", tokens=(64,), calls=3, api=api)["T=64"][kind]
    allocs = {"worst fp8": 3, "cached": 1, "layout": 1, "dispatch": 3}.get(kind, 2)
    assert (got["launches"], got["args"], got["allocs"]) == (launches, args, allocs), got
    monkeypatch.setenv("EPCOMM_NATIVE", "0")
    got = hostprobe.probe("python", tokens=(64,), calls=3, api=api)["T=64"][kind]
    assert got["launches"] == launches and got["args"] > args, got


@pytest.mark.parametrize("kind", ["dispatch", "combine"])
@pytest.mark.parametrize("hook", [False, True])
def test_the_probe_rig_runs_low_latency_chains(monkeypatch, own_group, kind, hook):
    """With the native path (``EPCOMM_NATIVE=all`` here) an LL repeat's launch is one chain call: Triton's
    launcher gets no argument (nothing allocated, as always for LL: its outputs persist); with the hook, the
    send and ``hook()``'s receive are a chain each; with ``EPCOMM_NATIVE=0`` the launches parse their
    arguments again."""
    from epcomm.bench import hostprobe

    monkeypatch.setenv("EPCOMM_NATIVE", "all")
    real = hostprobe.install
    monkeypatch.setattr(hostprobe, "install", lambda: real(monkeypatch.setattr, monkeypatch.setitem))
    kind += "+hook" if hook else ""
    got = hostprobe.probe("python", tokens=(64,), calls=3, api="ll", hook=hook)["T=64"][kind]
    launches = 2 if hook else 1
    assert (got["launches"], got["args"], got["allocs"]) == (launches, 0, 0), got
    monkeypatch.setenv("EPCOMM_NATIVE", "0")
    got = hostprobe.probe("python", tokens=(64,), calls=3, api="ll", hook=hook)["T=64"][kind]
    assert got["launches"] == launches and got["args"] > 0, got


@pytest.mark.parametrize("kind, launches, allocs", [
    ("combine c", 3, 2),  # the transport's two launches and the reduction
    ("dx", 5, 4),  # the exchange and gather, recv_meta's two launches, the scatter
    ("combine x", 4, 3)])  # the pack, the transport's two launches, the reduction
def test_the_probe_rig_runs_the_v2_chains(monkeypatch, own_group, kind, launches, allocs):
    """With the native path (``EPCOMM_NATIVE=all`` here) an ``ElasticBuffer`` call's repeat is one chain call:
    Triton's launcher gets no argument and ``allocs`` allocations are made (a contiguous combine: the combined
    rows and the weights; an expanded no-sync dispatch: the received rows, one block of the small outputs,
    recv_meta's block, the expanded rows' block; an expanded combine: the packed rows, the combined rows and
    the weights); with ``EPCOMM_NATIVE=0`` the launches parse their arguments again."""
    from epcomm.bench import hostprobe

    monkeypatch.setenv("EPCOMM_NATIVE", "all")
    real = hostprobe.install
    monkeypatch.setattr(hostprobe, "install", lambda: real(monkeypatch.setattr, monkeypatch.setitem))
    got = hostprobe.probe("python", tokens=(64,), calls=3, api="v2")["T=64"][kind]
    assert (got["launches"], got["args"], got["allocs"]) == (launches, 0, allocs), got
    monkeypatch.setenv("EPCOMM_NATIVE", "0")
    got = hostprobe.probe("python", tokens=(64,), calls=3, api="v2")["T=64"][kind]
    assert got["launches"] == launches and got["args"] > 0, got
