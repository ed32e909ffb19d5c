"""What the Megatron plugin takes from megatron-core: imported once, here, without megatron-core's import noise.

``HAS_STRATEGY_REGISTRY`` tells the releases apart by what the installed megatron-core has, not by its
version string: 0.16 has a strategy registry (``strategy_registry``, its ``strategies.base`` module), 0.17 and
later have none and export ``TorchDistSaveShardedStrategy`` / ``TorchDistLoadShardedStrategy`` instead (then
``strategy_registry`` is None). A megatron-core lacking any of these is refused here, with what it lacks.
"""


from __future__ import annotations

import warnings

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
            from megatron.core.dist_checkpointing.strategies import base as strategy_registry

            HAS_STRATEGY_REGISTRY = hasattr(strategy_registry, "register_default_strategy")
        except ImportError:
            HAS_STRATEGY_REGISTRY = False
        if not HAS_STRATEGY_REGISTRY:  # 0.17+: subclasses of the torch_dist strategies are the seam
            strategy_registry = None  # type: ignore[assignment]
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
    "HAS_STRATEGY_REGISTRY",
    "MEGATRON_CORE_VERSION",
    "AsyncRequest",
    "CheckpointingException",
    "ShardedObject",
    "ShardedTensor",
    "TorchDistLoadShardedStrategy",
    "TorchDistSaveShardedStrategy",
    "dict_list_map_outplace",
    "is_main_replica",
    "nested_values",
    "strategy_registry",
]
