"""What a restore did (``Restored``), what it says of the steps it passed over, and of a state it read
into before failing.

A restore reading in place (a job start, or ``in_place=True``) writes the state's own tensors as it
reads: where it then falls back to an older step, or fails, these say which tensors may hold parts
of which step (docs/concepts/restore.md).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from tiercheck.humanize import fmt_steps, some
from tiercheck.restore.agree import StepChoice

log = logging.getLogger("tiercheck")


PHASES = ("agree", "plan", "transfer", "verify", "place")
"""A restore's phases, each rank's own seconds in each (``Restored.phases``), summed over its attempts: ``agree``
on the step (the choice between tiers included: ``with_choice``), ``plan`` (find the holders, fetch and match the
manifest, plan the reads), ``transfer`` (read, send and receive the chunks, each checked against its CRC32C as it
arrives), ``verify`` (wait until every rank says all its chunks verified), ``place`` (copy the staged bytes into the
state and hand it its plain values)."""


def with_choice(done: Restored, total_s: float) -> Restored:
    """``done``, timed by the whole restore call (``total_s``): what its phases leave out (the memory tier's
    choice of step, the other tiers' newest, a memory step that could not be read) goes to ``agree``, the
    choice of what to restore, so the phases add up to the call."""
    rest = max(0.0, total_s - sum(done.phases.values()))
    return replace(done, phases={**done.phases, "agree": done.phases.get("agree", 0.0) + rest})


class Timeline:
    """A rank's seconds in each of a restore's ``PHASES``: ``took(phase)`` gives it the time since the last mark."""

    def __init__(self) -> None:
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.mark = time.perf_counter()

    def took(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] += now - self.mark
        self.mark = now


@dataclass(frozen=True, slots=True)
class Restored:
    step: int
    arrays: int
    bytes_read: int
    chunks_received: int
    chunks_shared: int  # of those, received through shared memory from a rank on this host
    unstaged: int  # bytes of live tensors filled straight from shared memory, with no staging
    remote_reads: int
    fallbacks: int
    staged_in_pool: int  # bytes staged in the idle save pool rather than in new memory
    staged_on_device: int  # bytes of GPU tensors staged in spare GPU memory rather than host memory
    read_direct: int  # bytes read from the local tier around the page cache (O_DIRECT)
    from_remote: bool  # the step was chosen from the remote tier
    held_here: list[int]  # saving ranks whose files this node holds
    passed_over: dict[int, str] = field(default_factory=dict)  # this node's newer steps, passed over: why
    read_in_place: int = 0  # bytes read straight into the state's own tensors (no staging copy)
    copied_up: int = 0  # bytes staged in host memory for GPU tensors, copied up through page-locked buffers
    from_memory: bool = False  # the step was restored from the memory tier (``tiercheck.memory``)
    local_reads: int = 0  # chunks a restore from the memory tier read from the local tier (bad in memory)
    copies_passed_over: int = 0  # saving ranks whose files this rank found damaged in its node's copy
    save_id: str | None = None  # the save restored (the step's commit marker names it)
    # Seconds from the start of the reads until the chunks this rank read itself were verified and
    # placed (None: it read none), while it served other ranks beside them (``restore.serve``).
    own_placed_s: float | None = None
    phases: dict[str, float] = field(default_factory=dict)  # seconds by phase (``PHASES``), every attempt's

    def counters(self) -> dict[str, int | float | None]:
        """What ``Checkpointer.stats()`` reports of the last restore."""
        return {
            **{f"restore_{p}_s": self.phases.get(p, 0.0) for p in PHASES},
            "restore_s": sum(self.phases.values()),
            "restore_bytes_read": self.bytes_read,
            "restore_chunks_received": self.chunks_received,
            "restore_chunks_shared": self.chunks_shared,
            "restore_unstaged_bytes": self.unstaged,
            "restore_remote_reads": self.remote_reads,
            "restore_fallbacks": self.fallbacks,
            "restore_staged_in_pool": self.staged_in_pool,
            "restore_staged_on_device": self.staged_on_device,
            "restore_read_direct_bytes": self.read_direct,
            "restore_in_place_bytes": self.read_in_place,
            "restore_copied_up_bytes": self.copied_up,
            "restore_from_memory": int(self.from_memory),
            "restore_local_reads": self.local_reads,
            "restore_copies_passed_over": self.copies_passed_over,
            "restore_own_placed_s": self.own_placed_s,
        }


def overwritten(touched: dict[int, dict[int, str]]) -> str:
    """What the failed restore read into: said with the error where no step could be restored whole."""
    paths = sorted({path for dests in touched.values() for path in dests.values()})
    return (
        f"the restore had already read parts of step(s) {fmt_steps(sorted(touched))} into tensor(s) {some(paths, 8)} "
        "(it read into the state's own memory: a job start, or in_place=True); restore a whole step, or "
        "rebuild them, before using them"
    )


def say_mixed(touched: dict[int, dict[int, str]], step: int) -> None:
    """An in-place restore fell back to ``step``, which overwrote every tensor it holds: a tensor
    the damaged newer steps were read into and ``step`` does not hold keeps parts of those."""
    final = touched.get(step, {})
    left: dict[str, list[int]] = {}
    for s, dests in touched.items():
        for memory, path in dests.items():
            if s != step and memory not in final:
                left.setdefault(path, []).append(s)
    if left:
        names = some(sorted(left))
        steps = sorted({s for ss in left.values() for s in ss})
        log.error(
            "restore(in_place=True) fell back to step %d after it began to read into the state: tensor(s) "
            "%s, which step %d does not hold, may hold parts of step(s) %s; restore again before using them",
            step,
            names,
            step,
            fmt_steps(steps),
        )


def say_partly_restored(e: BaseException, steps: list[int]) -> None:
    """Tell the caller of a failed in-place restore that the state's tensors were read into."""
    what = (
        f"restore(in_place=True) failed after it began to read into the state: its tensors may hold "
        f"parts of step(s) {fmt_steps(steps)}; restore again before using them"
    )
    log.error("%s (%s)", what, e)
    if hasattr(e, "add_note"):  # Python 3.11 and later: shown under the traceback
        e.add_note(what)


def passed_over_here(choice: StepChoice, step: int) -> dict[int, str]:
    """This node's committed steps newer than the newest one every rank could get, ``step``: the
    choice passed them over, as damaged here (a garbage commit marker) or elsewhere (another
    node's files of the step are missing or damaged)."""
    newer = {int(s) for s in choice.held if int(s) > step} | {s for s in choice.damaged if s > step}
    return {s: choice.damaged.get(s, "not whole across the nodes' directories") for s in sorted(newer)}
