"""What bench/scale_sim.py adds to tiercheck's own protocol code to simulate a job in one process:
a clock per simulated rank, and coordinators that count only the ranks taking part.

Time. Every simulated rank has a clock. Its own steps (the protocol code between two waits, timed
for real) move it on; so does every request it makes to a store, by one round trip (``rtt_s``). A
wait ends no earlier than the moment the key it waits for was set, by whichever rank's clock that
was: the longest chain of dependent requests, with the real code's time in between, is the time a
protocol takes (its critical path). What this leaves out is the store servers' own throughput, which
bench/scale_sim.py reports beside it: requests in all over the requests per second a TCPStore
serves, measured in the same run.

Symmetry. Where a protocol is run for a group of the job's ranks only (the ranks of one pipeline
stage and the coordinators of its arrays: the other stages do the same work on other arrays), its
barriers count the ranks of the group (``participants``; those among node leaders, its nodes);
everything else, the world size that
places every array's coordinator included, is the real job's.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

from tiercheck.cluster.coordination import Barrier, Coordinator


class Clock:
    def __init__(self) -> None:
        self.now = 0.0


class SimCoordinator(Coordinator):
    """A rank's coordinator in a simulation: requests move its clock on by ``rtt_s``; the keys it
    sets are stamped with its clock (``stamps``, shared by every coordinator of one store)."""

    def __init__(
        self,
        store: Any,
        *,
        rank: int,
        world_size: int,
        namespace: str,
        timeout_s: float,
        clock: Clock,
        stamps: dict[str, float],
        rtt_s: float,
        participants: int | None = None,
    ) -> None:
        super().__init__(store, rank=rank, world_size=world_size, namespace=namespace, timeout_s=timeout_s)
        self.clock, self.stamps, self.rtt_s = clock, stamps, rtt_s
        self.participants = world_size if participants is None else participants
        self.nodes_total = self.participant_nodes = 0  # the job's nodes, and those taking part (set by the sim)
        self.owns_client = True

    def fork(self, store: Any, *, rank: int, world_size: int, namespace: str) -> Coordinator:
        return SimCoordinator(store, rank=rank, world_size=world_size, namespace=namespace, timeout_s=self.timeout_s,
                              clock=self.clock, stamps={}, rtt_s=self.rtt_s)  # fmt: skip

    def _count(self, out: int = 0, into: int = 0, ops: int = 1) -> None:
        super()._count(out, into, ops)
        self.clock.now += ops * self.rtt_s

    def _stamp(self, *keys: str) -> None:
        for k in keys:
            self.stamps[k] = max(self.stamps.get(k, 0.0), self.clock.now)

    def _after(self, key: str) -> None:
        """A read of ``key`` ends no earlier than it was set."""
        self.clock.now = max(self.clock.now, self.stamps.get(key, 0.0))

    def set(self, key: str, value: str | bytes) -> None:
        super().set(key, value)
        self._stamp(key)

    def multi_set(self, items: Any) -> None:
        super().multi_set(items)
        self._stamp(*items)

    def add(self, key: str, n: int) -> int:
        # The count a rank gets back tells it of every add before its own: it is no earlier than they
        # were (the last to arrive at a barrier opens it no earlier than anyone arrived).
        value = super().add(key, n)
        self._after(key)
        self._stamp(key)
        return value

    def append(self, key: str, value: str | bytes) -> None:
        super().append(key, value)
        self._stamp(key)

    def decide(self, key: str, proposal: str) -> str:
        got = super().decide(key, proposal)
        self._after(key)
        self._stamp(key)
        return got

    def get(self, key: str) -> bytes:
        self._after(key)
        return super().get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        for k in keys:
            self._after(k)
        return super().multi_get(keys)

    def waited(self, key: str) -> None:
        self._after(key)
        super().waited(key)

    def _taking_part(self, count: int | None) -> int:
        """The count a barrier of every rank (None) or of every node's leader waits for, among those
        taking part."""
        if count is None:
            return self.participants
        return self.participant_nodes if count == self.nodes_total and self.participant_nodes else count

    def arrive(self, name: str, *, what: str, count: int | None = None, record: bool = True) -> Barrier:
        return super().arrive(name, what=what, count=self._taking_part(count), record=record)

    def finish(self, scope: str, *, keys: tuple[str, ...] = (), count: int | None = None) -> None:
        super().finish(scope, keys=keys, count=self._taking_part(count))


class Timed:
    """Runs simulated ranks' protocols: each rank's own steps timed (and put on its clock), and
    what rank 0 allocates within one step measured (tracemalloc, rank 0's steps only)."""

    def __init__(self, n: int, clocks: list[Clock]) -> None:
        self.seconds = [0.0] * n
        self.clocks = clocks
        self.rank0_peak = 0

    def wrap(self, i: int, protocol: Any) -> Iterator[Any]:
        value = None
        first = True
        while True:
            if i == 0:
                tracemalloc.start()
            t0 = time.perf_counter()
            try:
                barrier = next(protocol) if first else protocol.send(value)
            except StopIteration as stop:
                self._took(i, t0)
                return stop.value
            self._took(i, t0)
            first = False
            value = yield barrier

    def _took(self, i: int, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.seconds[i] += dt
        self.clocks[i].now += dt
        if i == 0:
            self.rank0_peak = max(self.rank0_peak, tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
