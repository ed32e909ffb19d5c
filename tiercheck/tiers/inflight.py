"""Parts in flight under one bound: the remote tier's uploads and ranged reads (invariant 12, docs/design.md).

A tier has one ``Inflight``: every upload through it shares ``concurrency`` slots. A slot is taken
before a part is read from its source and given back when the part is sent (or fails), so the
sources run ahead of the network by the free slots only, and the memory parts hold is at most
``concurrency`` parts, whatever the number of objects going up at once. Ranged reads go out on a
pool of their own of the same width.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
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

    def fill(self, views: Sequence[memoryview], part: int, get: Callable[[int, memoryview], int]) -> int:
        """Fill ``views``, laid end to end, with ``get(at, view)`` (read the bytes from ``at`` on
        into ``view``; returns how many there were) over ranges of about ``part`` bytes, up to
        ``concurrency`` at once: a range within one view straight into it, one across several
        small views (small chunks, their checksums) into scratch, then copied out. Returns the
        bytes read up to the first range cut short (the source ends there). Never called from
        one of these threads (it would wait on itself)."""
        spans = [memoryview(v).cast("B") for v in views if len(v)]
        starts = list(itertools.accumulate((len(v) for v in spans), initial=0))
        ranges = _ranges([len(v) for v in spans], part)

        def one(rng: tuple[int, int]) -> int:
            at, n = rng
            i = bisect.bisect_right(starts, at) - 1
            if at + n <= starts[i + 1]:
                return get(at, spans[i][at - starts[i] : at - starts[i] + n])
            scratch = bytearray(n)
            got = get(at, memoryview(scratch))
            pos = at
            while pos < at + got:
                k = min(starts[i + 1], at + got) - pos
                spans[i][pos - starts[i] : pos - starts[i] + k] = scratch[pos - at : pos - at + k]
                pos += k
                i += 1
            return got

        futures = [self._gets.submit(one, r) for r in ranges]
        wait(futures)  # all of them: none may write into ``views`` once this returns or raises
        for (at, n), f in zip(ranges, futures, strict=True):
            if (got := f.result()) < n:
                return at + got
        return starts[-1]


def _ranges(sizes: Sequence[int], part: int) -> list[tuple[int, int]]:
    """(start, length) ranges covering buffers of ``sizes`` laid end to end: each buffer of a
    part or more alone, cut into parts; smaller neighbours together, up to about a part."""
    out: list[tuple[int, int]] = []
    pos, run = 0, 0  # run: bytes of small buffers gathered so far, ending at pos
    for n in sizes:
        if n >= part:
            if run:
                out.append((pos - run, run))
                run = 0
            out += [(pos + k, min(part, n - k)) for k in range(0, n, part)]
        else:
            run += n
            if run >= part:
                out.append((pos + n - run, run))
                run = 0
        pos += n
    if run:
        out.append((pos - run, run))
    return out


class SourceError(Exception):
    """What ``write_stream``'s source raised, carried past the retries unchanged."""


def sourced(pieces: Callable[[], Iterable[Buffer]]) -> Callable[[], Iterator[Buffer]]:
    """``pieces`` whose failures are ``SourceError``s: never taken for the store's."""

    def wrapped() -> Iterator[Buffer]:
        source = iter(pieces())
        while True:
            try:
                piece = next(source)
            except StopIteration:
                return
            except BaseException as e:
                raise SourceError(e) from None
            yield piece

    return wrapped
