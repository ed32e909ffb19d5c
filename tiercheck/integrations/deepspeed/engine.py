"""The DeepSpeed ``CheckpointEngine`` whose checkpoints are tiercheck steps.

DeepSpeed's calls, as ``engine.save_checkpoint`` makes them on every rank: ``create`` (a checkpoint begins),
``save`` per file (recorded, not written), ``commit`` (at the next optimizer step, or ``stage()`` from
install's wrapper of ``save_checkpoint``: the recorded files become one tiercheck step, copied to host memory
before it returns; the pointer files and ``latest`` follow once the step is committed). ``engine.load_checkpoint``,
wrapped by install, first calls ``prepare_load`` (every rank together: one collective restore of the files each
rank will load, pointer files where DeepSpeed looks), then DeepSpeed's ``load`` per file, then ``finish_load``.
"""


from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from tiercheck import Checkpointer, load
from tiercheck.errors import CheckpointNotFoundError, ForeignCheckpointError, StepExistsError, TiercheckError
from tiercheck.integrations._collectives import all_gather_object
from tiercheck.integrations.deepspeed.compat import SAFE_GLOBALS, CheckpointEngine, commit_info
from tiercheck.integrations.deepspeed.files import (
    META,
    checked_tag,
    find_tag,
    load_object,
    move,
    pack,
    read_pointer,
    unpack,
    write_atomically,
    write_pointers,
)
from tiercheck.seam import Tier, memory_steps, restore_tree, step_tiers

__all__ = ["TiercheckCheckpointEngine"]

log = logging.getLogger("tiercheck.deepspeed")


@dataclasses.dataclass
class _Pending:
    """One ``save_checkpoint`` whose files are recorded but not yet handed to tiercheck."""

    tag: str
    save_dir: str
    save_latest: bool
    step: int
    files: dict[str, Any] = dataclasses.field(default_factory=dict)


class TiercheckCheckpointEngine(CheckpointEngine):
    """A DeepSpeed ``CheckpointEngine`` whose checkpoints are tiercheck steps (see the package doc).

    Use :func:`install` rather than constructing it. ``local`` is this node's checkpoint
    directory (default: ``<save_dir>/tiercheck``); ``remote`` a URL the committed steps drain to;
    other keyword arguments go to :class:`tiercheck.Checkpointer` (``staging``, ``retention``,
    ``drain``, ``memory``, ...). With ``memory=MemoryOptions(...)`` a checkpoint may be committed
    in memory only (``persist_every``): its tag is found there, and a pointer to it reads it there.
    """

    def __init__(
        self,
        engine: Any,
        *,
        local: str | os.PathLike[str] | None = None,
        remote: str | Tier | None = None,
        allow_pickle: bool = False,
        safe_globals: Iterable[Any] = (),
        **options: Any,
    ) -> None:
        super().__init__(None)
        self.name = "TiercheckCheckpointEngine"
        self.engine = engine
        self.local = None if local is None else os.fspath(local)
        self.remote = remote
        self.allow_pickle = allow_pickle
        self.safe_globals = (*SAFE_GLOBALS, *safe_globals)
        self.options = options
        self._state: dict[str, Any] = {}  # what the Checkpointer saves / restores into: file name -> contents
        self._checkpointers: dict[str, Checkpointer] = {}
        self._pending: _Pending | None = None
        self._legacy = False  # DeepSpeed < 0.17.1: create(tag) / commit(tag), and commit must be synchronous
        self._restored: dict[str, Any] = {}  # absolute file path -> packed contents, during load_checkpoint
        self._published: list[Future[None]] = []  # per save: done once committed and its pointers written
        self._lock = threading.Lock()
        self._saving: str | None = None  # save_dir, inside engine.save_checkpoint (set by install's wrapper)

    # ------------------------------------------------------------------ DeepSpeed's interface

    def create(self, info: Any) -> None:
        """Start a checkpoint: ``info`` is a ``CheckpointCommitInfo`` (or the tag, before 0.17.1)."""
        self._raise_failed_saves()
        if self._pending is not None:
            self._commit_pending()  # two save_checkpoint calls with no optimizer step between them
        if self._saving is None:
            return  # not engine.save_checkpoint (save_16bit_model, say): its files are written by torch.save
        if isinstance(info, str):
            self._legacy = True
            pending = _Pending(info, self._saving, True, self._step())
        else:
            pending = _Pending(str(info.tag), os.fspath(info.save_dir), bool(info.save_latest), self._step())
        ckpt = self.checkpointer(pending.save_dir)
        if pending.step in ckpt.steps() or pending.step in memory_steps(self.options.get("memory"), ckpt.tier.root)[1]:
            raise StepExistsError(
                f"DeepSpeed checkpoint {pending.tag!r}: step {pending.step} (engine.global_steps) is already "
                f"committed in {ckpt.tier.url}; tiercheck numbers DeepSpeed checkpoints by global_steps and "
                "never overwrites one"
            )
        self._pending = pending

    def save(self, state_dict: Any, path: str) -> None:
        """Record one of DeepSpeed's files; a file outside ``<save_dir>/<tag>/`` (``save_16bit_model``)
        is not part of a checkpoint and is written with ``torch.save`` at once."""
        p = self._pending
        name = self._name_in_checkpoint(path)
        if p is None or name is None:
            torch.save(state_dict, path)
            return
        p.files[name] = pack(state_dict)

    def load(self, path: str, map_location: Any = None) -> Any:
        """One of DeepSpeed's files: restored by ``load_checkpoint``, else DeepSpeed's own file."""
        key = os.path.abspath(path)
        if key not in self._restored:
            pointer = read_pointer(path)
            if pointer is None:  # a checkpoint DeepSpeed wrote itself: no unpickling without opt-in
                return load_object(
                    path,
                    allow_pickle=self.allow_pickle,
                    safe_globals=self.safe_globals,
                    where=path,
                    map_location=map_location,
                )
            self._restored.update(self._read_alone(pointer, os.path.dirname(key)))
            if key not in self._restored:
                raise CheckpointNotFoundError(f"{path}: step {pointer['step']} in {pointer['root']} has no such file")
        return move(self.unpack(self._restored[key], where=path), map_location)

    def commit(self, info: Any) -> bool:
        """Hand the recorded files to tiercheck, if ``save_checkpoint`` has not already (DeepSpeed
        calls this at the next optimizer step; before 0.17.1, at the end of ``save_checkpoint``)."""
        published = self._commit_pending()
        if self._legacy and published is not None:
            published.result()  # old DeepSpeed writes `latest` as soon as commit returns
        return True

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        # The tag directory holds the pointer files; tiercheck's step lives in the local directory.
        os.makedirs(path, exist_ok=exist_ok)

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        """Every data-parallel rank hands DeepSpeed's model-state files to tiercheck (DeepSpeed's
        own engine: DP rank 0 alone). The replicas' files have the same names and tensors, so
        tiercheck writes each chunk once, spread over the replicas (as FastPersist spreads a
        file's bytes over DP ranks); each rank stages only the chunks it writes."""
        return True

    def is_decoupled(self) -> bool:
        return not self._legacy

    def set_commit_info(self, info: Any) -> None:
        pass

    def get_commit_info(self) -> Any:
        """The checkpoint DeepSpeed should commit at this optimizer step. ``save_latest`` is
        cleared: this engine writes ``latest`` itself, once the step is durable."""
        p = self._pending
        if p is None:
            return None  # every rank has one, files or not (ranks without files take part in the commit)
        return commit_info(p.tag, p.save_dir, save_latest=False)

    def preserves_storage_sharing(self) -> bool:
        # DeepSpeed clones tensors before torch.save so that views do not drag whole storages
        # into the file; tiercheck copies only each tensor's own elements, so no clone is needed.
        return False

    def cleanup(self) -> None:
        """Commit what is pending and wait for every save (``engine.destroy()`` calls this)."""
        self.flush()
        for ckpt in self._checkpointers.values():
            ckpt.close()
        self._checkpointers.clear()

    # ------------------------------------------------------------------ tiercheck's side

    def flush(self) -> None:
        """Commit the pending checkpoint and wait until every save is committed; raise a failure."""
        if self._pending is not None:
            self._commit_pending()
        self._raise_failed_saves(wait=True)

    def checkpointer(self, save_dir: str) -> Checkpointer:
        """The Checkpointer for ``save_dir`` (every rank calls this together the first time)."""
        root = self.local if self.local is not None else os.path.join(os.path.abspath(save_dir), "tiercheck")
        ckpt = self._checkpointers.get(root)
        if ckpt is None:
            ckpt = Checkpointer(self._state, local=root, remote=self.remote, **self.options)
            self._checkpointers[root] = ckpt
        return ckpt

    def prepare_load(self, load_dir: str, tag: str | None) -> str | None:
        """Restore (every rank together) the files of ``tag`` (default: the newest step every rank
        can get) and put pointer files where DeepSpeed looks for them; returns the tag, or None
        when tiercheck holds no such checkpoint (DeepSpeed's own files are then loaded)."""
        self.flush()
        ckpt = self.checkpointer(load_dir)
        step = None if tag is None else self._step_of_tag(ckpt, tag)
        if tag is not None and step is None:
            if os.path.isdir(os.path.join(load_dir, tag)):
                return tag  # not a tiercheck checkpoint: DeepSpeed's own files
            raise CheckpointNotFoundError(
                f"no checkpoint with tag {tag!r}: no tiercheck step of {ckpt.tier.url}"
                + (f" or {ckpt.remote.url}" if ckpt.remote is not None else "")
                + f" has it, and {os.path.join(load_dir, tag)} does not exist"
            )
        self._state.clear()
        try:
            got = restore_tree(ckpt, step, strict=False, others=self._wanted)
        except ForeignCheckpointError:  # raised on every rank at once
            if step is None and os.path.isfile(os.path.join(load_dir, "latest")):
                # The local directory is DeepSpeed's own save_dir (or holds its tags): what the error would tell
                # the caller to do is this very call, which loads DeepSpeed's files, the tag `latest` names.
                log.info("tiercheck: no tiercheck step in %s yet: loading DeepSpeed's own checkpoint", ckpt.tier.url)
                return None
            raise
        if got is None:
            self._state.clear()
            return None
        meta = self._state.pop(META, None)
        if not isinstance(meta, Mapping) or not isinstance(meta.get("tag"), str):
            raise CheckpointNotFoundError(f"step {got} in {ckpt.tier.url} was not saved by the DeepSpeed integration")
        tag = checked_tag(meta["tag"], where=f"{ckpt.tier.url}: step {got}")
        folder = os.path.join(os.path.abspath(load_dir), tag)
        self._restored = {os.path.join(folder, name): value for name, value in self._state.items()}
        write_pointers(folder, ckpt, got, list(self._state))
        self._state.clear()
        log.info("tiercheck: restoring DeepSpeed checkpoint %r (step %d) from %s", tag, got, ckpt.tier.url)
        return str(tag)

    def stage(self) -> None:
        """Hand the recorded checkpoint to tiercheck now: returns once its tensors are copied to
        host memory; writing and committing go on in the background."""
        if self._pending is not None:
            self._commit_pending()

    @contextlib.contextmanager
    def saving(self, save_dir: str | os.PathLike[str]) -> Iterator[None]:
        """Within this, ``create``/``save``/``commit`` make a checkpoint in ``save_dir`` (install()
        wraps ``engine.save_checkpoint`` in it); outside, files are written with ``torch.save``."""
        self._saving = os.fspath(save_dir)
        try:
            yield
        finally:
            self._saving = None

    def finish_load(self) -> None:
        self._restored = {}

    def _commit_pending(self) -> Future[None] | None:
        p, self._pending = self._pending, None
        if p is None:
            return None
        ckpt = self.checkpointer(p.save_dir)
        self._state.clear()
        self._state.update(p.files)
        self._state[META] = {"tag": p.tag, "files": sorted(p.files)}
        try:
            handle = ckpt.save(p.step, metadata={"deepspeed": {"tag": p.tag}})
        finally:
            self._state.clear()  # the pipeline holds its own copy once save() returns
        published: Future[None] = Future()
        with self._lock:
            self._published.append(published)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        handle.committed.add_done_callback(
            functools.partial(self._on_committed, ckpt, p, rank0 and p.save_latest, published)
        )
        return published

    def _on_committed(
        self, ckpt: Checkpointer, p: _Pending, latest: bool, published: Future[None], done: Future[Any]
    ) -> None:
        """On the commit thread: the pointer files, then ``latest``, once the step is committed."""
        exc = done.exception()
        if exc is not None:
            log.error("tiercheck: DeepSpeed checkpoint %r (step %d) failed: %s", p.tag, p.step, exc)
            published.set_exception(exc)
            return
        folder = os.path.join(p.save_dir, p.tag)
        try:
            write_pointers(folder, ckpt, p.step, sorted(p.files))
            if latest:
                write_atomically(os.path.join(p.save_dir, "latest"), p.tag.encode())
        except OSError as e:
            log.error("tiercheck: step %d is committed, but writing its pointers in %s failed: %s", p.step, folder, e)
            published.set_exception(e)
            return
        published.set_result(None)

    def _raise_failed_saves(self, *, wait: bool = False) -> None:
        """Raise the failure of a save (each once); with ``wait``, after waiting for every save."""
        with self._lock:
            done = [f for f in self._published if wait or f.done()]
            self._published = [f for f in self._published if f not in done]
        for f in done:
            exc = f.exception()  # waits
            if exc is not None:
                raise exc

    def _step(self) -> int:
        return int(getattr(self.engine, "global_steps", 0))

    def _name_in_checkpoint(self, path: str) -> str | None:
        """``path`` relative to ``<save_dir>/<tag>``, or None for a file outside it."""
        p = self._pending
        if p is None:
            return None
        path = os.path.abspath(path)
        folder = os.path.join(os.path.abspath(p.save_dir), p.tag)
        rel = os.path.relpath(path, folder)
        return None if rel.startswith("..") or os.path.isabs(rel) else rel

    def _step_of_tag(self, ckpt: Checkpointer, tag: str) -> int | None:
        """The step saved with ``tag``, from any rank's memory tier (with ``memory``), local tier or the
        remote (collective)."""
        memory, owned = memory_steps(self.options.get("memory"), ckpt.tier.root)
        found = find_tag(memory, tag) if memory is not None and owned else None
        found = found if found in owned else find_tag(ckpt.tier, tag)  # never another lineage's memory
        if found is None and ckpt.remote is not None:
            try:
                found = find_tag(ckpt.remote, tag)
            except (OSError, TiercheckError) as e:
                log.error("tiercheck: cannot search %s for tag %r: %s", ckpt.remote.url, tag, e)
        everyone: list[int | None] = all_gather_object(found)
        steps = {s for s in everyone if s is not None}
        if len(steps) > 1:
            raise CheckpointNotFoundError(f"tag {tag!r} names different steps on different ranks: {sorted(steps)}")
        return steps.pop() if steps else None

    def _wanted(self, names: list[str]) -> list[str]:
        """Which other ranks' files this rank will load, as DeepSpeed reads them: not other
        data-parallel ranks' ZeRO partitions (unless ZeRO's elastic checkpoint reads them all),
        of the model states only its model-parallel rank's and the first (DeepSpeed opens it to
        check the model-parallel size), all when that size changed; of a pipeline's layer files
        only its stage's."""
        engine = self.engine
        elastic = bool(getattr(engine, "zero_elastic_checkpoint", lambda: False)())
        group = getattr(getattr(engine, "optimizer", None), "dp_process_group", None)
        dp_rank = dist.get_rank(group=group) if dist.is_initialized() else 0
        mp_ranks = {int(m.group(1)) for n in names if (m := re.search(r"mp_rank_([0-9]+)", n))}
        same_mp = len(mp_ranks) == int(getattr(engine, "mp_world_size", 1) or 1)
        mine = {int(getattr(engine, "checkpoint_mp_rank", 0) or 0), min(mp_ranks, default=0)}
        module = getattr(engine, "module", None)
        start, stop = getattr(module, "_local_start", None), getattr(module, "_local_stop", None)
        out = []
        for n in names:
            z = re.search(r"zero_pp_rank_([0-9]+)_", n)
            if z and not elastic and int(z.group(1)) != dp_rank:
                continue
            m = re.search(r"mp_rank_([0-9]+)", n)
            if m and same_mp and int(m.group(1)) not in mine:
                continue
            layer = re.match(r"layer_([0-9]+)-", os.path.basename(n))
            if layer and start is not None and stop is not None and not start <= int(layer.group(1)) < stop:
                continue
            out.append(n)
        return out

    def _read_alone(self, pointer: Mapping[str, Any], folder: str) -> dict[str, Any]:
        """Every file of the pointer's step, read by this process alone (not collective)."""
        step = int(pointer["step"])
        fastest, *slower = step_tiers(step, pointer["root"], memory=self.options.get("memory"))
        source = pointer.get("remote") if not os.path.isdir(pointer["root"]) and pointer.get("remote") else None
        if slower:  # the memory tier comes before the local one: a step not persisted, its restore reads memory too
            source = fastest.url
        step_state = load(source or pointer["root"], step, allow_pickle=False)
        step_state.pop(META, None)
        return {os.path.join(folder, name): value for name, value in step_state.items()}

    def unpack(self, value: Any, *, where: str) -> Any:
        return unpack(value, allow_pickle=self.allow_pickle, safe_globals=self.safe_globals, where=where)
