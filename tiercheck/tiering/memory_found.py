"""A job started without the memory tier, on a local directory whose lineage has steps in memory.

The local directory records where its memory tier lives (``format.memory_steps``). A job opened
there without ``MemoryOptions`` restores from the local and remote tiers only; where the memory tier
holds committed steps of the directory's lineage newer than the step it restored, it says so in one
warning (which steps, how to get or drop them) rather than going back in time silently. Once such a
job saves, it has branched below them (a rollback): the first save withdraws them from memory too
(invariant 13: a rollback abandons a step wherever it lies), so no later restart with the memory
tier restores that abandoned future.
"""

from __future__ import annotations

import logging
import shlex

from tiercheck.errors import TiercheckError
from tiercheck.format.commit import withdraw_step
from tiercheck.format.memory_steps import lineage_steps, recorded_memory
from tiercheck.humanize import fmt_steps
from tiercheck.tiers.base import Tier
from tiercheck.tiers.private import PrivateTier, check_dir

log = logging.getLogger("tiercheck")


def recorded_tier(local: Tier) -> PrivateTier | None:
    """The memory tier ``local`` records, where it is there and private to this user (a place that is
    not is named in a warning and left alone); None where none is recorded or there."""
    directory = recorded_memory(local)
    if directory is None:
        return None
    try:
        if check_dir(directory) is None:
            return None
    except TiercheckError as e:
        log.warning("not looking at the memory tier %s records: %s", local.url, e)
        return None
    return PrivateTier(directory, top=directory.parent)


def warn_of_newer(local: Tier, restored: int | None) -> None:
    """Rank 0 of a job without the memory tier, after its restore (``restored``: the step, None: a
    fresh start): one warning where the memory tier holds committed steps of this lineage above it."""
    memory = recorded_tier(local)
    if memory is None:
        return
    try:
        newer = sorted(s for s in lineage_steps(memory, local) if restored is None or s > restored)
    except (OSError, TiercheckError) as e:
        log.debug("could not list the memory tier at %s: %s", memory.url, e)
        return
    if not newer:
        return
    path, what = shlex.quote(str(memory.root.parent)), "nothing" if restored is None else f"step {restored}"
    log.warning(
        "the memory tier at %s holds committed step(s) %s of this directory's lineage, newer than %s restored "
        "from %s: this job has no memory tier (Checkpointer(memory=None)). To restore them, restart with "
        "memory=MemoryOptions(path=%r) before this job saves, or copy them to the directory first with "
        "`tiercheck persist %s --memory %s`; to drop them, let this job save: its first save branches below them "
        "(a rollback) and withdraws them from memory",
        memory.url, fmt_steps(newer), what, local.url, str(memory.root.parent), shlex.quote(local.url), path,
    )  # fmt: skip


def abandon_above(local: Tier, branch: int) -> None:
    """A node's first rank, at the first save of a job without the memory tier after it restored
    ``branch``: the memory steps of this lineage above it are an abandoned branch, withdrawn."""
    memory = recorded_tier(local)
    if memory is None:
        return
    try:
        above = sorted(s for s in lineage_steps(memory, local) if s > branch)
        for step in above:
            withdraw_step(memory, step)
    except (OSError, TiercheckError) as e:
        log.warning("could not withdraw the memory tier's steps above step %d at %s: %s", branch, memory.url, e)
        return
    if above:
        log.warning("withdrew step(s) %s from the memory tier at %s: this job saves from step %d, a rollback that "
                    "abandons them", fmt_steps(above), memory.url, branch)  # fmt: skip
