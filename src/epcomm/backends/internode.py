"""The internode backend (issue 16): nodes, NVSHMEM start-up, and whether the backend can run.

What is built: the node map (hosts, or virtual nodes of ``EPCOMM_GPUS_PER_NODE`` ranks), the NVSHMEM
settings applied before NVSHMEM initialises (``_env.nvshmem_settings``), NVSHMEM symmetric memory
through torch (:func:`nvshmem_symmetric`), the device-call layer ``kernels/nvshmem.py`` with its
simulation, and the ordering check ``testing/nvshmem_order.py``.

What is not built yet: the dispatch and combine kernels over it (hierarchical high-throughput and
low-latency across nodes). :func:`availability` says so, so the selection rule never picks this
backend and ``EPCOMM_BACKEND=internode`` raises with that reason: groups that span nodes run the
reference backend (NCCL) until they exist. docs/internode.md has the design they follow.

Letters: ``R`` ranks, ``N`` GPUs per node, ``P = R / N`` nodes.
"""

from __future__ import annotations

import logging
import socket
import zlib

import torch
import torch.distributed as dist

from .. import _env

log = logging.getLogger(__name__)

BUILT = False  # the dispatch/combine kernels over NVSHMEM (see the module docstring)
NOT_BUILT = ("the internode backend's dispatch and combine kernels are not built yet (issue 16: NVSHMEM "
             "start-up, the device-call layer and its ordering check are); groups across nodes run the "
             "reference backend")

_applied: dict | None = None  # the NVSHMEM settings in force once applied in this process


def node_map(hosts: list, gpus_per_node: int | None) -> tuple[list[int], str]:
    """``(node of each rank, how the nodes were formed)`` for ranks on ``hosts`` (one entry per rank).

    Without virtual nodes a node is a host; its ranks must be consecutive (as torchrun places them).
    With ``gpus_per_node = N`` rank ``r`` is on node ``r // N``; ``N`` divides ``R`` and no node spans
    hosts. Example: hosts ``[a, a, a, a]``, ``N = 2`` -> ``[0, 0, 1, 1]``; hosts ``[a, a, b, b]``,
    ``N = None`` -> ``[0, 0, 1, 1]``.
    """
    r_ = len(hosts)
    if gpus_per_node is None:
        nodes, seen = [], {}
        for r, h in enumerate(hosts):
            if h not in seen:
                seen[h] = len(seen)
            elif nodes[-1] != seen[h]:
                raise ValueError(f"the ranks of a host must be consecutive (rank {r} is on host {seen[h]} "
                                 f"after host {nodes[-1]}); launch with torchrun's default placement")
            nodes.append(seen[h])
        counts = {n: nodes.count(n) for n in set(nodes)}
        if len(set(counts.values())) > 1:
            raise ValueError(f"every host needs the same number of ranks, got {sorted(counts.values())}")
        return nodes, f"{len(counts)} host(s) of {r_ // len(counts)} rank(s)"
    n = gpus_per_node
    if r_ % n:
        raise ValueError(f"EPCOMM_GPUS_PER_NODE={n} does not divide the group's {r_} ranks")
    nodes = [r // n for r in range(r_)]
    for node in range(r_ // n):
        if len({hosts[r] for r in range(node * n, node * n + n)}) > 1:
            raise ValueError(f"EPCOMM_GPUS_PER_NODE={n}: virtual node {node} (ranks {node * n}..{node * n + n - 1})"
                             " spans hosts")
    return nodes, f"{r_ // n} virtual node(s) of {n} rank(s) (EPCOMM_GPUS_PER_NODE={n})"


def group_nodes(group, device_index: int | None = None) -> tuple[list[int], str]:
    """:func:`node_map` for ``group`` (collective: every rank calls it). Every rank must set the same
    ``EPCOMM_GPUS_PER_NODE``."""
    rows: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(rows, (zlib.crc32(socket.gethostname().encode()), _env.gpus_per_node()), group=group)
    if len({r[1] for r in rows}) > 1:
        raise ValueError("EPCOMM_GPUS_PER_NODE differs across ranks: "
                         + ", ".join(f"{r[1]} on rank {i}" for i, r in enumerate(rows)))
    return node_map([r[0] for r in rows], rows[0][1])


def prepare_nvshmem(num_qps_per_rank: int, symmetric_bytes: int) -> dict:
    """Apply the NVSHMEM settings (where the user has not set them) before NVSHMEM initialises, and
    switch torch's symmetric memory to the NVSHMEM backend. Returns the settings in force. A second
    Buffer asking for other settings after NVSHMEM started gets a warning: NVSHMEM reads them once."""
    global _applied
    wanted = _env.nvshmem_settings(num_qps_per_rank, symmetric_bytes)
    if _applied is None:
        _applied = _env.apply_nvshmem_settings(wanted)
        log.info("epcomm: NVSHMEM settings %s", ", ".join(f"{k}={v} ({who})" for k, (v, who) in _applied.items()))
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
    else:
        differ = {k: v for k, v in wanted.items()
                  if k != "NVSHMEM_SYMMETRIC_SIZE" and _applied.get(k, (v,))[0] != v}
        if differ:
            log.warning("epcomm: NVSHMEM started with %s; this Buffer asks for %s, which cannot apply now",
                        {k: _applied[k][0] for k in differ}, differ)
    return dict(_applied)


def nvshmem_symmetric(nbytes: int, device, group):
    """A ``uint8[nbytes]`` NVSHMEM symmetric buffer and its rendezvous handle (after :func:`prepare_nvshmem`)."""
    import torch.distributed._symmetric_memory as symm_mem

    t = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    return t, symm_mem.rendezvous(t, group.group_name)


def create(buf):
    """The backend for ``buf``: not built yet (``availability`` reports it, so this is not reached)."""
    raise RuntimeError(NOT_BUILT)


def availability(buf) -> tuple[bool, str]:
    """Whether the internode backend can run for this Buffer, and why (collective: all ranks call)."""
    if buf.device.type != "cuda":
        return False, "the group is not on CUDA (gloo/CPU tensors)"
    try:
        import torch.distributed._symmetric_memory as symm_mem
        import triton  # noqa: F401

        from ..kernels import nvshmem
    except ImportError as e:
        return False, f"needs triton and torch symmetric memory ({e})"
    if not nvshmem.available() or not symm_mem.is_nvshmem_available():
        return False, "NVSHMEM is not available to torch here (pip install nvidia-nvshmem-cu12 matching torch)"
    if torch.cuda.get_device_capability(buf.device)[0] < 8:
        return False, "needs an SM80+ GPU"
    if not BUILT:
        return False, NOT_BUILT
    return True, "NVSHMEM is available"
