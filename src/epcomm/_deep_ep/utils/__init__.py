"""``deep_ep.utils`` under the switch ``EPCOMM_AS_DEEP_EP=1``: the names DeepEP V1's module exports.

Megatron-Core writes ``from deep_ep.utils import EventHandle, EventOverlap``.
"""

from epcomm.config import Config
from epcomm.event import EventHandle, EventOverlap

__all__ = ["Config", "EventHandle", "EventOverlap", "check_nvlink_connections"]


def check_nvlink_connections(group) -> None:
    """DeepEP asserts here that PCIe GPUs of ``group`` are NVLink-connected. epcomm needs no such
    check: a Buffer picks its backend from what the group offers (``epcomm env`` says which), so this
    accepts any group."""
