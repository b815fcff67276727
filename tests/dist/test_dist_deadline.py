"""Tier 2 (gloo on CPU, spawned processes, 4 ranks; or NCCL on 2 GPUs, see ``harness``): nothing
hangs. When one rank (rank 2 of 4: ranks on both sides of it wait) never makes a call, the others raise
``epcomm.backends.base.PeerTimeoutError`` naming the phase and the missing rank (``.rank``, ``.ranks`` and
the message; a collective learns it from the ranks' arrival announcements, ``deadline._RollCall``) within a
few seconds of ``EPCOMM_TIMEOUT_S``.

Each phase runs on a fresh process group, so a phase left half-done cannot disturb the next one;
before the phase every rank (the silent one too) runs a checked all_to_all and all_gather on it, so
the phase is never the group's first operation (NCCL connects lazily, and needs a group's first
operation to involve every rank) and the deadline measures the wait only. Every rank then makes the
phase's calls together once (its kind's arguments agreed), and the silent rank stops: the others wait in the
phase itself; in ``dispatch/arguments`` (no call together) they wait in the first call's exchange of its
arguments. The silent rank waits for marker files from the others before it moves on.

Under nccl a timed-out collective stays stuck on the GPU (nothing aborts it), so each phase runs in
its own launch, as the last thing its processes do; on gloo one launch runs every phase. The phases
and the missing-rank detail are those of the reference backend: under another backend the module
skips.
"""

from __future__ import annotations

import os
import time

import harness
import pytest
import torch
import torch.distributed as dist
from harness import dev

from epcomm import Buffer
from epcomm.backends.base import PeerTimeoutError
from epcomm.testing.inputs import Case, make_topk, make_x
from epcomm.testing.launcher import parallel_launch

TIMEOUT_S = 1.0
# nccl runs one rank per GPU: 2 ranks (one waits, one is silent) fit the 2-GPU device machine.
WORLD_SIZE = 4 if harness.TRANSPORT == "gloo" else 2
SILENT = 2 if harness.TRANSPORT == "gloo" else 1
M, HIDDEN = 16, 128
CASE = Case(WORLD_SIZE, (7, 8, 9, 6)[:WORLD_SIZE], hidden=HIDDEN, num_topk=2, num_experts=8, seed=3,
            no_expert_token=False, drop_prob=0.0)
# the phases; before each, every rank (the silent one too) makes the set-up call it needs (a handle) and one call
# of the phase's own kind, so the kind's arguments are agreed (``epcomm._agree``) and the call that waits is in the
# phase itself; but for "dispatch/arguments": a kind's first call, whose exchange of arguments waits
PHASES = ("dispatch/arguments", "dispatch/notify", "combine/payload", "cached_dispatch/payload",
          "low_latency_dispatch/counts", "low_latency_combine/payload")
LAUNCHES = [tuple(PHASES)] if harness.TRANSPORT == "gloo" else [(phase,) for phase in PHASES]


def _warm_up(group, device: torch.device) -> None:
    """A checked all_to_all and all_gather on ``group``, every rank taking part."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    mine = torch.full((n,), me, dtype=torch.int64, device=device)
    got = torch.empty_like(mine)
    dist.all_to_all_single(got, mine, group=group)
    everyone = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(everyone, mine[:1], group=group)
    if got.tolist() != list(range(n)) or torch.cat(everyone).tolist() != list(range(n)):
        raise AssertionError(f"rank {me}: warm-up collectives gave {got.tolist()} and {torch.cat(everyone).tolist()}")


def _phase(ctx, buf: Buffer, phase: str, silent: bool):
    """Run ``phase``: the set-up and the call of its kind together, then the silent rank stops and the others
    call again."""
    me = ctx.rank
    idx, w = dev(ctx, make_topk(CASE, me))
    x = dev(ctx, make_x(CASE, me))
    e = CASE.num_experts

    def ll():
        return buf.low_latency_dispatch(x, idx, M, e, use_fp8=False)

    def d(**kw):
        lay = dict(zip(("num_tokens_per_rank", "_", "num_tokens_per_expert", "is_token_in_rank"),
                       buf.get_dispatch_layout(idx, e)[:4]))
        del lay["_"]
        return buf.dispatch(x, **lay, **kw)

    if phase == "low_latency_combine/payload":
        recv_x, _, handle, _, _ = ll()
        call = lambda: buf.low_latency_combine(recv_x, idx, w, handle)
    elif phase in ("combine/payload", "cached_dispatch/payload"):
        recv_x, _, _, _, handle, _ = d(topk_idx=idx, topk_weights=w)
        call = (lambda: buf.combine(recv_x, handle)) if phase == "combine/payload" else (
            lambda: buf.dispatch(x, handle=handle))
    else:
        call = ll if phase == "low_latency_dispatch/counts" else d
    if phase != "dispatch/arguments":
        call()
    if not silent:
        call()


def rank_main(ctx, marker_dir: str, phases: tuple[str, ...]):
    os.environ.update(harness.child_env())
    os.environ["EPCOMM_TIMEOUT_S"] = str(TIMEOUT_S)  # read when the Buffer is built
    me = ctx.rank
    results = {}
    for phase in phases:
        group = dist.new_group(list(range(WORLD_SIZE)), backend=ctx.backend)
        _warm_up(group, ctx.device)
        buf = Buffer(group, num_nvl_bytes=0,
                     num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(M, HIDDEN, WORLD_SIZE, CASE.num_experts),
                     low_latency_mode=phase.startswith("low_latency"))
        tag = phase.replace("/", "_")
        if me == SILENT:
            _phase(ctx, buf, phase, silent=True)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not all(
                    os.path.exists(os.path.join(marker_dir, f"{tag}.{r}")) for r in range(WORLD_SIZE) if r != SILENT):
                time.sleep(0.02)
            continue
        t0 = time.monotonic()
        try:
            _phase(ctx, buf, phase, silent=False)
            results[phase] = ("returned", None, None, time.monotonic() - t0)
        except PeerTimeoutError as e:
            results[phase] = (str(e), e.phase, (e.rank, e.ranks), time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - reported to the parent
            results[phase] = (f"{type(e).__name__}: {e}", None, None, time.monotonic() - t0)
        open(os.path.join(marker_dir, f"{tag}.{me}"), "w").close()
    return results


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """``outcomes[rank][phase] = (message, PeerTimeoutError.phase, (.rank, .ranks), seconds)``."""
    if harness.BACKEND != "reference":
        pytest.skip(f"the phases and deadlines checked here are the reference backend's; this run uses "
                    f"{harness.BACKEND}")
    harness.skip_unless_launchable(WORLD_SIZE)
    markers = str(tmp_path_factory.mktemp("markers"))
    merged = [{} for _ in range(WORLD_SIZE)]
    for phases in LAUNCHES:
        per_rank = parallel_launch(WORLD_SIZE, rank_main, markers, phases, backend=harness.TRANSPORT,
                                   timeout_s=120.0)
        for rank, res in enumerate(per_rank):
            merged[rank].update(res)
    return merged


def _waiting_ranks():
    return [me for me in range(WORLD_SIZE) if me != SILENT]


@pytest.mark.parametrize("phase", list(PHASES))
def test_missing_rank_raises_peer_timeout(outcomes, phase):
    assert outcomes[SILENT] == {}
    for me in _waiting_ranks():
        message, got_phase, _, elapsed = outcomes[me][phase]
        assert got_phase == phase, f"rank {me}: expected PeerTimeoutError for {phase}, got: {message}"
        assert message.startswith(f"epcomm rank {me}: {phase} waited {TIMEOUT_S:g} s"), message
        assert f"(EPCOMM_TIMEOUT_S={TIMEOUT_S:g} sets the deadline)" in message, message
        assert elapsed < TIMEOUT_S + 4.0, f"rank {me}: gave up after {elapsed:.1f} s"
        assert elapsed >= 0.8 * TIMEOUT_S, f"rank {me}: raised after {elapsed:.2f} s, before the deadline"


@pytest.mark.parametrize("phase", list(PHASES))
def test_timeout_names_the_missing_rank(outcomes, phase):
    """Collectives too: the ranks that arrived announce it, so each knows which one did not."""
    for me in _waiting_ranks():
        message, got_phase, peer, _ = outcomes[me][phase]
        assert got_phase == phase, f"rank {me}: expected PeerTimeoutError for {phase}, got: {message}"
        assert peer == (SILENT, (SILENT,)) and f"waited {TIMEOUT_S:g} s for rank {SILENT} and" in message, \
            (peer, message)
