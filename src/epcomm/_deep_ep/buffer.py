"""``deep_ep.buffer`` under the switch ``EPCOMM_AS_DEEP_EP=1``: DeepEP V1's module of ``Buffer``."""

import epcomm.buffer
from epcomm.config import Config

from .utils import EventOverlap, check_nvlink_connections

__all__ = ["Buffer", "Config", "EventOverlap", "check_nvlink_connections"]


class Buffer(epcomm.buffer.Buffer):
    """``epcomm.Buffer`` with DeepEP's device rule: where CUDA is available it runs on the current CUDA
    device whatever the group's backend, as DeepEP does (vLLM passes its CPU gloo group; the reference
    backend then stages its transfers through the host, the nvlink backend needs none). Everything
    else is ``epcomm.Buffer``'s."""

    _cuda_whatever_the_group = True
