"""The errors of a wait on a peer, the deadline they name, and the record of the process groups on which
one gave up.

A leaf module of the backends: ``base`` (the backend interface) and ``deadline`` (the bounded host waits) use it.
A deadline that knows what set it is an ``_env.Seconds``.
"""

from __future__ import annotations

_GAVE_UP: set[str] = set()  # names of the process groups on which a wait of epcomm's gave up ("": unnamed)


def deadline_note(timeout_s: float) -> str:
    """What set the deadline ``timeout_s``, for a message. Example: ``"num_cpu_timeout_secs=12 sets the
    deadline"`` for ``_env.Seconds(12, "num_cpu_timeout_secs")``; for a plain float (the default deadline),
    the variable that sets it."""
    source = getattr(timeout_s, "source", None)
    if source is None:
        return "the default deadline; EPCOMM_TIMEOUT_S sets it"
    return f"{source}={timeout_s:g} sets the deadline"


def _who(ranks: tuple[int, ...]) -> str:
    """``(2,)`` -> "rank 2", ``(1, 3)`` -> "ranks 1 and 3", ``()`` -> "a peer"."""
    if not ranks:
        return "a peer"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _missing(peer: int | None, ranks) -> tuple[int, ...]:
    if ranks:
        return tuple(sorted(ranks))
    return (peer,) if peer is not None and peer >= 0 else ()


class PeerTimeoutError(TimeoutError):
    """A wait on a peer passed its deadline. ``ranks`` are the peers that had not arrived (empty if not
    known), ``rank`` the first of them (else ``peer`` as given: None or -1 if unknown), ``phase`` the step.

    Raising it records ``group`` (or, when not given, every group) as given up: see :func:`gave_up`."""

    def __init__(self, me: int, phase: str, peer: int | None, timeout_s: float, detail: str = "",
                 group=None, ranks=None):
        missing = _missing(peer, ranks)
        msg = (f"epcomm rank {me}: {phase} waited {timeout_s:g} s for {_who(missing)} and gave up"
               + (f" ({detail})" if detail else "")
               + f"; is every rank calling the same epcomm operation? ({deadline_note(timeout_s)})")
        super().__init__(msg)
        self.ranks = missing
        self.rank = missing[0] if missing else peer
        self.phase = phase
        _GAVE_UP.add(getattr(group, "group_name", "") if group is not None else "")


class PeerLostError(PeerTimeoutError):
    """A wait on a peer ended because the transport lost the peer (its connection closed: the process
    died or tore its group down). A ``PeerTimeoutError``, so one ``except`` serves both. ``rank``: the peer
    where the transport says which; ``ranks``: the peers that had not arrived at the wait, where known."""

    def __init__(self, me: int, phase: str, peer: int | None, detail: str, group=None, ranks=None):
        missing = _missing(None, ranks)
        lost = f"rank {peer}" if peer is not None and peer >= 0 else "a peer"
        TimeoutError.__init__(self, f"epcomm rank {me}: {phase} lost {lost} ({detail})"
                              + (f"; {_who(missing)} had not arrived" if missing else "")
                              + "; did a rank exit or fail?")
        self.ranks = missing or _missing(peer, None)
        self.rank = self.ranks[0] if self.ranks else peer
        self.phase = phase
        _GAVE_UP.add(getattr(group, "group_name", "") if group is not None else "")


def gave_up(group) -> bool:
    """Whether a wait of epcomm's on ``group`` passed its deadline or lost a peer in this process (a
    ``PeerTimeoutError`` that named no group counts for every group). The group's ranks are then out of
    step: teardown skips its collectives, which would wait on the peer again."""
    return bool(_GAVE_UP & {"", getattr(group, "group_name", "")})
