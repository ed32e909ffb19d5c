"""Which committed steps a tier keeps, and local retention over a node's directory."""


from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping

from tiercheck.cluster.job import Job
from tiercheck.cluster.keys.tiering import set_aside_key
from tiercheck.errors import StepExistsError
from tiercheck.format.commit import set_aside_step, withdraw_step
from tiercheck.format.lineage import abandoned_on, abandoned_why
from tiercheck.format.paths import step_dir
from tiercheck.format.steps import list_steps
from tiercheck.format.verify import step_damage
from tiercheck.options import RetentionOptions
from tiercheck.tiers.local import LocalTier

log = logging.getLogger("tiercheck")


def steps_to_delete(
    committed: Iterable[int], policy: RetentionOptions, *, damage: Callable[[int], str | None] | None = None
) -> list[int]:
    """Committed steps the policy lets go. The newest committed step is always kept.

    ``damage`` says why a step cannot be restored (None: it can). Given, ``keep_last`` counts
    restorable steps only: the steps are judged newest first, until ``keep_last`` restorable ones
    are found, and a damaged one among them is kept (never deleted on a guess, and never a reason
    to delete an older good step); older steps are not judged. Without it, every committed step
    counts."""
    steps = sorted(set(committed))
    if not steps:
        return []
    keep = {steps[-1]}
    if policy.keep_last is None:
        keep.update(steps)
    else:
        good = 0
        for s in reversed(steps):
            if good == policy.keep_last:
                break
            keep.add(s)
            if damage is None or damage(s) is None:
                good += 1
    if policy.keep_every is not None:
        keep.update(s for s in steps if s % policy.keep_every == 0)
    return [s for s in steps if s not in keep]


class LocalSteps:
    """The committed steps of this node's directory, and the retention policy over them. The
    node's first rank (``leader``) deletes, and at start removes partial steps (left by a crash);
    the other ranks only keep count. Steps ``pinned()`` names (still to be drained) are kept for a
    later pass. ``keep_last`` counts restorable steps only (``format.verify.step_damage``, the
    cheap check: manifest files, not chunks); a damaged step is reported once, and kept, and so is
    one whose save the directory's lineage abandoned (a rollback's branch, a taken-over lineage's). Only
    steps older than the newest step the whole job can restore (``whole``) are deleted: this node
    cannot see the others' copies."""

    def __init__(self, tier: LocalTier, policy: RetentionOptions, *, leader: bool) -> None:
        self.tier = tier
        self.policy = policy
        self.leader = leader
        self.pinned: Callable[[], set[int]] = set
        self._lock = threading.Lock()  # commits of overlapping saves finish on different threads
        self._damage: dict[int, str | None] = {}  # verdicts so far: a step's files are written once
        self._floor: int | None = None  # the newest step the whole job can restore (``whole``)
        listing = list_steps(tier)
        if leader:
            for step in listing.partial:
                log.warning(
                    "removing partial step %d from %s (left by an interrupted save or deletion)", step, tier.url
                )
                tier.delete_tree(step_dir(step))
        self._steps = set(listing.committed)

    def __contains__(self, step: int) -> bool:
        with self._lock:
            return step in self._steps

    def sorted(self) -> list[int]:
        with self._lock:
            return sorted(self._steps)

    def add(self, *steps: int) -> None:
        with self._lock:
            self._steps.update(steps)
            for s in steps:
                self._damage.pop(s, None)  # a step saved again, or copied in: judge it afresh

    def whole(self, step: int) -> None:
        """The whole job can restore ``step``: it committed it (every rank's part durable) or
        restored it (every rank agreed on it). Retention deletes only steps older than the newest
        such step: a step that looks whole here may be damaged on another node."""
        with self._lock:
            self._floor = step if self._floor is None else max(self._floor, step)

    def damage(self, step: int) -> str | None:
        """Why ``step`` cannot be restored from here (None: it can), judged once."""
        if step not in self._damage:
            why = self._damage[step] = step_damage(self.tier, step)
            if why is not None and self.leader:  # every rank of the node judges alike; one says so
                log.warning(
                    "retention: step %d in %s cannot be restored (%s); it does not count toward keep_last=%s "
                    "and is kept, so no older whole step is deleted for it",
                    step,
                    self.tier.url,
                    why,
                    self.policy.keep_last,
                )
        return self._damage[step]

    def retain(self) -> None:
        """Apply the policy: forget the steps it lets go, and delete them (on the leader). The
        deletion runs outside the lock: ``save()`` asks this set whether a step exists, and
        deleting a GiB-sized step took the training thread 0.8 s of waiting."""
        abandoned = abandoned_on(self.tier)  # read afresh: a rollback's first save records them

        def damage(step: int) -> str | None:
            return abandoned_why(self.tier, step, abandoned) or self.damage(step)

        with self._lock:
            pinned = self.pinned() | (set(self.policy.keep()) if self.policy.keep is not None else set())
            doomed = steps_to_delete(self._steps, self.policy, damage=damage)
            floor = -1 if self._floor is None else self._floor
            gone = [old for old in doomed if old not in pinned and old < floor]
            self._steps.difference_update(gone)  # pinned ones: still to be drained; a later pass deletes them
            for old in gone:
                self._damage.pop(old, None)
        if self.leader:
            for old in gone:
                withdraw_step(self.tier, old)
                log.info("retention: deleted step %d from %s", old, self.tier.url)

    def set_aside(self, steps: Iterable[int], why: Mapping[int, str]) -> None:
        """Forget ``steps``, which the last restore passed over as damaged (or not whole across
        the nodes), so that they can be saved again; the leader moves each out of the way first
        (``set_aside_step``), never deleting it. Every rank of the node calls it, with the same
        steps. Raises ``OSError`` (and forgets nothing) when the leader cannot move one."""
        mine = sorted(s for s in set(steps) if s in self)
        if self.leader:
            for s in mine:
                where = set_aside_step(self.tier, s)
                log.warning(
                    "set step %d aside as %s in %s, to save step %d again: the last restore passed it over (%s); "
                    "delete it once it is of no more use",
                    s,
                    where,
                    self.tier.url,
                    s,
                    why.get(s, "damaged"),
                )
        with self._lock:
            self._steps.difference_update(mine)
            for s in mine:
                self._damage.pop(s, None)


def set_aside_on_node(local: LocalSteps, job: Job, step: int, why: str, *, restore: int) -> None:
    """Before saving ``step`` again: move the committed step of that number, which the last
    restore (the job's ``restore``-th) passed over (damaged, or not whole across the nodes), out
    of the way (``LocalSteps.set_aside``) instead of refusing the save or overwriting it. The
    node's leader moves it; its other ranks wait for its word before they write into that name."""
    coord, nodes = job.coord, job.nodes
    moved, outcome = set_aside_key(coord, restore, step, nodes.leader), "ok"
    try:
        local.set_aside([step], {step: why})
    except OSError as e:  # the save then refuses the number, saying why (as every rank of the node)
        outcome = f"{type(e).__name__}: {e}"
    if len(nodes.ranks) > 1:
        if coord.rank == nodes.leader:
            coord.set(moved, outcome)
        else:
            coord.wait([moved], what=f"rank {nodes.leader} to set aside step {step}")
            outcome = coord.get(moved).decode()
    if outcome != "ok":
        local.add(step)
        raise StepExistsError(f"step {step} in {job.tier.url}, passed over by the last restore ({why}), could "
                              f"not be set aside to be saved again: {outcome}")  # fmt: skip
