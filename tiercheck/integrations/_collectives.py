"""The collectives the framework plugins run on the training thread, where the framework runs its own.

A plugin's ranks agree (on a step, a layout, whether anyone failed) inside the framework's save or load call,
which every rank makes together, as the framework's own checkpointing does: one ``all_gather_object`` on the
training process group. tiercheck's background threads never call these (they coordinate through the store).
"""


from __future__ import annotations

from typing import Any

import torch.distributed as dist

from tiercheck.errors import CoordinationError

__all__ = ["all_gather_object", "raise_first"]


def all_gather_object(obj: Any, group: Any = None, *, world_size: int | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (a collective on ``group``; ``None``: the world).

    ``world_size``: the ranks taking part where the caller knows it (a Checkpointer's, 1 when it does not
    cooperate with other ranks); by default the group's size, 1 without torch.distributed. With one rank
    nothing is sent."""
    if world_size is None:
        initialized = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size(group) if initialized else 1
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def raise_first(everyone: list[Any], own: BaseException | None) -> None:
    """After an all-gather of outcomes (dicts with an ``"error"`` entry): this rank's own failure with its
    original type, else a ``CoordinationError`` naming the first rank that failed; nothing if none did."""
    if own is not None:
        raise own
    for rank, doc in enumerate(everyone):
        if doc.get("error"):
            raise CoordinationError(f"rank {rank} failed, so this rank stops too: {doc['error']}")
