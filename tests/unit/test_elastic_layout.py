"""Tier 1: the layout math of ``ElasticBuffer`` (``epcomm.elastic_layout``), worked examples written out by
hand, DeepEP's sizing figures, and the V2 additions to ``EventOverlap``; the V2 kernels against their torch
twins under the interpreter (``sims/sim_elastic.py``) and compiled for sm_90 (``sims/compile_elastic.py``);
the host counter the tier-2 host budget uses (``epcomm.testing.torch_calls``)."""

import os
import subprocess
import sys

import pytest
import torch

from epcomm import elastic_layout as EL
from epcomm.event import EventOverlap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_buffer_sizes_match_deepeps_figures():
    # EP8 on one node and EP16 as 2 x 8 nodes in hybrid mode, M = 4096, H = 7168, K = 8, BF16
    assert EL.buffer_bytes(8, 8, 4096, 7168, 8, False, 1, True) == 473_956_352
    assert EL.buffer_bytes(16, 8, 4096, 7168, 8, False, 2, True) == 1_218_445_312
    # an FP8-sized buffer is smaller than a BF16 dispatch needs (the pitfall ElasticBuffer sizes around)
    assert EL.buffer_bytes(8, 8, 4096, 7168, 8, True, 1, True) < 473_956_352
    assert EL.buffer_bytes(8, 8, 4096, 7168, 8, False, 1, True) % EL.ALIGNMENT == 0
    assert EL.worst_expanded_rows(8, 4096, 8, 32, 128) == 266_240
    assert EL.dispatch_token_bytes(7168, 8, False) == 14464 and EL.combine_token_bytes(7168, 8) == 14400


def test_expanded_layout_worked_example():
    lay = EL.expanded_layout(torch.tensor([[0, 1], [-1, 1]]), 2, 2, 4)
    assert lay.counts.tolist() == [1, 2]
    assert lay.psum_contiguous.tolist() == [2, 4]
    assert lay.psum_expanded.tolist() == [1, 4]
    assert lay.slots.tolist() == [[0, 2], [-1, 3]]
    assert lay.source.tolist() == [0, -1, 1, 3]
    # rows keep the contiguous order inside an expert; alignment 1 leaves no gaps
    lay = EL.expanded_layout(torch.tensor([[1, -1], [0, 1], [1, 0]]), 2, 1, 5)
    assert lay.slots.tolist() == [[2, -1], [0, 3], [4, 1]]
    assert lay.source.tolist() == [2, 5, 0, 3, 4]


def test_master_lane_is_the_highest_lane_of_its_rank():
    got = EL.master_lanes(torch.tensor([[0, 3, 1, -1], [2, 2 + 1, -1, 0]]), 2)
    assert got.tolist() == [[False, True, True, False], [False, True, False, True]]


def test_ordered_reduce_adds_the_bias_first_and_rounds_once():
    big = torch.tensor([[4096.0]]).bfloat16()
    lanes = [big, -big, torch.tensor([[2.0 ** -10]]).bfloat16()]
    bias = (torch.tensor([[2.0 ** -9 + 2.0 ** -14]]).bfloat16(),)
    out = EL.ordered_reduce(lambda j: lanes[j], 3, bias, (1, 1), "cpu")
    # float32 near 4096 keeps steps of 2**-11: the bias's 2**-14 is lost before -4096 cancels, so the sum is
    # 2**-9 + 2**-10; adding the bias after the lanes would keep it
    assert out.item() == 2.0 ** -9 + 2.0 ** -10
    after = (EL.ordered_reduce(lambda j: lanes[j], 3, (), (1, 1), "cpu").float() + bias[0].float()).bfloat16()
    assert after.item() == 2.0 ** -9 + 2.0 ** -10 + 2.0 ** -14
    assert EL.ordered_reduce(lambda j: lanes[j], 0, (), (1, 1), "cpu").item() == 0


def test_local_reduce_sums_a_rows_slots_in_lane_order():
    x = torch.tensor([[1.0], [2.0], [4.0], [8.0]]).bfloat16()
    got = EL.local_reduce(x, torch.tensor([[1, -1, 2], [-1, -1, -1]], dtype=torch.int32))
    assert got.flatten().tolist() == [6.0, 0.0]


def test_pack_rows_round_trips_bytes_of_any_dtype():
    x = torch.randn(3, 8).to(torch.float8_e4m3fn)
    sf = torch.randint(-2**31, 2**31 - 1, (3, 3), dtype=torch.int64).to(torch.int32)
    w = torch.rand(3, 2)
    buf = EL.pack_rows([x, sf, w])
    assert buf.shape == (3, 32) and buf.dtype == torch.uint8  # 8 + 12 + 8 bytes, padded to 16
    x2, sf2, w2 = EL.unpack_rows(buf, [(torch.float8_e4m3fn, 8), (torch.int32, 3), (torch.float32, 2)])
    assert torch.equal(x2.view(torch.uint8), x.view(torch.uint8)) and torch.equal(sf2, sf) and torch.equal(w2, w)


def test_theoretical_counts():
    assert EL.theoretical_num_qps(24, False, 17) == 9 and EL.theoretical_num_qps(4, True, 129) == 65
    assert EL.theoretical_num_qps(24, True, 65) == 65 and EL.theoretical_num_qps(24, False, 4) == 4  # capped
    assert EL.theoretical_num_sms(8, 256, 8, 132, True, 450.0) == 14
    assert EL.theoretical_num_sms(8, 256, 8, 132, False, 450.0) == 64
    assert EL.theoretical_num_sms(1, 256, 8, 132, True, 450.0) == 132
    assert abs(EL.expected_ranks_per_token(256, 8, 8) - 5.25) < 0.1


def test_event_overlap_hook_runs_once_after_the_wait_and_release_drops_the_event():
    calls = []
    ev = EventOverlap()
    ev.register_hook_after_wait(lambda: calls.append(1))
    try:
        ev.register_hook_after_wait(lambda: None)
        raise AssertionError("a second hook was accepted")
    except ValueError:
        pass
    with ev(release_handle=True):
        pass
    ev.current_stream_wait()
    assert calls == [1] and ev.event is None


SIMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sims")


def _run_script(name: str, compile_only: bool = False) -> None:
    """``sims/<name>`` in its own process; it prints ``plan N`` first, then one ``ok`` line a check passed."""
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    if compile_only:
        env.pop("TRITON_INTERPRET", None)  # Triton's compiler itself, for sm_90
    res = subprocess.run([sys.executable, os.path.join(SIMS, name)], env=env, cwd=ROOT, check=False,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    lines = res.stdout.splitlines()
    plans = [int(line.split()[1]) for line in lines if line.startswith("plan ")]
    oks = [line for line in lines if line.startswith("ok")]
    assert len(plans) == 1 and plans[0] > 0 and len(oks) == plans[0], res.stdout


def test_v2_kernels_match_their_torch_twins_under_the_interpreter():
    _run_script("sim_elastic.py")


def test_v2_kernels_compile_for_sm90():
    _run_script("compile_elastic.py", compile_only=True)


def test_host_count_sees_each_kind_of_work():
    """``testing.torch_calls.HostCount`` (the host budget of tests/dist/test_elastic_backends_cpu.py): an
    allocation, device work, a view, a host read and a paused part each land where they should."""
    pytest.importorskip("triton")
    from epcomm.testing.torch_calls import HostCount

    x = torch.zeros(4)
    with HostCount(log=True) as c:
        y = torch.arange(4) * 2  # 2 calls, 2 allocations, 2 launches
        y.view(2, 2).contiguous()  # 2 calls, no allocation, no launch
        bool(y.sum())  # 2 calls, an allocation, a launch, a host read
        with c.paused():
            x.add_(1).clone()
    assert (c.ops, c.allocs, c.launches, c.syncs) == (6, 3, 3, 1), (c.counts(), c.calls.names, c.kernels)
    assert c.calls.names == ["arange", "mul", "view", "contiguous", "sum", "__bool__"] and c.meta == 0
    assert c.kernels == ["arange", "mul", "sum"]
    with HostCount() as m:
        x.shape, x.dtype, x.data_ptr(), x.is_contiguous()  # noqa: B018  (metadata reads)
    assert (m.ops, m.meta, m.allocs, m.launches) == (4, 4, 0, 0), m.counts()
