"""The V2 metadata in the gather (``TUNE["v2_meta_in_gather"]``): ``ElasticBuffer``'s contiguous no-sync dispatch
hands the outputs of ``elastic_layout.recv_meta`` to the nvlink backend's dispatch plan, whose gather
(``kernels/ht_receive._dispatch_impl_kernel`` with ``V2META``) writes them, so the dispatch launches no
``_dispatch_copy_epilogue_impl_meta_kernel`` after its transfer. This module holds what the plan adds to the
gather's launch for it; the kernel's arguments after ``push_ticket_ptr`` are, in order, ``gid, local, local_out,
meta, counts, psum, psum_rank, cum, part, topk_copy, send_head, dst_slot, M, A`` (:data:`GATHER_ARGS`).

Imports nothing of the backend (``elastic_engine`` takes :class:`V2Meta` from here; ``nvlink_params`` reads the
interpreter's variable when imported).

Letters: ``T`` tokens, ``K`` top-k, ``R`` ranks, ``L`` local experts, ``M`` max tokens a rank, ``N`` rows.
"""

from __future__ import annotations

from typing import NamedTuple

# the gather's arguments for the metadata: their first position, and the tensors ``run`` takes (``send_head``,
# the plan's own, goes in before ``dst_slot``)
GATHER_AT = 47
GATHER_ARGS = ("gid", "local", "local_out", "meta", "counts", "psum", "psum_rank", "cum", "part", "topk_copy",
               "send_head", "dst_slot")


class V2Meta(NamedTuple):
    """A contiguous no-sync V2 dispatch's metadata, as ``recv_meta`` takes it: ``m`` (max tokens a rank),
    ``alignment``, whether the call adds to cumulative statistics (``has_cum``) and copies the top-k ids
    (``copy_topk``)."""

    m: int
    alignment: int
    has_cum: bool
    copy_topk: bool


def meta_in_gather(tune: dict, transfer: str, has_topk: bool) -> bool:
    """Whether a dispatch plan of this backend may write the V2 metadata in its gather: ``tune
    ["v2_meta_in_gather"]`` (``nvlink_params.TUNE``), the SM transfer, a dispatch with top-k ids."""
    return bool(tune["v2_meta_in_gather"]) and transfer == "sm" and has_topk


def gather_consts(v2: V2Meta | None, lep: int) -> dict:
    """The gather's constexprs for ``v2`` (None: the defaults, no metadata) with ``L`` local experts, ``lep``
    the power of two ``>= L``."""
    if v2 is None:
        return {}
    return dict(V2META=True, V2_CUM=v2.has_cum, V2_COPY_TOPK=v2.copy_topk, V2_HB=max(lep, 32), V2_LEP=lep)


def gather_template(v2: V2Meta | None, filler) -> tuple[list, list]:
    """``(the template's entries from GATHER_AT, the holes among them)``: without ``v2`` every pointer is
    ``filler`` (read by no code of that variant) and ``M = A = 0``."""
    n = len(GATHER_ARGS)
    if v2 is None:
        return [filler] * n + [0, 0], []
    return [None] * n + [v2.m, v2.alignment], list(range(GATHER_AT, GATHER_AT + n))
