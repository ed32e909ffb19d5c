"""What restoring ranks send each other through the store, one frozen dataclass per message, each
with ``to_json``/``from_json`` (as ``cluster.assign.LeafDesc`` on the save side).

The bytes come from other ranks of the same job (so the same library), but through the store: a
message is checked field by field when it is parsed, and one that is not what it should be fails
with ``CoordinationError`` naming the store key and the field (``cluster.wire``), never with a
``KeyError`` or ``TypeError`` from deep inside the plan. The JSON is compact positional lists where a message is
sent once per chunk or per array (the store carries one per rank and coordinator: its size is part
of every rank's flat cost, ``bench/scale_sim.py``).

Rounds of a restore, and what each sends (``restore.plan``, ``restore.agree``, ``restore.holders``):

- agreeing on the step: the node leaders fold their ``HeldSteps`` up a tree to rank 0, which sets one
  ``StepDecision`` every rank reads;
- finding holders: each node leader sets its ``NodeHolds`` for its other ranks, and claims saving
  ranks' files with a ``HolderClaim``;
- planning the reads: each rank posts ``NeedsPost`` to each array coordinator it needs, and each
  coordinator posts each rank its ``ReadWork``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tiercheck.cluster.assign import Need
from tiercheck.cluster.wire import as_bool as _bool
from tiercheck.cluster.wire import as_dict as _dict
from tiercheck.cluster.wire import as_fields
from tiercheck.cluster.wire import as_int as _int
from tiercheck.cluster.wire import as_list as _list
from tiercheck.cluster.wire import as_rank as _rank
from tiercheck.cluster.wire import as_ranks as _ints
from tiercheck.cluster.wire import as_str as _str
from tiercheck.cluster.wire import bad as _bad
from tiercheck.cluster.wire import loads as loads  # where restore.* have always taken it from
from tiercheck.format.manifest import JSON, ArrayRecord

# -------------------------------------------------------------------------------- agreeing on a step


Spans = tuple[tuple[int, int], ...]  # ranks as sorted, disjoint [start, stop) ranges: a whole job is one


def spans_of(ranks: Iterable[int]) -> Spans:
    out: list[tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return tuple(out)


def union(a: Spans, b: Spans) -> Spans:
    out: list[tuple[int, int]] = []
    for start, stop in sorted(a + b):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return tuple(out)


def missing(spans: Spans, n: int) -> list[int]:
    """The ranks below ``n`` that ``spans`` leaves out."""
    out: list[int] = []
    at = 0
    for start, stop in spans:
        out.extend(range(at, min(start, n)))
        at = max(at, stop)
    out.extend(range(at, n))
    return out


@dataclass(frozen=True, slots=True)
class Held:
    """Of one step, what some nodes hold: the saving job's world size, the saving ranks whose files
    they hold, and the restoring ranks (of those nodes) that hold a copy."""

    world: int
    saving: Spans
    holders: Spans


@dataclass(frozen=True, slots=True)
class HeldSteps:
    """The committed steps of some nodes, folded up the leaders' tree to rank 0
    (``cluster.hierarchy.fold``): its size grows with the steps and with how broken they are (the
    gaps in their spans), not with the nodes."""

    steps: dict[int, Held]

    @classmethod
    def of_node(cls, ranks: Sequence[int], held: Mapping[str, JSON]) -> HeldSteps:
        """A node's, from its ranks and ``restore.agree.held_steps`` of its directory."""
        out, where = {}, "this node's committed steps"
        for s, v in held.items():
            saving, world, _ = _list(v, where, f"held[{s!r}]", 3)
            out[int(s)] = Held(_rank(world, where, "world"), spans_of(_ints(saving, where, "saving")), spans_of(ranks))
        return cls(out)

    @classmethod
    def merge(cls, parts: Sequence[HeldSteps]) -> HeldSteps:
        steps: dict[int, Held] = {}
        for part in parts:
            for s, h in part.steps.items():
                have = steps.get(s)
                steps[s] = h if have is None else Held(have.world, union(have.saving, h.saving),
                                                        union(have.holders, h.holders))  # fmt: skip
        return cls(steps)

    def to_json(self) -> dict[str, JSON]:
        return {str(s): [h.world, [list(x) for x in h.saving], [list(x) for x in h.holders]]
                for s, h in self.steps.items()}  # fmt: skip

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> HeldSteps:
        steps = {}
        for s, v in _dict(doc, where, "held steps").items():
            if not s.isdigit():
                raise _bad(where, "held", "steps by number", s)
            world, saving, holders = _list(v, where, f"held[{s!r}]", 3)
            steps[int(s)] = Held(_rank(world, where, f"held[{s!r}][0]"), _spans(saving, where, f"held[{s!r}][1]"),
                                 _spans(holders, where, f"held[{s!r}][2]"))  # fmt: skip
        return cls(steps)


def _spans(v: object, where: str, field: str) -> Spans:
    out: list[tuple[int, int]] = []
    for i, pair in enumerate(_list(v, where, field)):
        start, stop = (_rank(x, where, f"{field}[{i}]") for x in _list(pair, where, f"{field}[{i}]", 2))
        if stop <= start or (out and start < out[-1][1]):
            raise _bad(where, f"{field}[{i}]", "ascending disjoint [start, stop) ranges", pair)
        out.append((start, stop))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class StepDecision:
    """Rank 0's answer: the step to restore (None: no tier holds one) and whether it comes from
    the remote tier, or why there is none to restore (``error``)."""

    step: int | None
    remote: bool = False
    error: str | None = None

    def to_json(self) -> dict[str, JSON]:
        if self.error is not None:
            return {"error": self.error}
        return {"step": self.step, "remote": self.remote}

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> StepDecision:
        d = _dict(doc, where, "step decision")
        if "error" in d:
            return cls(None, error=_str(d["error"], where, "error"))
        step = d.get("step")
        return cls(None if step is None else _int(step, where, "step"), _bool(d.get("remote"), where, "remote"))


# ---------------------------------------------------------------------------------- finding holders


@dataclass(frozen=True, slots=True)
class NodeHolds:
    """A node leader's word to its other ranks on what of the step the node uses (``node_copy``):
    the saving ranks whose files are here, and those of them the node wrote itself."""

    here: tuple[int, ...]
    written: tuple[int, ...]

    def to_json(self) -> dict[str, JSON]:
        return {"here": sorted(self.here), "written": sorted(self.written)}

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> NodeHolds:
        d = _dict(doc, where, "node holds")
        return cls(_ints(d.get("here"), where, "here"), _ints(d.get("written"), where, "written"))


@dataclass(frozen=True, slots=True)
class HolderClaim:
    """The ranks of the node that claimed a saving rank's files: they read its chunks and serve its
    manifest files. Set through ``Coordinator.decide``: the first node's claim stands, and a node
    knows its claim stood when the stored JSON is its own, byte for byte."""

    ranks: tuple[int, ...]

    def to_json(self) -> list[JSON]:
        return list(self.ranks)

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> HolderClaim:
        return cls(_ints(doc, where, "holder ranks"))


# ------------------------------------------------------------------------------------ the read plan


@dataclass(frozen=True, slots=True)
class NeedsPost:
    """What one rank needs of the arrays one coordinator plans: boxes of global arrays, the rank's
    node (its first rank; left out where it is the rank itself) and host key (left out: it shares
    no memory)."""

    rank: int
    needs: tuple[Need, ...]
    node: int | None = None
    host: str | None = None

    def to_json(self) -> dict[str, JSON]:
        needs: list[JSON] = [[n.path, list(n.offsets), list(n.shape)] for n in self.needs]
        doc: dict[str, JSON] = {"rank": self.rank, "needs": needs}
        if self.node is not None and self.node != self.rank:  # left out where it says nothing
            doc["node"] = self.node
        if self.host is not None:
            doc["host"] = self.host
        return doc

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> NeedsPost:
        d = _dict(doc, where, "needs post")
        needs = []
        for i, n in enumerate(_list(d.get("needs"), where, "needs")):
            f = f"needs[{i}]"
            path, offsets, shape = _list(n, where, f, 3)
            needs.append(Need(_str(path, where, f), _ints(offsets, where, f"{f}[1]"), _ints(shape, where, f"{f}[2]")))
        node, host = d.get("node"), d.get("host")
        return cls(
            _rank(d.get("rank"), where, "rank"),
            tuple(needs),
            None if node is None else _rank(node, where, "node"),
            None if host is None else _str(host, where, "host"),
        )

    @property
    def node_or_rank(self) -> int:
        return self.rank if self.node is None else self.node


@dataclass(frozen=True, slots=True)
class AssignedRead:
    """A chunk a rank reads from storage: its array, its grid position, whether from the remote
    tier, and the saving rank that wrote it (whose part of the manifest holds its checksum)."""

    path: str
    coords: tuple[int, ...]
    remote: bool
    owner: int

    def to_json(self) -> list[JSON]:
        return [self.path, list(self.coords), self.remote, self.owner]

    @classmethod
    def from_json(cls, doc: object, *, where: str, field: str) -> AssignedRead:
        return cls(*as_fields(doc, where, field, (_str, _ints, _bool, _rank)))


@dataclass(frozen=True, slots=True)
class AssignedMove:
    """A chunk sent from one rank to another (``cluster.assign.Transfer``, by grid position)."""

    path: str
    coords: tuple[int, ...]
    src: int
    dst: int
    tag: int
    shared: bool = False

    def to_json(self) -> list[JSON]:
        return [self.path, list(self.coords), self.src, self.dst, self.tag, *([1] if self.shared else [])]

    @classmethod
    def from_json(cls, doc: object, *, where: str, field: str) -> AssignedMove:
        items = _list(doc, where, field)
        if len(items) not in (5, 6) or items[5:] not in ([], [1]):
            raise _bad(where, field, "a list of 5 or 6", doc)
        path, coords, src, dst, tag = items[:5]
        return cls(
            _str(path, where, f"{field}[0]"),
            _ints(coords, where, f"{field}[1]"),
            _rank(src, where, f"{field}[2]"),
            _rank(dst, where, f"{field}[3]"),
            _int(tag, where, f"{field}[4]"),
            len(items) == 6,
        )


@dataclass(frozen=True, slots=True)
class ArrayShape:
    """An array's record without its chunk maps: what a rank needs to place the chunks it is
    given of an array whose record it did not parse itself."""

    path: str
    dtype: str
    kind: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]

    @classmethod
    def of(cls, rec: ArrayRecord) -> ArrayShape:
        return cls(rec.path, rec.dtype, rec.kind, rec.shape, rec.chunks)

    def record(self) -> ArrayRecord:
        return ArrayRecord(path=self.path, dtype=self.dtype, kind=self.kind, shape=self.shape, chunks=self.chunks)

    def to_json(self) -> list[JSON]:
        return [self.path, self.dtype, self.kind, list(self.shape), list(self.chunks)]

    @classmethod
    def from_json(cls, doc: object, *, where: str, field: str) -> ArrayShape:
        return cls(*as_fields(doc, where, field, (_str, _str, _str, _ints, _ints)))


@dataclass(frozen=True, slots=True)
class ReadWork:
    """A coordinator's word to one rank: the chunks of its arrays the rank reads, those it sends
    or receives, and the shapes of the arrays they belong to."""

    reads: tuple[AssignedRead, ...] = ()
    moves: tuple[AssignedMove, ...] = ()
    records: tuple[ArrayShape, ...] = ()

    def to_json(self) -> dict[str, JSON]:
        return {
            "reads": [x.to_json() for x in self.reads],
            "moves": [m.to_json() for m in self.moves],
            "records": [r.to_json() for r in self.records],
        }

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> ReadWork:
        d = _dict(doc, where, "read work")
        return cls(
            tuple(AssignedRead.from_json(x, where=where, field=f"reads[{i}]") for i, x in _each(d, "reads", where)),
            tuple(AssignedMove.from_json(x, where=where, field=f"moves[{i}]") for i, x in _each(d, "moves", where)),
            tuple(ArrayShape.from_json(x, where=where, field=f"records[{i}]") for i, x in _each(d, "records", where)),
        )


def _each(d: Mapping[str, object], key: str, where: str) -> Sequence[tuple[int, object]]:
    return list(enumerate(_list(d.get(key), where, key)))
