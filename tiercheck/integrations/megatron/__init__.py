"""Megatron-core ``dist_checkpointing`` through tiercheck's tiers.

``install()`` makes a save and a load strategy (the same lines on every supported release):

    backend = tiercheck.integrations.megatron.install(local="/nvme/ckpt/run1", remote="s3://bucket/run1")
    dist_checkpointing.save(sharded_state_dict, "ckpts/iter_0000100", sharded_strategy=backend.save_strategy)
    state = dist_checkpointing.load(sharded_state_dict, "ckpts/iter_0000100", sharded_strategy=backend.load_strategy)

The ``ShardedTensor`` / ``ShardedObject`` part of the state becomes one tiercheck step, loadable into any
TP / PP / DP layout. Megatron keeps its own files in the checkpoint directory (``metadata.json``, the
common state); ``tiercheck.json`` there names the tiercheck root and step holding the data.

The mapping (``layouts_of``, ``merge_layouts``, ``shard_pieces`` in ``megatron_layout``: plain functions):

- A ShardedTensor's global shape and offset make it a ``tiercheck.Shard``: a box of a global tensor.
  Replicas (``replica_id``) hold the same box; each chunk is written once, the writing spread over them
  (as Megatron's fully-parallel save assumes, replicas hold equal values).
- Prepended axes (stacked layers, experts) become one array per index, so a rank may hold any number of
  layers of a key and another PP layout still finds them. Several pieces of one key in one layer on one
  rank (Megatron's SwiGLU gate / up split) become one array per equal part of the axis they lie on.
- ``flattened_range`` pieces (the legacy distributed-optimizer formats) are no box and are refused.
- A ShardedObject is stored once per ``unique_key`` (by its main replica) as tagged JSON, tensors and numpy
  arrays as arrays; values needing pickle only with ``allow_pickle=True``, for saving and for loading.

Releases (picked by what the installed megatron-core has, not by its version string):

- 0.16 (Python 3.10+): ``install()`` registers the strategies as backend ``("tiercheck", 1)``; save with
  ``sharded_strategy=("tiercheck", 1)``, and ``dist_checkpointing.load`` picks tiercheck from ``metadata.json``.
- 0.17 to 0.19 (0.19 needs Python 3.12+): there is no registry, and ``save`` replaces any strategy that is not
  a ``TorchDistSaveShardedStrategy``; tiercheck's strategies subclass Megatron's ``TorchDist*`` ones. Pass
  ``backend.save_strategy`` to ``save`` and ``backend.load_strategy`` to ``load`` (it loads ``torch_dist``
  checkpoints too, as Megatron's own would, so it can stand in for ``TorchDistLoadShardedStrategy``). From
  0.19 the common state reaches the strategy as ``ShardedObject("common_state")``; it is written as
  Megatron's own writer writes it (see ``megatron_files``), where ``load_common_state_dict`` reads it.
"""


from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tiercheck.checkpointer import Checkpointer
from tiercheck.errors import (
    CoordinationError,
    CorruptCheckpointError,
    IncompatibleStateError,
    TiercheckError,
    UnsupportedValueError,
)
from tiercheck.integrations.megatron.files import (
    BACKEND,
    COMMON_STATE,
    POINTER_FILE,
    POINTER_FORMAT,
    VERSION,
    AwaitCommit,
    encode_common_state,
    read_pointer,
    write_common_state,
    write_pointer,
)
from tiercheck.integrations.megatron.layout import KeyLayout, layouts_of, merge_layouts, shard_pieces, tensor_state
from tiercheck.state.flatten import flatten, torch_dtype
from tiercheck.version import __version__

_SUPPORTED = "megatron-core 0.16 to 0.19"
with warnings.catch_warnings():
    # Noise of megatron-core's own import: deprecated torch.jit APIs, no Transformer Engine / Apex / absl.
    warnings.simplefilter("ignore", DeprecationWarning)
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    warnings.filterwarnings("ignore", message="absl.logging is not installed")
    try:
        from megatron.core.package_info import __version__ as MEGATRON_CORE_VERSION
    except ImportError as _e:  # psutil is a dependency megatron-core does not declare
        raise ImportError(
            f"tiercheck.integrations.megatron needs {_SUPPORTED} (pip install megatron-core psutil): {_e}"
        ) from _e
    try:
        from megatron.core.dist_checkpointing.core import CheckpointingException
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace, nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

        try:  # 0.16: a strategy registry (strategies/base.py is gone from 0.19, its registry from 0.17)
            from megatron.core.dist_checkpointing.strategies import base as _registry

            HAS_STRATEGY_REGISTRY = hasattr(_registry, "register_default_strategy")
        except ImportError:
            HAS_STRATEGY_REGISTRY = False
        if not HAS_STRATEGY_REGISTRY:  # 0.17+: subclasses of the torch_dist strategies are the seam
            from megatron.core.dist_checkpointing.strategies.torch import (
                TorchDistLoadShardedStrategy,
                TorchDistSaveShardedStrategy,
            )
    except ImportError as _e:
        raise ImportError(
            f"tiercheck.integrations.megatron supports {_SUPPORTED}; megatron-core {MEGATRON_CORE_VERSION} "
            f"lacks what it needs: {_e}"
        ) from _e

__all__ = [
    "BACKEND",
    "HAS_STRATEGY_REGISTRY",
    "MEGATRON_CORE_VERSION",
    "POINTER_FILE",
    "VERSION",
    "KeyLayout",
    "TiercheckBackend",
    "TiercheckLoadStrategy",
    "TiercheckSaveStrategy",
    "install",
    "installed",
    "layouts_of",
    "merge_layouts",
    "read_pointer",
    "shard_pieces",
]

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
        "allow_pickle",
    }
)
_ITERATION = re.compile(r"(\d+)$")


# ------------------------------------------------------------------------------- the backend


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
        everyone = _all_gather(proposal, ckpt.world_size, self.group)
        _raise_first(everyone, failure)
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
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
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
        _raise_first(_all_gather(mine, world, self.group), failure)
        # Data saved into the checkpoint directory stays there; else this node's root (or the saver's).
        local = Path(checkpoint_dir).absolute() if pointer["local"] == "." else self.local or Path(pointer["local"])
        root = self._root(local, self.remote if self.remote is not None else pointer["remote"])
        values: dict[str, Any] = {o.unique_key: None for o in objects}
        try:
            root.state.clear()
            root.state.update(tensors=tree, objects=values)
            # only what this rank's layout holds, though the world size is the saver's (TP2 -> PP2)
            root.ckpt.restore(pointer["step"], allow_pickle=self.allow_pickle, extra=False)
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
            ckpt = Checkpointer(state, local=local, remote=remote, **self.options)
            root = _Root(ckpt, state, one_shot)
            if not one_shot:
                self._roots[key] = root
        return root

    def close(self) -> None:
        """Wait for in-flight saves and drains of the reused Checkpointers, and close them."""
        roots, self._roots = list(self._roots.values()), {}
        for root in roots:
            root.ckpt.close()


def _all_gather(obj: Any, world_size: int, group: Any) -> list[Any]:
    """Every rank's ``obj`` (a collective on the training thread, as Megatron's own save and load run)."""
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def _raise_first(everyone: list[Any], own: BaseException | None) -> None:
    if own is not None:
        raise own
    for rank, doc in enumerate(everyone):
        if doc.get("error"):
            raise CoordinationError(f"rank {rank} failed, so this rank stops too: {doc['error']}")


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


# ------------------------------------------------------------------------------- strategies


def _tensors_metadata(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Every saved tensor as a ShardedTensor without data or sharding (global shape and dtype)."""
    out = {}
    for key, doc in read_pointer(checkpoint_dir)["tensors"].items():
        lay = KeyLayout.from_json(doc, where=str(checkpoint_dir))
        meta = torch.empty(lay.shape, dtype=torch_dtype(lay.dtype), device="meta")
        out[key] = ShardedTensor.from_rank_offsets(key, meta).without_data()
    return out


def _sharded_metadata(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
    out = {k: ShardedObject.empty_from_unique_key(k) for k in read_pointer(checkpoint_dir)["objects"]}
    out.update(_tensors_metadata(checkpoint_dir))
    return out


def _saved_through_tiercheck(checkpoint_dir: str | os.PathLike[str]) -> bool:
    return (Path(checkpoint_dir) / POINTER_FILE).exists()


if HAS_STRATEGY_REGISTRY:  # megatron-core 0.16

    class TiercheckSaveStrategy(_registry.AsyncSaveShardedStrategy):  # type: ignore[misc]
        """Megatron's save strategy for the ``"tiercheck"`` backend (sync ``save`` and ``async_save``)."""

        def __init__(self, backend: TiercheckBackend) -> None:
            super().__init__(BACKEND, VERSION)  # Megatron's `backend` attribute: the name metadata.json records
            self.tiercheck = backend

        @property
        def can_handle_sharded_objects(self) -> bool:
            return True

        def async_save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str]) -> Any:
            return self.tiercheck.async_save(sharded_state_dict, checkpoint_dir)

    class TiercheckLoadStrategy(_registry.LoadShardedStrategy):  # type: ignore[misc]
        """Megatron's load strategy for checkpoints whose ``metadata.json`` names the ``"tiercheck"`` backend."""

        def __init__(self, backend: TiercheckBackend) -> None:
            self.tiercheck = backend

        @property
        def can_handle_sharded_objects(self) -> bool:
            return True

        def load(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
            return self.tiercheck.load(sharded_state_dict, checkpoint_dir)

        def load_tensors_metadata(self, checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
            return _tensors_metadata(checkpoint_dir)

        def load_sharded_metadata(self, checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
            return _sharded_metadata(checkpoint_dir)

        def check_backend_compatibility(self, loaded_backend: str) -> None:
            if loaded_backend != BACKEND:
                raise CheckpointingException(f"the tiercheck load strategy cannot load a {loaded_backend!r} checkpoint")

        def check_version_compatibility(self, loaded_version: int) -> None:
            if loaded_version != VERSION:
                raise CheckpointingException(
                    f"tiercheck checkpoint format version {loaded_version}; this reads {VERSION}"
                )

else:  # megatron-core 0.17+

    class TiercheckSaveStrategy(TorchDistSaveShardedStrategy):  # type: ignore[no-redef,misc]
        """A ``TorchDistSaveShardedStrategy`` (what ``dist_checkpointing.save`` keeps) saving through tiercheck.

        Megatron's ``async_strategy`` ("nvrx" or "mcore") is not used: tiercheck writes in its own background
        threads, and the returned request (megatron-core's ``AsyncRequest``) only waits for the commit."""

        def __init__(self, backend: TiercheckBackend) -> None:
            super().__init__(BACKEND, VERSION)  # `backend`: the name metadata.json records
            self.tiercheck = backend

        def save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str]) -> None:
            self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()

        def async_save(
            self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str], async_strategy: str = ""
        ) -> Any:
            common = sharded_state_dict.get(COMMON_STATE)
            payload: tuple[str, bytes] | None = None
            if isinstance(common, ShardedObject) and common.key == COMMON_STATE:  # 0.19+: Megatron's common state
                sharded_state_dict = {k: v for k, v in sharded_state_dict.items() if k != COMMON_STATE}
                if is_main_replica(common.replica_id):
                    payload = (common.unique_key, encode_common_state(common.data))
            request = self.tiercheck.async_save(sharded_state_dict, checkpoint_dir)
            if payload is not None:  # after tiercheck.json, before Megatron's metadata.json
                key, data = payload
                request.finalize_fns.append(lambda: write_common_state(Path(checkpoint_dir), key, data))
            return request

    class TiercheckLoadStrategy(TorchDistLoadShardedStrategy):  # type: ignore[no-redef,misc]
        """A ``TorchDistLoadShardedStrategy`` loading checkpoints saved through tiercheck (``tiercheck.json``
        in the directory) from tiercheck's tiers, and any other through Megatron's own ``torch_dist`` code,
        so that it can stand in wherever the training loop makes a ``TorchDistLoadShardedStrategy``."""

        def __init__(self, backend: TiercheckBackend) -> None:
            super().__init__()
            self.tiercheck = backend

        def load(
            self,
            sharded_state_dict: dict[str, Any],
            checkpoint_dir: str | os.PathLike[str],
            async_strategy: str = "mcore",
        ) -> dict[str, Any]:
            if not _saved_through_tiercheck(checkpoint_dir):
                return super().load(sharded_state_dict, checkpoint_dir, async_strategy)  # type: ignore[no-any-return]
            return self.tiercheck.load(sharded_state_dict, checkpoint_dir)

        def load_tensors_metadata(self, checkpoint_dir: str | os.PathLike[str], metadata: Any = None) -> dict[str, Any]:
            if not _saved_through_tiercheck(checkpoint_dir):
                return super().load_tensors_metadata(checkpoint_dir, metadata)  # type: ignore[no-any-return]
            return _tensors_metadata(checkpoint_dir)

        def load_sharded_metadata(self, checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
            if not _saved_through_tiercheck(checkpoint_dir):
                return super().load_sharded_metadata(checkpoint_dir)  # type: ignore[no-any-return]
            return _sharded_metadata(checkpoint_dir)


# ------------------------------------------------------------------------------- install


_installed: TiercheckBackend | None = None


def install(
    local: str | os.PathLike[str] | None = None, remote: str | None = None, **checkpointer_options: Any
) -> TiercheckBackend:
    """Make tiercheck's save and load strategies; call it on every rank, before the first save or load.

    megatron-core 0.16: also registers them as backend ``("tiercheck", 1)``; save with
    ``dist_checkpointing.save(..., sharded_strategy=("tiercheck", 1))`` (or ``backend.save_strategy``), and
    ``dist_checkpointing.load`` picks tiercheck from the checkpoint's ``metadata.json``. 0.17+ has no registry:
    pass ``backend.save_strategy`` to ``save`` and ``backend.load_strategy`` to ``load``.

    Calling it again replaces the previous backend and closes its Checkpointers. Close the returned backend at
    the end of training (it waits for in-flight saves and drains).
    """
    global _installed
    backend = TiercheckBackend(local=local, remote=remote, **checkpointer_options)
    if HAS_STRATEGY_REGISTRY:
        action = _registry.StrategyAction
        _registry.register_default_strategy(action.SAVE_SHARDED, BACKEND, VERSION, backend.save_strategy)
        _registry.register_default_strategy(action.LOAD_SHARDED, BACKEND, VERSION, backend.load_strategy)
    previous, _installed = _installed, backend
    if previous is not None:
        previous.close()
    return backend


def installed() -> TiercheckBackend:
    """The backend the last ``install()`` of this process made (for code far from where it was installed,
    such as Megatron-LM's loader)."""
    if _installed is None:
        raise TiercheckError("tiercheck's Megatron plugin is not installed: call install() on every rank first")
    return _installed
