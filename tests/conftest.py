"""Shared pytest set-up for the test tiers.

1. ``tests/unit``: no process group — layout math against hand-worked examples, quant round trips,
   Config, Buffer's static helpers, EventOverlap, the test helpers themselves.
2. ``tests/dist``: gloo on CPU in spawned processes (``epcomm.testing.launcher.parallel_launch``),
   world sizes 1-4, the whole API end to end through the reference backend, bad inputs, deadlines.
   ``tests/dist/harness.py`` runs many checks per launch and reports each as its own test.
3. ``tests/gpu``: skipped without CUDA.

CI runs tiers 1-2: ``python -m pytest -q tests/unit tests/dist``. Spawned ranks unpickle their
target by module name, so the test modules must be importable by name in a child process: keep
pytest's default ``prepend`` import mode (``--import-mode=importlib`` breaks spawning).

Without CUDA (CI), every launch whose environment is the session's forks its ranks from one server process that
imported torch, pytest and epcomm once (``launcher.fork_from_server``): a rank then starts in a fraction of a
second instead of importing them itself (about 2 s of CPU a rank, 130 ranks a run). Megatron-Core's ranks (6 a run,
5.5 s of CPU each to start) fork from a server started with the switch ``EPCOMM_AS_DEEP_EP=1`` that imported
Megatron-Core (``MEGATRON`` below). The launches whose ranks run the kernels under the Triton interpreter fork from
another server, which has also set up the interpreter, loaded and rewritten every kernel and imported TorchDynamo
(``epcomm.testing.interp_server``, ``harness.INTERPRETER``): 0.3-0.4 s of CPU a rank, 1.5 s where it imports
TorchDynamo, about 70 ranks a run. With CUDA the ranks spawn, as a user's launches do.

Progress: whatever the verbosity (CI runs ``-q``, whose dots can stand still for a minute), a line as each test
file ends names it with its tests' count and time and the session's clock, and a test that runs 30 s without any
such line gets one saying it still runs (``tests/progress_lines.py``).

Work that leaves cores idle starts as soon as the tests are collected (``pytest_collection_finish`` below), and
runs while tier 1 runs in this one process: tier 1's kernel scripts (``tests/unit/test_kernel_sims.py``,
``test_ht_kernels.py``: single-threaded processes, the longest about 30 s) at the lowest priority, and
``tests/dist/test_launcher.py``'s launches that sleep out a deadline; their tests collect the results. Once those
scripts have ended, tier 2's longest launches (ranks that run the kernels under the Triton interpreter, and the
reference backend's whole check lists) run one after another on a thread of this process (``tests/dist/background.py``),
beside tier 2's other tests, which run first
(``pytest_collection_modifyitems``): the queue keeps the cores busy that those tests leave idle, and its modules'
tests, which come last, find their launches done.
"""

from __future__ import annotations

import os
import sys

from progress_lines import ProgressLines  # tests/progress_lines.py (this directory is on sys.path)

# ``import harness`` from the tier-2 modules, whatever directory pytest was started from; spawned
# children inherit sys.path.
_DIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist")
if _DIST not in sys.path:
    sys.path.insert(0, _DIST)


# the Megatron-Core modules that tests/dist/test_clients_megatron.py's ranks import
MEGATRON = ("megatron.core.transformer.moe.fused_a2a", "megatron.core.parallel_state",
            "megatron.core.transformer.transformer_config", "megatron.core.tensor_parallel.layers",
            "megatron.core.transformer.mlp", "megatron.core.transformer.moe.experts",
            "megatron.core.transformer.moe.moe_layer", "megatron.core.transformer.moe.router",
            "megatron.core.transformer.moe.token_dispatcher", "megatron.core.transformer.spec_utils",
            "megatron.core.transformer.moe.moe_utils")


def _fork_ranks_from_a_server() -> None:
    import importlib.util

    import torch

    from epcomm.testing import launcher

    if not torch.cuda.is_available():
        # what most tier-2 modules import besides torch and epcomm (harness reads the environment at import:
        # not here), about 0.8 s of a rank's start on a loaded 2-core machine
        preload = ("pytest", "epcomm.testing.inputs", "epcomm.testing.compare")
        launcher.fork_from_server(preload=preload)
        # servers of their own, each started by its first launch (epcomm.testing.fork_servers; TorchInductor's
        # variables are read at their imports). The ranks that run the kernels under the Triton interpreter
        # (harness.INTERPRETER): the interpreter, the kernels and TorchDynamo loaded (epcomm.testing.interp_server).
        if importlib.util.find_spec("triton") is not None:
            launcher.fork_from_server(preload=(*preload, "epcomm.testing.interp_server"), name="interpreter",
                                      read_at_import=("TORCHINDUCTOR_",))
        # Megatron-Core's ranks (harness.MEGATRON): the switch on from the server's start-up, the Megatron-Core
        # modules they import imported (epcomm.testing.preload)
        launcher.fork_from_server(preload=(*preload, "epcomm.testing.preload"), name="megatron",
                                  read_at_import=("TORCHINDUCTOR_",),
                                  environ={"EPCOMM_AS_DEEP_EP": "1", "EPCOMM_TEST_PRELOAD": ",".join(MEGATRON)})


_fork_ranks_from_a_server()


_EARLY: list = []  # the test modules whose start_early ran


def pytest_configure(config):
    config.pluginmanager.register(ProgressLines(), "epcomm-progress-lines")


def pytest_collection_modifyitems(session, config, items):
    """Tier 2's modules whose launches run on the background queue (tests/dist/background.py: their ``stop_early`` is harness.stop_early)
    come after tier 2's other modules, each keeping its place among its own kind: the queue runs beside those, and
    its modules' tests then find their launches done."""
    import harness

    def in_background(item) -> bool:
        return getattr(getattr(item, "module", None), "stop_early", None) is harness.stop_early

    items[:] = [i for i in items if not in_background(i)] + [i for i in items if in_background(i)]


def pytest_collection_finish(session):
    """A test module that defines ``start_early(items)`` gets its selected tests once all are collected (it
    starts what they will collect), and ``stop_early()`` at the end of the session."""
    if session.config.option.collectonly:
        return
    by_module: dict = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if hasattr(module, "start_early"):
            by_module.setdefault(module, []).append(item)
    for module, items in by_module.items():
        _EARLY.append(module)
        module.start_early(items)
    _release_the_background_after([m.early_done for m in _EARLY if hasattr(m, "early_done")])


def _release_the_background_after(waits) -> None:
    """Tier 2's background queue (tests/dist/background.py: launches queued by its modules' ``start_early``) runs once every ``waits``
    is true: tier 1's kernel scripts have ended (they take the cores tier 1 leaves idle at the lowest priority, which
    the queue's processes would take from them)."""
    import threading
    import time

    import background  # tests/dist/background.py

    def release():
        while not all(done() for done in waits):
            time.sleep(0.5)
        background.BACKGROUND.release()

    threading.Thread(target=release, name="epcomm-background-release", daemon=True).start()


def pytest_sessionfinish(session):
    for module in _EARLY:
        module.stop_early()
