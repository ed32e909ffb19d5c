"""Which nodes of a job can supply a resumed drain's files (``Drainer``).

A multi-node drain commits a remote step only once every saving rank's files are up, so a node
that has uploaded its own waits for the others'. For a step that was on the local directories when
the job started (a drain resumed from an earlier job), each node's leader says at the start which
saves of which steps its directory holds and for which saving ranks (``post_held``). A node waiting
for files that no node holds and the remote lacks (a node's directory wiped since) gives up at once
(``unsupplied``) instead of waiting out the retry deadline: nothing is deleted, its own files stay
on the remote, and its local step is kept, for a later job that holds the rest to drain.
"""

from __future__ import annotations

import json
import logging

from tiercheck.cluster.coordination import Coordinator
from tiercheck.cluster.keys.tiering import held_all_key, held_count_key, held_key
from tiercheck.errors import CheckpointNotFoundError, CoordinationError, CorruptCheckpointError
from tiercheck.format.steps import read_marker
from tiercheck.tiering.upload import drained_ranks
from tiercheck.tiers.base import Tier

log = logging.getLogger("tiercheck")


def post_held(coord: Coordinator, local: Tier, steps: list[int], nodes: int) -> set[tuple[int, str]]:
    """Post, for each committed local step of ``steps``, the saving ranks this node's directory
    holds (under the step and its save); the last of the job's ``nodes`` leaders to post says that
    all have. Returns the (step, save) pairs posted."""
    held: set[tuple[int, str]] = set()
    for step in steps:
        try:
            marker = read_marker(local, step)
        except (CheckpointNotFoundError, CorruptCheckpointError):
            continue  # not drained either (``pending_steps``)
        if marker.save_id is None:
            continue
        held.add((step, marker.save_id))
        coord.append(held_key(coord, step, marker.save_id), json.dumps(list(marker.ranks)) + "\n")
    if coord.add(held_count_key(coord), 1) == nodes:
        coord.set(held_all_key(coord), "ok")
    return held


def unsupplied(coord: Coordinator, local: Tier, remote: Tier, step: int) -> list[int]:
    """The saving ranks of the local ``step`` whose files neither the remote holds (drained, for
    its save) nor any node of this job's directory held at its start (``post_held``)."""
    marker = read_marker(local, step)
    coord.wait([held_all_key(coord)], what="the nodes to say which steps they hold")
    there = drained_ranks(remote, step, marker.save_id)
    key = held_key(coord, step, marker.save_id)
    holders: set[int] = set()
    for line in coord.get(key).decode().splitlines() if coord.has(key) else []:
        try:
            holders.update(int(r) for r in json.loads(line))
        except (ValueError, TypeError) as e:
            raise CoordinationError(f"{key}: not a list of ranks: {line[:80]!r}") from e
    return sorted(set(range(marker.world_size)) - there - holders)
