"""Restoring a step: agree on it, gather its manifest, match it to the state, move the bytes.

Every rank of the job calls ``restore_state`` together (a single process is a job of one). The
ranks meet in the store, never in the training's collectives:

1. **Agree on the step** (``agree_on_step``): the first rank of each node posts the steps its
   directory holds (and the saving ranks whose files are there); rank 0 alone reads those, one
   per node, picks the newest step whole across the nodes or committed on the remote tier, and
   posts that one answer.
2. **Gather the manifest** (``gather_manifest``): from the remote tier when the step comes from
   there; otherwise the first node holding each saving rank's part of the manifest posts it, and
   each rank reads the parts its own directory lacks.
3. **Match** the saved tree to the live state (``prepare``): shapes, dtypes and keys are checked
   on every rank, and any rank's mismatch fails all of them, before anything is overwritten.
4. **Move the bytes** (``scatter.move_chunks``): each chunk is read where its file is, verified
   against its checksum, and sent to the ranks that need it; then the decoded values are handed
   to the state (``apply``).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from .commit import assemble, list_steps, read_manifest, read_marker
from .coordination import Coordinator, Nodes, Protocol, drive, dumps, shard_of
from .errors import (
    CheckpointNotFoundError,
    CoordinationError,
    CorruptCheckpointError,
    TiercheckError,
)
from .flatten import tensor_paths
from .fmt import fmt_steps, plural, ranges
from .manifest import JSON, Manifest, RankPart
from .match import add_entries, apply, covers, prepare, tree_for
from .planner import plan_reads as plan_reads_whole
from .replicas import read_replicas
from .restoreplan import Step, fetch, find_holders, index_of, plan_reads
from .scatter import ReadItem, copy_in, move_chunks, staged, staging_bytes
from .staging import HostPool
from .tiers.base import Tier
from .tiers.local import LocalTier
from .tiers.remote import open_tier

log = logging.getLogger("tiercheck")


# ----------------------------------------------------------------------------- the protocol


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a restore builds and drops its plan, or ``save()``
    flattens the state: parsing the manifest and planning the reads of 1,836 arrays allocates
    ~10^6 objects, which set off full collections over the training process's whole heap (0.13 s
    of a 1.4 s restore of 1.5 GiB here; planning took 0.22 s instead of 0.08), and they took
    30-40 ms of the 55-70 ms save() spent on the training thread for the same state. Reference
    counting still frees everything dropped; cycles wait for the next collection after it."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def held_steps(tier: Tier) -> dict[str, JSON]:
    """A node's committed steps: ``{step: [saving ranks whose files are here, saving world size, those
    of them this node wrote itself]}``; the others are peers' replicas (``replicas.read_replicas``)."""
    held: dict[str, JSON] = {}
    for s in list_steps(tier).committed:
        try:
            marker = read_marker(tier, s)
        except TiercheckError as e:
            log.warning("ignoring step %d on %s: %s", s, tier.url, e)
            continue
        own = list(marker.ranks)
        copies = {r for c in read_replicas(tier, s) if c.world_size == marker.world_size for r in c.ranks}
        held[str(s)] = [own + sorted(copies - set(own)), marker.world_size, own]
    return held


@dataclass(frozen=True, slots=True)
class StepChoice:
    step: int | None
    from_remote: bool  # committed on the remote tier: read what no node holds from there
    held: dict[str, JSON]  # this node's committed steps (see held_steps)


def agree_on_step(
    coord: Coordinator,
    name: str,
    tier: Tier,
    nodes: Nodes,
    *,
    requested: int | None,
    remote_steps: Callable[[], list[int]],
    below: int | None = None,
) -> Protocol[StepChoice]:
    """Every rank learns the same step to restore (None: no tier holds one), older than ``below``
    when given. ``remote_steps`` is called on rank 0 only."""
    held = held_steps(tier) if coord.rank == nodes.leader else {}
    if coord.rank == nodes.leader:
        coord.post(f"{name}/held", dumps({"ranks": list(nodes.ranks), "held": held}))
    yield coord.arrive(f"{name}/held", what="every node to list its committed steps")
    answer = coord.key(name, "step")
    if coord.rank == 0:
        per_node = [json.loads(v) for v in coord.collect(f"{name}/held")]
        remote = set(remote_steps())
        if below is not None:
            remote = {s for s in remote if s < below}
            for node in per_node:
                node["held"] = {s: v for s, v in node["held"].items() if int(s) < below}
        try:
            step = choose_step(per_node, requested, remote, world=coord.world_size, where=tier.url)
            coord.set(answer, dumps({"step": step, "remote": step is not None and step in remote}))
        except CheckpointNotFoundError as e:
            coord.set(answer, dumps({"error": str(e)}))
    yield coord.arrive(f"{name}/chosen", what="rank 0 to choose the step to restore")
    decision = json.loads(coord.get(answer))
    if "error" in decision:
        raise CheckpointNotFoundError(decision["error"])
    if coord.rank != nodes.leader:
        held = held_steps(tier)
    return StepChoice(decision["step"], bool(decision.get("remote")), held)


def choose_step(
    per_node: list[dict[str, JSON]], requested: int | None, remote: set[int], *, world: int, where: str
) -> int | None:
    """The step to restore: committed on the remote tier, or whole across the nodes' local
    directories. ``per_node`` holds each node's ``{"ranks": its ranks, "held": held_steps}``."""
    have: dict[int, set[int]] = defaultdict(set)  # step -> saving ranks whose files some node holds
    saved_world: dict[int, int] = {}
    holders: dict[int, set[int]] = defaultdict(set)  # step -> restoring ranks holding a copy
    for node in per_node:
        for s, (saving, ws, *_) in node["held"].items():
            have[int(s)].update(saving)
            saved_world[int(s)] = ws
            holders[int(s)].update(node["ranks"])

    def missing(s: int) -> list[int]:
        return sorted(set(range(saved_world[s])) - have[s])

    def lacking(s: int) -> str:
        without = sorted(set(range(world)) - holders[s])
        return f"step {s}: the files of saving rank(s) {ranges(missing(s))} are on no rank's local tier" + (
            f" (restoring rank(s) {ranges(without)} have no copy of the step)" if without else ""
        )

    whole = sorted(remote | {s for s in have if not missing(s)})
    if requested is not None:
        if requested in whole:
            return requested
        if requested in have:
            raise CheckpointNotFoundError(f"{where}: cannot restore {lacking(requested)}")
        raise CheckpointNotFoundError(
            f"step {requested} is not committed on any rank's local tier or the remote tier "
            f"({where}; committed: {fmt_steps(whole)})"
        )
    newer = [s for s in have if whole and s > whole[-1]]
    if newer:
        log.warning("newest steps are incomplete, skipping them: %s", "; ".join(lacking(s) for s in sorted(newer)))
    if whole:
        return whole[-1]
    if have:
        raise CheckpointNotFoundError(f"{where}: no committed step is whole; newest: {lacking(max(have))}")
    return None


def settle(
    coord: Coordinator, name: str, failure: TiercheckError | None, *, shared: tuple[type[Exception], ...] = ()
) -> Protocol[None]:
    """Every rank learns whether any rank failed at this point; the first failure is raised on all
    of them (a rank's own failure as it is, the others' as ``CoordinationError`` naming it, or as
    the same error where its type is one of ``shared``)."""
    if failure is not None:
        coord.report(name, failure)
    yield coord.arrive(name, what="every rank to get this far in the restore")
    coord.check(name, failure, shared=shared)


# ------------------------------------------------------------------------------- one restore


@dataclass(frozen=True, slots=True)
class Restored:
    step: int
    arrays: int
    bytes_read: int
    chunks_received: int
    remote_reads: int
    fallbacks: int
    staged_in_pool: int  # bytes staged in the idle save pool rather than in new memory
    read_direct: int  # bytes read from the local tier around the page cache (O_DIRECT)
    from_remote: bool  # the step was chosen from the remote tier
    held_here: list[int]  # saving ranks whose files this node holds


@gc_paused()
def restore_state(
    state: Mapping[str, Any],
    *,
    coord: Coordinator,
    name: str,
    tier: Tier,
    nodes: Nodes,
    remote: Tier | None,
    group: Any,
    requested: int | None,
    strict: bool,
    allow_pickle: bool,
    others: bool | Callable[[list[str]], Iterable[str]],
    extra: bool,
    read_once: bool,
    io_threads: int,
    pool: HostPool | None = None,
    in_place: bool = False,
) -> Restored | None:
    """One rank's part of restoring a step into ``state`` in place; every rank calls it with the
    same ``name``. Returns None when no tier holds a committed step (and none was requested).

    All or nothing: every chunk is read into staging memory and verified, on every rank, before
    the first byte reaches the state; with ``in_place``, CPU tensors are read into as they are
    (see ``Checkpointer.restore``). When the chosen step turns out damaged (a bad checksum, a
    missing or unreadable file) on every tier, the ranks agree to restore the newest older whole
    step instead, with a warning; a ``requested`` step is never swapped for another."""
    touched: list[int] = []  # steps read into the state's own memory (in place) so far
    try:
        below: int | None = None
        attempt = name
        damaged: list[_Damaged] = []
        for n in itertools.count(1):
            try:
                done = _restore_step(
                    state,
                    coord=coord,
                    name=attempt,
                    tier=tier,
                    nodes=nodes,
                    remote=remote,
                    group=group,
                    requested=requested,
                    below=below,
                    strict=strict,
                    allow_pickle=allow_pickle,
                    others=others,
                    extra=extra,
                    read_once=read_once,
                    io_threads=io_threads,
                    pool=pool,
                    touched=touched if in_place else None,
                )
            except _Damaged as d:
                if requested is not None:
                    raise d.error from None
                if coord.rank == 0:
                    log.warning("cannot restore step %d, trying the newest older whole step: %s", d.step, d.error)
                damaged.append(d)
                below, attempt = d.step, f"{name}.{n}"
                continue
            if done is None and damaged:
                also = (
                    f"; step(s) {fmt_steps([d.step for d in damaged[1:]])} are damaged too" if len(damaged) > 1 else ""
                )
                raise CorruptCheckpointError(f"{damaged[0].error} (no older committed step is whole to restore{also})")
            return done
    except BaseException as e:
        if touched:
            _say_partly_restored(e, touched)
        raise
    raise AssertionError("unreachable")


def _in_place(item: ReadItem) -> bool:
    """Whether an in-place restore reads ``item`` into the state's own memory: a tensor of the
    state on the CPU (a GPU one is staged in host memory either way)."""
    return not item.fresh and item.dest.device.type == "cpu"


def _say_partly_restored(e: BaseException, steps: list[int]) -> None:
    """Tell the caller of a failed in-place restore that the state's tensors were read into."""
    what = (
        f"restore(in_place=True) failed after it began to read into the state: its tensors may hold "
        f"parts of step(s) {fmt_steps(steps)}; restore again before using them"
    )
    log.error("%s (%s)", what, e)
    if hasattr(e, "add_note"):  # Python 3.11 and later: shown under the traceback
        e.add_note(what)


DAMAGE = (CorruptCheckpointError,)
"""Failures every rank raises as they are (not as another rank's ``CoordinationError``): each rank
then agrees the step is damaged, and they try an older one together."""


def _leave(coord: Coordinator, name: str, claimed: Sequence[str]) -> None:
    """Every rank is past every key of this restore attempt: remove them."""
    coord.delete(*claimed, *([coord.key(f"{name}/step", "step")] if coord.rank == 0 else []))
    coord.finish(name)


class _Damaged(Exception):
    """Every rank agreed that ``step`` is damaged on every tier."""

    def __init__(self, step: int, error: CorruptCheckpointError) -> None:
        self.step, self.error = step, error


def _restore_step(
    state: Mapping[str, Any],
    *,
    coord: Coordinator,
    name: str,
    tier: Tier,
    nodes: Nodes,
    remote: Tier | None,
    group: Any,
    requested: int | None,
    below: int | None,
    strict: bool,
    allow_pickle: bool,
    others: bool | Callable[[list[str]], Iterable[str]],
    extra: bool,
    read_once: bool,
    io_threads: int,
    pool: HostPool | None,
    touched: list[int] | None,
) -> Restored | None:
    """One attempt at one step. With ``touched`` (a list), CPU tensors of the state are read into
    in place, and ``step`` is added to it before the first byte is."""
    choice = drive(
        coord,
        agree_on_step(
            coord,
            f"{name}/step",
            tier,
            nodes,
            requested=requested,
            below=below,
            remote_steps=lambda: remote_steps(remote),
        ),
    )
    if choice.step is None:
        return None
    step = choice.step
    here, _, own = choice.held.get(str(step), [[], 0, []])
    where = f"{tier.url}: step {step}"
    claimed: tuple[str, ...] = ()
    failure: TiercheckError | None = None
    items: list[ReadItem] = []
    decoded: dict[str, Any] = {}
    view = dict(state)  # entries ``others`` adds go to the state only once the restore succeeded
    parts: dict[int, RankPart] = {}  # saving ranks' manifest parts, parsed once
    try:  # a damaged index, manifest file or tree is the step's damage as much as a bad chunk
        st = drive(
            coord,
            find_holders(coord, name, tier, nodes, step, here, own, remote=remote, from_remote=choice.from_remote),
        )
        claimed = st.claimed
        manifest = drive(
            coord, manifest_for(coord, name, tier, nodes, st, remote, state, others=bool(others), parts=parts)
        )
        try:
            if others:
                add_entries(view, manifest, others, where=where)
                if len(view) > len(state) and not isinstance(state, MutableMapping):
                    raise TypeError(f"{where}: restoring other ranks' entries needs a mutable state mapping")
            tree = tree_for(manifest, coord.rank, coord.world_size, view, extra=extra)
            items, decoded = prepare(view, manifest, tree, strict=strict, allow_pickle=allow_pickle, where=where)
        except TiercheckError as e:
            if coord.world_size == 1:
                raise
            failure = e
        drive(coord, settle(coord, f"{name}/prepared", failure, shared=DAMAGE))
    except CorruptCheckpointError as e:
        _leave(coord, name, claimed)
        raise _Damaged(step, e) from None
    plan = drive(
        coord,
        plan_reads(
            coord,
            name,
            f"{name}/reads",
            tier,
            st,
            remote,
            [i.need for i in items],
            manifest.arrays,
            read_once=read_once,
            parts=parts,
        ),
    )
    moved: dict[str, int] = {}
    nbytes = 0
    if touched is not None and any(_in_place(i) for i in items):  # the state's CPU tensors are read into
        items = [ReadItem(i.record, i.dest, i.offsets, fresh=True) if _in_place(i) else i for i in items]
        touched.append(step)
    with contextlib.ExitStack() as stack:  # staging in the save pool's resident memory where it is idle
        arena = stack.enter_context(pool.lend(staging_bytes(items))) if pool is not None else None
        reads, live = staged(items, arena)
        pool_memory = None if arena is None else arena.untyped_storage().data_ptr()
        in_pool = sum(b.numel() * b.element_size() for _, b in live if b.untyped_storage().data_ptr() == pool_memory)
        try:
            nbytes = move_chunks(
                tier,
                step,
                plan.records,
                reads,
                plan.reads,
                plan.transfers,
                rank=coord.rank,
                group=group,
                io_threads=io_threads,
                remote=remote if choice.from_remote else None,
                counters=moved,
            )
        except TiercheckError as e:
            failure = e
        try:
            if coord.world_size > 1:
                drive(coord, settle(coord, f"{name}/read", failure, shared=(CorruptCheckpointError,)))
            elif failure is not None:
                raise failure
        except CorruptCheckpointError as e:
            raise _Damaged(step, e) from None
        finally:
            _leave(coord, name, claimed)
        copy_in(live, swap=arena is None)  # the arena goes back to the pool: copied out of, never handed over
    apply(state, decoded, where=where)
    log.info(
        "restored step %d (%s; %d chunks from %s, %d after a bad local copy)",
        step,
        plural(len(items), "array"),
        moved.get("remote_reads", 0),
        remote.url if remote is not None else "no remote tier",
        moved.get("fallbacks", 0),
    )
    return Restored(
        step=step,
        arrays=len(items),
        bytes_read=nbytes,
        chunks_received=sum(t.dst == coord.rank for t in plan.transfers),
        remote_reads=moved.get("remote_reads", 0),
        fallbacks=moved.get("fallbacks", 0),
        staged_in_pool=in_pool,
        read_direct=moved.get("direct_bytes", 0),
        from_remote=choice.from_remote,
        held_here=list(here),
    )


def manifest_for(
    coord: Coordinator,
    root: str,
    tier: Tier,
    nodes: Nodes,
    st: Step,
    remote: Tier | None,
    state: Mapping[str, Any],
    *,
    others: bool,
    parts: dict[int, RankPart] | None = None,
) -> Protocol[Manifest]:
    """The part of the step's manifest this rank needs: its saving rank's tree (every rank's, when
    the state has entries that tree lacks or ``others`` asks for other ranks' entries) and the
    records of the arrays those trees refer to. A format 1 or 2 step's manifest is whole already.
    The saving ranks' parts it parses are left in ``parts`` (``plan_reads`` takes checksums there)."""
    parts = {} if parts is None else parts
    where = f"{tier.url}: step {st.step}"
    if st.format_version < 3:
        return Manifest.from_bytes(st.index, where=where)
    ix = index_of(st, where=where)
    own = coord.rank if coord.rank < ix.world_size else 0
    got = yield from fetch(coord, root, f"{root}/tree", tier, nodes, st, remote, {("rank", own)})
    failure: TiercheckError | None = None
    more: set[tuple[str, int]] = set()
    try:
        if others or not covers(assemble(ix, got, where=where, parts=parts).tree(own), state):
            more = {("rank", w) for w in range(ix.world_size)} - set(got)
    except TiercheckError as e:
        failure = e
    yield from settle(coord, f"{root}/tree", failure, shared=DAMAGE)
    got |= yield from fetch(coord, root, f"{root}/trees", tier, nodes, st, remote, more)
    paths: set[str] = set()
    try:
        trees = assemble(ix, got, where=where, parts=parts).trees
        paths = {p for t in trees for p in tensor_paths(t) if isinstance(p, str)}
    except TiercheckError as e:
        failure = e
    yield from settle(coord, f"{root}/paths", failure, shared=DAMAGE)
    shards = {("arrays", shard_of(p, ix.world_size)) for p in paths}
    got |= yield from fetch(coord, root, f"{root}/arrays", tier, nodes, st, remote, shards)
    manifest: Manifest | None = None
    try:
        manifest = assemble(ix, {f: b for f, b in got.items() if b}, where=where, only=paths, owners=False, parts=parts)
    except TiercheckError as e:
        failure = e
    del got
    yield from settle(coord, f"{root}/manifest", failure, shared=DAMAGE)
    assert manifest is not None
    return manifest


def remote_steps(remote: Tier | None) -> list[int]:
    if remote is None:
        return []
    try:
        return list_steps(remote).committed
    except (OSError, TiercheckError) as e:  # restore from the local tier alone, and say so
        log.error("cannot list %s, restoring from local tiers only: %s", remote.url, e)
        return []


def _raise_first_error(outcomes: list[JSON], own: BaseException | None, rank: int) -> None:
    if own is not None:
        raise own
    for r, o in enumerate(outcomes):
        if "error" in o:
            raise CoordinationError(f"rank {r} failed, so rank {rank} stops too: {o['error']}")


# --------------------------------------------------------------------------- load()


@gc_paused()
def load(
    path: str | os.PathLike[str],
    step: int | None = None,
    *,
    allow_pickle: bool = False,
    io_threads: int = 4,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Read a committed step into a plain nested dict of CPU tensors (state_dicts become dicts).

    ``path`` is a local directory or any remote URL (``s3://``, ``az://``, ``file://``;
    ``storage_options`` go to fsspec). Sharded tensors come back whole. A local directory must
    hold every chunk: a step saved by ranks on several nodes is spread over their directories.
    """
    root = os.fspath(path)
    tier = open_tier(root, storage_options=storage_options)
    if isinstance(tier, LocalTier) and not tier.root.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint directory at {root!r}")
    committed = list_steps(tier).committed
    if step is None and not committed:
        raise CheckpointNotFoundError(f"{root!r} holds no committed step")
    if step is None:
        step = committed[-1]
    elif step not in committed:
        raise CheckpointNotFoundError(f"step {step} is not committed in {root!r} (committed: {fmt_steps(committed)})")
    manifest = read_manifest(tier, step)
    marker = read_marker(tier, step)
    where = f"{tier.url}: step {step}"
    out: dict[str, Any] = {}
    if set(marker.ranks) != set(range(marker.world_size)):
        if manifest.format_version >= 3:  # the other ranks' parts of the manifest are elsewhere too
            absent = sorted(set(range(marker.world_size)) - set(marker.ranks))
        else:
            owners = {rec.owner(k) for rec in manifest.arrays.values() for k in rec.checksums}
            absent = sorted(owners - set(marker.ranks))
        if absent:
            raise CheckpointNotFoundError(
                f"{where}: the chunks written by saving rank(s) {ranges(absent)} are in other nodes' local "
                f"directories; this one holds ranks {ranges(sorted(marker.ranks))} of {marker.world_size}"
            )
    items, decoded = prepare(
        out, manifest, manifest.tree(0), strict=False, allow_pickle=allow_pickle, where=where, fresh=True
    )
    plan = plan_reads_whole(manifest.arrays, [[i.need for i in items]], [frozenset(marker.ranks)], read_once=True)
    move_chunks(tier, step, manifest.arrays, items, plan.reads[0], plan.transfers, rank=0, io_threads=io_threads)
    apply(out, decoded, where=where)
    return out


# ------------------------------------------------------------------------------------ helpers
