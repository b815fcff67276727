"""A pytest plugin (tests/conftest.py registers it): the suite says how far it is, whatever the verbosity.

CI and README run ``python -m pytest -q``, whose dots alone stood still for minutes in tier 2. With this plugin
each test file ends with its name, its tests' count and time, and the session's count and clock::

    tests/unit/test_layout.py ......................... 25 tests, 0.6 s [38/890 at 0:09]

(with ``-q`` the plugin writes the name, which pytest leaves out; with ``-v``, where every test has its line,
the summary is a line of its own). A test that runs ``every_s`` (30 s) with no line written gets one, and
another every ``every_s`` after that::

    ... still in tests/dist/test_nvlink_cpu.py::test_x, 30 s [at 2:40]

That line comes from a thread, which writes only while a test runs (between its start and its end), holding a
lock that pytest's own writes of a test's start, reports and end take too, so the two never interleave. While a
test runs, pytest's capture points file descriptor 1 at a file of its own: the thread writes to a copy of the
terminal's descriptor taken when the tests were collected, and pytest's buffered marks are flushed before.
"""

from __future__ import annotations

import os
import threading
import time

import pytest


class ProgressLines:
    def __init__(self, every_s: float = 30.0):
        self.every_s = every_s
        self.lock = threading.Lock()
        self.tr = None  # pytest's terminal reporter, once the tests are collected
        self.running: tuple[str, float] | None = None  # (nodeid, start) of the test now running
        self.stop = threading.Event()

    # -- session

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session):
        self.tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if self.tr is None or session.config.option.collectonly:
            self.tr = None
            return
        self.quiet, self.verbose = self.tr.verbosity < 0, self.tr.verbosity > 0
        self.total, self.done = len(session.items), 0
        self.t0 = self.last_line = self.file_t0 = time.monotonic()
        self.file, self.file_tests, self.last_of_file = None, 0, False
        self.tr.flush()
        self.fd = os.dup(self.tr._tw._file.fileno())  # capture is suspended here: the terminal (or CI's pipe)
        threading.Thread(target=self._beat, name="pytest-progress-lines", daemon=True).start()

    def pytest_sessionfinish(self, session):
        self.stop.set()
        with self.lock:
            if self.tr is not None:
                os.close(self.fd)
                self.tr = None

    # -- each test

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if self.tr is None:
            return
        with self.lock:
            now = time.monotonic()
            name = item.nodeid.split("::", 1)[0]
            if name != self.file:
                self.file, self.file_t0, self.file_tests = name, now, 0
                if self.quiet:  # pytest -q writes no file names
                    self._write(f"{name} ")
            self.running, self.last_line = (item.nodeid, now), now
            self.last_of_file = nextitem is None or nextitem.path != item.path

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_logstart(self, nodeid, location):
        with self.lock:
            yield
            self._flush()

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_logreport(self, report):
        """pytest's reporter writes a test's mark here: never at the same time as a heartbeat line."""
        with self.lock:
            yield
            self._flush()

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_logfinish(self, nodeid, location):
        """The file's line after its last test: before pytest writes its progress on that row, or with ``-v``
        after it, as a line of its own."""
        with self.lock:
            self.running = None
            if self.tr is not None and not self.verbose:
                self._finish()
            yield
            if self.tr is not None and self.verbose:
                self._finish()

    # -- lines

    def _clock(self, now: float) -> str:
        s = int(now - self.t0)
        return f"{s // 60}:{s % 60:02d}"

    def _flush(self) -> None:
        if self.tr is not None:
            self.tr.flush()

    def _write(self, text: str) -> None:
        """``text`` at the start of a row (main thread, with the lock held)."""
        if self.tr._tw.width_of_current_line:
            self.tr.write("\n")
        self.tr.write(text, flush=True)
        self.last_line = time.monotonic()

    def _finish(self) -> None:
        """The end of a test (with the lock held)."""
        self.file_tests += 1
        self.done += 1
        if not self.last_of_file:
            return
        now, n = time.monotonic(), self.file_tests
        tail = (f"{n} test{'s' if n != 1 else ''}, {now - self.file_t0:.1f} s "
                f"[{self.done}/{self.total} at {self._clock(now)}]")
        if self.verbose:
            self._write(f"{self.file}: {tail}\n")
        else:  # on the row of the file's marks
            self.tr.write(" " + tail, flush=True)
            self.last_line = now

    def _beat(self) -> None:
        while not self.stop.wait(min(1.0, self.every_s / 4)):
            with self.lock:
                now = time.monotonic()
                if self.tr is None or self.running is None or now - self.last_line < self.every_s:
                    continue
                nodeid, start = self.running
                text = f"... still in {nodeid}, {now - start:.0f} s [at {self._clock(now)}]\n"
                if self.tr._tw.width_of_current_line:
                    text = "\n" + text
                os.write(self.fd, text.encode())
                self.tr._tw._current_line = ""  # what pytest's reporter counts its row's width from
                self.last_line = now
