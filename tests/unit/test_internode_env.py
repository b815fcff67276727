"""Tier 1: the internode backend's host pieces that need no process group: the node map (hosts and
virtual nodes), ``EPCOMM_GPUS_PER_NODE``, the NVSHMEM settings and who wins when the user set one,
and ``epcomm env``'s internode section."""
import pytest

from epcomm import _env, doctor
from epcomm.backends.internode import node_map


def test_node_map_hosts_and_virtual_nodes():
    assert node_map(["a", "a", "b", "b"], None) == ([0, 0, 1, 1], "2 host(s) of 2 rank(s)")
    assert node_map(["a"] * 4, 2)[0] == [0, 0, 1, 1]
    assert node_map(["a"] * 4, 1)[0] == [0, 1, 2, 3]
    assert node_map(["a", "a", "b", "b"], 2)[0] == [0, 0, 1, 1]
    assert "virtual node(s) of 2" in node_map(["a"] * 4, 2)[1]
    with pytest.raises(ValueError, match="does not divide the group's 3 ranks"):
        node_map(["a"] * 3, 2)
    with pytest.raises(ValueError, match="virtual node 0 .* spans hosts"):
        node_map(["a", "b"], 2)
    with pytest.raises(ValueError, match="consecutive"):
        node_map(["a", "b", "a", "b"], None)
    with pytest.raises(ValueError, match="same number of ranks"):
        node_map(["a", "a", "b"], None)


def test_gpus_per_node_variable(monkeypatch):
    monkeypatch.delenv("EPCOMM_GPUS_PER_NODE", raising=False)
    assert _env.gpus_per_node() is None
    monkeypatch.setenv("EPCOMM_GPUS_PER_NODE", "2")
    assert _env.gpus_per_node() == 2
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv("EPCOMM_GPUS_PER_NODE", bad)
        with pytest.raises(ValueError, match=f"EPCOMM_GPUS_PER_NODE must be a positive integer, got '{bad}'"):
            _env.gpus_per_node()
    assert "EPCOMM_GPUS_PER_NODE" in _env.VARIABLES


def test_nvshmem_settings_map_the_buffer_arguments():
    s = _env.nvshmem_settings(num_qps_per_rank=8, symmetric_bytes=3 << 30, rdma_nic=True)
    assert s["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "8" and s["NVSHMEM_IB_ENABLE_IBGDA"] == "1"
    assert int(s["NVSHMEM_SYMMETRIC_SIZE"]) >= (3 << 30) + (256 << 20)
    s = _env.nvshmem_settings(num_qps_per_rank=24, symmetric_bytes=0, rdma_nic=False)
    assert "NVSHMEM_IB_ENABLE_IBGDA" not in s and s["NVSHMEM_SYMMETRIC_SIZE"] == str(1 << 30)
    with pytest.raises(ValueError, match="num_qps_per_rank must be >= 1, got 0"):
        _env.nvshmem_settings(0, 0)


def test_a_value_the_user_set_wins():
    environ = {"NVSHMEM_IBGDA_NUM_RC_PER_PE": "4"}
    got = _env.apply_nvshmem_settings({"NVSHMEM_IBGDA_NUM_RC_PER_PE": "24", "NVSHMEM_QP_DEPTH": "1024"}, environ)
    assert got == {"NVSHMEM_IBGDA_NUM_RC_PER_PE": ("4", "user"), "NVSHMEM_QP_DEPTH": ("1024", "epcomm")}
    assert environ == {"NVSHMEM_IBGDA_NUM_RC_PER_PE": "4", "NVSHMEM_QP_DEPTH": "1024"}


def test_epcomm_env_reports_the_internode_settings(monkeypatch):
    monkeypatch.setenv("EPCOMM_GPUS_PER_NODE", "1")
    monkeypatch.setenv("NVSHMEM_IB_SL", "3")
    title, lines = doctor.internode()
    text = "\n".join(lines)
    assert title == "internode (NVSHMEM)"
    assert "EPCOMM_GPUS_PER_NODE=1" in text and "NVSHMEM_IB_SL=3  (yours)" in text
    assert "NVSHMEM_IBGDA_NUM_RC_PER_PE=24" in text
    assert "a group across nodes runs: internode where NVSHMEM comes up (else reference): low-latency over " \
           "NVSHMEM; high-throughput hierarchical over NVSHMEM and NVLink" in text
    monkeypatch.setenv("EPCOMM_GPUS_PER_NODE", "zero")
    assert "virtual nodes: error: EPCOMM_GPUS_PER_NODE must be a positive integer" in "\n".join(doctor.internode()[1])


def test_ht_launch_key_tells_level_word_alignments_apart():
    """The HT engine's launch key fixes what Triton specialises on; a level word (a ``Ptr`` into the
    levels tensor, chosen by the call's parity) is 16-byte aligned or not, so the key must say which
    (tier 3 with EPCOMM_VERIFY_LAUNCH=1 caught a key that did not)."""
    import torch

    from epcomm.backends.internode_ht import _go
    from epcomm.kernels.launch import Ptr

    levels = torch.zeros(16, dtype=torch.int32)
    keys = []
    launcher = lambda key, grid, *args, **kw: keys.append(key)  # noqa: E731
    for i in range(2):
        _go(launcher, "relay", (1,), levels, 7, Ptr(levels[i:]))
    assert keys[0][1:3] == keys[1][1:3] == ((torch.int32, levels.data_ptr() & 15 == 0), (False, False, False))
    assert keys[0][3] != keys[1][3]
