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
- planning the reads: each group of ranks needing the same posts one ``NeedsPost`` to each array
  coordinator it needs, and each node's first rank registers the node's members
  (``restore.members``);
  each coordinator posts each group one ``RouteWork`` (and one to each rank reading for others
  whose group it does not plan).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tiercheck.cluster.assign import Need, Route, Source
from tiercheck.cluster.ranksets import RankSet
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
from tiercheck.format.layout import chunk_at
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
    manifest files; and the node's host (``Nodes.host``; None: it shares no memory), so a rank
    reading there can pass chunks to ranks of its host through shared memory. Set through
    ``Coordinator.decide``: the first node's claim stands, and a node knows its claim stood when
    the stored JSON is its own, byte for byte. ``[rank, ...]``, the host last where there is one."""

    ranks: tuple[int, ...]
    host: str | None = None

    def to_json(self) -> list[JSON]:
        return [*self.ranks, *([self.host] if self.host is not None else [])]

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> HolderClaim:
        items = _list(doc, where, "holder ranks")
        host = items[-1] if items and isinstance(items[-1], str) else None
        return cls(_ints(items[: len(items) - (host is not None)], where, "holder ranks"), host)


# ------------------------------------------------------------------------------------ the read plan


@dataclass(frozen=True, slots=True)
class NeedsPost:
    """What the ranks of one group need of the arrays one coordinator plans: boxes of global
    arrays. Ranks needing the same (data-parallel replicas) have the same ``digest``: the first
    of them posts the boxes, and the group's members are registered by node (``restore.members``)."""

    digest: str
    needs: tuple[Need, ...]

    def to_json(self) -> dict[str, JSON]:
        needs: list[JSON] = [[n.path, list(n.offsets), list(n.shape)] for n in self.needs]
        return {"digest": self.digest, "needs": needs}

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> NeedsPost:
        d = _dict(doc, where, "needs post")
        needs = []
        for i, n in enumerate(_list(d.get("needs"), where, "needs")):
            f = f"needs[{i}]"
            path, offsets, shape = _list(n, where, f, 3)
            needs.append(Need(_str(path, where, f), _ints(offsets, where, f"{f}[1]"), _ints(shape, where, f"{f}[2]")))
        return cls(_str(d.get("digest"), where, "digest"), tuple(needs))


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
class RouteWork:
    """A coordinator's word to a group of needers (or to one rank reading for others): the routes
    of the chunks they need (``cluster.assign.Route``, each rank works out its own part), the
    shapes of their arrays, and the transfers' tags. Rank sets are said once each, as runs
    (``cluster.ranksets``): whatever the number of replicas, a route costs a few numbers."""

    routes: tuple[tuple[Route, int], ...] = ()  # and each chunk's tag
    records: tuple[ArrayShape, ...] = ()

    def to_json(self) -> dict[str, JSON]:
        sets: dict[frozenset[int], int] = {}

        def ref(ranks: frozenset[int] | None) -> int:
            return -1 if ranks is None else sets.setdefault(ranks, len(sets))

        chunks: list[JSON] = []
        for route, tag in self.routes:
            sources: list[JSON] = [[s.rank, s.remote, ref(s.to), ref(s.shared)] for s in route.sources]
            chunks.append([route.path, list(route.chunk.coords), route.owner, tag, ref(route.needers), sources])
        return {
            "sets": [RankSet.of(ranks).to_json() for ranks in sets],
            "chunks": chunks,
            "records": [r.to_json() for r in self.records],
        }

    @classmethod
    def from_json(cls, doc: object, *, where: str, world: int) -> RouteWork:
        """Checked against the restoring job's ``world`` size (ranks, and what their sets expand to)."""
        d = _dict(doc, where, "route work")
        records = tuple(
            ArrayShape.from_json(x, where=where, field=f"records[{i}]") for i, x in _each(d, "records", where)
        )
        shapes = {r.path: r for r in records}
        sets = [
            frozenset(RankSet.from_json(x, where=where, field=f"sets[{i}]", world=world))
            for i, x in _each(d, "sets", where)
        ]

        def ranks(v: object, field: str) -> frozenset[int] | None:
            i = _int(v, where, field)
            if not -1 <= i < len(sets):
                raise _bad(where, field, f"one of the {len(sets)} sets, or -1", v)
            return None if i == -1 else sets[i]

        routes = []
        for i, x in _each(d, "chunks", where):
            f = f"chunks[{i}]"
            path, coords, owner, tag, needers, sources = _list(x, where, f, 6)
            path = _str(path, where, f"{f}[0]")
            shape = shapes.get(path)
            coords = _ints(coords, where, f"{f}[1]")
            if shape is None or len(coords) != len(shape.shape):
                raise _bad(where, f"{f}[1]", "a chunk of an array whose shape the message gives", x)
            out = []
            for j, y in enumerate(_list(sources, where, f"{f}[5]")):
                g = f"{f}[5][{j}]"
                rank, remote, to, shared = _list(y, where, g, 4)
                to_set, shared_set = ranks(to, f"{g}[2]"), ranks(shared, f"{g}[3]") or frozenset()
                out.append(Source(_rank(rank, where, f"{g}[0]"), _bool(remote, where, f"{g}[1]"), to_set, shared_set))
            every = ranks(needers, f"{f}[4]")
            if not out or every is None or out[0].to is not None or any(s.to is None for s in out[1:]):
                raise _bad(where, f, "a route: its needers, its main source first, then sources of nodes", x)
            chunk = chunk_at(shape.shape, shape.chunks, coords)
            route = Route(path, chunk, _rank(owner, where, f"{f}[2]"), every, tuple(out))
            routes.append((route, _int(tag, where, f"{f}[3]")))
        return cls(tuple(routes), records)


def _each(d: Mapping[str, object], key: str, where: str) -> Sequence[tuple[int, object]]:
    return list(enumerate(_list(d.get(key), where, key)))
