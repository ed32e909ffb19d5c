"""Restoring a step: agree on it, gather its manifest, match it to the state, move the bytes.

Every rank of the job calls ``restore_state`` together (a single process is a job of one). It runs
a ``Restore``, whose docstring numbers the steps, which ranks do what in each, and how a step
found damaged falls back to an older one. The ranks meet in the store, never in the training's
collectives; what they send each other there is in ``restore.messages``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tiercheck.cluster.coordination import Coordinator, drive, dumps, shard_of
from tiercheck.cluster.hierarchy import node_of
from tiercheck.cluster.job import Job
from tiercheck.cluster.keys import scope_key
from tiercheck.cluster.keys.restore import copies_bucket, part_scope, retry_scope
from tiercheck.errors import (
    CoordinationError,
    CorruptCheckpointError,
    PartlyRestoredError,
    TiercheckError,
)
from tiercheck.format.lineage import check_claimable
from tiercheck.format.manifest import ArrayRecord, Manifest, RankPart
from tiercheck.format.paths import pack_file, step_dir
from tiercheck.format.refmaps import check_documents
from tiercheck.humanize import fmt_steps, plural
from tiercheck.restore.agree import StepChoice, agree_on_step, refuse_fresh_start, remote_steps, settle
from tiercheck.restore.holders import Step, find_holders
from tiercheck.restore.match import add_entries, apply, prepare, tree_for
from tiercheck.restore.messages import loads
from tiercheck.restore.needed import DAMAGE, manifest_for
from tiercheck.restore.plan import ReadRequest, RestorePlan, plan_restore
from tiercheck.restore.read import ReadCounts, ReadSource, deferrable, fill_deferred, move_chunks, share_key
from tiercheck.restore.report import Restored, Timeline, overwritten, passed_over_here, say_mixed, say_partly_restored
from tiercheck.restore.serve import TransferError
from tiercheck.restore.share import Sharing
from tiercheck.restore.stage import ReadItem, copy_in, staged, staging_bytes
from tiercheck.state.flatten import gc_paused
from tiercheck.state.staging import HostPool
from tiercheck.tiers.base import Tier

log = logging.getLogger("tiercheck")


# ------------------------------------------------------------------------------- one restore


@dataclass(frozen=True, kw_only=True)
class RestoreRequest:
    """What one restore asks for: ``Checkpointer.restore``'s keywords (see there), and how to read."""

    step: int | None = None  # None: the newest step every rank can get
    strict: bool = True
    allow_pickle: bool = False
    others: bool | Callable[[list[str]], Iterable[str]] = False
    extra: bool = True
    in_place: bool = False
    read_once: bool = True  # one rank in the job reads each chunk (else one per node needing it)
    share_memory: bool = True  # ranks of one host pass chunks through shared memory, where the group is CPU's
    io_threads: int = 4


@gc_paused()
def restore_state(
    state: Mapping[str, Any], job: Job, request: RestoreRequest, *, name: str, pool: HostPool | None = None
) -> Restored | None:
    """One rank's part of restoring a step into ``state`` in place; every rank calls it with the
    same ``name``. Returns None when no tier holds a committed step (and none was requested).
    ``pool`` is the idle save pool, staged into where it is big enough.

    All or nothing, or with ``in_place`` into the state's tensors as they are: when each applies is
    explained once, in docs/concepts/restore.md (invariant 7 of docs/design.md). When the chosen
    step turns out damaged (a bad checksum, a missing or unreadable file) on every tier, the ranks
    agree to restore the newest older whole step instead, with a warning; a requested step is never
    swapped for another. Where no tier holds a step but a local directory holds committed steps none
    can read (their commit markers damaged), raises ``CorruptCheckpointError`` naming them, and where
    it holds another framework's checkpoints, ``ForeignCheckpointError``: never None (a fresh start
    over them)."""
    done = Restore(state, job, request, name=name, pool=pool).run()
    if done is None and request.step is None:
        refuse_fresh_start(job, part_scope(name, "foreign"))
    return done


class Restore:
    """One rank's restore of a step into ``state`` (``restore_state``: build one, call ``run``).

    Call order. Every rank of the job builds one with the same ``name`` and calls ``run``, which
    calls the steps below in this order, on every rank; each step meets the other ranks in the
    store (never in the training's collectives), so no rank may skip one:

    1. ``agree(name, below)``: every rank learns the same step (``restore.agree``). Each node's
       first rank posts the steps its directory holds (``messages.HeldSteps``, folded up the node
       leaders' tree); rank 0 alone picks the newest whole across the nodes or committed on the
       remote tier (older than ``below`` when given) and sets one ``StepDecision``, which every
       rank reads. None: no tier holds a step, and ``run`` returns None.
    2. ``prepare(choice, name)``: each node's first rank claims the saving ranks whose files the
       node holds (``restore.holders``: a ``HolderClaim`` each, its ``NodeHolds`` for the node's
       other ranks); every rank gets the part of the step's manifest it needs (``restore.needed``:
       from its node's directory, the remote tier, or the store, where the holding node's first
       rank serves it) and matches it to the state (``restore.match``): keys, shapes and dtypes,
       any rank's mismatch failing all of them before anything is overwritten.
    3. ``plan(prepared, name)``: every rank reads alone the chunks its own saving rank wrote that
       it needs, and posts the rest to the arrays' coordinators (a ``NeedsPost`` per group of ranks
       needing the same); each coordinator decides who reads each chunk and who sends it to whom,
       and posts each group its routes once (a ``RouteWork``, ``restore.plan``): a ``RestorePlan``.
    4. ``read(prepared, plan, items, name)``: every rank reads its chunks, verifies them and
       sends and receives its transfers (``restore.read.move_chunks``), into staging memory or,
       with ``in_place``, the state's own; every rank agrees that all were verified before any
       staged byte is copied in.
    5. ``apply`` (in ``attempt``): every rank hands the plain values to its state
       (``restore.match.apply``) and returns what its restore did (``Restored``).

    ``attempt`` runs 1 to 5 once. Where 2, 3 or 4 find the step damaged on every tier (a bad
    checksum, a missing or unreadable file, on any rank), every rank raises ``_Damaged`` at the
    same point, and ``run`` goes back to 1 under a new name with that step as ``below``: the newest
    older whole step, with a warning. A requested step is never swapped for another. Where 4 found
    the damage in a node's own copy of some writers' files (``_CopyDamaged``, on several nodes),
    ``run`` first goes back to 2 for the same step, that node no longer claiming those writers: a
    peer's replica of them, or the remote tier, serves them; where none does, 2 says so and the
    step is passed over as above. Each such round drops at least one node's copy, so they end."""

    def __init__(
        self, state: Mapping[str, Any], job: Job, request: RestoreRequest, *, name: str, pool: HostPool | None
    ) -> None:
        self.state, self.job, self.request, self.name, self.pool = state, job, request, name, pool
        # Steps read into the state's own memory (in place) so far: each tensor read into (by its
        # memory), and its array.
        self.touched: dict[int, dict[int, str]] = {}
        # By step: saving ranks whose files, as this rank's node holds them, held a chunk this rank
        # found damaged; and on the node's leader, all its node's ranks found (no longer claimed).
        self.found: dict[int, set[int]] = {}
        self.dropped: dict[int, set[int]] = {}
        self.timeline = Timeline()  # seconds by phase, over the attempts

    def run(self) -> Restored | None:
        """Attempts from the newest step down until one restores (see the class's call order)."""
        touched = self.touched
        try:
            below: int | None = None
            attempt = self.name
            damaged: list[_Damaged] = []
            again: StepChoice | None = None
            first_copy: CorruptCheckpointError | None = None  # of the step read again: the first damaged copy
            for n in itertools.count(1):
                try:
                    done = self.attempt(attempt, below, again)
                except _Damaged as d:
                    if isinstance(d.error, _CopyDamaged) and d.choice is not None:  # the same step again
                        first_copy, again = first_copy or d.error, d.choice
                        if self.job.coord.rank == 0:
                            log.warning("step %d: %s; reading the files of that copy from another node's copy, or "
                                        "the remote tier", d.step, d.error)  # fmt: skip
                        attempt = retry_scope(self.name, n)
                        continue
                    if first_copy is not None:  # no other copy served those files: say what was damaged
                        d = _Damaged(d.step, CorruptCheckpointError(f"{first_copy}; {d.error}"))
                    again = first_copy = None
                    if self.request.step is not None:
                        raise d.error from None
                    if self.job.coord.rank == 0:
                        log.warning("cannot restore step %d, trying the newest older whole step: %s", d.step, d.error)
                    damaged.append(d)
                    below, attempt = d.step, retry_scope(self.name, n)
                    continue
                if done is None and damaged:
                    more = [d.step for d in damaged[1:]]
                    also = f"; step(s) {fmt_steps(more)} are damaged too" if more else ""
                    raise CorruptCheckpointError(
                        f"{damaged[0].error} (no older committed step is whole to restore{also})"
                    )
                if done is not None and set(touched) - {done.step}:
                    say_mixed(touched, done.step)
                if done is not None and damaged:
                    done = replace(done, passed_over={**done.passed_over, **{d.step: str(d.error) for d in damaged}})
                if done is not None:
                    done = replace(done, copies_passed_over=len(self.found.get(done.step, ())))
                return done
        except CorruptCheckpointError as e:  # no step whole: say what the ones tried overwrote
            if touched:
                raise PartlyRestoredError(f"{e}; {overwritten(touched)}") from e
            raise
        except BaseException as e:
            if touched:
                say_partly_restored(e, sorted(touched))
            raise
        raise AssertionError("unreachable")

    def attempt(self, name: str, below: int | None, again: StepChoice | None = None) -> Restored | None:
        """One attempt at one step, steps 1 to 5 (``again``: the step chosen already, read again
        from 2 without the copies found damaged). In place, the step is added to ``touched``, with
        the state's tensors it reads into, before the first byte is."""
        job, request = self.job, self.request
        coord, tier, remote = job.coord, job.tier, job.remote
        self.timeline.mark = time.perf_counter()
        choice = again or self.agree(name, below)
        self.timeline.took("agree")
        if choice.step is None:
            return None
        step = choice.step
        prepared = self.prepare(choice, name, again=again is not None)
        plan = self.plan(prepared, name)
        self.timeline.took("plan")
        items = prepared.items
        read_in_place = 0
        if request.in_place and any(_in_place(i) for i in items):  # the state's tensors are read into
            self.touched[step] = {i.dest.data_ptr(): i.record.path for i in items if _in_place(i) and i.dest.numel()}
            read_in_place = sum(i.dest.numel() * i.dest.element_size() for i in items if _in_place(i))
            items = [ReadItem(i.record, i.dest, i.offsets, fresh=True) if _in_place(i) else i for i in items]
        # All or nothing, a live CPU tensor whose every chunk passes through the host's shared memory is
        # filled from there once all is verified (no staging); in place, as each chunk is verified (the
        # copies overlap the reads: DP=2 0.97x dcp.load's time against 1.12x deferred, dist_bench).
        defer = deferrable(items, plan.transfers, coord.rank)
        items = [replace(i, deferred=True) if d else i for i, d in zip(items, defer, strict=True)]
        unstaged = sum(i.dest.numel() * i.dest.element_size() for i in items if i.deferred)
        moved = self.read(prepared, plan, items, name)
        apply(self.state, prepared.decoded, where=f"{tier.url}: step {step}", strict=request.strict)
        self.timeline.took("place")
        log.info(
            "restored step %d (%s; %d chunks from %s, %d after a bad local copy)",
            step,
            plural(len(items), "array"),
            moved.counts.remote_reads,
            remote.url if remote is not None else "no remote tier",
            moved.counts.fallbacks,
        )
        return Restored(
            step=step,
            arrays=len(items),
            bytes_read=moved.nbytes,
            chunks_received=sum(t.dst == coord.rank for t in plan.transfers),
            chunks_shared=sum(t.dst == coord.rank and t.shared for t in plan.transfers),
            unstaged=unstaged,
            remote_reads=moved.counts.remote_reads,
            fallbacks=moved.counts.fallbacks,
            staged_in_pool=moved.staged_in_pool,
            staged_on_device=moved.staged_on_device,
            read_direct=moved.counts.direct_bytes,
            from_remote=choice.from_remote,
            read_in_place=read_in_place,
            copied_up=moved.copied_up,
            held_here=sorted(prepared.st.here),
            passed_over=passed_over_here(choice, step) if request.step is None else {},
            save_id=prepared.st.save_id,
            own_placed_s=moved.counts.own_placed_s,
            phases=dict(self.timeline.phases),
        )

    def agree(self, name: str, below: int | None) -> StepChoice:
        """Step 1: the step every rank restores, older than ``below`` when given."""
        remote = self.job.remote
        return drive(
            self.job.coord,
            agree_on_step(
                self.job, part_scope(name, "step"), requested=self.request.step, below=below,
                remote_steps=lambda: remote_steps(remote, self.job.tier),
            ),
        )  # fmt: skip

    def prepare(self, choice: StepChoice, name: str, *, again: bool = False) -> _Prepared:
        """Step 2: find who holds the agreed step, fetch its manifest, and match it to the state:
        what each tensor reads (``items``) and the plain values (``decoded``). A damaged index,
        manifest file or tree is the step's damage as much as a bad chunk (``_Damaged``, on every
        rank). ``again``: the step is read again, and a node no longer claims the saving ranks
        whose files, as it holds them, a rank of it found damaged (``read``)."""
        state, job, request = self.state, self.job, self.request
        coord, tier, remote = job.coord, job.tier, job.remote
        assert choice.step is not None
        step = choice.step
        here, _, own = choice.held.get(str(step), [[], 0, []])
        dropped: list[int] | None = None  # None: a first attempt, claims as held
        if again:
            dropped = sorted(self._dropped(step)) if coord.rank == job.nodes.leader else []
            here, own = [w for w in here if w not in dropped], [w for w in own if w not in dropped]
        where = f"{tier.url}: step {step}"
        claimed: tuple[str, ...] = ()
        failure: TiercheckError | None = None
        items: list[ReadItem] = []
        decoded: dict[str, Any] = {}
        view = dict(state)  # entries ``others`` adds go to the state only once the restore succeeded
        parts: dict[int, RankPart] = {}
        try:
            host = share_key(job.group, job.nodes) if self.request.share_memory else None
            st = drive(coord, find_holders(job, name, step, here, own, from_remote=choice.from_remote, host=host,
                                           dropped=dropped))  # fmt: skip
            claimed = st.claimed
            others = request.others
            manifest = drive(coord, manifest_for(job, name, st, state, others=bool(others), parts=parts))
            try:
                if job.nodes.leader == coord.rank:  # it claims the directory once the restore is done
                    check_claimable(tier)
                if others:
                    add_entries(view, manifest, others, where=where)
                    if len(view) > len(state) and not isinstance(state, MutableMapping):
                        raise TypeError(f"{where}: restoring other ranks' entries needs a mutable state mapping")
                tree = tree_for(manifest, coord.rank, coord.world_size, view, extra=request.extra)
                items, decoded = prepare(
                    view, manifest, tree, strict=request.strict, allow_pickle=request.allow_pickle, where=where,
                    before_refusing=_damaged_record(tier, remote, st),
                )  # fmt: skip
            except TiercheckError as e:
                if coord.world_size == 1:
                    raise
                failure = e
            drive(coord, settle(job, part_scope(name, "prepared"), failure, shared=DAMAGE))
        except CorruptCheckpointError as e:
            _leave(coord, name, claimed)
            raise _Damaged(step, e) from None
        return _Prepared(
            step=step, st=st, manifest=manifest, items=items, decoded=decoded, parts=parts, choice=choice,
        )  # fmt: skip

    def plan(self, prepared: _Prepared, name: str) -> RestorePlan:
        """Step 3: which rank reads which chunk where, and sends it to whom (``plan.plan_restore``).
        An arrays or owners file, or a part of a chunk's writer, damaged or of another save, is the
        step's damage."""
        job, request = self.job, self.request
        asked = ReadRequest(
            needs=[i.need for i in prepared.items],
            records=prepared.manifest.arrays,
            read_once=request.read_once,
            parts=prepared.parts,
            host=share_key(job.group, job.nodes) if request.share_memory else None,
        )
        try:
            return drive(job.coord, plan_restore(job, name, prepared.st, asked))
        except CorruptCheckpointError as e:
            _leave(job.coord, name, prepared.st.claimed)
            raise _Damaged(prepared.step, e) from None

    def read(self, prepared: _Prepared, plan: RestorePlan, items: list[ReadItem], name: str) -> ReadOutcome:
        """Step 4: move the step's bytes (``move_chunks``) into staging memory (the idle save pool
        where it is big enough) or, for items read in place, the state's own; every rank agrees
        they all verified before any staged byte is copied in."""
        job, request = self.job, self.request
        coord, tier, step = job.coord, job.tier, prepared.step
        counts = ReadCounts()
        nbytes = 0
        failure: TiercheckError | None = None
        with contextlib.ExitStack() as stack:  # staging in the save pool's resident memory where it is idle
            arena = stack.enter_context(self.pool.lend(staging_bytes(items))) if self.pool is not None else None
            sharing = stack.enter_context(Sharing())  # closed once every rank is past the reads (``settle``)
            reads, live = staged(items, arena)
            pool_memory = None if arena is None else arena.untyped_storage().data_ptr()
            in_pool = sum(
                b.numel() * b.element_size() for _, b, _ in live if b.untyped_storage().data_ptr() == pool_memory
            )
            on_device = sum(b.numel() * b.element_size() for _, b, _ in live if b.is_cuda)
            try:
                source = ReadSource(
                    tier=tier,
                    step=step,
                    rank=coord.rank,
                    group=job.group,
                    remote=job.remote if prepared.choice.from_remote else None,
                    io_threads=request.io_threads,
                )
                nbytes = move_chunks(source, plan, reads, counts=counts, sharing=sharing)
            except TiercheckError as e:
                failure = self._copy_damaged(e, step, counts.damaged)
            self.timeline.took("transfer")
            try:
                if isinstance(failure, TransferError):  # a rank it moved chunks with is gone: no verdict comes
                    raise failure
                if coord.world_size > 1:
                    shared = (_CopyDamaged, CorruptCheckpointError)
                    drive(coord, settle(job, part_scope(name, "read"), failure, shared=shared))
                elif failure is not None:
                    raise failure
            except CorruptCheckpointError as e:
                raise _Damaged(step, e, prepared.choice) from None
            finally:
                _leave(coord, name, prepared.st.claimed)
                self.timeline.took("verify")
            fill_deferred(sharing)
            # The arena goes back to the pool: copied out of, never handed over.
            copied_up = copy_in(live, swap=arena is None)
        return ReadOutcome(
            nbytes=nbytes, counts=counts, staged_in_pool=in_pool, staged_on_device=on_device, copied_up=copied_up
        )

    def _copy_damaged(self, error: TiercheckError, step: int, damaged: set[int]) -> TiercheckError:
        """The reads' first failure, as ``_CopyDamaged`` where this rank found a chunk damaged in its
        node's copy of saving ranks' files it had not found damaged before, and another node may
        hold a copy. It tells its node's leader which, through the node's store, to claim no more."""
        new = damaged - self.found.setdefault(step, set())
        if not new or self.job.nodes.count == 1 or not isinstance(error, CorruptCheckpointError):
            return error
        self.found[step] |= new
        node_of(self.job.coord).post(copies_bucket(self.name, step), dumps(sorted(new)))
        packs = ", ".join(f"{step_dir(step)}/{pack_file(w)}" for w in sorted(new))  # where the damaged chunks lie
        return _CopyDamaged(f"{error} (in this node's copy of saving rank(s) {fmt_steps(sorted(new))}' files: {packs})")

    def _dropped(self, step: int) -> set[int]:
        """On a node's leader: the saving ranks whose files, as the node holds them, its ranks found
        damaged in ``step`` so far (``_copy_damaged``)."""
        node, bucket = node_of(self.job.coord), copies_bucket(self.name, step)
        got = self.dropped.setdefault(step, set())
        for raw in node.collect(bucket):
            ranks = loads(raw, where=scope_key(node, bucket))
            if not isinstance(ranks, list) or not all(type(w) is int and w >= 0 for w in ranks):
                raise CoordinationError(f"{scope_key(node, bucket)}: not a list of saving ranks: {raw[:80]!r}")
            got.update(ranks)
        return got


@dataclass(frozen=True, kw_only=True)
class _Prepared:
    """A step agreed on, its holders found and its manifest matched to the state (``Restore.prepare``)."""

    step: int
    st: Step
    manifest: Manifest
    items: list[ReadItem]
    decoded: dict[str, Any]
    parts: dict[int, RankPart]  # saving ranks' manifest parts, parsed once
    choice: StepChoice  # the step's, as every rank agreed on it (read again, where a copy is damaged)


@dataclass(frozen=True, kw_only=True)
class ReadOutcome:
    """What ``Restore.read`` moved on this rank: the bytes read, what the reads counted, and the
    bytes staged in the idle save pool, on the device, and in host memory copied up to a GPU."""

    nbytes: int
    counts: ReadCounts
    staged_in_pool: int
    staged_on_device: int
    copied_up: int


def _in_place(item: ReadItem) -> bool:
    """Whether an in-place restore reads ``item`` into the state's own memory: a tensor of the
    state on the CPU, or on a GPU (its chunks then go up through the page-locked bounce buffers
    as each run is verified: ``read.move_chunks``)."""
    return not item.fresh and item.dest.device.type in ("cpu", "cuda")


def _leave(coord: Coordinator, name: str, claimed: Sequence[str]) -> None:
    """Every rank is past every key of this restore attempt: remove them."""
    coord.delete(*claimed)
    coord.finish(name)


class _Damaged(Exception):
    """Every rank agreed that ``step`` is damaged on every tier; or, where ``error`` is
    ``_CopyDamaged``, in a node's copy of some saving ranks' files, read again from another
    (``choice``: the step's, chosen already)."""

    def __init__(self, step: int, error: CorruptCheckpointError, choice: StepChoice | None = None) -> None:
        self.step, self.error, self.choice = step, error, choice


class _CopyDamaged(CorruptCheckpointError):
    """A chunk damaged in a node's copy of its writer's files (and on the tier it falls back to
    there): another node's copy of those files, or the remote tier, may hold it whole."""


def _damaged_record(tier: Tier, remote: Tier | None, st: Step) -> Callable[[ArrayRecord], None]:
    """What ``prepare`` asks before it refuses the live state for a record whose shape or dtype the
    state does not have: whether the step's own files contradict that record. Its coordinator wrote
    it twice, in its arrays file and as the array's zarr.json in its reference map: a record the
    map contradicts (or a map of another step) is the step's damage, passed over for an older step
    as a bad chunk is (``format.refmaps``), where the state is what the step was saved from. One
    read of one map, on the way to refusing the state only; where this node holds the map, or the
    step comes from the remote tier (a node holding neither refuses the state as before)."""

    def check(rec: ArrayRecord) -> None:
        coordinator = shard_of(rec.path, st.world_size)
        source = tier if coordinator in st.here else remote if st.from_remote else None
        if source is not None:
            where = f"{source.url}: step {st.step}"
            check_documents(source, st.step, coordinator, {rec.path: rec}, save=st.save_id, where=where)

    return check
