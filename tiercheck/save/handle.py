"""What a save hands back and carries through the pipeline: ``SaveHandle`` (the caller's view:
staged, committed, drained, timings) and ``PendingSave`` (one step on its way through the threads)."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tiercheck.errors import StateChangedError
from tiercheck.format.codec import seal
from tiercheck.format.manifest import JSON, RankPart
from tiercheck.format.shards import owners_bytes, shard_bytes
from tiercheck.save.pack import ChunkTask, PackPlan, Run
from tiercheck.state.flatten import Leaf
from tiercheck.state.memory_slots import SlotPool
from tiercheck.state.staging import Region
from tiercheck.tiers.local import PackWriter


@dataclass(frozen=True, slots=True)
class WriteRequest:
    """One write for the I/O threads: a small file, or a staged run of chunks (from the pool) into the pack."""

    path: str
    parts: list[bytes] = field(default_factory=list)
    staged: tuple[Run, Region] | None = None
    event: torch.cuda.Event | None = None  # the run's device-to-host copies, on CUDA


class SaveHandle:
    """What ``Checkpointer.save`` returns: completion futures and per-stage timings.

    ``staged`` completes when the host copy is done (the state may change from then on);
    ``committed`` when the step is durable and visible on the local tier (with the memory tier, a
    save that goes to memory only: once it is committed there); ``persisted`` with True once it is
    committed on the local tier, False for a save to the memory tier only; ``drained`` with True
    once it is committed on the remote tier, False if it will not be (no remote tier, not a step
    DrainOptions.every selects, or skipped for a newer one), or the drain's error; ``replicated``
    with True once this node's files of the step are on its replica peers (ReplicationOptions),
    else False. Futures carry the original exception of a failed save. ``timings`` holds seconds:
    plan_s, blocked_s (how long save() blocked), stage_s, persist_s, commit_s and durable_s (from
    the save() call to commit), and hook_blocked_s only when an ``optimizer.step()`` (or
    ``wait_staged()``) waited for this save's lazy copy.

    Attributes:
        step: the step saved.
        nbytes: bytes this rank writes for it.
        skipped: True when the save was dropped (``StagingOptions(if_busy="skip")``).
        staged: completes when the host copy is done.
        committed: completes when the step is committed on the local tier (or, to memory only, in memory).
        persisted: True once committed on the local tier, False for a save to memory only.
        drained: True once committed on the remote tier, else False (or the drain's error).
        replicated: True once this node's files are on its replica peers, else False.
        timings: seconds per stage (above).
    """

    def __init__(self, step: int, *, skipped: bool = False, nbytes: int = 0) -> None:
        self.step = step
        self.skipped = skipped
        self.nbytes = nbytes
        self.staged: Future[None] = Future()
        self.committed: Future[None] = Future()
        self.drained: Future[bool] = Future()
        self.replicated: Future[bool] = Future()
        self.persisted: Future[bool] = Future()
        self.timings: dict[str, float] = {}
        if skipped:
            self.staged.set_result(None)
            self.committed.set_result(None)
            self.persisted.set_result(False)
            self.drained.set_result(False)
            self.replicated.set_result(False)

    def wait(self, timeout: float | None = None) -> None:
        """Block until committed; re-raise the failure of the save with its original type."""
        self.committed.result(timeout)

    def done(self) -> bool:
        """Whether the save is committed (or failed)."""
        return self.committed.done()

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else "committed" if self.done() else "in flight"
        return f"<SaveHandle step={self.step} {state} {self.nbytes} bytes>"


@dataclass(eq=False)
class PendingSave:
    step: int
    plan: PackPlan
    leaves: list[Leaf]
    tree: JSON
    metadata: JSON
    attempt: int  # how many earlier saves of this step number this Checkpointer started
    save_id: str  # names this save in every file it writes (``format.saveid.new_save_id``)
    handle: SaveHandle
    t_call: float
    ready: torch.cuda.Event | None = None  # recorded on the training stream at save()
    eager_staged: threading.Event = field(default_factory=threading.Event)
    pack: PackWriter | None = None
    persist: bool = True  # written to the node-local directory too (False: to the memory tier only)
    slot: SlotPool | None = None  # the memory tier's slot it stages into (None: the ring pool)
    checksums: dict[str, dict[str, int]] = field(default_factory=dict)
    error: BaseException | None = None
    _pending: int = 1  # outstanding writes, plus one while staging runs
    _lock: threading.Lock = field(default_factory=threading.Lock)
    t_stage0: float = 0.0
    t_write0: float = 0.0
    t_write1: float = 0.0
    seq: int = -1  # this save's place among the pipeline's saves: commits follow it
    watch: bool = True  # a lazy save: its copies check the tensors did not change (an eager one copies in save())
    versions: list[int | None] = field(init=False)  # each lazy leaf's version at save() (``versions_of``)

    def __post_init__(self) -> None:
        # Built inside save(): what a lazy copy must still find (see ``changed``).
        self.versions = versions_of([leaf.watch for leaf in self.leaves]) if self.watch else []

    def changed(self, tasks: Iterable[ChunkTask], *, copying: bool) -> StateChangedError | None:
        """The error for the first of ``tasks``' lazy tensors whose version counter moved since
        save(): an in-place change (``mul_``, ``copy_``, an optimizer's update) bumps the counter
        the tensor shares with its views and detached aliases (a state_dict's parameter) when it is
        launched, before a CUDA kernel runs (a DTensor's: see ``Leaf.watch``). ``copying``: checked
        after the copy, so the change may have landed in the middle of it. A tensor replaced (a new
        Parameter assigned) leaves the one save() took as it was: no error. Not seen: changes
        through ``.data`` (a new counter), numpy views, CUDA graph replays, inference tensors."""
        if not self.watch:
            return None
        leaves = self.leaves
        index = [t.leaf for t in tasks]
        then = [self.versions[i] for i in index]
        now = versions_of([leaves[i].watch for i in index])
        if now == then:
            return None
        at = next(k for k, (a, b) in enumerate(zip(then, now, strict=True)) if a != b)
        when = "while it was being copied" if copying else "before it was copied"
        return StateChangedError(
            f"{leaves[index[at]].path} changed after save({self.step}), {when} to host memory (lazy staging; "
            f"its version counter went from {then[at]} to {now[at]}): step {self.step} was not committed. In "
            "lazy mode parameters and optimizer state may change only in optimizer.step(), which waits for "
            "the copy; call Checkpointer.wait_staged() before changing them elsewhere, or use "
            "StagingOptions(mode='eager')"
        )

    def manifest_parts(self) -> tuple[bytes, bytes | None, bytes | None]:
        """This rank's part of the step's manifest (its tree; each chunk's CRC32C and place in
        its pack), and if it coordinates arrays their shard (shapes, grids) and owners file (each
        chunk's writer), each sealed."""
        offsets: dict[str, dict[str, int]] = {}
        for t in self.plan.tasks:
            offsets.setdefault(t.path, {})[t.chunk.key] = t.offset
        sizes = {t.path: t.nbytes for t in self.plan.tasks}
        save = self.save_id
        part = seal(RankPart(self.tree, self.checksums, offsets, sizes, save).to_bytes())
        if not self.plan.shard:
            return part, None, None
        return part, seal(shard_bytes(self.plan.shard, save)), seal(owners_bytes(self.plan.shard, save))


def record_ready(leaves: list[Leaf]) -> torch.cuda.Event | None:
    """An event on the training stream after the work that produced the state: staging on a side
    stream waits for it, never for the whole device."""
    if not any(leaf.tensor.is_cuda for leaf in leaves):
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream())
    return ev


def versions_of(watches: list[tuple[torch.Tensor, ...]]) -> list[int | None]:
    """For each leaf's ``Leaf.watch``, a number that moves whenever the leaf is changed in place:
    the version counter of its watched tensor, plus its DTensor's (each only grows); None where
    there is nothing to watch (an eager leaf) or no counter (an inference tensor). A save takes it
    up to three times per tensor: one comprehension, twice as fast as a call per leaf."""
    try:
        return [(w[0]._version if len(w) == 1 else w[0]._version + w[1]._version) if w else None for w in watches]
    except RuntimeError:  # an inference tensor among them, which has no counter: one at a time
        return [_version_or_none(w) for w in watches]


def _version_or_none(watch: tuple[torch.Tensor, ...]) -> int | None:
    try:
        return sum(t._version for t in watch) if watch else None
    except RuntimeError:
        return None


def wait_staged(handle: SaveHandle) -> None:
    handle.staged.exception()  # waits; a failed copy surfaces through handle.wait()/committed
