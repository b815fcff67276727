"""Work that tier-2 tests need, run on a thread of this process beside the tests before theirs.

A test module queues what its selected tests will need as soon as the session's tests are collected
(``start_early(items)``, tests/conftest.py): launches of CPU ranks whose kernels run under the Triton interpreter
(``harness.queue_gloo_once``) and of whole check lists (``harness.queue_cached``), the longest work of tier 2, which
keeps two cores busy. One job runs at a time, in
the order queued (the order of the tests), from the moment ``release`` is called: tests/conftest.py releases the
queue once tier 1's kernel scripts have ended (they run at the lowest priority on the cores that tier 1 leaves idle,
and a queue of ordinary priority would take those). A test asks for its job's result (``result``): done, it gets
it; running, it waits; still queued, it waits for the jobs before it and its own (the queue runs them in the test
order, so those are the ones it needs next; running it here instead could run two launches of one module at once,
which share their simulated memory's file names). A job that was never queued runs in the caller. The result is
kept for the session (an exception as well, raised to each caller).

A job runs with the environment of its queueing (``environ`` of ``parallel_launch``), not with whatever a test
running meanwhile has set in this process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class _Job:
    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.done = threading.Event()
        self.value = self.error = None

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args, **self.kwargs)
        except BaseException as e:  # noqa: BLE001 - raised to each caller of result()
            self.error = e
        self.done.set()


class Queue:
    def __init__(self):
        self._jobs: dict = {}  # key -> _Job, queued or run
        self._queue: list = []  # keys not yet started, in order
        self._cond = threading.Condition()
        self._released = self._stopped = False
        self._thread: threading.Thread | None = None

    def queue(self, key, fn: Callable, *args, **kwargs) -> None:
        """``fn(*args, **kwargs)`` as the job ``key`` (once: a key already queued or run is left as it is)."""
        with self._cond:
            if key in self._jobs or self._stopped:
                return
            self._jobs[key] = _Job(fn, args, kwargs)
            self._queue.append(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="epcomm-test-background", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def release(self) -> None:
        """Start running the queued jobs (none runs before)."""
        with self._cond:
            self._released = True
            self._cond.notify_all()

    def result(self, key, fn: Callable, *args, **kwargs):
        """The job ``key``'s result (see the module doc); ``fn(*args, **kwargs)`` here if it was never queued."""
        with self._cond:
            job = self._jobs.get(key)
            if job is None:
                job = self._jobs[key] = _Job(fn, args, kwargs)
                mine = True
            else:
                mine = False
                self._released = True  # (a test waits for it: whatever held the queue back, it goes now)
                self._cond.notify_all()
        if mine:
            job.run()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.value

    def stop(self) -> None:
        """Drop the jobs not started and wait for the one running (the end of the session)."""
        with self._cond:
            self._stopped = True
            for key in self._queue:
                job = self._jobs[key]
                job.error = RuntimeError("the session ended before this job ran")
                job.done.set()
            self._queue.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and not (self._released and self._queue):
                    self._cond.wait()
                if self._stopped:
                    return
                job = self._jobs[self._queue.pop(0)]
            job.run()


BACKGROUND = Queue()
