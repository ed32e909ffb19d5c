"""Lightning's ``CheckpointIO`` over tiercheck's tiers: ``Trainer(plugins=[TiercheckCheckpointIO(local=...)])``.

Lightning's calls, and which ranks make them (its ``Strategy``): ``save_checkpoint`` and ``remove_checkpoint``
on global rank 0 only; ``load_checkpoint`` on every rank; ``teardown`` on every rank at the end of ``fit`` /
``validate`` / ``test``. So the tiercheck ``Checkpointer`` lives on global rank 0 and checkpoints alone
(``DistributedOptions(enabled=False)``); the other ranks read the step without one (``tiercheck.load``).
With ``memory=MemoryOptions(...)`` a step may be on rank 0's node's memory tier only (``persist_every``): every
lookup of a step (the pointer's save, the other ranks' read) tries the memory tier first, as a restore does.
"""


from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tiercheck import Checkpointer, load
from tiercheck.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedValueError
from tiercheck.integrations.dcp.shared import CHECKPOINTER_OPTIONS
from tiercheck.integrations.lightning import pointer
from tiercheck.integrations.lightning.compat import CheckpointIO, global_rank, lightning_load
from tiercheck.options import DistributedOptions, RetentionOptions
from tiercheck.seam import Tier, decode, flatten, open_tier, read_index, restore_tree, step_tiers

__all__ = ["TiercheckCheckpointIO"]

log = logging.getLogger("tiercheck")

_OPTIONS = CHECKPOINTER_OPTIONS - {"process_group"}  # its Checkpointer is rank 0's alone
_STEP_IN_HEAD = re.compile(rb'"step":([0-9]+)')


class TiercheckCheckpointIO(CheckpointIO):
    """Lightning checkpoints as tiercheck steps: ``Trainer(plugins=[TiercheckCheckpointIO(local=..., remote=...)])``.

    Each save is step ``checkpoint["global_step"]``, staged into host memory before ``save_checkpoint`` returns
    and written, committed and drained in the background (no ``AsyncCheckpointIO`` needed). The path Lightning
    asked for gets a small JSON pointer (``pointer``) once the step is committed, so ``ModelCheckpoint``'s files,
    ``ckpt_path="last"`` and ``"best"`` work as before. A second save at the same global step (``last.ckpt``
    beside a top-k file) writes only its pointer: weights and optimizer state cannot change within a global step,
    and each pointer keeps its own plain values and small tensors.

    Retention is tiercheck's (``retention=RetentionOptions(...)``, default the last 3 steps), and a step a
    pointer in a directory this plugin wrote to still names is kept too: ``ModelCheckpoint(save_top_k=k)``'s
    deletions remove its pointer files, and the steps they named go once nothing names them, never the newest
    restorable one. ``teardown()`` (the end of ``fit``) waits for the saves and the drain to ``remote``.

    ``allow_pickle``: store values with no safe encoding (objects in ``hyper_parameters``) with pickle, and read
    them back; without it such a save raises ``UnsupportedValueError`` naming the value. A file that is not a
    pointer (a ``.ckpt`` of Lightning's own) is loaded with ``torch.load(weights_only=True)`` unless
    ``allow_pickle``. Other keyword options (``remote_options``, ``staging``, ``write``, ``retention``,
    ``drain``, ``distributed``, ``replication``, ``memory``) go to the ``Checkpointer``. With ``memory``, each save
    commits to rank 0's memory tier and the steps its ``persist_every`` names go to ``local`` too; the pointer
    follows the commit to memory, and a step in memory only is read by the ranks on rank 0's node (the others
    read ``local`` and ``remote``: on several nodes, name every step a pointer keeps with ``persist_every``).
    """

    def __init__(
        self,
        local: str | os.PathLike[str],
        remote: str | None = None,
        *,
        allow_pickle: bool = False,
        **checkpointer_options: Any,
    ) -> None:
        unknown = sorted(set(checkpointer_options) - _OPTIONS)
        if unknown:
            known = ", ".join(sorted(_OPTIONS))
            raise TypeError(f"unknown Checkpointer option(s) {', '.join(unknown)}; known: {known}")
        self.local = Path(local).absolute()
        self.remote = remote
        self.allow_pickle = allow_pickle
        self.options = checkpointer_options
        self._ckpt: Checkpointer | None = None
        self._state: dict[str, Any] = {}  # what the Checkpointer saves / restores: filled for one call, then emptied
        self._lock = threading.Lock()
        self._saved: dict[int, tuple[Any, dict[str, Any], str]] = {}  # step -> (handle, its big tensors, first path)
        self._issued: dict[str, int] = {}  # path -> the save whose pointer it waits for (a removal cancels it)
        self._serial = 0
        self._dirs: set[Path] = set()  # where pointers were written: the steps they name are kept
        self._writing = threading.Condition()
        self._pending = 0  # pointers still to be written
        self._error: BaseException | None = None

    # -- Lightning's calls

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Global rank 0: stage ``checkpoint`` as step ``global_step``; the pointer at ``path`` follows its commit."""
        if storage_options is not None:
            raise TypeError(f"TiercheckCheckpointIO takes no storage_options (got {storage_options!r})")
        self._raise_background_error()
        step = checkpoint.get("global_step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"{path}: the checkpoint's global_step {step!r} is no step number")
        try:
            tree, leaves = flatten(checkpoint, allow_pickle=self.allow_pickle)
        except UnsupportedValueError as e:
            raise UnsupportedValueError(
                f"{path}: {e}; tiercheck stores plain values and tensors without pickle. Pass "
                "TiercheckCheckpointIO(allow_pickle=True) to store the others with pickle (and to load them back)"
            ) from e
        small = pointer.encode_small(leaves)
        big = {leaf.path: [list(leaf.global_shape), str(leaf.tensor.dtype)] for leaf in leaves}
        big = {p: sig for p, sig in big.items() if p not in small}
        doc = {"step": step, "save_id": None, "local": str(self.local), "remote": self.remote, "tree": tree,
               "small": small}  # fmt: skip
        key = str(Path(path).absolute())
        with self._lock:
            handle = self._save_once(step, checkpoint, big, key)
            self._serial += 1
            self._issued[key] = serial = self._serial
            self._dirs.add(Path(key).parent)
        with self._writing:
            self._pending += 1
        handle.committed.add_done_callback(lambda f: self._committed(f, key, serial, doc))

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Every rank: the checkpoint ``path`` points to (its step's tensors, its own values)."""
        if not pointer.is_pointer(path):
            if not Path(path).exists():
                raise CheckpointNotFoundError(f"{path}: no such checkpoint")
            return lightning_load(path, map_location, weights_only=weights_only if self.allow_pickle else True)
        doc = pointer.read(path)
        step = doc["step"]
        self._dirs.add(Path(path).absolute().parent)  # its directory's pointers keep their steps from now on
        self._check_save(path, step, doc["save_id"])  # before a byte is read
        saved = self._restore(step)
        self._check_save(path, step, doc["save_id"])  # and the step was not saved again meanwhile
        _, leaves = flatten(saved, allow_pickle=self.allow_pickle)
        by_path = {leaf.path: leaf.tensor for leaf in leaves}
        small = doc["small"]

        def source(tag: str, array: str, live: Any) -> Any:
            if array in small:
                t = pointer.decode_small(small[array], f"{path}: {array}")
            elif array in by_path:
                t = by_path[array]
            else:
                raise CorruptCheckpointError(f"{path}: {array} is neither in the pointer nor in step {step}")
            return t.numpy() if tag == "$ndarray" else t

        out = decode(doc["tree"], source, allow_pickle=self.allow_pickle, where=str(path))
        if isinstance(out, dict) and out.get("global_step", step) != step:
            raise CorruptCheckpointError(f"{path}: the pointer names step {step}, its values global_step "
                                         f"{str(out.get('global_step'))[:40]}")  # fmt: skip
        return out

    def remove_checkpoint(self, path: Any) -> None:
        """Global rank 0: remove the file (a pointer not written yet is not written); the step is left to
        tiercheck's retention, which deletes it once no pointer names it."""
        p = Path(path).absolute()
        with self._lock:
            self._issued.pop(str(p), None)
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.is_dir():
            shutil.rmtree(p)

    def wait(self) -> None:
        """Block until every save so far is committed and its pointer written; raise a failure among them."""
        with self._lock:
            ckpt = self._ckpt
        try:
            if ckpt is not None:
                ckpt.wait()
        finally:
            with self._writing:
                self._writing.wait_for(lambda: self._pending == 0)
        self._raise_background_error()

    def teardown(self) -> None:
        """Every rank, at the end of fit / validate / test: wait for the saves, their pointers and the drain."""
        with self._lock:
            ckpt, self._ckpt = self._ckpt, None
        if ckpt is not None:
            try:
                ckpt.wait()
            finally:
                with self._writing:
                    self._writing.wait_for(lambda: self._pending == 0)
                undrained = ckpt.close(drain=True)
            if undrained:
                log.warning("Lightning teardown: steps %s are not drained to %s yet (the next run drains them)",
                            undrained, self.remote)  # fmt: skip
        self._raise_background_error()

    # -- helpers

    def _checkpointer(self) -> Checkpointer:
        if self._ckpt is None:
            options = dict(self.options)
            distributed = options.pop("distributed", None) or DistributedOptions()
            options["distributed"] = dataclasses.replace(distributed, enabled=False)
            retention = options.pop("retention", None) or RetentionOptions()
            options["retention"] = dataclasses.replace(retention, keep=self._named_steps)  # a pointer names them
            ckpt = Checkpointer(self._state, local=self.local, remote=self.remote, allow_pickle=self.allow_pickle,
                                **options)  # fmt: skip
            self._ckpt = ckpt
        return self._ckpt

    def _save_once(self, step: int, checkpoint: dict[str, Any], big: dict[str, Any], path: str) -> Any:
        """The handle of step ``step``: saved now, or by this run's earlier save at the same global step."""
        if step in self._saved:
            handle, first, first_path = self._saved[step]
            lacking = sorted(p for p, sig in big.items() if first.get(p) != sig)
            if not lacking:
                return handle
            raise UnsupportedValueError(
                f"{path}: global step {step} was saved already (as {first_path}) without {len(lacking)} of the "
                f"tensors this save holds ({', '.join(lacking[:3])}...); tensors cannot be added to a saved step"
            )
        ckpt = self._checkpointer()
        self._state.update(checkpoint)
        try:
            handle = ckpt.save(step)
        finally:
            self._state.clear()  # the host copy is taken: hold no references to Lightning's tensors
        self._saved[step] = (handle, big, path)
        return handle

    def _committed(self, f: Future[Any], path: str, serial: int, doc: dict[str, Any]) -> None:
        """On tiercheck's commit thread: the step is committed; write the pointer naming its save, unless the
        pointer was removed since."""
        try:
            error = f.exception()
            if error is not None:
                self._error = self._error or error
                return
            with self._lock:
                wanted = self._issued.get(path) == serial
            if wanted:  # committed on the local tier, or (with memory, a step not persisted) in memory
                marker, _, _ = read_index(self._tiers(doc["step"], remote=False)[0], doc["step"])
                pointer.write(path, {**doc, "save_id": marker.save_id})
        except BaseException as e:  # an unwritable directory: surfaced at the next save or teardown
            self._error = self._error or e
        finally:
            with self._writing:
                self._pending -= 1
                self._writing.notify_all()

    def _restore(self, step: int) -> dict[str, Any]:
        """Step ``step`` as a nested dict: rank 0 through its Checkpointer (the run continues the step's
        lineage), the other ranks read-only from the local tier, else the remote."""
        if global_rank() != 0:
            try:  # memory where it holds the step (rank 0's node: what its restore reads too), else local
                return load(self._tiers(step, remote=False)[0].url, step, allow_pickle=self.allow_pickle)
            except (CheckpointNotFoundError, FileNotFoundError):
                if self.remote is None:
                    raise
                opts = self.options.get("remote_options")
                return load(self.remote, step, allow_pickle=self.allow_pickle, storage_options=opts)
        with self._lock:
            ckpt = self._checkpointer()
            self._saved.clear()  # later saves continue the restored trajectory: new saves, at any step
            try:
                restore_tree(ckpt, step, strict=False, others=True)
                return dict(self._state)
            finally:
                self._state.clear()

    def _check_save(self, path: Any, step: int, save: str) -> None:
        """Refuse pointer ``path`` unless step ``step`` holds its save ``save`` where a restore reads it first
        (``_tiers``: memory, local, remote): a step saved again after a rollback, or a pointer whose ``step`` was
        edited, would give another save's tensors with this pointer's values."""
        for tier in self._tiers(step):
            try:
                marker, _, _ = read_index(tier, step)
            except (CheckpointNotFoundError, CorruptCheckpointError, FileNotFoundError):
                continue  # not there whole: the restore reads the next tier, or says why it cannot
            if marker.save_id != save:
                raise CorruptCheckpointError(
                    f"{path}: points at save {save} of step {step}, but {tier.url} holds save {marker.save_id} of "
                    "it (the step was saved again after a rollback, or the pointer was edited); not loaded"
                )
            return

    def _tiers(self, step: int, *, remote: bool = True) -> list[Tier]:
        """Where a restore of ``step`` looks, first to last: the memory tier where it holds the step (with
        ``memory``), the local tier, the remote."""
        remote_tier = None
        if remote and self.remote is not None:
            remote_tier = open_tier(self.remote, storage_options=self.options.get("remote_options"))
        return step_tiers(step, self.local, memory=self.options.get("memory"), remote=remote_tier)

    def _named_steps(self) -> set[int]:
        """Steps the pointer files in this plugin's directories name (read from each file's first bytes)."""
        out: set[int] = set()
        for d in list(self._dirs):
            try:
                files = [p for p in d.iterdir() if p.is_file()]
            except OSError:
                continue
            for p in files:
                try:
                    with open(p, "rb") as fh:
                        head = fh.read(96)
                except OSError:
                    continue
                m = _STEP_IN_HEAD.search(head)
                if m and head.startswith(b'{"format":"' + pointer.FORMAT.encode()):
                    out.add(int(m.group(1)))
        return out

    def _raise_background_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error
