"""``EventOverlap``: a CUDA event (or nothing, on CPU) plus tensors kept alive until it completes."""

from __future__ import annotations

from typing import Any

import torch


class EventOverlap:
    """Wraps a ``torch.cuda.Event`` recorded on the communication stream.

    On CPU (and whenever the work already completed synchronously) the event is ``None`` and every
    method is a no-op. ``with event: body`` lets ``body`` overlap the communication and makes the
    current stream wait for it on exit.
    """

    def __init__(self, event: torch.cuda.Event | None = None, extra_tensors: tuple[Any, ...] | None = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the event (no-op without one)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.current_stream_wait()

    def __repr__(self) -> str:
        return f"EventOverlap(event={self.event!r})"
