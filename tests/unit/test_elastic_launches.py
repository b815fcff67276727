"""Tier 1: the launches of ``ElasticBuffer``'s own kernels (``kernels/v2*.py``) in a DeepSeek-V3-shaped call on
the nvlink backend (2 ranks, 4096 tokens a rank, hidden 7168, top-8, 256 experts; no CPU sync, so ``N = R*M``
rows and the worst expanded rows), recorded from their launchers (``backends/elastic_kernels.py``,
``backends/nvlink_v2.py``) on meta tensors: which kernels spin-wait and how many programs they get, and how much
each program moves a step. On an H100 under MPS (2 ranks, 24 SMs) the combine transport moved one row of 512
words a step (2 KB in flight a program, each row behind a dependent load of its destination) and took
~5.8 ms of a combine that V1 does in ~450 µs; the expanded copy moved 1 KB a step in 8-byte pieces.

Also: the tiled kernels run under the interpreter with tiles small enough that every loop steps several
times (``sims/sim_elastic_tiles.py``), and compiled for sm_90 their rows move as 16-byte vectors
(``sims/vectors_elastic.py``)."""
import math
import os
import subprocess
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIMS = os.path.join(ROOT, "tests", "unit", "sims")
R, M, H, K, E = 2, 4096, 7168, 8, 256
LE = E // R
DEVICE_SMS = 132  # an H100
MIN_STEP_BYTES = 16 << 10  # V1's combine push: TUNE cpush_rb x cpush_block int32 words a step


def _record():
    """A ``Kernels`` whose launches are recorded as ``(name, grid, consts)``, not run."""
    pytest.importorskip("triton")
    from epcomm.backends.elastic_kernels import Kernels

    kern, seen = Kernels(), []
    kern.launch = lambda name, key, consts, grid, *args: seen.append((name, tuple(grid), dict(consts)))
    return kern, seen


def _fake_backend(kern, ptrs=(0x7F0000000000, 0x7E0000200000)):
    """What ``nvlink_v2.return_rows`` reads of the nvlink backend, sized as an ElasticBuffer sizes it for DSv3."""
    from epcomm import elastic_layout as EL

    nvl = EL.staging_bytes(R, M, H, K)
    nvl = (nvl + 255) // 256 * 256
    be = types.SimpleNamespace(num_ranks=R, rank=0, device=torch.device("meta"), ht_off=1 << 20, nvl_bytes=nvl,
                               hdl=types.SimpleNamespace(buffer_ptrs=list(ptrs)), err=torch.zeros(8, device="meta"),
                               _timeout_ns=10 ** 9, _check_error=lambda: None)
    be.symm = torch.empty(be.ht_off + nvl, dtype=torch.uint8, device="meta")
    be.ptr_table = torch.empty(R, dtype=torch.int64, device="meta")
    be._v2 = {"epoch": torch.zeros(2, dtype=torch.int32, device="meta"), "kernels": kern}
    return be


def _dsv3_calls(num_sms: int):
    """Every V2 launch of a contiguous and an expanded dispatch's epilogues and of their combines (weights sent
    back), in order, with the rows each moves: ``[(name, grid, consts, rows)]``."""
    from epcomm import elastic_layout as EL
    from epcomm.backends import nvlink_v2

    kern, seen = _record()
    meta = dict(device="meta")
    n, t = R * M, M
    out = []

    def take(rows):
        out.extend((*s, rows) for s in seen)
        seen.clear()

    for expand in (False, True):
        a = 128 if expand else 1
        x_rows = EL.worst_expanded_rows(R, M, K, LE, a)
        rm = kern.recv_meta(torch.empty(R, R, dtype=torch.int32, **meta), 0, torch.empty(n, dtype=torch.int32, **meta),
                            torch.empty(n, K, dtype=torch.int64, **meta), torch.empty(t, R, dtype=torch.int32, **meta),
                            torch.empty(t, K, dtype=torch.int64, **meta), M, LE, a, x_rows, expand, None)
        take(n)
        if expand:
            x = EL.Rows(torch.empty(n, H, dtype=torch.bfloat16, **meta), 0, 2 * H)
            w = EL.Rows(torch.empty(n, K, dtype=torch.float32, **meta), 0, 4 * K)
            # by contiguous row (each read once, stored to its lanes' rows), from the handle's slots
            kern.copy_epilogue(rm.source, K, False, DEVICE_SMS, x, torch.bfloat16, H, None, None, 0, False, w,
                               slots=rm.meta[:, 2:])
            take(n)
            rows, _ = kern.pack(torch.empty(x_rows, H, dtype=torch.bfloat16, **meta), rm.meta,
                                torch.empty(x_rows, dtype=torch.float32, **meta), 1)
            take(n)
        be = _fake_backend(kern)
        dst = torch.empty(n, dtype=torch.int64, **meta)
        if expand:
            got = nvlink_v2.return_rows(be, rows, dst, M, "combine/rows", num_sms)
        else:  # the transport reads x and the weights in place (elastic_engine.combine on this backend): no pack
            got = nvlink_v2.return_row_parts(be, torch.empty(n, H, dtype=torch.bfloat16, **meta), torch.empty(
                n, K, dtype=torch.float32, **meta), dst, M, "combine/rows", num_sms)
        take(n)
        kern.reduce(got, torch.empty(t, K, dtype=torch.int64, **meta), LE, M, H, (), (0, K), True, True)
        take(t)
    return out


def _waiting_kernels() -> set:
    """The kernels of ``kernels/v2.py`` and ``kernels/v2_dispatch.py`` that spin-wait (call ``wait_ge``): their
    programs wait on other programs or ranks, so their grids must fit on the SMs at once."""
    pytest.importorskip("triton")
    import inspect

    from epcomm.kernels import v2, v2_dispatch

    return {name for mod in (v2, v2_dispatch) for name, f in vars(mod).items()
            if name.endswith("_kernel") and "wait_ge(" in inspect.getsource(f.fn)}


@pytest.mark.parametrize("num_sms", [4, 8, 12, 24])
def test_dsv3_v2_launches_are_bounded_and_move_tiles(num_sms):
    calls = _dsv3_calls(num_sms)
    names = [c[0] for c in calls]
    assert names.count("_combine_impl_kernel") == 2 and names.count("_dispatch_copy_epilogue_impl_kernel") == 1, names
    assert names.count("_combine_pack_kernel") == 1, names  # the expanded combine's local sum; contiguous: none
    # a contiguous dispatch's epilogue is one launch (metadata, counts and prefix sums); an expanded one adds
    # the layout (then the copy)
    assert names[:2] == ["_dispatch_copy_epilogue_impl_meta_kernel", "_combine_impl_kernel"], names
    at = names.index("_recv_meta_kernel")
    want = ["_recv_meta_kernel", "_expert_layout_kernel", "_dispatch_copy_epilogue_impl_kernel"]
    assert names[at:at + 3] == want, names
    assert _waiting_kernels() == {"_combine_impl_kernel", "_combine_arrive_kernel"}
    report = []
    for name, grid, consts, rows in calls:
        programs = math.prod(grid)
        if name == "_combine_impl_kernel":
            # spin-waits: exactly the call's num_sms programs, whatever the rows (the arrival counts them)
            assert grid == (num_sms, 1, 1), (name, grid)
            step = 4 * consts["RB"] * consts["BLOCK"]
            steps = math.ceil(rows / (programs * consts["RB"])) * math.ceil(consts["W"] / consts["BLOCK"])
            assert consts["ALIGNED"], "DSv3 rows of 14368 bytes into 16-byte aligned areas: vector stores"
        elif name == "_combine_arrive_kernel":
            assert grid == (1, 1, 1)
            continue
        elif name == "_dispatch_copy_epilogue_impl_kernel":
            assert programs <= 4 * DEVICE_SMS, grid  # no wait: any grid finishes; a few programs an SM
            step = consts["RB"] * consts["BLOCK"]
            steps = math.ceil(rows / (programs * consts["RB"])) * math.ceil(consts["ROW"] / consts["BLOCK"])
        elif name == "_expert_layout_kernel":
            assert grid[0] == LE, grid  # program e scans every row for expert e (expanded dispatches only)
            steps = math.ceil(rows / consts["BN"])
            assert steps <= 16, (name, consts["BN"], steps)
            continue
        elif name in ("_combine_pack_kernel", "_combine_reduce_epilogue_impl_kernel"):
            # one tile a program: a row (token) by a block of the hidden dim, all rows in parallel
            assert grid == (rows, math.ceil(H / consts["BLOCK"]), 1), (name, grid)
            continue
        else:
            assert name in ("_recv_meta_kernel", "_dispatch_copy_epilogue_impl_meta_kernel"), name
            assert grid[0] == math.ceil(rows / consts["BN"]) + math.ceil(M / consts["BN"]), grid
            continue
        report.append((name, programs, step, steps))
        assert step >= MIN_STEP_BYTES, f"{name}: {step} bytes a step, under V1's {MIN_STEP_BYTES}"
    print(*report, sep="\n")


def _run(script: str, interpret: bool) -> str:
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    if not interpret:
        env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, os.path.join(SIMS, script)], env=env, cwd=ROOT, check=False,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    lines = res.stdout.splitlines()
    plans = sum(int(line.split()[1]) for line in lines if line.startswith("plan "))
    oks = [line for line in lines if line.startswith("ok")]
    assert plans > 0 and len(oks) == plans, res.stdout
    return res.stdout


def test_tiled_v2_kernels_step_several_times_under_the_interpreter():
    _run("sim_elastic_tiles.py", True)


def test_v2_rows_move_as_16_byte_vectors_on_sm90():
    _run("vectors_elastic.py", False)
