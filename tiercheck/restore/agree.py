"""Agreeing on the step to restore: each node says which steps it holds whole, rank 0 picks the
newest every rank can get (locally, from a peer's replica, or from the remote tier), and every
rank learns the answer. Also the verdict after a restore (``settle``): all ranks succeeded, or all
fall back together; and, where no tier holds a step, no fresh start over steps a directory holds but
cannot read (``refuse_fresh_start``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from tiercheck.cluster.coordination import Exchange, drive, dumps
from tiercheck.cluster.hierarchy import fold, forget_later, tell, verdict
from tiercheck.cluster.job import Job
from tiercheck.cluster.keys.restore import agree_scope
from tiercheck.errors import CheckpointNotFoundError, CorruptCheckpointError, ForeignCheckpointError, TiercheckError
from tiercheck.format.foreign import find_foreign, say_foreign
from tiercheck.format.lineage import abandoned_on, read_lineage
from tiercheck.format.manifest import JSON, CommitMarker
from tiercheck.format.replicas import read_replicas
from tiercheck.format.steps import list_steps, read_marker
from tiercheck.humanize import fmt_steps
from tiercheck.restore.messages import HeldSteps, StepDecision, loads
from tiercheck.tiers.base import Tier

log = logging.getLogger("tiercheck")


#: Why a committed step of a node's tier is not its lineage's to restore (None: it is), from its marker
#: (the memory tier's rule, ``format.memory_steps.doubt``); rank 0's ``Veto`` asks the remote prefix.
Trust = Callable[[int, CommitMarker], str | None]
Veto = Callable[[int], str | None]


def held_steps(
    tier: Tier, damaged: dict[int, str] | None = None, *, check_replicas: bool = True, trust: Trust | None = None
) -> dict[str, JSON]:
    """A node's committed steps: ``{step: [saving ranks whose files are here, saving world size, those
    of them this node wrote itself]}``; the others are peers' replicas (``format.replicas.read_replicas``),
    counted only where their files match their markers (unless not ``check_replicas``: the node's other
    ranks, which learn what their node holds of the chosen step from its leader, ``plan.find_holders``).
    Steps whose commit marker cannot be read are left out, and put in ``damaged`` with why; so are
    the saves the directory's lineage abandoned (a rollback's branch, another lineage's steps). Every
    step left out is in ``damaged``: a restore that passes over a committed step says so
    (``report.passed_over_here``), and the run's next save of that number sets it aside instead of
    finding it in the way (``Checkpointer.save``). ``trust`` leaves out, saying why in the log, the
    steps it doubts (not in ``damaged``: they are another branch's or job's, never set aside for one)."""
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
            why = f"its lineage abandoned save {marker.save_id} (a rollback or a take-over)"
            log.info("ignoring step %d on %s: %s", s, tier.url, why)
            if damaged is not None:
                damaged[s] = why
            continue
        doubted = trust(s, marker) if trust is not None else None
        if doubted is not None:
            log.info("not restoring step %d from %s: %s", s, tier.url, doubted)
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
    trust: Trust | None = None,
    veto: Veto | None = None,
    refuse: str | None = None,
) -> Exchange[StepChoice]:
    """Every rank learns the same step to restore (None: no tier holds one), older than ``below``
    when given. The node leaders fold what their nodes hold up a tree to rank 0
    (``cluster.hierarchy``), which picks the step and calls ``remote_steps`` (on rank 0 only); each
    leader reads the answer and tells its node. ``trust`` (each node's) and ``veto`` (rank 0's, on
    the step it would choose) leave out steps that are not the lineage's (see ``Trust``).
    ``refuse`` (rank 0's): why none of the tier's steps is to be restored, whatever the nodes hold;
    every rank still takes part in the exchange, and raises ``CheckpointNotFoundError`` with it."""
    coord, tier, nodes = job.coord, job.tier, job.nodes
    world = coord.world_size
    damaged: dict[int, str] = {}
    held = held_steps(tier, damaged, trust=trust) if coord.rank == nodes.leader else {}
    answer: bytes | None = None
    if coord.rank == nodes.leader:
        where = agree_scope(name, "held")
        mine = HeldSteps.of_node(nodes.ranks, held)

        def merge(parts: list[bytes]) -> bytes:
            parsed = [HeldSteps.from_json(loads(p, where=where), where=where, world=world) for p in parts]
            return dumps(HeldSteps.merge(parsed).to_json()).encode()

        folded = yield from fold(
            coord, nodes, where, dumps(mine.to_json()).encode(), merge, what="the nodes to list their committed steps"
        )
        if folded is not None:  # node 0's leader: every leader is past what it kept for later
            forget_later(coord)
            if refuse is not None:
                answer = dumps(StepDecision(None, error=refuse).to_json()).encode()
            else:
                folded_held = HeldSteps.from_json(loads(folded, where=where), where=where, world=world)
                answer = _decide(folded_held, requested, below, remote_steps, world=world, where=tier.url, veto=veto)
    raw = yield from tell(coord, nodes, agree_scope(name, "step"), answer, what="rank 0 to choose the step to restore")
    decision = StepDecision.from_json(loads(raw, where=name), where=name)
    if decision.error is not None:
        raise CheckpointNotFoundError(decision.error)
    if coord.rank != nodes.leader:
        held = held_steps(tier, damaged, check_replicas=False, trust=trust)
    return StepChoice(decision.step, decision.remote, held, damaged)


def _decide(
    held: HeldSteps,
    requested: int | None,
    below: int | None,
    remote_steps: Callable[[], list[int]],
    *,
    world: int,
    where: str,
    veto: Veto | None = None,
) -> bytes:
    """Rank 0's answer: the step every rank restores, or why none can be. A step ``veto`` refuses
    is left out, and the choice made again without it."""
    remote = set(remote_steps())
    if below is not None:
        remote = {s for s in remote if s < below}
        held = HeldSteps({s: h for s, h in held.steps.items() if s < below})
    while True:
        try:
            step = choose_step(held, requested, remote, world=world, where=where)
            decision = StepDecision(step, step is not None and step in remote)
        except CheckpointNotFoundError as e:
            decision = StepDecision(None, error=str(e))
            break
        why = veto(step) if veto is not None and step is not None else None
        if step is None or why is None:
            break
        log.info("not restoring step %d from %s: %s", step, where, why)
        held = HeldSteps({s: h for s, h in held.steps.items() if s != step})
        remote.discard(step)
    return dumps(decision.to_json()).encode()


def choose_step(held: HeldSteps, requested: int | None, remote: set[int], *, world: int, where: str) -> int | None:
    """The step to restore: committed on the remote tier, or whole across the nodes' local
    directories (``held``: what all of them hold)."""

    def lacking(s: int) -> str:
        h = held.steps[s]
        without = h.holders.missing(world)
        return f"step {s}: the files of saving rank(s) {h.saving.missing(h.world).describe()} are on no rank's " + (
            f"local tier (restoring rank(s) {without.describe()} have no copy of the step)" if without else "local tier"
        )

    have = set(held.steps)
    whole = sorted(remote | {s for s, h in held.steps.items() if not h.saving.missing(h.world)})
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
    job: Job, name: str, failure: TiercheckError | None, *, shared: tuple[type[Exception], ...] = ()
) -> Exchange[None]:
    """Every rank learns whether any rank failed at this point; the first failure is raised on all
    of them (a rank's own failure as it is, the others' as ``CoordinationError`` naming it, or as
    the same error where its type is one of ``shared``). Through each node's leader
    (``cluster.hierarchy.verdict``)."""
    yield from verdict(job.coord, job.nodes, name, failure, what="every rank to get this far in the restore",
                       shared=shared)  # fmt: skip


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


def refuse_fresh_start(job: Job, scope: str) -> None:
    """Every rank together, where no tier holds a step it can restore: where any rank's directory holds
    committed steps whose commit markers cannot be read, every rank raises ``CorruptCheckpointError`` naming
    them and why; where it holds another framework's checkpoints, ``ForeignCheckpointError``. Never a fresh
    start over them on some ranks only. (A step whose marker names a save the lineage abandoned is readable, and
    no step of this lineage: a fresh start over it is right.)"""
    unreadable: dict[int, str] = {}  # none read where the directory commits no step: a fresh start's case
    for s in list_steps(job.tier).committed:
        try:
            read_marker(job.tier, s)
        except TiercheckError as e:
            unreadable[s] = str(e)
    error: TiercheckError | None = None
    if unreadable:
        error = CorruptCheckpointError(
            f"{job.tier.url}: no step can be restored, but step(s) {fmt_steps(sorted(unreadable))} are committed "
            f"there: {'; '.join(unreadable.values())}"
        )
    elif found := find_foreign(job.tier):
        error = ForeignCheckpointError(say_foreign(job.tier, found))
    # settle finishes the scope itself (its leaders count out once): finishing it here again let the first rank
    # out delete the failure before a slower rank had read it, which then started fresh
    drive(job.coord, settle(job, scope, error, shared=(ForeignCheckpointError, CorruptCheckpointError)))
