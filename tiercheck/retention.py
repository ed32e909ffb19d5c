"""Which committed steps a tier keeps."""

from __future__ import annotations

from collections.abc import Iterable

from .options import RetentionOptions


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
