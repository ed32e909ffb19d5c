"""Megatron's save and load strategies for tiercheck: thin adapters that hand Megatron's calls to the backend.

Which classes they subclass depends on the release (see ``compat``): on megatron-core 0.16 the registry's
``AsyncSaveShardedStrategy`` / ``LoadShardedStrategy``, registered as backend ``("tiercheck", 1)`` by
``install()``; on 0.17+ the ``TorchDist*`` strategies, which ``dist_checkpointing.save`` keeps and whose load
strategy still loads ``torch_dist`` checkpoints (those without ``tiercheck.json``) as Megatron's own does. The
tensors' and objects' metadata come from ``tiercheck.json`` alone, without reading the step.
"""


from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

import torch

from tiercheck.integrations.megatron import compat
from tiercheck.integrations.megatron.compat import (
    HAS_STRATEGY_REGISTRY,
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    is_main_replica,
)
from tiercheck.integrations.megatron.files import (
    BACKEND,
    COMMON_STATE,
    POINTER_FILE,
    VERSION,
    encode_common_state,
    read_pointer,
    write_common_state,
)
from tiercheck.integrations.megatron.layout import KeyLayout
from tiercheck.seam import torch_dtype

__all__ = ["TiercheckLoadStrategy", "TiercheckSaveStrategy"]


class Backend(Protocol):
    """What the strategies hand Megatron's calls to: ``backend.TiercheckBackend``, which makes them
    (named by this protocol, so that this module does not import the backend that imports it)."""

    def async_save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str]) -> Any: ...

    def load(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]: ...


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

    class TiercheckSaveStrategy(compat.strategy_registry.AsyncSaveShardedStrategy):  # type: ignore[misc]
        """Megatron's save strategy for the ``"tiercheck"`` backend (sync ``save`` and ``async_save``)."""

        def __init__(self, backend: Backend) -> None:
            super().__init__(BACKEND, VERSION)  # Megatron's `backend` attribute: the name metadata.json records
            self.tiercheck = backend

        @property
        def can_handle_sharded_objects(self) -> bool:
            return True

        def async_save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str]) -> Any:
            return self.tiercheck.async_save(sharded_state_dict, checkpoint_dir)

    class TiercheckLoadStrategy(compat.strategy_registry.LoadShardedStrategy):  # type: ignore[misc]
        """Megatron's load strategy for checkpoints whose ``metadata.json`` names the ``"tiercheck"`` backend."""

        def __init__(self, backend: Backend) -> None:
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

    class TiercheckSaveStrategy(compat.TorchDistSaveShardedStrategy):  # type: ignore[no-redef,misc]
        """A ``TorchDistSaveShardedStrategy`` (what ``dist_checkpointing.save`` keeps) saving through tiercheck.

        Megatron's ``async_strategy`` ("nvrx" or "mcore") is not used: tiercheck writes in its own background
        threads, and the returned request (megatron-core's ``AsyncRequest``) only waits for the commit."""

        def __init__(self, backend: Backend) -> None:
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

    class TiercheckLoadStrategy(compat.TorchDistLoadShardedStrategy):  # type: ignore[no-redef,misc]
        """A ``TorchDistLoadShardedStrategy`` loading checkpoints saved through tiercheck (``tiercheck.json``
        in the directory) from tiercheck's tiers, and any other through Megatron's own ``torch_dist`` code,
        so that it can stand in wherever the training loop makes a ``TorchDistLoadShardedStrategy``."""

        def __init__(self, backend: Backend) -> None:
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
