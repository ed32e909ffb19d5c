"""What a restore says of the steps it passed over, and of a state it read into before failing.

A restore reading in place (a job start, or ``in_place=True``) writes the state's own tensors as it
reads: where it then falls back to an older step, or fails, these say which tensors may hold parts
of which step (docs/concepts/restore.md).
"""

from __future__ import annotations

import logging

from tiercheck.humanize import fmt_steps, some
from tiercheck.restore.agree import StepChoice

log = logging.getLogger("tiercheck")


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
