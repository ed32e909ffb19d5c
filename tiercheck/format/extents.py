"""Whether the sizes and places a step's manifest gives its chunks are backed by the step: the one
home of the extent checks that ``load``, ``verify`` and a restore run, so that the three agree.

A manifest file can be re-sealed by whoever edits it, so its checksum says nothing of its sense.
Three things hold for any step tiercheck wrote, and are checked before a buffer is sized from a
record or a chunk is read at an offset:

- each array's chunks are as many bytes as its record makes them (elements times the itemsize of
  its dtype), the size its writer's part gives (``check_sizes``): a record relabelling its dtype
  to one of another width is caught here, wherever the part is read;
- no two chunks of a pack overlap (``check_pack``, per rank part, which is all a restoring rank
  reads of a pack's layout; ``check_extents`` over a whole manifest's records): a chunk given
  another chunk's offset and checksum reads that chunk's bytes, and they check out;
- every chunk lies inside the file holding it (``check_extents``: one byte read per file).

Nothing here sees a tensor.
"""

from __future__ import annotations

import errno
import itertools
from collections import defaultdict
from collections.abc import Mapping

from tiercheck.errors import CorruptCheckpointError, TiercheckError
from tiercheck.format.codec import CHECKSUM_BYTES, STORAGE_DTYPES, chunk_nbytes
from tiercheck.format.layout import grid_size, is_chunk_key
from tiercheck.format.manifest import ArrayRecord, RankPart
from tiercheck.format.paths import pack_file, pack_owner, part_file, step_dir
from tiercheck.tiers.base import Tier

#: A chunk's extent in its file: offset, bytes (data and checksum), array path, chunk key.
Extent = tuple[int, int, str, str]


def check_spans(file: str, spans: list[Extent], *, where: str, source: str = "") -> None:
    """No two of the chunks ``spans`` (sorted here) overlap in ``file``: ``CorruptCheckpointError``
    naming both, and ``source`` (where their offsets were read) when given."""
    spans.sort()
    for (o, n, p, k), (o2, _, p2, k2) in itertools.pairwise(spans):
        if o + n > o2:
            raise CorruptCheckpointError(
                f"{where}: {file}: array {p!r} chunk {k} (offset {o:,}, {n:,} bytes) overlaps "
                f"array {p2!r} chunk {k2} (offset {o2:,}){f' ({source})' if source else ''}"
            )


def check_pack(part: RankPart, rank: int, *, where: str) -> None:
    """No two chunks saving rank ``rank``'s ``part`` places in its pack overlap there. One sort
    of the part's chunks."""
    spans = [
        (offset, part.chunk_bytes[path] + CHECKSUM_BYTES, path, key)
        for path, by_key in part.offsets.items()
        for key, offset in by_key.items()
    ]
    check_spans(pack_file(rank), spans, where=where, source=f"the offsets in {part_file(rank)}")


def check_sizes(part: RankPart, rank: int, records: Mapping[str, ArrayRecord], *, where: str) -> None:
    """Each array of ``records`` whose chunks saving rank ``rank``'s ``part`` sizes has chunks of
    the size its record makes them: elements times its dtype's itemsize. Looks up the fewer of the
    two in the other (a whole step's parts against all its records: each once)."""
    sizes = part.chunk_bytes
    for path in sizes if len(sizes) <= len(records) else records:
        size, rec = sizes.get(path), records.get(path)
        if size is None or rec is None or rec.dtype not in STORAGE_DTYPES:  # an unknown dtype: refused where used
            continue
        want = chunk_nbytes(rec)
        if size != want:
            raise CorruptCheckpointError(
                f"{where}: {part_file(rank)}: array {path!r}: rank {rank}'s part gives chunks of {size:,} bytes, "
                f"its record ({rec.dtype}, chunks {list(rec.chunks)}) {want:,} (the part's nbytes against the "
                "dtype and chunks in the array's arrays file)"
            )


def check_extents(tier: Tier, step: int, arrays: Mapping[str, ArrayRecord], *, where: str) -> None:
    """Every chunk of ``arrays`` is one of its grid's, each grid chunk is named, and each lies
    inside the file holding it, no two overlapping in a pack: ``CorruptCheckpointError`` naming
    the file and the field when not. A reader sizing buffers from these records (a fresh ``load``
    allocates whole arrays) then allocates at most what the step's files hold: an arrays file
    declaring 600 million elements beside a pack of 16 KiB is refused here, before any buffer.
    One read of a byte per file (its last needed one), no listing."""
    spans: dict[str, list[Extent]] = defaultdict(list)
    for rec in arrays.values():
        n = chunk_nbytes(rec) + CHECKSUM_BYTES
        grid = grid_size(rec.shape, rec.chunks)
        if len(rec.checksums) != grid or not all(is_chunk_key(k, rec.shape, rec.chunks) for k in rec.checksums):
            raise CorruptCheckpointError(
                f"{where}: array {rec.path!r}: the manifest names {len(rec.checksums):,} chunks, not the "
                f"{grid:,} of its shape {list(rec.shape)} and chunks {list(rec.chunks)}"
            )
        for key in rec.checksums:
            file, offset = rec.location(key)
            spans[file].append((offset, n, rec.path, key))
    d = step_dir(step)
    for file, ss in sorted(spans.items()):
        check_spans(file, ss, where=where)
        o, n, p, k = ss[-1]
        try:
            there = len(tier.read_range(f"{d}/{file}", o + n - 1, 1)) == 1
        except TiercheckError:  # a symbolic link in its place: refused as what it is
            raise
        except FileNotFoundError:
            kind = "pack" if pack_owner(file) is not None else "chunk"
            missing = f"{where}: array {p!r} chunk {k}: its {kind} file is missing ({file})"
            raise CorruptCheckpointError(missing) from None
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOVERFLOW):  # an offset past any file a system can hold
                raise CorruptCheckpointError(f"{where}: cannot read {file}: {e.strerror or e}") from None
            there = False
        if not there:
            raise CorruptCheckpointError(
                f"{where}: array {p!r} chunk {k}: its {n:,} bytes at offset {o:,} (the manifest's dtype, "
                f"chunks and offset) run past the end of {file} (truncated or damaged)"
            )
