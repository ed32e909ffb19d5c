"""``export``: a committed step as a Hugging Face safetensors directory, for inference servers and
``transformers``' ``from_pretrained``.

Each exported tensor is assembled from the step's chunks by the restore path's own reader
(``seam.read_regions``: every chunk's checksum verified, whatever TP/PP/DP/ZeRO layout saved
it), a band of chunk rows at a time, into a reused buffer; cast if asked, and appended to its shard.
Reading the next batch overlaps writing the last, and memory stays at two batches (``buffer_bytes``
each, or one band of chunk rows where that is larger) whatever the model's size.

The files are written by this module, not by ``safetensors.torch.save_file``: that takes every tensor
of a shard in memory at once (``serialize_file`` wants a pointer to each tensor's data), while the
format (a length, a JSON header, the bytes) lets a shard be written piece by piece once its header
is known, which it is from the manifest before a byte is read.

Nothing is left half-written: everything goes to a hidden directory beside the target (each shard
under a temporary name, renamed when whole and synced), which is renamed to the target only once
every file is whole; on any failure it is removed, and a later export that succeeds removes those that killed
exports left. ``to`` is never written through a symbolic link.
"""


from __future__ import annotations

import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiercheck.errors import IncompatibleStateError, InvalidArgumentError
from tiercheck.integrations.hf.files import (
    INDEX_FILE,
    METADATA_KEY,
    encode_header,
    index_document,
    parse_size,
    shard_name,
)
from tiercheck.integrations.hf.names import NameMap, exported_arrays
from tiercheck.integrations.hf.source import read_regular
from tiercheck.seam import (
    BLOCK,
    ArrayRecord,
    CommitMarker,
    LocalTier,
    Region,
    Tier,
    aligned_empty,
    check_extents,
    itemsize,
    open_step,
    read_regions,
    torch_dtype,
)

CASTABLE = ("float64", "float32", "float16", "bfloat16")  # what ``dtype`` converts; other dtypes stay


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportResult:
    directory: str
    step: int
    files: list[str]  # shard files, in order
    tensors: int
    total_size: int  # bytes of tensor data, as the index's metadata says
    seconds: float
    buffer_bytes: int  # the most memory the export's buffers held at once


@dataclass(frozen=True, slots=True)
class _Tensor:
    name: str  # the Hugging Face name
    record: ArrayRecord
    dtype: str  # as exported

    @property
    def nbytes(self) -> int:
        return self.record.numel * itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class _Piece:
    """Rows ``[lo, hi)`` of a tensor (all of a 0-d one)."""

    tensor: _Tensor
    lo: int
    hi: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self.tensor.record.shape
        return (self.hi - self.lo, *shape[1:]) if shape else ()

    @property
    def stored_bytes(self) -> int:
        return _numel(self.shape) * itemsize(self.tensor.record.dtype)

    @property
    def exported_bytes(self) -> int:
        return _numel(self.shape) * itemsize(self.tensor.dtype)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row as exported (0 for a 0-d tensor, whose one piece starts where it does)."""
        shape = self.tensor.record.shape
        return _numel(shape[1:]) * itemsize(self.tensor.dtype) if shape else 0


def export(
    source: str | os.PathLike[str],
    to: str | os.PathLike[str],
    *,
    step: int | None = None,
    only: Iterable[str] = ("model",),
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    drop_prefix: str | None = None,
    names: NameMap | None = None,
    include: Iterable[str | os.PathLike[str]] = (),
    storage_options: dict[str, Any] | None = None,
    io_threads: int = 4,
    buffer_bytes: int = 64 << 20,
    progress: Callable[[int, int], None] | None = None,
) -> ExportResult:
    """Write step ``step`` (the newest where None) of the checkpoint at ``source`` as a Hugging Face
    safetensors directory ``to``: ``model-0000k-of-0000n.safetensors`` of at most ``max_shard_size``
    each (a tensor larger than that alone in its file) and ``model.safetensors.index.json``, or one
    ``model.safetensors``; ``to`` must not exist, or be empty.

    ``source`` is a local directory holding every rank's chunks, or a remote URL (``s3://``,
    ``az://``, ``file://``; ``storage_options`` go to fsspec). ``only``: the top-level entries of
    the saved state to export (optimizer state only when named). ``dtype``: floating tensors
    converted to it (``"bfloat16"``...). Names are mapped by ``drop_prefix`` and ``names``
    (``hf.names``). ``include``: files copied in beside the shards (``config.json``, the
    tokenizer's), which ``from_pretrained`` needs. ``progress(done, total)`` is called with bytes.
    """
    started = time.monotonic()
    only = tuple(only)
    out_dtype = _dtype_name(dtype)
    limit = parse_size(max_shard_size)
    tier, step, manifest, marker = open_step(source, step, storage_options=storage_options)
    where = f"{tier.url}: step {step}"
    chosen = exported_arrays(manifest, only, drop_prefix=drop_prefix, names=names, where=where)
    check_extents(tier, step, {p: manifest.arrays[p] for p in chosen.values()}, where=where)
    tensors = [_Tensor(hf, rec, _cast_to(rec.dtype, out_dtype)) for hf, path in chosen.items()
               for rec in (manifest.arrays[path],)]  # fmt: skip
    if not tensors:
        raise IncompatibleStateError(f"{where}: the entries {', '.join(map(repr, only))} hold no tensor to export")
    if METADATA_KEY in chosen:
        raise IncompatibleStateError(
            f"{where}: {chosen[METADATA_KEY]} would be exported as {METADATA_KEY!r}, the name safetensors keeps for "
            "a file's metadata (no reader could open the file): give it another name with names="
        )
    shards = _shards(tensors, limit)
    extras = [Path(e) for e in include]
    taken = {shard_name(i, len(shards)) for i in range(len(shards))} | {INDEX_FILE}
    if clash := sorted({e.name for e in extras} & taken):
        raise ValueError(f"include: {clash[0]} would replace a file of the export")
    target = _check_target(Path(to))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tiercheck-{secrets.token_hex(4)}"
    tmp.mkdir()
    out = LocalTier(tmp, fsync=True, direct_io=True)  # every file synced; shards' whole blocks with O_DIRECT
    reader = _Reader(tier, step, manifest.arrays, marker, io_threads=io_threads, buffer_bytes=buffer_bytes)
    total = sum(t.nbytes for t in tensors)
    report = progress or (lambda done, total: None)
    try:
        files, weight_map = [], {}
        done = 0
        for i, shard in enumerate(shards):
            name = shard_name(i, len(shards))
            done = _write_shard(out, name, shard, reader, meta={"format": "pt"}, report=report, done=done, total=total)
            files.append(name)
            weight_map.update(dict.fromkeys((t.name for t in shard), name))
        if len(shards) > 1:
            out.write(INDEX_FILE, [index_document(weight_map, total)])
        for extra in extras:
            out.write(extra.name, [read_regular(extra)])  # a link to a file is followed; a FIFO is refused
        out.sync_dirs("")
        if target.exists():
            target.rmdir()  # empty, checked above: rename replaces only what is not there
        os.rename(tmp, target)
        LocalTier(target.parent, fsync=True).sync_dirs(target.name)  # the parent's entry for it
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        reader.close()
    _remove_leftovers(target)
    return ExportResult(
        directory=str(target), step=step, files=files, tensors=len(tensors), total_size=total,
        seconds=time.monotonic() - started, buffer_bytes=reader.peak_bytes,
    )  # fmt: skip


def _check_target(target: Path) -> Path:
    """``target``, if an export may become it: a new path or an empty directory, never a symbolic link."""
    if target.is_symlink():  # written through, the export would land wherever the link points
        raise InvalidArgumentError(
            f"{target}: is a symbolic link (to {os.readlink(target)}); export writes its directory itself and "
            "never through a link: give a new path, or the directory the link points to"
        )
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{target}: exists and is not an empty directory; give a new one")
    return target


def _remove_leftovers(target: Path) -> None:
    """The hidden directories that exports to ``target`` killed before their rename left beside it: now that
    this one holds the name, none of them can ever be renamed to it."""
    left = re.compile(rf"\.{re.escape(target.name)}\.tiercheck-[0-9a-f]{{8}}")
    for entry in os.scandir(target.parent):
        if left.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)


def _dtype_name(dtype: str | torch.dtype | None) -> str | None:
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in CASTABLE:
        raise ValueError(f"dtype {name!r}: export converts to one of {', '.join(CASTABLE)}")
    return name


def _cast_to(stored: str, out: str | None) -> str:
    return out if out is not None and stored in CASTABLE else stored


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _shards(tensors: list[_Tensor], limit: int) -> list[list[_Tensor]]:
    """Tensors in order, cut into files of at most ``limit`` bytes (as ``save_pretrained`` does)."""
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _write_shard(
    out: LocalTier,
    name: str,
    shard: list[_Tensor],
    reader: _Reader,
    *,
    meta: dict[str, str],
    report: Callable[[int, int], None],
    done: int,
    total: int,
) -> int:
    """One file, under a temporary name until it is whole and synced; returns the bytes done so far.

    Its tensors go in by itemsize, largest first (as the safetensors library orders them), so each
    starts at a multiple of its itemsize and is read or cast straight into its place in a batch
    laid out as the file's bytes. The batches are written through the local tier's pack writer:
    whole blocks with O_DIRECT (no copy into the page cache, no dirty pages for the final fsync to
    flush; 0.6 s of copying and 0.75 s of syncs for 1.1 GiB through the cache), the ends of each
    batch through the page cache."""
    shard = sorted(shard, key=lambda t: -itemsize(t.dtype))
    header = encode_header([(t.name, t.dtype, t.record.shape, t.nbytes) for t in shard], meta)
    starts, pos = {}, len(header)
    for t in shard:
        starts[t.name], pos = pos, pos + t.nbytes
    part = name + ".partial"
    pack = out.open_pack(part)
    try:
        pack.write_at(0, [header])
        with ThreadPoolExecutor(1, thread_name_prefix="tiercheck-export") as writer:
            pending: Future[None] | None = None
            for batch, at, data in reader.batches(_pieces(shard, reader.buffer_bytes), starts):
                if pending is not None:
                    pending.result()
                pending = writer.submit(pack.write_at, at, [data.numpy().data])
                done += sum(p.exported_bytes for p in batch)
                report(done, total)
            if pending is not None:
                pending.result()
    finally:
        pack.close()
    os.rename(out.root / part, out.root / name)
    return done


def _pieces(shard: list[_Tensor], budget: int) -> Iterator[_Piece]:
    """Each tensor in bands of whole chunk rows, as many rows as fit ``budget`` (one band at least)."""
    for t in shard:
        rec = t.record
        if not rec.shape:
            yield _Piece(t, 0, 1)
            continue
        band = rec.chunks[0]
        row_bytes = _numel(rec.shape[1:]) * itemsize(rec.dtype)
        rows = max(band, budget // max(row_bytes, 1) // band * band)
        for lo in range(0, rec.shape[0], rows):
            yield _Piece(t, lo, min(rec.shape[0], lo + rows))
        if rec.shape[0] == 0:
            yield _Piece(t, 0, 0)


class _Reader:
    """Pieces read into two alternating buffers (one being filled while the other is written)."""

    def __init__(
        self,
        tier: Tier,
        step: int,
        records: dict[str, ArrayRecord],
        marker: CommitMarker,
        *,
        io_threads: int,
        buffer_bytes: int,
    ) -> None:
        self.tier, self.step, self.records, self.io_threads = tier, step, records, io_threads
        self.holders = frozenset(marker.ranks)
        self.buffer_bytes = buffer_bytes
        self._buffers: list[list[torch.Tensor]] = [[torch.empty(0, dtype=torch.uint8)] * 2 for _ in range(2)]
        self._turn = 0
        self.peak_bytes = 0

    def _buffer(self, which: int, nbytes: int) -> torch.Tensor:
        """The turn's buffer ``which`` (0: as stored, for pieces cast; 1: the file's bytes, page-aligned),
        grown to ``nbytes``."""
        bufs = self._buffers[self._turn]
        if bufs[which].numel() < nbytes:
            bufs[which] = aligned_empty(nbytes)
            self.peak_bytes = max(self.peak_bytes, sum(b.numel() for pair in self._buffers for b in pair))
        return bufs[which]

    def batches(
        self, pieces: Iterable[_Piece], starts: dict[str, int]
    ) -> Iterator[tuple[list[_Piece], int, torch.Tensor]]:
        """Pieces grouped up to the buffer's size, each group read and verified: with where its bytes
        go in the file (``starts``: each tensor's offset there) and the bytes (a view of this turn's
        buffer, valid until the turn after next)."""
        batch: list[_Piece] = []
        size = 0
        for piece in pieces:
            n = piece.exported_bytes
            if batch and size + n > self.buffer_bytes:
                yield batch, *self._read(batch, starts)
                batch, size = [], 0
            batch.append(piece)
            size += n
        if batch:
            yield batch, *self._read(batch, starts)

    def _read(self, batch: list[_Piece], starts: dict[str, int]) -> tuple[int, torch.Tensor]:
        first, last = batch[0], batch[-1]
        begin = starts[first.tensor.name] + first.lo * first.row_bytes
        end = starts[last.tensor.name] + last.lo * last.row_bytes + last.exported_bytes
        lead = begin % BLOCK  # the buffer sits on the file's blocks: O_DIRECT takes the whole ones
        out = self._buffer(1, lead + end - begin)
        casts = [p for p in batch if p.tensor.dtype != p.tensor.record.dtype]
        stored = self._buffer(0, sum(_aligned(p.stored_bytes) for p in casts)) if casts else None
        regions: list[Region] = []
        copies, pos = [], 0
        for p in batch:
            rec = p.tensor.record
            at = lead + starts[p.tensor.name] + p.lo * p.row_bytes - begin
            dest = out[at : at + p.exported_bytes].view(torch_dtype(p.tensor.dtype)).view(p.shape)
            if p.tensor.dtype != rec.dtype:
                assert stored is not None
                view = stored[pos : pos + p.stored_bytes].view(torch_dtype(rec.dtype)).view(p.shape)
                pos += _aligned(p.stored_bytes)
                copies.append((dest, view))
                dest = view
            if dest.numel():
                offsets = (p.lo, *([0] * (len(rec.shape) - 1))) if rec.shape else ()
                regions.append((rec, dest, offsets))
        read_regions(self.tier, self.step, regions, holders=self.holders, io_threads=self.io_threads)
        for dest, view in copies:
            dest.copy_(view)
        self._turn ^= 1
        return begin, out[lead : lead + end - begin]

    def close(self) -> None:
        self._buffers = []


def _aligned(n: int) -> int:
    return -(-n // 64) * 64
