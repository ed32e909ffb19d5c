"""The node-local tier: a directory on the node's own disk (NVMe)."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tiercheck.errors import UnsafeCheckpointError
from tiercheck.libc import RAMFS_MAGIC, TMPFS_MAGIC, filesystem_type
from tiercheck.tiers.base import Buffer, Tier
from tiercheck.tiers.mapped import map_file_range, resident_pages
from tiercheck.tiers.refusals import storage_error

STREAM_WRITERS = 2  # pieces a copy writes at once (``write_stream``), beside the one being read
STREAM_PIECE_BYTES = 64 << 20  # and their size: from a remote tier, each read as ranged GETs in parallel
BLOCK = 4096  # O_DIRECT needs buffer address, length and file offset aligned to the device block
DIRECT_MIN_BYTES = 1 << 20  # below this the page cache is cheaper than a direct write
# A read whose pieces are checked as they land (``read_vectored(each=...)``) reads this much at a time:
# well within a core's L2 cache (bigger pieces measured slower, smaller ones cost more calls).
PIECE_BYTES = 512 << 10


class LocalTier(Tier):
    """A directory on this machine's filesystem: the node-local tier (NVMe), or a parallel
    filesystem's path. Files are written with fsync (``fsync=False`` for tests and benchmarks),
    big ones around the page cache with ``direct_io``."""

    vectored_reads = True

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True, direct_io: bool = False) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)
        self.durable = fsync
        self._fsync = fsync
        self._direct = direct_io and hasattr(os, "O_DIRECT")
        self._in_memory: bool | None = None  # on a tmpfs (``map_range``), once asked

    @property
    def direct_io(self) -> bool:
        """Whether big chunks go around the page cache (asked for, and not refused so far)."""
        return self._direct

    @property
    def local_path(self) -> Path:
        return self.root

    def create(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise  # a file, or a link to nowhere, where the directory should be: not a storage fault
        except OSError as e:
            raise storage_error(e, self.root, "create it") from e

    def _abs(self, path: str, *, link_at_end: bool = False) -> Path:
        """``path`` under the root. Paths come from our own planning, but also from manifests read
        back: escapes are refused, and so is a symbolic link anywhere below the root (tiercheck
        never writes one; followed, it would read or write outside the checkpoint). The root itself
        may be a link (an NVMe mount). With ``link_at_end``, the last component may be a link: it
        is removed, not followed."""
        if path.startswith("/") or "\\" in path or "\0" in path or any(p in ("..",) for p in path.split("/")):
            raise UnsafeCheckpointError(f"path {path!r} would leave the checkpoint root {self.root}")
        if not path:
            return self.root
        here = self.root
        parts = [p for p in path.split("/") if p]
        for i, part in enumerate(parts):
            here = here / part
            try:
                mode = os.lstat(here).st_mode
            except (FileNotFoundError, NotADirectoryError):
                break  # nothing further exists to be a link
            if stat.S_ISLNK(mode) and not (link_at_end and i == len(parts) - 1):
                raise UnsafeCheckpointError(
                    f"{here} is a symbolic link; a checkpoint never holds one, so tiercheck will not follow it"
                )
        return self.root / path

    def _make_parent(self, target: Path) -> None:
        """Create the directories above ``target`` (a path ``_abs`` gave) that are missing."""
        target.parent.mkdir(parents=True, exist_ok=True)

    def _create(self, target: Path, flags: int) -> int:
        """``target`` opened for writing with ``flags`` (``O_CREAT``: made where missing), never through a link."""
        return open_no_follow(target, flags, 0o644)

    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        target = self._abs(path)
        self._make_parent(target)
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        offset = self._write_direct(target, views) if self._direct and views else 0
        fd = self._create(target, os.O_WRONLY | os.O_CREAT | (0 if offset else os.O_TRUNC))
        try:
            _write_all(fd, views, offset)
            if self._fsync:
                os.fsync(fd)  # also covers the metadata (size, extents) of a direct write before it
        finally:
            os.close(fd)

    def _write_direct(self, target: Path, views: list[memoryview]) -> int:
        """Write the block-aligned head of the first buffer with O_DIRECT; return how many bytes
        that covered (0 when it does not apply), and leave the rest of ``views`` to write."""
        n = _direct_span(views[0], 0)
        fd = self._open_direct(target, os.O_CREAT | os.O_TRUNC) if n else None
        if fd is None:
            return 0
        try:
            _write_all(fd, [views[0][:n]], 0)
        finally:
            os.close(fd)
        views[0] = views[0][n:]
        return n

    def _open_direct(self, target: Path, flags: int) -> int | None:
        """``target`` opened for writing with O_DIRECT, or None where the filesystem refuses it
        (tmpfs, some network mounts): direct I/O is then off for this tier."""
        try:
            return self._create(target, os.O_WRONLY | os.O_DIRECT | flags)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._direct = False
            return None

    def read(self, path: str) -> bytearray:
        with open(self._abs(path), "rb", opener=open_no_follow) as f:
            buf = bytearray(os.fstat(f.fileno()).st_size)
            n = f.readinto(buf)
            del buf[n:]  # the file shrank since fstat: return what is there
            return buf

    def read_bytes(self, path: str) -> bytes:
        with open(self._abs(path), "rb", buffering=0, opener=open_no_follow) as f:
            return f.read()  # read straight into one bytes object sized from fstat

    def read_range(self, path: str, offset: int, length: int) -> bytearray:
        """Writable, and sized from the file: a ``length`` far beyond what is stored (a hostile
        manifest's) allocates nothing more."""
        with open(self._abs(path), "rb", buffering=0, opener=open_no_follow) as f:
            buf = bytearray(max(0, min(length, os.fstat(f.fileno()).st_size - offset)))
            f.seek(offset)
            n = f.readinto(buf) or 0
            del buf[n:]  # the file shrank since fstat
            return buf

    def read_into(self, path: str, out: memoryview, *, offset: int = 0, length: int | None = None) -> tuple[int, bytes]:
        with open(self._abs(path), "rb", opener=open_no_follow) as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(offset)
            if length is not None and length < len(out):
                out = out[:length]
            n = f.readinto(out)  # buffered: loops until ``out`` is full or the file ends
            # The rest, sized by the file, not by ``length`` (a hostile manifest's): read(n) sizes its buffer first.
            rest = -1 if length is None else max(0, min(length - n, size - offset - n))
            return n, f.read(rest)

    def read_vectored(
        self,
        path: str,
        offset: int,
        views: Sequence[memoryview],
        *,
        direct: bool = False,
        each: Callable[[memoryview], None] | None = None,
    ) -> tuple[int, bool]:
        """Fill ``views`` (writable) from ``path`` at ``offset`` on, in order, with as few reads as
        it takes (one ``preadv`` of up to 1024 buffers each); returns the bytes read, fewer where
        the file ends first, and whether they bypassed the page cache. Restore reads runs of
        chunks that lie together in a pack this way.

        With ``direct``, and where the tier does direct I/O, ``offset`` and every view's address
        and length are whole blocks, and the page cache does not hold most of the largest view's
        bytes already (``mincore`` says), the reads bypass the page cache: no copy out of
        it, and no cache memory to fill and reclaim.

        With ``each``, the reads are of ``PIECE_BYTES`` at most, and each piece read is passed to
        ``each`` (in file order) before the next is read: a restore folds its chunks' checksums
        while their bytes are still in the CPU's cache, rather than read them back from memory
        after a read of 64 MiB (from a tmpfs: 1.2-1.35x the bytes per CPU second)."""
        target = self._abs(path)
        fd = open_no_follow(target, os.O_RDONLY)
        try:
            direct = direct and self._direct and _blocks(offset, views) and not _cached(fd, offset, views)
            if direct:
                fd, direct = self._reopen_direct(target, fd)
            total, pending = 0, [v for v in views if len(v)]
            while pending:
                batch = pending[:1024] if each is None else _head(pending, PIECE_BYTES)
                n = os.preadv(fd, batch, offset + total)
                total += n
                if each is not None:
                    for piece in _head(batch, n):
                        each(piece)
                if n == 0 or (direct and n % BLOCK):
                    break  # the end of the file (a direct read cannot go on from within a block)
                _advance(pending, n)  # a short read resumes mid-buffer
            return total, direct
        finally:
            os.close(fd)

    @property
    def lends_memory(self) -> bool:
        if self._in_memory is None:
            self._in_memory = filesystem_type(os.fspath(self.root)) in (TMPFS_MAGIC, RAMFS_MAGIC)
        return self._in_memory

    def map_range(self, path: str, offset: int, length: int) -> memoryview | None:
        """``length`` bytes of ``path`` from ``offset`` on, mapped rather than read (``tiers.mapped``),
        where the directory is in memory (a tmpfs: the memory tier); None on a disk (a read is as
        cheap, and ``direct_io`` keeps big reads out of the page cache) or where the file holds fewer.
        A missing file raises ``FileNotFoundError``."""
        if not self.lends_memory:
            return None
        fd = open_no_follow(self._abs(path), os.O_RDONLY)
        try:
            return map_file_range(fd, offset, length)
        finally:
            os.close(fd)

    def _reopen_direct(self, target: Path, fd: int) -> tuple[int, bool]:
        """``target`` opened again for reading with O_DIRECT (``fd`` closed), and True; ``fd``
        and False where the filesystem refuses direct I/O (which is then off for this tier)."""
        try:
            direct = open_no_follow(target, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._direct = False
            return fd, False
        os.close(fd)
        return direct, True

    def write_stream(self, path: str, pieces: Callable[[], Iterable[Buffer]], *, size: int | None = None) -> None:
        """Written under a temporary name and renamed when whole, as an object store completes
        an upload: a failed stream leaves nothing under ``path``. Up to ``STREAM_WRITERS`` pieces
        are written at once, at their offsets (a parallel filesystem's clients write faster so),
        while the source reads the next."""
        target = self._abs(path)
        self._make_parent(target)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{threading.get_native_id()}")
        fd = self._create(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        slots = threading.BoundedSemaphore(STREAM_WRITERS)
        writes: list[Future[None]] = []
        try:
            with ThreadPoolExecutor(STREAM_WRITERS, thread_name_prefix="tiercheck-write") as pool:
                offset = 0
                for piece in pieces():
                    view = memoryview(piece).cast("B")
                    slots.acquire()
                    writes.append(pool.submit(_write_all, fd, [view], offset))
                    writes[-1].add_done_callback(lambda _: slots.release())
                    offset += len(view)
                    if writes[0].done():  # a failed write stops the stream early
                        writes.pop(0).result()
            for w in writes:
                w.result()
            if self._fsync:
                os.fsync(fd)
        except BaseException:
            for w in writes:
                w.cancel()
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, target)

    def piece_bytes(self, size: int) -> int:
        return STREAM_PIECE_BYTES

    def open_pack(self, path: str) -> PackWriter:
        """A file the I/O threads fill at given offsets, concurrently (a rank's pack)."""
        target = self._abs(path)
        self._make_parent(target)
        return PackWriter(self, target)

    def exists(self, path: str) -> bool:
        return self._abs(path).exists()

    def list_dir(self, path: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._abs(path)))
        except FileNotFoundError:
            return []

    def sizes(self, path: str) -> dict[str, int]:
        top = self._abs(path)
        out: dict[str, int] = {}
        for dirpath, dirs, files in os.walk(top):
            for f in (*dirs, *files):
                full = os.path.join(dirpath, f)
                if os.path.islink(full):
                    raise UnsafeCheckpointError(
                        f"{full} is a symbolic link; a checkpoint never holds one, so tiercheck will not follow it"
                    )
            for f in files:
                full = os.path.join(dirpath, f)
                with contextlib.suppress(FileNotFoundError):
                    out[os.path.relpath(full, top)] = os.path.getsize(full)
        return out

    def publish(self, path: str, data: bytes) -> None:
        target = self._abs(path)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        self.write(str(tmp.relative_to(self.root)), [data])
        os.replace(tmp, target)  # atomic on POSIX: readers see no marker or the whole marker
        self._sync_dir(target.parent)

    def delete(self, path: str) -> None:
        target = self._abs(path, link_at_end=True)
        try:
            target.unlink()
        except FileNotFoundError:
            return
        self._sync_dir(target.parent)

    def move(self, path: str, to: str) -> None:
        """Rename ``path`` (a file or a directory) to ``to`` inside this tier, atomically; the
        directories above ``to`` are created. Fails if ``to`` exists."""
        source, target = self._abs(path, link_at_end=True), self._abs(to)
        self._make_parent(target)
        if target.exists():
            raise FileExistsError(errno.EEXIST, "cannot move there: it exists", str(target))
        os.rename(source, target)
        self._sync_dir(target.parent)
        self._sync_dir(source.parent)

    def delete_tree(self, path: str) -> None:
        target = self._abs(path, link_at_end=True)
        with contextlib.suppress(FileNotFoundError):
            if target.is_symlink() or not target.is_dir():  # a link (never followed) or a stray file
                target.unlink()
            else:
                shutil.rmtree(target)
        self._sync_dir(target.parent)

    def sync_dirs(self, path: str) -> None:
        if not self._fsync:
            return
        top = self._abs(path)
        dirs = [Path(dirpath) for dirpath, _dirnames, _files in os.walk(top)]
        if top != self.root:
            dirs.append(top.parent)
        # One fsync per directory, many directories per step (one per tensor): overlap them.
        with ThreadPoolExecutor(min(8, len(dirs)) or 1, thread_name_prefix="tiercheck-dirsync") as pool:
            list(pool.map(self._sync_dir, dirs))

    def _sync_dir(self, d: Path) -> None:
        if not self._fsync:
            return
        try:
            fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        except OSError as e:  # some filesystems refuse fsync on directories; nothing more to do there
            if e.errno not in (errno.EINVAL, errno.EBADF):
                raise
        finally:
            os.close(fd)


class PackWriter:
    """One file written at known offsets by several threads, fsync'd once at the end.

    The whole blocks of a write (from the file's first block boundary in it, where the buffer is
    block-aligned too) go through a second descriptor opened with O_DIRECT (when the tier asks for
    direct I/O), the bytes before and after through the page cache: big chunks bypass the page
    cache even though they share a pack with small ones.
    """

    def __init__(self, tier: LocalTier, target: Path) -> None:
        self.tier = tier
        self.target = target
        self._fd: int | None = tier._create(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self._direct_fd: int | None = None
        self._lock = threading.Lock()

    def write_at(self, offset: int, parts: Sequence[Buffer]) -> None:
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        if self._fd is None:
            raise ValueError(f"{self.target} is closed")
        if self.tier._direct and views:
            skip = -offset % BLOCK  # up to the file's next block boundary: through the page cache
            n = _direct_span(views[0], skip)
            fd = self._direct() if n else None
            if fd is not None:
                _write_all(self._fd, [views[0][:skip]], offset)
                _write_all(fd, [views[0][skip : skip + n]], offset + skip)
                views[0] = views[0][skip + n :]
                offset += skip + n
        _write_all(self._fd, views, offset)

    def _direct(self) -> int | None:
        with self._lock:
            if self._direct_fd is None and self.tier._direct:
                self._direct_fd = self.tier._open_direct(self.target, 0)
            return self._direct_fd

    def close(self) -> None:
        """Make everything written durable, then close. Idempotent."""
        with self._lock:
            fds, self._fd, self._direct_fd = [self._fd, self._direct_fd], None, None
        try:
            if fds[0] is not None and self.tier._fsync:
                os.fsync(fds[0])  # covers the direct writes' metadata too
        finally:
            for fd in fds:
                if fd is not None:
                    os.close(fd)


def open_no_follow(path: str | os.PathLike[str], flags: int, mode: int = 0o777) -> int:
    """``os.open`` that refuses a symbolic link as the last component (``ELOOP``): ``_abs`` refused
    one below the root already, and none planted since is followed (and the descriptor is not inherited)."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def _direct_span(view: memoryview, skip: int) -> int:
    """How many bytes of ``view`` from ``skip`` on O_DIRECT can write (whole blocks from a
    block-aligned address, and enough of them to be worth it), or 0."""
    n = max(len(view) - skip, 0) // BLOCK * BLOCK
    if n < DIRECT_MIN_BYTES or (_address(view) + skip) % BLOCK:
        return 0
    return n


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _blocks(offset: int, views: Sequence[memoryview]) -> bool:
    """Whether a read at ``offset`` into ``views`` can bypass the page cache: whole blocks."""
    return offset % BLOCK == 0 and all(len(v) % BLOCK == 0 and _address(v) % BLOCK == 0 for v in views if len(v))


def _cached(fd: int, offset: int, views: Sequence[memoryview]) -> bool:
    """Whether the page cache holds most of the largest of ``views`` (read at ``offset``), which
    stands for the run around it: copying out of the cache beats reading the disk again."""
    at, largest = offset, (0, offset)
    for v in views:
        largest = max(largest, (len(v), at))
        at += len(v)
    length, start = largest
    resident = resident_pages(fd, start, length)
    return resident is not None and 2 * resident * mmap.PAGESIZE > length


def _write_all(fd: int, views: list[memoryview], offset: int) -> None:
    """pwritev everything in ``views`` at ``offset``, resuming after short writes."""
    views = [v for v in views if len(v)]
    while views:
        written = os.pwritev(fd, views[:1024], offset)
        offset += written
        _advance(views, written)  # a short write resumes mid-buffer


def _head(views: Sequence[memoryview], n: int) -> list[memoryview]:
    """The first ``n`` bytes of ``views``, as views of them (1024 at most, what one ``preadv`` takes)."""
    out: list[memoryview] = []
    for v in views:
        if n <= 0 or len(out) == 1024:
            break
        out.append(v[:n])
        n -= len(v)
    return out


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` (buffers done by a vectored read or write), in place."""
    while n and views:
        if n >= len(views[0]):
            n -= len(views.pop(0))
        else:
            views[0], n = views[0][n:], 0
