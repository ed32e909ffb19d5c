"""tiercheck: hierarchical, asynchronous checkpointing for large-model training with PyTorch."""

from typing import TYPE_CHECKING, Any

from tiercheck import errors
from tiercheck.errors import (
    CheckpointNotFoundError,
    ClosedError,
    CoordinationError,
    CorruptCheckpointError,
    DirectoryInUseError,
    IncompatibleStateError,
    InvalidArgumentError,
    LineageError,
    MemoryTierError,
    NotADirectoryTierError,
    PartlyRestoredError,
    RemoteStorageError,
    StagingError,
    StateChangedError,
    StepExistsError,
    StorageError,
    TiercheckError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from tiercheck.options import (
    DistributedOptions,
    DrainOptions,
    MemoryOptions,
    ParityOptions,
    ReplicationOptions,
    RetentionOptions,
    RetryOptions,
    StagingOptions,
    WriteOptions,
)
from tiercheck.version import __version__

if TYPE_CHECKING:
    from tiercheck.checkpointer import Checkpointer
    from tiercheck.restore.load import load
    from tiercheck.rng import RNGState
    from tiercheck.save.handle import SaveHandle
    from tiercheck.state.sharding import Shard, per_rank

# What needs torch is imported on first use, so that `tiercheck --help`, `ls` and `inspect` start
# in a fraction of a second instead of the seconds `import torch` takes.
_LAZY = {
    "Checkpointer": "checkpointer",
    "load": "restore.load",
    "SaveHandle": "save.handle",
    "Shard": "state.sharding",
    "per_rank": "state.sharding",
    "RNGState": "rng",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointNotFoundError",
    "Checkpointer",
    "ClosedError",
    "CoordinationError",
    "CorruptCheckpointError",
    "DirectoryInUseError",
    "DistributedOptions",
    "DrainOptions",
    "IncompatibleStateError",
    "InvalidArgumentError",
    "LineageError",
    "MemoryOptions",
    "MemoryTierError",
    "NotADirectoryTierError",
    "ParityOptions",
    "PartlyRestoredError",
    "RNGState",
    "RemoteStorageError",
    "ReplicationOptions",
    "RetentionOptions",
    "RetryOptions",
    "SaveHandle",
    "Shard",
    "StagingError",
    "StagingOptions",
    "StateChangedError",
    "StepExistsError",
    "StorageError",
    "TiercheckError",
    "UnsafeCheckpointError",
    "UnsupportedValueError",
    "WriteOptions",
    "__version__",
    "errors",
    "load",
    "per_rank",
]
