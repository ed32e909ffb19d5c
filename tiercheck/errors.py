"""Exceptions raised by tiercheck.

Every error derives from :class:`TiercheckError` *and* from the builtin a caller would catch
without knowing tiercheck (``FileNotFoundError`` for a missing step, ``ValueError`` for bad
data), so ``except FileNotFoundError`` keeps working around a tiercheck call.
"""

from __future__ import annotations


class TiercheckError(Exception):
    """Root of every error tiercheck raises on purpose."""


class CheckpointNotFoundError(TiercheckError, FileNotFoundError):
    """A checkpoint directory, or a requested step in it, does not exist or is not committed."""


class StepExistsError(TiercheckError, FileExistsError):
    """A save would overwrite a step that is already committed."""


class DirectoryInUseError(TiercheckError, RuntimeError):
    """Another writer (another job, or an open ``Checkpointer``) holds the node-local directory."""


class LineageError(TiercheckError, RuntimeError):
    """A local directory or remote prefix holds another run's steps, and this run did not restore
    from it (it would replace them): use another place, restore from it, or take it over."""


class ContestedStepError(LineageError):
    """The remote prefix holds a committed step of another save, which its lineage has not
    abandoned, under the number of a local step being drained. Only a run that restored or saved
    that local step (then the step is its lineage's) sets the remote one aside and drains its own."""


class CorruptCheckpointError(TiercheckError, ValueError):
    """Stored bytes do not match their checksum, or a manifest cannot be read."""


class PartlyRestoredError(CorruptCheckpointError):
    """No step could be restored whole, after a restore that reads into the state's own memory (a
    job start, or ``in_place=True``) had overwritten some of its tensors: the message names them."""


class IncompatibleStateError(TiercheckError, ValueError):
    """The state to restore into does not match the checkpoint (keys, shapes or dtypes)."""


class UnsafeCheckpointError(TiercheckError, PermissionError):
    """Loading would need unpickling without opt-in, or a path escapes the checkpoint root (a symbolic
    link under it included); or the memory tier's directory in a place every user shares (``/dev/shm``)
    is not private to this user: a link, another user's, or writable by its group or others."""


class UnsupportedValueError(TiercheckError, TypeError):
    """A value in the state cannot be stored without pickle, and pickle was not allowed; or the
    state itself is of a type tiercheck cannot take (not a mapping; a ``Shard`` of no tensor)."""


class StagingError(TiercheckError, RuntimeError):
    """Host staging cannot proceed as configured (e.g. the memory bound is too small)."""


class CoordinationError(TiercheckError, RuntimeError):
    """Ranks could not agree: one failed, died, or took longer than DistributedOptions.timeout_s."""


class RemoteStorageError(TiercheckError, OSError):
    """The remote tier refused (access denied, no such bucket) or kept failing past the retry limits."""


class StorageError(TiercheckError, OSError):
    """The node-local directory refused a write tiercheck needs (a full disk or quota, a read-only
    filesystem, no permission). ``errno`` is the operating system's (``ENOSPC``, ``EROFS``...); the
    message names the directory, its free space where that is the cause, and what to do."""


class MemoryTierError(TiercheckError, OSError):
    """The memory tier cannot hold what it needs (``MemoryOptions``): its tmpfs has too little free
    space, or the cgroup's memory limit leaves too little room (``errno`` ``ENOSPC``; the message names
    the path, the bytes needed, the tmpfs's free bytes, the cgroup's limit, and what to do). Or its
    directory refused a save: removed while the job ran (``ENOENT``), a read-only mount over it
    (``EROFS``), a file where a directory should be (``ENOTDIR``); the message names the directory."""


class StateChangedError(TiercheckError, RuntimeError):
    """A tensor staged lazily changed between ``save()`` and the end of its copy to host memory
    (its version counter moved): that save fails rather than commit a torn step."""


class InvalidArgumentError(TiercheckError, ValueError):
    """An argument or option tiercheck cannot use: a step that is not a non-negative int, an option
    out of its range, settings that contradict each other. The message names it."""


class NotADirectoryTierError(StorageError, NotADirectoryError):
    """A local tier's path (``Checkpointer(local=...)``, a directory given to the CLI) is a file."""


class ClosedError(TiercheckError, RuntimeError):
    """A ``Checkpointer`` was used after ``close()``."""


class ForeignCheckpointError(TiercheckError, RuntimeError):
    """A restore found no tiercheck step where another framework's checkpoints lie (DCP or torchtitan
    ``step-N/``, DeepSpeed ``global_stepN/``, Lightning ``.ckpt``, ``torch.save`` files): rather than start
    from scratch over them, it stops; the message names what it found and the ``tiercheck import`` command."""
