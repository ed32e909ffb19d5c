"""A Checkpointer's save plan across saves: made with every rank once, reused while the state's
layout stays the same (a save then exchanges nothing to plan)."""

from __future__ import annotations

import logging

from tiercheck.cluster.coordination import Coordinator, drive
from tiercheck.save.pack import RUN_ALIGN, PackPlan, leaf_descs, pack_plan
from tiercheck.save.plan import plan_save

__all__ = ["RUN_ALIGN", "Planner"]
from tiercheck.state.flatten import Leaf

log = logging.getLogger("tiercheck")


class Planner:
    """A Checkpointer's write plan, made with every rank (``plan_save``) and kept while the
    state's leaves keep their layout: re-planned only when one changed, or when told to
    (``forget``: every rank must then, as planning is collective)."""

    def __init__(self, coord: Coordinator, *, rank: int, world_size: int, root_doc: bool, target_chunk_bytes: int):
        self.coord, self.rank, self.world_size, self.root_doc = coord, rank, world_size, root_doc
        self.target_chunk_bytes = target_chunk_bytes
        self.align = 1  # chunks' alignment in the pack (see pack_plan)
        self.plan: PackPlan | None = None
        self.made = 0  # plans made so far (each a collective round, named by its number)
        self.reused = 0  # saves that took the last plan as it was: nothing exchanged

    @staticmethod
    def chunk_target(chunk_bytes: int, max_host_bytes: int | None) -> int:
        """The chunk size to plan for: ``WriteOptions.chunk_bytes``, less where a bounded pool
        (``StagingOptions.max_host_bytes``) must hold two chunks at least."""
        return chunk_bytes if max_host_bytes is None else min(chunk_bytes, max(max_host_bytes // 2, 4096))

    def forget(self) -> None:
        self.plan = None

    def stats(self) -> dict[str, int]:
        return {"plan_bytes_per_save": self.bytes_per_save, "plans_made": self.made, "plans_reused": self.reused}

    @property
    def bytes_per_save(self) -> int:
        """What this rank writes of each save, by the current plan (0 before one is made)."""
        return sum(t.nbytes for t in self.plan.tasks) if self.plan is not None else 0

    def for_leaves(self, leaves: list[Leaf]) -> PackPlan:
        """This rank's write plan for ``leaves``: the last one, if their layout is the same."""
        descs = leaf_descs(leaves)
        if self.plan is not None and self.plan.signature == descs:
            self.reused += 1
            return self.plan
        planned = drive(self.coord, plan_save(self.coord, self.made, descs, target_chunk_bytes=self.target_chunk_bytes))
        self.made += 1
        self.plan = pack_plan(leaves, planned, signature=descs, rank=self.rank, root_doc=self.root_doc,
                              align=self.align)  # fmt: skip
        if self.world_size > 1:
            log.info(
                "rank %d: save plan: this rank writes %.1f MiB of the %d arrays it holds, coordinates %d",
                self.rank,
                planned.nbytes / 2**20,
                len(planned.records),
                len(planned.shard),
            )
        return self.plan

