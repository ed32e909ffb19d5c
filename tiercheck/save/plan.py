"""Making a save plan with every rank's cost flat in the job's size: per-array coordinators.

No rank sees every rank's descriptions. Each global array has one coordinating rank (a CRC of its
name modulo the world size), and the plan is made in four rounds, each closed by a barrier:

1. every rank describes its pieces, grouped by coordinator, and names each group by a digest of
   its description. Replicas (DP ranks, TP ranks of a replicated norm) have the same pieces and so
   the same digest: the first of them posts the description into the coordinator's bucket, each
   appends its rank to the digest's list of holders (a few bytes, not a description per replica).
   Equal slices cut along one dimension (a distributed optimizer's buffers over the DP ranks, TP
   weights) are described as block 0 of a pattern, the same for every slice, and each holder
   appends its rank and block (``save.patterns``);
2. each coordinator lays out its arrays (the chunk grid aligned to every piece, refusing a
   disagreement or a hole) and writes one offer per digest: the chunks those pieces hold, each
   with the full group of ranks holding that chunk (for a pattern, those of its first block, and
   how they move from block to block);
3. each rank reads its offers and splits the offers of every group of holders as every other
   member does (largest first, least loaded; ``cluster.assign.assign_owners``): the members see the same
   offers, so they agree without another exchange. It tells each coordinator which of its chunks
   held by several it took (only the ranks that took some do; a chunk of one holder is that
   holder's, and the coordinator knows it: a distributed optimizer's slices cost nothing here);
4. each coordinator records the owner of every chunk of its arrays: its shard of the manifest,
   written beside the data at every save.

A rank sends and receives in proportion to the pieces it holds (plus, as a coordinator, to the
distinct pieces of a few arrays and a few bytes per holder): about the same at 131,072 ranks as at
8. The plan is cached and redone only when some rank's layout changes (every rank then plans
again, with a new generation number).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from tiercheck.cluster.assign import LeafDesc, Offer, WriteTask, assign_owners, chunk_array, local_chunk
from tiercheck.cluster.coordination import Coordinator, Exchange, dumps, shard_of
from tiercheck.cluster.hierarchy import gather_at_leader
from tiercheck.cluster.keys import digest as digest_of
from tiercheck.cluster.keys import error_key, scope_key
from tiercheck.cluster.keys.save import (
    holders_key,
    offer_key,
    pieces_bucket,
    pieces_n_key,
    plan_holders_scope,
    plan_round_scope,
    plan_scope,
    took_bucket,
)
from tiercheck.cluster.wire import Run, loads
from tiercheck.errors import CoordinationError, IncompatibleStateError
from tiercheck.format.codec import chunk_nbytes
from tiercheck.format.layout import Chunk, chunk_at
from tiercheck.format.manifest import ArrayRecord
from tiercheck.save.messages import (
    ArrayOffer,
    ChunkOffer,
    HolderWord,
    PiecesPost,
    TookPost,
    holders_entry,
    parse_holders,
)
from tiercheck.save.patterns import EACH, apply_shift, as_pattern, pattern_offer, place

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
    name = plan_scope(generation)
    by_coord: dict[int, list[LeafDesc]] = defaultdict(list)
    for d in descs:
        by_coord[shard_of(d.path, coord.world_size)].append(d)
    digests, blocks = _post_pieces(coord, name, by_coord)
    yield from _register(coord, name, digests, blocks)
    yield coord.arrive(plan_round_scope(name, "posted"), what="every rank's tensors for a new save plan")
    layouts, offered = _offer_chunks(coord, name, target_chunk_bytes)
    yield coord.arrive(
        plan_round_scope(name, "offered"), what="the coordinators to lay out the arrays of a new save plan"
    )
    coord.check(name, shared=(IncompatibleStateError, CoordinationError))
    records, tasks, nbytes = _take_share(coord, name, descs, by_coord, (digests, blocks))
    yield coord.arrive(plan_round_scope(name, "chosen"), what="every rank to take its share of a new save plan")
    shard = _record_owners(coord, name, layouts)
    coord.delete(*offered)  # read by now: every holder passed 'chosen'
    yield coord.arrive(plan_round_scope(name, "done"), what="the coordinators to record a new save plan")
    coord.check(name, shared=(IncompatibleStateError, CoordinationError))
    coord.finish(name)
    return SavePlan(records=records, tasks=tasks, nbytes=nbytes, shard=shard)


# An array as its coordinator lays it out: its record (no owners) and each chunk with the ranks holding it.
_Layout = tuple[ArrayRecord, list[tuple[Chunk, tuple[int, ...]]]]


def _post_pieces(
    coord: Coordinator, name: str, by_coord: dict[int, list[LeafDesc]]
) -> tuple[dict[int, str], dict[int, int]]:
    """Round 1: post my pieces to their coordinators; the digest of each group, and my block of
    those posted as a block pattern (``save.patterns``), by coordinator. Replicas hold the same
    pieces (and ranks cutting arrays alike the same pattern): the first of them posts the pieces,
    each is registered as a holder of that digest (``_register``)."""
    digests: dict[int, str] = {}
    blocks: dict[int, int] = {}
    for c, leaves in sorted(by_coord.items()):
        pattern = as_pattern(leaves)
        posted = tuple(leaves) if pattern is None else pattern.leaves
        body = ("p" if pattern else "") + dumps([d.to_json() for d in posted])
        digests[c] = digest = digest_of(body)
        if coord.add(pieces_n_key(coord, name, c, digest), 1) == 1:
            coord.post(pieces_bucket(name, c), dumps(PiecesPost(digest, posted, pattern=pattern is not None).to_json()))
        if pattern is not None:
            blocks[c] = pattern.block
    return digests, blocks


def _register(coord: Coordinator, name: str, digests: dict[int, str], blocks: dict[int, int]) -> Exchange[None]:
    """Round 1, by node: the ranks of a node tell its first rank the digests they hold (and their
    blocks), in the node's store; it appends the node's holders of each digest to the digest's
    register in a few runs (``save.messages.Holders``): a coordinator reads an entry per node, not per rank,
    for an array the node's ranks all hold (a norm) or hold one block each of (a TP weight)."""
    node = coord.node
    if node is None or node.world_size == 1:
        for c, d in sorted(digests.items()):
            coord.append(holders_key(coord, name, c, d), holders_entry([(coord.rank, blocks.get(c))]))
        return
    said = scope_key(node, plan_holders_scope(name))
    members: dict[tuple[int, str], list[tuple[int, int | None]]] = defaultdict(list)
    try:
        mine = "".join(HolderWord(c, d, coord.rank, blocks.get(c)).entry() for c, d in sorted(digests.items()))
        what = "this node's ranks to say what they hold"
        raw = yield from gather_at_leader(node, plan_holders_scope(name), mine, what=what)
        if raw is None:
            return
        for w in HolderWord.read(raw, where=said, field="holders", world=coord.world_size):
            members[w.coordinator, w.digest].append((w.rank, w.block))
    except CoordinationError as e:  # said to every rank at the plan's next check
        coord.report(name, e)
        return
    for (c, d), held in sorted(members.items()):
        coord.append(holders_key(coord, name, c, d), holders_entry(held))


def _offer_chunks(coord: Coordinator, name: str, target_chunk_bytes: int) -> tuple[dict[str, _Layout], list[str]]:
    """Round 2, as a coordinator: lay out my arrays and offer each chunk to its holders (one offer
    per digest: the holders of the same pieces, or of one block pattern, get the same offer).
    Returns the layouts and the keys of the offers (deleted once every holder has read them). A
    disagreement or a hole is reported to every rank, and nothing is offered."""
    rank = coord.rank
    bodies: dict[str, PiecesPost] = {}
    where = pieces_bucket(name, rank)
    for post in (PiecesPost.from_json(loads(v, where=where), where=where) for v in coord.collect(where)):
        bodies[post.digest] = post
    if bodies and coord.has(error_key(coord, name)):  # a node's first rank could not register its node's holders:
        bodies = {}  # its registers are missing (every rank hears why at the next check)
    registers = {digest: holders_key(coord, name, rank, digest) for digest in bodies}
    held: dict[str, list[tuple[int, int]]] = {}  # each holder and its block (0: not a pattern)
    for (digest, key), value in zip(registers.items(), coord.multi_get(list(registers.values())), strict=True):
        held[digest] = sorted(parse_holders(value, where=key, world=coord.world_size, pattern=bodies[digest].pattern))
    coord.delete(*registers.values(), *(pieces_n_key(coord, name, rank, digest) for digest in bodies))
    pieces: dict[str, list[tuple[int, LeafDesc]]] = defaultdict(list)
    for digest, post in bodies.items():
        for r, k in held[digest]:
            for d in post.pieces:
                pieces[d.path].append((r, place(d, k) if post.pattern else d))
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
                for h in holders:
                    lists[h].append((chunk.coords, holders))
    except IncompatibleStateError as e:
        coord.report(name, e)
        offered.clear()

    def offer(r: int) -> str:
        arrays = {path: ArrayOffer.of(layouts[path][0], tuple(chunks)) for path, chunks in offered[r].items()}
        return dumps(ChunkOffer(arrays=arrays).to_json())

    cand: dict[str, str] = {}
    records = {path: rec for path, (rec, _) in layouts.items()}
    for digest, rs in held.items() if offered else ():
        key = offer_key(coord, name, rank, digest)
        if not bodies[digest].pattern:
            cand[key] = offer(rs[0][0])
            continue
        arrays = pattern_offer(bodies[digest].pieces, rs, records, offered)
        if arrays is not None:
            cand[key] = dumps(ChunkOffer(arrays=arrays).to_json())
            continue
        cand[key] = dumps(EACH)  # an uneven layout: the holders of each block their own offer
        first = {k: r for r, k in reversed(rs)}
        cand.update({offer_key(coord, name, rank, digest, k): offer(r) for k, r in first.items()})
    coord.multi_set(cand)
    return layouts, list(cand)


def _take_share(
    coord: Coordinator,
    name: str,
    descs: Sequence[LeafDesc],
    by_coord: dict[int, list[LeafDesc]],
    posted: tuple[dict[int, str], dict[int, int]],
) -> tuple[dict[str, ArrayRecord], list[WriteTask], int]:
    """Round 3: take my share of every group of holders I belong to, and tell the coordinators
    (``posted``: the digests, and my blocks of patterns, by coordinator). Returns the records of
    my arrays, the chunks I write (in leaf order) and their bytes."""
    rank, world = coord.rank, coord.world_size
    digests, blocks = posted
    leaf_of = {d.path: i for i, d in enumerate(descs)}
    mine_offers: list[Offer] = []
    records: dict[str, ArrayRecord] = {}
    coords_of = sorted(by_coord)
    groups: dict[tuple[Run, ...], tuple[int, ...]] = {}  # one tuple per group of holders (by its runs), shared
    moved: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}  # and per group moved to my block
    keys = [offer_key(coord, name, c, digests[c]) for c in coords_of]
    docs = [loads(value, where=key) for key, value in zip(keys, coord.multi_get(keys), strict=True)]
    uneven = [i for i, (c, doc) in enumerate(zip(coords_of, docs, strict=True)) if doc == EACH and c in blocks]
    if uneven:  # patterns whose layout is uneven: my block's own offers, in one request
        own = [offer_key(coord, name, coords_of[i], digests[coords_of[i]], blocks[coords_of[i]]) for i in uneven]
        for i, key, value in zip(uneven, own, coord.multi_get(own), strict=True):
            keys[i], docs[i] = key, loads(value, where=key)
    for c, key, doc in zip(coords_of, keys, docs, strict=True):
        for path, array in ChunkOffer.from_json(doc, where=key, world=world).arrays.items():
            rec = records[path] = array.record(path)
            nbytes = chunk_nbytes(rec)
            chunks = []
            for cc, group in array.chunks:
                if group.runs not in groups:
                    groups[group.runs] = tuple(group)
                chunks.append((cc, groups[group.runs]))
            if array.shift is not None:
                if c not in blocks:
                    raise CoordinationError(f"{key}: array {path!r} is offered as a block pattern, not posted as one")
                chunks = apply_shift(array, chunks, blocks[c], world=world, where=key, moved_groups=moved)
            mine_offers.extend(Offer(nbytes, path, _chunk(rec, cc), holders) for cc, holders in chunks)
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
            coord.post(took_bucket(name, c), dumps(post.to_json()))
    return records, tasks, nbytes


def _record_owners(coord: Coordinator, name: str, layouts: dict[str, _Layout]) -> dict[str, ArrayRecord]:
    """Round 4, as a coordinator: record every chunk's owner; each must have exactly one (a chunk
    taken twice or by no rank is reported to every rank)."""
    owners_by_path: dict[str, dict[str, int]] = defaultdict(dict)
    where = took_bucket(name, coord.rank)
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
