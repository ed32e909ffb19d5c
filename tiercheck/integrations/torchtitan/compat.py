"""What the torchtitan plugin takes from torchtitan: imported once, here, and checked for what it needs.

Feature-detected, not read from a version string: the plugin subclasses torchtitan's DCP ``CheckpointManager``
(``torchtitan.components.checkpointer.dcp``, torchtitan 0.3) and overrides its DCP seam (``dcp_save``,
``dcp_load``), its step discovery (``_find_load_step``, ``_load``) and its purge (``_purge_stale_checkpoints``).
A torchtitan lacking any of them (0.2 and before: a ``CheckpointManager`` built from ``JobConfig``, no nested
``Config``) is refused here, naming what it lacks.
"""


from __future__ import annotations

import importlib.metadata
import inspect

_SUPPORTED = "torchtitan 0.3"
try:
    from torchtitan.components.checkpointer.base import MODEL
    from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager
    from torchtitan.tools import filesystem
    from torchtitan.tools.utils import GarbageCollection
except ImportError as _e:
    raise ImportError(f"tiercheck.integrations.torchtitan needs {_SUPPORTED} (pip install torchtitan): {_e}") from _e

try:
    TORCHTITAN_VERSION = importlib.metadata.version("torchtitan")
except importlib.metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH
    TORCHTITAN_VERSION = "unknown"

_NEEDED = {
    "dcp_save": ("state_dict", "checkpoint_id", "async_mode", "enable_garbage_collection", "to_hf"),
    "dcp_load": ("state_dict", "checkpoint_id", "from_hf", "from_quantized"),
    "_load": ("step",),
    "_find_load_step": ("folder",),
    "_create_checkpoint_id": ("step", "folder"),
    "_states_to_load": ("model_only",),
    "_purge_stale_checkpoints": (),
    "_close": (),
}


def _lacking() -> list[str]:
    out = [] if hasattr(CheckpointManager, "Config") else ["CheckpointManager.Config"]
    for name, params in _NEEDED.items():
        fn = getattr(CheckpointManager, name, None)
        if fn is None:
            out.append(f"CheckpointManager.{name}")
            continue
        have = inspect.signature(fn).parameters
        out.extend(f"CheckpointManager.{name}({p}=...)" for p in params if p not in have)
    return out


if _lacking():
    raise ImportError(
        f"tiercheck.integrations.torchtitan supports {_SUPPORTED}; torchtitan {TORCHTITAN_VERSION} lacks "
        f"{', '.join(_lacking())}"
    )

__all__ = [
    "MODEL",
    "TORCHTITAN_VERSION",
    "AsyncMode",
    "CheckpointManager",
    "GarbageCollection",
    "filesystem",
]
