"""Tier 1: the size hints of DeepEP V2's experimental calls (DeepEP's formulas, worked out by hand), the
pipeline's lanes and the launch shapes of their kernels, the argument checks that need no group, and the
pipeline schedule the tier-2 checks use (never a deadlock under credits)."""

import pytest
import torch

from epcomm import ElasticBuffer
from epcomm.backends.pp import PPConfig
from epcomm.elastic_extras import _shapes, agrs_session_bytes, engram_storage_size_hint, pp_buffer_size_hint
from epcomm.testing.extras_cases import pp_schedule

MIB = 1 << 20


def test_engram_hint():
    # DeepEP's test_engram defaults: 524288 entries of 128 BF16 (256-byte rows), 512 tokens x 24 entries
    assert engram_storage_size_hint(524288, 128, 512 * 24) == (4 * MIB, 128 * MIB)
    # FP8 rows of 100 bytes align to 128: 3 rows -> 384 bytes -> 2 MiB; 20000 entries -> 2.44 MiB -> 4 MiB
    assert engram_storage_size_hint(20000, 100, 3, torch.float8_e4m3fn) == (2 * MIB, 4 * MIB)
    assert ElasticBuffer.get_engram_storage_size_hint(1, 1, 1) == (2 * MIB, 2 * MIB)
    with pytest.raises(TypeError, match="dtype"):
        engram_storage_size_hint(1, 1, 1, "bf16")
    with pytest.raises(ValueError, match="hidden"):
        engram_storage_size_hint(1, -1, 1)


def test_pp_hint():
    # DeepEP's test_pp: 4096 x 7168 BF16, 4 in flight: 56 MiB x 4 x 2 neighbours x (send, recv) = 896 MiB
    assert pp_buffer_size_hint(4096 * 7168 * 2, 4) == 896 * MIB
    assert pp_buffer_size_hint(33, 1) == 2 * MIB  # 33 -> 64 bytes a slot
    assert ElasticBuffer.get_pp_buffer_size_hint(MIB + 1, 3) == align2((MIB + 32) * 12)
    with pytest.raises(TypeError, match="num_max_inflight_tensors"):
        pp_buffer_size_hint(64, 2.0)


def align2(n):
    return (n + 2 * MIB - 1) // (2 * MIB) * (2 * MIB)


def test_agrs_hints():
    class Group:
        def size(self):
            return 4

    # each tensor's R * bytes aligned to 32: (3, 5) BF16 = 30 bytes -> 120 -> 128
    assert agrs_session_bytes(4, [(3, 5), (3, 5)], torch.bfloat16) == 256
    assert ElasticBuffer.get_agrs_num_max_session_bytes(Group(), (3, 5), torch.bfloat16) == 128
    # DeepEP's test_agrs: 4 x (32, 64, 2048) BF16 at 4 ranks = 4 x 32 MiB
    shape = (32, 64, 2048)
    assert ElasticBuffer.get_agrs_num_max_session_bytes(Group(), [shape] * 4, torch.bfloat16) == 128 * MIB
    assert ElasticBuffer.get_agrs_buffer_size_hint(Group(), 128 * MIB + 1) == 130 * MIB
    assert _shapes("shapes", torch.Size([2, 3])) == ([(2, 3)], False)
    assert _shapes("shapes", [torch.Size([2]), (4,)]) == ([(2,), (4,)], True)
    for bad in ((), [(2, -1)], (2.0,), "x"):
        with pytest.raises(TypeError, match="shapes"):
            agrs_session_bytes(2, bad, torch.bfloat16)


def test_pp_lanes():
    four = PPConfig(num_ranks=4, rank=2, num_max_tensor_bytes=64, num_max_inflight_tensors=2)
    assert (four.prev, four.next) == (1, 3)
    assert four.lane(2, 1) == 0 and four.lane(2, 3) == 1  # what the previous / next rank sends
    assert four.lane(3, 2) == 0 and four.lane(1, 2) == 1  # where rank 2's sends land
    two = PPConfig(num_ranks=2, rank=0, num_max_tensor_bytes=64, num_max_inflight_tensors=2)
    assert two.lane(0, 1) == 0 and two.lane(1, 0) == 0  # one peer, both ways: one lane
    assert four.slot_bytes == 32 + 64
    with pytest.raises(ValueError, match="at least 2 ranks"):
        PPConfig(num_ranks=1, rank=0, num_max_tensor_bytes=64, num_max_inflight_tensors=2)


def test_kernel_shapes():
    triton = pytest.importorskip("triton")
    from epcomm.kernels import engram, pp

    assert engram.row_words(256) == (64, triton.language.int32)
    assert engram.row_words(130) == (65, triton.language.int16)
    assert engram.row_words(129)[0] == 129
    assert engram.block_shape(64) == (64, 32)
    assert engram.block_shape(3584) == (1024, 4)
    assert pp.word_type(1024, 0x100)[0] == 4 and pp.word_type(1024, 0x102)[0] == 2 and pp.word_type(7, 0)[0] == 1
    assert pp.programs(0, 132, 3584 * 4096, 2048) == 132
    assert pp.programs(0, 132, 100, 2048) == 1
    assert pp.programs(8, 132, 10 ** 6, 2048) == 8


@pytest.mark.parametrize("seed", range(20))
def test_pp_schedule_never_deadlocks(seed):
    """Replays a schedule with sends that block while ``inflight`` of their direction are unreceived: every rank
    steps through its ops in order; a step is possible when its receive has been sent or its send has a free
    slot. The schedule must finish."""
    ranks, inflight = 3 + seed % 2, 1 + seed % 3
    ops = pp_schedule(ranks, 60, inflight, seed)
    assert ops and all(ops[i][0] <= ops[i + 1][0] for i in range(len(ops) - 1))
    when = {(op, s, d, i): t for t, op, s, d, i in ops}
    for (op, s, d, i), t in when.items():  # the promise: fewer than inflight earlier tensors unreceived at a send
        if op == "send":
            assert when[("recv", s, d, i)] > t
            assert sum(when[("recv", s, d, j)] > t for j in range(i)) < inflight, (s, d, i)
    per = [[op for op in ops if (op[1] == "send" and op[2] == r) or (op[1] == "recv" and op[3] == r)]
           for r in range(ranks)]
    at = [0] * ranks
    sent, received = {}, {}
    while any(at[r] < len(per[r]) for r in range(ranks)):
        moved = False
        for r in range(ranks):
            if at[r] == len(per[r]):
                continue
            _, op, src, dst, i = per[r][at[r]]
            key = (src, dst)
            if op == "send" and sent.get(key, 0) - received.get(key, 0) < inflight:
                assert i == sent.get(key, 0)
                sent[key] = i + 1
            elif op == "recv" and sent.get(key, 0) > i:
                assert i == received.get(key, 0)
                received[key] = i + 1
            else:
                continue
            at[r] += 1
            moved = True
        assert moved, f"deadlock at {at}"


def test_extras_kernels_compile_for_sm90_and_move_vectors():
    """Every kernel of the three calls compiles for sm_90 in the variants the plans launch (the interpreter lets
    through what the compiler rejects: a plain global in a kernel, pointer casts), and the copies said to move
    16-byte vectors do (``sims/compile_extras.py``)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(root, "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    sims = os.path.join(root, "tests", "unit", "sims")
    res = subprocess.run([sys.executable, os.path.join(sims, "compile_extras.py")], env=env, cwd=sims,
                         capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    lines = res.stdout.splitlines()
    plans = [int(line.split()[1]) for line in lines if line.startswith("plan ")]
    assert len(plans) == 1 and plans[0] > 0 and sum(line.startswith("ok") for line in lines) == plans[0], res.stdout


CALLS = ("engram_write", "engram_fetch", "pp_set_config", "pp_send", "pp_recv", "agrs_set_config",
         "create_agrs_session", "destroy_agrs_session", "agrs_new_session", "agrs_get_inplace_tensor", "all_gather",
         "get_engram_storage_size_hint", "get_pp_buffer_size_hint", "get_agrs_num_max_session_bytes",
         "get_agrs_buffer_size_hint")


def test_the_calls_under_the_deep_ep_switch():
    """``deep_ep.ElasticBuffer`` (``EPCOMM_AS_DEEP_EP=1``) has every call DeepEP's four scripts use, and the static
    hints answer there as DeepEP's do (test_engram and test_pp call them on the class)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import _epcomm_as_deep_ep; _epcomm_as_deep_ep.install(); import deep_ep, torch\n"
            f"missing = [n for n in {CALLS!r} if not callable(getattr(deep_ep.ElasticBuffer, n, None))]\n"
            "assert not missing, missing\n"
            "print(deep_ep.ElasticBuffer.get_engram_storage_size_hint(524288, 128, 512 * 24, torch.float8_e4m3fn),"
            " deep_ep.ElasticBuffer.get_pp_buffer_size_hint(4096 * 7168 * 2, 4))\n")
    env = dict(os.environ, EPCOMM_AS_DEEP_EP="1", PYTHONPATH=os.path.join(root, "src"))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["(2097152,", "67108864)", str(896 * MIB)], res.stdout  # FP8 rows: 128 bytes


def test_nvshmem_heap_check_names_the_setting():
    """An internode plan's allocation that NVSHMEM's fixed heap cannot hold raises before it allocates, naming
    NVSHMEM_SYMMETRIC_SIZE and a size that would do; one that fits passes."""
    import types

    from epcomm.backends.extras import Symmetric

    be = types.SimpleNamespace(nvshmem_settings={"NVSHMEM_SYMMETRIC_SIZE": (str(1 << 30), "epcomm")},
                               symm=torch.empty(900 << 20, dtype=torch.uint8))
    Symmetric._check_heap(be, 100 << 20, "pp_set_config")
    with pytest.raises(RuntimeError, match=r"pp_set_config: NVSHMEM's symmetric heap .* NVSHMEM_SYMMETRIC_SIZE"):
        Symmetric._check_heap(be, 200 << 20, "pp_set_config")
    Symmetric._check_heap(types.SimpleNamespace(), 1 << 40, "x")  # (the CPU simulation: no heap)
