"""The DCP ``StorageReader``: ``dcp.load`` of a step saved by :class:`~tiercheck.integrations.dcp.TiercheckWriter`.

DCP's loading calls, in the order ``dcp.load`` makes them (see ``tiercheck.integrations.dcp``), and which rank
makes each, are listed on :class:`TiercheckReader`'s methods. ``read_metadata`` is where the ranks agree on the
step (one all-gather on the training process group); ``read_data`` is one collective ``Checkpointer.restore``
through the directory's shared Checkpointer (``shared``), every chunk verified before any byte reaches DCP's
tensors (``regions`` says which of them may be read into straight).
"""


from __future__ import annotations

import io
import os
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tiercheck.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    TiercheckError,
    UnsafeCheckpointError,
)
from tiercheck.integrations.dcp.metadata import step_of, to_metadata
from tiercheck.integrations.dcp.regions import item_start, memory_span, own_target, read_box, state_memory
from tiercheck.integrations.dcp.shared import Shared, acquire, checked_options, release
from tiercheck.integrations.dcp.steps import restorable_steps
from tiercheck.integrations.dcp.writer import TiercheckWriter
from tiercheck.seam import (
    FreshShard,
    fmt_steps,
    host_read_buffer,
    open_tier,
    read_index,
    refuse_foreign,
    restore_tree,
    step_tiers,
)

__all__ = ["TiercheckReader"]


class TiercheckReader(StorageReader):
    """A DCP ``StorageReader`` loading a tiercheck step saved by :class:`TiercheckWriter`.

    ``local``: this node's directory; ``remote``: the remote tier to read what the local one lacks or has
    damaged. ``checkpoint_id`` is the step (an int or its decimal string); without one the ranks load the
    newest step committed on every rank's local tier or on the remote tier. With the writer's
    ``memory=MemoryOptions(...)``, the steps in every rank's memory tier count too, and a step there is read
    from memory (a step saved to memory only included). Every chunk is verified against
    its CRC before any byte reaches the state; a damaged one raises ``CorruptCheckpointError`` (wrapped, as
    every error inside ``dcp.load``, in DCP's ``CheckpointException``, which names it). After a load,
    ``restored_from`` says which tier served this rank: ``"memory"``, ``"the local directory"`` or
    ``"the remote tier"`` (where any chunk came from there).

    DCP's byte items are ``torch.save`` pickles, which DCP's load planner unpickles with
    ``weights_only=False``. The reader lets through only what ``torch.load(weights_only=True)`` accepts
    (plain values, tensors, containers; add types with ``safe_globals=[...]``), re-serialised; anything else
    raises ``UnsafeCheckpointError`` unless ``allow_pickle=True`` (then the bytes go to DCP as stored).
    """

    def __init__(
        self,
        local: str | os.PathLike[str],
        remote: str | None = None,
        *,
        remote_options: dict[str, Any] | None = None,
        allow_pickle: bool = False,
        safe_globals: list[Any] | None = None,
        **checkpointer_options: Any,
    ) -> None:
        super().__init__()
        self.local = Path(local).absolute()
        self.remote = remote
        self.remote_options = remote_options
        self.allow_pickle = allow_pickle
        self.safe_globals = list(safe_globals or [])
        self.options = checked_options(checkpointer_options)
        self.group = checkpointer_options.get("process_group")
        self._requested: int | None = None
        self._step: int | None = None
        self._metadata: Metadata | None = None
        self.restored_from: str | None = None  # the tier the last load read, for its caller's log

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        """All ranks, when ``dcp.load`` was given a ``checkpoint_id``: the step to load."""
        self._requested = None if checkpoint_id is None else step_of(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """All ranks: agree on the step (a collective on the process group) and rebuild its DCP metadata."""
        if "rank" in kwargs:  # DCP's retry for rank-local metadata, after this failed: there is none
            raise CheckpointNotFoundError("tiercheck steps have no rank-local DCP metadata")
        memory = self.options.get("memory")
        whole = restorable_steps(
            self.local, self.remote, remote_options=self.remote_options, group=self.group, memory=memory
        )
        where = f"{self.local}" + (" / its memory tier" if memory else "")
        where += f" / {self.remote}" if self.remote else ""
        if self._requested is not None:
            if self._requested not in whole:
                raise CheckpointNotFoundError(
                    f"{where}: step {self._requested} is not committed on every rank's local (or memory) tier or "
                    f"the remote tier (committed there: {fmt_steps(sorted(whole))})"
                )
            step = self._requested
        elif whole:
            step = max(whole)
        else:
            refuse_foreign(self.local)  # DCP checkpoints of its own writer there: name the import, not just "none"
            raise CheckpointNotFoundError(f"{where}: no step is committed on every rank's local tier or the remote")
        self._step = step
        remote = open_tier(self.remote, storage_options=self.remote_options) if self.remote else None
        error: TiercheckError | None = None
        for tier in step_tiers(step, self.local, memory=memory, remote=remote):
            try:
                _, doc, _ = read_index(tier, step)
            except (CheckpointNotFoundError, CorruptCheckpointError) as e:
                error = error or e
                continue
            meta = doc.get("metadata")
            return to_metadata(
                meta.get("dcp") if isinstance(meta, dict) else None, step, where=f"{tier.url}: step {step}"
            )
        assert error is not None
        raise error

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """All ranks."""
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """All ranks, once per load: one collective restore of the boxes this rank's items lie in."""
        assert self._step is not None, "read_metadata runs first"
        by_fqn: dict[str, list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            by_fqn[item.storage_index.fqn].append(item)
        meta = self._metadata
        assert meta is not None, "set_up_storage_reader runs first"
        values: dict[str, Any] = {}
        boxes: dict[str, tuple[int, ...]] = {}
        # DCP's tensor for each read item, resolved once. A tensor of the state it loads into stays untouched
        # until every chunk is verified: restore reads into a new buffer, copied in afterwards. A tensor the
        # planner made for the load (it aliases none of the state) is read into straight, with no copy.
        targets: dict[str, list[torch.Tensor]] = {}
        direct: set[str] = set()
        state = state_memory(getattr(planner, "state_dict", None))
        for fqn, items in by_fqn.items():
            if items[0].type == LoadItemType.BYTE_IO:
                values[fqn] = None  # filled from the saving rank that wrote it
                continue
            md = meta.state_dict_metadata[fqn]
            assert isinstance(md, TensorStorageMetadata)
            lo, hi = read_box(items)
            boxes[fqn] = lo
            targets[fqn] = [planner.resolve_tensor(item) for item in items]
            shape = [h - low for low, h in zip(lo, hi, strict=True)]
            if state is not None and own_target(targets[fqn], shape, md.properties.dtype, state):
                direct.add(fqn)
                buf = targets[fqn][0]
                state.append(memory_span(buf))  # a planner reusing one scratch tensor gets it read into once
            else:  # on a page when big: its chunks can skip the page cache
                buf = host_read_buffer(tuple(shape), md.properties.dtype)
            # Nothing sees either before the restore succeeded: it needs no staging copy of its own.
            values[fqn] = FreshShard(buf, offsets=lo, global_shape=md.size)
        with self._checkpointer() as shared, shared.lock:
            shared.state.clear()
            shared.state.update(values)
            try:
                restore_tree(shared.ckpt, self._step, strict=True, extra=False, allow_pickle=False)
                restored = dict(shared.state)
                self.restored_from = _tier_read(shared.ckpt.stats())
            finally:
                shared.state.clear()
        for fqn, items in by_fqn.items():
            for i, item in enumerate(items):
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(self._safe_bytes(fqn, restored[fqn])))
                    continue
                target = targets[fqn][i]
                if fqn not in direct:
                    buf = restored[fqn].local
                    region = [s - b for s, b in zip(item_start(item), boxes[fqn], strict=True)]
                    src = buf[tuple(slice(r, r + n) for r, n in zip(region, item.lengths, strict=True))]
                    if target.shape != src.shape:
                        raise CorruptCheckpointError(
                            f"{fqn}: DCP asked for {list(target.shape)}, read {list(src.shape)}"
                        )
                    target.detach().copy_(src)
                planner.commit_tensor(item, target)
        return _done(None)

    @contextmanager
    def _checkpointer(self) -> Iterator[Shared]:
        shared = acquire(self.local, self.remote, {**self.options, "remote_options": self.remote_options}, writer=False)
        try:
            yield shared
        finally:
            release(shared, drain=False)  # drains are the writer's business

    def _safe_bytes(self, fqn: str, raw: Any) -> bytes:
        if not isinstance(raw, bytes):
            raise CorruptCheckpointError(f"step {self._step}: {fqn} should be DCP's bytes, found {type(raw).__name__}")
        if self.allow_pickle:
            return raw
        try:
            with torch.serialization.safe_globals(self.safe_globals):
                value = torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as e:
            raise UnsafeCheckpointError(
                f"step {self._step}: {fqn} needs unpickling beyond torch.load(weights_only=True) ({e}); "
                "pass TiercheckReader(safe_globals=[...]) for its types, or allow_pickle=True if you trust it"
            ) from None
        out = io.BytesIO()
        torch.save(value, out)
        return out.getvalue()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return TiercheckWriter.validate_checkpoint_id(checkpoint_id)


def _tier_read(stats: dict[str, Any]) -> str:
    """Which tier a restore read, from the Checkpointer's counters of it."""
    if stats.get("restore_from_memory"):
        return "memory"
    return "the remote tier" if stats.get("restore_remote_reads") else "the local directory"


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut
