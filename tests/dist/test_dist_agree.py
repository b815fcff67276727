"""Tier 2 (gloo on CPU, spawned processes, world sizes 2 and 3; or NCCL on GPUs, see ``harness``): ranks that
disagree on an argument every rank must pass alike raise ``ValueError`` on every rank naming it and each
rank's value, at the first call of the kind, and stay in step (``agree_checks``: ``Buffer``'s high-throughput
and low-latency calls, ``ElasticBuffer``'s dispatch and combine). Was: ``num_experts`` 16 on one rank and 32 on
another, or a hidden size of 256 against 512, aborted one process inside gloo (``gloo::EnforceNotMet ...
Received data size doesn't match expected size``) and the other lost it.

The same checks run on the nvlink and internode backends on CPU processes (test_nvlink_cpu.py,
test_internode_ht_cpu.py, test_elastic_backends_cpu.py).
"""

from __future__ import annotations

import functools

import agree_checks
import harness
import pytest

WORLD_SIZES = (2, 3)


def check_v1(ctx):
    from epcomm import Buffer

    agree_checks.v1(ctx, functools.partial(Buffer, ctx.group))


def check_low_latency(ctx):
    from epcomm import Buffer

    agree_checks.low_latency(ctx, functools.partial(Buffer, ctx.group))


def check_v2(ctx):
    harness.reference_only("ElasticBuffer's engine is selected by the rule; the device backends' run in "
                           "test_elastic_backends_cpu.py")
    from epcomm import ElasticBuffer

    agree_checks.v2(ctx, ElasticBuffer)


CHECKS = [("v1", check_v1), ("low_latency", check_low_latency), ("v2", check_v2)]


def rank_main(ctx):
    return harness.run_checks(ctx, CHECKS)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("check_name", [n for n, _ in CHECKS])
def test_arguments_that_differ_across_ranks(world_size, check_name):
    harness.report(harness.launch_cached(rank_main, world_size), check_name)
