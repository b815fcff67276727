"""Tier 3: ``deep_ep.Buffer`` (what ``import deep_ep`` gives under ``EPCOMM_AS_DEEP_EP=1``) follows
DeepEP's device rule: on a plain gloo group, as vLLM builds its DeepEP Buffers (``group=cpu_group``),
it runs on the current CUDA device, picks the nvlink backend, and matches the reference backend on
the NCCL group for high-throughput and low-latency calls. ``epcomm.Buffer`` on the same group stays
on the CPU (its own rule: the device the group moves)."""
import os

import torch.distributed as dist

from epcomm import Buffer
from epcomm._deep_ep.buffer import Buffer as DeepEPBuffer
from epcomm.testing import gpu_cases as G
from epcomm.testing.inputs import Case
from epcomm.testing.launcher import parallel_launch

WORLD = int(os.environ.get("EPCOMM_TEST_WORLD", "2"))


def _rank(ctx):
    gloo = dist.new_group(backend="gloo")
    assert Buffer(gloo).device.type == "cpu"
    r = ctx.world_size
    ref = G.make_buffers(ctx.group, num_nvl_bytes=256 << 20)[0]
    buf = DeepEPBuffer(gloo, num_nvl_bytes=256 << 20)
    assert buf.device.type == "cuda" and buf.backend_name == "nvlink", (buf.device, buf.backend_name)
    case = Case(num_ranks=r, tokens=tuple(37 + 11 * i for i in range(r)), hidden=256, num_topk=4,
                num_experts=8 * r)
    out = [G.check_ht_case(ref, buf, case, ctx.rank, fp8) for fp8 in (False, True)]
    m, h, e = 16, 512, 8 * r
    hint = Buffer.get_low_latency_rdma_size_hint(m, h, r, e)
    lref = G.make_buffers(ctx.group, num_rdma_bytes=hint, low_latency_mode=True)[0]
    lbuf = DeepEPBuffer(gloo, num_rdma_bytes=hint, low_latency_mode=True)
    ll = Case(num_ranks=r, tokens=(m,) * r, hidden=h, num_topk=4, num_experts=e, seed=9)
    out.append(G.check_ll_case(lref, lbuf, ll, ctx.rank, m, use_fp8=True))
    out.append(G.check_ll_case(lref, lbuf, ll, ctx.rank, m, use_fp8=False, hook=True))
    return len(out)


def test_deep_ep_buffer_on_a_gloo_group_runs_on_cuda():
    assert parallel_launch(WORLD, _rank, backend="nccl", timeout_s=150) == [4] * WORLD
