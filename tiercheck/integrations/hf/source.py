"""A local safetensors directory to import (``load_pretrained``), read as what it is: files from outside.

Unlike a checkpoint directory, which never holds a symbolic link (``LocalTier`` refuses to follow one), an import
may be made of links: the Hugging Face hub cache links each file of a snapshot to a blob
(``snapshots/<rev>/model.safetensors -> ../../blobs/<hash>``). So links are followed here, to regular files
only, and only for reading. Anything else where a file should be (a FIFO, a device, a directory, a link to one)
is refused before it is read, and never opened in a way that could block: ``stat`` first, then an
``O_NONBLOCK`` open whose ``fstat`` must agree (the name may change in between).
"""


from __future__ import annotations

import contextlib
import io
import os
import stat

from tiercheck.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError
from tiercheck.seam import LocalTier

__all__ = ["ImportDir", "open_regular", "read_regular"]


def open_regular(path: str | os.PathLike[str], *, where: str | None = None) -> int:
    """A read-only descriptor of ``path``, links followed, if it is a regular file; ``CorruptCheckpointError``
    for anything else, raised without blocking (a FIFO's ``open`` would wait for a writer)."""
    where = where or os.fspath(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{where}: no such file (or a link to nothing)") from None
    _check_regular(mode, where)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _check_regular(os.fstat(fd).st_mode, where)  # what was opened, in case the name changed since the stat
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike[str]) -> bytes:
    """All of a regular file (links followed): a file copied in beside an export, for instance."""
    with os.fdopen(open_regular(path), "rb", buffering=0) as f:
        return f.read()


def _check_regular(mode: int, where: str) -> None:
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a special file"
        raise CorruptCheckpointError(f"{where}: not a regular file ({kind}); refusing to read it")


class ImportDir(LocalTier):
    """A local directory of safetensors files, read only: its entries may be links to regular files anywhere
    (followed), never anything else. What ``load_pretrained`` reads of it: ``sizes``, ``read``, ``read_range``,
    ``read_into``; it writes nothing."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(root, fsync=False)

    def _open(self, path: str) -> io.BufferedReader:
        if not path or "/" in path or "\\" in path or "\0" in path or path in (".", ".."):
            raise UnsafeCheckpointError(f"{path!r} is not a file of the directory {self.root}")
        return os.fdopen(open_regular(self.root / path), "rb")

    def sizes(self, path: str) -> dict[str, int]:
        """The directory's entries by name, links followed; one that is not a regular file (a directory, a
        FIFO) counts 0 bytes here, and is refused if it is read."""
        if path:
            raise UnsafeCheckpointError(f"{path!r}: an import directory is read at its top level only")
        out: dict[str, int] = {}
        for name in sorted(os.listdir(self.root)):
            with contextlib.suppress(FileNotFoundError):  # a link to nothing: not a file of the directory
                st = os.stat(self.root / name)
                out[name] = st.st_size if stat.S_ISREG(st.st_mode) else 0
        return out

    def exists(self, path: str) -> bool:
        return path in self.sizes("")

    def read(self, path: str) -> bytearray:
        with self._open(path) as f:
            buf = bytearray(os.fstat(f.fileno()).st_size)
            n = f.readinto(buf)
            del buf[n:]
            return buf

    def read_bytes(self, path: str) -> bytes:
        return bytes(self.read(path))

    def read_range(self, path: str, offset: int, length: int) -> bytearray:
        with self._open(path) as f:
            buf = bytearray(max(0, min(length, os.fstat(f.fileno()).st_size - offset)))
            f.seek(offset)
            n = f.readinto(buf) or 0
            del buf[n:]
            return buf

    def read_into(self, path: str, out: memoryview, *, offset: int = 0, length: int | None = None) -> tuple[int, bytes]:
        with self._open(path) as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(offset)
            if length is not None and length < len(out):
                out = out[:length]
            n = f.readinto(out) or 0
            rest = -1 if length is None else max(0, min(length - n, size - offset - n))
            return n, f.read(rest)

