"""The rounds of a rebuild (``tiering.rebuild``): which shards go to whom, and their transfer.

For each stripe holding a piece that lacking members must get back (their data pieces, or with
``parity`` their parity pieces), one of those members decodes the stripe (``Route.decoder``: of the
stripe's lacking members, the one given the least to decode so far). It receives the first ``d``
shards that ``sources`` hold of the stripe and decodes every piece the stripe lacks in one pass
(zfec computes the missing rows together). It writes its own piece, and sends each other lacking
member its piece. A stripe that two lost members lack is therefore received and decoded once, not
twice. Each lacking member receives ``d`` shards for the stripes it decodes and one piece for the
others.

A round moves a slice (``tiering.parity.chunk_bytes``) of every piece. Two rounds are in flight: a
round's reads, sends and receives are posted before the round before it is decoded, so the transfer
overlaps the decode. A decoder decodes a round's stripes on a few threads (zfec releases the GIL).
Nothing posted waits on another member; a member waits only for shards already posted to it. So no
two members wait on each other.

A source that cannot read a shard (a file gone or short) says so and sends zeros in its place. The
member that decodes it then finds its rebuilt files or parity unlike the record. The group checks its
copies and passes that source over (``tiering.rebuild``). The group's next exchange is still
reached, so nobody waits out the gloo timeout.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from tiercheck.errors import CorruptCheckpointError, TiercheckError
from tiercheck.format.parity import PARITY_RECORD, ParityRecord, Stripes, decode, parity_file
from tiercheck.format.paths import COMMIT_FILE, step_dir
from tiercheck.tiering.parity import ParityGroup, chunk_bytes
from tiercheck.tiering.parity_wire import Region

log = logging.getLogger("tiercheck")

MAX_DECODE_THREADS = 8


@dataclass(frozen=True, slots=True)
class Route:
    """A stripe to rebuild: the positions whose shards go to the decoder (``d`` of them), the
    position that decodes, and every position the stripe lacks (the decoder's among them)."""

    stripe: int
    sources: tuple[int, ...]
    decoder: int
    lacking: tuple[int, ...]


def routes(st: Stripes, lacking: Collection[int], sources: Sequence[int], *, parity: bool) -> list[Route]:
    """The same routes on every member: for each stripe where a member in ``lacking`` holds a data
    piece (with ``parity``: a parity piece), its first ``d`` positions held by ``sources`` and not
    lacking, and its decoder (the lacking member with the fewest pieces to decode so far, then the
    lowest position)."""
    load = dict.fromkeys(lacking, 0)
    out = []
    for stripe in range(st.n):
        gone = tuple(j for j in range(st.n) if st.holder(stripe, j) in load and (j >= st.d) == parity)
        if not gone:
            continue
        src = tuple(j for j in range(st.n) if st.holder(stripe, j) in sources and j not in gone)[: st.d]
        if len(src) < st.d:
            raise CorruptCheckpointError(f"parity: stripe {stripe} has {len(src)} shards to decode from, {st.d} needed")
        decoder = min(gone, key=lambda j: (load[st.holder(stripe, j)], j))
        load[st.holder(stripe, decoder)] += len(gone)
        out.append(Route(stripe, src, decoder, gone))
    return out


class _Rounds:
    """One member's part in a rebuild's rounds (see the module's docstring)."""

    def __init__(self, group: ParityGroup, record: ParityRecord, plan: list[Route], *, parity: bool) -> None:
        assert group.group is not None
        self.group, self.wire, self.record, self.parity = group, group.group, record, parity
        self.st, self.me, self.piece, self.dir = record.stripes, group.me, record.piece, step_dir(record.step)
        self.plan = plan
        self.chunk = chunk_bytes(group.options, self.st, self.piece)
        self.region = Region(group.tier, self.dir, [(n, s) for n, s, _ in record.members[self.me].files])
        self.writers: dict[int, Any] = {}
        self.bufs: dict[tuple[int, int, int], torch.Tensor] = {}
        self.decoding = [r for r in plan if self._holds(r, r.decoder)]
        self.received = 0
        self.unread: str | None = None
        workers = min(len(self.decoding), os.cpu_count() or 1, MAX_DECODE_THREADS)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="tiercheck-rebuild") if workers > 1 else None

    def _holds(self, route: Route, position: int) -> bool:
        return self.st.holder(route.stripe, position) == self.me

    def _buf(self, r: int, stripe: int, position: int, n: int) -> torch.Tensor:
        return self.bufs.setdefault((r % 2, stripe, position), torch.empty(self.chunk, dtype=torch.uint8))[:n]

    def open(self) -> None:
        """This member's files to write: its parity pieces, or its data files (their step's commit
        marker and record removed first: the step counts only once they are written again)."""
        lacking = {k for route in self.plan for k in route.lacking if self._holds(route, k)}
        if not lacking:
            return
        if self.parity:
            self.writers = {s: self.group.tier.open_pack(f"{self.dir}/{parity_file(s)}")
                            for s, _ in self.st.parity_of(self.me)}  # fmt: skip
            return
        self.group.tier.delete(f"{self.dir}/{COMMIT_FILE}")
        self.group.tier.delete(f"{self.dir}/{PARITY_RECORD}")
        self.region.open()

    def close(self) -> None:
        self.region.close()
        writers, self.writers = self.writers, {}
        for w in writers.values():
            w.close()
        if self.pool is not None:
            self.pool.shutdown()

    def run(self) -> None:
        pending: tuple[int, int, int, list[Any], list[Any]] | None = None
        for r, offset in enumerate(range(0, self.piece, self.chunk)):
            posted = self._post(r, offset)
            if pending is not None:
                self._finish(*pending)
            pending = posted
        if pending is not None:
            self._finish(*pending)

    def _post(self, r: int, offset: int) -> tuple[int, int, int, list[Any], list[Any]]:
        """Round ``r``'s reads and sends (this member's shards), and its receives (shards to decode,
        pieces decoded elsewhere): nothing here waits on another member."""
        n, st = min(self.chunk, self.piece - offset), self.st
        shards, forwarded = [], []
        for route in self.plan:
            to = st.holder(route.stripe, route.decoder)
            for j in route.sources:
                if self._holds(route, j):
                    t = self._buf(r, route.stripe, j, n)
                    self._read(route.stripe, j, offset, t)
                    shards.append(self.wire.send(t, to, route.stripe * st.n + j))
                elif to == self.me:
                    shards.append(self.wire.recv(self._buf(r, route.stripe, j, n), st.holder(route.stripe, j),
                                                 route.stripe * st.n + j))  # fmt: skip
                    self.received += n
            for k in route.lacking:
                if k != route.decoder and self._holds(route, k):
                    forwarded.append((route.stripe, k, self.wire.recv(self._buf(r, route.stripe, k, n), to,
                                                                      route.stripe * st.n + k)))  # fmt: skip
                    self.received += n
        return r, offset, n, shards, forwarded

    def _finish(self, r: int, offset: int, n: int, shards: list[Any], forwarded: list[Any]) -> None:
        """Round ``r``: its shards in, this member's stripes decoded, their pieces written or sent on;
        then the pieces decoded elsewhere in, and written."""
        st = self.st
        for w in shards:
            w.wait()

        def one(route: Route) -> dict[int, bytes]:
            return decode(st, {j: self.bufs[r % 2, route.stripe, j][:n].numpy() for j in route.sources},
                          route.lacking)  # fmt: skip

        pool = self.pool
        outs = list(pool.map(one, self.decoding) if pool is not None else map(one, self.decoding))
        sends = []
        for route, out in zip(self.decoding, outs, strict=True):
            for k, piece in out.items():
                if k == route.decoder:
                    self._write(route.stripe, k, offset, piece)
                    continue
                t = self._buf(r, route.stripe, k, n)
                t.numpy()[:] = memoryview(piece)
                sends.append(self.wire.send(t, st.holder(route.stripe, k), route.stripe * st.n + k))
        for stripe, k, w in forwarded:
            w.wait()
            self._write(stripe, k, offset, memoryview(self._buf(r, stripe, k, n).numpy()))  # type: ignore[arg-type]
        for w in sends:
            w.wait()

    def _write(self, stripe: int, position: int, offset: int, piece: Any) -> None:
        if position < self.st.d:
            self.region.write(position * self.piece + offset, memoryview(piece))
        else:
            self.writers[stripe].write_at(offset, [piece])

    def _read(self, stripe: int, j: int, offset: int, t: torch.Tensor) -> None:
        """This member's shard ``j`` of ``stripe`` from ``offset`` into ``t``; zeros where it cannot be
        read (said once: the member decoding it finds its pieces unlike the record)."""
        view = memoryview(t.numpy())  # type: ignore[arg-type]
        try:
            if j < self.st.d:
                self.region.read(j * self.piece + offset, view)
                return
            path = f"{self.dir}/{parity_file(stripe)}"
            got, _ = self.group.tier.read_into(path, view, offset=offset, length=len(view))
            if got != len(view):
                raise CorruptCheckpointError(f"{self.group.tier.url}: {path} is shorter than its record says")
        except (TiercheckError, OSError) as e:
            if self.unread is None:
                self.unread = str(e)
                log.warning("parity: step %d: this node's shard of stripe %d cannot be read, zeros are sent in "
                            "its place (its group checks its copies after the rounds): %s", self.record.step, stripe,
                            e)  # fmt: skip
            view[:] = bytes(len(view))


def transfer(group: ParityGroup, record: ParityRecord, lacking: tuple[int, ...], sources: Sequence[int], *,
             parity: bool) -> int:  # fmt: skip
    """Run this member's part in the rounds that give ``lacking`` members their data pieces (with
    ``parity``: their parity pieces) from ``sources``; returns the bytes this member received."""
    rounds = _Rounds(group, record, routes(record.stripes, lacking, sources, parity=parity), parity=parity)
    try:
        rounds.open()
        rounds.run()
    finally:
        rounds.close()
    return rounds.received
