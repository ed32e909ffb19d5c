"""The storage interface every tier implements. Tiers move bytes; they never see a tensor.

Paths are "/"-separated and relative to the tier's root. Call order for one step, all from
tiercheck's background threads of the rank that owns the data (never the training thread):

    write(...)             once per file: zarr metadata, chunks, the manifest (any order, concurrently)
    sync_dirs(step_dir)    make every directory entry under the step (and the step's own) durable
    publish(marker, ...)   atomically and durably create the commit marker: the step is visible

Readers call ``list_dir``, ``exists`` and ``read``; retention calls ``delete_tree`` after it
has withdrawn a step's commit marker with ``delete``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence

Buffer = bytes | bytearray | memoryview


class Tier(ABC):
    """A place checkpoints live: a node-local directory, or (later) an fsspec URL."""

    url: str
    #: Whether a completed ``write`` survives a machine crash (fsync or equivalent).
    durable: bool = True

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

    def write_stream(self, path: str, pieces: Callable[[], Iterable[Buffer]]) -> None:
        """Create or replace ``path`` with the buffers ``pieces()`` yields, in order; durable on
        return. Copies of pack files go this way, one chunk in memory at a time; a tier that
        retries calls ``pieces`` again. The default gathers them and writes once."""
        self.write(path, list(pieces()))

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
