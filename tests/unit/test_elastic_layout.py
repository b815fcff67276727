"""Tier 1: the layout math of ``ElasticBuffer`` (``epcomm.elastic_layout``), worked examples written out by
hand, DeepEP's sizing figures, and the V2 additions to ``EventOverlap``."""

import torch

from epcomm import elastic_layout as EL
from epcomm.event import EventOverlap


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


_SIM = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
from epcomm.testing import interp  # noqa: F401  (the interpreter's NumPy 2 fix)
import torch
from epcomm.kernels import v2
g = torch.Generator().manual_seed(0)
src = torch.randint(0, 256, (5, 40), generator=g, dtype=torch.uint8)   # N = 5 rows of 40 bytes (BLOCK 16: 3 steps)
source = torch.tensor([0, -1, 3, 9, -1, 4], dtype=torch.int64)          # K = 2: rows 0, pad, 1, 4, pad, 2
for zero in (False, True):
    out = torch.full((6, 40), 7, dtype=torch.uint8)
    v2._dispatch_copy_epilogue_impl_kernel[(2,)](src, source, out, 6, 2, ROW=40, ZERO=zero, BLOCK=16)
    for e, s in enumerate(source.tolist()):
        want = src[s // 2] if s >= 0 else torch.full((40,), 0 if zero else 7, dtype=torch.uint8)
        assert torch.equal(out[e], want), (zero, e, out[e], want)
# the combine's reduction: float32, biases first, lanes in order, unused lanes adding zero
R, M, K, H = 2, 3, 4, 40
got = (torch.randn(R * M, H + 8, generator=g) * 2.0 ** torch.randint(-8, 8, (R * M, 1), generator=g)).bfloat16()
use = torch.rand(M, K, generator=g) < 0.6
owner = torch.randint(0, R, (M, K), generator=g)
b = [torch.randn(M, H, generator=g).bfloat16() for _ in range(2)]
for nb in (0, 1, 2):
    out = torch.empty(M, H, dtype=torch.float32)
    v2._combine_reduce_epilogue_impl_kernel[(M, 3)](got, use.to(torch.int8), owner, b[0], b[1], out, M, K, H + 8, H,
                                                   NB=nb, OUT_F32=True, BLOCK=16)
    acc = b[0].float() + b[1].float() if nb == 2 else (b[0].float() if nb else torch.zeros(M, H))
    for j in range(K):
        rows = got[owner[:, j] * M + torch.arange(M), :H].float()
        acc = acc + torch.where(use[:, j:j + 1], rows, torch.zeros(()))
    assert torch.equal(out, acc), (nb, (out - acc).abs().max())
print("ok")
"""


def test_v2_epilogue_kernels_under_the_interpreter():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _SIM], check=False, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr
