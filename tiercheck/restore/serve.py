"""Chunks a rank reads only for other ranks, served from the tier's own memory: a memory tier's pack
files mapped (``Tier.map_range``), never copied, each chunk verified and its sends posted as soon
as it is, on a thread of their own beside the rank's reads of the chunks it places itself.

A node restoring its own state serves a replaced node's chunks from its peer copy this way: its
own reads (``read.move_chunks``' pool) and the serving run side by side, and the replaced node
receives at the process group's speed, several chunks in flight (gloo sends them in order on one
connection; the next chunk's checksum overlaps the transfer of the one before). On the CPU
(gloo) a chunk is sent from the mapped pages themselves; where the process group moves chunks in
GPU memory (NCCL), it is copied once from the mapping to this rank's GPU and sent from there
(``_Moves.send``), into the receiver's GPU tensor.

Nothing unverified is sent as verified: a chunk is sent from its mapping only once its CRC32C
matches its writer's manifest and the checksum stored after it. One that does not (damaged in
this copy), or that cannot be mapped (a tier on disk, a file cut short), is read the usual way
(``_Moves.read_and_fill``), which reads it from the remote tier where it can, or records the error
and sends filler bytes the receivers wait for: the error reaches every rank before the verdict,
and the restore reads that writer's files from another copy (``restore.protocol``). The mappings
live until every send of the restore is complete (``_Moves.keep``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import torch

from tiercheck.cluster.assign import Read
from tiercheck.errors import CoordinationError, CorruptCheckpointError
from tiercheck.format.codec import CHECKSUM_BYTES, chunk_nbytes, verify_parts
from tiercheck.format.layout import Chunk, overlap
from tiercheck.format.manifest import ArrayRecord
from tiercheck.format.paths import step_dir
from tiercheck.restore.stage import ReadItem, dest_stops
from tiercheck.tiers.base import Tier


class TransferError(CoordinationError):
    """A chunk's transfer over the process group failed: the rank at the other end, or the connection
    to it, is gone. No verdict of the job can come (that rank never gets there): the rank that saw
    it raises it at once, naming that rank, and the others give up at their timeout."""


def transfer_error(rank: int, peer: int, what: str, sending: bool, e: BaseException) -> TransferError:
    """``TransferError`` for ``what`` (a chunk) sent to or received from global rank ``peer``."""
    said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    way = f"sending {what} to rank {peer}" if sending else f"receiving {what} from rank {peer}"
    return TransferError(f"rank {rank}: {way} failed (its process, or the connection to it, is gone?): {said}")


Placed = tuple[str, Chunk, torch.Tensor]  # a chunk read: its array, the chunk, its verified bytes
Key = tuple[str, tuple[int, ...]]  # an array's path and a chunk's coordinates


class Serving(Protocol):
    """What serving needs of the reads in flight (``read._Moves``)."""

    @property
    def tier(self) -> Tier: ...

    @property
    def step(self) -> int: ...

    @property
    def records(self) -> Mapping[str, ArrayRecord]: ...

    def read_and_fill(self, job: Read) -> Placed: ...

    def send(self, path: str, c: Chunk, data: torch.Tensor) -> None: ...


def to_serve(
    reads: Sequence[Read],
    sends: Mapping[Key, Sequence[tuple[int, int, bool]]],
    by_path: Mapping[str, Sequence[ReadItem]],
    records: Mapping[str, ArrayRecord],
) -> tuple[list[Read], list[Read]]:
    """``reads`` split into those served (read only to be sent, over the process group: no
    destination on this rank overlaps the chunk, none of its receivers takes it through the host's
    shared memory, and it is read from this rank's tier, where its writer's manifest places it) and
    the rest, each in the order given."""
    served, rest = [], []
    for job in reads:
        key, c = (job.path, job.chunk.coords), job.chunk
        to = sends.get(key, ())
        mine = by_path.get(job.path, ())
        if (
            to
            and not job.remote
            and not any(shared for _, _, shared in to)
            and c.key in records[job.path].offsets
            and not any(overlap(c.starts, c.stops, i.offsets, dest_stops(i)) is not None for i in mine)
        ):
            served.append(job)
        else:
            rest.append(job)
    return served, rest


def serve(moves: Serving, jobs: Iterable[Read], setup: Callable[[], None] | None = None) -> int:
    """Send each chunk of ``jobs`` to the ranks needing it, verified, in order (on the calling
    thread, while the rank's own reads go on beside it); returns the bytes served. ``setup`` runs
    first (the thread's GPU)."""
    if setup is not None:
        setup()
    total = 0
    for job in jobs:
        data = _mapped(moves, job)
        path, c, data = (job.path, job.chunk, data) if data is not None else moves.read_and_fill(job)
        total += data.numel()
        moves.send(path, c, data)
    return total


def _mapped(moves: Serving, job: Read) -> torch.Tensor | None:
    """A chunk's bytes in the tier's own memory, verified; None where they cannot be mapped, or do
    not check out (then read the usual way, which says why)."""
    rec = moves.records[job.path]
    key = job.chunk.key
    if key not in rec.checksums:
        return None
    file, offset = rec.location(key)
    nbytes = chunk_nbytes(rec)
    try:
        view = moves.tier.map_range(f"{step_dir(moves.step)}/{file}", offset, nbytes + CHECKSUM_BYTES)
    except OSError:
        return None
    if view is None:
        return None
    try:
        verify_parts(view[:nbytes], view[nbytes:], expected_crc=rec.checksums[key], nbytes=nbytes, where="")
    except CorruptCheckpointError:
        return None
    return torch.frombuffer(view[:nbytes], dtype=torch.uint8)
