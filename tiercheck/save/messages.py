"""What saving ranks send each other through the store, one frozen dataclass per message, each
with ``to_json``/``from_json`` (as ``restore.messages`` on the restore side; the pieces a rank
posts in the first round of a plan are ``cluster.assign.LeafDesc``).

A message is checked field by field when it is parsed (``cluster.wire``): one that is not what it
should be fails with ``CoordinationError`` naming its store key and the field. The JSON is compact
positional lists where a message is sent once per chunk, and a set of ranks is one string of
``cluster.wire``'s grammar: its size is part of every rank's flat cost (``bench/scale_sim.py``). The
words a node's ranks say to its first rank, and the registers of holders, are entries
(``cluster.wire.Entry``): ``HolderWord``, ``Holders``.

Rounds of a save plan (``save.plan``), and what each sends:

- posting pieces: each rank posts each coordinator of its arrays one ``PiecesPost`` per group of
  pieces (replicas post it once, and append their ranks to its register: ``Holders``);
- offering chunks: each coordinator sets one ``ChunkOffer`` per group of holders of the same pieces;
- taking a share: each rank posts each coordinator whose chunks it took a ``TookPost``.

Committing a save (``save.vote``): rank 0 sets the step's ``CommitMeta`` for every node leader.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from tiercheck.cluster.assign import LeafDesc
from tiercheck.cluster.wire import (
    Entry,
    RankSet,
    as_dict,
    as_float,
    as_list,
    as_rank,
    as_ranks,
    as_str,
    bad,
    optional,
    read_number,
    read_rank,
    read_ranks,
    read_signed,
    read_token,
)
from tiercheck.format.manifest import JSON, ArrayRecord

# -------------------------------------------------------------------------------- the save plan


@dataclass(frozen=True, slots=True)
class HolderWord(Entry):
    """A rank's word to its node's first rank (``save.plan._register``): it holds the pieces posted
    to ``coordinator`` under ``digest``, as ``block`` of their pattern where they are one."""

    coordinator: int
    digest: str
    rank: int
    block: int | None = None

    FIELDS = (("coordinator", read_rank), ("digest", read_token), ("rank", read_rank), ("block", optional(read_number)))


@dataclass(frozen=True, slots=True)
class Holders(Entry):
    """Holders of one digest in its register: ``ranks`` and, where the digest is a pattern
    (``save.patterns``), their blocks: ``block`` for the first, each next one ``step`` further
    (None: the same block). The eight ranks of a node holding a replicated norm, or its eight TP
    blocks, are one entry: ``16+8:0:1``."""

    ranks: RankSet
    block: int | None = None
    step: int | None = None

    FIELDS = (("ranks", read_ranks), ("block", optional(read_number)), ("step", optional(read_signed)))


def holders_entry(members: Sequence[tuple[int, int | None]]) -> str:
    """Holders of one digest (their ranks, and their blocks of a pattern) as ``Holders`` entries: each
    run of consecutive ranks whose blocks step evenly is one."""
    ms = sorted(members)
    out = []
    i = 0
    while i < len(ms):
        r0, k0 = ms[i]
        d = None if len(ms) == i + 1 or k0 is None else (ms[i + 1][1] or 0) - k0
        j = i + 1
        while j < len(ms) and ms[j][0] == ms[j - 1][0] + 1 and (k0 is None or ms[j][1] == k0 + (j - i) * (d or 0)):
            j += 1
        out.append(Holders(RankSet.of_blocks([(r0, j - i)]), k0, d if j - i > 1 and d else None).entry())
        i = j
    return "".join(out)


def parse_holders(raw: bytes, *, where: str, world: int, pattern: bool) -> list[tuple[int, int]]:
    """The holders in a register (``holders_entry``): each rank (below ``world``) with its block
    (0 where the digest is no pattern). A rank holds a digest once: the register names at most
    ``world`` ranks in all, checked before any is expanded."""
    out: list[tuple[int, int]] = []
    entries = Holders.read(raw, where=where, field="ranks", world=world)
    if sum(len(e.ranks) for e in entries) > world:
        raise bad(where, "ranks", f"at most {world} holders", f"{len(entries)} entries")
    for i, e in enumerate(entries):
        n, k0, d = len(e.ranks), e.block or 0, e.step or 0
        if (e.block is not None) != pattern or (not pattern and e.step is not None) or min(k0, k0 + (n - 1) * d) < 0:
            what = "ranks:block[:step], blocks of at least 0" if pattern else "ranks"
            raise bad(where, f"ranks[{i}]", what, e.entry())
        out.extend((r, k0 + j * d) for j, r in enumerate(e.ranks))
    return out


@dataclass(frozen=True, slots=True)
class PiecesPost:
    """A group of a rank's pieces of the arrays one coordinator lays out, under the group's digest
    (the same on every replica holding them): ``[digest, [piece, ...]]``; with ``pattern``, the
    pieces are block 0 of a block pattern (``save.patterns``), ``[digest, [piece, ...], 1]``."""

    digest: str
    pieces: tuple[LeafDesc, ...]
    pattern: bool = False

    def to_json(self) -> list[object]:
        return [self.digest, [d.to_json() for d in self.pieces], *([1] if self.pattern else [])]

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> PiecesPost:
        items = as_list(doc, where, "post")
        if len(items) not in (2, 3) or items[2:] not in ([], [1]):
            raise bad(where, "post", "[digest, pieces] or [digest, pieces, 1]", doc)
        posted = as_list(items[1], where, "pieces")
        return cls(
            as_str(items[0], where, "digest"),
            tuple(LeafDesc.from_json(d, where=where, field=f"pieces[{i}]") for i, d in enumerate(posted)),
            pattern=len(items) == 3,
        )


@lru_cache(maxsize=4096)  # a coordinator offers the same groups of replicas to every holder
def _holders(ranks: tuple[int, ...]) -> RankSet:
    return RankSet.of(ranks)


@dataclass(frozen=True, slots=True)
class Shift:
    """How a block pattern's offer (``save.patterns``) moves to another block: the chunks offered
    are those of ``block``, and the holder of block ``k`` holds them moved ``(k - block) * per``
    along ``dim``, each held by ranks ``(k - block) * step`` further on. ``[dim, block, per, step]``."""

    dim: int
    block: int
    per: int
    step: int

    def to_json(self) -> list[JSON]:
        return [self.dim, self.block, self.per, self.step]

    @classmethod
    def from_json(cls, doc: object, *, where: str, field: str, ndim: int) -> Shift:
        items = as_list(doc, where, field, 4)
        dim, block, per = (as_rank(v, where, f"{field}[{i}]") for i, v in enumerate(items[:3]))
        if dim >= ndim:
            raise bad(where, field, "[dim, block, per, step], dim an axis of the array", doc)
        return cls(dim, block, per, as_rank(items[3], where, f"{field}[3]"))


@dataclass(frozen=True, slots=True, kw_only=True)
class ArrayOffer:
    """One array as its coordinator laid it out, to one group of holders: its record's shape (no
    owners) and the chunks the group holds, each by grid position with the full group of ranks
    holding it (a ``cluster.wire.RankSet``: 128 replicas are ``3/128x128``). With a ``shift``,
    the offer of a block pattern: how its chunks move from block to block."""

    dtype: str
    kind: str
    shape: tuple[int, ...]
    grid: tuple[int, ...]  # the chunk shape
    chunks: tuple[tuple[tuple[int, ...], RankSet], ...]  # (grid position, holders)
    shift: Shift | None = None

    @classmethod
    def of(
        cls, rec: ArrayRecord, chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...], shift: Shift | None = None
    ) -> ArrayOffer:
        held = tuple((cc, _holders(hs)) for cc, hs in chunks)
        return cls(dtype=rec.dtype, kind=rec.kind, shape=rec.shape, grid=rec.chunks, chunks=held, shift=shift)

    def record(self, path: str) -> ArrayRecord:
        return ArrayRecord(path=path, dtype=self.dtype, kind=self.kind, shape=self.shape, chunks=self.grid)

    def to_json(self) -> list[JSON]:
        short: list[JSON] = [self.dtype, self.kind, list(self.shape), list(self.grid)]
        chunks: list[JSON] = [[list(cc), group.to_json()] for cc, group in self.chunks]
        return [short, chunks] if self.shift is None else [short, chunks, self.shift.to_json()]

    @classmethod
    def from_json(cls, doc: object, *, where: str, field: str, world: int) -> ArrayOffer:
        """Its holders checked against the saving job's ``world`` size."""
        items = as_list(doc, where, field)
        if len(items) not in (2, 3):
            raise bad(where, field, "[array, chunks] or [array, chunks, shift]", doc)
        short, chunks = items[:2]
        dtype, kind, shape, grid = as_list(short, where, f"{field}[0]", 4)
        ndim = len(as_list(shape, where, f"{field}[0][2]"))
        shift = Shift.from_json(items[2], where=where, field=f"{field}[2]", ndim=ndim) if len(items) == 3 else None
        offered = []
        for i, c in enumerate(as_list(chunks, where, f"{field}[1]")):
            f = f"{field}[1][{i}]"
            cc, group = as_list(c, where, f, 2)
            holders = RankSet.from_json(group, where=where, field=f"{f}[1]", world=world)
            offered.append((as_ranks(cc, where, f"{f}[0]"), holders))
        return cls(
            dtype=as_str(dtype, where, f"{field}[0][0]"),
            kind=as_str(kind, where, f"{field}[0][1]"),
            shape=as_ranks(shape, where, f"{field}[0][2]"),
            grid=as_ranks(grid, where, f"{field}[0][3]"),
            chunks=tuple(offered),
            shift=shift,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkOffer:
    """A coordinator's offer to one group of holders of the same pieces: each of their arrays it
    coordinates (every holder hears of an array, even of an empty piece)."""

    arrays: dict[str, ArrayOffer]

    def to_json(self) -> dict[str, JSON]:
        return {path: a.to_json() for path, a in self.arrays.items()}

    @classmethod
    def from_json(cls, doc: object, *, where: str, world: int) -> ChunkOffer:
        d = as_dict(doc, where, "offer")
        return cls(
            arrays={path: ArrayOffer.from_json(a, where=where, field=path, world=world) for path, a in d.items()}
        )


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
