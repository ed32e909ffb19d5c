"""Making a save plan with every rank's cost flat in the job's size: per-array coordinators.

No rank sees every rank's descriptions. Each global array has one coordinating rank (a CRC of its
name modulo the world size), and the plan is made in four rounds, each closed by a barrier:

1. every rank describes its pieces, grouped by coordinator, and names each group by a digest of
   its description. Replicas (DP ranks, TP ranks of a replicated norm) have the same pieces and so
   the same digest: the first of them posts the description into the coordinator's bucket, each
   appends its rank to the digest's list of holders (a few bytes, not a description per replica);
2. each coordinator lays out its arrays (the chunk grid aligned to every piece, refusing a
   disagreement or a hole) and writes one offer per digest: the chunks those pieces hold, each
   with the full group of ranks holding that chunk;
3. each rank reads its offers and splits the offers of every group of holders as every other
   member does (largest first, least loaded; ``cluster.assign.assign_owners``): the members see the same
   offers, so they agree without another exchange. It tells each coordinator which of its chunks
   held by several it took (only the ranks that took some do; a chunk of one holder is that
   holder's, and the coordinator knows it: a distributed optimizer's slices cost nothing here);
4. each coordinator records the owner of every chunk of its arrays: its shard of the manifest,
   written beside the data at every save.

A rank sends and receives in proportion to the pieces it holds (plus, as a coordinator, to the
distinct pieces of a few arrays and a few bytes per holder): about the same at 16,384 ranks as at
8. The plan is cached and redone only when some rank's layout changes (every rank then plans
again, with a new generation number).
"""


from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from tiercheck.cluster.assign import LeafDesc, Offer, WriteTask, assign_owners, chunk_array, local_chunk
from tiercheck.cluster.coordination import Coordinator, Exchange, dumps, shard_of
from tiercheck.cluster.ranksets import RankSet
from tiercheck.cluster.wire import as_register, loads
from tiercheck.errors import CoordinationError, IncompatibleStateError
from tiercheck.format.codec import CHECKSUM_BYTES, chunk_nbytes, zarr_documents
from tiercheck.format.layout import Chunk, chunk_at, is_edge
from tiercheck.format.manifest import ArrayRecord
from tiercheck.format.paths import pack_file
from tiercheck.format.saveid import REFS_STAMP
from tiercheck.save.messages import ArrayOffer, ChunkOffer, PiecesPost, TookPost
from tiercheck.state.flatten import Leaf, dtype_name
from tiercheck.state.staging import ALIGN, align_up
from tiercheck.tiers.local import DIRECT_MIN_BYTES

log = logging.getLogger("tiercheck")


@dataclass(frozen=True, slots=True)
class SavePlan:
    """One rank's part of the job's save plan."""

    records: dict[str, ArrayRecord]  # every array this rank holds (no owners)
    tasks: list[WriteTask]  # the chunks this rank writes, in leaf order
    nbytes: int  # bytes of chunk data this rank writes
    shard: dict[str, ArrayRecord]  # the arrays this rank coordinates, with every chunk's owner


def plan_save(
    coord: Coordinator, generation: int, descs: Sequence[LeafDesc], *, target_chunk_bytes: int
) -> Exchange[SavePlan]:
    """This rank's side of making a save plan (see the module docstring). Every rank runs it
    with the same ``generation``; it yields at each barrier."""
    name = f"plan{generation}"
    by_coord: dict[int, list[LeafDesc]] = defaultdict(list)
    for d in descs:
        by_coord[shard_of(d.path, coord.world_size)].append(d)
    digests = _post_pieces(coord, name, by_coord)
    yield coord.arrive(f"{name}/posted", what="every rank's tensors for a new save plan")
    layouts, offered = _offer_chunks(coord, name, target_chunk_bytes)
    yield coord.arrive(f"{name}/offered", what="the coordinators to lay out the arrays of a new save plan")
    coord.check(name, shared=(IncompatibleStateError, CoordinationError))
    records, tasks, nbytes = _take_share(coord, name, descs, by_coord, digests)
    yield coord.arrive(f"{name}/chosen", what="every rank to take its share of a new save plan")
    shard = _record_owners(coord, name, layouts)
    coord.delete(*offered)  # read by now: every holder passed 'chosen'
    yield coord.arrive(f"{name}/done", what="the coordinators to record a new save plan")
    coord.check(name, shared=(IncompatibleStateError, CoordinationError))
    coord.finish(name)
    return SavePlan(records=records, tasks=tasks, nbytes=nbytes, shard=shard)


# An array as its coordinator lays it out: its record (no owners) and each chunk with the ranks holding it.
_Layout = tuple[ArrayRecord, list[tuple[Chunk, tuple[int, ...]]]]


def _post_pieces(coord: Coordinator, name: str, by_coord: dict[int, list[LeafDesc]]) -> dict[int, str]:
    """Round 1: post my pieces to their coordinators; the digest of each group, by coordinator.
    Replicas hold the same pieces: the first of them posts the pieces, each appends its rank to
    the list of holders of that digest."""
    digests: dict[int, str] = {}
    for c, leaves in sorted(by_coord.items()):
        body = dumps([d.to_json() for d in leaves])
        digests[c] = digest = hashlib.blake2b(body.encode(), digest_size=12).hexdigest()
        if coord.add(coord.key(name, "in", c, digest, "n"), 1) == 1:
            coord.post(f"{name}/in/{c}", dumps(PiecesPost(digest, tuple(leaves)).to_json()))
        coord.append(coord.key(name, "in", c, digest, "ranks"), f"{coord.rank},")
    return digests


def _offer_chunks(coord: Coordinator, name: str, target_chunk_bytes: int) -> tuple[dict[str, _Layout], list[str]]:
    """Round 2, as a coordinator: lay out my arrays and offer each chunk to its holders (one offer
    per digest: the holders of the same pieces get the same offer). Returns the layouts and the
    keys of the offers (deleted once every holder has read them). A disagreement or a hole is
    reported to every rank, and nothing is offered."""
    rank = coord.rank
    bodies: dict[str, list[LeafDesc]] = {}
    where = f"{name}/in/{rank}"
    for post in (PiecesPost.from_json(loads(v, where=where), where=where) for v in coord.collect(where)):
        bodies[post.digest] = list(post.pieces)
    registers = {digest: coord.key(name, "in", rank, digest, "ranks") for digest in bodies}
    held = {
        digest: sorted(as_register(value, key))
        for (digest, key), value in zip(registers.items(), coord.multi_get(list(registers.values())), strict=True)
    }
    coord.delete(*registers.values(), *(coord.key(name, "in", rank, digest, "n") for digest in bodies))
    pieces: dict[str, list[tuple[int, LeafDesc]]] = defaultdict(list)
    for digest, leaves in bodies.items():
        for r in held[digest]:
            for d in leaves:
                pieces[d.path].append((r, d))
    layouts: dict[str, _Layout] = {}
    offered: dict[int, dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]] = defaultdict(dict)
    try:
        for path in sorted(pieces):
            rec, chunks = chunk_array(path, sorted(pieces[path], key=lambda p: p[0]), target_chunk_bytes)
            layouts[path] = (rec, chunks)
            lists: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
            for r, _ in pieces[path]:  # every holder hears of the array, even of an empty piece
                lists[r] = offered[r][path] = []
            for chunk, holders in chunks:
                group = _encode_ranks(holders)
                for h in holders:
                    lists[h].append((chunk.coords, group))
    except IncompatibleStateError as e:
        coord.report(name, e)
        offered.clear()

    def offer(r: int) -> str:
        arrays = {path: ArrayOffer.of(layouts[path][0], tuple(chunks)) for path, chunks in offered[r].items()}
        return dumps(ChunkOffer(arrays=arrays).to_json())

    cand = {coord.key(name, "offer", rank, digest): offer(rs[0]) for digest, rs in held.items() if offered}
    coord.multi_set(cand)
    return layouts, list(cand)


def _take_share(
    coord: Coordinator,
    name: str,
    descs: Sequence[LeafDesc],
    by_coord: dict[int, list[LeafDesc]],
    digests: dict[int, str],
) -> tuple[dict[str, ArrayRecord], list[WriteTask], int]:
    """Round 3: take my share of every group of holders I belong to, and tell the coordinators.
    Returns the records of my arrays, the chunks I write (in leaf order) and their bytes."""
    rank, world = coord.rank, coord.world_size
    leaf_of = {d.path: i for i, d in enumerate(descs)}
    mine_offers: list[Offer] = []
    records: dict[str, ArrayRecord] = {}
    coords_of = sorted(by_coord)
    groups: dict[tuple[int, ...], tuple[int, ...]] = {}  # one tuple per group of holders, shared
    keys = [coord.key(name, "offer", c, digests[c]) for c in coords_of]
    for key, value in zip(keys, coord.multi_get(keys), strict=True):
        for path, array in ChunkOffer.from_json(loads(value, where=key), where=key).arrays.items():
            rec = records[path] = array.record(path)
            nbytes = chunk_nbytes(rec)
            for cc, group in array.chunks:
                if group not in groups:
                    groups[group] = _decode_ranks(group, world=world, where=key)
                holders = groups[group]
                mine_offers.append(Offer(nbytes, path, _chunk(rec, cc), holders))
    missing = sorted(set(leaf_of) - set(records))
    if missing:
        raise CoordinationError(f"rank {rank}: the save plan left out {missing[:3]}")
    owners = assign_owners(mine_offers)
    taken: dict[int, dict[str, list[tuple[int, ...]]]] = {c: {} for c in coords_of}
    tasks: list[WriteTask] = []
    nbytes = 0
    for offer, owner in zip(mine_offers, owners, strict=True):
        if owner != rank:
            continue
        i = leaf_of[offer.path]
        tasks.append(WriteTask(i, offer.chunk, local_chunk(offer.chunk, descs[i])))
        nbytes += offer.nbytes
        if len(offer.holders) > 1:  # a chunk of one holder is its: the coordinator knows it
            taken[shard_of(offer.path, world)].setdefault(offer.path, []).append(offer.chunk.coords)
    tasks.sort(key=lambda t: (t.leaf, t.chunk.coords))
    for c, took in taken.items():
        if took:  # only the ranks that took chunks of a coordinator's arrays tell it
            post = TookPost(rank=rank, took={path: tuple(ccs) for path, ccs in took.items()})
            coord.post(f"{name}/took/{c}", dumps(post.to_json()))
    return records, tasks, nbytes


def _record_owners(coord: Coordinator, name: str, layouts: dict[str, _Layout]) -> dict[str, ArrayRecord]:
    """Round 4, as a coordinator: record every chunk's owner; each must have exactly one (a chunk
    taken twice or by no rank is reported to every rank)."""
    owners_by_path: dict[str, dict[str, int]] = defaultdict(dict)
    where = f"{name}/took/{coord.rank}"
    for value in coord.collect(where):
        post = TookPost.from_json(loads(value, where=where), where=where)
        h = post.rank
        for path, coord_list in post.took.items():
            for cc in coord_list:
                key = _chunk(layouts[path][0], cc).key
                if owners_by_path[path].setdefault(key, h) != h:
                    taken_twice = f"array {path!r} chunk {key}: taken by ranks {owners_by_path[path][key]} and {h}"
                    coord.report(name, CoordinationError(taken_twice))
    shard: dict[str, ArrayRecord] = {}
    for path, (rec, chunks) in layouts.items():
        owned = owners_by_path[path]
        for chunk, holders in chunks:
            if len(holders) == 1 and owned.setdefault(chunk.key, holders[0]) != holders[0]:
                stray = f"array {path!r} chunk {chunk.key}: taken by rank {owned[chunk.key]}, which does not hold it"
                coord.report(name, CoordinationError(stray))
        if len(owned) != len(chunks):
            coord.report(
                name, CoordinationError(f"array {path!r}: {len(chunks) - len(owned)} chunk(s) taken by no rank")
            )
        shard[path] = rec.with_chunks(owners=dict(sorted(owned.items())))
    return shard


def _chunk(rec: ArrayRecord, coords: tuple[int, ...]) -> Chunk:
    return chunk_at(rec.shape, rec.chunks, coords)


def _encode_ranks(ranks: tuple[int, ...]) -> tuple[int, ...]:
    """A sorted rank list, compactly: ``[-1, start, stride, count]`` when it is an arithmetic
    progression of three or more (DP replicas are), ``[-2, *runs]`` when its runs
    (``cluster.ranksets``: every TP rank of every replica is one) are shorter, else the list itself."""
    if len(ranks) >= 3:
        stride = ranks[1] - ranks[0]
        if all(b - a == stride for a, b in itertools.pairwise(ranks)):
            return (-1, ranks[0], stride, len(ranks))
        runs = RankSet.of(ranks).runs
        if 4 * len(runs) + 1 < len(ranks):
            return (-2, *itertools.chain.from_iterable(runs))
    return ranks


def _decode_ranks(doc: tuple[int, ...], *, world: int, where: str) -> tuple[int, ...]:
    """The ranks of an encoded group (``_encode_ranks``), each below ``world``."""
    if doc[:1] == (-1,):
        _, start, stride, count = doc
        runs = [[start, 1, max(stride, 1), count]]
    elif doc[:1] == (-2,):
        runs = [list(doc[i : i + 4]) for i in range(1, len(doc), 4)]
    else:
        runs = [[r, 1, 1, 1] for r in doc]
    return tuple(sorted(RankSet.from_json(runs, where=where, field="holders", world=world)))


@dataclass(frozen=True, slots=True)
class ChunkTask:
    leaf: int  # index into the save's leaves
    path: str  # array path
    chunk: Chunk  # in the global array (its key names the file)
    local: Chunk  # the same chunk in the leaf tensor's own coordinates
    chunk_shape: tuple[int, ...]
    nbytes: int  # full (padded) chunk bytes
    offset: int  # where the chunk (data, then its CRC32C) starts in this rank's pack


RUN_BYTES = 64 << 20  # chunks are staged and written together in runs of up to this many bytes
RUN_CHUNKS = 512  # and this many chunks


@dataclass(frozen=True, slots=True)
class Run:
    """Consecutive chunks staged in one region of the pool exactly as they lie in the pack (data,
    checksum, data, ..., with the zeros of alignment gaps) and written with one call: one copy
    call, one write, one pool region for many chunks. A chunk longer than a run is one alone.

    The run starts ``lead`` bytes into its region: its offset in the pack modulo a page, so that
    the pack's block-aligned middle of the run is page-aligned in memory too, and is written with
    direct I/O wherever the run starts (0 where its first chunk cannot be placed there)."""

    tasks: list[ChunkTask]
    lead: int = 0

    @property
    def offset(self) -> int:
        return self.tasks[0].offset  # in the pack; each chunk's place in the region is relative to it

    @property
    def nbytes(self) -> int:
        last = self.tasks[-1]
        return last.offset + last.nbytes + CHECKSUM_BYTES - self.offset

    def at(self, t: ChunkTask) -> int:
        """Where chunk ``t`` starts in the run's region."""
        return self.lead + t.offset - self.offset

    @staticmethod
    def plan(tasks: list[ChunkTask], limit: int, placeable: Callable[[ChunkTask, int], bool]) -> list[Run]:
        """``tasks`` (in pack order) cut into runs spanning at most ``limit`` bytes. A chunk joins
        the run before it where ``placeable(task, place in the region)`` (its copy can land there)."""
        runs: list[Run] = []
        cur: list[ChunkTask] = []
        lead = 0
        for t in tasks:
            if cur and (
                len(cur) >= RUN_CHUNKS
                or t.offset + t.nbytes + CHECKSUM_BYTES - cur[0].offset > limit
                or not placeable(t, lead + t.offset - cur[0].offset)
            ):
                runs.append(Run(cur, lead))
                cur = []
            if not cur:
                lead = t.offset % ALIGN if placeable(t, t.offset % ALIGN) else 0
            cur.append(t)
        if cur:
            runs.append(Run(cur, lead))
        return runs


@dataclass(frozen=True, slots=True)
class PackPlan:
    """What this rank writes into its pack and how it stages it (chunks, runs, pool bytes): computed
    once and reused while the layout of every rank is unchanged."""

    signature: tuple[Any, ...]
    shard: dict[str, ArrayRecord]  # the arrays this rank coordinates, with their chunk owners
    tasks: list[ChunkTask]  # this rank's chunks: eager ones first, then lazy ones
    n_eager: int
    runs: tuple[list[Run], list[Run]]  # the eager tasks and the lazy ones in runs (``plan_runs``)
    placement: tuple[tuple[torch.device, tuple[int, ...]], ...]  # what the runs assumed (``leaf_placement``)
    rank: int
    refs: bytes  # this rank's zarr keys: its chunks in its pack, the zarr.json of the arrays it coordinates
    pool_bytes: int  # host memory this rank's whole snapshot needs


def pack_plan(
    leaves: list[Leaf],
    save_plan: SavePlan,
    *,
    signature: tuple[Any, ...],
    rank: int,
    root_doc: bool,
    align: int = 1,
) -> PackPlan:
    """This rank's part of the save plan: its chunks in copy order, eager leaves first, each at
    its place in the rank's pack (in that order; big chunks block-aligned, for direct I/O, the others
    at a multiple of ``align``: ``RUN_ALIGN`` where a slot of the memory tier stages the pack's image), and
    its reference map (its chunks, and the zarr documents of the arrays it coordinates; the
    step's own group with ``root_doc``)."""
    eager: list[ChunkTask] = []
    lazy: list[ChunkTask] = []
    for t in save_plan.tasks:
        leaf = leaves[t.leaf]
        rec = save_plan.records[leaf.path]
        task = ChunkTask(t.leaf, leaf.path, t.chunk, t.local, rec.chunks, chunk_nbytes(rec), 0)
        (lazy if leaf.lazy else eager).append(task)
    tasks, end = [], 0
    for task in eager + lazy:
        end = align_up(end) if task.nbytes >= DIRECT_MIN_BYTES else -(-end // align) * align
        tasks.append(replace(task, offset=end))
        end += task.nbytes + CHECKSUM_BYTES
    runs = plan_runs(leaves, tasks[: len(eager)], tasks[len(eager) :], RUN_BYTES)
    return PackPlan(
        signature=signature,
        shard=save_plan.shard,
        tasks=tasks,
        n_eager=len(eager),
        rank=rank,
        runs=runs,
        placement=leaf_placement(leaves),
        refs=reference_map(rank, tasks, zarr_documents(list(save_plan.shard.values()), root=root_doc)),
        pool_bytes=runs_bytes(runs),
    )


def leaf_placement(leaves: list[Leaf]) -> tuple[tuple[torch.device, tuple[int, ...]], ...]:
    """Each leaf's device and strides, which decide where ``plan_runs`` may place its chunks (which
    pieces are contiguous, which stream copies them). The plan's signature (shapes and dtypes, on
    which every rank re-plans together) leaves them out."""
    return tuple((leaf.tensor.device, leaf.tensor.stride()) for leaf in leaves)


def runs_bytes(runs: tuple[list[Run], list[Run]]) -> int:
    """The pool memory ``runs`` take at once: one region of whole pages a run."""
    return sum(align_up(r.lead + r.nbytes) for part in runs for r in part)


def plan_runs(
    leaves: list[Leaf], eager: list[ChunkTask], lazy: list[ChunkTask], limit: int
) -> tuple[list[Run], list[Run]]:
    """The eager and the lazy tasks in runs (``Run.plan``) whose chunks all come from one device
    (one stream copies a run), each chunk where its view can be taken: at a place aligned for its
    dtype, or anywhere when it is copied as bytes (a contiguous piece, no edge padding)."""

    def placeable(t: ChunkTask, at: int) -> bool:
        return at % RUN_ALIGN == 0 or as_bytes(leaves[t.leaf].tensor, t) is not None

    def cut(tasks: list[ChunkTask]) -> list[Run]:
        runs: list[Run] = []
        start = 0
        devices = [leaves[t.leaf].tensor.device for t in tasks]
        for i in range(1, len(tasks) + 1):
            if i == len(tasks) or devices[i] != devices[start]:
                runs.extend(Run.plan(tasks[start:i], limit, placeable))
                start = i
        return runs

    return cut(eager), cut(lazy)


def reference_map(rank: int, tasks: list[ChunkTask], docs: dict[str, bytes]) -> bytes:
    """A kerchunk reference map (version 1) of this rank's zarr keys: each chunk's byte range in
    its pack, under the template ``{{u}}`` a reader sets to the step's URL, and the ``zarr.json``
    documents inline. The union of every rank's map is the step as one zarr group."""
    if not tasks and not docs:
        return b""
    pack = "{{u}}/" + pack_file(rank)
    refs: dict[str, object] = {k: v.decode() for k, v in docs.items()}
    for t in tasks:
        refs[f"{t.path}/{t.chunk.key}"] = [pack, t.offset, t.nbytes + CHECKSUM_BYTES]
    return json.dumps({"version": 1, "templates": {"u": "."}, "refs": refs}, separators=(",", ":")).encode()


def stamp_reference_map(refs: bytes, *, step: int, save: str) -> bytes:
    """A rank's reference map (made once per plan) naming the step and save it is written for, as
    every file of a step does (format 5), under a key kerchunk readers pass over."""
    assert refs.endswith(b"}")
    stamp = json.dumps({"step": step, "save_id": save}, separators=(",", ":"))
    return refs[:-1] + f',"{REFS_STAMP}":{stamp}}}'.encode()


RUN_ALIGN = 64  # a chunk copied through a view of its dtype starts at a multiple of this in its run


def as_bytes(src: torch.Tensor, t: ChunkTask) -> torch.Tensor | None:
    """Chunk ``t`` of ``src`` as bytes, where it can be copied as such: a contiguous piece (a whole
    small tensor, rows of a big one) filling its chunk (no edge padding). None otherwise."""
    if src.device.type != "cpu" or is_edge(t.local, t.chunk_shape):
        return None
    whole = t.local.stops == src.shape and not any(t.local.starts)  # most chunks: no indexing to pay for
    piece = src if whole else src[t.local.slices()]
    if not piece.is_contiguous():
        return None
    return piece.reshape(-1).view(torch.uint8)


def leaf_descs(leaves: list[Leaf]) -> tuple[LeafDesc, ...]:
    """What planning needs of each leaf (and what tells a changed layout from an unchanged one)."""
    return tuple(
        LeafDesc(
            leaf.path,
            dtype_name(leaf.tensor.dtype),
            leaf.kind,
            leaf.global_shape,
            leaf.offsets,
            tuple(leaf.tensor.shape),
            leaf.lazy,
        )
        for leaf in leaves
    )
