"""tiercheck: hierarchical, asynchronous checkpointing for large-model training with PyTorch."""

__version__ = "0.1.0"

from . import errors
from .checkpointer import Checkpointer, load
from .errors import (
    CheckpointNotFoundError,
    CoordinationError,
    CorruptCheckpointError,
    DirectoryInUseError,
    IncompatibleStateError,
    RemoteStorageError,
    StagingError,
    StepExistsError,
    TiercheckError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from .options import (
    DistributedOptions,
    DrainOptions,
    RetentionOptions,
    RetryOptions,
    StagingOptions,
    WriteOptions,
)
from .pipeline import SaveHandle
from .sharding import Shard, per_rank

__all__ = [
    "CheckpointNotFoundError",
    "Checkpointer",
    "CoordinationError",
    "CorruptCheckpointError",
    "DirectoryInUseError",
    "DistributedOptions",
    "DrainOptions",
    "IncompatibleStateError",
    "RemoteStorageError",
    "RetentionOptions",
    "RetryOptions",
    "SaveHandle",
    "Shard",
    "StagingError",
    "StagingOptions",
    "StepExistsError",
    "TiercheckError",
    "UnsafeCheckpointError",
    "UnsupportedValueError",
    "WriteOptions",
    "__version__",
    "errors",
    "load",
    "per_rank",
]
