"""The public entry point: ``Checkpointer`` (save / restore in place) and ``load``."""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Mapping, MutableMapping
from types import TracebackType
from typing import Any

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import __version__
from .commit import list_steps, read_manifest, step_dir, withdraw_step
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleStateError,
    StepExistsError,
)
from .flatten import (
    Leaf,
    _Encoder,
    decode,
    expected_record_for,
    flatten,
    is_stateful,
    tensor_paths,
    torch_dtype,
)
from .manifest import JSON, Manifest
from .options import RetentionOptions, StagingOptions, WriteOptions
from .pipeline import Pipeline, Plan, SaveHandle, SaveJob, plan_save
from .restore import ReadItem, read_arrays
from .retention import steps_to_delete
from .staging import HostPool
from .tiers.local import LocalTier

log = logging.getLogger("tiercheck")


class Checkpointer:
    """Saves and restores one training state on a node-local tier.

    ``state`` maps names to Stateful objects (anything with ``state_dict()`` and
    ``load_state_dict()``: modules, optimizers, schedulers) or to nested dicts / lists / tuples of
    tensors and plain values. ``restore()`` writes into these objects in place.
    """

    def __init__(
        self,
        state: Mapping[str, Any],
        *,
        local: str | os.PathLike[str],
        staging: StagingOptions | None = None,
        write: WriteOptions | None = None,
        retention: RetentionOptions | None = None,
        allow_pickle: bool = False,
    ) -> None:
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping of names to state, not {type(state).__qualname__}")
        self.state = state
        self.staging = staging or StagingOptions()
        self.write = write or WriteOptions()
        self.retention = retention or RetentionOptions()
        self.allow_pickle = allow_pickle
        if os.path.exists(local) and not os.path.isdir(local):
            raise NotADirectoryError(f"local tier {os.fspath(local)!r} exists and is not a directory")
        self.tier = LocalTier(local, fsync=self.write.fsync, direct_io=self.write.direct_io)
        self.tier.create()
        self.lazy = self.staging.mode == "lazy" or (
            self.staging.mode == "auto" and any(isinstance(v, torch.optim.Optimizer) for v in state.values())
        )
        self._plan: Plan | None = None
        self._pool: HostPool | None = None
        self._pipeline: Pipeline | None = None
        self._last: SaveHandle | None = None
        self._last_job: SaveJob | None = None
        self._lock = threading.Lock()  # save() and restore() from several threads stay serialised
        self._retention_lock = threading.Lock()  # commits of overlapping saves finish on different threads
        self._closed = False
        self._counters = {"saves": 0, "skipped": 0, "staging_blocked_s": 0.0}
        self._committed = set(self._clean_partial_steps())
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
                topology={"world_size": 1, "rank": 0},
                library_version=__version__,
                handle=handle,
                t_call=t_call,
                ready=_record_ready(leaves),
            )
            handle.timings["plan_s"] = time.perf_counter() - t_call
            pipeline.submit(job)
            self._counters["saves"] += 1
            self._last, self._last_job = handle, job
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
        signature = tuple((leaf.path, leaf.tensor.dtype, tuple(leaf.tensor.shape), leaf.lazy) for leaf in leaves)
        if self._plan is None or self._plan.signature != signature:
            target = self.write.chunk_bytes
            if self.staging.max_host_bytes is not None:
                target = min(target, max(self.staging.max_host_bytes // 2, 4096))
            self._plan = plan_save(leaves, signature=signature, target_chunk_bytes=target)
        return self._plan

    def _ensure_pipeline(self, leaves: list[Leaf]) -> Pipeline:
        if self._pipeline is None:
            pin = self.staging.pin_memory
            if pin is None:
                pin = any(leaf.tensor.is_cuda for leaf in leaves)
            self._pool = HostPool(pin_memory=bool(pin))
            self._pipeline = Pipeline(
                self.tier,
                self._pool,
                io_threads=self.write.io_threads,
                max_host_bytes=self.staging.max_host_bytes,
                nice=self.write.nice,
                on_commit=self._after_commit,
            )
        return self._pipeline

    def _after_commit(self, step: int) -> None:
        with self._retention_lock:
            self._committed.add(step)
            for old in steps_to_delete(self._committed, self.retention):
                withdraw_step(self.tier, old)
                self._committed.discard(old)
                log.info("retention: deleted step %d from %s", old, self.tier.url)

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
        """Committed steps on the local tier, oldest first."""
        return list_steps(self.tier).committed

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def restore(self, step: int | None = None, *, strict: bool = True, allow_pickle: bool | None = None) -> int | None:
        """Restore ``step`` (default: the newest committed one) into the state, in place.

        Returns the restored step, or None when the tier holds no committed step (and ``step`` was
        not given). With ``strict``, every tensor of the state must be in the checkpoint.
        """
        self._check_open()
        with self._lock:
            if self._pipeline is not None:
                self._pipeline.wait_idle()  # a failed save is the handle's business, not restore's
            committed = self.steps()
            step = _choose_step(committed, step, where=self.tier.url)
            if step is None:
                return None
            manifest = read_manifest(self.tier, step)
            pickle_ok = self.allow_pickle if allow_pickle is None else allow_pickle
            _restore_into(
                self.state, manifest, self.tier, strict=strict, allow_pickle=pickle_ok, io_threads=self.write.io_threads
            )
            self._committed.update(committed)
            log.info("restored step %d from %s", step, self.tier.url)
            return step

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
        return out

    def close(self) -> None:
        """Wait for in-flight saves, then stop the background threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
        if self._pipeline is not None:
            self._pipeline.close()

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
    path: str | os.PathLike[str], step: int | None = None, *, allow_pickle: bool = False, io_threads: int = 4
) -> dict[str, Any]:
    """Read a committed step into a plain nested dict of CPU tensors (state_dicts become dicts)."""
    root = os.fspath(path)
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"no checkpoint directory at {root!r}")
    tier = LocalTier(root, fsync=False)
    step = _choose_step(list_steps(tier).committed, step, where=repr(root))
    if step is None:
        raise CheckpointNotFoundError(f"{root!r} holds no committed step")
    manifest = read_manifest(tier, step)
    out: dict[str, Any] = {}
    _restore_into(out, manifest, tier, strict=False, allow_pickle=allow_pickle, io_threads=io_threads, fresh=True)
    return out


# ------------------------------------------------------------------------------------ helpers


def _restore_into(
    state: Mapping[str, Any],
    manifest: Manifest,
    tier: LocalTier,
    *,
    strict: bool,
    allow_pickle: bool,
    io_threads: int,
    fresh: bool = False,
) -> None:
    where = f"{tier.url}: step {manifest.step}"
    tree = manifest.tree
    if not isinstance(tree, dict):
        raise CorruptCheckpointError(f"{where}: manifest tree is not an object")
    items: list[ReadItem] = []

    def source(tag: str, path: Any, live: Any) -> Any:
        rec = manifest.arrays.get(path) if isinstance(path, str) else None
        if rec is None:
            raise CorruptCheckpointError(f"{where}: the state refers to array {path!r}, which the manifest lacks")
        here = f"{where}: {path}"
        if tag == "$tensor" and isinstance(live, torch.Tensor):
            expected_record_for(live, rec, where=here)
            items.append(ReadItem(rec, live.detach()))
            return live
        if tag == "$ndarray" and isinstance(live, np.ndarray) and live.flags.writeable and live.flags.c_contiguous:
            dest = torch.from_numpy(live)
            expected_record_for(dest, rec, where=here)
            items.append(ReadItem(rec, dest))
            return live
        dest = torch.empty(rec.shape, dtype=torch_dtype(rec.dtype))
        items.append(ReadItem(rec, dest))
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
            live_sd = live.state_dict()
            if strict:
                _check_no_missing_tensors(live_sd, tree[key], key, where)
            decoded[key] = decode(tree[key], source, allow_pickle=allow_pickle, where=f"{where}: {key}", live=live_sd)
        else:
            decoded[key] = decode(tree[key], source, allow_pickle=allow_pickle, where=f"{where}: {key}", live=live)
    # Every shape and dtype is checked above; only now is anything overwritten.
    with torch.no_grad():
        read_arrays(tier, manifest.step, items, io_threads=io_threads)
    for key, value in decoded.items():
        live = None if fresh else state[key]
        if is_stateful(live):
            live.load_state_dict(value)
        elif not _update_in_place(live, value):
            if not isinstance(state, MutableMapping):
                raise IncompatibleStateError(
                    f"{where}: cannot restore {key!r} in place and the state mapping is read-only"
                )
            state[key] = value


def _check_no_missing_tensors(live_sd: Any, saved: JSON, key: str, where: str) -> None:
    probe = _Encoder(allow_pickle=True)
    probe.encode(live_sd, [key], lambda t: False)
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


def _choose_step(committed: list[int], step: int | None, *, where: str) -> int | None:
    """``step`` if it is committed, the newest committed step if ``step`` is None (None if none)."""
    if step is None:
        return committed[-1] if committed else None
    if step not in committed:
        raise CheckpointNotFoundError(f"step {step} is not committed in {where} (committed: {_fmt_steps(committed)})")
    return step


def _fmt_steps(steps: list[int]) -> str:
    if not steps:
        return "none"
    return ", ".join(map(str, steps[-10:])) + (" (newest 10 shown)" if len(steps) > 10 else "")
