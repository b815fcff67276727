"""Tier 1 (no process group): the transport switch of the tier-2 harness (``tests/dist/harness.py``)
and ``epcomm.testing.inputs.to_device``, which moves every tier-2 input to the rank's device.

The nccl paths are exercised with ``torch.cuda`` faked (monkeypatched device counts) and the
``meta`` device standing in for a GPU: no GPU is needed.
"""

from __future__ import annotations

import harness
import pytest
import torch

from epcomm.testing.inputs import to_device

# ----------------------------------------------------------------------------- settings


def test_settings_default_to_gloo_and_the_reference_backend():
    assert harness.settings_from_env({}) == ("gloo", "reference")
    assert harness.settings_from_env({"EPCOMM_TEST_TRANSPORT": "", "EPCOMM_TEST_BACKEND": " "}) == ("gloo",
                                                                                                     "reference")
    assert harness.settings_from_env({"EPCOMM_TEST_TRANSPORT": "NCCL"}) == ("nccl", "reference")
    assert harness.settings_from_env({"EPCOMM_TEST_TRANSPORT": "nccl", "EPCOMM_TEST_BACKEND": "nvlink"}) == (
        "nccl", "nvlink")


@pytest.mark.parametrize("env,match", [
    ({"EPCOMM_TEST_TRANSPORT": "mpi"}, r"EPCOMM_TEST_TRANSPORT must be one of \('gloo', 'nccl'\), got 'mpi'"),
    ({"EPCOMM_TEST_TRANSPORT": "nccl", "EPCOMM_TEST_BACKEND": "fast"}, "EPCOMM_TEST_BACKEND must be one of .* 'fast'"),
    ({"EPCOMM_TEST_BACKEND": "nvlink"}, "EPCOMM_TEST_BACKEND=nvlink needs EPCOMM_TEST_TRANSPORT=nccl"),
])
def test_settings_reject_what_cannot_run(env, match):
    with pytest.raises(ValueError, match=match):
        harness.settings_from_env(env)


def test_child_env_forces_the_backend_under_nccl_only(monkeypatch):
    monkeypatch.setattr(harness, "TRANSPORT", "gloo")
    monkeypatch.setattr(harness, "BACKEND", "reference")
    assert harness.child_env() == harness.CHILD_ENV  # a gloo group must pick the reference backend by itself
    monkeypatch.setattr(harness, "TRANSPORT", "nccl")
    assert harness.child_env() == {**harness.CHILD_ENV, "EPCOMM_BACKEND": "reference"}
    monkeypatch.setattr(harness, "BACKEND", "nvlink")
    assert harness.child_env()["EPCOMM_BACKEND"] == "nvlink"
    assert "EPCOMM_BACKEND" not in harness.CHILD_ENV


def test_reference_only(monkeypatch):
    monkeypatch.setattr(harness, "BACKEND", "reference")
    harness.reference_only("anything")
    monkeypatch.setattr(harness, "BACKEND", "nvlink")
    with pytest.raises(harness.NotApplicable, match=r"reference backend only \(the shrink mask\); this run uses nvlink"):
        harness.reference_only("the shrink mask")


# ----------------------------------------------------------------------------- world sizes


def fake_gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


@pytest.mark.parametrize("gpus", [0, 2])
def test_gloo_launches_every_world_size(monkeypatch, gpus):
    fake_gpus(monkeypatch, gpus)
    assert all(harness.launch_skip_reason(r, "gloo") is None for r in (1, 2, 3, 4, 64))


def test_nccl_skips_world_sizes_above_the_gpu_count(monkeypatch):
    fake_gpus(monkeypatch, 2)
    assert harness.launch_skip_reason(1, "nccl") is None
    assert harness.launch_skip_reason(2, "nccl") is None
    for r in (3, 4):
        assert harness.launch_skip_reason(r, "nccl") == (
            f"nccl runs one rank per GPU: world size {r} needs {r} GPUs, 2 visible")
    fake_gpus(monkeypatch, 8)
    assert all(harness.launch_skip_reason(r, "nccl") is None for r in harness.WORLD_SIZES)


def test_nccl_without_cuda_fails_instead_of_skipping(monkeypatch):
    fake_gpus(monkeypatch, 0)
    with pytest.raises(RuntimeError, match="EPCOMM_TEST_TRANSPORT=nccl needs CUDA GPUs"):
        harness.launch_skip_reason(1, "nccl")


def test_skip_unless_launchable_uses_this_runs_transport(monkeypatch):
    fake_gpus(monkeypatch, 2)
    monkeypatch.setattr(harness, "TRANSPORT", "nccl")
    harness.skip_unless_launchable(2)
    with pytest.raises(pytest.skip.Exception, match="world size 3 needs 3 GPUs, 2 visible"):
        harness.skip_unless_launchable(3)
    monkeypatch.setattr(harness, "TRANSPORT", "gloo")
    harness.skip_unless_launchable(3)


# ----------------------------------------------------------------------------- to_device


def layouts() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    s = torch.rand(5, 4, generator=g)
    wide = torch.full((5, 8), -7.0)
    wide[:, ::2] = s
    return {"contiguous": s, "column_major": s.t().contiguous().t(), "strided": wide[:, ::2],
            "fp8": s.to(torch.float8_e4m3fn), "bool": s > 0.5, "empty": torch.empty(0, 3, dtype=torch.int64),
            "offset": wide[1:, 1::2]}


@pytest.mark.parametrize("name", list(layouts()))
def test_to_device_keeps_dtype_shape_and_strides(name):
    t = layouts()[name]
    m = to_device(t, "meta")  # another device than the CPU, without a GPU
    assert m.device.type == "meta"
    assert (m.dtype, m.shape, m.stride(), m.is_contiguous()) == (t.dtype, t.shape, t.stride(), t.is_contiguous())
    if name == "strided":
        assert t.to("meta").is_contiguous()  # what to_device avoids: Tensor.to drops a strided view's layout


def test_to_device_values_and_containers():
    t = layouts()
    assert to_device(t["strided"], "cpu") is t["strided"]  # the identity on the tensor's own device
    assert to_device(t["strided"], torch.device("cpu")) is t["strided"]
    q, s = to_device((t["fp8"], t["column_major"]), "meta")
    assert (q.dtype, s.stride()) == (torch.float8_e4m3fn, (1, 5))
    moved = to_device([t["contiguous"], None], "meta")
    assert isinstance(moved, list) and moved[1] is None and moved[0].device.type == "meta"
    assert to_device(None, "meta") is None
    with pytest.raises(TypeError, match="to_device takes a tensor, a tuple or list of them, or None; got dict"):
        to_device({"x": t["contiguous"]}, "meta")


# ----------------------------------------------------------------------------- the background queue (tests/dist/background.py)


def test_the_background_queue_runs_its_jobs_in_order_once_released_and_each_test_gets_its_own():
    import threading

    from background import Queue

    q, ran, gate = Queue(), [], threading.Event()

    def job(name, wait=False):
        if wait:
            gate.wait(10)
        ran.append(name)
        if name == "bad":
            raise ValueError("bad job")
        return f"{name} done"

    for name in ("a", "b", "bad", "c"):
        q.queue(name, job, name, wait=name == "a")
    q.queue("a", job, "a twice")  # (queued once)
    assert ran == []  # nothing runs before the release
    q.release()
    gate.set()
    assert q.result("c", job, "unused") == "c done"  # waits for its turn: the queue runs them in queue order
    assert ran == ["a", "b", "bad", "c"]
    assert q.result("a", job, "unused") == "a done"
    with pytest.raises(ValueError, match="bad job"):
        q.result("bad", job, "unused")
    assert q.result("never queued", job, "here") == "here done" and ran[-1] == "here"  # runs in the caller
    q.stop()


def test_a_test_that_asks_releases_the_queue_and_the_session_end_drops_what_did_not_run():
    from background import Queue

    q = Queue()
    q.queue("a", lambda: "a done")
    q.queue("b", lambda: "b done")
    assert q.result("a", lambda: "unused") == "a done"  # (not released: asking releases it)
    q.result("b", lambda: "unused")
    late = Queue()
    late.queue("x", lambda: "x done")
    late.stop()
    with pytest.raises(RuntimeError, match="the session ended before this job ran"):
        late.result("x", lambda: "unused")
