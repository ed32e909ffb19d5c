"""TODO docstring: tiercheck.save.commit."""


from __future__ import annotations

import json
import time

from tiercheck.dist.coordination import Barrier, Coordinator, Nodes, Protocol
from tiercheck.errors import CoordinationError
from tiercheck.format.manifest import (
    JSON,
    ManifestIndex,
)
from tiercheck.format.paths import owners_file, part_file, shard_file, step_dir
from tiercheck.format.steps import commit_step
from tiercheck.tiers.base import Tier

# ------------------------------------------------------------------------------------ commit


def commit_save(
    coord: Coordinator,
    tier: Tier,
    *,
    step: int,
    attempt: int,
    nodes: Nodes,
    part: bytes,
    shard: bytes | None,
    owners: bytes | None = None,
    error: BaseException | None,
    metadata: JSON,
    library_version: str,
) -> Protocol[None]:
    """Commit one save once this rank's chunks are durable (or report that they are not).

    Each rank writes its part of the manifest (sealed ``part``, and ``shard`` and ``owners`` when
    it coordinates arrays) beside its chunks and counts itself in; once every rank has, the first rank of each
    node writes the step's index and commit marker into its node's directory. A rank that failed
    says so and the step fails on every rank; one that died is given up on after the
    coordinator's timeout. The step is committed once every node committed it. Store traffic is a
    few small keys per rank (rank 0's metadata once per node): O(ranks) per save in all.
    """
    rank, world = coord.rank, coord.world_size
    name = f"save/{step}/{attempt}"
    outcome = coord.key(name, "outcome")
    if error is None:
        try:
            d = step_dir(step)
            tier.write(f"{d}/{part_file(rank)}", [part])
            if shard is not None:
                tier.write(f"{d}/{shard_file(rank)}", [shard])
            if owners is not None:
                tier.write(f"{d}/{owners_file(rank)}", [owners])
            if rank == 0:
                coord.set(coord.key(name, "meta"), json.dumps({"metadata": metadata, "created": time.time()}))
        except BaseException as e:
            error = e
    if error is not None:
        coord.decide(outcome, f"rank {rank} failed: {error!r}")
        raise error
    if coord.add(coord.key(name, "arrived"), 1) == world:
        coord.decide(outcome, "ok")
    verdict = yield from _verdict(coord, outcome, f"the other ranks to write step {step}")
    if verdict != "ok":
        raise CoordinationError(f"step {step} was not committed: {verdict}")
    done = coord.key(name, "committed")
    if rank == nodes.leader:
        try:
            meta = json.loads(coord.get(coord.key(name, "meta")))
            index = ManifestIndex(
                step=step,
                library_version=library_version,
                created_unix=float(meta["created"]),
                world_size=world,
                nodes=nodes.count,
                metadata=meta["metadata"],
            )
            commit_step(tier, step, index.to_bytes(), ranks=nodes.ranks, world_size=world)
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


def _verdict(coord: Coordinator, key: str, what: str) -> Protocol[str]:
    """Wait for the first decision at ``key``; a rank that gives up waiting decides it with why."""
    try:
        yield Barrier(key, what)
    except CoordinationError as e:
        coord.decide(key, str(e))
    return coord.get(key).decode()
