"""The errors of a wait on a peer, and the record of the process groups on which one gave up.

A leaf module: ``base`` (the backend interface) and ``deadline`` (the bounded host waits) both use it.
"""

from __future__ import annotations

_GAVE_UP: set[str] = set()  # names of the process groups on which a wait of epcomm's gave up ("": unnamed)


class PeerTimeoutError(TimeoutError):
    """A wait on a peer passed its deadline. ``rank`` is the peer (or -1 if unknown), ``phase`` the step.

    Raising it records ``group`` (or, when not given, every group) as given up: see :func:`gave_up`."""

    def __init__(self, me: int, phase: str, peer: int | None, timeout_s: float, detail: str = "",
                 group=None):
        who = f"rank {peer}" if peer is not None and peer >= 0 else "a peer"
        msg = (f"epcomm rank {me}: {phase} waited {timeout_s:g} s for {who} and gave up"
               + (f" ({detail})" if detail else "")
               + "; is every rank calling the same epcomm operation? (EPCOMM_TIMEOUT_S sets the deadline)")
        super().__init__(msg)
        self.rank = peer
        self.phase = phase
        _GAVE_UP.add(getattr(group, "group_name", "") if group is not None else "")


class PeerLostError(PeerTimeoutError):
    """A wait on a peer ended because the transport lost the peer (its connection closed: the process
    died or tore its group down). A ``PeerTimeoutError``, so one ``except`` serves both."""

    def __init__(self, me: int, phase: str, peer: int | None, detail: str, group=None):
        TimeoutError.__init__(self, f"epcomm rank {me}: {phase} lost "
                              + (f"rank {peer}" if peer is not None and peer >= 0 else "a peer")
                              + f" ({detail}); did a rank exit or fail?")
        self.rank = peer
        self.phase = phase
        _GAVE_UP.add(getattr(group, "group_name", "") if group is not None else "")


def gave_up(group) -> bool:
    """Whether a wait of epcomm's on ``group`` passed its deadline or lost a peer in this process (a
    ``PeerTimeoutError`` that named no group counts for every group). The group's ranks are then out of
    step: teardown skips its collectives, which would wait on the peer again."""
    return bool(_GAVE_UP & {"", getattr(group, "group_name", "")})
