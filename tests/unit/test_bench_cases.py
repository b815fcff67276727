"""Tier 1: benchmark case sets, command-line overrides and their validation (no process group)."""

from __future__ import annotations

import itertools

import pytest

from epcomm.bench.cases import ALIASES, CASE_SETS, DEFAULT_CPU, DEFAULT_GPU, BenchCase, resolve_cases


def test_dsv3_shapes():
    (ht,) = CASE_SETS["ht-dsv3"]
    assert (ht.mode, ht.tokens, ht.hidden, ht.topk, ht.experts) == ("ht", 4096, 7168, 8, 256)
    (ll,) = CASE_SETS["ll-dsv3"]
    assert (ll.mode, ll.tokens, ll.hidden, ll.topk, ll.experts, ll.hook) == ("ll", 128, 7168, 8, 256, True)
    (ll288,) = CASE_SETS["ll-dsv3-288"]
    assert ll288.experts == 288 and ll288.tokens == 128


def test_sweep_spans_1_to_16384():
    ht = sorted(c.tokens for c in CASE_SETS["sweep"] if c.mode == "ht")
    assert ht[0] == 1 and ht[-1] == 16384 and all(b == 4 * a for a, b in itertools.pairwise(ht))
    ll = sorted(c.tokens for c in CASE_SETS["sweep"] if c.mode == "ll")
    assert ll[0] == 1 and all(b == 2 * a for a, b in itertools.pairwise(ll))


def test_rows_per_case():
    ht = CASE_SETS["ht-dsv3"][0].ops()
    assert [(o, d) for o, d, _ in ht] == [("dispatch", "bf16"), ("dispatch", "fp8"), ("combine", "bf16")]
    ll = CASE_SETS["ll-dsv3"][0].ops()
    assert ("dispatch", "fp8", ("total",)) in ll and ("combine", "bf16", ("total",)) in ll
    assert ("dispatch", "fp8", ("send", "recv")) in ll and ("combine", "bf16", ("send", "recv")) in ll
    no_hook = BenchCase("x", "ll", 8, 256, 2, 8).ops()
    assert all(p == ("total",) for _, _, p in no_hook)


def test_defaults_and_aliases_resolve():
    for names in (DEFAULT_GPU, DEFAULT_CPU, *([n] for n in ALIASES)):
        assert resolve_cases(list(names), world_size=2)
    cases = resolve_cases(["dsv3"], world_size=2)
    assert [c.name for c in cases] == ["ht-dsv3", "ll-dsv3", "ll-dsv3-288"]


def test_overrides_and_mode_filter():
    cases = resolve_cases(["ht-dsv3", "ll-dsv3"], world_size=2, tokens=[1, 64], hidden=1024, topk=4, experts=32)
    assert [(c.mode, c.tokens) for c in cases] == [("ht", 1), ("ht", 64), ("ll", 1), ("ll", 64)]
    assert all((c.hidden, c.topk, c.experts) == (1024, 4, 32) for c in cases)
    assert all(c.mode == "ll" for c in resolve_cases(["small", "sweep-small"], world_size=2, mode="ll"))
    # duplicates collapse, order is kept
    assert len(resolve_cases(["small", "small"], world_size=2)) == len(CASE_SETS["small"])


@pytest.mark.parametrize("kwargs, match", [
    ({"names": ["nope"]}, "unknown case 'nope'"),
    ({"names": ["ll-dsv3-288"], "world_size": 5}, "divisible by the world size 5"),
    ({"names": ["small"], "hidden": 200}, "multiple of 128"),
    ({"names": ["small"], "topk": 40}, "larger than experts"),
    ({"names": ["ht-dsv3"], "mode": "ll"}, "no case left"),
    ({"names": ["small"], "mode": "fast"}, "mode must be"),
])
def test_bad_requests_raise(kwargs, match):
    kwargs = {"world_size": 2, **kwargs}
    names = kwargs.pop("names")
    with pytest.raises(ValueError, match=match):
        resolve_cases(names, **kwargs)


def test_case_validates_itself():
    with pytest.raises(ValueError, match="mode"):
        BenchCase("x", "mid", 1, 128, 1, 2)
    with pytest.raises(ValueError, match="tokens"):
        BenchCase("x", "ht", 0, 128, 1, 2)


def test_sms_column_says_what_the_kernels_take(monkeypatch):
    """The SMs column: the config's num_sms where the kernels honour it (high-throughput, nvlink and
    internode); the low-latency kernels reach every SM."""
    import types

    import torch

    from epcomm import Buffer
    from epcomm.bench import runner

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=132))
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert runner._sms("nvlink", gpu, "ht") == runner._sms("internode", gpu, "ht") == Buffer.num_sms
    assert runner._sms("internode", gpu, "ll") == runner._sms("nvlink", gpu, "ll") == "all 132"
    # the reference and the peer move bytes through the group's transport: gloo when ranks share a GPU
    assert runner._sms("reference", gpu, "ht", "nccl") == "nccl" and runner._sms("reference", cpu, "ht") == "gloo"
    assert runner._sms("gloo-a2a", gpu, "ll", "gloo") == "gloo"


def test_internode_buffer_fits_the_runs_nodes(monkeypatch):
    """The bench sizes an internode Buffer for the run's ranks per node: at 4 ranks in nodes of 2 the
    hierarchical areas are larger than in nodes of 1, and the Buffer would refuse the call otherwise."""
    from epcomm.backends.internode_ht import high_throughput_bytes
    from epcomm.bench import runner
    from epcomm.bench.cases import resolve_cases

    cases = [c for c in resolve_cases(["ht-dsv3"], world_size=4) if c.mode == "ht"]
    need = {n: max(high_throughput_bytes(c.tokens, c.hidden, c.topk, 4, n) for c in cases) for n in (1, 2, 4)}
    assert need[2] > need[1]
    monkeypatch.setenv("EPCOMM_GPUS_PER_NODE", "2")
    assert runner._buffer_kwargs("ht", cases, 4, "internode")["num_nvl_bytes"] >= need[2]
    monkeypatch.delenv("EPCOMM_GPUS_PER_NODE")
    assert runner._buffer_kwargs("ht", cases, 4, "internode")["num_nvl_bytes"] >= max(need.values())
