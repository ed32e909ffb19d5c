"""A node leader's background thread that works through steps in turn: a step's copies to peers
(``tiering.replication``), its parity (``tiering.parity``), and jobs queued among them (``in_turn``).

Every leader submits the same steps and jobs in the same order, so leaders that work together (a
pair, a parity group) stay in step. A step's work that raises is reported and counts as failed;
the thread goes on with the next.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

log = logging.getLogger("tiercheck")


class Turns:
    """The queue and its thread. Subclasses give ``_work(step)``, call ``_start`` once they are ready
    (only on a leader with peers), and name what they do in ``what`` (for the log)."""

    what = "work"

    def __init__(self, *, every: int = 1) -> None:
        self.every = every
        self._cond = threading.Condition()
        # A step's own work, or a job run in its turn (``in_turn``).
        self._queue: list[tuple[int, Future[bool], Callable[[], bool] | None]] = []
        self._current: int | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    def _start(self, name: str) -> None:
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _work(self, step: int) -> bool:
        raise NotImplementedError

    def submit(self, step: int, done: Future[bool] | None = None) -> None:
        """Work on a step this node committed (every leader submits the same steps in order); ``done``
        gets the result (False at once where this rank does no such work, or ``every`` skips the step)."""
        fut: Future[bool] = done or Future()
        if self._thread is None or step % self.every:
            fut.set_result(False)
            return
        with self._cond:
            self._queue.append((step, fut, None))
            self._cond.notify_all()

    def in_turn(self, step: int, job: Callable[[], bool], done: Future[bool]) -> None:
        """Run ``job`` on the thread in its turn among the submitted steps (every leader submits the
        same jobs at the same place in its queue, so its peers stay in step). ``done`` gets its result
        (False where it raised: reported, as a step's work is)."""
        if self._thread is None:
            done.set_result(False)
            return
        with self._cond:
            self._queue.append((step, done, job))
            self._cond.notify_all()

    def pinned(self) -> set[int]:
        """Steps still to be worked on: retention keeps them."""
        with self._cond:
            return {s for s, _, _ in self._queue} | ({self._current} if self._current is not None else set())

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every submitted step is done (or failed); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._current is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = None) -> None:
        self.wait(timeout)
        with self._cond:
            self._stop = True
            for _, fut, _ in self._queue:
                fut.set_result(False)
            self._queue.clear()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                step, fut, job = self._queue.pop(0)
                self._current = step
            try:
                ok = self._work(step) if job is None else job()
            except BaseException as e:  # reported (before its waiters wake); this work never stops training
                log.warning("%s of step %d failed: %s", self.what, step, e)
                ok = False
            try:
                fut.set_result(ok)
            finally:
                with self._cond:
                    self._current = None
                    self._cond.notify_all()
