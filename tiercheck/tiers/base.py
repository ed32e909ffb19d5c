"""The storage interface every tier implements. Tiers move bytes; they never see a tensor.

Paths are "/"-separated and relative to the tier's root. Call order for one step, all from
tiercheck's background threads of the rank that owns the data (never the training thread):

    open_pack(pack)        a save: the rank's pack, filled at known offsets by the I/O threads
    write(...)             once per file: zarr metadata, the manifest parts (any order, concurrently)
    sync_dirs(step_dir)    make every directory entry under the step (and the step's own) durable
    publish(marker, ...)   atomically and durably create the commit marker: the step is visible

Copies between tiers (drain, ``tiercheck restore``) use ``write_stream`` instead of ``open_pack``.
Readers call ``list_dir``, ``exists``, ``read``, ``read_range`` and ``read_into``; a restore reads
chunks that lie together in a pack with one ``read_vectored`` where the tier says it can
(``vectored_reads``). Retention calls ``delete_tree`` after it has withdrawn a step's commit marker
with ``delete``.

What a tier can do is said by its capability attributes (``local_path``, ``direct_io``,
``vectored_reads``), never by asking which class it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol

Buffer = bytes | bytearray | memoryview


class PackWriter(Protocol):
    """One file that several threads fill at known offsets (a rank's pack), durable on ``close``."""

    def write_at(self, offset: int, parts: Sequence[Buffer]) -> None: ...

    def close(self) -> None: ...


class Tier(ABC):
    """A place checkpoints live: a node-local directory, or an fsspec URL (``tiers.remote``)."""

    url: str
    #: Whether a completed ``write`` survives a machine crash (fsync or equivalent).
    durable: bool = True
    #: Whether ``read_vectored`` fills many buffers with one request (a local file's ``preadv``);
    #: where it does not, a restore reads chunk by chunk.
    vectored_reads: bool = False

    @property
    def local_path(self) -> Path | None:
        """The tier's root on this machine's filesystem; None for object stores."""
        return None

    @property
    def direct_io(self) -> bool:
        """Whether reads and writes may bypass the page cache (O_DIRECT)."""
        return False

    @abstractmethod
    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        """Create or replace ``path`` with the concatenation of ``parts``; durable on return."""

    @abstractmethod
    def read(self, path: str) -> bytes | bytearray:
        """The whole content of ``path``. Raises ``FileNotFoundError`` when it does not exist."""

    def read_bytes(self, path: str) -> bytes:
        """``read`` as immutable ``bytes``, for copies between tiers: object-store clients take
        ``bytes``, and a tier that can read straight into them saves the copy ``bytes(read(path))``
        makes."""
        return bytes(self.read(path))  # the same object when read already gave bytes

    def read_range(self, path: str, offset: int, length: int) -> bytes | bytearray:
        """``length`` bytes of ``path`` from ``offset``: fewer where the file ends first (a chunk
        in a pack is read this way), never a buffer larger than what is stored. The default
        reads the whole file."""
        return bytes(memoryview(self.read(path))[offset : offset + length])

    def read_into(self, path: str, out: memoryview, *, offset: int = 0, length: int | None = None) -> tuple[int, bytes]:
        """Read ``path`` (or its ``length`` bytes from ``offset``) into ``out`` (writable, bytes)
        as far as it goes: returns how many bytes went there and the rest. Restore reads chunks
        straight into the tensors they fill this way; the default reads, then copies."""
        raw = memoryview(self.read(path) if length is None else self.read_range(path, offset, length))
        if length is None:
            raw = raw[offset:]
        n = min(len(raw), len(out))
        out[:n] = raw[:n]
        return n, bytes(raw[n:])

    def read_vectored(
        self,
        path: str,
        offset: int,
        views: Sequence[memoryview],
        *,
        direct: bool = False,
        each: Callable[[memoryview], None] | None = None,
    ) -> tuple[int, bool]:
        """Fill ``views`` (writable) from ``path`` at ``offset`` on, in order; returns the bytes read
        (fewer where the file ends first) and whether they bypassed the page cache. ``each``, where
        given, is passed every byte read, in file order, in pieces (as they land, where the tier
        can: ``LocalTier``; here, each view's part once all is read). The default reads the range,
        then copies; tiers with ``vectored_reads`` do better."""
        raw = memoryview(self.read_range(path, offset, sum(len(v) for v in views)))
        pos = 0
        for v in views:
            n = min(len(v), len(raw) - pos)
            v[:n] = raw[pos : pos + n]
            pos += n
        return pos, pass_read(views, pos, each)

    @property
    def lends_memory(self) -> bool:
        """Whether ``map_range`` lends the tier's own memory (a directory on a tmpfs: ``LocalTier``)."""
        return False

    def map_range(self, path: str, offset: int, length: int) -> memoryview | None:
        """``length`` bytes of ``path`` from ``offset`` on, lent from the tier's own memory rather than
        read into new memory, for as long as the view lives; None where the tier lends none
        (``lends_memory``) or the file holds fewer bytes there."""
        return None

    def open_pack(self, path: str) -> PackWriter:
        """A file the I/O threads fill at given offsets, concurrently: a save's pack. Only tiers a
        save writes to (the local tier) have one."""
        raise NotImplementedError(f"{type(self).__name__} ({self.url}) does not take writes at offsets")

    def write_stream(self, path: str, pieces: Callable[[], Iterable[Buffer]], *, size: int | None = None) -> None:
        """Create or replace ``path`` with the buffers ``pieces()`` yields, in order (``size``
        bytes in all, where the caller knows); durable on return, and never visible in part.
        Copies of pack files go this way, pieces of ``piece_bytes(size)`` read and verified
        ahead of the writes; a tier that retries the whole object calls ``pieces`` again. The
        default gathers them and writes once."""
        self.write(path, list(pieces()))

    def piece_bytes(self, size: int) -> int:
        """The size of the pieces ``write_stream`` of a ``size``-byte object takes best (whole
        blocks): one part of an upload, one write of a copy."""
        return 16 << 20

    def part_checksums(self, path: str) -> tuple[str, int] | None:
        """What the store kept of ``path``'s parts' checksums, and the parts' size: S3's
        composite CRC32C of a multipart upload (``parts.composite_of``). None where it keeps
        none: a resumed copy of the file is then read back, or copied again."""
        return None

    def discard_unfinished(self, path: str, names: set[str] | None = None) -> int:
        """Drop what writes cut short left under ``path`` that no listing shows (an object
        store's unfinished uploads): of the files ``names``, or all. Returns how many."""
        return 0

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def list_dir(self, path: str = "") -> list[str]:
        """Names directly under ``path`` (empty when it does not exist)."""

    @abstractmethod
    def publish(self, path: str, data: bytes) -> None:
        """Atomically create ``path``: a reader sees all of ``data`` or nothing. Durable on return."""

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove one file durably; no error when it is already gone."""

    @abstractmethod
    def delete_tree(self, path: str) -> None:
        """Remove ``path`` and everything under it; no error when it is already gone."""

    @abstractmethod
    def sync_dirs(self, path: str) -> None:
        """Make the entries of ``path``, of every directory below it, and ``path``'s own entry in
        its parent durable (a no-op where directories do not exist, e.g. object stores)."""

    def sizes(self, path: str) -> dict[str, int]:
        """Every file under ``path`` with its size, keyed by path relative to ``path`` (used to
        resume a copy). The default knows nothing, so everything is copied again."""
        return {}

    def abort(self) -> None:
        """Stop retrying: requests in flight give up at their next retry (a closing drain whose
        wait ran out). A no-op for tiers that do not retry."""
        return None


def pass_read(views: Sequence[memoryview], n: int, each: Callable[[memoryview], None] | None) -> bool:
    """The first ``n`` bytes of ``views`` given to ``each`` (``Tier.read_vectored``), view by view;
    False (what a read that bypassed no page cache returns)."""
    for v in views:
        if each is None or n <= 0:
            break
        each(v[:n])
        n -= len(v)
    return False
