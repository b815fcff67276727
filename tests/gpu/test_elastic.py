"""Tier 3: ``ElasticBuffer`` (DeepEP V2's API) on CUDA: the backend the selection picks (nvlink on one node),
and the reference backend on the same group, against the oracles of ``epcomm.testing.elastic_cases``
(dispatch and combine bitwise, both layouts, BF16 / FP8 with fp32 or opaque int32 packs, CPU sync and
worst-case shapes, cached replays, zero padding, 0-2 biases, single and multiple reduction, weights back);
then a CUDA graph of a dispatch without CPU sync plus its combine, captured once and replayed on new
inputs, bitwise equal to the same calls made eagerly.

``EPCOMM_TEST_WORLD`` ranks (default 2); with fewer GPUs, ``EPCOMM_TEST_SHARE_GPU=1`` (the ranks join
through gloo for CUDA tensors and time-share the GPU)::

    EPCOMM_TEST_SHARE_GPU=1 python -m pytest -q tests/gpu/test_elastic.py
"""
import os
import sys

import pytest

from epcomm.testing.launcher import parallel_launch

WORLD = int(os.environ.get("EPCOMM_TEST_WORLD", "2"))


def _log(ctx, msg):
    print(f"[rank {ctx.rank}] {msg}", file=sys.stderr, flush=True)


def _case(r, seed=11):
    from epcomm.testing.elastic_cases import V2Case

    return V2Case(num_ranks=r, tokens=tuple(40 + 9 * i for i in range(r)), hidden=1024, num_topk=6,
                  num_experts=8 * r, masked=0.1, seed=seed)


def _rank_checks(ctx, backend):
    if backend:
        os.environ["EPCOMM_BACKEND"] = backend
    from epcomm import ElasticBuffer
    from epcomm.testing import elastic_cases as C

    case = _case(ctx.world_size)
    buf = ElasticBuffer(ctx.group, num_max_tokens_per_rank=case.m, hidden=case.hidden, num_topk=case.num_topk,
                        explicitly_destroy=True)
    assert buf.device.type == "cuda" and (backend is None or buf._backend.name == backend), buf._backend.name
    for sf_kind in ("bf16", "fp32", "ue8m0"):
        for expand in (False, True):
            for alignment, sync in ((1, True), (128, False)):
                C.check_dispatch(buf, case, ctx.rank, sf_kind, expand, alignment, sync)
    for expand in (False, True):
        for n_bias in (0, 1, 2):
            C.check_combine(buf, case, ctx.rank, expand, n_bias, 128 if expand else 1, n_bias == 1)
    name = buf._backend.name
    buf.destroy()
    single = ElasticBuffer(ctx.group, num_max_tokens_per_rank=case.m, hidden=case.hidden,
                           allow_multiple_reduction=False, explicitly_destroy=True)
    C.check_combine(single, case, ctx.rank, True, 2, 128, False)
    single.destroy()
    _log(ctx, f"ok {name}")
    return name


def _rank_graph(ctx):
    import torch

    from epcomm import ElasticBuffer
    from epcomm.testing import elastic_cases as C
    from epcomm.testing import gpu_cases as G

    case = _case(ctx.world_size)
    e, dev = case.num_experts, torch.device("cuda", torch.cuda.current_device())
    buf = ElasticBuffer(ctx.group, num_max_tokens_per_rank=case.m, hidden=case.hidden, num_topk=case.num_topk)
    x, _, idx, w = (None if t is None else t.to(dev) for t in C.inputs(case, ctx.rank))  # (no scales: BF16)
    sms = buf.get_theoretical_num_sms(e, case.num_topk)  # before the capture (cached after)

    def step():
        outs = []
        for expand in (False, True):
            rx, ridx, rw, hd, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=e, num_sms=sms,
                                               expert_alignment=128 if expand else 1, do_cpu_sync=False,
                                               do_expand=expand)
            if expand:
                y = rx  # every expert the identity: the combine sums each token's rows
            else:
                y = (rx.float() * (ridx >= 0).sum(1, keepdim=True)).to(torch.bfloat16)
            out, ow, _ = buf.combine(y, hd, topk_weights=rw)
            outs += [out, ow, hd.psum_num_recv_tokens_per_expert]
            if not expand:
                n_rows, rows, ids = hd.psum_num_recv_tokens_per_scaleup_rank[-1:], rx, ridx
        # no weights given: the backend moves zeros (the plan's own eagerly; a captured call makes its own)
        nx, nidx, nw, _, _ = buf.dispatch(x, topk_idx=idx, num_experts=e, num_sms=sms, do_cpu_sync=False)
        assert nw is None
        real = torch.arange(nx.shape[0], device=nx.device)[:, None] < n_rows  # (rows past them: padding)
        outs += [torch.where(real, nx, 0), torch.where(real, rows, 0), torch.where(real, nidx, 0),
                 torch.where(real, ids, 0)]
        return outs

    def same_rows(outs):  # the no-weights dispatch's rows and ids are the weighted one's
        assert torch.equal(outs[-4], outs[-3]) and torch.equal(outs[-2], outs[-1]), "no-weights rows differ"

    eager = [t.clone() for t in step()]
    same_rows(eager)
    graph, static = G.capture(step)
    for seed in (12, 13):
        graph.replay()
        torch.cuda.synchronize()
        same_rows(static)
        for i, (a, b) in enumerate(zip(static, eager)):
            assert torch.equal(a, b), f"replay output {i} differs from the eager call"
        nx, _, nidx, nw = (t if t is None else t.to(dev) for t in C.inputs(_case(ctx.world_size, seed), ctx.rank))
        x.copy_(nx)  # a new batch in the captured tensors (same token count)
        idx.copy_(nidx)
        w.copy_(nw)
        eager = [t.clone() for t in step()]
    _log(ctx, "ok graph")
    return True


@pytest.mark.parametrize("backend", [None, "reference"], ids=["selected", "reference"])
def test_elastic_buffer_on_cuda_against_the_oracle(backend):
    res = parallel_launch(WORLD, _rank_checks, backend, backend="nccl", timeout_s=300)
    assert len(set(res)) == 1, res


def test_elastic_buffer_graph_of_dispatch_and_combine_without_cpu_sync():
    assert all(parallel_launch(WORLD, _rank_graph, backend="nccl", timeout_s=300))
