"""The public entry point: ``Checkpointer`` (save / restore in place) and ``load``."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tiercheck.cluster.coordination import Coordinator, store_traffic
from tiercheck.cluster.job import Job
from tiercheck.cluster.keys.restore import restore_scope
from tiercheck.errors import ClosedError, InvalidArgumentError, StepExistsError, UnsupportedValueError
from tiercheck.format.manifest import JSON
from tiercheck.format.metadata import encode as encode_metadata
from tiercheck.format.saveid import new_save_id
from tiercheck.format.steps import list_steps
from tiercheck.lifecycle import exit_deadline, start, unclosed
from tiercheck.memory import Memory
from tiercheck.options import (
    DistributedOptions,
    DrainOptions,
    MemoryOptions,
    ReplicationOptions,
    RetentionOptions,
    StagingOptions,
    WriteOptions,
)
from tiercheck.restore.load import load
from tiercheck.restore.protocol import RestoreRequest, restore_state
from tiercheck.save.handle import PendingSave, SaveHandle, record_ready, wait_staged
from tiercheck.save.pipeline import Pipeline
from tiercheck.save.planner import RUN_ALIGN, Planner
from tiercheck.save.prefault import Prefaulter
from tiercheck.save.vote import commit_job
from tiercheck.state import memory_pool
from tiercheck.state.flatten import Leaf, flatten, gc_paused
from tiercheck.state.staging import NO_POOL, HostPool
from tiercheck.tiering import lineage
from tiercheck.tiering.memory_found import warn_of_newer
from tiercheck.tiering.retention import set_aside_on_node
from tiercheck.tiers.base import Tier
from tiercheck.version import __version__

__all__ = ["Checkpointer", "load"]

log = logging.getLogger("tiercheck")

class Checkpointer:
    """Saves and restores one training state on a node-local tier, alone or as one rank of many.

    ``state`` maps names to Stateful objects (anything with ``state_dict()`` and
    ``load_state_dict()``: modules, optimizers, schedulers) or to nested dicts / lists / tuples of
    tensors and plain values. ``restore()`` writes into these objects in place.

    Under ``torch.distributed`` (the default group, or ``process_group``), every rank of the group
    constructs its Checkpointer, calls ``save(step)`` with the same steps and ``restore()`` together.
    Tensors may be DTensors or ``tiercheck.Shard`` pieces of global tensors; plain tensors are
    replicated. Each chunk of each global tensor is written once, by one of the ranks holding it,
    and a step commits only when every rank's part is durable. ``local`` is this node's directory.

    Args:
        state: what to checkpoint, by name (see above); restored in place.
        local: this node's checkpoint directory (fast local disk), created if missing. Partial
            steps a crash left there are removed; one job writes it at a time (a lock).
        remote: where committed steps drain in the background: an fsspec URL (``s3://``,
            ``az://``, ``abfs://``, ``file://``) or a tier object. ``None``: no remote tier.
        remote_options: options for the remote's fsspec filesystem (endpoint, credentials).
        process_group: the ``torch.distributed`` group whose ranks checkpoint together
            (default: the world, whenever ``torch.distributed`` is initialized).
        staging: how a save copies the state into host memory (``StagingOptions``).
        write: chunk size, I/O threads, fsync, direct I/O, lineage take-over (``WriteOptions``).
        retention: which committed local steps to keep (``RetentionOptions``; default: the last 3).
        distributed: how the ranks cooperate (``DistributedOptions``).
        drain: what is copied to the remote tier and how (``DrainOptions``).
        replication: copies of each node's steps on other nodes' local tiers
            (``ReplicationOptions``). ``None``: no copies.
        memory: stage into files on a tmpfs that outlive the process (``MemoryOptions``; its
            docstring says what is built). ``None``: ordinary process memory.
        allow_pickle: store values that have no safe encoding with pickle, and read them back.
    """

    def __init__(
        self,
        state: Mapping[str, Any],
        *,
        local: str | os.PathLike[str],
        remote: str | Tier | None = None,
        remote_options: dict[str, Any] | None = None,
        process_group: Any = None,
        staging: StagingOptions | None = None,
        write: WriteOptions | None = None,
        retention: RetentionOptions | None = None,
        distributed: DistributedOptions | None = None,
        drain: DrainOptions | None = None,
        replication: ReplicationOptions | None = None,
        memory: MemoryOptions | None = None,
        allow_pickle: bool = False,
    ) -> None:
        if not isinstance(state, Mapping):
            raise UnsupportedValueError(f"state must be a mapping of names to state, not {type(state).__qualname__}")
        self.state = state
        self.staging = staging or StagingOptions()
        self._memory = memory_pool.start(memory, local, state)
        self.write = write or WriteOptions()
        self.retention = retention or RetentionOptions()
        self.distributed = distributed or DistributedOptions()
        self.drain_options = drain or DrainOptions()
        self.allow_pickle = allow_pickle
        self.group = process_group
        s = start(local, process_group=process_group, skip_if_busy=self.staging.if_busy == "skip", write=self.write,
                  retention=self.retention, distributed=self.distributed, drain=self.drain_options,
                  replication=replication, remote=remote, remote_options=remote_options)  # fmt: skip
        self.rank, self.world_size, self._coord, self._nodes = s.rank, s.world_size, s.coord, s.nodes
        self.tier, self._dir_lock, self._local, self._tiers = s.tier, s.lock, s.local, s.tiers
        self.node_ranks, self._leader = self._nodes.ranks, self._nodes.leader == self.rank
        self._bg_coord: Coordinator | None = None  # the commit thread's own store connection

        self.lazy = self.staging.lazy_for(any(isinstance(v, torch.optim.Optimizer) for v in state.values()))
        target = Planner.chunk_target(self.write.chunk_bytes, self.staging.max_host_bytes)
        self._planner = Planner(self._coord, rank=self.rank, world_size=self.world_size, root_doc=self._leader,
                                target_chunk_bytes=target)  # fmt: skip
        self._attempts: dict[int, int] = defaultdict(int)
        self._restores = 0
        self._passed_over: dict[int, str] = {}  # newer local steps the last restore passed over: why
        self._pool: HostPool | None = None
        self._pipeline: Pipeline | None = None
        self._last: SaveHandle | None = None
        self._lock = threading.Lock()  # save() and restore() from several threads stay serialised
        self._closed = False
        self._counters: dict[str, Any] = {"saves": 0, "skipped": 0, "staging_blocked_s": 0.0}
        self.remote = self._tiers.remote
        self._job = Job(coord=self._coord, nodes=self._nodes, tier=self.tier, remote=self.remote, group=self.group)
        self._mem = Memory(self._memory, self._job, replication) if self._memory else None
        if replication is not None and replication.parity is not None and self._mem is None and self._coord.rank == 0:
            log.warning("ReplicationOptions.parity protects the memory tier's steps; without memory= it does nothing "
                        "(the local tier keeps %d whole copies)", replication.replicas)  # fmt: skip
        self._planner.align = RUN_ALIGN if self._mem else 1  # a slot stages the pack's image (Memory)
        self._owner = lineage.Owner(self._job, take_over=self.write.take_over, memory=self._mem is not None)
        self._hook = register_optimizer_step_pre_hook(self._before_optimizer_step) if self.lazy else None
        self._prefaulter = Prefaulter()
        if not self._local.sorted():  # where steps are committed, a restore comes first: it starts it
            self._prefault()
        self._pid = os.getpid()  # a forked child (Megatron's async saves fork their caller) never closes it
        unclosed.add(self)  # closed at interpreter exit if still open then

    def _prefault(self) -> None:
        """Fault in a pool for the state as it is now (see ``save.prefault``)."""
        if self.staging.prefault and self.world_size == 1 and self._pipeline is None and self._mem is None:
            self._prefaulter.start(self._prefault_target)

    def _prefault_target(self, stop: threading.Event) -> tuple[HostPool, int] | None:
        with self._lock:
            if stop.is_set() or self._pipeline is not None:
                return None
            _, leaves = flatten(self.state, allow_pickle=self.allow_pickle)
            if not leaves:
                return None
            pool = self._ensure_pool(leaves)
            plan = self._planner.for_leaves(leaves)
        bound = self.staging.max_host_bytes
        return pool, plan.pool_bytes if bound is None else min(plan.pool_bytes, bound)

    def _drop_prefault(self) -> None:
        self._prefaulter.give_back(self._pool if self._pipeline is None else None)  # before a restore, a close

    # ------------------------------------------------------------------------------- saving

    @gc_paused()  # flattening allocates per tensor: collections over the whole heap took half of save()
    def save(self, step: int, *, metadata: JSON = None) -> SaveHandle:
        """Checkpoint the state as ``step``; returns once the state may change (see StagingOptions)."""
        t_call = time.perf_counter()
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidArgumentError(f"step must be a non-negative int, not {step!r}")
        metadata = encode_metadata(metadata)  # refused here, before anything is written
        with self._lock:
            self._owner.before_save()  # may this run write where it saves? (tiering.lineage)
            if step in self._passed_over and step in self._local:
                set_aside_on_node(self._local, self._job, step, self._passed_over.pop(step), restore=self._restores)
            if step in self._local:
                raise StepExistsError(
                    f"step {step} is already committed in {self.tier.url}; saving it again would overwrite it"
                )
            if self._mem is not None:
                self._mem.before_save(step)  # the step a restore read from memory, being persisted
            inflight = self._pipeline.inflight_steps() if self._pipeline is not None else set()
            if step in inflight:
                raise StepExistsError(f"step {step} is already being saved")
            if self.staging.if_busy == "skip" and inflight:
                self._counters["skipped"] += 1
                why = "the previous save is still being written (StagingOptions(if_busy='skip'))"
                warnings.warn(f"tiercheck: skipped the save of step {step}: {why}", RuntimeWarning, stacklevel=2)
                return SaveHandle(step, skipped=True)
            tree, leaves = flatten(self.state, allow_pickle=self.allow_pickle)
            pipeline = self._ensure_pipeline(leaves)
            plan = self._planner.for_leaves(leaves)
            handle = SaveHandle(step, nbytes=sum(t.nbytes for t in plan.tasks))
            attempt, persist = self._attempts[step], self._mem is None or self._mem.persists(step)
            job = PendingSave(step=step, plan=plan, leaves=leaves, tree=tree, metadata=metadata, attempt=attempt,
                              save_id=new_save_id(self._nodes.run, step, attempt), handle=handle, t_call=t_call,
                              ready=record_ready(leaves), watch=self.lazy, persist=persist)  # fmt: skip
            self._attempts[step] += 1
            handle.timings["plan_s"] = time.perf_counter() - t_call
            pipeline.submit(job)
            self._counters["saves"] += 1
            self._last = handle
            if self.lazy:
                job.eager_staged.wait()
            else:
                wait_staged(handle)
            handle.timings["blocked_s"] = time.perf_counter() - t_call
            return handle

    def wait_staged(self) -> None:
        """Block until the latest save's host copy is complete (the state may then change)."""
        handle = self._last
        if handle is not None and not handle.staged.done():
            t0 = time.perf_counter()
            wait_staged(handle)
            waited = time.perf_counter() - t0
            self._counters["staging_blocked_s"] += waited
            handle.timings["hook_blocked_s"] = handle.timings.get("hook_blocked_s", 0.0) + waited

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed (and its memory copies or parity on the peers are
        over), and a step restored from the memory tier is persisted to the local directory and made
        whole again on the peers (their failure is logged); raise the failure of the latest save."""
        if self._pipeline is not None and not self._pipeline.wait_idle(timeout):
            raise TimeoutError(f"saves still in flight after {timeout} s")
        if self._mem is not None:
            self._mem.wait_persisted(timeout)
        if self._last is not None and not self._last.skipped:
            exc = self._last.committed.exception(timeout=0)
            if exc is not None:
                raise exc

    def forget_plan(self) -> None:
        """Re-plan at the next save even if this rank's leaves look the same: for frameworks
        whose other ranks' shares can change when this rank's do not (every rank must then call
        it, as planning is collective)."""
        self._planner.forget()

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.wait_staged()

    def _ensure_pool(self, leaves: list[Leaf]) -> HostPool:
        self._pool = self._pool or HostPool.for_tensors((x.tensor for x in leaves), self.staging.pin_memory)
        return self._pool

    def _ensure_pipeline(self, leaves: list[Leaf]) -> Pipeline:
        if self._pipeline is None:
            pool = self._ensure_pool(leaves)
            self._bg_coord = self._coord.connect_again()
            self._pipeline = Pipeline(
                self.tier,
                pool,
                io_threads=self.write.io_threads,
                max_host_bytes=self.staging.max_host_bytes,
                nice=self.write.nice,
                own_dir=len(self.node_ranks) == 1,
                commit=self._commit,
                on_commit=self._after_commit,
                memory=self._mem.slots if self._mem else None,
            )
        return self._pipeline

    def _commit(self, job: PendingSave) -> None:
        """Runs on the commit thread once this rank's writes are durable (or failed)."""
        assert self._bg_coord is not None
        bg = replace(self._job, coord=self._bg_coord)
        if self._mem is not None:
            self._mem.commit(bg, job, library_version=__version__, lineage=self._owner.lineage)
        if job.persist:
            commit_job(bg, job, library_version=__version__)

    def _after_commit(self, job: PendingSave) -> None:
        self._tiers.committed(job.step, job.handle.replicated, job.handle.drained, save=job.save_id)
        self._local.add(job.step)
        self._local.whole(job.step)  # committed: every rank's part is durable
        self._local.retain()

    # ------------------------------------------------------------------------------ restoring

    def steps(self) -> list[int]:
        """Committed steps on this node's local tier, oldest first."""
        return list_steps(self.tier).committed

    def latest_step(self) -> int | None:
        """The newest committed step on this node's local tier, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def restore(
        self,
        step: int | None = None,
        *,
        strict: bool = True,
        allow_pickle: bool | None = None,
        populate_local: bool = False,
        in_place: bool | None = None,
    ) -> int | None:
        """Restore a committed step into the state, in place; under ``torch.distributed`` every rank
        calls it, and the saved layout may differ from the current one. On the saving world size,
        items saved inside the state's entries that it lacks are added (a fresh optimizer gets its
        saved state). All or nothing, or in place at a job start: see docs/concepts/restore.md.

        Args:
            step: the step to restore; None: the newest step every rank can get.
            strict: every tensor of the state must be in the checkpoint (False: plain entries may lack some).
            allow_pickle: overrides the Checkpointer's ``allow_pickle`` for this restore (None: the
                Checkpointer's).
            populate_local: a node that lacked part of the step copies all of it from the remote tier
                into its local directory in the background, so the next restart reads locally.
            in_place: True reads straight into the state's tensors, False all or nothing; None: in
                place only before this Checkpointer has saved or restored.

        Returns:
            The restored step, or None when no tier holds a committed step and ``step`` was None.

        Raises:
            CheckpointNotFoundError: ``step`` is committed on no tier this rank can read.
            IncompatibleStateError: the state does not match the step (names, shapes, dtypes).
            CorruptCheckpointError: the step is damaged everywhere (``PartlyRestoredError``, a
                subclass, where tensors were already overwritten in place).
            CoordinationError: another rank failed; its error is quoted.
        """
        return self._restore(step, strict=strict, allow_pickle=allow_pickle, populate_local=populate_local,
                             in_place=in_place, others=False, extra=True)  # fmt: skip

    def _restore(
        self, step: int | None, *, strict: bool, allow_pickle: bool | None, populate_local: bool,
        in_place: bool | None, others: bool | Callable[[list[str]], Iterable[str]], extra: bool,
    ) -> int | None:  # fmt: skip
        """``restore``, choosing how the saved tree maps onto the state: see ``seam.restore_tree``."""
        self._check_open()
        self._drop_prefault()  # before the lock: pre-faulting plans under it
        with self._lock:
            if self._pipeline is not None:
                self._pipeline.wait_idle()  # a failed save is the handle's business, not restore's
            n = self._restores
            if in_place is None:  # at a job start, nothing the state holds is worth a second copy
                in_place = n == 0 and self._counters["saves"] == 0
            self._restores += 1
            try:
                d, pickle = self.distributed, self.allow_pickle if allow_pickle is None else allow_pickle
                request = RestoreRequest(step=step, strict=strict, allow_pickle=pickle, others=others, extra=extra,
                                         in_place=in_place, read_once=d.read_once, share_memory=d.share_memory,
                                         io_threads=self.write.io_threads)  # fmt: skip
                name = restore_scope(n)
                disk = functools.partial(restore_state, self.state, self._job, request, name=name, pool=self._pool)
                done = self._mem.restore(self.state, request, name, disk) if self._mem else disk()
            finally:
                self._prefault()  # for the state as restored (a fresh optimizer's state included)
            if self._mem is None and self.rank == 0:  # without the memory tier: says what it holds, if newer
                warn_of_newer(self.tier, None if done is None else done.step)
            if done is None:
                return None
            self._counters.update(done.counters())
            self._passed_over = dict(done.passed_over)
            self._local.add(*self.steps())
            self._local.whole(done.step)
            self._owner.restored(from_remote=done.from_remote, restore=n, step=done.step)
            self._tiers.own(done.step, done.save_id)  # the lineage's step: another save of it is set aside
            if self._mem is not None:
                self._mem.after_restore(done.step, from_memory=done.from_memory, local=self._local, tiers=self._tiers)
            if populate_local and done.from_remote and self._leader and len(done.held_here) < self.world_size:
                self._tiers.populate(done.step)
            return done.step

    # ------------------------------------------------------------------------------ lifecycle

    def stats(self) -> dict[str, Any]:
        """Counters and sizes of this rank, for logs and dashboards: ``saves``, ``committed``, the staging
        pool's, the store traffic's, and after a restore its reads and seconds by phase (``restore_*``),
        with ``memory=`` the background copies' (``memory_*``). Every key: docs/concepts/stats.md."""
        out: dict[str, Any] = dict(self._counters) | self._tiers.part_stats()
        if self._pipeline is not None:
            out.update(self._pipeline.counters)
        out["inflight"] = sorted(self._pipeline.inflight_steps()) if self._pipeline else []
        out.update(self._pool.stats() if self._pool else NO_POOL)
        out.update(lazy=self.lazy, rank=self.rank, world_size=self.world_size)
        out.update(self._planner.stats(), **(self._mem.stats() if self._mem else {"memory_held_bytes": 0}))
        out.update(store_traffic([c for c in (self._coord, self._bg_coord) if c is not None]))
        return out

    def drain(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait until every committed step the policy selects is on the remote tier (or failed).

        Returns the remote status (see ``status()``); raises ``RemoteStorageError`` if a drain
        failed since the last call. Steps an earlier run left undrained are included.
        """
        self._check_open()
        if self._tiers.drainer is None:
            raise InvalidArgumentError("this Checkpointer has no remote tier (pass remote=URL)")
        if self._pipeline is not None:
            self._pipeline.wait_idle(timeout)
        return self._tiers.wait_drained(timeout)

    def status(self) -> dict[str, Any]:
        """Where each tier stands: committed local steps, in-flight saves, and the remote drain
        (pending, draining, last drained, skipped, failed with the last error, retries, bytes)."""
        return {
            "rank": self.rank,
            "local": {
                "url": self.tier.url,
                "committed": self.steps(),
                "inflight": sorted(self._pipeline.inflight_steps()) if self._pipeline else [],
            },
            **self._tiers.status(),
        }

    def close(self, *, drain: bool = True, timeout: float | None = None) -> list[int]:
        """Wait for in-flight saves and (with ``drain``) for drains to the remote tier, then stop
        the background threads and give the staging pool's host memory back; ``timeout`` bounds
        the wait for drains. Returns the committed steps
        not drained to the remote tier (empty without one), with a WARNING when ``drain`` asked
        for them: they stay in the local directory, and the next run with this remote tier (or
        ``tiercheck drain``) finishes them. Idempotent.

        A Checkpointer still open at interpreter exit is closed then, with ``drain``, waiting for its saves
        and drains for at most ``DistributedOptions.timeout_s`` in all; a WARNING names what it abandoned."""
        return self._close(drain=drain, timeout=timeout)

    def _close_at_exit(self) -> None:
        if self._closed:
            return
        bound = self.distributed.timeout_s
        deadline = exit_deadline(bound)
        for c in (self._coord, self._bg_coord, *(x.node for x in (self._coord, self._bg_coord) if x)):
            if c is not None:  # commits not begun yet (and their nodes' waits) wait no longer than that either
                c.deadline = deadline
        log.info("exiting: closing the open Checkpointer of %s within %.0f s", self.tier.url, bound)
        self._close(drain=True, timeout=max(0.0, deadline - time.monotonic()), deadline=deadline)

    def _close(self, *, drain: bool, timeout: float | None, deadline: float | None = None) -> list[int]:
        """``close``; with a ``deadline`` (at exit), saves still in flight then are abandoned, with a WARNING."""
        if self._closed:
            return []
        self._closed = True
        unclosed.discard(self)
        if self._hook is not None:
            self._hook.remove()
        self._drop_prefault()
        abandoned: list[int] = []
        if self._pipeline is not None:
            abandoned = self._pipeline.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if abandoned:
            log.warning(
                "exiting: abandoned the save of step(s) %s to %s, still in flight after %.0f s "
                "(DistributedOptions.timeout_s): not committed; the next save or start removes its files",
                ", ".join(map(str, abandoned)),
                self.tier.url,
                self.distributed.timeout_s,
            )
        elif self._pool is not None:
            self._pool.drop()  # a closed Checkpointer holds no snapshot's worth of host memory
        if self._mem is not None and not abandoned:
            self._mem.close(local=self._local, tiers=self._tiers)
        if deadline is not None:
            timeout = max(0.0, deadline - time.monotonic())
        try:
            return self._tiers.close(drain=drain, timeout=timeout)
        finally:
            self._dir_lock.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this Checkpointer is closed")

