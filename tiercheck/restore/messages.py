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

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from tiercheck.cluster.assign import Need, Route, Source
from tiercheck.cluster.wire import Entry, RankSet, as_fields, optional, read_flag, read_ranks, read_token
from tiercheck.cluster.wire import as_bool as _bool
from tiercheck.cluster.wire import as_dict as _dict
from tiercheck.cluster.wire import as_int as _int
from tiercheck.cluster.wire import as_list as _list
from tiercheck.cluster.wire import as_rank as _rank
from tiercheck.cluster.wire import as_ranks as _ints
from tiercheck.cluster.wire import as_str as _str
from tiercheck.cluster.wire import bad as _bad
from tiercheck.cluster.wire import loads as loads  # where restore.* have always taken it from
from tiercheck.format.layout import chunk_at
from tiercheck.format.manifest import JSON, ArrayRecord
from tiercheck.format.values import MAX_WORLD_SIZE

# -------------------------------------------------------------------------------- agreeing on a step


@dataclass(frozen=True, slots=True)
class Held:
    """Of one step, what some nodes hold: the saving job's world size, the saving ranks whose files
    they hold, and the restoring ranks (of those nodes) that hold a copy."""

    world: int
    saving: RankSet
    holders: RankSet


@dataclass(frozen=True, slots=True)
class HeldSteps:
    """The committed steps of some nodes, folded up the leaders' tree to rank 0
    (``cluster.hierarchy.fold``): its size grows with the steps and with how broken they are (the
    gaps in their sets of ranks: a whole job is one block), not with the nodes.
    ``{step: [world, saving, holders]}``, each set of ranks in ``cluster.wire``'s grammar."""

    steps: dict[int, Held]

    @classmethod
    def of_node(cls, ranks: Sequence[int], held: Mapping[str, JSON]) -> HeldSteps:
        """A node's, from its ranks and ``restore.agree.held_steps`` of its directory."""
        out, where = {}, "this node's committed steps"
        for s, v in held.items():
            saving, world, _ = _list(v, where, f"held[{s!r}]", 3)
            out[int(s)] = Held(
                _rank(world, where, "world"), RankSet.of(_ints(saving, where, "saving")), RankSet.of(ranks)
            )
        return cls(out)

    @classmethod
    def merge(cls, parts: Sequence[HeldSteps]) -> HeldSteps:
        steps: dict[int, Held] = {}
        for part in parts:
            for s, h in part.steps.items():
                have = steps.get(s)
                steps[s] = h if have is None else Held(have.world, have.saving.union(h.saving),
                                                        have.holders.union(h.holders))  # fmt: skip
        return cls(steps)

    def to_json(self) -> dict[str, JSON]:
        return {str(s): [h.world, h.saving.to_json(), h.holders.to_json()] for s, h in self.steps.items()}

    @classmethod
    def from_json(cls, doc: object, *, where: str, world: int) -> HeldSteps:
        """Checked against the restoring job's ``world`` size (the holders) and each step's own,
        at most ``format.values.MAX_WORLD_SIZE`` (its saving ranks)."""
        steps = {}
        for s, v in _dict(doc, where, "held steps").items():
            if not s.isdigit():
                raise _bad(where, "held", "steps by number", s)
            f = f"held[{s!r}]"
            saving_world, saving, holders = _list(v, where, f, 3)
            n = _rank(saving_world, where, f"{f}[0]")
            if n > MAX_WORLD_SIZE:
                raise _bad(where, f"{f}[0]", f"a world size of at most {MAX_WORLD_SIZE}", n)
            steps[int(s)] = Held(n, RankSet.from_json(saving, where=where, field=f"{f}[1]", world=n),
                                 RankSet.from_json(holders, where=where, field=f"{f}[2]", world=world))  # fmt: skip
        return cls(steps)


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
    the saving ranks whose files are here, and those of them the node wrote itself (sets of ranks,
    each below ``format.values.MAX_WORLD_SIZE``)."""

    here: RankSet
    written: RankSet

    def to_json(self) -> dict[str, JSON]:
        return {"here": self.here.to_json(), "written": self.written.to_json()}

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> NodeHolds:
        d = _dict(doc, where, "node holds")
        here = RankSet.from_json(d.get("here"), where=where, field="here", world=MAX_WORLD_SIZE)
        return cls(here, RankSet.from_json(d.get("written"), where=where, field="written", world=MAX_WORLD_SIZE))


@dataclass(frozen=True, slots=True)
class HolderClaim(Entry):
    """The ranks of the node that claimed a saving rank's files: they read its chunks and serve its
    manifest files; and the node's host (``Nodes.host``; None: it shares no memory), so a rank
    reading there can pass chunks to ranks of its host through shared memory. Set through
    ``Coordinator.decide``: the first node's claim stands, and a node knows its claim stood when
    the stored entry is its own, byte for byte. One entry ``ranks[:host[:copy]]`` (``cluster.wire``).

    ``copy``: the node holds a copy of files no writer's node claimed (a replaced node's, from its
    peers' memory). Every other node holding such a copy then appends its own claim after the first
    (``restore.holders``): they share the reads. A writer's node's claim stands alone."""

    ranks: RankSet
    host: str | None = None
    copy: bool = False

    FIELDS = (("ranks", read_ranks), ("host", optional(read_token)), ("copy", read_flag))


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
    shapes of their arrays, and the transfers' tags. Each set of ranks is said once, in the sets
    of ``cluster.wire.RankSet`` (whatever the number of replicas, a few bytes), and named by its
    place there. A chunk is ``[path, coords, owner, tag, needers, main, [source, ...]]``: its main
    source ``[rank, remote, shared]`` serves every needer no other source does, each other source
    ``[rank, remote, to, shared]`` the needers ``to`` of its node."""

    routes: tuple[tuple[Route, int], ...] = ()  # and each chunk's tag
    records: tuple[ArrayShape, ...] = ()

    def to_json(self) -> dict[str, JSON]:
        sets: dict[AbstractSet[int], int] = {}  # a frozenset and a RankSet of the same ranks are one

        def ref(ranks: AbstractSet[int]) -> int:
            return sets.setdefault(ranks, len(sets))

        chunks: list[JSON] = []
        for route, tag in self.routes:
            main, *others = route.sources
            head: list[JSON] = [route.path, list(route.chunk.coords), route.owner, tag, ref(route.needers)]
            first: list[JSON] = [main.rank, main.remote, ref(main.shared)]
            nodes: list[JSON] = [[s.rank, s.remote, ref(s.to or frozenset()), ref(s.shared)] for s in others]
            chunks.append([*head, first, nodes])
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
        # Each set stays runs (``RankSet``): a needer asks whether it is in one, and only a source
        # sending to them walks its ranks.
        sets = [RankSet.from_json(x, where=where, field=f"sets[{i}]", world=world) for i, x in _each(d, "sets", where)]

        def ranks(v: object, field: str) -> RankSet:
            i = _int(v, where, field)
            if not 0 <= i < len(sets):
                raise _bad(where, field, f"one of the {len(sets)} sets", v)
            return sets[i]

        def source(v: object, field: str, to: bool) -> Source:
            items = _list(v, where, field, 4 if to else 3)
            rank, remote = _rank(items[0], where, f"{field}[0]"), _bool(items[1], where, f"{field}[1]")
            return Source(
                rank,
                remote,
                ranks(items[2], f"{field}[2]") if to else None,
                ranks(items[-1], f"{field}[{len(items) - 1}]"),
            )

        routes = []
        for i, x in _each(d, "chunks", where):
            f = f"chunks[{i}]"
            path, coords, owner, tag, needers, main, others = _list(x, where, f, 7)
            path = _str(path, where, f"{f}[0]")
            shape = shapes.get(path)
            coords = _ints(coords, where, f"{f}[1]")
            if shape is None or len(coords) != len(shape.shape):
                raise _bad(where, f"{f}[1]", "a chunk of an array whose shape the message gives", x)
            sources = [source(main, f"{f}[5]", False)]
            sources += [source(y, f"{f}[6][{j}]", True) for j, y in enumerate(_list(others, where, f"{f}[6]"))]
            chunk = chunk_at(shape.shape, shape.chunks, coords)
            route = Route(path, chunk, _rank(owner, where, f"{f}[2]"), ranks(needers, f"{f}[4]"), tuple(sources))
            routes.append((route, _int(tag, where, f"{f}[3]")))
        return cls(tuple(routes), records)


def _each(d: Mapping[str, object], key: str, where: str) -> Sequence[tuple[int, object]]:
    return list(enumerate(_list(d.get(key), where, key)))
