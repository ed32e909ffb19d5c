"""Who writes which chunk on save, and who reads and sends which chunk on restore.

Pure Python (no torch, no I/O, no store): the pieces ``save.plan`` and ``restore.plan`` run on
coordinators and holders, and ``assign_writes`` / ``assign_all_reads``, which run them over the whole job
in one place (for tests, tools and single-directory loads).

Saving: the tensors of all ranks are pieces (boxes) of global arrays. The chunk grid of an array
is aligned to every box boundary (``layout.grid_for_boxes``), so each chunk lies wholly inside
every box that touches it, and any rank holding that box can write it alone. Each chunk is
written once, by the least-loaded of its holders: replicas share the writing, and each group of
ranks holding the same chunks splits them the same way on every member.

Restoring: each rank asks for boxes of global arrays; the chunks they touch are read by ranks
whose node directory holds the chunk's pack and sent to ranks that need it but cannot read it.
"""


from __future__ import annotations

import bisect
import heapq
import math
import zlib
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from tiercheck.cluster.wire import as_bool, as_fields, as_ranks, as_str
from tiercheck.errors import IncompatibleStateError, UnsupportedValueError
from tiercheck.format.codec import chunk_nbytes, itemsize
from tiercheck.format.layout import MAX_CHUNKS, Chunk, chunks_in_box, grid_for_boxes, grid_size
from tiercheck.format.manifest import ArrayRecord


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
    def from_json(cls, doc: object, *, where: str, field: str = "leaf") -> LeafDesc:
        """One rank's piece as another rank posted it (``where``: the store key), checked field by
        field (``cluster.wire``)."""
        return cls(*as_fields(doc, where, field, (as_str, as_str, as_str, as_ranks, as_ranks, as_ranks, as_bool)))

    @property
    def stops(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.shape, strict=True))


@dataclass(frozen=True, slots=True)
class WriteTask:
    leaf: int  # index into this rank's leaves
    chunk: Chunk  # in global coordinates (its key names the file)
    local: Chunk  # the same chunk in the leaf's own coordinates (what to copy)


@dataclass(frozen=True, slots=True)
class WriteAssignment:
    records: dict[str, ArrayRecord]  # every global array, with the owner of each chunk
    tasks: list[list[WriteTask]]  # per rank
    nbytes: list[int]  # per rank: bytes of chunk data to write


def assign_writes(descs: Sequence[Sequence[LeafDesc]], *, target_chunk_bytes: int) -> WriteAssignment:
    """Dedup and balance: each chunk of each global array is written by exactly one holder.

    The whole job's plan from every rank's descriptions, in one place: what ``save.plan`` computes
    spread over the ranks (each array on its coordinator, each group of holders on its members),
    with the same answer. For tests and tools; a job never gathers every rank's descriptions.
    """
    arrays: dict[str, list[tuple[int, LeafDesc]]] = defaultdict(list)
    leaf_of: dict[tuple[int, str], int] = {}
    for rank, leaves in enumerate(descs):
        for i, d in enumerate(leaves):
            arrays[d.path].append((rank, d))
            leaf_of[rank, d.path] = i
    records: dict[str, ArrayRecord] = {}
    offers: list[Offer] = []
    for path in sorted(arrays):
        rec, chunks = chunk_array(path, arrays[path], target_chunk_bytes)
        records[path] = rec
        offers.extend(Offer(chunk_nbytes(rec), path, c, holders) for c, holders in chunks)
    owners = assign_owners(offers)
    tasks: list[list[WriteTask]] = [[] for _ in descs]
    load = [0] * len(descs)
    by_path: dict[str, dict[str, int]] = defaultdict(dict)
    for offer, rank in zip(offers, owners, strict=True):
        by_path[offer.path][offer.chunk.key] = rank
        load[rank] += offer.nbytes
        i = leaf_of[rank, offer.path]
        tasks[rank].append(WriteTask(i, offer.chunk, local_chunk(offer.chunk, descs[rank][i])))
    for rank_tasks in tasks:
        rank_tasks.sort(key=lambda t: (t.leaf, t.chunk.coords))
    records = {path: r.with_chunks(owners=dict(sorted(by_path[path].items()))) for path, r in records.items()}
    return WriteAssignment(records=records, tasks=tasks, nbytes=load)


def chunk_array(
    path: str, pieces: Sequence[tuple[int, LeafDesc]], target_chunk_bytes: int
) -> tuple[ArrayRecord, list[tuple[Chunk, tuple[int, ...]]]]:
    """One global array from the pieces ranks hold of it: its chunk grid (aligned to every piece,
    so any holder of a chunk can write it alone) and each chunk with the ranks holding it.

    Raises ``IncompatibleStateError`` when the ranks disagree on the array or leave a hole."""
    first_rank, first = pieces[0]
    for rank, d in pieces[1:]:
        if (d.dtype, d.kind, d.global_shape) != (first.dtype, first.kind, first.global_shape):
            raise IncompatibleStateError(
                f"array {path!r}: rank {first_rank} has {first.dtype}{list(first.global_shape)} "
                f"but rank {rank} has {d.dtype}{list(d.global_shape)} as the global tensor"
            )
    shape = first.global_shape
    boxes = [(d.offsets, d.shape) for _, d in pieces if math.prod(d.shape) > 0]
    grid = grid_for_boxes(shape, boxes, itemsize(first.dtype), target_chunk_bytes)
    if grid_size(shape, grid) > MAX_CHUNKS:  # it could not be read back (nor planned in time)
        raise UnsupportedValueError(
            f"array {path!r}{list(shape)}: its shards' boundaries cut it into {grid_size(shape, grid):,} chunks "
            f"of {list(grid)}, more than {MAX_CHUNKS:,}; shard it at coarser offsets or raise WriteOptions.chunk_bytes"
        )
    rec = ArrayRecord(path=path, dtype=first.dtype, kind=first.kind, shape=shape, chunks=grid)
    by_chunk: dict[tuple[int, ...], tuple[Chunk, list[int]]] = {}
    for rank, d in pieces:
        for c in chunks_in_box(shape, grid, d.offsets, d.shape):
            by_chunk.setdefault(c.coords, (c, []))[1].append(rank)
    expected = grid_size(shape, grid)
    if len(by_chunk) != expected:
        raise IncompatibleStateError(f"array {path!r}{list(shape)}: {_hole(shape, grid, by_chunk)} is held by no rank")
    return rec, [(c, tuple(sorted(hs))) for _, (c, hs) in sorted(by_chunk.items())]


@dataclass(frozen=True, slots=True)
class Offer:
    """A chunk to be written by one of ``holders``."""

    nbytes: int
    path: str
    chunk: Chunk
    holders: tuple[int, ...]


def assign_owners(offers: Sequence[Offer]) -> list[int]:
    """The rank that writes each offered chunk. Chunks are balanced within each group of ranks
    holding the same chunks (DP replicas of a shard, say), largest first, each to the least-loaded
    member. A group's members see the same offers, so each can run this on its own offers and
    agree with the others without another exchange."""
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, o in enumerate(offers):
        groups[o.holders].append(i)
    owner = [-1] * len(offers)
    for holders, members in groups.items():
        # Holders by load: a heap of distinct loads, and the holders at each load by position in
        # the group, so a chunk finds the least-loaded holder next to its own start in log time
        # (a group of 1,024 replicas must not cost 1,024 steps per chunk).
        at_load: dict[int, list[int]] = {0: list(range(len(holders)))}
        loads = [0]
        for i in sorted(members, key=lambda i: (-offers[i].nbytes, offers[i].path, offers[i].chunk.coords)):
            while not at_load.get(loads[0]):
                at_load.pop(heapq.heappop(loads), None)
            least = at_load[loads[0]]
            # Ties go round the group from a point the chunk picks, so a group's lone chunk (a
            # replicated optimizer partition, say) does not always land on its lowest rank.
            start = zlib.crc32(f"{offers[i].path}/{offers[i].chunk.key}".encode()) % len(holders)
            j = least.pop(bisect.bisect_left(least, start) % len(least))
            owner[i] = holders[j]
            load = loads[0] + offers[i].nbytes
            if load not in at_load:
                at_load[load] = []
                heapq.heappush(loads, load)
            bisect.insort(at_load[load], j)
    return owner


def local_chunk(c: Chunk, d: LeafDesc) -> Chunk:
    """Chunk ``c`` of the global array in the coordinates of the piece ``d`` holding it."""
    return Chunk(
        coords=c.coords,
        starts=tuple(s - o for s, o in zip(c.starts, d.offsets, strict=True)),
        stops=tuple(s - o for s, o in zip(c.stops, d.offsets, strict=True)),
    )


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
    shared: bool = False  # src and dst share a host: the bytes pass through shared memory, a header is sent


@dataclass(frozen=True, slots=True)
class Read:
    path: str
    chunk: Chunk
    remote: bool  # from the remote tier (no restoring rank's node holds the file)


@dataclass(frozen=True, slots=True)
class ReadAssignment:
    reads: list[list[Read]]  # per restoring rank: chunks it reads from storage
    transfers: list[Transfer]
    read_bytes: list[int]  # per restoring rank


def assign_all_reads(
    records: dict[str, ArrayRecord],
    needs: Sequence[Sequence[Need]],
    readable: Sequence[frozenset[int]],
    *,
    read_once: bool,
    remote: bool = False,
    nodes: Sequence[Hashable] | None = None,
    hosts: Sequence[str | None] | None = None,
) -> ReadAssignment:
    """Who reads each needed chunk, and who sends it to whom: the whole job's read plan in one
    place (a job plans per array on coordinators, ``restore.plan``, with ``assign_reads``).

    ``readable[r]`` is the set of saving ranks whose packs restoring rank ``r`` can read
    on its node. With ``read_once``, each chunk is read by one rank and sent to every other rank
    needing it; otherwise each node needing it reads it once (every rank is a node of its own
    unless ``nodes`` says otherwise). A chunk
    no node holds is read from the remote tier (when ``remote``) by the ranks needing it.
    ``nodes[r]`` and ``hosts[r]``: restoring rank ``r``'s node and host key (``assign_reads``).
    """
    readers: dict[int, list[int]] = defaultdict(list)
    for r, owners in enumerate(readable):
        for o in owners:
            readers[o].append(r)
    wanted = needed_chunks(records, dict(enumerate(needs)))
    reads, transfers, load = assign_reads(
        records,
        wanted,
        lambda o: readers.get(o, []),
        read_once=read_once,
        remote=remote,
        tag=lambda i: i,
        node_of=None if nodes is None else nodes.__getitem__,
        host_of=None if hosts is None else hosts.__getitem__,
    )
    return ReadAssignment(
        reads=[reads.get(r, []) for r in range(len(needs))],
        transfers=transfers,
        read_bytes=[load.get(r, 0) for r in range(len(needs))],
    )


Needers = dict[tuple[str, tuple[int, ...]], tuple[Chunk, set[int]]]


def needed_chunks(records: Mapping[str, ArrayRecord], needs: Mapping[int, Sequence[Need]]) -> Needers:
    """Each chunk some rank needs, with the ranks needing it."""
    needers: Needers = {}
    for rank, rank_needs in needs.items():
        for n in rank_needs:
            rec = records[n.path]
            for c in chunks_in_box(rec.shape, rec.chunks, n.offsets, n.shape):
                needers.setdefault((n.path, c.coords), (c, set()))[1].add(rank)
    return needers


@dataclass(frozen=True, slots=True)
class Source:
    """A rank reading a chunk from storage, and whom it sends it to: ``to``, the needers of its
    node (None for the chunk's main source: every needer no other source serves), ``shared`` those
    of them on its host (the bytes pass through shared memory). Sets of ranks: frozensets where
    ``route_chunks`` makes them, ``cluster.wire.RankSet`` where a rank reads them from a message."""

    rank: int
    remote: bool  # from the remote tier (no restoring rank's node holds the file)
    to: AbstractSet[int] | None
    shared: AbstractSet[int]


@dataclass(frozen=True, slots=True)
class Route:
    """How one needed chunk reaches every rank needing it: who reads it (the main source first),
    and the ranks needing it. Each rank works out its own part (``sends``, ``source_of``) from
    the route alone, so a route is said once to every rank that needs the chunk. A rank that only
    receives asks its sets whether it is in them: with the sets of a message (``RankSet``), that
    costs their runs, not their ranks (1,024 replicas need a chunk at 131,072 ranks); only the
    main source walks the needers, sending to them."""

    path: str
    chunk: Chunk
    owner: int  # the saving rank that wrote it (its part holds the checksum)
    needers: AbstractSet[int]
    sources: tuple[Source, ...]

    def readers(self) -> frozenset[int]:
        return frozenset(s.rank for s in self.sources)

    def sends(self, s: Source) -> list[tuple[int, bool]]:
        """The ranks source ``s`` sends the chunk to, and whether through shared memory."""
        if s.to is not None:
            dsts: AbstractSet[int] = s.to
        else:
            rest = set(self.needers) - self.readers()
            for other in self.sources:
                if other.to is not None:
                    rest.difference_update(other.to)
            dsts = rest
        return [(d, d in s.shared) for d in sorted(dsts)]

    def source_of(self, rank: int) -> Source:
        """The source a needer that reads nothing receives the chunk from."""
        for s in self.sources:
            if s.to is not None and rank in s.to:
                return s
        return self.sources[0]


def route_chunks(
    records: Mapping[str, ArrayRecord],
    needers: Needers,
    readers_of: Callable[[int], Sequence[int]],
    *,
    read_once: bool,
    remote: bool,
    node_of: Callable[[int], Hashable] | None = None,
    host_of: Callable[[int], str | None] | None = None,
    owners_read: bool = False,
) -> tuple[list[Route], dict[int, int]]:
    """Who reads each needed chunk and who gets it from whom (in ``needers``' sorted order), and the
    bytes each rank reads. ``readers_of(owner)`` lists the restoring ranks that can read the files
    of saving rank ``owner``.

    Each node (``node_of(rank)``; by default every rank is a node of its own) that needs a chunk
    and holds it reads it once, by its least loaded rank needing it, and passes it to its other
    ranks needing it; a node that does not hold it receives it from the main source. With
    ``read_once``, one rank in the whole job reads each chunk. A transfer between two ranks of one
    host (equal, non-None ``host_of``) is ``shared``. With ``owners_read`` (and not ``read_once``),
    the restoring rank numbered as a chunk's writer is its node's reader where it can read it and
    its node needs the chunk: it reads the chunks its saving rank wrote anyway, needing them; where it
    cannot (its node was replaced: peers hold its files), the least loaded of ``readers_of(owner)``
    does, ties broken from the writer's place on, so the writers' chunks spread over the holding nodes'
    ranks in every coordinator's plan."""
    node = node_of or (lambda r: r)
    host = host_of or (lambda r: None)
    load: dict[int, int] = defaultdict(int)
    routes: list[Route] = []
    for (path, _), (c, who) in sorted(needers.items()):
        rec = records[path]
        owner = rec.owner(c.key)
        able = list(readers_of(owner))
        from_remote = not able
        if from_remote:
            if not remote:
                raise IncompatibleStateError(
                    f"array {path!r} chunk {c.key}: saved by rank {owner}, whose files no restoring rank can read"
                )
            able = sorted(who)
        nbytes = chunk_nbytes(rec)
        local = sorted(who.intersection(able))
        chosen: dict[Hashable, int] = {}  # node: the rank reading the chunk there
        if read_once or not local:
            r = min(local or able, key=lambda r: (load[r], r))
            if owners_read and not read_once and not local:
                # The writer reads its own chunks; where its node was replaced, the least loaded of the ranks of
                # the nodes holding its files, ties going from the writer's place on: each coordinator plans alone
                # (its ``load`` is its own), and would have the holding node's first rank read every chunk of the
                # replaced node's writers; within a plan, every holder serves part.
                n = len(able)
                r = owner if owner in able else able[min(range(n), key=lambda i: (load[able[i]], (i - owner) % n))]
            chosen[node(r)] = r
        else:
            for r in local:
                if node(r) not in chosen or (load[r], r) < (load[chosen[node(r)]], chosen[node(r)]):
                    chosen[node(r)] = r
            if owners_read and owner in able and node(owner) in chosen:
                chosen[node(owner)] = owner  # it reads its own chunks alone (restore.plan._self_served)
        for r in chosen.values():
            load[r] += nbytes
        main = min(chosen.values(), key=lambda r: (load[r], r))
        served: dict[int, set[int]] = {r: set() for r in chosen.values()}
        for dst in who.difference(chosen.values()):
            served[chosen.get(node(dst), main)].add(dst)
        sources = tuple(
            Source(
                r,
                from_remote,
                None if r == main else frozenset(served[r]),
                frozenset(d for d in served[r] if host(r) is not None and host(r) == host(d)),
            )
            for r in sorted(chosen.values(), key=lambda r: r != main)
        )
        routes.append(Route(path, c, owner, frozenset(who), sources))
    return routes, dict(load)


def assign_reads(
    records: Mapping[str, ArrayRecord],
    needers: Needers,
    readers_of: Callable[[int], Sequence[int]],
    *,
    read_once: bool,
    remote: bool,
    tag: Callable[[int], int],
    node_of: Callable[[int], Hashable] | None = None,
    host_of: Callable[[int], str | None] | None = None,
) -> tuple[dict[int, list[Read]], list[Transfer], dict[int, int]]:
    """``route_chunks``, as reads per rank and transfers: ``tag(i)`` numbers the i-th chunk's
    transfers (unique in the whole restore: each rank receives a chunk once)."""
    routes, load = route_chunks(
        records, needers, readers_of, read_once=read_once, remote=remote, node_of=node_of, host_of=host_of
    )
    reads: dict[int, list[Read]] = defaultdict(list)
    transfers: list[Transfer] = []
    for i, route in enumerate(routes):
        for s in route.sources:
            reads[s.rank].append(Read(route.path, route.chunk, s.remote))
            for dst, shared in route.sends(s):
                transfers.append(Transfer(route.path, route.chunk, s.rank, dst, tag(i), shared))
    return dict(reads), transfers, load
