"""Tier 2: the soak (``scripts/soak.py``, ``epcomm.testing.soak``) on two CPU processes, the fast objects on the CPU
rig's nvlink backend (kernels under the Triton interpreter), so few calls and small shapes.

The script passes a short run (every kind of check, one line a rank, its JSON with the memory series). Then, in
one launch, the soak runs four times with the backends' plan caches bounded small (so that a short run fills and
clears them, the library's own rule at a size it reaches): as the library is, it passes; and it fails, naming what
broke, on each of three breaks made in the ranks: the high-throughput backend's plan cache never cleared (its
bound exceeded), every call keeping 16 MiB (the resident memory past its budget), the fast dispatch's received
rows (or its handle, where it receives none) made wrong (the check against the reference fails, naming the iteration).
"""
import functools
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import uuid

import harness
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the interpreter)")

ROOT = pathlib.Path(__file__).resolve().parents[2]
CALLS = 14
LEAK = 16 << 20  # bytes a broken call keeps


def test_the_script_passes_a_short_cpu_run(tmp_path):
    from epcomm.testing.soak import KINDS

    out = tmp_path / "soak.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--device", "cpu", "--world", "2",
                        "--calls", str(CALLS), "--sample-every", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env=env, check=False)
    assert p.returncode == 0, p.stdout + p.stderr[-6000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("rank ")]
    assert len(lines) == 2 and all(ln.endswith("; OK") for ln in lines), p.stdout
    reports = json.loads(out.read_text())["reports"]
    for rep in reports:
        assert rep["calls"] >= CALLS and rep["failures"] == [], rep
        assert set(rep["checks"]) == set(KINDS), rep["checks"]  # every kind ran
        assert sum(rep["by_kind"].values()) == rep["calls"]
        assert len(rep["samples"]) == rep["iterations"] + 1 and rep["rss"]["peak_after"] > 0  # (one a check)
        assert rep["caches"]["ht.backend._plans"][1] > 0 and rep["caches"]["v2._fast"][1] > 0  # (caches used)
    assert reports[0]["by_kind"] == reports[1]["by_kind"]  # both ranks made the same calls


class _NeverCleared(dict):
    def clear(self):
        pass


def _unbounded(objs):
    be = objs["ht"]._backend
    be._plans = _NeverCleared(be._plans)


def _leak(objs):
    import torch

    kept = []
    for name, method in (("ht", "dispatch"), ("ht", "combine"), ("ll", "low_latency_dispatch"),
                         ("ll", "low_latency_combine"), ("v2", "dispatch"), ("v2", "combine")):
        obj = objs[name]
        fn = getattr(obj, method)

        def keeping(*a, _fn=fn, **kw):
            kept.append(torch.ones(LEAK, dtype=torch.uint8))  # (touched: resident)
            return _fn(*a, **kw)

        setattr(obj, method, keeping)
    objs["ht"]._kept_by_the_break = kept


def _wrong(objs):
    import torch

    fast = objs["ht"]
    fn = fast.dispatch

    def wrong(*a, **kw):
        out = fn(*a, **kw)
        if kw.get("handle") is not None:
            return out
        x, handle = out[0][0] if isinstance(out[0], tuple) else out[0], out[4]
        if int(handle.rank_prefix_matrix[-1, fast.rank]):  # one bit of the first received row
            x.view(-1)[:1].view(torch.uint8 if x.element_size() == 1 else torch.int16).bitwise_xor_(1)
        else:  # (no rows here: the handle's prefix matrix)
            handle.rank_prefix_matrix[0, 0] += 1
        return out

    fast.dispatch = wrong


def _small_bounds(objs, brk=None):
    """The backends' plan caches bounded small (in this rank process only; the soak reads the bounds from the
    same constants), then the break ``brk``. (Not before the soak: importing the backends loads Triton, which
    must come after the CPU rig set up its interpreter.)"""
    from epcomm.backends import ht_combine, ht_dispatch, ll_calls

    ht_dispatch._MAX_PLANS = ht_combine._MAX_PLANS = 3
    ll_calls._MAX_KINDS = 1
    if brk is not None:
        brk(objs)


def _soaks(ctx, tag):
    from epcomm.testing import soak

    opts = soak.Options(calls=CALLS, device="cpu", sample_every=1, tag=tag)
    out = {}
    for name, brk in (("clean", None), ("unbounded", _unbounded), ("leak", _leak)):
        rep = soak.run_rank(ctx, opts, functools.partial(_small_bounds, brk=brk))
        out[name] = (rep["failures"], rep["caches"])
    try:
        soak.run_rank(ctx, opts, functools.partial(_small_bounds, brk=_wrong))
        out["wrong"] = None
    except soak.SoakFailure as e:
        out["wrong"] = str(e)
    return out


TAG = f"soak{uuid.uuid4().hex[:6]}"  # this session's shared-memory files


def start_early(items):  # (tests/conftest.py) this module's launch, in the background (tests/dist/background.py)
    if any(it.name != "test_the_script_passes_a_short_cpu_run" for it in items):
        harness.queue_gloo_once([(_soaks, 2, TAG)], timeout_s=600)


stop_early = harness.stop_early


def _launch():
    """The soaks' launch (the interpreter's ranks: ``harness.launch_gloo_once``), raised where it failed."""
    res = harness.launch_gloo_once(_soaks, 2, TAG, timeout_s=600)
    if isinstance(res, BaseException):
        raise res
    return res


def test_small_bounds_clear_and_pass():
    for res in _launch():
        failures, caches = res["clean"]
        assert failures == [], failures
        most, bound = caches["ht.backend._plans"][1:]
        assert bound == 5 and most >= 4, caches  # filled to its bound, then cleared


def test_a_plan_cache_never_cleared_fails():
    for res in _launch():
        failures, caches = res["unbounded"]
        assert caches["ht.backend._plans"][1] > 5, caches
        assert any(f.startswith("plan cache ht.backend._plans held") for f in failures), failures
        assert not any("memory" in f for f in failures), failures  # (small plans: the bound catches it)


def test_memory_kept_by_every_call_fails():
    for res in _launch():
        failures, _ = res["leak"]
        assert any(f.startswith("rss memory grew after the warm-up") for f in failures), failures


def test_a_wrong_result_fails_naming_the_iteration():
    for res in _launch():
        msg = res["wrong"]
        assert msg is not None and "iteration" in msg and "(ht" in msg, msg
        assert "recv_x" in msg or "rank_prefix_matrix" in msg, msg
