"""Who writes which chunk on save, and who reads and sends which chunk on restore.

Pure Python (no torch, no I/O): every rank runs the same planning on the same gathered inputs
and gets the same answer, so a plan needs one exchange of descriptions and no further agreement.

Saving: the tensors of all ranks are pieces (boxes) of global arrays. The chunk grid of an array
is aligned to every box boundary (``layout.grid_for_boxes``), so each chunk lies wholly inside
every box that touches it, and any rank holding that box can write it alone. Each chunk is
written once, by the least-loaded of its holders: replicas share the writing.

Restoring: each rank asks for boxes of global arrays; the chunks they touch are read by ranks
whose node directory holds the chunk's file and sent to ranks that need it but cannot read it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .codec import chunk_nbytes, itemsize
from .errors import IncompatibleStateError
from .layout import Chunk, chunks_in_box, grid_for_boxes
from .manifest import ArrayRecord


@dataclass(frozen=True, slots=True)
class LeafDesc:
    """What one rank holds of one global array (exchanged between ranks as a JSON list)."""

    path: str
    dtype: str
    kind: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]  # the local piece's extents
    lazy: bool

    def to_json(self) -> list[object]:
        return [
            self.path,
            self.dtype,
            self.kind,
            list(self.global_shape),
            list(self.offsets),
            list(self.shape),
            self.lazy,
        ]

    @classmethod
    def from_json(cls, doc: list[object]) -> LeafDesc:
        path, dtype, kind, gshape, offs, shape, lazy = doc
        return cls(str(path), str(dtype), str(kind), _ints(gshape), _ints(offs), _ints(shape), bool(lazy))

    @property
    def stops(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.shape, strict=True))


def _ints(v: object) -> tuple[int, ...]:
    assert isinstance(v, list)
    return tuple(int(x) for x in v)


@dataclass(frozen=True, slots=True)
class WriteTask:
    leaf: int  # index into this rank's leaves
    chunk: Chunk  # in global coordinates (its key names the file)
    local: Chunk  # the same chunk in the leaf's own coordinates (what to copy)


@dataclass(frozen=True, slots=True)
class WritePlan:
    records: dict[str, ArrayRecord]  # every global array, with the owner of each chunk
    tasks: list[list[WriteTask]]  # per rank
    nbytes: list[int]  # per rank: bytes of chunk data to write


def plan_writes(descs: Sequence[Sequence[LeafDesc]], *, target_chunk_bytes: int) -> WritePlan:
    """Dedup and balance: each chunk of each global array is written by exactly one holder."""
    arrays: dict[str, list[tuple[int, int, LeafDesc]]] = defaultdict(list)  # path -> (rank, leaf, desc)
    for rank, leaves in enumerate(descs):
        for i, d in enumerate(leaves):
            arrays[d.path].append((rank, i, d))

    records: dict[str, ArrayRecord] = {}
    holders: list[tuple[int, str, tuple[int, ...], Chunk, list[tuple[int, int, LeafDesc]]]] = []
    for path in sorted(arrays):
        pieces = arrays[path]
        first = pieces[0][2]
        for rank, _, d in pieces[1:]:
            if (d.dtype, d.kind, d.global_shape) != (first.dtype, first.kind, first.global_shape):
                raise IncompatibleStateError(
                    f"array {path!r}: rank {pieces[0][0]} has {first.dtype}{list(first.global_shape)} "
                    f"but rank {rank} has {d.dtype}{list(d.global_shape)} as the global tensor"
                )
        shape = first.global_shape
        boxes = [(d.offsets, d.shape) for _, _, d in pieces if math.prod(d.shape) > 0]
        grid = grid_for_boxes(shape, boxes, itemsize(first.dtype), target_chunk_bytes)
        rec = ArrayRecord(path=path, dtype=first.dtype, kind=first.kind, shape=shape, chunks=grid)
        nbytes = chunk_nbytes(rec)
        by_chunk: dict[tuple[int, ...], tuple[Chunk, list[tuple[int, int, LeafDesc]]]] = {}
        for rank, i, d in pieces:
            for c in chunks_in_box(shape, grid, d.offsets, d.shape):
                by_chunk.setdefault(c.coords, (c, []))[1].append((rank, i, d))
        expected = math.prod(math.ceil(s / c) for s, c in zip(shape, grid, strict=True)) if all(shape) else 0
        if len(by_chunk) != expected:
            raise IncompatibleStateError(
                f"array {path!r}{list(shape)}: {_hole(shape, grid, by_chunk)} is held by no rank"
            )
        records[path] = rec
        holders.extend((nbytes, path, coords, c, hs) for coords, (c, hs) in by_chunk.items())

    # Largest first, each to its least-loaded holder: a greedy balance that is the same on every rank.
    holders.sort(key=lambda h: (-h[0], h[1], h[2]))
    load = [0] * len(descs)
    tasks: list[list[WriteTask]] = [[] for _ in descs]
    owners: dict[str, dict[str, int]] = defaultdict(dict)
    for nbytes, path, _, c, hs in holders:
        rank, i, d = min(hs, key=lambda h: (load[h[0]], h[0]))
        load[rank] += nbytes
        owners[path][c.key] = rank
        local = Chunk(
            coords=c.coords,
            starts=tuple(s - o for s, o in zip(c.starts, d.offsets, strict=True)),
            stops=tuple(s - o for s, o in zip(c.stops, d.offsets, strict=True)),
        )
        tasks[rank].append(WriteTask(i, c, local))
    for rank_tasks in tasks:
        rank_tasks.sort(key=lambda t: (t.leaf, t.chunk.coords))
    records = {
        path: ArrayRecord(
            path=path,
            dtype=r.dtype,
            kind=r.kind,
            shape=r.shape,
            chunks=r.chunks,
            owners=dict(sorted(owners[path].items())),
        )
        for path, r in records.items()
    }
    return WritePlan(records=records, tasks=tasks, nbytes=load)


def _hole(shape: tuple[int, ...], grid: tuple[int, ...], found: Mapping[tuple[int, ...], object]) -> str:
    for c in chunks_in_box(shape, grid, (0,) * len(shape), shape):
        if c.coords not in found:
            return "[" + ", ".join(f"{a}:{b}" for a, b in zip(c.starts, c.stops, strict=True)) + "]"
    return "part of it"


# ------------------------------------------------------------------------------------- reading


@dataclass(frozen=True, slots=True)
class Need:
    """A box of a global array that one rank wants filled."""

    path: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Transfer:
    path: str
    chunk: Chunk
    src: int  # the restoring rank that reads it from storage
    dst: int  # the restoring rank that receives it
    tag: int  # unique within the restore; pairs the send with its receive


@dataclass(frozen=True, slots=True)
class Read:
    path: str
    chunk: Chunk
    remote: bool  # from the remote tier (no restoring rank's node holds the file)


@dataclass(frozen=True, slots=True)
class ReadPlan:
    reads: list[list[Read]]  # per restoring rank: chunks it reads from storage
    transfers: list[Transfer]
    read_bytes: list[int]  # per restoring rank


def plan_reads(
    records: dict[str, ArrayRecord],
    needs: Sequence[Sequence[Need]],
    readable: Sequence[frozenset[int]],
    *,
    read_once: bool,
    remote: bool = False,
) -> ReadPlan:
    """Who reads each needed chunk, and who sends it to whom.

    ``readable[r]`` is the set of saving ranks whose chunk files restoring rank ``r`` can read
    on its node. With ``read_once``, each chunk is read by one rank and sent to every other rank
    needing it; otherwise every rank that needs a chunk and can read it reads it itself. A chunk
    no node holds is read from the remote tier (when ``remote``) by the ranks needing it.
    """
    needers: dict[tuple[str, tuple[int, ...]], tuple[Chunk, set[int]]] = {}
    for rank, rank_needs in enumerate(needs):
        for n in rank_needs:
            rec = records[n.path]
            for c in chunks_in_box(rec.shape, rec.chunks, n.offsets, n.shape):
                needers.setdefault((n.path, c.coords), (c, set()))[1].add(rank)

    reads: list[list[Read]] = [[] for _ in needs]
    load = [0] * len(needs)
    transfers: list[Transfer] = []
    for (path, _), (c, who) in sorted(needers.items()):
        rec = records[path]
        owner = rec.owner(c.key)
        able = [r for r in range(len(needs)) if owner in readable[r]]
        from_remote = not able
        if from_remote:
            if not remote:
                raise IncompatibleStateError(
                    f"array {path!r} chunk {c.key}: saved by rank {owner}, whose files no restoring rank can read"
                )
            able = sorted(who)
        nbytes = chunk_nbytes(rec)
        local = sorted(who.intersection(able))
        readers = [min(local or able, key=lambda r: (load[r], r))] if read_once or not local else local
        for r in readers:
            reads[r].append(Read(path, c, from_remote))
            load[r] += nbytes
        src = min(readers, key=lambda r: (load[r], r))
        for dst in sorted(who.difference(readers)):
            transfers.append(Transfer(path, c, src, dst, len(transfers)))
    return ReadPlan(reads=reads, transfers=transfers, read_bytes=load)
