"""Runs of chunks that lie together in a pack, and how one read of a run lands in memory.

A restore reads chunks one after the other in a pack with one request where the tier can
(``Tier.vectored_reads``: a local file's ``preadv``, a few ranged GETs in parallel on an object
store): ``read_runs`` groups them, a ``RunLayout`` says where each byte of the run goes
(straight into its destination, or scratch memory) and what is verified, and ``Folded`` checks the
chunks as the read lands them.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tiercheck.cluster.assign import Read
from tiercheck.errors import CorruptCheckpointError
from tiercheck.format.codec import CHECKSUM_BYTES, PackCheck, chunk_nbytes
from tiercheck.format.manifest import ArrayRecord
from tiercheck.restore.stage import whole_blocks
from tiercheck.state.staging import aligned_empty
from tiercheck.tiers.base import Tier
from tiercheck.tiers.local import BLOCK


@dataclass(frozen=True, slots=True)
class Slot:
    """One chunk of a run: where it lies in the pack, and the memory its data is read straight
    into (``direct_target``), or None (read into scratch, then copied or sent)."""

    job: Read
    offset: int
    nbytes: int  # the full chunk's data, padding included, without its checksum
    target: torch.Tensor | None
    filled: bool = True  # the target is the destination (else shared memory, the destination filled from it)


@dataclass(slots=True)
class RunLayout:
    """How one vectored read of a run lands: the file from ``start`` on into ``views`` in order;
    then ``copies`` (into, from) move bytes that landed in scratch to where they belong, and each
    chunk's ``parts`` (its data, the rest of it with the checksum, and its bytes as a tensor where
    it has no target) are verified."""

    start: int
    end: int  # the bytes up to here must be read
    views: list[memoryview] = field(default_factory=list)
    parts: list[tuple[memoryview, memoryview, torch.Tensor | None]] = field(default_factory=list)
    copies: list[tuple[memoryview, memoryview]] = field(default_factory=list)
    direct: bool = False

    @classmethod
    def buffered(cls, slots: Sequence[Slot]) -> RunLayout:
        """Each target as its own buffer; a chunk without one, alignment gaps and checksums in
        buffers of their own."""
        last = slots[-1]
        layout = cls(slots[0].offset, last.offset + last.nbytes + CHECKSUM_BYTES)
        pos = layout.start
        for s in slots:
            if s.offset > pos:
                layout.views.append(memoryview(bytearray(s.offset - pos)))  # an alignment gap
            whole = s.nbytes + CHECKSUM_BYTES
            if s.target is None:  # copied into place afterwards, or sent: read whole into scratch
                raw = bytearray(whole)
                data, rest = memoryview(raw)[: s.nbytes], memoryview(raw)[s.nbytes :]
                layout.parts.append((data, rest, torch.frombuffer(raw, dtype=torch.uint8)[: s.nbytes]))
            else:  # straight into the destination; an edge chunk's padding and the checksum apart
                data = s.target.numpy().data
                rest = memoryview(bytearray(whole - len(data)))
                layout.parts.append((data, rest, None))
            layout.views += [data, rest]
            pos = s.offset + whole
        return layout

    @classmethod
    def unbuffered(cls, slots: Sequence[Slot]) -> RunLayout | None:
        """Whole blocks, for a read that bypasses the page cache: the block-aligned body of each
        target that starts on a block in memory and in the pack (big chunks do in the pack;
        ``staged`` places big arrays on pages), everything between in one page-aligned scratch
        buffer. None when targets would take less than half of the blocks read."""
        last = slots[-1]
        end = last.offset + last.nbytes + CHECKSUM_BYTES
        layout = cls(slots[0].offset // BLOCK * BLOCK, end, direct=True)
        hi = whole_blocks(end)
        bodies = [
            0
            if s.target is None or s.offset % BLOCK or s.target.data_ptr() % BLOCK
            else s.target.numel() // BLOCK * BLOCK
            for s in slots
        ]
        if 2 * sum(bodies) < hi - layout.start:
            return None
        scratch = aligned_empty(hi - layout.start - sum(bodies))
        raw = scratch.numpy().data
        gaps: list[tuple[int, int]] = []  # (file offset, scratch offset) where each scratch span starts
        pos, used = layout.start, 0
        for s, body in zip(slots, bodies, strict=True):
            if not body:
                continue
            if s.offset > pos:
                gaps.append((pos, used))
                layout.views.append(raw[used : used + s.offset - pos])
                used += s.offset - pos
            assert s.target is not None
            layout.views.append(s.target.numpy().data[:body])
            pos = s.offset + body
        if hi > pos:
            gaps.append((pos, used))
            layout.views.append(raw[used : used + hi - pos])

        def at(offset: int, n: int) -> torch.Tensor:  # the file's bytes [offset, offset + n) in scratch
            i = bisect.bisect_right(gaps, (offset, len(raw))) - 1
            start = gaps[i][1] + offset - gaps[i][0]
            return scratch[start : start + n]

        for s, body in zip(slots, bodies, strict=True):
            whole = s.nbytes + CHECKSUM_BYTES
            if s.target is None:
                chunk = at(s.offset, whole)
                layout.parts.append((chunk[: s.nbytes].numpy().data, chunk[s.nbytes :].numpy().data, chunk[: s.nbytes]))
                continue
            data = s.target.numpy().data
            if len(data) > body:  # the part of the target short of a block, read into scratch
                layout.copies.append((data[body:], at(s.offset + body, len(data) - body).numpy().data))
            layout.parts.append((data, at(s.offset + len(data), whole - len(data)).numpy().data, None))
        return layout


class Folded:
    """The checksums of a run's chunks folded as a read lands its bytes (``Tier.read_vectored``'s
    ``each``, in file order from ``start``): ``whole()`` says whether every chunk checked out. The
    first mismatch stops the folding, never the read: the run's chunks are then checked one by one."""

    def __init__(self, records: dict[str, ArrayRecord], slots: Sequence[Slot], start: int, where: str) -> None:
        spans = [
            (s.offset - start, s.nbytes, s.job.path, s.job.chunk.key, records[s.job.path].checksums[s.job.chunk.key])
            for s in slots
        ]
        self._check: PackCheck | None = PackCheck(spans, where)

    def __call__(self, piece: memoryview) -> None:
        if self._check is None:
            return
        try:
            self._check.feed(piece)
        except CorruptCheckpointError:
            self._check = None

    def whole(self) -> bool:
        """Every chunk passed and checked out."""
        if self._check is None:
            return False
        try:
            self._check.close()
        except CorruptCheckpointError:
            return False
        return True


def read_runs(
    tier: Tier,
    records: dict[str, ArrayRecord],
    reads: Sequence[Read],
    *,
    remote: Tier | None = None,
    max_bytes: int,
    max_chunks: int,
) -> list[list[Read]]:
    """``reads`` in runs to read at once: chunks of one pack on one tier (``tier``, or ``remote``
    for the reads planned from it), in file order, each starting where the one before ends (or
    after its alignment gap), up to ``max_bytes`` and ``max_chunks`` a run, where that tier reads
    many buffers at once (``vectored_reads``). Everything else (a chunk the record gives no
    checksum or offset) is read alone, which reports it with the chunk's name."""
    alone: list[list[Read]] = []
    placed: list[tuple[bool, str, int, int, Read]] = []
    for r in reads:
        rec = records[r.path]
        src = remote if r.remote else tier
        if src is None or not src.vectored_reads or r.chunk.key not in rec.checksums or r.chunk.key not in rec.offsets:
            alone.append([r])
            continue
        file, offset = rec.location(r.chunk.key)
        placed.append((r.remote, file, offset, chunk_nbytes(rec) + CHECKSUM_BYTES, r))
    placed.sort(key=lambda p: (p[0], p[1], p[2]))
    runs: list[list[Read]] = []
    cur: list[Read] = []
    where, start, end = (False, ""), 0, 0
    for from_remote, file, offset, n, r in placed:
        if cur and (
            (from_remote, file) != where
            or not end <= offset < end + BLOCK
            or offset + n - start > max_bytes
            or len(cur) >= max_chunks
        ):
            runs.append(cur)
            cur = []
        if not cur:
            where, start = (from_remote, file), offset
        cur.append(r)
        end = offset + n
    if cur:
        runs.append(cur)
    return runs + alone
