"""``deep_ep.ElasticBuffer`` under the switch ``EPCOMM_AS_DEEP_EP=1``: DeepEP V2's buffer (docs/v2.md)."""

import torch.distributed as dist

import epcomm.elastic
from epcomm.elastic import EPHandle

__all__ = ["EPHandle", "ElasticBuffer", "get_logical_domain_size", "get_physical_domain_size"]


class ElasticBuffer(epcomm.elastic.ElasticBuffer):
    """``epcomm.ElasticBuffer`` that follows DeepEP's device rule (as ``deep_ep.Buffer``: the current CUDA
    device where CUDA is available, whatever the group's backend)."""

    _cuda_whatever_the_group = True


def get_physical_domain_size(group) -> tuple[int, int]:
    """``(nodes, ranks a node)`` of ``group`` (hosts, or ``EPCOMM_GPUS_PER_NODE``); collective."""
    from epcomm.backends.internode import group_nodes

    nodes = len(set(group_nodes(group)[0]))
    return nodes, dist.get_world_size(group) // nodes


def get_logical_domain_size(group, allow_hybrid_mode: bool = True) -> tuple[int, int]:
    """``(1, R)``: epcomm lays a V2 dispatch out as DeepEP's direct mode on every topology (docs/v2.md)."""
    return 1, dist.get_world_size(group)
