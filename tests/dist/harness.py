"""Shared machinery of the tier-2 tests (spawned processes; gloo on CPU, or NCCL on GPUs as below): one
launch per world size runs a whole list of named checks, and each check is reported as its own
pytest test.

Starting a process costs about 3 s (importing torch), so a test module launches once per world size
(``launch_cached``) and parametrises its tests over ``(world_size, check name)``. In every rank the
checks run in order (``run_checks``); the first failure stops that rank, because the ranks may then
be out of step, and later checks are reported as "not run". Checks run in child processes, where
pytest does not rewrite ``assert``: use the helpers below (they say what differs) or assert with a
message.

Letters: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``L = E/R``,
``M`` low-latency max tokens per rank.

Running on GPUs: the same suite runs over NCCL with CUDA tensors::

    EPCOMM_TEST_TRANSPORT=nccl python -m pytest -q tests/dist

- ``EPCOMM_TEST_TRANSPORT``: ``gloo`` (the default; what CI runs, on the CPU) or ``nccl`` (one process
  per GPU, rank ``r`` on ``cuda:r``; world sizes above ``torch.cuda.device_count()`` are skipped, so
  a 2-GPU machine runs world sizes 1 and 2; without CUDA every test fails, none passes by skipping).
- ``EPCOMM_TEST_BACKEND`` (nccl only): the backend the ranks force through ``EPCOMM_BACKEND``;
  ``reference`` by default, or ``nvlink``. Checks that hold only for the reference backend (its
  error timing, shrink, deadline phases) then skip and say why.
- ``test_ops.py`` and ``test_bench_cli.py`` are gloo-only: they skip under nccl.

One code path for both transports: a check builds its inputs on the CPU exactly as on gloo
(``epcomm.testing.inputs``, seeded CPU generators) and moves them with ``dev(ctx, ...)`` (a no-op on
gloo); constant tensors (``zeros``, ``full``) are made on ``ctx.device`` directly; the oracles stay on
the CPU, and results are compared on the CPU (``equal`` and ``epcomm.testing.compare`` move them).
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from collections.abc import Callable

import pytest
import torch
from background import BACKGROUND  # tests/dist/background.py

from epcomm.backends import BACKENDS
from epcomm.testing.inputs import Case, to_device
from epcomm.testing.launcher import RankError, parallel_launch

WORLD_SIZES = (1, 2, 3, 4)
# Deadline for every wait on a peer inside the children: a check that leaves the ranks out of step
# fails in seconds instead of hanging for the 30 s default.
CHILD_ENV = {"EPCOMM_TIMEOUT_S": "20"}
LAUNCH_TIMEOUT_S = 240.0
TRANSPORTS = ("gloo", "nccl")


def settings_from_env(environ) -> tuple[str, str]:
    """``(transport, backend)`` from ``EPCOMM_TEST_TRANSPORT`` and ``EPCOMM_TEST_BACKEND``.

    ``backend`` is the one the Buffers run: on gloo always ``reference`` (the selection rule for a
    CPU group), on nccl the one the ranks force (``reference`` unless ``EPCOMM_TEST_BACKEND`` says)."""
    transport = environ.get("EPCOMM_TEST_TRANSPORT", "").strip().lower() or "gloo"
    if transport not in TRANSPORTS:
        raise ValueError(f"EPCOMM_TEST_TRANSPORT must be one of {TRANSPORTS}, got {transport!r}")
    backend = environ.get("EPCOMM_TEST_BACKEND", "").strip().lower() or "reference"
    if backend not in BACKENDS:
        raise ValueError(f"EPCOMM_TEST_BACKEND must be one of {BACKENDS}, got {backend!r}")
    if backend != "reference" and transport != "nccl":
        raise ValueError(f"EPCOMM_TEST_BACKEND={backend} needs EPCOMM_TEST_TRANSPORT=nccl "
                         "(a gloo group runs the reference backend only)")
    return transport, backend


TRANSPORT, BACKEND = settings_from_env(os.environ)


class NotApplicable(Exception):
    """Raised by a check that does not apply to this world size or backend."""


def child_env() -> dict[str, str]:
    """Environment of the ranks: the deadline, and under nccl the backend the Buffers must run (on
    gloo nothing is forced: a CPU group must select the reference backend by itself)."""
    env = dict(CHILD_ENV)
    if TRANSPORT == "nccl":
        env["EPCOMM_BACKEND"] = BACKEND
    return env


def reference_only(why: str) -> None:
    """Raise ``NotApplicable`` unless the Buffers run the reference backend; ``why`` says what in the
    check is specific to it."""
    if BACKEND != "reference":
        raise NotApplicable(f"reference backend only ({why}); this run uses {BACKEND}")


def dev(ctx, obj):
    """``obj`` (a tensor, a tuple or list of tensors and None) on the rank's device, with its dtype,
    shape and strides (``epcomm.testing.inputs.to_device``); the identity on gloo."""
    return to_device(obj, ctx.device)


def run_checks(ctx, checks: list[tuple[str, Callable]], env: dict[str, str] | None = None) -> dict:
    """Run ``checks`` in order on this rank: ``{name: None (passed) | "skip: why" | traceback}``."""
    os.environ.update(child_env() if env is None else env)  # read when a Buffer is built
    results: dict[str, str | None] = {}
    for name, fn in checks:
        try:
            fn(ctx)
        except NotApplicable as e:
            results[name] = f"skip: {e}"
            continue
        except Exception:  # noqa: BLE001 - reported to the parent per check
            results[name] = traceback.format_exc()
            break
        results[name] = None
    return results


def launch_skip_reason(world_size: int, transport: str | None = None) -> str | None:
    """Why ``world_size`` ranks cannot run on ``transport`` (default: this run's), or None.

    NCCL runs one rank per GPU, so a world larger than ``torch.cuda.device_count()`` is skipped.
    Without CUDA at all, nccl raises instead: a run that skipped everything would look green."""
    if (transport or TRANSPORT) != "nccl":
        return None
    if not torch.cuda.is_available():
        raise RuntimeError("EPCOMM_TEST_TRANSPORT=nccl needs CUDA GPUs; torch.cuda.is_available() is False")
    n = torch.cuda.device_count()
    if world_size > n:
        return f"nccl runs one rank per GPU: world size {world_size} needs {world_size} GPUs, {n} visible"
    return None


def skip_unless_launchable(world_size: int) -> None:
    reason = launch_skip_reason(world_size)
    if reason is not None:
        pytest.skip(reason)


def _launch(fn, world_size: int, server: str, environ: dict | None = None):
    try:
        return parallel_launch(world_size, fn, timeout_s=LAUNCH_TIMEOUT_S, backend=TRANSPORT, server=server,
                               environ=environ)
    except RankError as e:
        return e


def launch_cached(fn: Callable, world_size: int, server: str = ""):
    """``fn(ctx)`` on ``world_size`` ranks of this run's transport, once per (fn, world size) per
    pytest session; skips the test where the transport cannot run ``world_size`` ranks. ``server``: the fork
    server its ranks start from where they fork (``MEGATRON``; tests/conftest.py). Where ``queue_cached`` queued
    it, from the background queue (``background.py``)."""
    skip_unless_launchable(world_size)
    return BACKGROUND.result(("cached", fn, world_size, server), _launch, fn, world_size, server)


def queue_cached(launches, switch: bool = False) -> None:
    """Queue ``launch_cached(fn, world_size, server)`` for each ``(fn, world_size, server)`` of ``launches`` on the
    background queue (``background.py``), with this process's environment now (and ``EPCOMM_AS_DEEP_EP=1`` with ``switch``, which
    ``deep_ep_switch`` sets for the module's own tests): a test module's ``start_early``. Only on gloo, and where the
    ranks fork from a server (which takes that environment; spawned ranks would take this process's at their
    start): elsewhere its tests launch as before."""
    from epcomm.testing import fork_servers

    environ = {**os.environ, **({"EPCOMM_AS_DEEP_EP": "1"} if switch else {})}
    for fn, world_size, server in launches:
        if (TRANSPORT == "gloo" and fork_servers.running(server)
                and fork_servers.start_method(environ, server)[0] == "forkserver"):
            BACKGROUND.queue(("cached", fn, world_size, server), _launch, fn, world_size, server, environ)


# The fork server of the ranks that run the kernels under the Triton interpreter (tests/conftest.py starts it without
# CUDA; elsewhere, or where a launch's environment differs from its own, the ranks start as any launch's do)
INTERPRETER = "interpreter"
# The fork server of Megatron-Core's ranks: started with the switch EPCOMM_AS_DEEP_EP=1, Megatron-Core imported
MEGATRON = "megatron"


def _gloo(fn: Callable, world_size: int, *args, timeout_s: float, environ: dict | None = None):
    try:
        return parallel_launch(world_size, fn, *args, timeout_s=timeout_s, backend="gloo", server=INTERPRETER,
                               environ=environ)
    except RankError as e:
        return e


def launch_gloo_once(fn: Callable, world_size: int, *args, timeout_s: float = LAUNCH_TIMEOUT_S):
    """``fn(ctx, *args)`` on ``world_size`` CPU processes on gloo whatever this run's transport (checks on
    simulated devices: the kernels under the Triton interpreter, ``INTERPRETER``), once per pytest session: its
    result (or ``RankError``) for ``report``; where ``queue_gloo_once`` queued it, from the background queue (``background.py``)."""
    return BACKGROUND.result(("gloo", fn, world_size, args, timeout_s), _gloo, fn, world_size, *args, timeout_s=timeout_s)


def queue_gloo_once(launches, timeout_s: float = LAUNCH_TIMEOUT_S) -> None:
    """Queue ``launch_gloo_once(fn, world_size, *args, timeout_s=timeout_s)`` for each ``(fn, world_size, *args)``
    of ``launches`` on the background queue (``background.py``), in that order, with this process's environment now: a test module's
    ``start_early`` (tests/conftest.py) with the launches of its selected tests, in their order."""
    environ = dict(os.environ)
    for fn, world_size, *args in launches:
        BACKGROUND.queue(("gloo", fn, world_size, tuple(args), timeout_s), _gloo, fn, world_size, *args,
                   timeout_s=timeout_s, environ=environ)


def stop_early() -> None:
    """A test module's ``stop_early`` (tests/conftest.py) where it queued launches: the background queue stops."""
    BACKGROUND.stop()


def report(outcome, name: str) -> None:
    """Turn one check's per-rank results into a pytest pass / fail / skip."""
    if isinstance(outcome, BaseException):
        raise outcome
    failures, skips = [], []
    for rank, res in enumerate(outcome):
        if name not in res:
            failed = [n for n, v in res.items() if v is not None and not v.startswith("skip:")]
            failures.append(f"rank {rank}: not run (stopped after check {failed[-1]!r} failed)" if failed
                            else f"rank {rank}: not run")
        elif res[name] is None:
            continue
        elif res[name].startswith("skip:"):
            skips.append(res[name][5:].strip())
        else:
            failures.append(f"rank {rank}:\n{res[name]}")
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    if skips:
        pytest.skip(skips[0])


# ----------------------------------------------------------------------------- scenarios


def num_experts_for(num_ranks: int) -> int:
    return 4 * max(num_ranks, 2)  # 8, 8, 12, 16


def cases(num_ranks: int, hidden: int) -> dict[str, Case]:
    """The routing scenarios every API path runs on, for ``num_ranks`` ranks.

    - ``random``: odd token counts (9, 13, 17, 21), random top-4 with -1 entries, token 0 of every
      rank selects no expert.
    - ``zero_tokens``: rank 0 has ``T = 0``.
    - ``hot``: expert 1 takes about a third of the tokens.
    - ``empty_rank``: no token selects an expert of the last rank (for R = 1: nothing is routed).
    """
    e = num_experts_for(num_ranks)
    odd = tuple(9 + 4 * r for r in range(num_ranks))
    base = Case(num_ranks, odd, hidden=hidden, num_topk=4, num_experts=e, seed=10 * num_ranks, drop_prob=0.15)
    return {
        "random": base,
        "zero_tokens": dataclasses.replace(base, tokens=(0,) + odd[1:], seed=base.seed + 1),
        "hot": dataclasses.replace(base, tokens=tuple(25 + 2 * r for r in range(num_ranks)), hot_expert=1,
                                   seed=base.seed + 2),
        "empty_rank": dataclasses.replace(base, empty_rank=num_ranks - 1, seed=base.seed + 3),
    }


# ----------------------------------------------------------------------------- assertions


def check(cond, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def equal(actual, expected, what: str) -> None:
    """Exact equality of tensors (dtype, shape, values) or plain Python values, with a message."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise AssertionError(f"{what}: got {type(actual).__name__}, expected a tensor")  # noqa: TRY004
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            raise AssertionError(f"{what}: {actual.dtype}{tuple(actual.shape)} != expected "
                                 f"{expected.dtype}{tuple(expected.shape)}")
        if not torch.equal(actual.cpu(), expected.cpu()):
            raise AssertionError(f"{what}:\n{actual}\n!= expected\n{expected}")
    elif actual != expected:
        raise AssertionError(f"{what}: {actual!r} != expected {expected!r}")


BF16_U = 2.0**-8  # bf16 unit roundoff (eps / 2)


def within_bf16_path(actual, ref, mag, roundings: int, what: str, floor: float = 1e-30) -> None:
    """``|actual - ref| <= 2 * roundings * u * M + u * |ref| + floor`` element-wise, for a result that went through
    ``roundings`` bf16 roundings on a path linear in them: each moves a value by at most ``u`` times its magnitude,
    and every later step is linear in it with absolute weights, so it reaches the result as at most ``u * M``
    (``mag``: the magnitude sum of the reference computation); the factor 2 covers the second-order terms and
    float32 accumulation. Shapes must agree, and no NaN passes."""
    a, ref64 = actual.detach().double(), ref.double()
    check(a.shape == ref64.shape, f"{what}: shape {tuple(a.shape)} != {tuple(ref64.shape)}")
    check(not bool(torch.isnan(a).any()), f"{what}: NaN")
    budget = 2 * roundings * BF16_U * mag + BF16_U * ref64.abs() + floor
    bad = (a - ref64).abs() > budget
    if bool(bad.any()):
        i = tuple(int(v) for v in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements outside the bf16 budget; first "
                             f"at {i}: got {a[i].item():.6g}, expected {ref64[i].item():.6g}, budget "
                             f"{budget[i].item():.3g}")


def raises(exc: type[BaseException], match: str, fn: Callable, *args, **kwargs) -> None:
    """``fn(*args, **kwargs)`` must raise ``exc`` with a message matching ``match``."""
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


# ----------------------------------------------------------------------------- clients under EPCOMM_AS_DEEP_EP


def run_checks_as_deep_ep(ctx, checks: list[tuple[str, Callable]]) -> dict:
    """``run_checks`` with the switch on in the rank (``import deep_ep`` gives epcomm)."""
    return run_checks(ctx, checks, env={**child_env(), "EPCOMM_AS_DEEP_EP": "1"})


@pytest.fixture(scope="module")
def deep_ep_switch():
    """The switch in this process's environment while a module's ranks start: they are fresh
    interpreters, and the start-up hook reads it before anything else (restored afterwards)."""
    old = os.environ.get("EPCOMM_AS_DEEP_EP")
    os.environ["EPCOMM_AS_DEEP_EP"] = "1"
    yield
    if old is None:
        os.environ.pop("EPCOMM_AS_DEEP_EP", None)
    else:
        os.environ["EPCOMM_AS_DEEP_EP"] = old
