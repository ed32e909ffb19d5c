"""Planning a restore with every rank's cost flat in the job's size.

The step is chosen first (``restore.agree.agree_on_step``). Then, in rounds closed by barriers:

1. **Holders** (``restore.holders.find_holders``). The first node holding each saving rank's files
   (its commit marker lists the rank) claims it in the store, naming the node's ranks: they can read
   that rank's chunks and parts of the manifest. The step's index goes into the store once.
2. **Fetch** (``fetch``): each rank gets the manifest files it needs, and no others: its saving
   rank's part (its state tree), then, only if the live state has entries that tree lacks (a
   pipeline stage moved), the other ranks' parts, then the array shards of the arrays its tree
   refers to. Each file is read from this node's directory when it is here, from the remote tier
   when the step comes from there, and otherwise from the store, where the node holding it posts
   it on request.
3. **Plan reads** (``plan_restore``): each rank posts what it needs of each array to the array's
   coordinator (a rank on the node holding the array's shard, which reads the shard from disk);
   each coordinator decides who reads each needed chunk and who sends it to whom
   (``dist.assign.assign_reads``), and posts every rank its work. A rank learns its reads, sends and
   receives, with the checksum of each chunk it reads taken from the writer's part on its node.
"""


from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tiercheck.cluster.assign import Need, Read, Transfer, assign_reads, needed_chunks
from tiercheck.cluster.coordination import Coordinator, Exchange, Nodes, dumps, shard_of
from tiercheck.errors import CorruptCheckpointError, IncompatibleStateError, TiercheckError
from tiercheck.format.codec import chunk_nbytes, unseal
from tiercheck.format.extents import check_pack, check_sizes
from tiercheck.format.layout import chunk_at
from tiercheck.format.manifest import (
    JSON,
    ArrayRecord,
    ManifestIndex,
    RankPart,
    parse_manifest_doc,
    parse_rank_part,
)
from tiercheck.format.paths import owners_file, part_file, shard_file, step_dir
from tiercheck.format.shards import parse_owners, parse_shard
from tiercheck.restore.holders import FileId, Step, holders_of, read_manifest_file
from tiercheck.tiers.base import Tier

log = logging.getLogger("tiercheck")



def fetch(
    coord: Coordinator,
    root: str,
    name: str,
    tier: Tier,
    nodes: Nodes,
    st: Step,
    remote: Tier | None,
    wanted: set[FileId],
) -> Exchange[dict[FileId, bytes]]:
    """Round 2 (run once per kind of file a rank wants): the manifest files in ``wanted``, as stored.

    A shard that does not exist (its rank coordinated nothing) comes back empty. A file that
    cannot be read fails every rank (the reader with its own error, the others quoting it)."""
    d = step_dir(st.step)
    got: dict[FileId, bytes] = {}
    away = sorted(f for f in wanted if f[1] not in st.here)
    own: TiercheckError | None = None
    try:
        for f in sorted(wanted - set(away)):
            got[f] = read_manifest_file(tier, d, f)
        if st.from_remote and remote is not None:  # from a node where one holds them (a peer's copy too)
            held = holders_of(coord, root, {f[1] for f in away}, remote=True)
            for f in [f for f in away if f[1] not in held]:
                got[f] = read_manifest_file(remote, d, f)
            away = [f for f in away if f[1] in held]
    except TiercheckError as e:
        own, away = e, []
        coord.report(name, e)
    coord.multi_set({coord.key(name, "want", *f): "1" for f in away})
    yield coord.arrive(f"{name}/wanted", what="every rank to ask for the manifest files it needs")
    served: list[str] = []
    if coord.rank == nodes.leader:
        claimed = holders_of(coord, root, st.here, remote=st.from_remote)
        for w in sorted(st.here):
            if claimed.get(w) != list(nodes.ranks):
                continue  # another node serves this rank's files
            for kind in ("rank", "arrays"):
                want = coord.key(name, "want", kind, w)
                if coord.has(want):
                    file_key = coord.key(name, "file", kind, w)
                    try:
                        data = read_manifest_file(tier, d, (kind, w))
                    except TiercheckError as e:  # still answer: the asking rank must not wait forever
                        own, data = own or e, b""
                        coord.report(name, e)
                    coord.set(file_key, data)
                    served += [want, file_key]
    yield coord.arrive(f"{name}/served", what="the nodes holding the step to share manifest files")
    coord.check(name, own, shared=(CorruptCheckpointError,))
    files = [coord.key(name, "file", *f) for f in away]
    if files:  # served before the barrier; a file no node served fails within timeout_s, not the store's
        coord.wait(files, what="the manifest files this rank asked other nodes for")
    for f, value in zip(away, coord.multi_get(files), strict=True):
        got[f] = value
    yield coord.arrive(f"{name}/fetched", what="every rank to read the manifest files it asked for")
    coord.delete(*served)
    return got


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """One restoring rank's part of the read plan."""

    reads: list[Read]
    transfers: list[Transfer]  # those this rank sends or receives
    records: dict[str, ArrayRecord]  # of the arrays it reads or receives, checksums of what it reads
    read_bytes: int


def plan_restore(
    coord: Coordinator,
    root: str,
    name: str,
    tier: Tier,
    st: Step,
    remote: Tier | None,
    needs: Sequence[Need],
    records: Mapping[str, ArrayRecord],
    *,
    read_once: bool,
    parts: Mapping[int, RankPart] | None = None,
    node: int | None = None,
    host: str | None = None,
) -> Exchange[RestorePlan]:
    """Round 3: post needs to the arrays' coordinators, plan there, learn this rank's work.
    ``parts``: saving ranks' manifest parts already parsed (the checksums are taken there).
    ``node``: this rank's node (its first rank; default: a node of its own), whose ranks read each
    chunk once; ``host``: its host key (``restore.share.host_key``), None to share no memory."""
    rank, world = coord.rank, coord.world_size
    shards = sorted({shard_of(n.path, st.world_size) for n in needs})
    shard_holders = holders_of(coord, root, shards, remote=st.from_remote)
    by_coord: dict[int, list[list[object]]] = defaultdict(list)
    for n in needs:
        s = shard_of(n.path, st.world_size)
        by_coord[coordinator_of(s, shard_holders.get(s), world)].append([n.path, list(n.offsets), list(n.shape)])
    for c, items in sorted(by_coord.items()):
        doc: dict[str, object] = {"rank": rank, "needs": items}
        if node is not None and node != rank:  # left out where they say nothing: posted to every coordinator
            doc["node"] = node
        if host is not None:
            doc["host"] = host
        coord.post(f"{name}/needs/{c}", dumps(doc))
    yield coord.arrive(f"{name}/posted", what="every rank to say what it needs")

    # As a coordinator: plan the reads of my arrays, post each rank its work.
    posted = [json.loads(v) for v in coord.collect(f"{name}/needs/{rank}")]
    if posted:
        _coordinate_reads(coord, root, name, tier, st, remote, posted, records, read_once=read_once)
    del posted, by_coord
    yield coord.arrive(f"{name}/planned", what="the coordinators to plan the restore's reads")
    coord.check(name, shared=(IncompatibleStateError, CorruptCheckpointError))

    # My work: what to read (with each chunk's checksum from its writer's part), send, receive. A
    # rank that cannot make it out (a part that lacks a checksum it should hold) still arrives at
    # the barrier below and says why, or the others would wait there out the whole timeout.
    plan: RestorePlan | None = None
    failure: TiercheckError | None = None
    try:
        plan = _my_work(coord, name, tier, st, remote, records, parts or {})
    except TiercheckError as e:
        failure = e
        coord.report(f"{name}/done", e)
    yield coord.arrive(f"{name}/done", what="every rank to learn its part of the restore")
    coord.check(f"{name}/done", failure, shared=(IncompatibleStateError, CorruptCheckpointError))
    assert plan is not None
    return plan


def _my_work(
    coord: Coordinator,
    name: str,
    tier: Tier,
    st: Step,
    remote: Tier | None,
    records: Mapping[str, ArrayRecord],
    parts: Mapping[int, RankPart],
) -> RestorePlan:
    """This rank's reads, sends and receives, as its coordinators posted them, with the checksum
    of every chunk it reads."""
    rank = coord.rank
    out_reads: list[Read] = []
    out_moves: dict[int, Transfer] = {}
    recs: dict[str, ArrayRecord] = {}
    owners_of: dict[tuple[str, str], int] = {}
    for value in coord.collect(f"{name}/work/{rank}"):
        w = json.loads(value)
        for short in w["records"]:  # shape and chunks: as this rank parsed them where it did
            if short[0] not in recs:
                recs[short[0]] = records.get(short[0]) or _from_short(short)
        for path, cc, from_remote, owner in w["reads"]:
            chunk = chunk_at(recs[path].shape, recs[path].chunks, tuple(cc))
            out_reads.append(Read(path, chunk, bool(from_remote)))
            owners_of[path, chunk.key] = int(owner)
        for path, cc, src, dst, tag, *shared in w["moves"]:  # shared: [1], or left out
            chunk = chunk_at(recs[path].shape, recs[path].chunks, tuple(cc))
            out_moves[tag] = Transfer(path, chunk, src, dst, tag, bool(shared))
    by_path: dict[str, dict[str, int]] = defaultdict(dict)
    offsets: dict[str, dict[str, int]] = defaultdict(dict)
    for (path, key), (crc, offset) in _checksums(tier, remote, st, owners_of, parts, recs).items():
        by_path[path][key] = crc
        if offset is not None:
            offsets[path][key] = offset
    for path, rec in list(recs.items()):
        mine_crcs = by_path.get(path, {})
        recs[path] = rec.with_chunks(
            checksums=mine_crcs,
            owners={key: owners_of[path, key] for key in mine_crcs},
            offsets=offsets.get(path, {}),
        )
    for path, rec in records.items():
        recs.setdefault(path, rec)
    out_reads.sort(key=lambda x: (x.path, x.chunk.coords))
    transfers = sorted(out_moves.values(), key=lambda t: t.tag)
    nbytes = sum(chunk_nbytes(recs[x.path]) for x in out_reads)
    return RestorePlan(out_reads, transfers, recs, nbytes)


def _coordinate_reads(
    coord: Coordinator,
    root: str,
    name: str,
    tier: Tier,
    st: Step,
    remote: Tier | None,
    posted: list[JSON],
    known: Mapping[str, ArrayRecord],
    *,
    read_once: bool,
) -> None:
    """Plan the reads of the arrays whose needs were posted to this rank; post every rank its work
    (or report why the plan cannot be made). ``known``: records this rank parsed already from the
    same shards (its own manifest's, without owners): where they cover a shard's needed arrays,
    the shard is not parsed again (the owners are in a file of their own)."""
    rank, world = coord.rank, coord.world_size
    failure: TiercheckError | None = None
    d = step_dir(st.step)
    wanted: dict[int, list[Need]] = defaultdict(list)
    node_of: dict[int, int] = {}
    host_of: dict[int, str | None] = {}  # a rank that needs none of these arrays: None (shares no memory)
    for doc in posted:
        r = int(doc["rank"])
        wanted[r].extend(Need(p, tuple(o), tuple(s)) for p, o, s in doc["needs"])
        node_of[r], host = int(doc.get("node", r)), doc.get("host")
        host_of[r] = host if isinstance(host, str) else None
    try:
        mine: dict[str, ArrayRecord] = {}
        by_shard: dict[int, set[str]] = defaultdict(set)
        for ns in wanted.values():
            for n in ns:
                by_shard[shard_of(n.path, st.world_size)].add(n.path)
        for s, paths in sorted(by_shard.items()):
            source = tier if s in st.here else remote
            if source is None:
                raise CorruptCheckpointError(f"{tier.url}: {d}/{shard_file(s)} is on no node this rank can read")
            if paths <= known.keys():
                mine.update((p, known[p]) for p in paths)  # a single rank's restore: all of them
            else:
                raw = read_manifest_file(source, d, ("arrays", s))
                where = f"{source.url}: {d}/{shard_file(s)}"
                if raw:
                    records = parse_shard(unseal(raw, where=where), where=where, save=st.save_id)
                    for path, rec in records.items():
                        _check_owners(path, rec.owners, st.world_size, where=where)  # none, unless forged
                    mine.update(records)
            raw = read_manifest_file(source, d, ("owners", s))
            where = f"{source.url}: {d}/{owners_file(s)}"
            owned = parse_owners(unseal(raw, where=where), where=where, save=st.save_id) if raw else {}
            for path, writers in owned.items():
                _check_owners(path, writers, st.world_size, where=where)
                if path in mine:
                    mine[path] = mine[path].with_chunks(owners=writers)
        for ns in wanted.values():
            for n in ns:
                if n.path not in mine:
                    raise CorruptCheckpointError(f"{tier.url}: step {st.step}: no record of array {n.path!r}")
        needers = needed_chunks(mine, wanted)
        owners = {mine[p].owner(c.key) for (p, _), (c, _) in needers.items()}
        readers = holders_of(coord, root, owners, remote=st.from_remote)
        reads, transfers, _ = assign_reads(
            mine,
            needers,
            lambda o: readers.get(o, []),
            read_once=read_once,
            remote=st.from_remote,
            tag=lambda i: i * world + rank,
            node_of=lambda r: node_of.get(r, r),
            host_of=host_of.get,
        )
    except TiercheckError as e:
        failure = e
        reads, transfers = {}, []
    work: dict[int, dict[str, list[object]]] = defaultdict(lambda: {"reads": [], "moves": [], "records": []})
    used: dict[int, set[str]] = defaultdict(set)
    for r, rs in reads.items():
        for x in rs:
            work[r]["reads"].append([x.path, list(x.chunk.coords), x.remote, mine[x.path].owner(x.chunk.key)])
            used[r].add(x.path)
    for t in transfers:
        move = [t.path, list(t.chunk.coords), t.src, t.dst, t.tag, *([1] if t.shared else [])]
        for r in (t.src, t.dst):
            work[r]["moves"].append(move)
            used[r].add(t.path)
    for r, paths in used.items():
        work[r]["records"] = [_short(mine[p]) for p in sorted(paths)]
    for r, w in sorted(work.items()):
        coord.post(f"{name}/work/{r}", dumps(w))
    if failure is not None:
        coord.report(name, failure)


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
) -> dict[tuple[str, str], tuple[int, int | None]]:
    """The checksum of each chunk this rank reads, and its offset in its writer's pack (format 4),
    from the writer's part of the manifest: in ``parts`` when parsed already, else on this node
    (the reader is on the writer's node) or on the remote tier. Each part is checked as ``load``
    checks it (``format.extents``): its chunks' sizes are their ``records``', none overlaps another."""
    out: dict[tuple[str, str], tuple[int, int | None]] = {}
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
            out[path, key] = part.checksums[path][key], part.offsets.get(path, {}).get(key)
    return out


def _short(rec: ArrayRecord) -> list[object]:
    return [rec.path, rec.dtype, rec.kind, list(rec.shape), list(rec.chunks)]


def _from_short(doc: list[object]) -> ArrayRecord:
    path, dtype, kind, shape, chunks = doc
    return ArrayRecord(path=str(path), dtype=str(dtype), kind=str(kind), shape=tuple(shape), chunks=tuple(chunks))  # type: ignore[arg-type]


def index_of(st: Step, *, where: str) -> ManifestIndex:
    return ManifestIndex.from_doc(parse_manifest_doc(st.index, where=where), where=where)
