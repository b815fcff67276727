"""Tier 1: ``ElasticBuffer.barrier`` on a GPU orders every rank's earlier device work before any rank goes on, as
DeepEP's barrier kernel does on the stream: the device is synchronised before the ranks meet (a meeting alone would
let a peer's later kernels read memory this rank's earlier copies were still writing). Called on a stand-in buffer
with ``torch.cuda.synchronize`` recorded, so it runs without a GPU; the meeting itself is tier 2's."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from epcomm import ElasticBuffer


@pytest.mark.parametrize("with_cpu_sync, expected", [(False, ["sync", "meet"]), (True, ["sync", "meet", "sync"])])
def test_the_device_is_synchronised_before_the_ranks_meet(monkeypatch, with_cpu_sync, expected):
    order = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: order.append("sync"))
    stand_in = SimpleNamespace(device=torch.device("cuda", 0), _check_alive=lambda: None,
                               _meet=lambda phase: order.append("meet"))
    for use_comm_stream in (True, False):
        order.clear()
        ElasticBuffer.barrier(stand_in, use_comm_stream=use_comm_stream, with_cpu_sync=with_cpu_sync)
        assert order == expected


def test_on_the_cpu_the_ranks_only_meet(monkeypatch):
    order = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: order.append("sync"))
    stand_in = SimpleNamespace(device=torch.device("cpu"), _check_alive=lambda: None,
                               _meet=lambda phase: order.append(phase))
    ElasticBuffer.barrier(stand_in, with_cpu_sync=True)
    assert order == ["ElasticBuffer.barrier"]
