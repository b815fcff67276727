"""Tier 1: the internode high-throughput path's host arithmetic (``backends/internode_ht.py``,
``kernels/internode_ht.py``): how a launch's programs are split between its roles, the counter region's
layout and the buffer size, the paired combine's pipeline depth, with the worked examples of their
docstrings."""
import itertools

from epcomm.backends.internode_ht import TUNE, _final_stages, high_throughput_bytes, roles
from epcomm.kernels.internode_ht import ctr_words


def test_roles_worked_examples():
    assert roles(24, [1, 1, 0]) == [(0, 12), (12, 12), (0, 0)]
    assert roles(2, [1, 1, 1]) == [(0, 1), (1, 1), (1, 1)]
    assert roles(24, [1, 2, 1]) == [(0, 6), (6, 12), (18, 6)]


def test_roles_every_role_runs_and_never_waits_on_a_later_program():
    """For every launch size and weights: each role with work gets programs, inside the launch; with
    enough programs the roles are disjoint and cover the launch; and a role's programs never come after
    a later role's (the interpreter runs a launch's programs in order, and a later role waits on an earlier
    one: a program may do both, in role order)."""
    for programs in range(1, 41):
        for weights in itertools.product([0, 1, 2, 3], repeat=3):
            if not any(weights):  # (the forwarders and the relays always have work)
                continue
            got = roles(programs, list(weights))
            live = [k for k, w in enumerate(weights) if w]
            assert all(got[k] == (0, 0) for k in range(3) if k not in live), (programs, weights, got)
            spans = [range(got[k][0], got[k][0] + got[k][1]) for k in live]
            assert all(len(s) >= 1 and s.start >= 0 and s.stop <= programs for s in spans), (programs, weights, got)
            for s, t in zip(spans, spans[1:]):
                assert s.stop - 1 <= t.start, (programs, weights, got)  # (at most the one program shared)
            if programs >= len(live):
                assert sorted(p for s in spans for p in s) == list(range(programs)), (programs, weights, got)


def test_counter_words_and_buffer_size():
    # D_RD[P][CM] at 0, then D_NV[R][CM], C_CS[P][N][CM], C_FN[P][CM], F_RD[P], F_NV[N], F_CS[N], F_FN[P]
    assert ctr_words(4, 2, 128) == (256, 768, 1280, 1536, 1538, 1540, 1542, 1544)
    assert ctr_words(2, 1, 4) == (8, 16, 24, 32, 34, 35, 36, 38)
    # DSv3 at 2 ranks in nodes of 1 (the docstring's example); rounded up to MiB unless asked not to
    assert high_throughput_bytes(4096, 7168, 8, 2, 1) == 452 << 20
    exact = high_throughput_bytes(4096, 7168, 8, 2, 1, round_mib=False)
    assert (451 << 20) < exact <= (452 << 20)


def test_paired_combine_pipeline_depth_fits_shared_memory():
    """``TUNE["c_stages"]`` where ``stages - 1`` steps of BF16 tiles (``combine_rb`` x ``final_block``: a row per
    node, ``P_POW2``, and each bias) fit the shared memory a kernel may plan for (``nvlink_params.SMEM_BUDGET``),
    else 1 (unpipelined). The sm_90 compile of the DSv3 combine needs 65536 bytes at 2 nodes, 512 columns, 3
    stages; 262144 (over the H100's 227 KiB: a launch that fails) with 2 biases at 1024 columns."""
    old = dict(TUNE)
    try:
        TUNE.update(c_stages=3, combine_rb=16)
        assert _final_stages(2, 512) == 3  # the docstring's example: 2 x 32 KiB
        assert _final_stages(2, 1024) == 3  # 128 KiB
        assert _final_stages(4, 512) == 3  # 2 nodes and 2 biases: 128 KiB
        assert _final_stages(4, 1024) == 1  # 256 KiB would not fit
        assert _final_stages(8, 1024) == 1  # 512 KiB
        TUNE.update(c_stages=1)
        assert _final_stages(2, 512) == 1
        TUNE.update(c_stages=0)  # (0 means unpipelined too)
        assert _final_stages(2, 512) == 1
    finally:
        TUNE.clear()
        TUNE.update(old)


def test_an_elastic_buffer_gets_a_region_for_a_full_call_at_its_shape():
    """An ElasticBuffer sizes its staging by DeepEP's V2 rules (one area of each kind); the internode region holds
    two parities of each. Measured on one H100 (2 ranks under MPS, two virtual nodes of one): an ElasticBuffer for
    M = 4096, H = 7168, K = 8 gave 241172480 bytes and its first BF16 dispatch refused with 'needs 473440384'.
    ``ht_region_bytes`` gives such a buffer at least that; a V1 Buffer's sizes stay the caller's."""
    from types import SimpleNamespace

    from epcomm.backends.internode import ht_region_bytes
    from epcomm.elastic_layout import staging_bytes

    given = staging_bytes(2, 4096, 7168, 8)
    assert given == 241172480
    v2 = SimpleNamespace(num_nvl_bytes=given, num_rdma_bytes=0, low_latency_mode=False, elastic_shape=(4096, 7168, 8))
    assert ht_region_bytes(v2, 2, 1) >= 473440384
    assert ht_region_bytes(v2, 2, 1) == high_throughput_bytes(4096, 7168, 8, 2, 1) == 452 << 20
    v1 = SimpleNamespace(num_nvl_bytes=1 << 30, num_rdma_bytes=1 << 20, low_latency_mode=False)
    assert ht_region_bytes(v1, 2, 1) == (1 << 30) + (1 << 20)
    ll = SimpleNamespace(num_nvl_bytes=1 << 30, num_rdma_bytes=1 << 20, low_latency_mode=True, elastic_shape=None)
    assert ht_region_bytes(ll, 2, 1) == 1 << 30
