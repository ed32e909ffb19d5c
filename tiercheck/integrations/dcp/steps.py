"""Which steps every rank can restore: committed on every rank's local tier, in every rank's memory tier (with
``MemoryOptions``), or on the remote tier.

One collective (an all-gather on the training process group) shared by :class:`TiercheckReader` (the step
``dcp.load`` reads) and the framework managers built on it (torchtitan's ``CheckpointManager`` finds the step to
resume from with it). Rank 0 alone lists the remote tier; each rank lists its own node's directory, which may be
missing or empty (a replaced node restores from the remote alone).
"""


from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tiercheck.errors import CoordinationError, TiercheckError
from tiercheck.integrations._collectives import all_gather_object
from tiercheck.options import MemoryOptions
from tiercheck.seam import LocalTier, list_steps, memory_steps, open_tier

__all__ = ["restorable_steps"]


def restorable_steps(
    local: str | os.PathLike[str],
    remote: str | None = None,
    *,
    remote_options: dict[str, Any] | None = None,
    group: Any = None,
    memory: MemoryOptions | None = None,
) -> set[int]:
    """All ranks of ``group``: the steps committed on every rank's local tier, in every rank's memory tier (of
    ``local``'s lineage: what ``Checkpointer.restore`` reads from memory, all or nothing), or on the remote tier.

    Raises ``CoordinationError`` (on every rank) if a rank cannot list its tiers."""
    tier = LocalTier(Path(local).absolute())
    mine: dict[str, Any] = {}
    try:
        mine["local"] = list_steps(tier).committed if tier.root.is_dir() else []
        mine["memory"] = memory_steps(memory, tier.root)[1]
        if remote is not None and _rank(group) == 0:
            mine["remote"] = list_steps(open_tier(remote, storage_options=remote_options)).committed
    except (OSError, TiercheckError) as e:
        mine["error"] = f"{type(e).__name__}: {e}"
    everyone = all_gather_object(mine, group)
    for r, doc in enumerate(everyone):
        if "error" in doc:
            raise CoordinationError(f"rank {r} cannot list its tiers: {doc['error']}")
    on_disk = set.intersection(*(set(d["local"]) for d in everyone))
    in_memory = set.intersection(*(set(d["memory"]) for d in everyone))
    return on_disk | in_memory | set(everyone[0].get("remote", []))


def _rank(group: Any) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
