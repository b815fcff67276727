"""Tier 1: the nvlink backend's high-throughput kernels without a GPU, each script in its own process, as
tests/unit/test_kernel_sims.py runs its scripts (``plan N``, then one ``ok`` per check passed):
sims/compile_ht.py compiles them for sm_90 with Triton's compiler and ptxas, in the variants the backend
launches (the exchange with the handle, the gather that pushes, cached too, the combine in one kernel,
the layout, the exchange with the layout fused in); sims/sim_ht_layout.py runs the layout kernel under the
interpreter against ``layout.dispatch_layout``, bitwise; sims/sim_ht_fused_layout.py the exchange kernel with its
fused layout against the layout kernel and the unfused exchange, bitwise. All start as soon as the session's tests are collected (tests/conftest.py). The fused kernels' logic runs end to end in tier 2
(tests/dist/test_nvlink_cpu.py) against the reference backend."""
import pytest

pytest.importorskip("triton")
pytest.importorskip("numpy")

from test_kernel_sims import (  # noqa: E402, F401 (tests/conftest.py)
    collect, early_done, start_early, started_scripts, stop_early)

SCRIPTS = ["compile_ht.py", "sim_ht_layout.py", "sim_ht_fused_layout.py"]


@pytest.fixture(scope="module")
def started():
    yield from started_scripts(SCRIPTS)  # all at once


@pytest.mark.parametrize("script", SCRIPTS)
def test_ht_kernels(started, script):
    collect(script, started[script])
