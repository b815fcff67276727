"""Tier 2: on the nvlink backend a contiguous ``ElasticBuffer.combine`` with ``topk_weights`` builds no packed
rows: the transport (``_combine_impl_kernel``) reads ``x`` and the weights in place and stores each row as
``x | weights`` into its owner's area (``nvlink_v2.return_row_parts``), so no ``_combine_pack_kernel`` runs.
Only the rows other ranks own move: the reduction reads this rank's own in place from ``x`` and the weights
(with and without weights). Its results are bitwise those of the reference engine (``elastic_engine._combine_torch``: torch operations,
rows packed by ``elastic_layout.pack_rows``, through the same backend) and of the oracle
(``testing.elastic_cases``), with two biases, for contiguous and strided ``x``. Where the transport could not
move the rows as 16-byte vectors (``x`` 8 bytes off alignment, ``K = 3``) the pack runs as before, with the
same results. Two CPU ranks, kernels under the Triton interpreter, symmetric memory simulated.
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

LAYOUTS = ("contiguous", "strided", "unaligned")  # x as it is, 16-byte aligned columns of wider rows, 8 bytes off


def _run(ctx, tag):
    """``{(K, sync, layout): (pack launches, transport launches)}`` of a combine with weights and two biases,
    each checked bitwise against the reference engine and the oracle."""
    import torch

    from epcomm.testing import elastic_cases as C
    from epcomm.testing.torch_calls import HostCount

    OnBackend = _on_backend(ctx, tag, "nvlink")
    from epcomm.backends import nvlink_v2  # (after the interpreter is set up: kernels/common reads it at import)
    from epcomm.backends.elastic_kernels import combine_row_bytes
    got = {}
    for k in (8, 3):
        case = C.V2Case(num_ranks=ctx.world_size, tokens=(12, 16), hidden=128, num_topk=k, num_experts=16, seed=7,
                        masked=0.1)
        h = case.hidden
        buf = OnBackend(ctx.group, num_max_tokens_per_rank=case.m, hidden=h, num_topk=k)
        x, _, idx, w = C.inputs(case, ctx.rank)
        b = C.bias(case, ctx.rank, 2)
        want = C.expected_combine(case, ctx.rank, 2, True)
        for sync in (True, False):
            rx, ridx, rw, hd, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=case.num_experts,
                                               num_max_tokens_per_rank=case.m, do_cpu_sync=sync)
            y = C.combine_input(hd, ridx, rx.shape[0], h, rx.shape[0])
            wide = torch.full((y.shape[0], h + 24), float("nan"), dtype=torch.bfloat16)
            for layout, yy in zip(LAYOUTS, (y, wide[:, 8:8 + h], wide[:, 4:4 + h])):
                yy.copy_(y)
                for ww in (rw, None) if layout != "unaligned" else (rw,):
                    what = f"K={k} sync={sync} {layout} weights={ww is not None}"
                    # the call's area (areas of every row width share their bytes): this rank's own block
                    # filled with a byte no row has
                    area = nvlink_v2._Area(buf._backend, case.m, combine_row_bytes(h, k if ww is not None else 0))
                    area.area[ctx.rank].fill_(0xAB)
                    with HostCount(log=True) as c:
                        out, ow, _ = buf.combine(yy, hd, topk_weights=ww, bias=b)
                    names = [n[len("triton:"):] for n in c.kernels if n.startswith("triton:")]
                    own_moved = bool((area.area[ctx.rank] != 0xAB).any())
                    kern, buf._steps.kernels = buf._steps.kernels, None  # the reference engine, through the same transport
                    try:
                        ref, ref_w, _ = buf.combine(yy, hd, topk_weights=ww, bias=b)
                    finally:
                        buf._steps.kernels = kern
                    C._eq(f"{what}: combined x vs the reference engine", out, ref)
                    C._eq(f"{what}: combined x vs the oracle", out, want)
                    if ww is None:
                        assert ow is None and ref_w is None, what
                    else:
                        C._eq(f"{what}: weights back vs the reference engine", ow, ref_w)
                        C._eq(f"{what}: weights back vs the oracle", ow, w)
                    got[(k, sync, layout, ww is not None)] = (names.count("_combine_pack_kernel"),
                                                              names.count("_combine_impl_kernel"), own_moved)
    return got


TAG = uuid.uuid4().hex[:12]  # this session's shared-memory files


def start_early(items):  # (tests/conftest.py) this module's launch, in the background (tests/dist/background.py)
    harness.queue_gloo_once([(_run, 2, TAG)], timeout_s=300)


stop_early = harness.stop_early


def test_nvlink_contiguous_combine_with_weights_packs_nothing_and_is_bitwise_the_reference():
    res = harness.launch_gloo_once(_run, 2, TAG, timeout_s=300)
    if isinstance(res, BaseException):
        raise res
    for rank, got in enumerate(res):
        for (k, sync, layout, with_w), (packs, transports, own_moved) in got.items():
            in_place = (k % 4 == 0 or not with_w) and layout != "unaligned"
            assert transports == 1, (rank, k, sync, layout, with_w, transports)
            # read in place, this rank's own rows stay where they are (its block of its area is not written)
            assert own_moved != in_place, f"rank {rank} K={k} sync={sync} {layout} weights={with_w}: " \
                f"own rows moved: {own_moved}"
            assert packs == (0 if in_place else 1), f"rank {rank} K={k} sync={sync} {layout} weights={with_w}: {packs} packs"
        assert len(got) == 2 * 2 * (2 * len(LAYOUTS) - 1), sorted(got)
