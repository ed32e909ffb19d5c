"""Block patterns: the ranks holding equal slices of the same arrays post them once, and hear once.

A distributed optimizer's flat buffers (Megatron), FSDP2's dim-0 shards and tensor-parallel weights
are each cut along one dimension into equal blocks, one rank (or one group of replicas) a block.
Each such rank's pieces differ from the next's by their offset alone, so in a plan that posted
exact pieces (``save.plan``'s first round) every one of them was a description of its own, and its
coordinator wrote an offer for each: at 1,024 data-parallel ranks, 1,024 of both for one buffer.

As a pattern, a rank's group of pieces for one coordinator is posted as block 0 (every offset
zero, ``Pattern.leaves``), so every rank cutting the arrays alike posts the same description under
the same digest, and it appends ``rank:block`` to the digest's register where it appended its
rank. The coordinator places each piece back (``place``) and lays the arrays out as before. Where
every holder's chunks and their holders are those of the first holder's block moved along the
cut dimension (by ``per`` chunks a block) and their ranks by a fixed ``step`` a block, it writes
one offer for all of them, each array with that ``shift`` (``pattern_offer``): a Megatron buffer
split over 1,024 ranks costs one description, one offer and 1,024 register entries of a few bytes.
Where they are not (an uneven layout), it offers the holders of each block their chunks under a
key of the block's, as exact pieces are offered (``EACH``): never more offers than exact pieces
would have cost. The pieces and chunks a plan ends with are the same either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from tiercheck.cluster.assign import LeafDesc
from tiercheck.errors import CoordinationError
from tiercheck.format.manifest import ArrayRecord
from tiercheck.save.messages import ArrayOffer, Shift

EACH = "each"  # a pattern's offer where the holders of each block are offered theirs apart
Grouped = tuple[tuple[int, ...], tuple[int, ...]]  # a chunk's grid position, its holders (decoded)


@dataclass(frozen=True, slots=True)
class Pattern:
    """A rank's group of pieces as block 0 of a pattern (``as_pattern``), and its block."""

    leaves: tuple[LeafDesc, ...]
    block: int


def cut_dim(d: LeafDesc) -> int | None:
    """The one dimension a pattern's piece is cut on (None: it is the whole array)."""
    cut = [i for i, (n, g) in enumerate(zip(d.shape, d.global_shape, strict=True)) if n != g]
    return cut[0] if cut else None


def as_pattern(leaves: Sequence[LeafDesc]) -> Pattern | None:
    """``leaves`` as a pattern: each whole, or cut along one dimension at a multiple of its own
    extent there (block ``k`` of blocks that long), the same ``k`` for all; None where some
    piece is not such a block (cut along several dimensions, or empty), or every one is whole."""
    block: int | None = None
    out = []
    for d in leaves:
        boxes = zip(d.offsets, d.shape, d.global_shape, strict=True)
        cut = [i for i, (o, n, g) in enumerate(boxes) if (o, n) != (0, g)]
        if not cut:
            out.append(d)
            continue
        if len(cut) > 1:
            return None
        o, n = d.offsets[cut[0]], d.shape[cut[0]]
        if n == 0 or o % n or (block is not None and o // n != block):
            return None
        block = o // n
        out.append(replace(d, offsets=(0,) * len(d.offsets)))
    return None if block is None else Pattern(tuple(out), block)


def place(d: LeafDesc, block: int) -> LeafDesc:
    """A pattern's piece as block ``block`` of its array."""
    dim = cut_dim(d)
    if dim is None:
        return d
    offsets = list(d.offsets)
    offsets[dim] = block * d.shape[dim]
    return replace(d, offsets=tuple(offsets))


def pattern_offer(
    body: Sequence[LeafDesc],
    held: Sequence[tuple[int, int]],
    records: Mapping[str, ArrayRecord],
    chunks_of: Mapping[int, Mapping[str, list[Grouped]]],
) -> dict[str, ArrayOffer] | None:
    """The one offer for every holder ``(rank, block)`` of a pattern whose pieces are ``body``:
    each array's chunks as the first holder's block holds them, and how to move them to another
    block (``ArrayOffer.shift``). ``chunks_of``: each holder's chunks of each array as laid out,
    with their holders. None where some holder's chunks are not the first's moved so (an uneven
    layout: each block's holders are then offered theirs)."""
    r0, k0 = held[0]
    arrays: dict[str, ArrayOffer] = {}
    for d in body:
        rec, ref = records[d.path], chunks_of[r0][d.path]
        dim = cut_dim(d)
        if dim is None:  # a whole array: its chunks and their holders, the same for every holder
            arrays[d.path] = ArrayOffer.of(rec, tuple(ref))
            continue
        if rec.chunks[dim] == 0 or d.shape[dim] % rec.chunks[dim] or not ref:
            return None
        per = d.shape[dim] // rec.chunks[dim]
        step = _step(d.path, ref, held, chunks_of)
        if step is None:
            return None
        # The holders of one block hold the same pieces (one digest, one block): its first stands for
        # them all, so this is checked once a block, never once a replica of a block.
        for k, r in {k: r for r, k in reversed(held)}.items():
            moved = [(_moved(cc, dim, (k - k0) * per), tuple(h + (k - k0) * step for h in hs)) for cc, hs in ref]
            if moved != chunks_of[r][d.path]:
                return None
        arrays[d.path] = ArrayOffer.of(rec, tuple(ref), shift=Shift(dim, k0, per, step))
    return arrays


def _step(
    path: str, ref: list[Grouped], held: Sequence[tuple[int, int]], chunks_of: Mapping[int, Mapping[str, list[Grouped]]]
) -> int | None:
    """How far the holders of a block's first chunk move, in ranks, from one block to the next (0
    where every holder holds the first holder's block); None where it is not a whole number."""
    k0 = held[0][1]
    for r, k in held:
        if k != k0:
            theirs = chunks_of[r][path]
            if not theirs:
                return None
            dist = theirs[0][1][0] - ref[0][1][0]
            return dist // (k - k0) if dist % (k - k0) == 0 else None
    return 0


def _moved(cc: tuple[int, ...], dim: int, by: int) -> tuple[int, ...]:
    return (*cc[:dim], cc[dim] + by, *cc[dim + 1 :])


def apply_shift(
    offer: ArrayOffer,
    chunks: list[Grouped],
    block: int,
    *,
    world: int,
    where: str,
    moved_groups: dict[tuple[tuple[int, ...], int], tuple[int, ...]] | None = None,
) -> list[Grouped]:
    """A pattern's chunks as the holder of ``block`` holds them (``offer.shift``), each checked
    against the array's grid and its holders against the world size. ``moved_groups``: groups
    moved so far, shared (a group of 1,024 replicas is moved once, not once a chunk)."""
    if offer.shift is None:
        return chunks
    dim, k0, per, step = offer.shift.dim, offer.shift.block, offer.shift.per, offer.shift.step
    rows = -(-offer.shape[dim] // offer.grid[dim]) if offer.grid[dim] else 0
    by = (block - k0) * step
    cache = {} if moved_groups is None else moved_groups
    out = []
    for cc, hs in chunks:
        moved = _moved(cc, dim, (block - k0) * per)
        holders = cache.get((hs, by))
        if holders is None:
            holders = cache[hs, by] = tuple(h + by for h in hs)
        if not 0 <= moved[dim] < rows or not holders or holders[0] < 0 or holders[-1] >= world:  # groups: sorted
            raise CoordinationError(
                f"{where}: a pattern's chunk {list(cc)} moved to block {block} lies outside the array or the job: "
                f"{list(moved)}, ranks {list(holders)}"
            )
        out.append((moved, holders))
    return out
