"""What a save hands back and carries through the pipeline: ``SaveHandle`` (the caller's view:
staged, committed, drained, timings) and ``SaveJob`` (one step on its way through the threads)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tiercheck.format.codec import seal
from tiercheck.format.manifest import JSON, RankPart, owners_bytes, shard_bytes
from tiercheck.save.plan import PackPlan, Run
from tiercheck.state.flatten import Leaf
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
    ``committed`` when the step is durable and visible on the local tier; ``drained`` with True
    once it is committed on the remote tier, False if it will not be (no remote tier, not a step
    DrainOptions.every selects, or skipped for a newer one), or the drain's error; ``replicated``
    with True once this node's files of the step are on its replica peers (ReplicationOptions),
    else False. Futures carry the original exception of a failed save. ``timings`` holds seconds:
    plan_s, blocked_s (how long save() blocked), stage_s, persist_s, commit_s and durable_s (from
    the save() call to commit).
    """

    def __init__(self, step: int, *, skipped: bool = False, nbytes: int = 0) -> None:
        self.step = step
        self.skipped = skipped
        self.nbytes = nbytes
        self.staged: Future[None] = Future()
        self.committed: Future[None] = Future()
        self.drained: Future[bool] = Future()
        self.replicated: Future[bool] = Future()
        self.timings: dict[str, float] = {}
        if skipped:
            self.staged.set_result(None)
            self.committed.set_result(None)
            self.drained.set_result(False)
            self.replicated.set_result(False)

    def wait(self, timeout: float | None = None) -> None:
        """Block until committed; re-raise the failure of the save with its original type."""
        self.committed.result(timeout)

    def done(self) -> bool:
        return self.committed.done()

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else "committed" if self.done() else "in flight"
        return f"<SaveHandle step={self.step} {state} {self.nbytes} bytes>"


@dataclass(eq=False)
class SaveJob:
    step: int
    plan: PackPlan
    leaves: list[Leaf]
    tree: JSON
    metadata: JSON
    attempt: int  # how many earlier saves of this step number this Checkpointer started
    save_id: str  # names this save in every file it writes (``format.manifest.new_save_id``)
    handle: SaveHandle
    t_call: float
    ready: torch.cuda.Event | None = None  # recorded on the training stream at save()
    eager_staged: threading.Event = field(default_factory=threading.Event)
    pack: PackWriter | None = None
    checksums: dict[str, dict[str, int]] = field(default_factory=dict)
    error: BaseException | None = None
    _pending: int = 1  # outstanding writes, plus one while staging runs
    _lock: threading.Lock = field(default_factory=threading.Lock)
    t_stage0: float = 0.0
    t_write0: float = 0.0
    t_write1: float = 0.0
    seq: int = -1  # this save's place among the pipeline's saves: commits follow it

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


def wait_staged(handle: SaveHandle) -> None:
    handle.staged.exception()  # waits; a failed copy surfaces through handle.wait()/committed
