"""Tier 1: the pieces of ``backends/deadline.py`` and ``base.gave_up`` that need no process group: which
backend serves which device, which groups a ``PeerTimeoutError`` marks as given up, the messages of
the two errors, and the watchdog of a wait epcomm cannot bound itself."""

from __future__ import annotations

import logging
import time
import types

import pytest
import torch

from epcomm.backends import base, deadline, errors
from epcomm.backends.base import PeerLostError, PeerTimeoutError


@pytest.mark.parametrize("name, device, expected", [
    ("gloo", "cpu", "gloo"),
    ("nccl", "cuda", "nccl"),
    ("cpu:gloo,cuda:gloo", "cuda", "gloo"),  # the shared-GPU mode: CUDA tensors through gloo
    ("cpu:gloo,cuda:nccl", "cuda", "nccl"),
    ("cpu:gloo,cuda:nccl", "cpu", "gloo"),
])
def test_backend_for_a_device(monkeypatch, name, device, expected):
    monkeypatch.setattr(deadline.dist, "get_backend", lambda group: name)
    assert deadline.backend_for(object(), torch.device(device)) == expected


def test_a_timeout_marks_its_group_and_only_it(monkeypatch):
    monkeypatch.setattr(errors, "_GAVE_UP", set())
    a, b = types.SimpleNamespace(group_name="a"), types.SimpleNamespace(group_name="b")
    assert not base.gave_up(a) and not base.gave_up(b)
    err = PeerTimeoutError(0, "dispatch/notify", 1, 2.0, group=a)
    assert base.gave_up(a) and not base.gave_up(b)
    assert str(err).startswith("epcomm rank 0: dispatch/notify waited 2 s for rank 1 and gave up")
    PeerLostError(3, "barrier", None, "Connection reset by peer", group=b)
    assert base.gave_up(b)


def test_a_timeout_without_a_group_marks_every_group(monkeypatch):
    monkeypatch.setattr(errors, "_GAVE_UP", set())
    PeerTimeoutError(0, "low_latency_dispatch/receive", 2, 1.0)
    assert base.gave_up(types.SimpleNamespace(group_name="any"))


def test_peer_lost_names_the_rank_and_the_phase(monkeypatch):
    monkeypatch.setattr(errors, "_GAVE_UP", set())
    err = PeerLostError(1, "dispatch/notify", None, "Connection reset by peer")
    assert isinstance(err, PeerTimeoutError) and err.phase == "dispatch/notify" and err.rank is None
    assert str(err) == ("epcomm rank 1: dispatch/notify lost a peer (Connection reset by peer); "
                        "did a rank exit or fail?")


def test_watch_logs_a_wait_that_outlasts_the_deadline(caplog):
    with caplog.at_level(logging.ERROR, logger="epcomm.backends.deadline"):
        with deadline.watch(2, "the symmetric-memory rendezvous", 0.05):
            time.sleep(0.3)
        with deadline.watch(2, "a quick step", 5.0):
            pass
    assert [r.getMessage() for r in caplog.records] == [
        "epcomm rank 2: the symmetric-memory rendezvous has waited 0.05 s for the other ranks and has no "
        "deadline of its own (it waits up to the process group's timeout); is every rank building this Buffer?"]
