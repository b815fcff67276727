"""``deep_ep.utils.event`` under the switch ``EPCOMM_AS_DEEP_EP=1``: DeepEP V2's module of ``EventOverlap``
(Megatron-Core falls back to it; vLLM imports ``EventOverlap`` from here)."""

from epcomm.event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
