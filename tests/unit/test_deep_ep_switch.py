"""Tier 1: the switch ``EPCOMM_AS_DEEP_EP`` (src/_epcomm_as_deep_ep.py), its start-up hook, the
``deep_ep`` names it provides, ``EventHandle``, and the build backend that puts the hook into wheels.

The fresh-interpreter checks run ``python -c`` in a subprocess: that is the only way to see what the
``.pth`` line does at start-up. They need epcomm installed by pip (``pip install -e .`` or
``pip install .``), as CI installs it; an install that predates the hook fails here with what to do.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

import _epcomm_as_deep_ep as hook
from epcomm.event import EventHandle, EventOverlap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _backend():
    spec = importlib.util.spec_from_file_location("epcomm_build", os.path.join(ROOT, "build_backend",
                                                                              "epcomm_build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(code: str, switch: str | None, pythonpath: str | None = None) -> dict:
    """Run ``code`` (which prints one JSON line last) in a fresh interpreter; its parsed output."""
    env = {k: v for k, v in os.environ.items() if k != hook.VARIABLE}
    if switch is not None:
        env[hook.VARIABLE] = switch
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0, f"subprocess failed ({p.returncode}):\n{p.stderr[-3000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("ON", True), (" yes ", True),
                                      ("", False), ("0", False), ("off", False), ("False", False)])
def test_switch_values(value, on):
    assert hook.switch_on({hook.VARIABLE: value}) is on
    assert hook.switch_on({}) is False


def test_switch_bad_value_names_variable_and_value():
    with pytest.raises(ValueError, match=r"EPCOMM_AS_DEEP_EP .*got 'maybe'"):
        hook.switch_on({hook.VARIABLE: "maybe"})


def test_a_bad_value_at_start_up_is_one_line_and_the_switch_stays_off(tmp_path):
    files = hook.pth_files()
    assert files, f"{hook.PTH_NAME} is in no site directory: run `pip install -e .` again"
    shutil.copy(files[0], tmp_path)  # a second hook file: site runs the line twice in one process
    env = {k: v for k, v in os.environ.items() if k != hook.VARIABLE}
    env[hook.VARIABLE] = "maybe"
    code = (f"import site; site.addsitedir({str(tmp_path)!r}); import _epcomm_as_deep_ep as h; "
            "print(h.installed())")
    p = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip() == "False", (p.returncode, p.stdout, p.stderr)
    want = (f"epcomm: {hook.VARIABLE} must be one of {hook._ON} (on) or {hook._OFF} (off), got 'maybe'; "
            "import deep_ep is not answered by epcomm in this process")
    assert [ln for ln in p.stderr.splitlines() if ln.strip()] == [want], p.stderr


def test_event_handle_on_cpu_is_empty_and_waits_for_nothing():
    h = EventHandle()
    assert h.event is None and h.query() is True
    ev = EventOverlap(h)
    assert ev.event is h
    ev.current_stream_wait()  # no CUDA: must not touch torch.cuda
    with ev:
        pass
    h.synchronize()
    h.wait()


def test_installed_pth_is_the_backends_line():
    files = hook.pth_files()
    assert files, (f"{hook.PTH_NAME} is in no site directory: this epcomm was installed before the hook "
                   "existed (or not by pip); run `pip install -e .` again")
    with open(files[0]) as f:
        assert f.read() == _backend().PTH_TEXT


_PROBE = """
import importlib.util, json, sys
started = {"torch": "torch" in sys.modules, "epcomm": "epcomm" in sys.modules}
spec = importlib.util.find_spec("deep_ep")
out = {"started": started, "found": spec is not None}
if spec is not None:
    import deep_ep, deep_ep.buffer, epcomm
    from deep_ep import Buffer, Config, EventOverlap, topk_idx_t
    from deep_ep.utils import EventHandle, EventOverlap as EO2, check_nvlink_connections
    out["file"] = deep_ep.__file__
    out["same"] = (issubclass(Buffer, epcomm.Buffer) and Config is epcomm.Config and EventOverlap is EO2
                   and deep_ep.buffer.Buffer is Buffer and topk_idx_t is epcomm.topk_idx_t)
    ev = EventOverlap(EventHandle())
    ev.current_stream_wait()
    out["event"] = ev.event.event is None
    try:
        from deep_ep import HybridEPBuffer  # noqa: F401
        out["hybrid"] = "importable"
    except ImportError:
        out["hybrid"] = "ImportError"
    from epcomm.doctor import deep_ep_switch
    out["env"] = deep_ep_switch()[1]
print(json.dumps(out))
"""


def test_switch_off_provides_nothing_and_imports_nothing():
    out = _run(_PROBE, None)
    assert out == {"started": {"torch": False, "epcomm": False}, "found": False}
    assert _run(_PROBE, "0") == out


def test_switch_on_gives_epcomm_as_deep_ep():
    out = _run(_PROBE, "1")
    assert out["started"] == {"torch": False, "epcomm": False}, "the start-up hook imported torch or epcomm"
    assert out["found"] and out["same"] and out["event"], out
    assert out["file"].endswith(os.path.join("epcomm", "_deep_ep", "__init__.py")), out["file"]
    assert out["hybrid"] == "ImportError"
    gives = [ln for ln in out["env"] if ln.startswith("import deep_ep gives:")]
    assert gives and gives[0].startswith("import deep_ep gives: epcomm (epcomm/_deep_ep)"), out["env"]
    assert "real DeepEP: not installed" in out["env"], out["env"]


def test_switch_on_shadows_a_real_deep_ep(tmp_path):
    real = tmp_path / "deep_ep"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    on = _run(_PROBE, "1", pythonpath=str(tmp_path))
    assert on["same"] and on["file"].endswith(os.path.join("_deep_ep", "__init__.py")), on
    shadowed = [ln for ln in on["env"] if ln.startswith("real DeepEP:")]
    assert shadowed and "SHADOWED" in shadowed[0] and str(real) in shadowed[0], on["env"]
    off = _run("import json, deep_ep; print(json.dumps({'real': getattr(deep_ep, 'REAL', False)}))", None,
               pythonpath=str(tmp_path))
    assert off == {"real": True}


def _fake_wheel(path):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pkg/__init__.py", "x = 1\n")
        z.writestr("pkg-0.1.dist-info/RECORD", "pkg/__init__.py,sha256=abc,6\npkg-0.1.dist-info/RECORD,,\n")


def test_build_backend_adds_the_pth_with_its_record_line(tmp_path):
    be = _backend()
    whl = str(tmp_path / "pkg-0.1-py3-none-any.whl")
    _fake_wheel(whl)
    be.add_pth(whl)
    be.add_pth(whl)  # idempotent
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        data = z.read(be.PTH_NAME)
        record = z.read("pkg-0.1.dist-info/RECORD").decode().splitlines()
    assert names.count(be.PTH_NAME) == 1 and names[-1].endswith("RECORD"), names
    assert data.decode() == be.PTH_TEXT
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    assert f"{be.PTH_NAME},sha256={digest},{len(data)}" in record, record
    assert "pkg/__init__.py,sha256=abc,6" in record


def test_build_backend_rejects_a_wheel_without_one_record(tmp_path):
    whl = str(tmp_path / "bad-0.1-py3-none-any.whl")
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("bad/__init__.py", "")
    with pytest.raises(ValueError, match="0 .dist-info/RECORD"):
        _backend().add_pth(whl)
