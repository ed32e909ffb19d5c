"""Agreeing on the step to restore: each node says which steps it holds whole, rank 0 picks the
newest every rank can get (locally, from a peer's replica, or from the remote tier), and every
rank learns the answer. Also the verdict after a restore (``settle``): all ranks succeeded, or all
fall back together."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tiercheck.cluster.coordination import Coordinator, Exchange, dumps
from tiercheck.cluster.job import Job
from tiercheck.errors import CheckpointNotFoundError, TiercheckError
from tiercheck.format.lineage import abandoned_on, read_lineage
from tiercheck.format.manifest import JSON
from tiercheck.format.replicas import read_replicas
from tiercheck.format.steps import list_steps, read_marker
from tiercheck.humanize import fmt_steps, ranges
from tiercheck.restore.messages import HeldPost, StepDecision, loads
from tiercheck.tiers.base import Tier

log = logging.getLogger("tiercheck")



def held_steps(tier: Tier, damaged: dict[int, str] | None = None, *, check_replicas: bool = True) -> dict[str, JSON]:
    """A node's committed steps: ``{step: [saving ranks whose files are here, saving world size, those
    of them this node wrote itself]}``; the others are peers' replicas (``format.replicas.read_replicas``),
    counted only where their files match their markers (unless not ``check_replicas``: the node's other
    ranks, which learn what their node holds of the chosen step from its leader, ``plan.find_holders``).
    Steps whose commit marker cannot be read are left out, and put in ``damaged`` with why; so are
    the saves the directory's lineage abandoned (a rollback's branch, another lineage's steps)."""
    held: dict[str, JSON] = {}
    abandoned = abandoned_on(tier)
    for s in list_steps(tier).committed:
        try:
            marker = read_marker(tier, s)
        except TiercheckError as e:
            log.warning("ignoring step %d on %s: %s", s, tier.url, e)
            if damaged is not None:
                damaged[s] = str(e)
            continue
        if (s, marker.save_id) in abandoned:
            log.info("ignoring step %d on %s: its lineage abandoned that save (a rollback or a take-over)", s, tier.url)
            continue
        own = list(marker.ranks)
        replicas = read_replicas(tier, s, checked=check_replicas)
        copies = {r for c in replicas if c.world_size == marker.world_size for r in c.ranks}
        held[str(s)] = [own + sorted(copies - set(own)), marker.world_size, own]
    return held


@dataclass(frozen=True, slots=True)
class StepChoice:
    step: int | None
    from_remote: bool  # committed on the remote tier: read what no node holds from there
    held: dict[str, JSON]  # this node's committed steps (see held_steps)
    damaged: dict[int, str] = field(default_factory=dict)  # this node's steps left out of held: why


def agree_on_step(
    job: Job,
    name: str,
    *,
    requested: int | None,
    remote_steps: Callable[[], list[int]],
    below: int | None = None,
) -> Exchange[StepChoice]:
    """Every rank learns the same step to restore (None: no tier holds one), older than ``below``
    when given. ``remote_steps`` is called on rank 0 only."""
    coord, tier, nodes = job.coord, job.tier, job.nodes
    damaged: dict[int, str] = {}
    held = held_steps(tier, damaged) if coord.rank == nodes.leader else {}
    if coord.rank == nodes.leader:
        coord.post(f"{name}/held", dumps(HeldPost(nodes.ranks, held).to_json()))
    yield coord.arrive(f"{name}/held", what="every node to list its committed steps")
    answer = coord.key(name, "step")
    if coord.rank == 0:
        where = f"{name}/held"
        per_node = [HeldPost.from_json(loads(v, where=where), where=where) for v in coord.collect(where)]
        remote = set(remote_steps())
        if below is not None:
            remote = {s for s in remote if s < below}
            per_node = [replace(n, held={s: v for s, v in n.held.items() if int(s) < below}) for n in per_node]
        try:
            step = choose_step(per_node, requested, remote, world=coord.world_size, where=tier.url)
            coord.set(answer, dumps(StepDecision(step, step is not None and step in remote).to_json()))
        except CheckpointNotFoundError as e:
            coord.set(answer, dumps(StepDecision(None, error=str(e)).to_json()))
    yield coord.arrive(f"{name}/chosen", what="rank 0 to choose the step to restore")
    decision = StepDecision.from_json(loads(coord.get(answer), where=answer), where=answer)
    if decision.error is not None:
        raise CheckpointNotFoundError(decision.error)
    if coord.rank != nodes.leader:
        held = held_steps(tier, damaged, check_replicas=False)
    return StepChoice(decision.step, decision.remote, held, damaged)


def choose_step(
    per_node: list[HeldPost], requested: int | None, remote: set[int], *, world: int, where: str
) -> int | None:
    """The step to restore: committed on the remote tier, or whole across the nodes' local
    directories. ``per_node`` holds each node's ranks and ``held_steps``."""
    have: dict[int, set[int]] = defaultdict(set)  # step -> saving ranks whose files some node holds
    saved_world: dict[int, int] = {}
    holders: dict[int, set[int]] = defaultdict(set)  # step -> restoring ranks holding a copy
    for node in per_node:
        for s, (saving, ws, *_) in node.held.items():
            have[int(s)].update(saving)
            saved_world[int(s)] = ws
            holders[int(s)].update(node.ranks)

    def missing(s: int) -> list[int]:
        return sorted(set(range(saved_world[s])) - have[s])

    def lacking(s: int) -> str:
        without = sorted(set(range(world)) - holders[s])
        return f"step {s}: the files of saving rank(s) {ranges(missing(s))} are on no rank's local tier" + (
            f" (restoring rank(s) {ranges(without)} have no copy of the step)" if without else ""
        )

    whole = sorted(remote | {s for s in have if not missing(s)})
    if requested is not None:
        if requested in whole:
            return requested
        if requested in have:
            raise CheckpointNotFoundError(f"{where}: cannot restore {lacking(requested)}")
        raise CheckpointNotFoundError(
            f"step {requested} is not committed on any rank's local tier or the remote tier "
            f"({where}; committed: {fmt_steps(whole)})"
        )
    newer = [s for s in have if whole and s > whole[-1]]
    if newer:
        log.warning("newest steps are incomplete, skipping them: %s", "; ".join(lacking(s) for s in sorted(newer)))
    if whole:
        return whole[-1]
    if have:
        raise CheckpointNotFoundError(f"{where}: no committed step is whole; newest: {lacking(max(have))}")
    return None


def settle(
    coord: Coordinator, name: str, failure: TiercheckError | None, *, shared: tuple[type[Exception], ...] = ()
) -> Exchange[None]:
    """Every rank learns whether any rank failed at this point; the first failure is raised on all
    of them (a rank's own failure as it is, the others' as ``CoordinationError`` naming it, or as
    the same error where its type is one of ``shared``)."""
    if failure is not None:
        coord.report(name, failure)
    yield coord.arrive(name, what="every rank to get this far in the restore")
    coord.check(name, failure, shared=shared)


def remote_steps(remote: Tier | None, local: Tier) -> list[int]:
    """The remote's committed steps a restore may take: not the saves the lineage abandoned (as
    the remote's or ``local``'s lineage file records them), nor, after a rollback the remote has
    not heard of yet (``local``'s file says to which step), any step above it."""
    if remote is None:
        return []
    try:
        committed = list_steps(remote).committed
        abandoned = abandoned_on(remote) | abandoned_on(local)
    except (OSError, TiercheckError) as e:  # restore from the local tier alone, and say so
        log.error("cannot list %s, restoring from local tiers only: %s", remote.url, e)
        return []
    try:
        mine = read_lineage(local)
    except (OSError, TiercheckError):
        mine = None  # refused, naming it, where this run writes
    rollback = mine.rollback if mine is not None else None
    numbers = {s for s, _ in abandoned}
    out = []
    for s in committed:
        if rollback is not None and s > rollback:
            log.info("ignoring step %d on %s: a rollback to step %d abandoned it", s, remote.url, rollback)
            continue
        if s in numbers:
            try:
                if (s, read_marker(remote, s).save_id) in abandoned:
                    log.info("ignoring step %d on %s: its lineage abandoned that save", s, remote.url)
                    continue
            except (OSError, TiercheckError):
                continue  # its marker cannot be read: no restore could take it
        out.append(s)
    return out
