"""Committing a save across ranks: each rank posts its outcome, each node's first rank assembles
and publishes the node's commit marker once every rank of the job has written its part, and a
failure anywhere withdraws the step everywhere (``commit_save``, a sans-I/O protocol)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from tiercheck.cluster.coordination import Barrier, Coordinator, Exchange, drive
from tiercheck.cluster.job import Job
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


def commit_save(job: Job, outcome: RankOutcome) -> Exchange[None]:
    """Commit one save once this rank's chunks are durable (or report that they are not).

    Each rank writes its part of the manifest (``outcome.part``, and ``shard`` and ``owners`` when
    it coordinates arrays) beside its chunks and counts itself in; once every rank has, the first rank of each
    node writes the step's index and commit marker into its node's directory. A rank that failed
    says so and the step fails on every rank; one that died is given up on after the
    coordinator's timeout. The step is committed once every node committed it. Store traffic is a
    few small keys per rank (rank 0's metadata once per node): O(ranks) per save in all.
    """
    coord, tier, nodes = job.coord, job.tier, job.nodes
    step, part, shard, owners, error = outcome.step, outcome.part, outcome.shard, outcome.owners, outcome.error
    rank, world = coord.rank, coord.world_size
    name = f"{outcome.vote}/{step}/{outcome.attempt}"
    decided = coord.key(name, "outcome")
    if error is None:
        try:
            d = step_dir(step)
            tier.write(f"{d}/{part_file(rank)}", [part])
            if shard is not None:
                tier.write(f"{d}/{shard_file(rank)}", [shard])
            if owners is not None:
                tier.write(f"{d}/{owners_file(rank)}", [owners])
            if rank == 0:
                meta = CommitMeta(metadata=outcome.metadata, created=time.time())
                coord.set(coord.key(name, "meta"), json.dumps(meta.to_json()))
        except BaseException as e:
            error = e
    if error is not None:
        coord.decide(decided, f"rank {rank} failed: {error!r}")
        raise error
    if coord.add(coord.key(name, "arrived"), 1) == world:
        coord.decide(decided, "ok")
    verdict = yield from _verdict(coord, decided, f"the other ranks to write step {step}")
    if verdict != "ok":
        raise CoordinationError(f"step {step} was not committed: {verdict}")
    done = coord.key(name, "committed")
    if rank == nodes.leader:
        try:
            where = coord.key(name, "meta")
            meta = CommitMeta.from_json(loads(coord.get(where), where=where), where=where)
            index = ManifestIndex(
                step=step,
                library_version=outcome.library_version,
                created_unix=meta.created,
                world_size=world,
                nodes=nodes.count,
                metadata=meta.metadata,
                save_id=outcome.save_id,
            )
            commit_step(tier, step, index.to_bytes(), save_id=outcome.save_id, ranks=nodes.ranks, world_size=world)
            if coord.add(coord.key(name, "nodes"), 1) == nodes.count:
                coord.decide(done, "ok")
        except BaseException as e:
            coord.decide(done, f"the node of rank {rank} could not commit: {e!r}")
            raise
    verdict = yield from _verdict(coord, done, f"every node to commit step {step}")
    if verdict != "ok":
        raise CoordinationError(f"step {step} is not committed on every node: {verdict}")
    if coord.add(coord.key(name, "finished"), 1) == world:  # everyone has read everything: clean up
        coord.delete(*(coord.key(name, k) for k in ("outcome", "arrived", "meta", "committed", "nodes", "finished")))


def _verdict(coord: Coordinator, key: str, what: str) -> Exchange[str]:
    """Wait for the first decision at ``key``; a rank that gives up waiting decides it with why."""
    try:
        yield Barrier(key, what)
    except CoordinationError as e:
        coord.decide(key, str(e))
    return coord.get(key).decode()


def commit_job(job: Job, save: PendingSave, *, library_version: str, vote: str = "save") -> None:
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
    )
    drive(job.coord, commit_save(job, outcome))
