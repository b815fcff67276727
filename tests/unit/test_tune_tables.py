"""Tier 1: every ``EPCOMM_TUNE`` table's keys, each a launch constant or a switch; at most six switches.

A switch is an entry that turns a code path on or off or picks a mode: a bool or a string value. Every int
entry is listed here as a launch constant (block sizes, warps, stages, chunk counts, role weights), so a new
key fails this test until it is classified; an on/off or mode entry is a bool or a string, never an int. Each
switch is named in docs/architecture.md beside the committed measurement that keeps its other value."""

from __future__ import annotations

import os

from epcomm.backends import internode_ht, internode_ll, nvlink_ll, nvlink_params

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_SWITCHES = 6

NVLINK = {"gather_rb", "gather_block", "gather_warps", "gather_stages", "reduce_tb", "reduce_block",
          "reduce_warps", "reduce_stages", "notify_block", "notify_warps", "push_rb", "push_block",
          "cpush_rb", "cpush_block", "ce_chunks", "ce_chunks_sync"}
NVLINK_LL = {"send_warps", "send_gc", "recv_warps", "recv_tb", "recv_qb", "recv_block", "recv_split",
             "csend_warps", "csend_block", "csend_programs", "crecv_warps", "crecv_block", "both_qb",
             "both_block", "both_sends", "both_gc", "both_warps"}
INTERNODE_HT = {"dispatch_warps", "dispatch_rb", "dispatch_block", "combine_warps", "combine_rb",
                "combine_block", "d_send", "d_forward", "d_receive", "c_send", "c_relay", "c_final",
                "d_p2p_rows", "final_block", "c_stages"}
INTERNODE_LL = {"send_warps", "send_gc", "recv_warps", "recv_tb", "recv_qb", "recv_block", "csend_warps",
                "csend_block", "csend_programs", "crecv_warps", "crecv_block"}
# EPCOMM_TUNE's prefix of each table, and the launch constants it holds
TABLES = {"": (nvlink_params.TUNE, NVLINK), "ll.": (nvlink_ll.TUNE, NVLINK_LL),
          "iht.": (internode_ht.TUNE, INTERNODE_HT), "ill.": (internode_ll.TUNE, INTERNODE_LL)}


def switches() -> list[str]:
    """Every table's switches (bool or string entries), as ``EPCOMM_TUNE`` names them."""
    return [prefix + k for prefix, (table, _) in TABLES.items() for k, v in table.items()
            if isinstance(v, (bool, str))]


def test_every_key_is_a_launch_constant_or_a_switch():
    for prefix, (table, constants) in TABLES.items():
        ints = {k for k, v in table.items() if type(v) is int}
        name = f"{prefix or 'nvlink_params.'}TUNE"
        assert ints == constants, (f"{name}: int entries not listed as launch constants "
                                   f"{sorted(ints - constants)}, listed but gone {sorted(constants - ints)}")
        odd = {k: v for k, v in table.items() if not isinstance(v, (bool, int, str))}
        assert not odd, odd


def test_at_most_six_switches_each_named_in_the_architecture_doc():
    found = switches()
    assert len(found) <= MAX_SWITCHES, found
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        doc = f.read()
    missing = [name for name in found if f"`{name}`" not in doc]
    assert not missing, f"switches not named in docs/architecture.md: {missing}"


def test_the_switches_are_these():
    assert sorted(switches()) == ["iht.p2p", "ll.fused_dispatch"]
