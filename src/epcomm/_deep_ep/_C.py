# ruff: noqa: N999  (DeepEP names its native module deep_ep._C)
"""``deep_ep._C`` under the switch ``EPCOMM_AS_DEEP_EP=1``: DeepEP's native module has no counterpart in
epcomm; this stand-in holds the one name pure-Python code imports from it at module level
(``EventHandle``), so DeepEP's own test helpers (``deep_ep.utils.envs`` imports ``_C``) can be loaded
beside epcomm. Anything else raises ``AttributeError`` naming what is missing."""

from epcomm.event import EventHandle

__all__ = ["EventHandle"]


def __getattr__(name: str):
    raise AttributeError(f"deep_ep._C.{name} is DeepEP's native code, which epcomm does not provide")
