"""What the Lightning plugin takes from Lightning: imported once, here.

Lightning ships under two names: ``lightning`` (``lightning.pytorch``, ``lightning.fabric``) and the standalone
``pytorch_lightning`` / ``lightning_fabric``. A ``Trainer`` accepts only the ``CheckpointIO`` of its own package,
so the plugin subclasses the one installed, ``lightning`` first. Feature-detected: the ``CheckpointIO`` interface
(``save_checkpoint``, ``load_checkpoint``, ``remove_checkpoint``, ``teardown``) and ``rank_zero_only.rank``, as
in Lightning 2.x; tested with 2.6.
"""


from __future__ import annotations

import importlib.metadata

_SUPPORTED = "Lightning 2.x (lightning or pytorch-lightning)"
try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.utilities.cloud_io import _load as lightning_load
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    PACKAGE = "lightning"
except ImportError:
    try:
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO  # type: ignore[no-redef,assignment]
        from lightning_fabric.utilities.cloud_io import _load as lightning_load  # type: ignore[no-redef,assignment]
        from lightning_fabric.utilities.rank_zero import rank_zero_only  # type: ignore[no-redef,assignment]

        PACKAGE = "pytorch-lightning"
    except ImportError as _e:
        raise ImportError(
            f"tiercheck.integrations.lightning needs {_SUPPORTED} (pip install lightning): {_e}"
        ) from _e

LIGHTNING_VERSION = importlib.metadata.version(PACKAGE)
_METHODS = ("save_checkpoint", "load_checkpoint", "remove_checkpoint", "teardown")
_lacking = [m for m in _METHODS if not hasattr(CheckpointIO, m)]
if _lacking or not hasattr(rank_zero_only, "rank"):
    raise ImportError(
        f"tiercheck.integrations.lightning supports {_SUPPORTED}; {PACKAGE} {LIGHTNING_VERSION} lacks "
        f"{', '.join(f'CheckpointIO.{m}' for m in _lacking) or 'rank_zero_only.rank'}"
    )


def global_rank() -> int:
    """This process's global rank, as Lightning knows it (set by its strategy before any checkpoint call)."""
    return int(getattr(rank_zero_only, "rank", 0) or 0)


__all__ = ["LIGHTNING_VERSION", "PACKAGE", "CheckpointIO", "global_rank", "lightning_load"]
