"""The backend: Megatron sharded state dicts saved and loaded as tiercheck steps.

:class:`TiercheckBackend` is what ``install()`` makes; its strategies (``strategies``) hand it Megatron's calls.
A save (``async_save``, every rank together, on the training thread): the ranks agree on the step and the
merged layouts in one all-gather, the state goes to the root's Checkpointer (which stages it before returning
and commits in the background), and the returned ``AsyncRequest``'s finalize function writes
``tiercheck.json`` once the step is committed. A load (``load``, every rank together): the ranks learn in one
all-gather whether any failed to map its state, then one collective restore fills this rank's tensors.
"""


from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tiercheck import Checkpointer
from tiercheck.errors import (
    CorruptCheckpointError,
    IncompatibleStateError,
    InvalidArgumentError,
    TiercheckError,
    UnsupportedValueError,
)
from tiercheck.integrations._collectives import all_gather_object, raise_first
from tiercheck.integrations.megatron.compat import (
    MEGATRON_CORE_VERSION,
    AsyncRequest,
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    dict_list_map_outplace,
    is_main_replica,
    nested_values,
)
from tiercheck.integrations.megatron.files import POINTER_FORMAT, VERSION, AwaitCommit, read_pointer, write_pointer
from tiercheck.integrations.megatron.layout import KeyLayout, layouts_of, merge_layouts, tensor_state
from tiercheck.integrations.megatron.strategies import TiercheckLoadStrategy, TiercheckSaveStrategy
from tiercheck.seam import flatten, memory_steps, restore_tree
from tiercheck.version import __version__

__all__ = ["TiercheckBackend"]

_CHECKPOINTER_OPTIONS = frozenset(
    {
        "remote_options",
        "process_group",
        "staging",
        "write",
        "retention",
        "distributed",
        "drain",
        "replication",
        "memory",
        "allow_pickle",
    }
)
_ITERATION = re.compile(r"([0-9]+)$")


@dataclass
class _Root:
    ckpt: Checkpointer
    state: dict[str, Any]  # the mapping the Checkpointer saves: refilled before every save / restore
    one_shot: bool  # a Checkpointer for one checkpoint directory, closed after its save / load


class TiercheckBackend:
    """Saves and loads Megatron sharded state dicts as tiercheck steps; what ``install()`` registers.

    ``local``: this node's tiercheck root (every rank passes its own node's path). One Checkpointer per
    root is created on the first save or load (every rank together, as Megatron calls them) and reused,
    so its host staging memory and save plan carry over between saves. ``None``: the data goes into each
    checkpoint directory itself, with a Checkpointer per save (closed when the save is final).
    ``remote``: a URL the local steps drain to. Other keyword options go to every ``tiercheck.Checkpointer``.
    ``memory=MemoryOptions(...)`` (the memory tier) needs ``local``: it is the root's, whose Checkpointer lives
    on; a Checkpointer per checkpoint directory, closed after its save, would leave a memory tier on the tmpfs
    for each directory and restore from none. A load from another root (a checkpoint saved elsewhere) reads
    it without the memory tier.

    The tiercheck step of a save is the number ending the directory name (``iter_0000100`` -> 100) when that
    step is free and newer than every step of the root, else the next free number; ``tiercheck.json`` in the
    checkpoint directory records it.
    """

    def __init__(
        self, *, local: str | os.PathLike[str] | None = None, remote: str | None = None, **checkpointer_options: Any
    ) -> None:
        unknown = sorted(set(checkpointer_options) - _CHECKPOINTER_OPTIONS)
        if unknown:
            raise TypeError(
                f"unknown Checkpointer option(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(_CHECKPOINTER_OPTIONS))}"
            )
        if checkpointer_options.get("memory") is not None and local is None:
            raise InvalidArgumentError(
                "TiercheckBackend(memory=...) needs local=: without it each checkpoint directory gets a Checkpointer "
                "of its own, closed after its save, so a memory tier would be left on the tmpfs per directory and "
                "never restored from; give the node's tiercheck root as local="
            )
        self.local = None if local is None else Path(local).absolute()
        self.remote = remote
        self.options = checkpointer_options
        self.allow_pickle = bool(checkpointer_options.get("allow_pickle", False))
        self.group = checkpointer_options.get("process_group")
        self.save_strategy = TiercheckSaveStrategy(self)
        self.load_strategy = TiercheckLoadStrategy(self)
        self._roots: dict[tuple[str, str | None], _Root] = {}
        self._sent: str | None = None  # the description this rank last sent to the others
        self._described: list[dict[str, Any]] = []  # every rank's latest description

    # -- saving

    def async_save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str]) -> Any:
        """Start saving; returns Megatron's ``AsyncRequest`` (schedule it, or ``execute_sync()`` it).

        Returns once the state is copied to host memory; tiercheck writes and commits in the background.
        The request's ``async_fn`` waits for the commit; its finalize function (on the training thread)
        raises the save's error, if any, and writes ``tiercheck.json``.
        """
        try:
            tensors, objects = _sharded_values(sharded_state_dict)
            saved = {o.unique_key: o.data for o in objects if is_main_replica(o.replica_id)}
            flatten({"objects": saved}, allow_pickle=self.allow_pickle)  # an object that cannot be stored fails here
            mine: dict[str, Any] = {
                "tensors": {k: v.to_json() for k, v in layouts_of(tensors).items()},
                "objects": sorted(saved),
            }
            failure: BaseException | None = None
        except (TiercheckError, CheckpointingException) as e:  # told to the other ranks, then raised
            mine, failure = {}, e
        root = self._root(Path(checkpoint_dir).absolute() if self.local is None else self.local, self.remote)
        try:
            step, layouts, object_keys = self._agree(root.ckpt, Path(checkpoint_dir), mine, failure)
            tree, _, _ = tensor_state(tensors, layouts, loading=False, where=str(checkpoint_dir))
            root.state.clear()
            root.state.update(tensors=tree, objects=saved)
            description = {"tensors": {k: v.to_json() for k, v in layouts.items()}, "objects": object_keys}
            handle = root.ckpt.save(step, metadata={"megatron": {"checkpoint_dir": str(checkpoint_dir), **description}})
        except BaseException:
            if root.one_shot:
                root.ckpt.close()
            raise
        finally:
            root.state.clear()  # the host copy is taken: hold no references to the model's tensors
        pointer = {
            "format": POINTER_FORMAT,
            "version": VERSION,
            "step": step,
            "local": "." if root.one_shot else str(self.local),
            "remote": self.remote,
            "tiercheck": __version__,
            "megatron_core": MEGATRON_CORE_VERSION,
            **description,
        }
        waiter = AwaitCommit(handle)
        rank = dist.get_rank(self.group) if dist.is_initialized() else 0

        def finalize() -> None:
            try:
                handle.wait()
            finally:
                waiter.close()
                if root.one_shot:
                    root.ckpt.close()
            if rank == 0:
                write_pointer(Path(checkpoint_dir), pointer)

        return AsyncRequest(waiter, (), [finalize])

    def _agree(
        self, ckpt: Checkpointer, checkpoint_dir: Path, mine: dict[str, Any], failure: BaseException | None
    ) -> tuple[int, dict[str, KeyLayout], list[str]]:
        """Every rank's step proposal and (when changed) description, in one all-gather on the training
        thread: the step number, the merged tensor layouts and the saved objects' keys. A rank that could
        not describe its state says so here, and every rank raises."""
        local = ckpt.status()["local"]
        taken = set(local["committed"]) | set(local["inflight"])
        if self.local is not None:  # steps committed in memory only are taken too
            taken |= set(memory_steps(self.options.get("memory"), self.local)[1])
        m = _ITERATION.search(checkpoint_dir.name)
        wanted = int(m.group(1)) if m else None
        text = json.dumps(mine, sort_keys=True)
        proposal = {
            "wanted": wanted,
            "free": wanted is not None and wanted not in taken and wanted > max(taken, default=-1),
            "newest": max(taken, default=-1),
            "described": None if text == self._sent or failure is not None else mine,
            "error": None if failure is None else f"{type(failure).__name__}: {failure}",
        }
        everyone = all_gather_object(proposal, self.group, world_size=ckpt.world_size)
        raise_first(everyone, failure)
        self._sent = text
        if len(self._described) != len(everyone):
            self._described = [{} for _ in everyone]
        for r, p in enumerate(everyone):
            if p["described"] is not None:
                self._described[r] = p["described"]
        if wanted is not None and all(p["wanted"] == wanted and p["free"] for p in everyone):
            step = wanted
        else:
            step = max(p["newest"] for p in everyone) + 1
        where = f"saving {checkpoint_dir}"
        layouts = merge_layouts(
            {k: KeyLayout.from_json(v, where=where) for k, v in d.get("tensors", {}).items()} for d in self._described
        )
        objects = sorted({k for d in self._described for k in d.get("objects", [])})
        return step, layouts, objects

    # -- loading

    def load(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
        """Fill the state dict's ShardedTensors (in place where they have data) and ShardedObjects from the
        step ``tiercheck.json`` names; returns the same structure with tensors and values in their place."""
        try:
            pointer = read_pointer(checkpoint_dir)
            where = f"{checkpoint_dir} (tiercheck step {pointer['step']})"
            layouts = {k: KeyLayout.from_json(v, where=where) for k, v in pointer["tensors"].items()}
            tensors, objects = _sharded_values(sharded_state_dict)
            absent = sorted({o.unique_key for o in objects} - set(pointer["objects"]))
            if absent:
                raise IncompatibleStateError(f"{where}: the checkpoint has no object {', '.join(map(repr, absent))}")
            tree, data, twins = tensor_state(tensors, layouts, loading=True, where=where)
            failure: BaseException | None = None
        except (TiercheckError, CheckpointingException) as e:  # every rank learns it before a collective waits
            failure = e
        mine = {"error": None if failure is None else f"{type(failure).__name__}: {failure}"}
        raise_first(all_gather_object(mine, self.group), failure)
        # Data saved into the checkpoint directory stays there; else this node's root (or the saver's).
        local = Path(checkpoint_dir).absolute() if pointer["local"] == "." else self.local or Path(pointer["local"])
        root = self._root(local, self.remote if self.remote is not None else pointer["remote"])
        values: dict[str, Any] = {o.unique_key: None for o in objects}
        try:
            root.state.clear()
            root.state.update(tensors=tree, objects=values)
            # only what this rank's layout holds, though the world size is the saver's (TP2 -> PP2)
            restore_tree(root.ckpt, pointer["step"], allow_pickle=self.allow_pickle, extra=False)
        finally:
            root.state.clear()
            if root.one_shot:
                root.ckpt.close()
        lost = sorted(set(o.unique_key for o in objects) - set(values))
        if lost:
            raise CorruptCheckpointError(f"{where}: no saving rank stored object {', '.join(map(repr, lost))}")
        with torch.no_grad():
            for copy, original in twins:
                copy.copy_(original)

        def loaded(v: Any) -> Any:
            if isinstance(v, ShardedTensor):
                return data[id(v)]
            if isinstance(v, ShardedObject):
                return values[v.unique_key]
            return v

        return dict_list_map_outplace(loaded, sharded_state_dict)  # type: ignore[no-any-return]

    # -- Checkpointers

    def _root(self, local: Path, remote: str | None) -> _Root:
        """The Checkpointer for a local root (created by every rank together the first time)."""
        one_shot = self.local is None or local != self.local
        key = (str(local), remote)
        root = self._roots.get(key)
        if root is None:
            state: dict[str, Any] = {}
            # the memory tier is the long-lived root's alone (see the class docstring)
            options = {k: v for k, v in self.options.items() if not (one_shot and k == "memory")}
            ckpt = Checkpointer(state, local=local, remote=remote, **options)
            root = _Root(ckpt, state, one_shot)
            if not one_shot:
                self._roots[key] = root
        return root

    def close(self) -> None:
        """Wait for in-flight saves and drains of the reused Checkpointers, and close them."""
        roots, self._roots = list(self._roots.values()), {}
        for root in roots:
            root.ckpt.close()


def _sharded_values(sharded_state_dict: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    tensors: list[Any] = []
    objects: list[Any] = []
    for v in nested_values(sharded_state_dict):
        if isinstance(v, ShardedTensor):
            tensors.append(v)
        elif isinstance(v, ShardedObject):
            objects.append(v)
        else:
            raise UnsupportedValueError(
                f"tiercheck's Megatron strategy got a {type(v).__qualname__} among the sharded values; "
                "expected ShardedTensor or ShardedObject (factories are applied by dist_checkpointing.save/load)"
            )
    return tensors, objects
