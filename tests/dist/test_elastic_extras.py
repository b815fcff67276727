"""Tier 2: ``ElasticBuffer``'s Engram, pipeline send/recv and AGRS calls (DeepEP V2's experimental surface,
``epcomm/elastic_extras.py``) on CPU processes, at 2, 3 and 4 ranks, on every backend: the reference (gloo), and
the nvlink and internode backends with their kernels under the Triton interpreter and symmetric memory simulated
(``epcomm.testing.cpu_nvlink`` / ``cpu_internode``; internode as virtual nodes of one rank, so every byte crosses
the simulated NVSHMEM).

The checks (``epcomm.testing.extras_cases``): Engram fetches bit for bit against the whole storage indexed (BF16;
FP8 with opaque int32 scale packs in both layouts), a second write, several ``num_qps``, no tokens; pipeline
tensors of odd sizes and dtypes on a random schedule under credit flow control, bit for bit; DeepEP's AGRS stress
(sessions, batched, in place, waits in random order, an empty tensor) against the stacked inputs; and every bad
input and out-of-session call, each raising its named error on every rank, with the next good call still right;
at 2 ranks, last, a receive and an all-gather whose peer never comes give up at the deadline naming the peer.
One launch per (backend, world size) runs all its checks (process start-up and the interpreter dominate).
"""

import importlib.util
import os
import uuid

import harness
import pytest

CHECKS = ("engram-bf16", "engram-fp8", "engram-errors", "pp", "pp-errors", "agrs", "agrs-errors", "deadlines")
BACKENDS = {"reference": (2, 3, 4), "nvlink": (2, 3, 4), "internode": (2, 4)}
TAG = uuid.uuid4().hex[:12]  # this session's shared-memory files


def _maker(ctx, backend: str, tag: str):
    """``make(**kw) -> ElasticBuffer`` on ``backend`` in this fresh rank process."""
    from epcomm import ElasticBuffer

    if backend == "reference":
        return lambda **kw: ElasticBuffer(ctx.group, **kw)
    os.environ["EPCOMM_TIMEOUT_S"] = "20"
    if backend == "internode":
        os.environ["EPCOMM_GPUS_PER_NODE"] = "1"
    from epcomm.testing import cpu_internode, cpu_nvlink

    cpu_nvlink.install(tag, ctx.rank, ctx.world_size, ctx.group)
    from epcomm import ElasticBuffer as Elastic  # (after the install: the emulated symmetric memory)

    made = cpu_nvlink.nvlink_backend() if backend == "nvlink" else cpu_internode.internode_backend()

    class OnBackend(Elastic):
        _make_backend = staticmethod(made)

    def make(**kw):
        buf = OnBackend(ctx.group, **kw)
        assert buf._backend.name == backend, buf._backend.name
        return buf
    return make


def _rank(ctx, backend: str, tag: str, names: tuple):
    from epcomm.testing import extras_cases as X

    make = _maker(ctx, backend, tag)
    r, w, dev = ctx.rank, ctx.world_size, ctx.device

    def delivered(fn):
        def run(ctx):
            fn()
            if backend == "internode":  # no simulated put left behind or overtaken by its signal
                from epcomm.testing import cpu_internode

                cpu_internode.check_delivery()
        return run

    fns = {
        "engram-bf16": lambda: X.check_engram(make, r, w, dev, fp8=False, seed=1),
        "engram-fp8": lambda: X.check_engram(make, r, w, dev, fp8=True, seed=2),
        "engram-errors": lambda: X.check_engram_errors(make, r, w, dev),
        "pp": lambda: X.check_pp(make, r, w, dev, seed=3, num_sends=8 * w if backend != "reference" else 40 * w),
        "pp-errors": lambda: X.check_pp_errors(make, r, w, dev),
        "agrs": lambda: X.check_agrs(make, r, w, dev, seed=4, num_ops=10 if backend != "reference" else 24),
        "agrs-errors": lambda: X.check_agrs_errors(make, r, w, dev),
        "deadlines": lambda: X.check_deadlines(make, r, w, dev, backend != "reference",  # (last)
                                               f"/tmp/epcomm-deadlines-{tag}-{backend}"),
    }
    return harness.run_checks(ctx, [(name, delivered(fns[name])) for name in names], env={})


CASES = [(b, w, c) for b, worlds in BACKENDS.items() for w in worlds for c in CHECKS if c != "deadlines" or w == 2]


def _launch(backend: str, world: int) -> tuple:
    names = CHECKS if world == 2 else CHECKS[:-1]  # (the deadlines at 2 ranks only: they leave the ranks out of step)
    return _rank, world, backend, TAG, names


def start_early(items):  # (tests/conftest.py) this module's launches, in the background (tests/dist/background.py)
    params = [(it.callspec.params["backend"], it.callspec.params["world"]) for it in items]
    harness.queue_gloo_once(dict.fromkeys(_launch(b, w) for b, w in params
                                          if b == "reference" or importlib.util.find_spec("triton") is not None),
                            timeout_s=900)


stop_early = harness.stop_early


@pytest.mark.parametrize(("backend", "world", "check"), CASES, ids=[f"{b}-{w}-{c}" for b, w, c in CASES])
def test_elastic_extras(backend, world, check):
    if backend != "reference" and importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton (the interpreter)")
    harness.report(harness.launch_gloo_once(*_launch(backend, world), timeout_s=900), check)
