"""Tier 3: the internode backend with four ranks as two nodes of two (issue 28): the forwarding path.

With one rank a node (``test_internode_nvshmem.py``'s two ranks) nothing is forwarded: the HT gather
reads the node slots directly. Here ``EPCOMM_GPUS_PER_NODE=2`` makes ranks 0-1 and 2-3 two nodes, so a
token crosses to a node once (NVSHMEM put to the relay with the sender's local index there), is forwarded
by stores inside the node, and the combine reduces at the relay before it crosses back.

- ``test_internode_2x2_high_throughput``: HT dispatch and combine, BF16 and FP8 (bitwise, the handle
  identical to the reference's), cached dispatch, ``num_worst_tokens``, bias, a rank that sends nothing
  with a hot expert, two programs a launch with RDMA chunks of 1 and 3, async events; dispatch + combine with ``num_worst_tokens`` captured in a CUDA graph
  and replayed on new inputs; three combines alone, each in its graph, replayed in turn. Also four nodes
  of one rank (every peer over NVSHMEM, nothing forwarded), the eager checks only.
- ``test_internode_2x2_low_latency``: LL dispatch and combine (the node's peer by stores, the other node
  over NVSHMEM), BF16, FP8 plain and UE8M0, the receive hook, zero-copy, CUDA-graph replay, a stress loop.

Runs on four GPUs, or on one GPU shared by four processes under MPS: ``bash scripts/gpu_check.sh
shared-nvshmem 4`` (a private MPS daemon, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25`` per process;
NVSHMEM takes four processes a GPU at 25: passed so at 46f78a7, ~5 min per HT case and 4 min for LL). Tier 2 runs the
same paths in simulation (``tests/dist/test_internode_ht_cpu.py``, ``test_internode_ll_cpu.py``).
"""
import os

import pytest
import torch

from epcomm.testing.launcher import parallel_launch, share_gpu

WORLD = int(os.environ.get("EPCOMM_TEST_WORLD", "2"))
# four ranks for NVSHMEM: four GPUs, or one shared under MPS at <= 25 % of its threads per process
MPS_SHARE = 0 < int(os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "0") or 0) <= 25
FOUR = torch.cuda.device_count() >= 4 or (share_gpu(4) and MPS_SHARE)
pytestmark = pytest.mark.skipif(WORLD != 4 or not FOUR, reason="four ranks: four GPUs, or one under MPS at 25 % "
                                "(EPCOMM_TEST_WORLD=4; scripts/gpu_check.sh shared-nvshmem 4)")


def _available():
    from epcomm.kernels import nvshmem

    if not nvshmem.available():
        pytest.skip("torch's NVSHMEM Triton bindings are unavailable")


def _ht_rank(ctx, gpus_per_node, graphs):
    os.environ["EPCOMM_GPUS_PER_NODE"] = str(gpus_per_node)
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.inputs import Case

    r = ctx.world_size
    ref, fast = G.make_buffers(ctx.group, fast="internode", num_nvl_bytes=1 << 30)
    assert fast.backend_name == "internode" and fast._backend.ranks_per_node == gpus_per_node
    out = []
    big = Case(num_ranks=r, tokens=(512, 300, 128, 401), hidden=7168, num_topk=8, num_experts=64, seed=1)
    hot = Case(num_ranks=r, tokens=(0, 77, 130, 5), hidden=2048, num_topk=4, num_experts=16, seed=2, hot_expert=3)
    for case in (big, hot):
        for fp8 in (False, True):
            out.append(G.check_ht_case(ref, fast, case, ctx.rank, fp8, with_bias=not fp8))
        out.append(G.check_ht_case(ref, fast, case, ctx.rank, False, worst=sum(case.tokens)))
    # two programs a launch (one program forwards, then receives; one relays, then finals) and RDMA chunks
    # of 1 and 3 rows
    from epcomm import Config
    out.append(G.check_ht_case(ref, fast, hot, ctx.rank, False, with_bias=True,
                               configs=(Config(2, 6, 256, 1, 128), Config(2, 6, 256, 3, 128))))
    G.check_ht_async(ref, fast, hot, ctx.rank)
    if graphs:
        g = Case(num_ranks=r, tokens=(256, 200, 128, 180), hidden=7168, num_topk=8, num_experts=64, seed=3)
        G.check_ht_graph(ref, fast, g, ctx.rank, worst=sum(g.tokens), replays=10)
        G.check_ht_combine_graph(ref, fast, [Case(num_ranks=r, tokens=(300, 180, 64, 250), hidden=2048,
                                                  num_topk=8, num_experts=64, seed=4 + i) for i in range(3)],
                                 ctx.rank)
    return [c["remote_rows"] for c in out]


@pytest.mark.parametrize("gpus_per_node,graphs", [(2, True), (1, False)], ids=["2-nodes-of-2", "4-nodes-of-1"])
def test_internode_2x2_high_throughput(gpus_per_node, graphs):
    _available()
    res = parallel_launch(4, _ht_rank, gpus_per_node, graphs, backend="nccl", timeout_s=540)
    # every case moved rows between the ranks (each rank has tokens in the first case; in the second rank 0
    # has none of its own, so every row it receives is remote)
    assert all(len(r) == 7 and min(r) > 0 for r in res), res


def _ll_rank(ctx, m, hidden, experts, stress):
    os.environ["EPCOMM_GPUS_PER_NODE"] = "2"
    from epcomm import Buffer
    from epcomm.testing import gpu_cases as G
    from epcomm.testing.inputs import Case

    r = ctx.world_size
    hint = Buffer.get_low_latency_rdma_size_hint(m, hidden, r, experts)
    ref, fast = G.make_buffers(ctx.group, fast="internode", num_rdma_bytes=hint, low_latency_mode=True)
    assert fast.backend_name == "internode" and fast._backend.ranks_per_node == 2
    case = Case(num_ranks=r, tokens=tuple(max(1, m - 3 * i) for i in range(r)), hidden=hidden, num_topk=8,
                num_experts=experts, seed=11, hot_expert=5)
    out = []
    for kw in ({"use_fp8": False}, {"use_fp8": True}, {"use_fp8": True, "round_scale": True, "ue8m0": True},
               {"use_fp8": False, "hook": True}, {"use_fp8": True, "hook": True, "zero_copy": True}):
        out.append(G.check_ll_case(ref, fast, case, ctx.rank, m, **kw))
    G.check_ll_graph(ref, fast, case, ctx.rank, m, replays=20)
    stress = G.check_ll_stress(ref, fast, case, ctx.rank, m, iters=stress)
    return {"remote_rows": [c["remote_rows"] for c in out], "stress": stress}


@pytest.mark.parametrize("m,hidden,experts", [(128, 7168, 288)], ids=["dsv3"])
def test_internode_2x2_low_latency(m, hidden, experts):
    _available()
    res = parallel_launch(4, _ll_rank, m, hidden, experts, 50, backend="nccl", timeout_s=400)
    for r in res:  # every case and the stress loop moved rows between the ranks (not only a rank's own)
        assert len(r["remote_rows"]) == 5 and min(r["remote_rows"]) > 0, res
        assert r["stress"].checked == 2 and r["stress"].remote_rows > 0, res  # iterations 0 and 49 checked
