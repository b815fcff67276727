"""Where a Buffer's work goes: the current stream (synchronous calls) or the communication stream
(``async_finish=True``), and the ordering between the two.

Every call of one Buffer shares its device state (counters, staging slots, receive areas), so its work
must stay in order whichever stream it runs on: a synchronous call waits for an asynchronous call's
work still on the communication stream, and an asynchronous call after a synchronous one waits for
everything on the current stream (not only ``previous_event``).
"""

from __future__ import annotations

from typing import Callable

import torch

from . import _validate as V
from .event import EventOverlap


class CallStreams:
    """The communication stream of a Buffer on ``device`` (None on CPU) and what ran where last."""

    def __init__(self, device: torch.device) -> None:
        self.comm = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.comm_pending = False  # an asynchronous call's work may still run on the comm stream
        self.last_on_current = False  # the last call's work went on the current stream

    def sync(self) -> None:
        """Before work queued on the current stream (a synchronous call)."""
        if self.comm_pending:
            torch.cuda.current_stream().wait_stream(self.comm)
            self.comm_pending = False
        self.last_on_current = True

    def now(self, previous_event: EventOverlap | None, async_finish: bool, allocate_on_comm_stream: bool) -> bool:
        """Whether a call with these arguments is :meth:`run`'s common case, a synchronous call with no event to wait
        for; then the current stream is made ready for it (:meth:`sync`) and the caller runs its work right here,
        with an empty ``EventOverlap``, without building ``run``'s closure and input list."""
        if previous_event is None and not async_finish and not allocate_on_comm_stream:
            self.sync()
            return True
        return False

    def run(self, fn: Callable, inputs: list, previous_event: EventOverlap | None, async_finish: bool,
            allocate_on_comm_stream: bool):
        """``fn()`` on the current stream (synchronous: after ``previous_event``) or on the communication
        stream (``async_finish``: after ``previous_event``, else after the current stream); returns
        ``(result, EventOverlap)``."""
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise ValueError("allocate_on_comm_stream=True needs previous_event and async_finish=True, got "
                             f"previous_event={previous_event!r}, async_finish={async_finish}")
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise TypeError(f"previous_event must be an EventOverlap, got {type(previous_event).__name__}")
        if self.comm is None:
            return fn(), EventOverlap()
        if not async_finish:
            # its results are the current stream's when it returns: no stream switch, record_stream or join
            if previous_event is not None and previous_event.event is not None:
                torch.cuda.current_stream().wait_event(previous_event.event)
            self.sync()
            return fn(), EventOverlap()
        compute = torch.cuda.current_stream()
        if previous_event is not None and previous_event.event is not None and not self.last_on_current:
            self.comm.wait_event(previous_event.event)
        else:
            self.comm.wait_stream(compute)
        self.last_on_current, self.comm_pending = False, True
        with torch.cuda.stream(self.comm):
            result = fn()
        outs = V.tensors_in(result)
        for t in outs:
            if t.is_cuda:
                t.record_stream(compute)
        ins = V.tensors_in(inputs)
        for t in ins:
            if t.is_cuda:
                t.record_stream(self.comm)
        ev = torch.cuda.Event()
        ev.record(self.comm)
        return result, EventOverlap(ev, tuple(outs) + tuple(ins))
