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


def test_a_timeout_names_every_rank_that_never_arrived(monkeypatch):
    monkeypatch.setattr(errors, "_GAVE_UP", set())
    one = PeerTimeoutError(0, "dispatch/notify", None, 10.0, ranks=[2])
    assert (one.rank, one.ranks) == (2, (2,))
    assert str(one).startswith("epcomm rank 0: dispatch/notify waited 10 s for rank 2 and gave up; ")
    two = PeerTimeoutError(1, "barrier", None, 10.0, ranks=(3, 0))
    assert (two.rank, two.ranks) == (0, (0, 3)) and "waited 10 s for ranks 0 and 3 and gave up" in str(two)
    none = PeerTimeoutError(1, "barrier", None, 10.0, ranks=())
    assert (none.rank, none.ranks) == (None, ()) and "for a peer" in str(none)
    lost = PeerLostError(1, "dispatch/notify", None, "Connection closed by peer", ranks=(2,))
    assert (lost.rank, lost.ranks) == (2, (2,))
    assert str(lost) == ("epcomm rank 1: dispatch/notify lost a peer (Connection closed by peer); rank 2 had not "
                         "arrived; did a rank exit or fail?")


def test_a_timeout_names_what_set_its_deadline(monkeypatch):
    import pickle

    from epcomm import _env

    monkeypatch.setattr(errors, "_GAVE_UP", set())
    set_by = _env.Seconds(12, "num_cpu_timeout_secs")
    assert set_by == 12.0 and pickle.loads(pickle.dumps(set_by)).source == "num_cpu_timeout_secs"
    assert str(PeerTimeoutError(0, "ElasticBuffer.barrier", 1, set_by)).endswith(
        "(num_cpu_timeout_secs=12 sets the deadline)")
    assert str(PeerTimeoutError(0, "barrier", 1, 30.0)).endswith("(the default deadline; EPCOMM_TIMEOUT_S sets it)")
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "7.5")
    assert str(PeerTimeoutError(0, "barrier", 1, _env.timeout_s(30.0))).endswith(
        "(EPCOMM_TIMEOUT_S=7.5 sets the deadline)")
    monkeypatch.delenv("EPCOMM_TIMEOUT_S")
    assert _env.timeout_s(set_by) is set_by


def test_the_roll_call_reads_who_announced(monkeypatch):
    """``deadline._RollCall`` on a store: each wait of a phase has its own keys; the missing are the ranks
    that announced nothing for it."""

    class Store:
        def __init__(self):
            self.keys = set()

        def set(self, k, v):
            self.keys.add(k)

        def check(self, ks):
            return all(k in self.keys for k in ks)

    store, group = Store(), types.SimpleNamespace(group_name="g")
    monkeypatch.setattr(deadline, "_WAITS", {})
    monkeypatch.setattr(deadline.dist.distributed_c10d, "_get_process_group_store", lambda g: store, raising=False)
    monkeypatch.setattr(deadline.dist, "get_rank", lambda g: 1)
    monkeypatch.setattr(deadline.dist, "get_world_size", lambda g: 4)
    first, second = deadline._RollCall(group, "dispatch/notify"), deadline._RollCall(group, "dispatch/notify")
    store.set("epcomm/arrived/dispatch/notify/0/3", "1")  # rank 3 arrived at the first wait only
    assert first.missing(0.0) == (0, 2) and second.missing(0.0) == (0, 2, 3)
    assert "epcomm/arrived/dispatch/notify/0/1" in store.keys  # (reading announces this rank too)
    monkeypatch.setattr(deadline.dist.distributed_c10d, "_get_process_group_store", lambda g: None, raising=False)
    assert deadline._RollCall(group, "barrier").missing(0.0) is None  # no store: not known
