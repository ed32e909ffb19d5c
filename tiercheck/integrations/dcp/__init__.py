"""PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``, DCP) through tiercheck's tiers.

    import torch.distributed.checkpoint as dcp
    from tiercheck.integrations.dcp import TiercheckReader, TiercheckWriter

    writer = TiercheckWriter(local="/nvme/ckpt/run1", remote="s3://bucket/run1")   # every rank, once
    dcp.save(state_dict, storage_writer=writer, checkpoint_id=100)                 # step 100
    dcp.load(state_dict, storage_reader=TiercheckReader(local="/nvme/ckpt/run1"))   # the newest committed step
    writer.close()                                                                 # waits for the drain

DCP plans what is written (its planner flattens the state dict, picks one rank per replicated item and builds
the global ``Metadata``); these classes store it as one tiercheck step per save, ``checkpoint_id`` its number.
DCP's call order (``storage.py``), and what each call does here:

Saving: ``reset(checkpoint_id)`` (all ranks: the step) -> ``set_up_storage_writer`` (all) ->
``prepare_local_plan`` (all; as is) -> ``prepare_global_plan`` (coordinator: notes whether any rank's share
changed, and says so to every rank in ``storage_data``) -> ``write_data`` (all: the rank's items become one
Checkpointer state, tensors as ``Shard`` pieces, DCP's pickled objects as ``bytes``; ``save`` stages, writes with
CRCs and commits once every rank's part is durable, and the future completes then) -> ``finish``
(coordinator: the step is committed already; the drain to the remote tier runs on in the background).

Loading: ``reset`` (all, only with a ``checkpoint_id``) -> ``read_metadata`` (all: agree on the step,
rebuild ``Metadata`` from its JSON) -> ``set_up_storage_reader`` / ``prepare_*_plan`` (as is) ->
``read_data`` (all: one collective ``Checkpointer.restore`` of the box each tensor's read items cover,
every chunk from the fastest valid tier and verified first; then the regions go to the planner).

One Checkpointer per local directory and process serves its writer and readers (tiercheck allows one
writer per directory: a second Checkpointer would get ``DirectoryInUseError``). The writer keeps it, host
pool and save plan with it, until ``close()``; a reader without a writer opens one for ``read_data``.
"""


from __future__ import annotations

import io
import logging
import os
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from tiercheck.checkpointer import Checkpointer
from tiercheck.errors import (
    CheckpointNotFoundError,
    CoordinationError,
    CorruptCheckpointError,
    TiercheckError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from tiercheck.fmt import fmt_steps
from tiercheck.format.steps import list_steps, read_index
from tiercheck.integrations.dcp.metadata import describe_metadata, describe_plans, layout_digest, step_of, to_metadata
from tiercheck.integrations.dcp.shared import Shared, acquire, release
from tiercheck.restore.match import FreshShard
from tiercheck.restore.read import host_read_buffer
from tiercheck.state.sharding import Shard
from tiercheck.tiers.base import Tier
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.remote import open_tier

__all__ = ["TiercheckReader", "TiercheckWriter"]

log = logging.getLogger("tiercheck")

_CHECKPOINTER_OPTIONS = frozenset(
    {"remote_options", "process_group", "staging", "write", "retention", "distributed", "drain", "replication"}
)
_LAYOUT_KEY = "tiercheck_layout"  # in SavePlan.storage_data: the generation of the ranks' layout


def _options(options: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - _CHECKPOINTER_OPTIONS)
    if unknown:
        raise TypeError(
            f"unknown Checkpointer option(s) {', '.join(unknown)}; known: {', '.join(sorted(_CHECKPOINTER_OPTIONS))}"
        )
    return options


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


# ------------------------------------------------------------------------------- saving


class TiercheckWriter(StorageWriter):
    """A DCP ``StorageWriter`` saving each ``dcp.save`` / ``dcp.async_save`` as one tiercheck step.

    ``local``: this node's directory (every rank passes its own node's path); ``remote``: a URL committed steps
    drain to (S3, Azure, ``file://``); other keyword options (``remote_options``, ``process_group``,
    ``staging``, ``write``, ``retention``, ``distributed``, ``drain``) go to the ``tiercheck.Checkpointer``
    created at the first save. ``process_group`` must be the group given to ``dcp.save`` (default: the world).

    ``checkpoint_id`` is the step: ``dcp.save(sd, storage_writer=w, checkpoint_id=100)`` (or ``"100"``) writes
    step 100, and every save needs one (DCP does not call ``reset`` without it). ``dcp.save`` returns once the
    step is committed on the local tier; ``close()`` waits for the drain to the remote tier.

    ``async_save`` works with ``AsyncCheckpointerType.THREAD``: DCP stages a CPU copy of the state dict (its
    ``DefaultStager``), and its thread runs this writer, which copies that into tiercheck's host pool and waits
    for the commit. ``AsyncCheckpointerType.PROCESS`` pickles the writer into another process, where it could
    not share this process's Checkpointer, host pool and directory lock: it is refused (``TypeError``).
    """

    def __init__(self, local: str | os.PathLike[str], remote: str | None = None, **checkpointer_options: Any) -> None:
        super().__init__()
        self.local = Path(local).absolute()
        self.remote = remote
        self.options = _options(checkpointer_options)
        self._step: int | None = None
        self._coordinator = False
        self._dcp_rank: int | None = None
        self._shared: Shared | None = None
        self._closed = False
        # The coordinator's view of the layout (which rank writes which region), and each rank's.
        self._digest: str | None = None
        self._generation = 0
        self._planned_generation = 0
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
            if digest != self._digest:
                self._digest, self._generation = digest, self._generation + 1
            self._described = describe_plans(plans)
        return [replace(p, storage_data={_LAYOUT_KEY: self._generation}) for p in plans]

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
            if layout is not None and layout != self._planned_generation:
                # Some rank's share changed: every rank re-plans (tiercheck re-plans by itself only where a
                # rank's own leaves changed, and its planning is collective).
                shared.ckpt._plan = None
                self._planned_generation = layout
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
        if self._shared is None:
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
        """Wait for in-flight saves and (unless another user of the directory keeps it open) for drains to
        the remote tier, at most ``timeout`` s; returns the steps not drained. Idempotent."""
        self._closed = True
        shared, self._shared = self._shared, None
        if shared is None:
            return []
        shared.writer = False
        try:
            shared.ckpt.wait()  # this writer's saves, even where a reader keeps the Checkpointer open
        except Exception as e:  # the save's own future carried it already
            log.warning("closing a TiercheckWriter whose last save failed: %s", e)
        return release(shared, drain=drain, timeout=timeout)

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


# ------------------------------------------------------------------------------- loading


class TiercheckReader(StorageReader):
    """A DCP ``StorageReader`` loading a tiercheck step saved by :class:`TiercheckWriter`.

    ``local``: this node's directory; ``remote``: the remote tier to read what the local one lacks or has
    damaged. ``checkpoint_id`` is the step (an int or its decimal string); without one the ranks load the
    newest step committed on every rank's local tier or on the remote tier. Every chunk is verified against
    its CRC before any byte reaches the state; a damaged one raises ``CorruptCheckpointError`` (wrapped, as
    every error inside ``dcp.load``, in DCP's ``CheckpointException``, which names it).

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
        self.options = _options(checkpointer_options)
        self.group = checkpointer_options.get("process_group")
        self._requested: int | None = None
        self._step: int | None = None
        self._metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        """All ranks, when ``dcp.load`` was given a ``checkpoint_id``: the step to load."""
        self._requested = None if checkpoint_id is None else step_of(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """All ranks: agree on the step (a collective on the process group) and rebuild its DCP metadata."""
        if "rank" in kwargs:  # DCP's retry for rank-local metadata, after this failed: there is none
            raise CheckpointNotFoundError("tiercheck steps have no rank-local DCP metadata")
        local = LocalTier(self.local)
        remote = open_tier(self.remote, storage_options=self.remote_options) if self.remote else None
        mine: dict[str, Any] = {}
        try:
            mine["local"] = list_steps(local).committed if local.root.is_dir() else []
            if remote is not None and _rank(self.group) == 0:
                mine["remote"] = list_steps(remote).committed
        except (OSError, TiercheckError) as e:
            mine["error"] = f"{type(e).__name__}: {e}"
        everyone = _all_gather(mine, self.group)
        for r, doc in enumerate(everyone):
            if "error" in doc:
                raise CoordinationError(f"rank {r} cannot list its tiers: {doc['error']}")
        whole = set.intersection(*(set(d["local"]) for d in everyone)) | set(everyone[0].get("remote", []))
        where = f"{self.local}" + (f" / {self.remote}" if self.remote else "")
        if self._requested is not None:
            if self._requested not in whole:
                raise CheckpointNotFoundError(
                    f"{where}: step {self._requested} is not committed on every rank's local tier or the remote "
                    f"tier (committed there: {fmt_steps(sorted(whole))})"
                )
            step = self._requested
        elif whole:
            step = max(whole)
        else:
            raise CheckpointNotFoundError(f"{where}: no step is committed on every rank's local tier or the remote")
        self._step = step
        tiers: list[Tier] = [t for t in (local, remote) if t is not None]
        error: TiercheckError | None = None
        for tier in tiers:
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
        state = _state_memory(getattr(planner, "state_dict", None))
        for fqn, items in by_fqn.items():
            if items[0].type == LoadItemType.BYTE_IO:
                values[fqn] = None  # filled from the saving rank that wrote it
                continue
            md = meta.state_dict_metadata[fqn]
            assert isinstance(md, TensorStorageMetadata)
            lo, hi = _box(items)
            boxes[fqn] = lo
            targets[fqn] = [planner.resolve_tensor(item) for item in items]
            shape = [h - low for low, h in zip(lo, hi, strict=True)]
            if state is not None and _own_target(targets[fqn], shape, md.properties.dtype, state):
                direct.add(fqn)
                buf = targets[fqn][0]
                state.append(_span(buf))  # a planner reusing one scratch tensor gets it read into once
            else:  # on a page when big: its chunks can skip the page cache
                buf = host_read_buffer(tuple(shape), md.properties.dtype)
            # Nothing sees either before the restore succeeded: it needs no staging copy of its own.
            values[fqn] = FreshShard(buf, offsets=lo, global_shape=md.size)
        with self._checkpointer() as shared, shared.lock:
            shared.state.clear()
            shared.state.update(values)
            try:
                shared.ckpt.restore(self._step, strict=True, extra=False, allow_pickle=False)
                restored = dict(shared.state)
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
                    region = [s - b for s, b in zip(_start(item), boxes[fqn], strict=True)]
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


def _box(items: list[ReadItem]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The smallest box of the global tensor holding every item's region."""
    starts = [_start(i) for i in items]
    lo = tuple(min(col) for col in zip(*starts, strict=True)) if starts[0] else ()
    ends = [[s + n for s, n in zip(st, i.lengths, strict=True)] for st, i in zip(starts, items, strict=True)]
    hi = tuple(max(col) for col in zip(*ends, strict=True)) if ends[0] else ()
    return lo, hi


def _start(item: ReadItem) -> list[int]:
    """Where an item's region starts in the global tensor."""
    chunk = item.storage_index.offset or torch.Size([0] * len(item.lengths))
    return [s + o for s, o in zip(chunk, item.storage_offsets, strict=True)]


def _own_target(
    targets: list[torch.Tensor], shape: list[int], dtype: torch.dtype, state: list[tuple[int, int]]
) -> bool:
    """Whether restore may read straight into DCP's tensor: the only one of its fqn, a CPU tensor of the stored
    dtype and of the box's shape, sharing no memory with the planner's state dict. DCP's contract
    (``LoadPlanner.resolve_tensor``) is that such a tensor reaches the state only through ``commit_tensor``,
    which is called once the restore succeeded."""
    if len(targets) != 1:
        return False
    t = targets[0]
    if type(t) is not torch.Tensor or t.device.type != "cpu" or t.dtype != dtype or list(t.shape) != shape:
        return False
    lo, hi = _span(t)
    return hi > lo and not any(a < hi and lo < b for a, b in state)


def _state_memory(value: Any) -> list[tuple[int, int]] | None:
    """The memory every tensor of the planner's state dict lies in (DTensors' and ShardedTensors' local
    tensors), or None where that cannot be told: then no target counts as made for the load."""
    if not isinstance(value, Mapping):
        return None
    spans: list[tuple[int, int]] = []
    todo: list[Any] = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, Mapping):
            todo.extend(v.values())
        elif isinstance(v, list | tuple):
            todo.extend(v)
        elif callable(getattr(v, "local_shards", None)):  # a ShardedTensor (a Tensor with no storage of its own)
            todo.extend(s.tensor for s in v.local_shards())
        elif hasattr(v, "__tensor_flatten__"):  # a wrapper subclass (DTensor, float8, ...): its inner tensors
            todo.extend(getattr(v, name) for name in v.__tensor_flatten__()[0])
        elif isinstance(v, torch.Tensor):
            try:
                spans.append(_span(v))
            except (RuntimeError, NotImplementedError):  # some other subclass without a plain storage
                return None
    return spans


def _span(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _rank(group: Any) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _all_gather(obj: Any, group: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
