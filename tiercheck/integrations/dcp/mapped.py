"""A DCP checkpoint's tensors without reading them into memory, for ``tiercheck import``.

A tensor DCP wrote in one piece (one rank's, whole, with no transform) is a view of the file it lies in,
memory-mapped: its bytes are read when the import copies them into its staging pool, a pool at a time, and
the page cache may drop them again. A tensor saved in several pieces (by several ranks) must be put together
before it can be saved as one array: it is given a place in a scratch file on the import's destination disk
(unlinked at once: nothing is left behind if the import dies), mapped the same way, and filled by DCP's own
reader a piece at a time. Either way the import's own memory does not grow with the checkpoint.

Every number here comes from the checkpoint and is checked before it is used: the file a piece names lies
inside the checkpoint's directory, its byte range inside that file, and the tensor ``torch.save`` wrote there
(read with ``weights_only`` onto the meta device: its header only, none of its data) is the dtype and shape
the metadata names and lies inside its range.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from tiercheck.errors import CorruptCheckpointError, StorageError

__all__ = ["Mapped", "scratch_tensors"]

SCRATCH_ALIGN = 4096  # each tensor's place in the scratch file: whole pages


class Mapped:
    """The files of the DCP checkpoint at ``root``, each mapped once, and views of the tensors in them."""

    def __init__(self, root: Path, metadata: Metadata) -> None:
        self._root = root.resolve()
        self._metadata = metadata
        self._files: dict[str, mmap.mmap] = {}  # relative path: the file's bytes, mapped
        for index, info in (metadata.storage_data or {}).items():  # every piece, before DCP's reader opens any
            self._file(str(getattr(info, "relative_path", "")), index.fqn)

    def view(self, fqn: str, md: TensorStorageMetadata) -> torch.Tensor | None:
        """The tensor ``fqn`` as a view of its file, where DCP wrote it whole in one piece with no transform
        at a place its dtype can be viewed at; else None (DCP's reader fills it, ``scratch_tensors``)."""
        if len(md.chunks) != 1 or any(md.chunks[0].offsets) or tuple(md.chunks[0].sizes) != tuple(md.size):
            return None
        dtype, shape = md.properties.dtype, tuple(md.size)
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=dtype)
        info = (self._metadata.storage_data or {}).get(MetadataIndex(fqn, md.chunks[0].offsets))
        if info is None or getattr(info, "transform_descriptors", None):
            return None
        path, size, mapped = self._file(info.relative_path, fqn)
        offset, length = info.offset, info.length
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and 0 < length <= size - offset):
            raise CorruptCheckpointError(
                f"{path}: {fqn} lies at bytes [{offset}, {offset}+{length}) of a file of {size} bytes (DCP's .metadata)"
            )
        saved = _header(path, offset, length, fqn)
        where = f"{path}: {fqn} (at byte {offset})"
        if saved.dtype != dtype or tuple(saved.shape) != shape:
            raise CorruptCheckpointError(
                f"{where} is {saved.dtype}{list(saved.shape)}, but DCP's .metadata says {dtype}{list(shape)}"
            )
        storage = saved.untyped_storage()
        at, nbytes = getattr(storage, "_checkpoint_offset", None), storage.nbytes()
        if not isinstance(at, int) or not 0 <= at <= length - nbytes:
            raise CorruptCheckpointError(f"{where}: its data ({nbytes} bytes) lies outside its {length} bytes")
        itemsize = dtype.itemsize
        extent = saved.storage_offset() + sum((n - 1) * s for n, s in zip(shape, saved.stride(), strict=True)) + 1
        if min(saved.stride(), default=0) < 0 or extent * itemsize > nbytes:
            raise CorruptCheckpointError(f"{where}: its strides reach past its {nbytes} bytes of data")
        if nbytes % itemsize:
            raise CorruptCheckpointError(f"{where}: its data ({nbytes} bytes) is not whole {dtype} elements")
        # A view of the mapped file wherever the data starts: DCP packs its items end to end, so most start at
        # no multiple of their element size (torch's CPU copies read such memory as any other).
        data = torch.frombuffer(mapped, dtype=dtype, count=nbytes // itemsize, offset=offset + at)
        return data.as_strided(shape, saved.stride(), saved.storage_offset())

    def _file(self, relative: str, fqn: str) -> tuple[Path, int, mmap.mmap]:
        path = (self._root / relative).resolve()
        if not relative or not path.is_relative_to(self._root):
            raise CorruptCheckpointError(
                f"{self._root}: DCP's .metadata puts {fqn} in {relative!r}, outside the checkpoint's directory"
            )
        try:
            if relative not in self._files and path.stat().st_size:
                with open(path, "rb") as f:  # a private mapping: a view written to never reaches the file
                    mapped = self._files[relative] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                if hasattr(mmap, "MADV_SEQUENTIAL"):  # read ahead as the copies go through it
                    mapped.madvise(mmap.MADV_SEQUENTIAL)
        except OSError as e:
            raise CorruptCheckpointError(f"{path}: {fqn} lies in this file, which cannot be read ({e})") from None
        mapped = self._files.get(relative, _EMPTY)
        return path, len(mapped) if relative in self._files else 0, mapped


_EMPTY = mmap.mmap(-1, 1)  # what an empty file "maps" to: no range inside it passes the checks


def _header(path: Path, offset: int, length: int, fqn: str) -> torch.Tensor:
    """The tensor ``torch.save`` wrote at ``[offset, offset + length)`` of ``path``, on the meta device: its dtype,
    shape, strides and where its data starts (a few KiB of the file read, none of the data)."""
    with open(path, "rb") as f:
        try:
            saved = torch.load(cast(IO[bytes], _Window(f, offset, length)), weights_only=True, map_location="meta")
        except Exception as e:
            raise CorruptCheckpointError(
                f"{path}: {fqn} (at byte {offset}) is not a tensor torch.save wrote ({e})"
            ) from None
    if not isinstance(saved, torch.Tensor):
        raise CorruptCheckpointError(f"{path}: {fqn} (at byte {offset}) holds a {type(saved).__name__}, not a tensor")
    return saved


class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, as a file of their own (what ``torch.load`` reads)."""

    def __init__(self, f: io.BufferedReader, offset: int, length: int) -> None:
        super().__init__()
        self._f, self._offset, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(base + pos, 0)
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        n = max(min(len(buffer), self._length - self._pos), 0)
        self._f.seek(self._offset + self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got


def scratch_tensors(tensors: Mapping[str, TensorStorageMetadata], where: Path) -> dict[str, torch.Tensor]:
    """An empty tensor for each of ``tensors`` (its size and dtype), all in one scratch file in ``where``, mapped
    and unlinked at once. Refused where the disk has not the room."""
    places: dict[str, tuple[int, int]] = {}
    total = 0
    for fqn, md in tensors.items():
        if any(n < 0 for n in md.size):
            raise CorruptCheckpointError(f"DCP's .metadata: {fqn} has the size {list(md.size)}")
        nbytes = math.prod(md.size) * md.properties.dtype.itemsize
        places[fqn] = (total, nbytes)
        total += -(-nbytes // SCRATCH_ALIGN) * SCRATCH_ALIGN
    if not total:
        return {fqn: torch.empty(tuple(md.size), dtype=md.properties.dtype) for fqn, md in tensors.items()}
    free = shutil.disk_usage(where).free
    if total > free:
        raise StorageError(
            f"{where}: importing needs {total:,} bytes of scratch space to put together the tensors DCP saved in "
            f"pieces ({len(tensors)} of them), and the disk has {free:,} free"
        )
    fd, name = tempfile.mkstemp(prefix=".tiercheck-import-", dir=where)
    try:
        # Reserved in full before it is mapped: a sparse file on a disk that fills meanwhile would fail a write
        # into the mapping with SIGBUS, not an error (where the platform cannot reserve, it is only sized).
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, total)
            else:
                os.ftruncate(fd, total)
        except OSError as e:
            raise StorageError(
                e.errno, f"{where}: cannot reserve {total:,} bytes of scratch space for the import: {e.strerror}"
            ) from None
        scratch = torch.from_file(name, shared=True, size=total, dtype=torch.uint8)
    finally:
        os.close(fd)
        os.unlink(name)  # the mapping keeps it while the import runs; nothing is left if it dies
    return {
        fqn: scratch[start : start + nbytes].view(md.properties.dtype).view(tuple(md.size))
        for (fqn, md), (start, nbytes) in zip(tensors.items(), places.values(), strict=True)
    }
