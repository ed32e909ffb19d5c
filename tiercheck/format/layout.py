"""Chunk geometry of one array: how a global shape is cut into zarr chunks.

Pure Python on purpose (no torch): storage, planning and tests share it.

Zarr v3's regular grid stores every chunk at full chunk shape, the edge ones padded. We pick
chunk shapes that split a dimension into near-equal parts, so padding stays under one row per
chunk, and cut only as deep into the dimensions as the target size requires.
"""


from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

Shape = tuple[int, ...]


def chunk_shape(shape: Sequence[int], itemsize: int, target_bytes: int) -> Shape:
    """The chunk shape for an array of ``shape``: chunks of at most ``target_bytes`` where possible.

    Leading dimensions are cut first (chunks stay contiguous in C order); a dimension is cut into
    near-equal parts; dimensions after the cut one are kept whole. A 0-d array has chunk ``()``;
    an empty array gets a chunk of its non-zero extents (it stores no chunk at all).
    """
    shape = tuple(int(d) for d in shape)
    if not shape:
        return ()
    if any(d == 0 for d in shape):
        return tuple(max(d, 1) for d in shape)
    chunk = list(shape)
    for i, extent in enumerate(shape):
        row_bytes = itemsize * math.prod(shape[i + 1 :])
        if row_bytes * extent <= target_bytes:
            break  # this dimension and all after it fit whole
        if row_bytes <= target_bytes:
            parts = ceil_div(extent * row_bytes, target_bytes)
            chunk[i] = ceil_div(extent, parts)
            break
        chunk[i] = 1  # one index of this dimension is still too big: cut deeper
    return tuple(chunk)


def ceil_div(a: int, b: int) -> int:
    """Integer ceiling of ``a / b``: exact for any size (float division is not, past 2**53, and
    overflows past 1e308: a hostile chunk extent of 10**400 read as zero chunks)."""
    return -(-a // b)


MAX_CHUNKS = 1 << 24
"""Chunks in one array's grid, at most: each has a checksum in a manifest file (capped at
256 MiB, ~20 bytes a checksum), and restore walks the grid. A grid beyond it is refused on
save (with the sharding named) and on load (a hostile record of 2**48 one-element chunks)."""


def grid_size(shape: Sequence[int], chunk: Sequence[int]) -> int:
    """How many chunks the grid has, without walking it (integer math)."""
    if any(d == 0 for d in shape):
        return 0
    return math.prod(ceil_div(d, c) for d, c in zip(shape, chunk, strict=True))


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of an array: its grid coordinates and the part of the array it holds."""

    coords: tuple[int, ...]
    starts: tuple[int, ...]
    stops: tuple[int, ...]

    @property
    def valid_shape(self) -> Shape:
        """Extent of real data in this chunk (smaller than the chunk shape at the edges)."""
        return tuple(b - a for a, b in zip(self.starts, self.stops, strict=True))

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in zip(self.starts, self.stops, strict=True))

    @property
    def key(self) -> str:
        """The chunk's key under the array: zarr v3's default encoding with "." as separator, so a
        chunk is a file right in its array's directory (no directory per grid row to create and fsync)."""
        return chunk_key(self.coords)


@functools.lru_cache(maxsize=1 << 16)
def chunk_key(coords: tuple[int, ...]) -> str:
    """A chunk's key from its grid coordinates (see ``Chunk.key``). Most arrays have a chunk or a
    few, at the same coordinates, and a restore asks for each key several times: they are kept."""
    return ".".join(["c", *map(str, coords)])


def is_chunk_key(key: str, shape: Sequence[int], chunk: Sequence[int]) -> bool:
    """Whether ``key`` is the key of a chunk of this grid (``chunk_key`` of coordinates inside
    it): any other string (``../../outside/c.0``, ``c.00``, another script's digits) is none."""
    parts = key.split(".")
    if parts[0] != "c" or len(parts) != len(shape) + 1:
        return False
    coords = parts[1:]
    if not all(c.isascii() and c.isdigit() and (c == "0" or not c.startswith("0")) for c in coords):
        return False
    return all(int(c) < ceil_div(d, n) for c, d, n in zip(coords, shape, chunk, strict=True))


def chunk_at(shape: Sequence[int], chunk: Sequence[int], coords: tuple[int, ...]) -> Chunk:
    """The chunk at grid position ``coords``."""
    starts = tuple(i * c for i, c in zip(coords, chunk, strict=True))
    stops = tuple(min(s + c, d) for s, c, d in zip(starts, chunk, shape, strict=True))
    return Chunk(coords=coords, starts=starts, stops=stops)


def chunks(shape: Sequence[int], chunk: Sequence[int]) -> Iterator[Chunk]:
    """Every chunk of the grid in C order. An empty array has none; a 0-d array has one."""
    shape = tuple(shape)
    if any(d == 0 for d in shape):
        return
    counts = [ceil_div(d, c) for d, c in zip(shape, chunk, strict=True)]
    for coords in itertools.product(*(range(n) for n in counts)):
        starts = tuple(i * c for i, c in zip(coords, chunk, strict=True))
        stops = tuple(min(s + c, d) for s, c, d in zip(starts, chunk, shape, strict=True))
        yield Chunk(coords=tuple(coords), starts=starts, stops=stops)


def is_edge(chunk: Chunk, chunk_shape: Sequence[int]) -> bool:
    """Whether the chunk holds less than a full chunk of data (and so is padded on storage)."""
    return chunk.valid_shape != tuple(chunk_shape)


# ------------------------------------------------------------------------------ sharded arrays


def grid_for_boxes(
    shape: Sequence[int],
    boxes: Sequence[tuple[Sequence[int], Sequence[int]]],
    itemsize: int,
    target_bytes: int,
) -> Shape:
    """A chunk shape for a global array whose pieces (``(offsets, extents)`` boxes) live on
    different ranks: every chunk lies inside each box it touches, so one rank can write it.

    Along a dimension that boxes cut, the chunk extent divides every cut position (their gcd);
    elsewhere it is free, as in :func:`chunk_shape`. Within that, chunks stay near the target.
    """
    shape = tuple(int(d) for d in shape)
    if not shape or any(d == 0 for d in shape):
        return chunk_shape(shape, itemsize, target_bytes)
    cuts: list[int] = [0] * len(shape)  # gcd of cut positions per dimension; 0 when uncut
    for offsets, extents in boxes:
        for d, (o, n) in enumerate(zip(offsets, extents, strict=True)):
            for pos in (o, o + n):
                if 0 < pos < shape[d]:
                    cuts[d] = math.gcd(cuts[d], pos)
    block = [g or d for g, d in zip(cuts, shape, strict=True)]
    chunk = list(block)
    for i in range(len(shape)):
        row_bytes = itemsize * math.prod(chunk[i + 1 :])
        if row_bytes * chunk[i] <= target_bytes:
            break
        if row_bytes <= target_bytes:
            rows = max(target_bytes // row_bytes, 1)
            if cuts[i]:
                chunk[i] = _largest_divisor_at_most(block[i], rows)
                if chunk[i] * 4 < rows and block[i] * row_bytes <= 4 * target_bytes:
                    chunk[i] = block[i]  # an awkward divisor: one larger chunk beats many tiny ones
            else:
                chunk[i] = ceil_div(block[i], ceil_div(block[i], rows))
            break
        chunk[i] = 1
    return tuple(chunk)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    best = 1
    for a in range(1, math.isqrt(n) + 1):
        if n % a == 0:
            for d in (a, n // a):
                if best < d <= limit:
                    best = d
    return best


def chunks_in_box(
    shape: Sequence[int], chunk: Sequence[int], offsets: Sequence[int], extents: Sequence[int]
) -> Iterator[Chunk]:
    """The chunks of the grid that intersect the box, in C order."""
    if any(n == 0 for n in extents) or any(d == 0 for d in shape):
        return
    ranges = [range(o // c, ceil_div(o + n, c)) for o, n, c in zip(offsets, extents, chunk, strict=True)]
    for coords in itertools.product(*ranges):
        starts = tuple(i * c for i, c in zip(coords, chunk, strict=True))
        stops = tuple(min(s + c, d) for s, c, d in zip(starts, chunk, shape, strict=True))
        yield Chunk(coords=tuple(coords), starts=starts, stops=stops)


def overlap(
    a_starts: Sequence[int], a_stops: Sequence[int], b_starts: Sequence[int], b_stops: Sequence[int]
) -> tuple[Shape, Shape] | None:
    """The intersection of two boxes as ``(starts, stops)``, or None when they do not meet."""
    starts = tuple(max(a, b) for a, b in zip(a_starts, b_starts, strict=True))
    stops = tuple(min(a, b) for a, b in zip(a_stops, b_stops, strict=True))
    if any(s >= e for s, e in zip(starts, stops, strict=True)) and starts:
        return None
    return starts, stops
