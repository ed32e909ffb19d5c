"""What saving ranks send each other through the store, one frozen dataclass per message, each
with ``to_json``/``from_json`` (as ``restore.messages`` on the restore side; the pieces a rank
posts in the first round of a plan are ``cluster.assign.LeafDesc``).

A message is checked field by field when it is parsed (``cluster.wire``): one that is not what it
should be fails with ``CoordinationError`` naming its store key and the field. The JSON is what the
plan always sent, compact positional lists where a message is sent once per chunk: its size is
part of every rank's flat cost (``bench/scale_sim.py``).

Rounds of a save plan (``save.plan``), and what each sends:

- posting pieces: each rank posts each coordinator of its arrays one ``PiecesPost`` per group of
  pieces (replicas post it once, and append their ranks to its register: ``wire.as_register``);
- offering chunks: each coordinator sets one ``ChunkOffer`` per group of holders of the same pieces;
- taking a share: each rank posts each coordinator whose chunks it took a ``TookPost``.

Committing a save (``save.vote``): rank 0 sets the step's ``CommitMeta`` for every node leader.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiercheck.cluster.assign import LeafDesc
from tiercheck.cluster.wire import as_dict, as_float, as_list, as_rank, as_ranks, as_str, bad
from tiercheck.format.manifest import JSON, ArrayRecord

# -------------------------------------------------------------------------------- the save plan


@dataclass(frozen=True, slots=True)
class PiecesPost:
    """A group of a rank's pieces of the arrays one coordinator lays out, under the group's digest
    (the same on every replica holding them): ``[digest, [piece, ...]]``."""

    digest: str
    pieces: tuple[LeafDesc, ...]

    def to_json(self) -> list[object]:
        return [self.digest, [d.to_json() for d in self.pieces]]

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> PiecesPost:
        digest, pieces = as_list(doc, where, "post", 2)
        posted = as_list(pieces, where, "pieces")
        return cls(
            as_str(digest, where, "digest"),
            tuple(LeafDesc.from_json(d, where=where, field=f"pieces[{i}]") for i, d in enumerate(posted)),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ArrayOffer:
    """One array as its coordinator laid it out, to one group of holders: its record's shape (no
    owners) and the chunks the group holds, each by grid position with the full group of ranks
    holding it (``save.plan._encode_ranks``: the ranks, ``[-1, start, stride, count]`` or runs)."""

    dtype: str
    kind: str
    shape: tuple[int, ...]
    grid: tuple[int, ...]  # the chunk shape
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (grid position, encoded holders)

    @classmethod
    def of(cls, rec: ArrayRecord, chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]) -> ArrayOffer:
        return cls(dtype=rec.dtype, kind=rec.kind, shape=rec.shape, grid=rec.chunks, chunks=chunks)

    def record(self, path: str) -> ArrayRecord:
        return ArrayRecord(path=path, dtype=self.dtype, kind=self.kind, shape=self.shape, chunks=self.grid)

    def to_json(self) -> list[JSON]:
        short: list[JSON] = [self.dtype, self.kind, list(self.shape), list(self.grid)]
        return [short, [[list(cc), list(group)] for cc, group in self.chunks]]

    @classmethod
    def from_json(cls, doc: object, *, where: str, field: str) -> ArrayOffer:
        short, chunks = as_list(doc, where, field, 2)
        dtype, kind, shape, grid = as_list(short, where, f"{field}[0]", 4)
        offered = []
        for i, c in enumerate(as_list(chunks, where, f"{field}[1]")):
            f = f"{field}[1][{i}]"
            cc, group = as_list(c, where, f, 2)
            offered.append((as_ranks(cc, where, f"{f}[0]"), _group(group, where, f"{f}[1]")))
        return cls(
            dtype=as_str(dtype, where, f"{field}[0][0]"),
            kind=as_str(kind, where, f"{field}[0][1]"),
            shape=as_ranks(shape, where, f"{field}[0][2]"),
            grid=as_ranks(grid, where, f"{field}[0][3]"),
            chunks=tuple(offered),
        )


def _group(v: object, where: str, field: str) -> tuple[int, ...]:
    """An encoded group of holders: ranks, ``[-1, start, stride, count]`` or ``[-2, *runs]``
    (runs of four numbers, ``cluster.ranksets``). Its ranks are checked against the world size
    where the plan decodes it."""
    items = as_list(v, where, field)
    if items[:1] == [-1]:
        if len(items) != 4:
            raise bad(where, field, "[-1, start, stride, count]", v)
        return (-1, *as_ranks(items[1:], where, field))
    if items[:1] == [-2]:
        if len(items) % 4 != 1:
            raise bad(where, field, "[-2, start, length, stride, count, ...]", v)
        return (-2, *as_ranks(items[1:], where, field))
    return as_ranks(items, where, field)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkOffer:
    """A coordinator's offer to one group of holders of the same pieces: each of their arrays it
    coordinates (every holder hears of an array, even of an empty piece)."""

    arrays: dict[str, ArrayOffer]

    def to_json(self) -> dict[str, JSON]:
        return {path: a.to_json() for path, a in self.arrays.items()}

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> ChunkOffer:
        d = as_dict(doc, where, "offer")
        return cls(arrays={path: ArrayOffer.from_json(a, where=where, field=path) for path, a in d.items()})


@dataclass(frozen=True, slots=True, kw_only=True)
class TookPost:
    """What one rank took of one coordinator's chunks: their grid positions, by array."""

    rank: int
    took: dict[str, tuple[tuple[int, ...], ...]]

    def to_json(self) -> dict[str, JSON]:
        took: dict[str, JSON] = {path: [list(cc) for cc in ccs] for path, ccs in self.took.items()}
        return {"rank": self.rank, "took": took}

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> TookPost:
        d = as_dict(doc, where, "took post")
        took = {}
        for path, ccs in as_dict(d.get("took"), where, "took").items():
            f = f"took[{path!r}]"
            took[path] = tuple(as_ranks(cc, where, f"{f}[{i}]") for i, cc in enumerate(as_list(ccs, where, f)))
        return cls(rank=as_rank(d.get("rank"), where, "rank"), took=took)


# ------------------------------------------------------------------------------------ the commit


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitMeta:
    """What rank 0 tells every node leader for the step's index: the caller's metadata, and when
    the save was made (seconds since the epoch, on rank 0's clock)."""

    metadata: JSON
    created: float

    def to_json(self) -> dict[str, JSON]:
        return {"metadata": self.metadata, "created": self.created}

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> CommitMeta:
        d = as_dict(doc, where, "commit metadata")
        if "metadata" not in d:
            raise bad(where, "metadata", "present", d)
        return cls(metadata=d["metadata"], created=as_float(d.get("created"), where, "created"))
