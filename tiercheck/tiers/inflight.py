"""Parts in flight under one bound: the remote tier's uploads and ranged reads (DESIGN invariant 12).

A tier has one ``Inflight``: every upload through it shares ``concurrency`` slots. A slot is taken
before a part is read from its source and given back when the part is sent (or fails), so the
sources run ahead of the network by the free slots only, and the memory parts hold is at most
``concurrency`` parts, whatever the number of objects going up at once. Ranged reads go out on a
pool of their own of the same width.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from tiercheck.tiers.base import Buffer
from tiercheck.tiers.parts import parts_of

T = TypeVar("T")


class Inflight:
    """The slots and threads of one tier's parts; ``counters`` gets ``parts``, ``bytes_up``,
    ``part_bytes_in_flight`` and ``part_bytes_peak`` (under ``lock``)."""

    def __init__(self, concurrency: int, counters: dict[str, int], lock: threading.Lock) -> None:
        self.concurrency = concurrency
        self.counters = counters
        self._lock = lock
        self._slots = threading.BoundedSemaphore(concurrency)
        self._puts = ThreadPoolExecutor(concurrency, thread_name_prefix="tiercheck-part")
        self._gets = ThreadPoolExecutor(concurrency, thread_name_prefix="tiercheck-get")
        for key in ("parts", "bytes_up", "part_bytes_in_flight", "part_bytes_peak"):
            counters.setdefault(key, 0)

    def send(self, pieces: Iterable[Buffer], part: int, put: Callable[[int, Buffer], T]) -> list[T]:
        """``put(number, data)`` for each part of ``pieces`` (``parts_of``: at least ``part`` bytes
        but the last), numbered from 1, as slots free up; returns what each returned, in order.
        The first failure (the source's or a part's) stops reading, lets the parts in flight end,
        and is raised as it was."""
        futures: list[Future[T]] = []
        failed = threading.Event()

        def release(f: Future[T]) -> None:
            self._slots.release()
            if f.cancelled() or f.exception() is not None:
                failed.set()

        try:
            parts = parts_of(pieces, part)
            while not failed.is_set():
                self._slots.acquire()  # before the part is read: the source runs ahead by the free slots only
                try:
                    data = next(parts, None)
                except BaseException:
                    self._slots.release()
                    raise
                if data is None:
                    self._slots.release()
                    break
                futures.append(self._puts.submit(self._put, put, len(futures) + 1, data))
                futures[-1].add_done_callback(release)
            return [f.result() for f in futures]  # the first failure, as raised
        except BaseException:
            for f in futures:
                f.cancel()
            for f in futures:  # the parts in flight end (or fail) before the caller aborts the upload
                with contextlib.suppress(BaseException):
                    f.exception()
            raise

    def _put(self, put: Callable[[int, Buffer], T], number: int, data: Buffer) -> T:
        n = len(data)
        c = self.counters
        with self._lock:
            c["part_bytes_in_flight"] += n
            c["part_bytes_peak"] = max(c["part_bytes_peak"], c["part_bytes_in_flight"])
        try:
            token = put(number, data)
        finally:
            with self._lock:
                c["part_bytes_in_flight"] -= n
        with self._lock:
            c["bytes_up"] += n
            c["parts"] += 1
        return token

    def gather(self, get: Callable[[int], T], starts: Iterable[int]) -> list[T]:
        """``get(start)`` for each of ``starts``, up to ``concurrency`` at once; results in order.
        Never called from one of these threads (it would wait on itself)."""
        return list(self._gets.map(get, starts))
