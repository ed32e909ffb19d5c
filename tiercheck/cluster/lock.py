"""One writer per node-local directory.

Two jobs (or two ``Checkpointer``s of one process) saving into one directory would delete each
other's in-flight steps as partial, overwrite each other's committed steps and mix chunks. So the
node's first rank holds an exclusive ``flock`` on ``<local>/.tiercheck-lock`` for as long as its
``Checkpointer`` is open, and the node's other ranks (same job) go ahead under it. The kernel drops
the lock when the holder's process exits however it exits (``kill -9`` included), so a crashed job
never leaves a lock that blocks the next one; the file's text (pid, host, start time) only names the
holder in the error a second writer gets.
"""



from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
from pathlib import Path

from tiercheck.cluster.coordination import Coordinator, Exchange
from tiercheck.cluster.keys.nodes import LOCK, lock_scope
from tiercheck.errors import DirectoryInUseError, StorageError, TiercheckError
from tiercheck.format.paths import LOCK_FILE
from tiercheck.tiers.refusals import storage_error

_MAX_HOLDER_BYTES = 4096  # the holder's description we write is ~100 bytes; read no more of a stray file


class DirectoryLock:
    """An exclusive, process-lifetime lock on a directory; ``release`` (or process exit) frees it."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.path = Path(root) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock at once or raise ``DirectoryInUseError`` naming the holder; ``StorageError``
        where the directory cannot be written (full, read-only), holding nothing then either."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as e:
            raise storage_error(e, self.path.parent, "lock it") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DirectoryInUseError(f"could not lock {self.path}: {e}") from None
            raise DirectoryInUseError(
                f"{self.path.parent} is in use by another tiercheck writer ({holder}; lock file {self.path}). "
                "Two writers in one directory would overwrite each other's steps: stop the other job or "
                "close its Checkpointer, or give this one another local directory"
            ) from None
        try:
            _write_holder(fd)
        except BaseException as e:
            # Closing drops the flock: a failed start holds nothing, and the next one (this process's
            # too) takes the lock. The file stays, emptied: removing it would race a new holder.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)
            if isinstance(e, OSError):
                raise storage_error(e, self.path.parent, "write its lock file") from e
            raise
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # drops the flock; the file stays (removing it would race a new holder)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __del__(self) -> None:
        self.release()


def _write_holder(fd: int) -> None:
    """Name this process in the lock file, for the error a second writer gets."""
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    data = memoryview((json.dumps(me) + "\n").encode())
    os.ftruncate(fd, 0)
    written = 0
    while written < len(data):  # a short write on a filling disk: the next one says why (ENOSPC)
        written += os.pwrite(fd, data[written:], written)


def _read_holder(fd: int) -> str:
    try:
        raw = os.pread(fd, _MAX_HOLDER_BYTES, 0)
        info = json.loads(raw)
        return f"pid {int(info['pid'])} on host {str(info['host'])[:255]!r} since {str(info['since'])[:40]}"
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        return "holder unknown"


def lock_node(
    coord: Coordinator, leader: int, lock: DirectoryLock, *, failure: StorageError | None = None
) -> Exchange[None]:
    """The node's ``leader`` takes ``lock``; every rank of the job learns whether it could, and all
    raise the same ``DirectoryInUseError`` if one node's directory is taken, so no rank goes on alone.
    A rank whose directory could not be written (``StorageError``: full, read-only), at the lock or
    given as the ``failure`` of its start before it, raises that; the others raise
    ``CoordinationError`` naming it, at once instead of after waiting for it."""
    failed: TiercheckError | None = failure
    if failed is None and coord.rank == leader:
        try:
            lock.acquire()
        except (DirectoryInUseError, StorageError) as e:
            failed = e
    if failed is not None:
        coord.report(LOCK, failed)
    yield coord.arrive(lock_scope(), what="every node's first rank to lock its directory")
    try:
        coord.check(LOCK, failed, shared=(DirectoryInUseError,))
    except BaseException:
        lock.release()
        raise
    finally:
        coord.finish(LOCK)
