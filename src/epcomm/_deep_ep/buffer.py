"""``deep_ep.buffer`` under the switch ``EPCOMM_AS_DEEP_EP=1``: DeepEP V1's module of ``Buffer``."""

from epcomm.buffer import Buffer
from epcomm.config import Config

from .utils import EventOverlap, check_nvlink_connections

__all__ = ["Buffer", "Config", "EventOverlap", "check_nvlink_connections"]
