"""Planning a restore with every rank's cost flat in the job's size.

The step is chosen first (``restore.agree.agree_on_step``). Then, in rounds closed by barriers:

1. **Holders** (``restore.holders.find_holders``). The first node holding each saving rank's files
   (its commit marker lists the rank) claims it in the store, naming the node's ranks: they can read
   that rank's chunks and parts of the manifest. The step's index goes into the store once.
2. **Fetch** (``restore.fetch.fetch``): each rank gets the manifest files it needs, and no others: its saving
   rank's part (its state tree), then, only if the live state has entries that tree lacks (a
   pipeline stage moved), the other ranks' parts, then the array shards of the arrays its tree
   refers to. Each file is read from this node's directory when it is here, from the remote tier
   when the step comes from there, and otherwise from the store, where the node holding it posts
   it on request.
3. **Plan reads** (``plan_restore``): ranks needing the same boxes of a coordinator's arrays
   (data-parallel replicas) are a group: the first of them posts the boxes to the arrays'
   coordinator (a rank on the node holding the array's shard, which reads the shard from disk),
   and each node's first rank registers the node's members (``NeedsPost``; ``restore.members``: the
   groups a node joined go under one signature per coordinator, so the replicas of a stage are one
   list of nodes, whatever the number of groups they share). The coordinator decides who reads
   each needed chunk and who gets it from whom (``cluster.assign.route_chunks``) and posts each
   group its routes once (``RouteWork``), with every set of ranks as a few runs
   (``cluster.wire.RankSet``); a rank reading for ranks outside its group gets those routes too. Each
   rank works out its own reads, sends and receives from the routes, with the checksum of each
   chunk it reads taken from the writer's part on its node. A rank reads alone the chunks its own
   saving rank wrote (``_self_served``), unless a group needing the same was posted already: then
   it joins it (the replica that wrote a piece hears how to serve the others with them, not apart).
   What a coordinator still reads per node is its first rank in a signature's list: a few bytes per
   replica.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tiercheck.cluster.assign import Need, Needers, Read, ReadAssignment, Route, Transfer, needed_chunks, route_chunks
from tiercheck.cluster.coordination import Coordinator, Exchange, dumps, shard_of
from tiercheck.cluster.hierarchy import gather_at_leader, node_of
from tiercheck.cluster.job import Job
from tiercheck.cluster.keys import digest, scope_key
from tiercheck.cluster.keys.restore import (
    groups_scope,
    needs_bucket,
    needs_n_key,
    part_scope,
    reads_round_scope,
    route_key,
    work_bucket,
)
from tiercheck.cluster.wire import bad
from tiercheck.errors import CoordinationError, CorruptCheckpointError, IncompatibleStateError, TiercheckError
from tiercheck.format.codec import chunk_nbytes, unseal
from tiercheck.format.extents import check_pack, check_sizes
from tiercheck.format.layout import chunks_in_box
from tiercheck.format.manifest import (
    ArrayRecord,
    RankPart,
    parse_rank_part,
)
from tiercheck.format.paths import owners_file, part_file, shard_file, step_dir
from tiercheck.format.shards import parse_owners, parse_shard
from tiercheck.restore.holders import Step, holders_of, read_manifest_file
from tiercheck.restore.members import GroupWord, Member, collect, sign
from tiercheck.restore.messages import ArrayShape, NeedsPost, RouteWork, loads
from tiercheck.tiers.base import Tier

log = logging.getLogger("tiercheck")


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """One restoring rank's part of the read plan."""

    reads: list[Read]
    transfers: list[Transfer]  # those this rank sends or receives
    records: dict[str, ArrayRecord]  # of the arrays it reads or receives, checksums of what it reads
    read_bytes: int

    @classmethod
    def alone(cls, assignment: ReadAssignment, records: dict[str, ArrayRecord]) -> RestorePlan:
        """The plan of a process reading on its own (``load``, ``seam.read_regions``): the one
        restoring rank's part of ``assignment``, made from ``records``."""
        return cls(assignment.reads[0], assignment.transfers, records, assignment.read_bytes[0])


@dataclass(frozen=True, kw_only=True)
class ReadRequest:
    """What one rank brings to the read plan (``plan_restore``): the boxes of global arrays it
    needs, the records of those arrays as it parsed them, the saving ranks' manifest parts it
    parsed already (the checksums are taken there), and how the job reads: ``read_once`` (one rank
    in the job reads each chunk, else one per node needing it: the job's nodes, ``Job.nodes``), and
    ``host`` (its node's host, ``restore.read.share_key``; None: it shares no memory)."""

    needs: Sequence[Need]
    records: Mapping[str, ArrayRecord]
    read_once: bool
    parts: Mapping[int, RankPart] = field(default_factory=dict)
    host: str | None = None


def plan_restore(job: Job, root: str, st: Step, request: ReadRequest) -> Exchange[RestorePlan]:
    """Round 3: post needs to the arrays' coordinators, plan there, learn this rank's work."""
    coord = job.coord
    name = part_scope(root, "reads")
    world = coord.world_size
    shards = sorted({shard_of(n.path, st.world_size) for n in request.needs})  # the same on every rank
    shard_holders = holders_of(coord, root, shards, remote=st.from_remote)
    by_coord: dict[int, list[Need]] = defaultdict(list)
    for n in request.needs:
        s = shard_of(n.path, st.world_size)
        by_coord[coordinator_of(s, shard_holders.get(s), world)].append(n)
    alone = _self_served(coord, name, st, request, by_coord)
    groups = _post_needs(coord, name, by_coord)
    yield from _register(job, name, groups, request.host)
    yield coord.arrive(reads_round_scope(name, "posted"), what="every rank to say what it needs")

    # As a coordinator: plan the reads of my arrays, post each group (and each other reader) its work.
    garbled, told = None, []
    try:
        coord.check(name)  # a node's first rank that could not register its node: its groups' registers are missing
        wanted, members = _collect_needs(coord, name)
    except CoordinationError as e:  # said to every rank, which would otherwise wait for its work
        garbled, wanted, members = e, {}, {}
        coord.report(name, e)
    if wanted:
        told = _coordinate_reads(job, root, st, wanted, members, request.records, read_once=request.read_once)
    del wanted, members, by_coord
    yield coord.arrive(reads_round_scope(name, "planned"), what="the coordinators to plan the restore's reads")
    coord.check(name, garbled, shared=(IncompatibleStateError, CorruptCheckpointError))

    # My work: what to read (with each chunk's checksum from its writer's part), send, receive. A
    # rank that cannot make it out (a part that lacks a checksum it should hold) still arrives at
    # the barrier below and says why, or the others would wait there out the whole timeout.
    plan: RestorePlan | None = None
    failure: TiercheckError | None = None
    try:
        plan = _my_work(job, name, st, {c: d for c, (d, _) in groups.items()}, alone, request.records, request.parts)
    except TiercheckError as e:
        failure = e
        coord.report(reads_round_scope(name, "done"), e)
    yield coord.arrive(reads_round_scope(name, "done"), what="every rank to learn its part of the restore")
    coord.delete(*told)  # read by now: every rank is past 'done'
    coord.check(reads_round_scope(name, "done"), failure, shared=(IncompatibleStateError, CorruptCheckpointError))
    assert plan is not None
    return plan


def _post_needs(coord: Coordinator, name: str, by_coord: Mapping[int, list[Need]]) -> dict[int, tuple[str, bool]]:
    """Round 1: post my needs to their coordinators; the digest of each group, by coordinator, and
    whether this rank was its first. Ranks needing the same boxes (replicas) have the same digest:
    the first of them posts the boxes (``_register`` says who the group's members are)."""
    digests: dict[int, tuple[str, bool]] = {}
    for c, items in sorted(by_coord.items()):
        digest = _digest(items)
        first = coord.add(needs_n_key(coord, name, c, digest), 1) == 1
        if first:
            coord.post(needs_bucket(name, c), dumps(NeedsPost(digest, tuple(items)).to_json()))
        digests[c] = (digest, first)
    return digests


def _register(job: Job, name: str, groups: Mapping[int, tuple[str, bool]], host: str | None) -> Exchange[None]:
    """Round 1, by node: the ranks of a node tell their first rank their groups (in the node's
    store), and it registers the node's members of each (``restore.members.sign``): a coordinator
    reads a few bytes per node, not per rank or group. ``host``: this node's host (the ranks of a
    node share one)."""
    coord, nodes = job.coord, job.nodes
    leader = nodes.leader
    if len(nodes.ranks) == 1:
        sign(coord, name, leader, host, {(c, d): ([coord.rank], first) for c, (d, first) in groups.items()})
        return
    node = node_of(coord)
    said = scope_key(node, groups_scope(name))
    members: dict[tuple[int, str], tuple[list[int], bool]] = {}
    try:
        raw = yield from gather_at_leader(
            node, groups_scope(name),
            "".join(GroupWord(c, d, coord.rank, first).entry() for c, (d, first) in sorted(groups.items())),
            what="this node's ranks to say which groups they need with",
        )  # fmt: skip
        if raw is None:
            return
        for i, w in enumerate(GroupWord.read(raw, where=said, field="groups", world=coord.world_size)):
            if w.rank not in nodes.ranks:
                raise bad(said, f"groups[{i}]", "the word of a rank of this node", w.entry())
            ranks, was = members.setdefault((w.coordinator, w.digest), ([], False))
            ranks.append(w.rank)
            members[w.coordinator, w.digest] = (ranks, was or w.first)
    except CoordinationError as e:  # said to every rank at the plan's next check
        coord.report(name, e)
        return
    sign(coord, name, leader, host, members)


def _collect_needs(coord: Coordinator, name: str) -> tuple[dict[str, list[Need]], dict[str, list[Member]]]:
    """Round 2, as a coordinator: what each group posted to me, and its members."""
    where = needs_bucket(name, coord.rank)
    posted = [NeedsPost.from_json(loads(v, where=where), where=where) for v in coord.collect(where)]
    wanted = {p.digest: list(p.needs) for p in posted}
    members = collect(coord, name, list(wanted))
    coord.delete(*(needs_n_key(coord, name, coord.rank, d) for d in wanted))
    return wanted, members


def _digest(needs: Sequence[Need]) -> str:
    """A group's name: the digest of the boxes its ranks need of one coordinator's arrays."""
    body = dumps(NeedsPost("", tuple(needs)).to_json()["needs"])
    return digest(body)


@dataclass(frozen=True, slots=True)
class SelfServed:
    """The reads a rank makes alone (``_self_served``), and the saving rank whose chunks they are
    (None: none)."""

    reads: list[Read]
    writer: int | None


def _self_served(
    coord: Coordinator, name: str, st: Step, request: ReadRequest, by_coord: dict[int, list[Need]]
) -> SelfServed:
    """The reads this rank makes alone, taken out of ``by_coord`` (what it posts to each
    coordinator), and the saving rank whose chunks they are: all it needs of a coordinator's
    arrays where its own saving rank wrote every chunk of it, on its node. Restoring the layout it
    saved, that is a distributed optimizer's slice: nobody else needs it, and no coordinator need
    hear of it. All or nothing per coordinator, so replicas still ask as one group for the rest.
    Where a group needing the same has been posted already (replicas: one of them wrote each
    piece), it joins the group instead, and learns from the group's one route message how to serve
    the others, where its coordinator would otherwise post it its own. Where other ranks need such
    a chunk too, their coordinator has this rank read it for them (``route_chunks``' ``owners_read``:
    it is read once on its node). Not with ``read_once``, where one rank in the job reads each
    chunk, whoever needs it."""
    rank = coord.rank
    own = rank if rank < st.world_size else None
    part = None if own is None else request.parts.get(own)
    if request.read_once or part is None or own not in st.here:
        return SelfServed([], None)
    reads: list[Read] = []
    for c, needs in list(by_coord.items()):
        of_c: list[Read] = []  # the reads of coordinator c's arrays
        for n in needs:
            rec, written = request.records.get(n.path), part.checksums.get(n.path, {})
            chunks = list(chunks_in_box(rec.shape, rec.chunks, n.offsets, n.shape)) if rec is not None else []
            if not chunks or not all(ch.key in written for ch in chunks):
                break
            of_c += [Read(n.path, ch, False) for ch in chunks]
        else:
            if coord.has(needs_n_key(coord, name, c, _digest(needs))):
                continue  # its replicas' group, posted already
            reads += of_c
            del by_coord[c]
    return SelfServed(reads, own)


def _my_work(
    job: Job,
    name: str,
    st: Step,
    groups: Mapping[int, str],
    alone: SelfServed,
    records: Mapping[str, ArrayRecord],
    parts: Mapping[int, RankPart],
) -> RestorePlan:
    """This rank's reads, sends and receives, worked out from the routes its coordinators posted
    (to each of its groups, and to it alone where it reads for ranks of other groups) and the
    reads it makes ``alone`` (of chunks its own saving rank wrote), with the checksum of every chunk
    it reads."""
    coord, tier, remote = job.coord, job.tier, job.remote
    rank = coord.rank
    out_reads: dict[tuple[str, tuple[int, ...]], Read] = {(x.path, x.chunk.coords): x for x in alone.reads}
    out_moves: dict[tuple[int, int], Transfer] = {}
    recs: dict[str, ArrayRecord] = {x.path: records[x.path] for x in alone.reads}
    owners_of: dict[tuple[str, str], int] = {}  # each chunk this rank reads: its writer, whose part holds its CRC
    if alone.writer is not None:
        owners_of.update(((x.path, x.chunk.key), alone.writer) for x in alone.reads)
    personal = work_bucket(name, rank)
    keys = [route_key(coord, name, c, d) for c, d in sorted(groups.items())]
    told = [(personal, v) for v in coord.collect(personal)]
    told += list(zip(keys, coord.multi_get(keys), strict=True))
    for where, value in told:
        w = RouteWork.from_json(loads(value, where=where), where=where, world=coord.world_size)
        for short in w.records:  # shape and chunks: as this rank parsed them where it did
            if short.path not in recs:
                recs[short.path] = records.get(short.path) or short.record()
        for route, tag in w.routes:
            c = route.chunk
            as_source = next((s for s in route.sources if s.rank == rank), None)
            if as_source is not None:
                out_reads[route.path, c.coords] = Read(route.path, c, as_source.remote)
                owners_of[route.path, c.key] = route.owner
                for dst, shared in route.sends(as_source):
                    out_moves[tag, dst] = Transfer(route.path, c, rank, dst, tag, shared)
            elif rank in route.needers:
                src = route.source_of(rank)
                out_moves[tag, rank] = Transfer(route.path, c, src.rank, rank, tag, rank in src.shared)
    by_path: dict[str, dict[str, int]] = defaultdict(dict)
    offsets: dict[str, dict[str, int]] = defaultdict(dict)
    for (path, key), (crc, offset) in _checksums(tier, remote, st, owners_of, parts, recs).items():
        by_path[path][key] = crc
        offsets[path][key] = offset
    for path, rec in list(recs.items()):
        crcs = by_path.get(path, {})
        recs[path] = rec.with_chunks(
            checksums=crcs,
            owners={key: owners_of[path, key] for key in crcs},
            offsets=offsets.get(path, {}),
        )
    for path, rec in records.items():
        recs.setdefault(path, rec)
    reads = sorted(out_reads.values(), key=lambda x: (x.path, x.chunk.coords))
    transfers = [out_moves[k] for k in sorted(out_moves)]
    nbytes = sum(chunk_nbytes(recs[x.path]) for x in reads)
    return RestorePlan(reads, transfers, recs, nbytes)


def _coordinate_reads(
    job: Job,
    root: str,
    st: Step,
    wanted: Mapping[str, list[Need]],
    members: Mapping[str, list[Member]],
    known: Mapping[str, ArrayRecord],
    *,
    read_once: bool,
) -> list[str]:
    """Plan the reads of the arrays whose needs were posted to this rank (by group, ``wanted``);
    post each group its routes, and each rank reading for another group its own (or report why
    the plan cannot be made). Returns the keys posted to groups (deleted once all read them).
    ``known``: records this rank parsed already from the same shards (its own manifest's, without
    owners): where they cover a shard's needed arrays, the shard is not parsed again."""
    coord = job.coord
    name = part_scope(root, "reads")
    rank, world = coord.rank, coord.world_size
    by_rank = {m.rank: m for ms in members.values() for m in ms}
    try:
        planned = _records_of(job, st, {n.path for ns in wanted.values() for n in ns}, known)
        chunks_of = {d: needed_chunks(planned, {0: ns}) for d, ns in wanted.items()}
        needers: Needers = {}
        for d, got in chunks_of.items():
            for k, (c, _) in got.items():
                needers.setdefault(k, (c, set()))[1].update(m.rank for m in members[d])
        owners = {planned[p].owner(c.key) for (p, _), (c, _) in needers.items()}
        claimed: dict[int, str | None] = {}  # host keys of the ranks of the nodes holding the chunks
        readers = holders_of(coord, root, owners, remote=st.from_remote, hosts=claimed, every_copy=True)

        def node_of_rank(r: int) -> int:
            """A rank's node: as it registered, or, for a chunk's writer reading its own chunks
            alone (not registered here), the node holding its files, where it is one of its ranks."""
            if r in by_rank:
                return by_rank[r].node
            return min(readers[r]) if r in readers.get(r, ()) else r

        routes, _ = route_chunks(
            planned,
            needers,
            lambda o: readers.get(o, []),
            read_once=read_once,
            remote=st.from_remote,
            node_of=node_of_rank,
            host_of=lambda r: by_rank[r].host if r in by_rank else claimed.get(r),
            owners_read=True,
        )
    except TiercheckError as e:
        coord.report(name, e)
        return []
    index = {(r.path, r.chunk.coords): (r, i * world + rank) for i, r in enumerate(routes)}
    group_of = {m.rank: d for d, ms in members.items() for m in ms}
    told = {}
    for d, got in chunks_of.items():
        mine_routes = tuple(index[k] for k in sorted(got))
        shapes = tuple(ArrayShape.of(planned[p]) for p in sorted({r.path for r, _ in mine_routes}))
        told[route_key(coord, name, rank, d)] = dumps(RouteWork(mine_routes, shapes).to_json())
    coord.multi_set(told)
    alone: dict[int, list[tuple[Route, int]]] = defaultdict(list)  # reads for groups not their own
    for k, (route, tag) in index.items():
        for s in route.sources:
            if s.rank not in group_of or k not in chunks_of[group_of[s.rank]]:
                alone[s.rank].append((route, tag))
    for r, items in sorted(alone.items()):
        shapes = tuple(ArrayShape.of(planned[p]) for p in sorted({route.path for route, _ in items}))
        coord.post(work_bucket(name, r), dumps(RouteWork(tuple(items), shapes).to_json()))
    return list(told)


def _records_of(job: Job, st: Step, paths: set[str], known: Mapping[str, ArrayRecord]) -> dict[str, ArrayRecord]:
    """The records of ``paths`` with their chunks' owners, from the shards of the step that hold
    them (``known`` where it covers a shard's needed arrays)."""
    tier, remote = job.tier, job.remote
    d = step_dir(st.step)
    out: dict[str, ArrayRecord] = {}
    by_shard: dict[int, set[str]] = defaultdict(set)
    for p in paths:
        by_shard[shard_of(p, st.world_size)].add(p)
    for s, in_shard in sorted(by_shard.items()):
        source = tier if s in st.here else remote
        if source is None:
            raise CorruptCheckpointError(f"{tier.url}: {d}/{shard_file(s)} is on no node this rank can read")
        if in_shard <= known.keys():
            out.update((p, known[p]) for p in in_shard)  # a single rank's restore: all of them
        else:
            raw = read_manifest_file(source, d, ("arrays", s))
            where = f"{source.url}: {d}/{shard_file(s)}"
            if raw:
                records = parse_shard(unseal(raw, where=where), where=where, save=st.save_id)
                for path, rec in records.items():
                    _check_owners(path, rec.owners, st.world_size, where=where)  # none, unless forged
                out.update(records)
        raw = read_manifest_file(source, d, ("owners", s))
        where = f"{source.url}: {d}/{owners_file(s)}"
        owned = parse_owners(unseal(raw, where=where), where=where, save=st.save_id) if raw else {}
        for path, writers in owned.items():
            _check_owners(path, writers, st.world_size, where=where)
            if path in out:
                out[path] = out[path].with_chunks(owners=writers)
    for p in paths:
        if p not in out:
            raise CorruptCheckpointError(f"{tier.url}: step {st.step}: no record of array {p!r}")
    return out


def _check_owners(path: str, owners: Mapping[str, int], world: int, *, where: str) -> None:
    """A chunk's writer must be a rank of the saving job: the reads wait on the store for a holder of
    each writer's files, and none would ever come for a rank that never was (a hang, then the store's
    own timeout error)."""
    for key, owner in owners.items():
        if owner >= world:
            raise CorruptCheckpointError(
                f"{where}: array {path!r} chunk {key}: owner {owner} is not a rank of the {world} that saved the step"
            )


def coordinator_of(shard: int, holders: list[int] | None, world: int) -> int:
    """The restoring rank planning the reads of the arrays in ``shard``: one on the node holding
    the shard (it reads it from disk), else (the shard is only on the remote tier) rank ``shard``
    modulo the world size."""
    if holders:
        return holders[shard % len(holders)]
    return shard % world


def _checksums(
    tier: Tier,
    remote: Tier | None,
    st: Step,
    owners_of: Mapping[tuple[str, str], int],
    parts: Mapping[int, RankPart],
    records: Mapping[str, ArrayRecord],
) -> dict[tuple[str, str], tuple[int, int]]:
    """The checksum of each chunk this rank reads, and its offset in its writer's pack,
    from the writer's part of the manifest: in ``parts`` when parsed already, else on this node
    (the reader is on the writer's node) or on the remote tier. Each part is checked as ``load``
    checks it (``format.extents``): its chunks' sizes are their ``records``', none overlaps another."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    d = step_dir(st.step)
    by_owner: dict[int, list[tuple[str, str]]] = defaultdict(list)
    for chunk, owner in owners_of.items():
        by_owner[owner].append(chunk)
    for owner, chunks in sorted(by_owner.items()):
        source = tier if owner in st.here else remote
        where = f"{(source or tier).url}: {d}/{part_file(owner)}"
        at = f"{(source or tier).url}: step {st.step}"
        part = parts.get(owner)
        if part is None:
            if source is None:
                raise CorruptCheckpointError(f"{tier.url}: {d}/{part_file(owner)} is on no tier this rank can read")
            raw = unseal(read_manifest_file(source, d, ("rank", owner)), where=where)
            part = parse_rank_part(raw, where=where, save=st.save_id)
            check_pack(part, owner, where=at)  # one in ``parts`` was, when it was assembled
        read = {path for path, _ in chunks}
        check_sizes(part, owner, {p: records[p] for p in read if p in records}, where=at)
        for path, key in chunks:
            if key not in part.checksums.get(path, {}):
                raise CorruptCheckpointError(f"{where}: no checksum for array {path!r} chunk {key}")
            out[path, key] = part.checksums[path][key], part.offsets[path][key]  # a part places each chunk it sums
    return out
