"""Megatron-core ``dist_checkpointing`` through tiercheck's tiers.

``install()`` makes a save and a load strategy (the same lines on every supported release):

    backend = tiercheck.integrations.megatron.install(local="/nvme/ckpt/run1", remote="s3://bucket/run1")
    dist_checkpointing.save(sharded_state_dict, "ckpts/iter_0000100", sharded_strategy=backend.save_strategy)
    state = dist_checkpointing.load(sharded_state_dict, "ckpts/iter_0000100", sharded_strategy=backend.load_strategy)

The ``ShardedTensor`` / ``ShardedObject`` part of the state becomes one tiercheck step, loadable into any
TP / PP / DP layout. Megatron keeps its own files in the checkpoint directory (``metadata.json``, the
common state); ``tiercheck.json`` there names the tiercheck root and step holding the data.

The mapping (``layouts_of``, ``merge_layouts``, ``shard_pieces`` in ``layout``: plain functions):

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
  Megatron's own writer writes it (see ``files``), where ``load_common_state_dict`` reads it.

Modules: ``backend`` (:class:`TiercheckBackend`), ``strategies`` (Megatron's strategy classes), ``installer``
(:func:`install`), ``layout`` (the mapping), ``files`` (``tiercheck.json``, the common state, the commit wait),
``compat`` (what is imported from megatron-core, and which release it is).
"""


from __future__ import annotations

from tiercheck.integrations.megatron.backend import TiercheckBackend
from tiercheck.integrations.megatron.compat import HAS_STRATEGY_REGISTRY, MEGATRON_CORE_VERSION
from tiercheck.integrations.megatron.files import BACKEND, POINTER_FILE, VERSION, read_pointer
from tiercheck.integrations.megatron.installer import install, installed
from tiercheck.integrations.megatron.layout import KeyLayout, layouts_of, merge_layouts, shard_pieces
from tiercheck.integrations.megatron.strategies import TiercheckLoadStrategy, TiercheckSaveStrategy

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
