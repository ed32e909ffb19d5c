"""The job a rank works in, as save and restore see it: one value instead of the same five
arguments threaded through every protocol."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiercheck.cluster.coordination import Coordinator
from tiercheck.cluster.nodes import Nodes
from tiercheck.tiers.base import Tier


@dataclass(frozen=True, kw_only=True)
class Job:
    """This rank's place in its job: the store it meets the other ranks in, the nodes (ranks that
    share a local directory), this node's local tier, the remote tier if any, and the process
    group chunks are fanned out over (None: the default group)."""

    coord: Coordinator
    nodes: Nodes
    tier: Tier
    remote: Tier | None = None
    group: Any = None
