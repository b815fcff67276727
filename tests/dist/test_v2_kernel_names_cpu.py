"""Tier 2: the kernels each ``ElasticBuffer`` call launches carry the names DeepEP V2's timing looks for.

DeepEP V2's ``tests/elastic/test_ep.py`` times dispatches with ``bench_kineto(..., kernel_names=('dispatch_impl',
'dispatch_copy_epilogue_impl'))`` and combines with ``('combine_impl', 'combine_reduce_epilogue_impl')``: a
name that matches no kernel divides by zero, one that matches two different kernels fails its assertion. So
every call kind must launch exactly one kernel whose name contains each substring (docs/v2.md, "Kernel
names"). Counted here by name (``testing.torch_calls.HostCount``, the Triton launches under the interpreter)
on the nvlink backend (two CPU ranks) and the internode backend (two nodes of one rank), the whole call,
the backend's own kernels included.
"""
import importlib.util
import os
import sys
import uuid

import harness
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_elastic_backends_cpu import _on_backend  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the interpreter)")

DISPATCH = ("dispatch_impl", "dispatch_copy_epilogue_impl")
COMBINE = ("combine_impl", "combine_reduce_epilogue_impl")


def _names(ctx, tag, backend, gpus_per_node):
    """``{call kind: [Triton kernel names launched, in order]}``, each kind counted on its second call."""
    import torch

    from epcomm.testing import elastic_cases as C
    from epcomm.testing.torch_calls import HostCount

    OnBackend = _on_backend(ctx, tag, backend, gpus_per_node)
    # (few tokens: which kernels a call launches does not depend on T, 3 and 5 launch what 12 and 16 did, and
    # every program of every launch runs in Python here)
    case = C.V2Case(num_ranks=ctx.world_size, tokens=(3, 5), hidden=128, num_topk=3, num_experts=8, seed=7)
    got = {}

    def count(kind, fn, *a, **k):
        fn(*a, **k)
        with HostCount(log=True) as c:
            out = fn(*a, **k)
        got[kind] = [n[len("triton:"):] for n in c.kernels if n.startswith("triton:")]
        return out

    x, _, idx, w = C.inputs(case, ctx.rank)
    q, sf, _, _ = C.inputs(case, ctx.rank, "fp32")
    b = C.bias(case, ctx.rank, 2)
    kw = dict(topk_idx=idx, topk_weights=w, num_experts=case.num_experts, num_max_tokens_per_rank=case.m)
    for multi in (True, False):
        buf = OnBackend(ctx.group, num_max_tokens_per_rank=case.m, hidden=case.hidden, num_topk=case.num_topk,
                        allow_multiple_reduction=multi)
        for expand in (False, True):
            t = f"{'expanded' if expand else 'contiguous'}{'' if multi else ' single'}"
            for sync in (True, False):
                rx, _, rw, hd, _ = count(f"dispatch {t} sync={sync}", buf.dispatch, x, **kw, do_expand=expand,
                                         expert_alignment=4, do_cpu_sync=sync)
            if multi:
                count(f"dispatch {t} fp8", buf.dispatch, (q, sf), **kw, do_expand=expand, do_cpu_sync=False)
                count(f"cached {t} fp8", buf.dispatch, (q, sf), handle=hd, do_expand=expand)
            count(f"cached {t}", buf.dispatch, x, handle=hd, do_expand=expand)
            count(f"cached {t} weights", buf.dispatch, x, handle=hd, do_expand=expand, topk_weights=w,
                  do_zero_padding=expand)
            y = torch.zeros(rx.shape[0], case.hidden, dtype=torch.bfloat16)
            count(f"combine {t}", buf.combine, y, hd)
            count(f"combine {t} biases", buf.combine, y, hd, bias=b,
                  topk_weights=rw if multi or not expand else None)
    return got


def _hits(names, sub):
    return [n for n in names if sub in n]


TAG = uuid.uuid4().hex[:10]  # this session's shared-memory files (and the backend's first letters)


def _launch(backend: str, gpus_per_node: int) -> tuple:
    return _names, 2, TAG + backend[:2], backend, gpus_per_node


def start_early(items):  # (tests/conftest.py) this module's launches, in the background (tests/dist/background.py)
    harness.queue_gloo_once(dict.fromkeys(_launch(it.callspec.params["backend"], it.callspec.params["gpus_per_node"])
                                          for it in items), timeout_s=600)


stop_early = harness.stop_early


@pytest.mark.parametrize("backend,gpus_per_node", [("nvlink", 0), ("internode", 1)], ids=["nvlink", "internode"])
def test_every_elastic_call_launches_one_kernel_of_each_deepep_name(backend, gpus_per_node):
    res = harness.launch_gloo_once(*_launch(backend, gpus_per_node), timeout_s=600)
    if isinstance(res, BaseException):
        raise res
    for rank, got in enumerate(res):
        assert len(got) == 28, sorted(got)
        for kind, names in got.items():
            print(f"rank {rank} {kind:34s}", names)
            if kind.startswith("combine"):
                want = {"combine_impl": 1, "combine_reduce_epilogue_impl": 1}
                if "expanded single" in kind:  # one transport and one reduce a lane (docs/v2.md): K of each
                    want = {"combine_impl": 3, "combine_reduce_epilogue_impl": 3}
                if backend == "internode":  # the transport is the group's all_to_all_single (docs/v2.md)
                    want["combine_impl"] = 0
                assert len(set(n for s in COMBINE for n in _hits(names, s))) == len([s for s in COMBINE if want[s]])
            else:
                want = {s: 1 for s in DISPATCH}
            for sub, n in want.items():
                assert len(_hits(names, sub)) == n, (rank, kind, sub, names)
            assert not _hits(names, "combine_impl" if kind.startswith("dispatch") or kind.startswith("cached")
                             else "dispatch_impl"), (rank, kind, names)
