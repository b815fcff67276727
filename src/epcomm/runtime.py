"""``Runtime``: what ``Buffer`` (DeepEP V1) and ``ElasticBuffer`` (DeepEP V2) both stand on.

One object per front end: the process group and this rank's place in it, the device its tensors live
on, the node of every rank, the backend chosen for them (and why), the streams a call's work goes on,
the deadline of a wait on a peer, and whether expert ids are checked on the host. The front ends hold
one each and never reach into each other; the backends read their sizes from it when they are built
(``backends.select_backend``).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist

from . import _env
from .backends import select_backend
from .backends.internode import group_nodes
from .streams import CallStreams

log = logging.getLogger(__name__)


class Runtime:
    """The group, device, nodes, backend, streams and deadline of one front end.

    ``cuda_whatever_the_group``: DeepEP's device rule (the current CUDA device whatever the group's
    backend; ``deep_ep.Buffer`` sets it), else epcomm's (CUDA where the group moves CUDA tensors: NCCL,
    or gloo named for CUDA too). ``timeout_s``: the deadline when ``EPCOMM_TIMEOUT_S`` is unset (None: 10 s
    on a GPU, 30 s on CPU). ``num_sms``: the SMs a
    high-throughput call may use when its ``Config`` names none (read at each call: ``Buffer.set_num_sms``
    changes it for every buffer). ``make_backend(runtime) -> Backend``: a backend made by the caller instead of
    the selection rule's (the CPU rigs of ``epcomm.testing`` run the device backends this way)."""

    def __init__(self, group, *, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 cuda_whatever_the_group: bool = False, timeout_s: float | None = None,
                 num_sms: Callable[[], int] = lambda: 20, make_backend: Callable | None = None,
                 elastic_shape: tuple[int, int, int] | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        # an ElasticBuffer's (num_max_tokens_per_rank, hidden, num_topk), where given: a backend whose
        # high-throughput region's layout the caller's size does not follow (internode) sizes it from these
        self.elastic_shape = elastic_shape
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self._num_sms = num_sms
        level = _env.log_level()
        if level:
            logging.getLogger("epcomm").setLevel(level.upper())
        backend_name = str(dist.get_backend(group)).lower()
        cuda_group = "nccl" in backend_name or "cuda:gloo" in backend_name or cuda_whatever_the_group
        if cuda_group and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        default = timeout_s if timeout_s is not None else (10.0 if self.device.type == "cuda" else 30.0)
        self.timeout_s = _env.timeout_s(float(default))
        self.streams = CallStreams(self.device)  # the communication stream and the order of calls
        # the node of every rank (hosts, or EPCOMM_GPUS_PER_NODE; collective, read once): the backend
        # selection uses it, and the dispatch layout counts tokens per node where there are several
        self.node_map = group_nodes(group, self.timeout_s)
        n_nodes = len(set(self.node_map[0]))
        self.ranks_per_node = self.group_size // n_nodes if n_nodes > 1 else None
        if make_backend is None:
            self.backend, why = select_backend(self)
        else:
            self.backend, why = make_backend(self), "made by the caller"
        # Range checks of expert ids need the values on the host: done by the front end unless the backend
        # checks them on the device (then a bad id raises at its next synchronisation, never a hang or a crash)
        self.host_checks = not self.backend.checks_topk_on_device
        log.info("epcomm rank %d: backend %s (%s)", self.rank, self.backend.name, why)

    @property
    def num_sms(self) -> int:
        return self._num_sms()

    def set_timeout(self, seconds: float, source: str) -> None:
        """A front end's own deadline (DeepEP V2's ``num_*_timeout_secs``, named by ``source`` in the errors of the
        waits that pass it), unless ``EPCOMM_TIMEOUT_S`` is set."""
        if _env.timeout_s(None) is None:
            self.timeout_s = self.backend.timeout_s = _env.Seconds(seconds, source)

    def destroy(self) -> None:
        self.backend.destroy()
