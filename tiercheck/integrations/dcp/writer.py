"""The DCP ``StorageWriter``: each ``dcp.save`` / ``dcp.async_save`` one tiercheck step.

DCP's saving calls, in the order ``dcp.save`` makes them (see ``tiercheck.integrations.dcp``), and which rank
makes each, are listed on :class:`TiercheckWriter`'s methods. DCP plans what is written; the writer hands each
rank's items to the directory's shared Checkpointer (``shared``), whose ``save`` stages them into host memory,
writes and commits in the background; ``write_data``'s future completes once the step is committed. The
coordinator records DCP's global ``Metadata`` as JSON in the step's metadata (``metadata``).
"""


from __future__ import annotations

import io
import logging
import os
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tiercheck import Checkpointer, Shard
from tiercheck.errors import UnsupportedValueError
from tiercheck.integrations.dcp.metadata import describe_metadata, describe_plans, layout_digest, step_of
from tiercheck.integrations.dcp.shared import (
    Shared,
    acquire,
    checked_options,
    layout_of,
    release,
    writer_made,
)

__all__ = ["TiercheckWriter"]

log = logging.getLogger("tiercheck")

_LAYOUT_KEY = "tiercheck_layout"  # in SavePlan.storage_data: the generation of the ranks' layout


class TiercheckWriter(StorageWriter):
    """A DCP ``StorageWriter`` saving each ``dcp.save`` / ``dcp.async_save`` as one tiercheck step.

    ``local``: this node's directory (every rank passes its own node's path); ``remote``: a URL committed steps
    drain to (S3, Azure, ``file://``); other keyword options (``remote_options``, ``process_group``,
    ``staging``, ``write``, ``retention``, ``distributed``, ``drain``, ``replication``, ``memory``) go to the
    ``tiercheck.Checkpointer`` created at the first save. ``process_group`` must be the group given to
    ``dcp.save`` (default: the world).

    ``checkpoint_id`` is the step: ``dcp.save(sd, storage_writer=w, checkpoint_id=100)`` (or ``"100"``) writes
    step 100, and every save needs one (DCP does not call ``reset`` without it). ``dcp.save`` returns once the
    step is committed on the local tier (with ``memory=MemoryOptions(...)``: in memory, and on the local tier
    too for the steps ``persist_every`` names); ``close()`` waits for the drain to the remote tier.

    One writer for every save, or a new one per save (DCP's idiom, ``storage_writer=TiercheckWriter(...)`` in
    each call): the writers of one process and directory share one Checkpointer (``shared``), so both save
    alike, and they must be given the same options. ``close()`` of any of them ends the directory's writing in
    this process (a later save opens a new Checkpointer); without one, interpreter exit closes it, waiting for
    its saves and drains for at most ``DistributedOptions(timeout_s=)``.

    ``async_save`` works with ``AsyncCheckpointerType.THREAD``: DCP stages a CPU copy of the state dict (its
    ``DefaultStager``), and its thread runs this writer, which copies that into tiercheck's host pool and waits
    for the commit. ``AsyncCheckpointerType.PROCESS`` pickles the writer into another process, where it could
    not share this process's Checkpointer, host pool and directory lock: it is refused (``TypeError``).
    """

    def __init__(self, local: str | os.PathLike[str], remote: str | None = None, **checkpointer_options: Any) -> None:
        super().__init__()
        self.local = Path(local).absolute()
        self.remote = remote
        self.options = checked_options(checkpointer_options)
        writer_made(self.options)
        self._step: int | None = None
        self._coordinator = False
        self._dcp_rank: int | None = None
        self._shared: Shared | None = None
        self._closed = False
        # The coordinator's view of the layout (which rank writes which region), and each rank's: the same for
        # every writer of the directory in this process.
        self._layout = layout_of(self.local)
        self._described: dict[str, Any] | None = None

    # -- DCP's calls, in order

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        """All ranks: a new save begins; ``checkpoint_id`` is its step."""
        self._step = None if checkpoint_id is None else step_of(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """All ranks."""
        if self._closed:
            raise RuntimeError("this TiercheckWriter is closed")
        if kwargs.get("use_collectives", True) is False:
            raise ValueError(
                "TiercheckWriter needs dcp.save(..., use_collectives=True): tiercheck commits collectively"
            )
        if self._step is None:
            raise ValueError(
                "TiercheckWriter needs the step as checkpoint_id in every save: "
                "dcp.save(state_dict, storage_writer=writer, checkpoint_id=100)"
            )
        self._coordinator = is_coordinator
        self._dcp_rank = kwargs.get("rank")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """All ranks: DCP's plan is used as it is."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator: note the layout; a new one makes every rank re-plan tiercheck's writing together."""
        if all(p.usable for p in plans):  # with DCP's plan caching, unchanged plans come empty
            digest = layout_digest(plans)
            layout = self._layout
            if digest != layout.digest:
                layout.digest, layout.generation = digest, layout.generation + 1
            self._described = describe_plans(plans)
        return [replace(p, storage_data={_LAYOUT_KEY: self._layout.generation}) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """All ranks: hand this rank's items to tiercheck; the future completes once the step is committed."""
        step = self._step
        assert step is not None  # set_up_storage_writer checked
        self._step = None  # a save without a checkpoint_id is refused, not written over this step
        values: dict[str, Any] = {}
        results: list[WriteResult] = []
        for item in plan.items:
            fqn = item.index.fqn
            if fqn in values:
                raise UnsupportedValueError(
                    f"{fqn}: several chunks of one tensor on one rank (a ShardedTensor with several local shards) "
                    "cannot be saved through TiercheckWriter"
                )
            data = planner.resolve_data(item)
            if item.tensor_data is not None:
                assert isinstance(data, torch.Tensor)
                chunk = item.tensor_data.chunk
                values[fqn] = Shard(data.detach(), offsets=chunk.offsets, global_shape=item.tensor_data.size)
                nbytes = data.numel() * data.element_size()
            else:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)  # type: ignore[arg-type]
                values[fqn] = raw
                nbytes = len(raw)
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=None))
        metadata = self._metadata(planner) if self._coordinator else None
        shared = self._checkpointer()
        layout = plan.storage_data.get(_LAYOUT_KEY) if isinstance(plan.storage_data, dict) else None
        with shared.lock:
            if layout is not None and layout != self._layout.planned:
                # Some rank's share changed: every rank re-plans (tiercheck re-plans by itself only where a
                # rank's own leaves changed, and its planning is collective).
                shared.ckpt.forget_plan()
                self._layout.planned = layout
            shared.state.clear()
            shared.state.update(values)
            try:
                handle = shared.ckpt.save(step, metadata=metadata)
            finally:
                shared.state.clear()  # the host copy is taken: hold no references to DCP's tensors
        fut: Future[list[WriteResult]] = Future()

        def committed(f: Any) -> None:
            error = f.exception()
            if error is None:
                fut.set_result(results)
            else:
                fut.set_exception(error)

        handle.committed.add_done_callback(committed)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator, after every rank's ``write_data`` completed: the step is committed already."""
        log.debug("DCP save committed as a tiercheck step (%d ranks' results)", len(results))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            step_of(checkpoint_id)
        except ValueError:
            return False
        return True

    # -- helpers and lifecycle

    def _metadata(self, planner: SavePlanner) -> dict[str, Any]:
        md = getattr(planner, "metadata", None)  # DefaultSavePlanner keeps the global Metadata it made
        described = describe_metadata(md) if isinstance(md, Metadata) else self._described
        if described is None:
            raise RuntimeError("TiercheckWriter: the coordinator has no global save plan (prepare_global_plan not run)")
        return {"dcp": described}

    def _checkpointer(self) -> Shared:
        if self._shared is None or self._shared.closed or not self._shared.writer:  # another writer closed it
            self._shared = acquire(self.local, self.remote, self.options, writer=True)
            ckpt = self._shared.ckpt
            if self._dcp_rank is not None and self._dcp_rank != ckpt.rank:
                raise ValueError(
                    f"DCP's rank {self._dcp_rank} is tiercheck's rank {ckpt.rank}: give TiercheckWriter the "
                    "process_group given to dcp.save"
                )
        return self._shared

    @property
    def checkpointer(self) -> Checkpointer | None:
        """The tiercheck Checkpointer this writer saves with (None before the first save): ``status()``,
        ``drain()``, ``stats()``."""
        return self._shared.ckpt if self._shared is not None else None

    def close(self, *, drain: bool = True, timeout: float | None = None) -> list[int]:
        """End this process's writing to the directory (every writer of it shares one Checkpointer): wait for
        in-flight saves and (unless a reader of the directory keeps it open) for drains to the remote tier, at
        most ``timeout`` s; returns the steps not drained. Idempotent."""
        self._closed = True
        shared, self._shared = self._shared, None
        if shared is None or shared.closed or not shared.writer:
            return []
        try:
            shared.ckpt.wait()  # the writers' saves, even where a reader keeps the Checkpointer open
        except Exception as e:  # the save's own future carried it already
            log.warning("closing a TiercheckWriter whose last save failed: %s", e)
        return release(shared, drain=drain, timeout=timeout, writer=True)

    def __enter__(self) -> TiercheckWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "a TiercheckWriter cannot be pickled: it saves through this process's tiercheck Checkpointer (host "
            "pool, directory lock, background threads). Use dcp.async_save(..., "
            "async_checkpointer_type=AsyncCheckpointerType.THREAD), not PROCESS"
        )
