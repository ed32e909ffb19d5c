"""tiercheck: hierarchical, asynchronous checkpointing for large-model training with PyTorch."""

__version__ = "0.1.0"

from . import errors
from .checkpointer import Checkpointer, load
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleStateError,
    StagingError,
    StepExistsError,
    TiercheckError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from .options import RetentionOptions, StagingOptions, WriteOptions
from .pipeline import SaveHandle

__all__ = [
    "CheckpointNotFoundError",
    "Checkpointer",
    "CorruptCheckpointError",
    "IncompatibleStateError",
    "RetentionOptions",
    "SaveHandle",
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
]
