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
   member does (largest first, least loaded; ``planner.assign_owners``): the members see the same
   offers, so they agree without another exchange. It tells each coordinator which of its chunks
   it took (only the ranks that took some do);
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
from collections.abc import Sequence
from dataclasses import dataclass

from .codec import chunk_nbytes
from .coordination import Coordinator, Protocol, dumps, shard_of
from .errors import CoordinationError, IncompatibleStateError
from .layout import Chunk, chunk_at
from .manifest import ArrayRecord
from .planner import LeafDesc, Offer, WriteTask, assign_owners, chunk_array, local_chunk

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
) -> Protocol[SavePlan]:
    """This rank's side of making a save plan (see the module docstring). Every rank runs it
    with the same ``generation``; it yields at each barrier."""
    name = f"plan{generation}"
    rank, world = coord.rank, coord.world_size
    leaf_of = {d.path: i for i, d in enumerate(descs)}
    by_coord: dict[int, list[LeafDesc]] = defaultdict(list)
    for d in descs:
        by_coord[shard_of(d.path, world)].append(d)

    # 1. Post my pieces to their coordinators. Replicas hold the same pieces: the first of them
    #    posts the pieces, each appends its rank to the list of holders of that digest.
    digests: dict[int, str] = {}
    for c, leaves in sorted(by_coord.items()):
        body = dumps([d.to_json() for d in leaves])
        digests[c] = digest = hashlib.blake2b(body.encode(), digest_size=12).hexdigest()
        if coord.add(coord.key(name, "in", c, digest, "n"), 1) == 1:
            coord.post(f"{name}/in/{c}", f"{digest}|{body}")
        coord.append(coord.key(name, "in", c, digest, "ranks"), f"{rank},")
    yield coord.arrive(f"{name}/posted", what="every rank's tensors for a new save plan")

    # 2. As a coordinator: lay out my arrays and offer each chunk to its holders (one offer per
    #    digest: the holders of the same pieces get the same offer).
    bodies: dict[str, list[LeafDesc]] = {}
    for value in coord.collect(f"{name}/in/{rank}"):
        digest, body = value.decode().split("|", 1)
        bodies[digest] = [LeafDesc.from_json(leaf) for leaf in json.loads(body)]
    registers = {digest: coord.key(name, "in", rank, digest, "ranks") for digest in bodies}
    held = {
        digest: sorted(int(r) for r in value.decode().split(",") if r)
        for digest, value in zip(registers, coord.multi_get(list(registers.values())), strict=True)
    }
    coord.delete(*registers.values(), *(coord.key(name, "in", rank, digest, "n") for digest in bodies))
    pieces: dict[str, list[tuple[int, LeafDesc]]] = defaultdict(list)
    for digest, leaves in bodies.items():
        for r in held[digest]:
            for d in leaves:
                pieces[d.path].append((r, d))
    layouts: dict[str, tuple[ArrayRecord, list[tuple[Chunk, tuple[int, ...]]]]] = {}
    offers: dict[int, dict[str, list[object]]] = defaultdict(dict)
    try:
        for path in sorted(pieces):
            rec, chunks = chunk_array(path, sorted(pieces[path], key=lambda p: p[0]), target_chunk_bytes)
            layouts[path] = (rec, chunks)
            short = [rec.dtype, rec.kind, list(rec.shape), list(rec.chunks)]
            lists: dict[int, list[object]] = {}
            for r, _ in pieces[path]:  # every holder hears of the array, even of an empty piece
                lists[r] = offers[r][path] = [short, []]
            for chunk, holders in chunks:
                group = _encode_ranks(holders)
                for h in holders:
                    lists[h][1].append([list(chunk.coords), group])  # type: ignore[attr-defined]
    except IncompatibleStateError as e:
        coord.report(name, e)
        offers.clear()
    cand = {coord.key(name, "offer", rank, digest): dumps(offers[rs[0]]) for digest, rs in held.items() if offers}
    coord.multi_set(cand)
    offered = list(cand)  # deleted at the end; the rest is not needed past this point
    del cand, offers, pieces, bodies
    yield coord.arrive(f"{name}/offered", what="the coordinators to lay out the arrays of a new save plan")
    coord.check(name, shared=(IncompatibleStateError, CoordinationError))

    # 3. Take my share of every group of holders I belong to; tell the coordinators.
    mine_offers: list[Offer] = []
    records: dict[str, ArrayRecord] = {}
    coords_of = sorted(by_coord)
    groups: dict[tuple[int, ...], tuple[int, ...]] = {}  # one tuple per group of holders, shared
    for value in coord.multi_get([coord.key(name, "offer", c, digests[c]) for c in coords_of]):
        for path, (short, chunks) in json.loads(value).items():
            dtype, kind, shape, grid = short
            rec = ArrayRecord(path=path, dtype=dtype, kind=kind, shape=tuple(shape), chunks=tuple(grid))
            records[path] = rec
            nbytes = chunk_nbytes(rec)
            for cc, group in chunks:
                holders = groups.setdefault(tuple(group), _decode_ranks(group))
                mine_offers.append(Offer(nbytes, path, _chunk(rec, tuple(cc)), holders))
    missing = sorted(set(leaf_of) - set(records))
    if missing:
        raise CoordinationError(f"rank {rank}: the save plan left out {missing[:3]}")
    owners = assign_owners(mine_offers)
    taken: dict[int, dict[str, list[list[int]]]] = {c: {} for c in coords_of}
    tasks: list[WriteTask] = []
    nbytes = 0
    for offer, owner in zip(mine_offers, owners, strict=True):
        if owner != rank:
            continue
        i = leaf_of[offer.path]
        tasks.append(WriteTask(i, offer.chunk, local_chunk(offer.chunk, descs[i])))
        nbytes += offer.nbytes
        taken[shard_of(offer.path, world)].setdefault(offer.path, []).append(list(offer.chunk.coords))
    tasks.sort(key=lambda t: (t.leaf, t.chunk.coords))
    for c, took in taken.items():
        if took:  # only the ranks that took chunks of a coordinator's arrays tell it
            coord.post(f"{name}/took/{c}", dumps({"rank": rank, "took": took}))
    del mine_offers, owners, taken, groups
    yield coord.arrive(f"{name}/chosen", what="every rank to take its share of a new save plan")

    # 4. As a coordinator: record every chunk's owner (each must have exactly one).
    owners_by_path: dict[str, dict[str, int]] = defaultdict(dict)
    for value in coord.collect(f"{name}/took/{rank}"):
        doc = json.loads(value)
        h = int(doc["rank"])
        for path, coord_list in doc["took"].items():
            for cc in coord_list:
                key = _chunk(layouts[path][0], tuple(cc)).key
                if owners_by_path[path].setdefault(key, h) != h:
                    taken_twice = f"array {path!r} chunk {key}: taken by ranks {owners_by_path[path][key]} and {h}"
                    coord.report(name, CoordinationError(taken_twice))
    shard: dict[str, ArrayRecord] = {}
    for path, (rec, chunks) in layouts.items():
        owned = owners_by_path[path]
        if len(owned) != len(chunks):
            coord.report(
                name, CoordinationError(f"array {path!r}: {len(chunks) - len(owned)} chunk(s) taken by no rank")
            )
        shard[path] = rec.with_chunks(owners=dict(sorted(owned.items())))
    coord.delete(*offered)  # read by now: every holder passed 'chosen'
    yield coord.arrive(f"{name}/done", what="the coordinators to record a new save plan")
    coord.check(name, shared=(IncompatibleStateError, CoordinationError))
    coord.finish(name)
    return SavePlan(records=records, tasks=tasks, nbytes=nbytes, shard=shard)


def _chunk(rec: ArrayRecord, coords: tuple[int, ...]) -> Chunk:
    return chunk_at(rec.shape, rec.chunks, coords)


def _encode_ranks(ranks: tuple[int, ...]) -> list[int]:
    """A sorted rank list, compactly: ``[start, stride, count]`` negated-first when it is an
    arithmetic progression of three or more (DP replicas are), else the list itself."""
    if len(ranks) >= 3:
        stride = ranks[1] - ranks[0]
        if all(b - a == stride for a, b in itertools.pairwise(ranks)):
            return [-1, ranks[0], stride, len(ranks)]
    return list(ranks)


def _decode_ranks(doc: list[int]) -> tuple[int, ...]:
    if doc and doc[0] == -1:
        _, start, stride, count = doc
        return tuple(range(start, start + stride * count, stride))
    return tuple(doc)
