"""What the DeepSpeed plugin takes from DeepSpeed, imported in one place (with the way to install it if absent).

``SAFE_GLOBALS`` are the types DeepSpeed puts in its files that torch's weights-only unpickler may rebuild (they
run no code of the file's). :func:`commit_info` makes DeepSpeed's ``CheckpointCommitInfo``, which only
DeepSpeed 0.17.1 and later have (and only they call for it).
"""


from __future__ import annotations

from typing import Any

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
except ImportError as e:  # pragma: no cover - exercised only without deepspeed
    raise ImportError(
        "tiercheck.integrations.deepspeed needs DeepSpeed: DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed"
    ) from e

__all__ = ["SAFE_GLOBALS", "CheckpointEngine", "DeepSpeedEngine", "commit_info"]

# Types DeepSpeed puts in its files, rebuilt by torch's weights-only unpickler (they run no code of the file's).
SAFE_GLOBALS: tuple[Any, ...] = (LossScaler, DynamicLossScaler, fragment_address, ZeroStageEnum)


def commit_info(tag: str, save_dir: str | None, *, save_latest: bool) -> Any:
    """DeepSpeed's ``CheckpointCommitInfo`` (0.17.1+) for a checkpoint of ``save_dir``."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    return CheckpointCommitInfo(tag=tag, save_dir=save_dir or "", save_latest=save_latest)
