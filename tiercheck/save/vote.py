"""Committing a save across ranks: each rank posts its outcome, each node's first rank assembles
and publishes the node's commit marker once every rank of the job has written its part, and a
failure anywhere withdraws the step everywhere (``commit_save``, a sans-I/O protocol)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from tiercheck.cluster.coordination import Barrier, Coordinator, Exchange, drive
from tiercheck.cluster.hierarchy import forget_later, leave_node, node_of
from tiercheck.cluster.job import Job
from tiercheck.cluster.keys import arrived_key, node_in_scope, open_key
from tiercheck.cluster.keys.save import VOTE_KEYS, NodeVoteKey, vote_key, vote_node_key, vote_scope
from tiercheck.cluster.nodes import Nodes
from tiercheck.cluster.wire import loads
from tiercheck.errors import CoordinationError
from tiercheck.format.commit import commit_step
from tiercheck.format.manifest import (
    JSON,
    ManifestIndex,
)
from tiercheck.format.paths import owners_file, part_file, shard_file, step_dir
from tiercheck.save.handle import PendingSave
from tiercheck.save.messages import CommitMeta

log = logging.getLogger("tiercheck")

# ------------------------------------------------------------------------------------ commit


@dataclass(frozen=True, kw_only=True)
class RankOutcome:
    """What one rank brings to the commit of a save: its sealed manifest parts, or its failure."""

    step: int
    attempt: int  # the how-many-th save of this step in this job: a retry meets its own store keys
    save_id: str  # the save's id, the same on every rank: in every file of the step
    part: bytes = b""  # this rank's part of the manifest (sealed)
    shard: bytes | None = None  # the arrays it coordinates (sealed), if any
    owners: bytes | None = None  # their chunks' writers (sealed), if any
    error: BaseException | None = None  # why this rank cannot commit, if it cannot
    metadata: JSON = None  # the caller's, as rank 0 saved it
    library_version: str
    vote: str = "save"  # names the vote's store keys: a save committed to two tiers votes twice
    lineage: str | None = None  # written into the commit marker (the memory tier's: CommitMarker.lineage)


def commit_save(job: Job, outcome: RankOutcome) -> Exchange[None]:
    """Commit one save once this rank's chunks are durable (or report that they are not).

    Each rank writes its part of the manifest (``outcome.part``, and ``shard`` and ``owners`` when
    it coordinates arrays) beside its chunks and counts itself in at its node (``Coordinator.node``);
    each node's leader then counts the node in at the job's store. Once every node has, the
    leaders write their node's index and commit marker, count in again, and tell their node the
    verdict. A rank that failed says so in the job's store and the step fails on every rank; one
    that died is given up on after the coordinator's timeout. The job's store sees four requests
    per node and a few more in all (rank 0's metadata, the two decisions): O(nodes) per save.
    """
    coord, nodes = job.coord, job.nodes
    node = node_of(coord)
    step, rank, leader = outcome.step, coord.rank, coord.rank == job.nodes.leader
    name = vote_scope(outcome.vote, step, outcome.attempt)
    decided, done = vote_key(coord, name, "outcome"), vote_key(coord, name, "committed")
    mine = [vote_key(coord, name, k) for k in VOTE_KEYS]
    if leader and nodes.number == 0:  # deleted at a later vote that every leader counted in at
        coord.later.extend(mine)
    error = outcome.error if outcome.error is not None else _write_parts(job, outcome, vote_key(coord, name, "meta"))
    if error is not None:
        coord.decide(decided, f"rank {rank} failed: {error!r}")
    try:
        arrived = node.arrive(node_in_scope(name), what=f"the ranks of this node to write step {step}", record=False)
    except CoordinationError as e:  # the node's leader, whose process serves the node's store, is gone
        coord.decide(decided, f"rank {rank} lost its node's leader: {e}")
    whole = leader  # whether the leader waits for its node's ranks as it leaves (all of them arrived)
    if error is not None:
        if leader:
            node.set(vote_node_key(node, name, "outcome"), coord.get(decided))
        yield from _leave(node, nodes, name, wait=whole)
        raise error
    if leader:
        try:
            yield arrived
        except CoordinationError as e:  # a rank of this node died, or hangs: the step fails everywhere
            coord.decide(decided, str(e))
            whole = False  # so it does not wait for that rank again as it leaves
        else:
            if coord.add(vote_key(coord, name, "arrived"), 1) == nodes.count:
                meta = coord.get(vote_key(coord, name, "meta")).decode()
                coord.decide(decided, f"{_OK}{meta}")
    verdict = yield from _verdict(job, name, "outcome", decided, f"the other ranks to write step {step}")
    if not verdict.startswith(_OK):
        yield from _leave(node, nodes, name, wait=whole)
        raise CoordinationError(f"step {step} was not committed: {verdict}")
    if leader:
        try:
            _commit_node(job, outcome, verdict[len(_OK) :], where=decided)
            if coord.add(vote_key(coord, name, "nodes"), 1) == nodes.count:
                coord.decide(done, _OK)
        except BaseException as e:
            coord.decide(done, f"the node of rank {rank} could not commit: {e!r}")
            node.set(vote_node_key(node, name, "committed"), coord.get(done))
            yield from _leave(node, nodes, name, wait=whole)
            raise
    verdict = yield from _verdict(job, name, "committed", done, f"every node to commit step {step}")
    yield from _leave(node, nodes, name, wait=whole)
    if verdict != _OK:
        raise CoordinationError(f"step {step} is not committed on every node: {verdict}")
    if leader and nodes.number == 0:
        forget_later(coord, keep=mine)  # every leader counted in at this vote: each is past the votes before it


_OK = "ok:"  # a verdict that lets the save go on; anything else says why not


def _leave(node: Coordinator, nodes: Nodes, name: str, *, wait: bool) -> Exchange[None]:
    """Done with a vote at this node; its leader waits for the node's ranks (``wait``: all of them
    arrived) and deletes the vote's keys there. Where the leader is gone, so is the node's store:
    the outcome stands, and nothing is left to delete."""
    keys = (vote_node_key(node, name, "outcome"), vote_node_key(node, name, "committed"), *_in(node, name))
    try:
        yield from leave_node(node, nodes, name, keys=keys, wait=wait)
    except CoordinationError as e:
        log.debug("leaving vote %s at the node: %s", name, e)


def _in(node: Coordinator, name: str) -> tuple[str, str]:
    return arrived_key(node, node_in_scope(name)), open_key(node, node_in_scope(name))


def _write_parts(job: Job, outcome: RankOutcome, meta_key: str) -> BaseException | None:
    """Write this rank's parts of the manifest (rank 0: the save's metadata into the store too)."""
    coord, tier, rank = job.coord, job.tier, job.coord.rank
    try:
        d = step_dir(outcome.step)
        tier.write(f"{d}/{part_file(rank)}", [outcome.part])
        if outcome.shard is not None:
            tier.write(f"{d}/{shard_file(rank)}", [outcome.shard])
        if outcome.owners is not None:
            tier.write(f"{d}/{owners_file(rank)}", [outcome.owners])
        if rank == 0:
            coord.set(meta_key, json.dumps(CommitMeta(metadata=outcome.metadata, created=time.time()).to_json()))
    except BaseException as e:
        return e
    return None


def _commit_node(job: Job, outcome: RankOutcome, meta: str, *, where: str) -> None:
    """A node's leader: write the step's index and commit marker into its node's directory."""
    coord, nodes = job.coord, job.nodes
    info = CommitMeta.from_json(loads(meta, where=where), where=where)
    index = ManifestIndex(
        step=outcome.step,
        library_version=outcome.library_version,
        created_unix=info.created,
        world_size=coord.world_size,
        nodes=nodes.count,
        metadata=info.metadata,
        save_id=outcome.save_id,
    )
    commit_step(job.tier, outcome.step, index.to_bytes(), save_id=outcome.save_id, ranks=nodes.ranks,
                world_size=coord.world_size, lineage=outcome.lineage)  # fmt: skip


def _verdict(job: Job, name: str, what_key: NodeVoteKey, key: str, what: str) -> Exchange[str]:
    """The job's decision at ``key``: the leader reads it from the job's store and tells its node,
    the node's other ranks read it from the node. A rank that gives up waiting decides it with why
    (the first decision wins, so every rank reads the same one)."""
    coord, node = job.coord, node_of(job.coord)
    leader = coord.rank == job.nodes.leader
    try:
        raw = yield Barrier(key, what, coord, fetch=True) if leader else Barrier(
            vote_node_key(node, name, what_key), what, node, fetch=True)  # fmt: skip
        verdict = bytes(raw).decode()
    except CoordinationError as e:
        coord.decide(key, str(e))
        verdict = coord.get(key).decode()
    if leader:
        node.set(vote_node_key(node, name, what_key), verdict)
    return verdict


def commit_job(
    job: Job, save: PendingSave, *, library_version: str, vote: str = "save", lineage: str | None = None
) -> None:
    """Commit a save the pipeline has written (or failed to) to ``job.tier``: this rank's manifest
    parts, then ``commit_save`` with the other ranks. Runs on the commit thread, on its own store
    connection (``job.coord``). The memory tier's commit is a vote of its own (``vote``)."""
    error = save.error
    part, shard, owners = b"", None, None
    if error is None:
        try:
            part, shard, owners = save.manifest_parts()
        except (TypeError, ValueError) as e:
            error = e
    outcome = RankOutcome(
        step=save.step,
        attempt=save.attempt,
        save_id=save.save_id,
        part=part,
        shard=shard,
        owners=owners,
        error=error,
        metadata=save.metadata,
        library_version=library_version,
        vote=vote,
        lineage=lineage,
    )
    drive(job.coord, commit_save(job, outcome))
