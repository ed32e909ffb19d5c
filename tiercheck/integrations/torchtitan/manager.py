"""torchtitan's DCP ``CheckpointManager``, saving and loading through tiercheck's tiers.

What changes against torchtitan's own manager, method by method (the rest is torchtitan's, unchanged):

- ``dcp_save``: ``dcp.save`` / ``dcp.async_save`` with a :class:`TiercheckWriter` and the step as
  ``checkpoint_id``. An HF export (``last_save_in_hf``) stays torchtitan's, in ``<folder>/hf/step-N``.
- ``dcp_load``: ``dcp.load`` with a :class:`TiercheckReader` for the manager's own steps; anything else
  (``initial_load_path``, HF weights) is torchtitan's.
- ``_find_load_step`` / ``_load``: the newest step every rank can restore, committed on every rank's local tier
  (or memory tier, with ``memory``) or on the remote tier (one collective): a new node with an empty directory
  resumes from the remote alone. Where that step is damaged (DCP's ``CheckpointException`` wraps a
  ``CorruptCheckpointError``), the next older one.
- ``_purge_stale_checkpoints``: nothing. ``keep_latest_k`` becomes the local tier's ``RetentionOptions``, which
  never deletes the newest restorable step, a step still draining, or a step another node may lack.
- ``_close``: waits for the last async save and for the drain to the remote tier.
"""


from __future__ import annotations

import dataclasses
import logging
import re
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from tiercheck.errors import CorruptCheckpointError, InvalidArgumentError
from tiercheck.integrations.dcp.reader import TiercheckReader
from tiercheck.integrations.dcp.steps import restorable_steps
from tiercheck.integrations.dcp.writer import TiercheckWriter
from tiercheck.integrations.torchtitan.compat import (
    MODEL,
    AsyncMode,
    CheckpointManager,
    GarbageCollection,
    filesystem,
)
from tiercheck.options import DrainOptions, MemoryOptions, RetentionOptions, WriteOptions
from tiercheck.options import StagingOptions as TiercheckStaging
from tiercheck.seam import committed_step_at, refuse_foreign

__all__ = ["TiercheckCheckpointManager"]

log = logging.getLogger("tiercheck")

_STEP_ID = re.compile(r"step-([0-9]+)")


class TiercheckCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` (``torchtitan.components.checkpointer.dcp``) over tiercheck's tiers.

    Select it in a config module with ``checkpoint=TiercheckCheckpointManager.Config(...)``; every field of
    torchtitan's ``CheckpointManager.Config`` keeps its meaning, except ``keep_latest_k`` (tiercheck's local
    retention, see the module), and these are added (see :class:`TiercheckCheckpointManager.Config`).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        local: str | None = None
        """This node's checkpoint directory (fast local disk). Default: ``folder`` under the dump folder."""

        remote: str | None = None
        """Where committed steps drain in the background (``s3://``, ``az://``, ``file://``); None: no remote."""

        remote_options: dict[str, Any] = field(default_factory=dict)
        """fsspec options of the remote tier (endpoint, credentials)."""

        remote_keep_last: int | None = None
        """Steps kept on the remote tier (None: all); its newest committed step is never deleted."""

        keep_every: int | None = None
        """Keep every step that is a multiple of this forever, on both tiers (None: no such steps)."""

        drain_every: int = 1
        """Drain only steps divisible by this to the remote tier."""

        max_host_bytes: int | None = None
        """Bound on tiercheck's host staging memory (None: one snapshot of the rank's state)."""

        take_over: bool = False
        """Write into a directory or prefix holding another run's steps (tiercheck's ``LineageError`` otherwise)."""

        memory: MemoryOptions | None = None
        """tiercheck's memory tier (``tiercheck.MemoryOptions(path=..., persist_every=N)``): every save is committed
        to files on a tmpfs that outlive the process, the steps ``persist_every`` names go to ``local`` too, and a
        restart after a crash resumes from memory (None: no memory tier)."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            for name in ("remote_keep_last", "keep_every"):
                value = getattr(self, name)
                if value is not None and value < 1:
                    raise ValueError(f"{name} must be at least 1 or None, not {value}")
            if self.drain_every < 1:
                raise ValueError(f"drain_every must be at least 1, not {self.drain_every}")
            if self.memory is not None and not isinstance(self.memory, MemoryOptions):
                raise InvalidArgumentError(
                    f"checkpoint.memory must be a tiercheck.MemoryOptions or None, not {type(self.memory).__qualname__}"
                )

    def __init__(self, config: Config, **kwargs: Any) -> None:
        _refuse_pinned_without_cuda(config)
        # torchtitan's purge thread is never started: retention is tiercheck's (keep_latest_k, mapped below).
        super().__init__(_without_purge(config), **kwargs)
        self._last_reader: TiercheckReader | None = None  # the last load's: which tier it read
        if not self.enable:
            return
        self.keep_latest_k = config.keep_latest_k
        if config.local is None and filesystem.is_remote(self.folder):
            raise ValueError(
                f"checkpoint.folder {self.folder} is remote: give TiercheckCheckpointManager.Config(local=...) a "
                "node-local directory, and the remote as remote=..."
            )
        self.local = Path(config.local or self.folder).absolute()
        self.remote = config.remote
        self.remote_options = dict(config.remote_options) or None
        options: dict[str, Any] = {
            "retention": RetentionOptions(keep_last=config.keep_latest_k or None, keep_every=config.keep_every),
            "drain": DrainOptions(
                every=config.drain_every,
                retention=RetentionOptions(keep_last=config.remote_keep_last, keep_every=config.keep_every),
            ),
            "staging": TiercheckStaging(max_host_bytes=config.max_host_bytes),
            "write": WriteOptions(take_over=config.take_over),
        }
        if config.memory is not None:
            options["memory"] = config.memory
        if self.remote_options is not None:
            options["remote_options"] = self.remote_options
        self._options = options
        self.writer = TiercheckWriter(self.local, self.remote, **options)
        log.info("torchtitan checkpoints go through tiercheck: local %s, remote %s, %s", self.local, self.remote,
                 _memory_named(config.memory))  # fmt: skip

    # -- saving

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future | AsyncSaveResponse | None:
        """Save ``state_dict`` as tiercheck step N (``checkpoint_id``: ``_create_checkpoint_id(N)``)."""
        if to_hf:  # a safetensors export for inference: torchtitan's writer, beside tiercheck's steps
            hf = filesystem.join(filesystem.join(self.folder, "hf"), f"step-{self._step_of(checkpoint_id)}")
            return super().dcp_save(state_dict, hf, async_mode, enable_garbage_collection, to_hf=True)
        step = str(self._step_of(checkpoint_id))  # the writer's checkpoint_id: the step
        ret: Future | AsyncSaveResponse | None = None
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, storage_writer=self.writer, checkpoint_id=step, process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            # DCP's PROCESS mode would pickle the writer into another process, away from this process's
            # Checkpointer: the save runs on DCP's thread instead, after its pinned-memory stager.
            stager: DefaultStager | None = getattr(self, "stager", None)
            if stager is None:
                stager = self.stager = DefaultStager(
                    StagingOptions(
                        use_pinned_memory=torch.cuda.is_available(),
                        use_shared_memory=False,
                        use_async_staging=True,
                        use_non_blocking_copy=torch.cuda.is_available(),
                    )
                )
            ret = dcp.async_save(
                state_dict,
                storage_writer=self.writer,
                checkpoint_id=step,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.THREAD,
                async_stager=stager,
            )
        else:
            dcp.save(state_dict, storage_writer=self.writer, checkpoint_id=step)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def _purge_stale_checkpoints(self) -> None:
        """Nothing: tiercheck's retention (``keep_latest_k``) deletes old steps, never the last restorable one."""

    # -- loading

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """Load tiercheck step N (``checkpoint_id``: ``_create_checkpoint_id(N)``, or another directory's committed
        ``step-0000000N`` given as ``initial_load_path``); anything else (a DCP checkpoint) as torchtitan does."""
        step = None if from_hf else self._own_step(checkpoint_id)
        other = None if from_hf or step is not None else committed_step_at(checkpoint_id)
        if other is not None:  # initial_load_path at another directory's tiercheck step: read by tiercheck
            dcp.load(state_dict, storage_reader=TiercheckReader(Path(checkpoint_id).parent), checkpoint_id=other)
        elif step is None:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        else:
            self._last_reader = self._reader()
            dcp.load(state_dict, storage_reader=self._last_reader, checkpoint_id=step)
        if MODEL in self.states:  # torchtitan flattens the model's entries into the state dict (as its own does)
            self.states[MODEL].load_state_dict(state_dict)

    def _find_load_step(self, folder: str = "") -> int:
        """All ranks: the newest step committed on every rank's local tier or on the remote tier; -1 if none."""
        return max(self._restorable(), default=-1)

    def _load(self, step: int = -1) -> bool:
        """All ranks: resume from ``step`` (-1: the newest restorable step, falling back to the next older one
        where a step is damaged, as ``Checkpointer.restore()`` does); torchtitan's own start without one."""
        steps = self._restorable()
        if step != -1 and step not in steps and self._torchtitan_step(step):
            return self._load_torchtitan_step(step)  # a step of the run before it moved over
        if step != -1 and step not in steps:
            raise FileNotFoundError(
                f"--checkpoint.load_step={step} is not committed on every rank's local tier ({self.local}) "
                f"or on the remote tier ({self.remote}); restorable: {sorted(steps)}"
            )
        if step != -1:
            self._load_step(step)
            return True
        if not steps:
            return self._load_without_steps()
        damaged: list[str] = []
        for load in sorted(steps, reverse=True):
            try:
                self._load_step(load)
            except CheckpointException as e:
                # Every rank raises the same gathered exception, so every rank falls back alike.
                damage = _damage(e)
                if damage is None:
                    raise
                damaged.append(f"step {load}: {damage}")
                log.warning("step %d cannot be restored whole (%s); trying an older step", load, damage)
                continue
            return True
        raise CorruptCheckpointError(
            f"no restorable step of {self.local} / {self.remote} is whole: {'; '.join(damaged)}"
        )

    def _load_without_steps(self) -> bool:
        """No tiercheck step to resume from. ``initial_load_path`` / HF weights: torchtitan's way. Else a run moved
        over mid-way continues from torchtitan's own newest DCP ``step-N`` in the folder, read by torchtitan's own
        loader (DCP's ``FileSystemReader``); another framework's checkpoints there stop the start
        (``ForeignCheckpointError``, naming ``tiercheck import``); a fresh start only where none lies."""
        if self.initial_load_path or self.initial_load_in_hf:
            return super()._load(-1)
        own = CheckpointManager._find_load_step(self, self.folder)  # torchtitan's scan: step-N/ with its .metadata
        if own >= 0:
            log.info("no tiercheck step yet: continuing from torchtitan's own checkpoint %s/step-%d", self.folder, own)
            return self._load_torchtitan_step(own)
        for place in {str(self.local), str(self.folder)}:
            if not filesystem.is_remote(place):
                refuse_foreign(place)
        return super()._load(-1)

    def _torchtitan_step(self, step: int) -> bool:
        """Whether torchtitan's own ``step-N/`` (a DCP checkpoint) is in the folder."""
        return bool(filesystem.isfile(filesystem.join(filesystem.join(self.folder, f"step-{step}"), ".metadata")))

    def _load_torchtitan_step(self, step: int) -> bool:
        """torchtitan's own ``step-N/``, read by torchtitan's own loader (DCP's ``FileSystemReader``)."""
        states = self._states_to_load(model_only=step == 0)
        self.dcp_load(states, filesystem.join(self.folder, f"step-{step}"), from_hf=False, from_quantized=False)
        return True

    def _load_step(self, load: int) -> None:
        begin = time.monotonic()
        self._last_reader = None
        states = self._states_to_load(model_only=load == 0)
        self.dcp_load(states, checkpoint_id=self._create_checkpoint_id(load), from_hf=False, from_quantized=False)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        reader = self._last_reader
        where = f" from {reader.restored_from}" if reader is not None and reader.restored_from else ""
        log.info("restored step %d%s through tiercheck in %.2f s", load, where, time.monotonic() - begin)

    # -- closing

    def _close(self) -> None:
        """Wait for the last async save, then for the drain to the remote tier; stop torchtitan's helpers."""
        if getattr(self, "save_future", None) is not None:
            try:
                self.maybe_wait_for_saving()
            except Exception as e:  # already the caller's; closing still drains what committed
                log.warning("closing: the last async save failed: %s", e)
        super()._close()
        writer = getattr(self, "writer", None)
        if writer is not None:
            undrained = writer.close()
            if undrained:
                log.warning("closing: steps %s are not drained to %s yet (the next run drains them)", undrained,
                            self.remote)  # fmt: skip

    # -- helpers

    def _restorable(self) -> set[int]:
        return restorable_steps(
            self.local, self.remote, remote_options=self.remote_options, memory=self._options.get("memory")
        )

    def _reader(self) -> TiercheckReader:
        options = {k: v for k, v in self._options.items() if k != "remote_options"}
        return TiercheckReader(self.local, self.remote, remote_options=self.remote_options, **options)

    def _own_step(self, checkpoint_id: str) -> int | None:
        """N when ``checkpoint_id`` is this manager's ``<folder>/step-N``, else None (a path of torchtitan's own, or a
        DCP checkpoint there, such as torchtitan's own ``step-N`` given as ``initial_load_path``)."""
        if filesystem.isfile(filesystem.join(str(checkpoint_id), ".metadata")):
            return None
        head, _, name = str(checkpoint_id).rpartition("/")
        m = _STEP_ID.fullmatch(name)
        return int(m.group(1)) if m and head == str(self.folder).rstrip("/") else None

    def _step_of(self, checkpoint_id: str) -> int:
        step = self._own_step(checkpoint_id)
        if step is None:
            raise ValueError(f"checkpoint_id {checkpoint_id!r} is not {self.folder}/step-N")
        return step


def _damage(e: CheckpointException) -> CorruptCheckpointError | None:
    """The damage among a failed load's ranks' errors (a checksum, a missing or unreadable file), if any:
    a reason to try an older step, where any other error (a state that does not match) is not."""
    for error, _ in e.failures.values():
        if isinstance(error, CorruptCheckpointError):
            return error
    return None


def _memory_named(memory: MemoryOptions | None) -> str:
    """The start-up line's words for the memory tier."""
    if memory is None:
        return "no memory tier"
    if memory.persist_every == 1:
        return f"memory tier under {memory.path} (every checkpoint, each persisted to local too)"
    return (
        f"memory tier under {memory.path} (every checkpoint; those of a step divisible by {memory.persist_every} "
        "persisted to local too)"
    )


def _refuse_pinned_without_cuda(config: Any) -> None:
    """``async_with_pinned_mem`` stages through DCP's pinned, non-blocking copies, which need an accelerator:
    without CUDA torchtitan's stager fails at the first save, so the manager is refused when built instead."""
    if config.enable and str(config.async_mode).lower() == "async_with_pinned_mem" and not torch.cuda.is_available():
        raise InvalidArgumentError(
            "checkpoint.async_mode='async_with_pinned_mem' needs CUDA (DCP's pinned-memory stager copies from the "
            "accelerator), and torch.cuda.is_available() is False here: use async_mode='async' (the save runs on "
            "DCP's thread) or 'disabled'"
        )


def _without_purge(config: Any) -> Any:
    """``config`` with ``keep_latest_k=0``: torchtitan's purge thread is never started."""
    return dataclasses.replace(config, keep_latest_k=0)
