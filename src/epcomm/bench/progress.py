"""A tiny progress bar on stderr (no dependency): redrawn in place on a terminal; elsewhere (a log
file, CI) a few lines only: the explicit messages and one line as each quarter of the steps is done.
Picklable, so a spawned rank can draw it."""

from __future__ import annotations

import dataclasses
import sys
import time


@dataclasses.dataclass
class Progress:
    total: int = 0
    enabled: bool = True
    width: int = 24
    done: int = 0
    start: float = dataclasses.field(default_factory=time.monotonic)

    def set_total(self, total: int) -> None:
        self.total = max(total, 0)

    def render(self, note: str = "") -> str:
        """The bar as text, e.g. ``[######------------------]  3/12  25%  4.1s  ht-dsv3 dispatch-bf16``."""
        total = max(self.total, 1)
        frac = min(self.done / total, 1.0)
        fill = round(frac * self.width)
        bar = "#" * fill + "-" * (self.width - fill)
        secs = time.monotonic() - self.start
        return f"[{bar}] {self.done:>3}/{self.total:<3} {frac:4.0%} {secs:6.1f}s  {note}".rstrip()

    def update(self, note: str = "", n: int = 1) -> None:
        """Advance by ``n`` and redraw with ``note`` (what runs next); off a terminal a line only when
        a quarter of the steps is crossed (``25%``, ``50%``, ``75%``, ``100%``)."""
        before = self.done
        self.done += n
        quarter = self.total > 0 and (4 * self.done) // self.total > (4 * before) // self.total
        self.show(note, always=bool(quarter))

    def show(self, note: str = "", always: bool = False) -> None:
        """Redraw with ``note`` (what runs now); off a terminal only ``always`` lines are written."""
        if not self.enabled:
            return
        err = sys.stderr
        if err.isatty():
            err.write("\r\033[K" + self.render(note))
        elif always:
            err.write(self.render(note) + "\n")
        err.flush()

    def close(self, note: str = "done") -> None:
        if not self.enabled:
            return
        if sys.stderr.isatty():
            sys.stderr.write("\r\033[K" + self.render(note) + "\n")
            sys.stderr.flush()
