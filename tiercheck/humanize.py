"""Short human-readable forms of step and rank lists, for messages (no torch here: the CLI uses them)."""

from __future__ import annotations

import itertools


def fmt_steps(steps: list[int]) -> str:
    if not steps:
        return "none"
    return ", ".join(map(str, steps[-10:])) + (" (newest 10 shown)" if len(steps) > 10 else "")


def ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out: list[str] = []
    for _, group in itertools.groupby(enumerate(ranks), lambda p: p[1] - p[0]):
        run = [r for _, r in group]
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out) or "none"


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def some(names: list[str], most: int = 5) -> str:
    """The first ``most`` of ``names``, and how many more: for messages that name what they are about."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")

