"""The part of a step's manifest a restoring rank needs (``manifest_for``): its saving rank's
tree, every rank's where the state asks for more, and the records of the arrays those trees name,
fetched by the nodes that hold them and shared, never the whole job's manifest on every rank."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tiercheck.cluster.coordination import Exchange, shard_of
from tiercheck.cluster.job import Job
from tiercheck.cluster.keys.restore import part_scope
from tiercheck.errors import CorruptCheckpointError, TiercheckError
from tiercheck.format.manifest import Manifest, RankPart
from tiercheck.format.steps import assemble
from tiercheck.restore.agree import settle
from tiercheck.restore.fetch import fetch, index_of
from tiercheck.restore.holders import Step
from tiercheck.restore.match import covers
from tiercheck.state.flatten import tensor_paths

DAMAGE = (CorruptCheckpointError,)
"""Failures every rank raises as they are (not as another rank's ``CoordinationError``): each rank
then agrees the step is damaged, and they try an older one together."""


def manifest_for(
    job: Job, root: str, st: Step, state: Mapping[str, Any], *, others: bool, parts: dict[int, RankPart] | None = None
) -> Exchange[Manifest]:
    """The part of the step's manifest this rank needs: its saving rank's tree (every rank's, when
    the state has entries that tree lacks or ``others`` asks for other ranks' entries) and the
    records of the arrays those trees refer to.
    The saving ranks' parts it parses are left in ``parts`` (``plan_restore`` takes checksums there)."""
    coord, tier = job.coord, job.tier
    parts = {} if parts is None else parts
    where = f"{tier.url}: step {st.step}"
    ix = index_of(st, where=where)
    own = coord.rank if coord.rank < ix.world_size else 0
    got = yield from fetch(job, root, st, {("rank", own)}, what="tree")
    failure: TiercheckError | None = None
    more: set[tuple[str, int]] = set()
    try:
        if others or not covers(assemble(ix, got, where=where, parts=parts).tree(own), state):
            more = {("rank", w) for w in range(ix.world_size)} - set(got)
    except TiercheckError as e:
        failure = e
    yield from settle(job, part_scope(root, "tree"), failure, shared=DAMAGE)
    got |= yield from fetch(job, root, st, more, what="trees")
    paths: set[str] = set()
    try:
        trees = assemble(ix, got, where=where, parts=parts).trees
        paths = {p for t in trees for p in tensor_paths(t) if isinstance(p, str)}
    except TiercheckError as e:
        failure = e
    yield from settle(job, part_scope(root, "paths"), failure, shared=DAMAGE)
    shards = {("arrays", shard_of(p, ix.world_size)) for p in paths}
    got |= yield from fetch(job, root, st, shards, what="arrays")
    manifest: Manifest | None = None
    try:
        manifest = assemble(ix, {f: b for f, b in got.items() if b}, where=where, only=paths, owners=False, parts=parts)
    except TiercheckError as e:
        failure = e
    del got
    yield from settle(job, part_scope(root, "manifest"), failure, shared=DAMAGE)
    assert manifest is not None
    return manifest
