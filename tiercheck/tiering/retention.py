"""Which committed steps a tier keeps, and local retention over a node's directory."""


from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from tiercheck.format.paths import step_dir
from tiercheck.format.steps import list_steps, withdraw_step
from tiercheck.options import RetentionOptions
from tiercheck.tiers.local import LocalTier

log = logging.getLogger("tiercheck")


def steps_to_delete(committed: Iterable[int], policy: RetentionOptions) -> list[int]:
    """Committed steps the policy lets go. The newest committed step is always kept."""
    steps = sorted(set(committed))
    if not steps:
        return []
    keep = {steps[-1]}
    keep.update(steps if policy.keep_last is None else steps[-policy.keep_last :])
    if policy.keep_every is not None:
        keep.update(s for s in steps if s % policy.keep_every == 0)
    return [s for s in steps if s not in keep]


class LocalSteps:
    """The committed steps of this node's directory, and the retention policy over them. The
    node's first rank (``leader``) deletes, and at start removes partial steps (left by a crash);
    the other ranks only keep count. Steps ``pinned()`` names (still to be drained) are kept for a
    later pass."""

    def __init__(self, tier: LocalTier, policy: RetentionOptions, *, leader: bool) -> None:
        self.tier = tier
        self.policy = policy
        self.leader = leader
        self.pinned: Callable[[], set[int]] = set
        self._lock = threading.Lock()  # commits of overlapping saves finish on different threads
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

    def retain(self) -> None:
        """Apply the policy: forget the steps it lets go, and delete them (on the leader). The
        deletion runs outside the lock: ``save()`` asks this set whether a step exists, and
        deleting a GiB-sized step took the training thread 0.8 s of waiting."""
        with self._lock:
            pinned = self.pinned()
            gone = [old for old in steps_to_delete(self._steps, self.policy) if old not in pinned]
            self._steps.difference_update(gone)  # pinned ones: still to be drained; a later pass deletes them
        if self.leader:
            for old in gone:
                withdraw_step(self.tier, old)
                log.info("retention: deleted step %d from %s", old, self.tier.url)
