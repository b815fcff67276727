"""``EventOverlap``: a CUDA event (or nothing, on CPU) plus tensors kept alive until it completes;
``EventHandle``: DeepEP's handle that records the current stream's position when it is made."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class EventHandle:
    """DeepEP's ``EventHandle``: made, it records an event on the current CUDA stream, so
    ``EventOverlap(EventHandle())`` is "everything queued on this stream so far" (Megatron-Core passes
    it as ``previous_event``).

    On CPU, or while CUDA is not initialised (no work can be queued), nothing is pending: ``event`` is
    ``None`` and waiting is a no-op. ``wait(stream)`` lets ``torch.cuda.Stream.wait_event`` take it.
    """

    def __init__(self) -> None:
        self.event: torch.cuda.Event | None = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the recorded position (no-op without an event)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def wait(self, stream=None) -> None:
        """Make ``stream`` (default: the current one) wait for the recorded position."""
        if self.event is not None:
            self.event.wait(stream)

    def query(self) -> bool:
        """Whether the recorded work has completed (always True without an event)."""
        return True if self.event is None else self.event.query()

    def synchronize(self) -> None:
        """Block the host until the recorded work has completed."""
        if self.event is not None:
            self.event.synchronize()

    def __repr__(self) -> str:
        return f"EventHandle(event={self.event!r})"


class EventOverlap:
    """Wraps a ``torch.cuda.Event`` recorded on the communication stream (or an ``EventHandle``).

    On CPU (and whenever the work already completed synchronously) the event is ``None`` and every
    method is a no-op. ``with event: body`` lets ``body`` overlap the communication and makes the
    current stream wait for it on exit.
    """

    def __init__(self, event: torch.cuda.Event | None = None, extra_tensors: tuple[Any, ...] | None = None):
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait: Callable[[], None] | None = None  # DeepEP V2: runs once, after the next wait
        self._release_on_exit = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Make the current CUDA stream wait for the event (no-op without one), then run the hook
        registered with :meth:`register_hook_after_wait`; ``release_handle`` drops the event afterwards."""
        if isinstance(self.event, (EventHandle, EventOverlap)):  # EventOverlap(an EventOverlap): its wait
            self.event.current_stream_wait()
        elif self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        hook, self.hook_after_wait = self.hook_after_wait, None
        if hook is not None:
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook: Callable[[], None]) -> None:
        """Run ``hook()`` after the next :meth:`current_stream_wait` (DeepEP V2; one hook at a time)."""
        if self.hook_after_wait is not None:
            raise ValueError("a hook is already registered on this EventOverlap")
        self.hook_after_wait = hook

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        """``with event(release_handle=True): ...`` (DeepEP V2): the wait on exit also drops the event."""
        self._release_on_exit = bool(release_handle)
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.current_stream_wait(self._release_on_exit)

    def __repr__(self) -> str:
        return f"EventOverlap(event={self.event!r})"
