"""The public entry point: ``Checkpointer`` (save / restore in place) and ``load``."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import replace
from types import TracebackType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import __version__
from .commit import commit_step, list_steps, read_manifest, read_marker, step_dir, withdraw_step
from .coordination import Coordinator, default_store, node_id
from .drain import Drainer, pending_steps
from .errors import (
    CheckpointNotFoundError,
    CoordinationError,
    CorruptCheckpointError,
    IncompatibleStateError,
    RemoteStorageError,
    StepExistsError,
    TiercheckError,
)
from .flatten import (
    Leaf,
    _Encoder,
    decode,
    dtype_name,
    flatten,
    is_stateful,
    tensor_paths,
    torch_dtype,
)
from .manifest import JSON, Manifest
from .options import DistributedOptions, DrainOptions, RetentionOptions, StagingOptions, WriteOptions
from .pipeline import Pipeline, Plan, SaveHandle, SaveJob, rank_plan
from .planner import LeafDesc, Need, plan_reads, plan_writes
from .restore import ReadItem, move_chunks
from .retention import steps_to_delete
from .sharding import placement_of
from .staging import HostPool
from .tiers.base import Tier
from .tiers.local import LocalTier
from .tiers.remote import open_tier
from .transfer import copy_step

log = logging.getLogger("tiercheck")

_namespaces: dict[tuple[int, ...], itertools.count[int]] = defaultdict(itertools.count)
# One namespace per Checkpointer of a group: its ranks create them in the same order.


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
        allow_pickle: bool = False,
    ) -> None:
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping of names to state, not {type(state).__qualname__}")
        self.state = state
        self.staging = staging or StagingOptions()
        self.write = write or WriteOptions()
        self.retention = retention or RetentionOptions()
        self.distributed = distributed or DistributedOptions()
        self.drain_options = drain or DrainOptions()
        self.allow_pickle = allow_pickle
        if os.path.exists(local) and not os.path.isdir(local):
            raise NotADirectoryError(f"local tier {os.fspath(local)!r} exists and is not a directory")
        self.tier = LocalTier(local, fsync=self.write.fsync, direct_io=self.write.direct_io)
        self.tier.create()

        self.group = process_group
        cooperate = self.distributed.enabled is not False and dist.is_available() and dist.is_initialized()
        if self.distributed.enabled and not cooperate:
            raise ValueError("DistributedOptions(enabled=True) but torch.distributed is not initialized")
        if cooperate:
            self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
            self._coord = Coordinator(
                default_store(),
                rank=self.rank,
                world_size=self.world_size,
                namespace=_namespace(process_group),
                timeout_s=self.distributed.timeout_s,
            )
        elif process_group is not None:
            raise ValueError("process_group was given, but this Checkpointer does not cooperate with other ranks")
        else:
            self.rank, self.world_size = 0, 1
            self._coord = Coordinator.single(self.distributed.timeout_s)
        if self.world_size > 1 and self.staging.if_busy == "skip":
            raise ValueError(
                "StagingOptions(if_busy='skip') works in a single process only: ranks would decide differently"
            )
        # Ranks that see the same local directory are one node; its first rank commits and deletes there.
        me = node_id(local) if self.world_size > 1 else "local"
        self.nodes: list[str] = self._coord.exchange("nodes", me, what="every rank's node directory")
        self.node_ranks = tuple(r for r, n in enumerate(self.nodes) if n == self.nodes[self.rank])
        self._leader = self.node_ranks[0] == self.rank
        self._bg_coord: Coordinator | None = None  # the commit thread's own store connection

        self.lazy = self.staging.mode == "lazy" or (
            self.staging.mode == "auto" and any(isinstance(v, torch.optim.Optimizer) for v in state.values())
        )
        self._plan: Plan | None = None
        self._plans_made = 0
        self._attempts: dict[int, int] = defaultdict(int)
        self._restores = 0
        self._pool: HostPool | None = None
        self._pipeline: Pipeline | None = None
        self._last: SaveHandle | None = None
        self._lock = threading.Lock()  # save() and restore() from several threads stay serialised
        self._retention_lock = threading.Lock()  # commits of overlapping saves finish on different threads
        self._closed = False
        self._counters = {"saves": 0, "skipped": 0, "staging_blocked_s": 0.0}
        self._committed = set(self._clean_partial_steps() if self._leader else list_steps(self.tier).committed)
        self.remote: Tier | None = None
        self._drainer: Drainer | None = None
        self._resumer: threading.Thread | None = None
        self._populate: threading.Thread | None = None
        self._drain_failures_seen = 0
        if remote is not None:
            self.remote = (
                remote
                if isinstance(remote, Tier)
                else open_tier(
                    remote,
                    storage_options=remote_options,
                    retry=self.drain_options.retry,
                    part_bytes=self.drain_options.part_bytes,
                )
            )
            self._drainer = Drainer(
                self.tier,
                self.remote,
                self.drain_options,
                coord=self._coord.connect_again(),
                node_ranks=self.node_ranks,
                uploads=self._leader,
                on_settled=self._retain,
            )
            if self._leader:
                self._resumer = threading.Thread(
                    target=self._resume_drains, args=(sorted(self._committed),), name="tiercheck-resume", daemon=True
                )
                self._resumer.start()
        self._hook = register_optimizer_step_pre_hook(self._before_optimizer_step) if self.lazy else None

    # ------------------------------------------------------------------------------- saving

    def save(self, step: int, *, metadata: JSON = None) -> SaveHandle:
        """Checkpoint the state as ``step``; returns once the state may change (see StagingOptions)."""
        t_call = time.perf_counter()
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        with self._lock:
            if step in self._committed:
                raise StepExistsError(
                    f"step {step} is already committed in {self.tier.url}; saving it again would overwrite it"
                )
            inflight = self._pipeline.inflight_steps() if self._pipeline is not None else set()
            if step in inflight:
                raise StepExistsError(f"step {step} is already being saved")
            if self.staging.if_busy == "skip" and inflight:
                self._counters["skipped"] += 1
                warnings.warn(
                    f"tiercheck: skipped the save of step {step}: the previous save is still being written "
                    "(StagingOptions(if_busy='skip'))",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return SaveHandle(step, skipped=True)
            tree, leaves = flatten(self.state, allow_pickle=self.allow_pickle)
            pipeline = self._ensure_pipeline(leaves)
            plan = self._plan_for(leaves)
            handle = SaveHandle(step, nbytes=sum(t.nbytes for t in plan.tasks))
            job = SaveJob(
                step=step,
                plan=plan,
                leaves=leaves,
                tree=tree,
                metadata=metadata,
                attempt=self._attempts[step],
                handle=handle,
                t_call=t_call,
                ready=_record_ready(leaves),
            )
            self._attempts[step] += 1
            handle.timings["plan_s"] = time.perf_counter() - t_call
            pipeline.submit(job)
            self._counters["saves"] += 1
            self._last = handle
            if self.lazy:
                job.eager_staged.wait()
            else:
                _wait_staged(handle)
            handle.timings["blocked_s"] = time.perf_counter() - t_call
            return handle

    def wait_staged(self) -> None:
        """Block until the latest save's host copy is complete (the state may then change)."""
        handle = self._last
        if handle is not None and not handle.staged.done():
            t0 = time.perf_counter()
            _wait_staged(handle)
            waited = time.perf_counter() - t0
            self._counters["staging_blocked_s"] += waited
            handle.timings["hook_blocked_s"] = handle.timings.get("hook_blocked_s", 0.0) + waited

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed; raise the failure of the latest save."""
        if self._pipeline is not None and not self._pipeline.wait_idle(timeout):
            raise TimeoutError(f"saves still in flight after {timeout} s")
        if self._last is not None and not self._last.skipped:
            exc = self._last.committed.exception(timeout=0)
            if exc is not None:
                raise exc

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.wait_staged()

    def _plan_for(self, leaves: list[Leaf]) -> Plan:
        """This rank's write plan; re-planned (one exchange between ranks) only when a layout changed."""
        descs = tuple(
            LeafDesc(
                leaf.path,
                dtype_name(leaf.tensor.dtype),
                leaf.kind,
                leaf.global_shape,
                leaf.offsets,
                tuple(leaf.tensor.shape),
                leaf.lazy,
            )
            for leaf in leaves
        )
        if self._plan is not None and self._plan.signature == descs:
            return self._plan
        target = self.write.chunk_bytes
        if self.staging.max_host_bytes is not None:
            target = min(target, max(self.staging.max_host_bytes // 2, 4096))
        everyone = self._coord.exchange(
            f"plan{self._plans_made}",
            [d.to_json() for d in descs],
            what="every rank's tensors for a new save plan (layouts must change on all ranks at the same save)",
        )
        self._plans_made += 1
        write_plan = plan_writes(
            [[LeafDesc.from_json(d) for d in rank_descs] for rank_descs in everyone], target_chunk_bytes=target
        )
        self._plan = rank_plan(leaves, write_plan, self.rank, signature=descs, zarr_docs=self._leader)
        if self.world_size > 1:
            log.info(
                "rank %d: save plan for %d arrays: this rank writes %.1f MiB of %.1f MiB",
                self.rank,
                len(write_plan.records),
                write_plan.nbytes[self.rank] / 2**20,
                sum(write_plan.nbytes) / 2**20,
            )
        return self._plan

    def _ensure_pipeline(self, leaves: list[Leaf]) -> Pipeline:
        if self._pipeline is None:
            pin = self.staging.pin_memory
            if pin is None:
                pin = any(leaf.tensor.is_cuda for leaf in leaves)
            self._pool = HostPool(pin_memory=bool(pin))
            self._bg_coord = self._coord.connect_again()
            self._pipeline = Pipeline(
                self.tier,
                self._pool,
                io_threads=self.write.io_threads,
                max_host_bytes=self.staging.max_host_bytes,
                nice=self.write.nice,
                own_dir=len(self.node_ranks) == 1,
                commit=self._commit,
                on_commit=self._after_commit,
            )
        return self._pipeline

    def _commit(self, job: SaveJob) -> None:
        """Runs on the commit thread once this rank's writes are durable (or failed).

        Every rank posts its checksums and state tree to the store; when all have, the first rank
        of each node writes the manifest and the commit marker into its node's directory. A rank
        that failed says so and every rank fails the step; one that died is given up on after
        ``DistributedOptions.timeout_s``. The step is committed only after every node committed it.
        """
        c = self._bg_coord
        assert c is not None
        k = ("save", job.step, job.attempt)
        outcome = c.key(*k, "outcome")
        if job.error is not None:
            c.decide(outcome, f"rank {self.rank} failed: {job.error!r}")
            raise job.error
        part = {"crc": job.checksums, "tree": job.tree, "metadata": job.metadata, "created": time.time()}
        c.set(c.key(*k, "part", self.rank), json.dumps(part, separators=(",", ":")))
        if c.add(c.key(*k, "arrived"), 1) == self.world_size:
            c.decide(outcome, "ok")
        try:
            c.wait([outcome], what=f"the other ranks to write step {job.step}")
        except CoordinationError as e:
            c.decide(outcome, str(e))
        verdict = c.get(outcome).decode()
        if verdict != "ok":
            raise CoordinationError(f"step {job.step} was not committed: {verdict}")
        done = c.key(*k, "committed")
        if self._leader:
            try:
                parts = [json.loads(c.get(c.key(*k, "part", r))) for r in range(self.world_size)]
                manifest = self._manifest(job, parts)
                commit_step(self.tier, job.step, manifest.to_bytes(), ranks=self.node_ranks, world_size=self.world_size)
                if c.add(c.key(*k, "nodes"), 1) == len(set(self.nodes)):
                    c.decide(done, "ok")
            except BaseException as e:
                c.decide(done, f"the node of rank {self.rank} could not commit: {e!r}")
                raise
        c.wait([done], what=f"every node to commit step {job.step}")
        verdict = c.get(done).decode()
        if verdict != "ok":
            raise CoordinationError(f"step {job.step} is not committed on every node: {verdict}")
        c.delete(c.key(*k, "part", self.rank))

    def _manifest(self, job: SaveJob, parts: list[dict[str, Any]]) -> Manifest:
        checksums: dict[str, dict[str, int]] = defaultdict(dict)
        for p in parts:
            for path, crcs in p["crc"].items():
                checksums[path].update(crcs)
        trees: list[JSON] = []
        index: dict[str, int] = {}
        tree_of_rank = []
        for p in parts:
            text = json.dumps(p["tree"], sort_keys=True)
            if text not in index:
                index[text] = len(trees)
                trees.append(p["tree"])
            tree_of_rank.append(index[text])
        return Manifest(
            step=job.step,
            library_version=__version__,
            created_unix=parts[0]["created"],
            trees=trees,
            tree_of_rank=tree_of_rank,
            arrays={
                path: replace(rec, checksums=dict(sorted(checksums[path].items())))
                for path, rec in job.plan.records.items()
            },
            metadata=parts[0]["metadata"],
            topology={"world_size": self.world_size, "nodes": self.nodes},
        )

    def _resume_drains(self, committed_before: list[int]) -> None:
        """Queue the local steps a previous run committed but did not finish draining."""
        assert self._drainer is not None and self.remote is not None
        try:
            steps = pending_steps(committed_before, self.remote, self.drain_options)
        except Exception as e:  # an unreachable remote must not stop training: drains retry later
            log.error("could not check %s for unfinished drains: %s", self.remote.url, e)
            return
        if steps:
            log.info("resuming the drain of step(s) %s to %s", _fmt_steps(steps), self.remote.url)
            self._drainer.submit_many(steps)

    def _after_commit(self, job: SaveJob) -> None:
        step = job.step
        if self._drainer is not None:
            self._drainer.submit(step, job.handle.drained)
        else:
            job.handle.drained.set_result(False)
        with self._retention_lock:
            self._committed.add(step)
        self._retain()

    def _retain(self) -> None:
        """Apply local retention; steps still waiting to be drained are kept for a later pass."""
        with self._retention_lock:
            pinned = self._drainer.pinned() if self._drainer is not None else set()
            for old in steps_to_delete(self._committed, self.retention):
                if old in pinned:
                    continue  # still to be drained; a later pass deletes it
                if self._leader:
                    withdraw_step(self.tier, old)
                    log.info("retention: deleted step %d from %s", old, self.tier.url)
                self._committed.discard(old)

    def _clean_partial_steps(self) -> list[int]:
        listing = list_steps(self.tier)
        for step in listing.partial:
            log.warning(
                "removing partial step %d from %s (left by an interrupted save or deletion)", step, self.tier.url
            )
            self.tier.delete_tree(step_dir(step))
        return listing.committed

    # ------------------------------------------------------------------------------ restoring

    def steps(self) -> list[int]:
        """Committed steps on this node's local tier, oldest first."""
        return list_steps(self.tier).committed

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def restore(
        self,
        step: int | None = None,
        *,
        strict: bool = True,
        allow_pickle: bool | None = None,
        populate_local: bool = False,
        others: bool | Callable[[list[str]], Iterable[str]] = False,
        extra: bool = True,
    ) -> int | None:
        """Restore ``step`` (default: the newest step every rank can get) into the state, in place.

        Returns the restored step, or None when no tier holds a committed step (and ``step`` was
        not given). With ``strict``, every tensor of the state must be in the checkpoint. Under
        ``torch.distributed`` every rank calls it; the saved layout may differ from the current one.
        With ``populate_local``, a node that lacked part of the step copies all of it from the
        remote tier into its local directory in the background, so the next restart reads locally.

        ``others`` is for frameworks whose ranks save different top-level entries (DeepSpeed's
        per-rank files) and read each other's: entries of the saved state that this state lacks are
        added to it (the state must be a mutable mapping) and restored too: all of them with
        ``True``, or those a callable picks from the list of their names.

        On the saving world size, items this rank saved inside the state's entries that the state
        lacks are added (a fresh optimizer gets its saved state); ``extra=False`` restores only
        what the state holds, for frameworks that describe exactly what each rank needs (Megatron,
        whose layout may change at the same world size).
        """
        self._check_open()
        with self._lock:
            if self._pipeline is not None:
                self._pipeline.wait_idle()  # a failed save is the handle's business, not restore's
            n = self._restores
            self._restores += 1
            mine_held: JSON = {"held": self._held_steps(), "remote": self._remote_steps() if self.rank == 0 else []}
            exchanged = self._coord.exchange(f"restore{n}/held", mine_held, what="every rank's committed steps")
            everyone = [e["held"] for e in exchanged]
            remote_steps = set(exchanged[0]["remote"])
            step = _agree_on_step(everyone, step, remote_steps, where=self.tier.url)
            if step is None:
                return None
            use_remote = step in remote_steps
            manifest = self._fetch_manifest(f"restore{n}", step, everyone, use_remote)
            pickle_ok = self.allow_pickle if allow_pickle is None else allow_pickle
            where = f"{self.tier.url}: step {step}"
            try:
                if others:
                    _add_entries(self.state, manifest, others, where=where)
                tree = _tree_for(manifest, self.rank, self.world_size, self.state, extra=extra)
                items, decoded = _prepare(
                    self.state, manifest, tree, strict=strict, allow_pickle=pickle_ok, where=where
                )
                mine: JSON = {"needs": [[i.record.path, list(i.offsets), list(i.dest.shape)] for i in items]}
            except TiercheckError as e:
                if self.world_size == 1:
                    raise
                failure: TiercheckError | None = e
                mine = {"error": f"{type(e).__name__}: {e}"}
            else:
                failure = None
            needs_all = self._coord.exchange(f"restore{n}/needs", mine, what="every rank's restore plan")
            _raise_first_error(needs_all, failure, self.rank)
            needs = [[Need(p, tuple(o), tuple(s)) for p, o, s in r["needs"]] for r in needs_all]
            readable = [frozenset(h[str(step)][0]) if str(step) in h else frozenset() for h in everyone]
            plan = plan_reads(manifest.arrays, needs, readable, read_once=self.distributed.read_once, remote=use_remote)
            moved: dict[str, int] = {}
            try:
                with torch.no_grad():
                    nbytes = move_chunks(
                        self.tier,
                        step,
                        manifest.arrays,
                        items,
                        plan,
                        rank=self.rank,
                        group=self.group,
                        io_threads=self.write.io_threads,
                        remote=self.remote if use_remote else None,
                        counters=moved,
                    )
            except TiercheckError as e:
                if self.world_size == 1:
                    raise
                failure, mine = e, {"error": f"{type(e).__name__}: {e}"}
            else:
                mine = {"ok": nbytes}
                self._counters["restore_bytes_read"] = nbytes
                self._counters["restore_chunks_received"] = sum(t.dst == self.rank for t in plan.transfers)
                self._counters["restore_remote_reads"] = moved.get("remote_reads", 0)
                self._counters["restore_fallbacks"] = moved.get("fallbacks", 0)
            if self.world_size > 1:
                _raise_first_error(
                    self._coord.exchange(f"restore{n}/done", mine, what="every rank to read step"), failure, self.rank
                )
            _apply(self.state, decoded, where=where)
            self._committed.update(self.steps())
            if populate_local and use_remote and self._leader:
                mine_here = everyone[self.rank].get(str(step), [[], 0])
                if set(mine_here[0]) != set(range(manifest.world_size)):
                    self._populate = threading.Thread(
                        target=self._populate_local, args=(step,), name="tiercheck-populate", daemon=True
                    )
                    self._populate.start()
            log.info(
                "restored step %d (%s; %d chunks from %s, %d after a bad local copy)",
                step,
                _plural(len(items), "array"),
                moved.get("remote_reads", 0),
                self.remote.url if self.remote is not None else "no remote tier",
                moved.get("fallbacks", 0),
            )
            return step

    def _populate_local(self, step: int) -> None:
        assert self.remote is not None
        try:
            copy_step(self.remote, self.tier, step, concurrency=self.drain_options.concurrency)
        except Exception as e:  # the restore succeeded; a failed copy only costs the next restart
            log.error("could not copy step %d from %s to %s: %s", step, self.remote.url, self.tier.url, e)
            return
        with self._retention_lock:
            self._committed.add(step)

    def _remote_steps(self) -> list[int]:
        if self.remote is None:
            return []
        try:
            return list_steps(self.remote).committed
        except (OSError, TiercheckError) as e:  # restore from the local tier alone, and say so
            log.error("cannot list %s, restoring from local tiers only: %s", self.remote.url, e)
            return []

    def _held_steps(self) -> dict[str, JSON]:
        """This node's committed steps: ``{step: [saving ranks whose files are here, saving world size]}``."""
        held: dict[str, JSON] = {}
        for s in list_steps(self.tier).committed:
            try:
                marker = read_marker(self.tier, s)
            except TiercheckError as e:
                log.warning("ignoring step %d on %s: %s", s, self.tier.url, e)
                continue
            held[str(s)] = [list(marker.ranks), marker.world_size]
        return held

    def _fetch_manifest(self, key: str, step: int, everyone: list[dict[str, JSON]], use_remote: bool) -> Manifest:
        """Read the manifest here (or from the remote tier), or receive it from the first rank that
        has it (via the store)."""
        holders = [r for r, h in enumerate(everyone) if str(step) in h]
        if self.rank in holders:
            try:
                manifest = read_manifest(self.tier, step)
            except TiercheckError as e:
                if not use_remote or self.remote is None:
                    raise
                log.warning("%s; reading it from %s instead", e, self.remote.url)
                manifest = read_manifest(self.remote, step)
            if self.rank == holders[0] and len(holders) < self.world_size and not use_remote:
                self._coord.set(self._coord.key(key, "manifest"), manifest.to_bytes())
            return manifest
        if use_remote and self.remote is not None:
            return read_manifest(self.remote, step)
        k = self._coord.key(key, "manifest")
        self._coord.wait([k], what=f"rank {holders[0]} to share the manifest of step {step}")
        return Manifest.from_bytes(self._coord.get(k), where=f"step {step} (manifest from rank {holders[0]})")

    # ------------------------------------------------------------------------------ lifecycle

    def stats(self) -> dict[str, Any]:
        """Counters and sizes, for logs and dashboards."""
        out: dict[str, Any] = dict(self._counters)
        if self._pipeline is not None:
            out.update(self._pipeline.counters)
        out["inflight"] = sorted(self._pipeline.inflight_steps()) if self._pipeline else []
        out["pool_capacity_bytes"] = self._pool.capacity if self._pool else 0
        out["pool_peak_bytes"] = self._pool.peak_in_use if self._pool else 0
        out["pool_allocations"] = self._pool.allocations if self._pool else 0
        out["pool_pinned"] = self._pool.pin_memory if self._pool else False
        out["lazy"] = self.lazy
        out["rank"], out["world_size"] = self.rank, self.world_size
        out["plan_bytes_per_save"] = sum(t.nbytes for t in self._plan.tasks) if self._plan else 0
        return out

    def drain(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait until every committed step the policy selects is on the remote tier (or failed).

        Returns the remote status (see ``status()``); raises ``RemoteStorageError`` if a drain
        failed since the last call. Steps an earlier run left undrained are included.
        """
        self._check_open()
        if self._drainer is None:
            raise ValueError("this Checkpointer has no remote tier (pass remote=URL)")
        if self._pipeline is not None:
            self._pipeline.wait_idle(timeout)
        if self._resumer is not None:
            self._resumer.join(timeout)
        if not self._drainer.wait(timeout):
            raise TimeoutError(f"drains still running after {timeout} s")
        status = self._drainer.snapshot()
        if status["failed"] > self._drain_failures_seen:
            self._drain_failures_seen = status["failed"]
            raise RemoteStorageError(f"draining to {status['url']} failed: {status['last_error']}")
        return status

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
            "remote": self._drainer.snapshot() if self._drainer is not None else None,
        }

    def close(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Wait for in-flight saves and (with ``drain``) for drains to the remote tier, then stop
        the background threads. Idempotent. A drain still unfinished resumes in the next run."""
        if self._closed:
            return
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
        if self._pipeline is not None:
            self._pipeline.close()
        if self._populate is not None:
            self._populate.join(timeout)
        if self._drainer is not None:
            if self._resumer is not None:
                self._resumer.join(timeout)
            self._drainer.close(drain=drain, timeout=timeout)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Checkpointer is closed")


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
        raise CheckpointNotFoundError(f"step {step} is not committed in {root!r} (committed: {_fmt_steps(committed)})")
    manifest = read_manifest(tier, step)
    marker = read_marker(tier, step)
    where = f"{tier.url}: step {step}"
    out: dict[str, Any] = {}
    items, decoded = _prepare(
        out, manifest, manifest.tree(0), strict=False, allow_pickle=allow_pickle, where=where, fresh=True
    )
    if set(marker.ranks) != set(range(marker.world_size)):
        owners = {rec.owner(k) for rec in manifest.arrays.values() for k in rec.checksums}
        absent = sorted(owners - set(marker.ranks))
        if absent:
            raise CheckpointNotFoundError(
                f"{where}: the chunks written by saving rank(s) {_ranges(absent)} are in other nodes' local "
                f"directories; this one holds ranks {_ranges(sorted(marker.ranks))} of {marker.world_size}"
            )
    plan = plan_reads(manifest.arrays, [[i.need for i in items]], [frozenset(marker.ranks)], read_once=True)
    move_chunks(tier, step, manifest.arrays, items, plan, rank=0, io_threads=io_threads)
    _apply(out, decoded, where=where)
    return out


# ------------------------------------------------------------------------------------ helpers


def _namespace(group: Any) -> str:
    """Store keys of this Checkpointer: distinct per process group, and per Checkpointer in a group."""
    ranks = tuple(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
    members = "-".join(map(str, ranks)) if len(ranks) <= 8 else hashlib.sha1(repr(ranks).encode()).hexdigest()[:12]
    return f"g{members}/ckpt{next(_namespaces[ranks])}"


def _agree_on_step(
    everyone: list[dict[str, JSON]], requested: int | None, remote: set[int], *, where: str
) -> int | None:
    """The step to restore: committed on the remote tier, or whole across the ranks' local
    directories (the same answer on every rank)."""
    have: dict[int, set[int]] = defaultdict(set)  # step -> saving ranks whose files some rank can read
    world: dict[int, int] = {}
    holders: dict[int, list[int]] = defaultdict(list)  # step -> restoring ranks holding a copy
    for r, held in enumerate(everyone):
        for s, (ranks, ws) in held.items():
            have[int(s)].update(ranks)
            world[int(s)] = ws
            holders[int(s)].append(r)

    def missing(s: int) -> list[int]:
        return sorted(set(range(world[s])) - have[s])

    def lacking(s: int) -> str:
        without = sorted(set(range(len(everyone))) - set(holders[s]))
        return f"step {s}: the files of saving rank(s) {_ranges(missing(s))} are on no rank's local tier" + (
            f" (restoring rank(s) {_ranges(without)} have no copy of the step)" if without else ""
        )

    whole = sorted(remote | {s for s in have if not missing(s)})
    if requested is not None:
        if requested in whole:
            return requested
        if requested in have:
            raise CheckpointNotFoundError(f"{where}: cannot restore {lacking(requested)}")
        raise CheckpointNotFoundError(
            f"step {requested} is not committed on any rank's local tier or the remote tier "
            f"({where}; committed: {_fmt_steps(whole)})"
        )
    newer = [s for s in have if whole and s > whole[-1]]
    if newer:
        log.warning("newest steps are incomplete, skipping them: %s", "; ".join(lacking(s) for s in sorted(newer)))
    if whole:
        return whole[-1]
    if have:
        raise CheckpointNotFoundError(f"{where}: no committed step is whole; newest: {lacking(max(have))}")
    return None


def _raise_first_error(outcomes: list[JSON], own: BaseException | None, rank: int) -> None:
    if own is not None:
        raise own
    for r, o in enumerate(outcomes):
        if "error" in o:
            raise CoordinationError(f"rank {r} failed, so rank {rank} stops too: {o['error']}")


def _tree_for(manifest: Manifest, rank: int, world_size: int, state: Mapping[str, Any], *, extra: bool) -> JSON:
    """The saved tree to restore into ``rank``.

    On the saving world size it is the same rank's tree: entries the state lacks are added, as in
    a single process (a fresh optimizer gets its saved state). On another world size the layout
    changed and other ranks' entries mean nothing here: only the state's own keys are filled,
    each from the same rank's tree where it has it (rank 0's if there was no such rank), else
    from the first saving rank that had it (a pipeline stage that moved to this rank, say).
    """
    first = rank if rank < manifest.world_size else 0
    order = [first, *(r for r in range(manifest.world_size) if r != first)]
    seen: set[int] = set()
    trees = []
    for r in order:
        i = manifest.tree_of_rank[r]
        if i not in seen:
            seen.add(i)
            trees.append(manifest.trees[i])
    live = {k: v.state_dict() if is_stateful(v) else v for k, v in state.items()}
    return _merge(trees[0], trees[1:], live, only_live=not extra or world_size != manifest.world_size)


def _add_entries(
    state: Mapping[str, Any], manifest: Manifest, others: bool | Callable[[list[str]], Iterable[str]], *, where: str
) -> None:
    """Add to ``state`` (as None, to be filled) the saved top-level entries ``others`` selects."""
    names = sorted({k for t in manifest.trees if _plain_dict(t) for k in t} - set(state))
    chosen = [n for n in others(names) if n in names] if callable(others) else names
    if not chosen:
        return
    if not isinstance(state, MutableMapping):
        raise TypeError(f"{where}: restoring other ranks' entries needs a mutable state mapping")
    for name in chosen:
        state[name] = None


def _merge(node: JSON, others: list[JSON], live: Any, *, only_live: bool) -> JSON:
    if not _plain_dict(node) or not isinstance(live, Mapping):
        return node
    out = {k: v for k, v in node.items() if k in live or not only_live}
    for k, v in live.items():
        subs = [o[k] for o in others if _plain_dict(o) and k in o]
        if k in out:
            out[k] = _merge(out[k], subs, v, only_live=only_live)
        elif subs:
            out[k] = _merge(subs[0], subs[1:], v, only_live=only_live)
    return out


def _plain_dict(node: JSON) -> bool:
    return isinstance(node, dict) and not (len(node) == 1 and next(iter(node)).startswith("$"))


def _prepare(
    state: Mapping[str, Any],
    manifest: Manifest,
    tree: JSON,
    *,
    strict: bool,
    allow_pickle: bool,
    where: str,
    fresh: bool = False,
) -> tuple[list[ReadItem], dict[str, Any]]:
    """Match the saved tree to the state: what to read into which tensor, and the decoded values.

    Raises before anything is overwritten if a shape, dtype or key does not fit. With ``fresh``,
    ``state`` is an empty dict to take everything the tree holds, as new CPU tensors (``load``).
    """
    if not isinstance(tree, dict):
        raise CorruptCheckpointError(f"{where}: manifest tree is not an object")
    items: list[ReadItem] = []

    def source(tag: str, path: Any, live: Any) -> Any:
        rec = manifest.arrays.get(path) if isinstance(path, str) else None
        if rec is None:
            raise CorruptCheckpointError(f"{where}: the state refers to array {path!r}, which the manifest lacks")
        here = f"{where}: {path}"
        if isinstance(live, np.ndarray) and tag == "$ndarray" and live.flags.writeable and live.flags.c_contiguous:
            live_placed = placement_of(torch.from_numpy(live), where=here)
        else:
            live_placed = placement_of(live, where=here) if tag == "$tensor" else None
        if live_placed is not None:
            local, global_shape, offsets = live_placed
            if global_shape != rec.shape or dtype_name(local.dtype) != rec.dtype:
                raise IncompatibleStateError(
                    f"{here}: checkpoint has {rec.dtype}{list(rec.shape)}, "
                    f"the state to restore into has {dtype_name(local.dtype)}{list(global_shape)}"
                )
            items.append(ReadItem(rec, local, offsets))
            return live
        dest = torch.empty(rec.shape, dtype=torch_dtype(rec.dtype))
        items.append(ReadItem(rec, dest, (0,) * dest.dim()))
        return dest.numpy() if tag == "$ndarray" else dest

    keys = list(tree) if fresh else list(state)
    missing = [k for k in keys if k not in tree]
    if missing and strict:
        raise IncompatibleStateError(
            f"{where}: the checkpoint has no entry for {', '.join(map(repr, missing))} "
            f"(it holds: {', '.join(map(repr, tree))})"
        )
    decoded: dict[str, Any] = {}
    for key in keys:
        if key not in tree:
            continue
        live = None if fresh else state[key]
        if is_stateful(live):
            live = live.state_dict()
        if strict and live is not None:
            _check_no_missing_tensors(live, tree[key], key, where)
        decoded[key] = decode(tree[key], source, allow_pickle=allow_pickle, where=f"{where}: {key}", live=live)
    return items, decoded


def _apply(state: Mapping[str, Any], decoded: dict[str, Any], *, where: str) -> None:
    """Hand the decoded values (their tensors now filled) to the state."""
    for key, value in decoded.items():
        live = state.get(key)
        if is_stateful(live):
            live.load_state_dict(value)
        elif not _update_in_place(live, value):
            if not isinstance(state, MutableMapping):
                raise IncompatibleStateError(
                    f"{where}: cannot restore {key!r} in place and the state mapping is read-only"
                )
            state[key] = value


def _check_no_missing_tensors(live: Any, saved: JSON, key: str, where: str) -> None:
    probe = _Encoder(allow_pickle=True)
    probe.encode(live, [key], lambda t: False)
    saved_paths = set(tensor_paths(saved))
    missing = [leaf.path for leaf in probe.leaves if leaf.path not in saved_paths]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise IncompatibleStateError(f"{where}: tensors of the state are missing from the checkpoint: {shown}")


def _update_in_place(live: Any, new: Any) -> bool:
    """Make ``live`` equal ``new`` without replacing it. False when only replacement works."""
    if live is new:
        return True
    if isinstance(live, dict) and isinstance(new, dict):
        for k in [k for k in live if k not in new]:
            del live[k]
        for k, v in new.items():
            if k not in live or not _update_in_place(live[k], v):
                live[k] = v
        return True
    if isinstance(live, list) and isinstance(new, list):
        if len(live) != len(new):
            live[:] = new
            return True
        for i, v in enumerate(new):
            if not _update_in_place(live[i], v):
                live[i] = v
        return True
    return False


def _record_ready(leaves: list[Leaf]) -> torch.cuda.Event | None:
    if not any(leaf.tensor.is_cuda for leaf in leaves):
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream())
    return ev


def _wait_staged(handle: SaveHandle) -> None:
    handle.staged.exception()  # waits; a failed copy surfaces through handle.wait()/committed


def _fmt_steps(steps: list[int]) -> str:
    if not steps:
        return "none"
    return ", ".join(map(str, steps[-10:])) + (" (newest 10 shown)" if len(steps) > 10 else "")


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out: list[str] = []
    for _, group in itertools.groupby(enumerate(ranks), lambda p: p[1] - p[0]):
        run = [r for _, r in group]
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out) or "none"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
