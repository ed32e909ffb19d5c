"""A restore's first round: which node holds each saving rank's files of the chosen step, and the
step's index (``find_holders``). Each node uses all of its copy of the step's manifest files or
none of it (``node_copy``); a damaged copy is read from the remote tier only where the remote holds
the same save.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tiercheck.cluster.coordination import Coordinator, Exchange, dumps, shard_of
from tiercheck.cluster.job import Job
from tiercheck.cluster.keys.restore import holder_key, node_holds_key, part_scope, step_index_key
from tiercheck.cluster.wire import RankSet
from tiercheck.errors import CheckpointNotFoundError, CorruptCheckpointError, TiercheckError
from tiercheck.format.codec import unseal
from tiercheck.format.manifest import ManifestIndex, parse_manifest_doc, parse_rank_part
from tiercheck.format.paths import part_file, step_dir
from tiercheck.format.saveid import check_file_save
from tiercheck.format.steps import manifest_file, read_index, read_marker, read_small
from tiercheck.restore.messages import HolderClaim, NodeHolds, loads
from tiercheck.tiers.base import Tier

log = logging.getLogger("tiercheck")

FileId = tuple[str, int]  # ("rank" | "arrays" | "owners", saving rank)


@dataclass(frozen=True, slots=True)
class Step:
    """What every rank knows of the chosen step once holders are known."""

    step: int
    index: bytes  # manifest.json as stored
    world_size: int  # of the saving job
    here: frozenset[int]  # saving ranks whose files this node holds
    from_remote: bool  # the step is committed on the remote tier
    claimed: tuple[str, ...]  # store keys this rank set for the whole restore (deleted at its end)
    save_id: str  # every manifest file read must name this save


def find_holders(
    job: Job,
    root: str,
    step: int,
    here: Sequence[int],
    written: Sequence[int] = (),
    *,
    from_remote: bool,
    host: str | None = None,
    dropped: Sequence[int] | None = None,
) -> Exchange[Step]:
    """Round 1: claim the saving ranks whose files this node holds; share the step's index. A node
    claims the ranks it ``written`` itself first; only then, in a second round, the peers' replicas it
    holds (``here`` less those), for the ranks no node claimed: a rank's own node serves its files.

    The node's leader decides what of its directory the node uses (``node_copy``: all of it, or
    nothing when its manifest files are damaged and the remote tier has the step); the other ranks
    of the node take ``here`` and ``written`` from it, so a node never disagrees with itself.
    ``host``: this node's host (``restore.read.share_key``), said with its claims.

    ``dropped`` (every rank gives a list, or every rank None): the step is read again, and the
    saving ranks listed (on a node's leader) are those whose files, as this node holds them, were
    found damaged, left out of ``here``. Each must then be claimed by another node, or be on the
    remote tier, or the step is damaged (``CorruptCheckpointError`` on every rank)."""
    coord, tier, nodes, remote = job.coord, job.tier, job.nodes, job.remote
    index_key = step_index_key(coord, root)
    own: TiercheckError | None = None
    claimed: list[str] = []
    members = HolderClaim(RankSet.of(nodes.ranks), host).entry()

    def claim(ranks: Sequence[int], *, copies: bool = False) -> None:
        # A copy's claim says so: a node holding another copy then adds its own after it
        # (``holders_of(every_copy=True)``: they share the reads), never to a claim its writer's node made.
        mine = HolderClaim(RankSet.of(nodes.ranks), host, copy=True).entry() if copies else members
        for w in ranks:
            key = holder_key(coord, root, w)
            got = coord.decide(key, mine)
            if got == mine:
                claimed.append(key)
            elif copies and HolderClaim.read(got, where=key, field="claim", world=coord.world_size)[0].copy:
                coord.append(key, mine)

    node_key = node_holds_key(coord, root, nodes.leader)
    if coord.rank == nodes.leader:
        try:
            index = node_copy(tier, step, here, remote=remote if from_remote else None) if here else None
            if index is None:
                here, written = (), ()
            if len(nodes.ranks) > 1:
                coord.set(node_key, dumps(NodeHolds(RankSet.of(here), RankSet.of(written)).to_json()))
                claimed.append(node_key)
            if index is not None:
                if coord.decide(index_key, index.decode()) == index.decode():
                    claimed.append(index_key)
                claim(sorted(set(here) & set(written)))
        except TiercheckError as e:
            own = e
            coord.report(part_scope(root, "holders"), e)
    yield coord.arrive(part_scope(root, "holders"), what="the nodes holding the step to say so")
    coord.check(part_scope(root, "holders"), own, shared=(CorruptCheckpointError,))
    if coord.rank != nodes.leader:
        mine = NodeHolds.from_json(loads(coord.get(node_key), where=node_key), where=node_key)
        here, written = tuple(mine.here), tuple(mine.written)
    copies = sorted(set(here) - set(written))
    if copies and coord.rank == nodes.leader:
        claim(copies, copies=True)
    yield coord.arrive(part_scope(root, "replicas"), what="the nodes holding replicas of the step to say so")
    if dropped is not None:
        yield from _claimed_elsewhere(coord, root, dropped, from_remote=from_remote, where=f"{tier.url}: step {step}")
    # The step's index: a node's (node_copy chose to use that node's files), else the remote's. A
    # node whose copy is damaged reads the remote's only where it is the same save (node_copy), and
    # every manifest file read is checked against the save of the index the job goes by.
    if coord.has(index_key):
        index = coord.get(index_key)
    elif from_remote and remote is not None:  # no node holds any of it
        _, _, index = read_index(remote, step)
    else:
        raise CorruptCheckpointError(f"{tier.url}: step {step}: no node shared the step's index")
    where = f"{tier.url}: step {step}"
    ix = ManifestIndex.from_doc(parse_manifest_doc(index, where=where, step=step), where=where)
    return Step(step, index, ix.world_size, frozenset(here), from_remote, tuple(claimed), ix.save_id)


def _claimed_elsewhere(
    coord: Coordinator, root: str, dropped: Sequence[int], *, from_remote: bool, where: str
) -> Exchange[None]:
    """Every rank: whether each saving rank a node left out, its copy damaged, has another holder
    (or the remote tier holds the step); where one has none, the step is damaged on every rank."""
    lost = [w for w in dropped if not coord.has(holder_key(coord, root, w))] if not from_remote else []
    own = None
    if lost:
        own = CorruptCheckpointError(f"{where}: no other node holds a copy of saving rank(s) {lost}' files")
        coord.report(part_scope(root, "copies"), own)
    yield coord.arrive(part_scope(root, "copies"), what="the nodes to find other copies of damaged files")
    coord.check(part_scope(root, "copies"), own, shared=(CorruptCheckpointError,))


def node_copy(tier: Tier, step: int, here: Iterable[int], *, remote: Tier | None) -> bytes | None:
    """The step's index as this node holds it, when this node's copy of the step's manifest files
    can be used: its ``manifest.json`` (checked against its commit marker) and the sealed parts,
    arrays and owners files of the saving ranks ``here`` all read and check. Else, when ``remote``
    (the step is committed there) is given, None: the node restores the step from the remote tier
    as a node holding none of it, as a damaged chunk is read from there; without a remote tier,
    the node's damage is the step's (``CorruptCheckpointError``), and the restore falls back.

    The one place a restore chooses between a node's own manifest files and the remote tier's:
    a node either uses all of its copy or none of it, never one tier's index with another's parts."""
    where = f"{tier.url}: step {step}"
    d = step_dir(step)
    try:
        _, doc, index = read_index(tier, step)
        ix = ManifestIndex.from_doc(doc, where=where)
        coordinated: set[int] = set()  # ranks whose arrays some chunk written here belongs to
        for w in sorted(set(here)):
            at = f"{where}: {part_file(w)}"
            raw = read_manifest_file(tier, d, ("rank", w))
            part = parse_rank_part(unseal(raw, where=at), where=at, save=ix.save_id)
            coordinated.update(shard_of(p, ix.world_size) for p in part.checksums)
        for w in sorted(set(here)):
            for kind in ("arrays", "owners"):
                raw, at = read_manifest_file(tier, d, (kind, w)), f"{where}: {manifest_file(kind, w)}"
                if raw:
                    check_file_save(unseal(raw, where=at), ix.save_id, where=at)
                elif w in coordinated:
                    raise CorruptCheckpointError(f"{at} is missing, and chunks written here are of its arrays")
    except (CorruptCheckpointError, CheckpointNotFoundError) as e:
        if remote is None:
            raise CorruptCheckpointError(str(e)) from None
        mine, theirs = _save_of(tier, step), _save_of(remote, step)
        if mine is not None and theirs != mine:  # the remote's step of that number is another save's
            raise CorruptCheckpointError(
                f"{e}; and {remote.url} holds {'another save' if theirs else 'no whole copy'} of step {step} "
                f"(save {theirs}, this node's is {mine})"
            ) from None
        log.warning("%s: this node's copy of the step is damaged, reading all of it from %s: %s", where, remote.url, e)
        return None
    # This node's files are used beside other nodes' and the remote tier's: every manifest file read
    # in the restore is checked against the save of the index it goes by (``Step.save_id``), so a
    # node or tier holding another save of the step number fails the step (and the restore falls back).
    return index


def _save_of(tier: Tier, step: int) -> str | None:
    """The save ``tier``'s commit marker of ``step`` names; None where it names none or cannot
    be read (a damaged marker says nothing of the save)."""
    try:
        return read_marker(tier, step).save_id
    except (CorruptCheckpointError, CheckpointNotFoundError, OSError):
        return None


def holders_of(
    coord: Coordinator,
    name: str,
    saving: Iterable[int],
    *,
    remote: bool,
    hosts: dict[int, str | None] | None = None,
    every_copy: bool = False,
) -> dict[int, list[int]]:
    """The restoring ranks that can read each of these saving ranks' files (none: only the remote):
    those of the node whose claim stood (the one serving its manifest files), and with
    ``every_copy``, after them, those of every other node holding a copy of files no writer's node
    claimed (a replaced node's: each holder reads part of its chunks). Into ``hosts`` where given,
    their host, by restoring rank."""
    wanted = sorted(set(saving))
    keys = [holder_key(coord, name, w) for w in wanted]
    if remote:  # some saving ranks may be on no node: ask for each before reading
        present = [(w, k) for w, k in zip(wanted, keys, strict=True) if coord.has(k)]
    else:  # the step is whole across the nodes: every saving rank has a holder
        present = list(zip(wanted, keys, strict=True))
    values = coord.multi_get([k for _, k in present])
    out: dict[int, list[int]] = {}
    for (w, k), v in zip(present, values, strict=True):
        claims = HolderClaim.read(v, where=k, field="claim", world=coord.world_size)  # a copy's: the first, then others
        out[w] = []
        for claim in claims if every_copy else claims[:1]:
            out[w] += [r for r in claim.ranks if r not in out[w]]
            if hosts is not None:
                hosts.update(dict.fromkeys(claim.ranks, claim.host))
    return out


def read_manifest_file(tier: Tier, d: str, f: FileId) -> bytes:
    kind, rank = f
    try:
        return read_small(tier, f"{d}/{manifest_file(kind, rank)}", where=tier.url)
    except FileNotFoundError:
        if kind != "rank":  # a rank that coordinated no array
            return b""
        raise CorruptCheckpointError(f"{tier.url}: {d}/{part_file(rank)} is missing from a committed step") from None
