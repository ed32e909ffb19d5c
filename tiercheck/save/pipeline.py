"""The save pipeline after planning: stage -> persist -> commit, with backpressure.

One stager thread takes saves in order and copies their chunks into the host pool; a small pool
of I/O threads writes each staged chunk (data + CRC32C trailer, fsync'd) to the tier and hands
its memory back; the thread finishing a save's last write commits it. Saves are therefore
committed independently, but staged strictly in order, and staging waits while the pool is full.
"""


from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import InvalidStateError, ThreadPoolExecutor

import torch

from tiercheck.errors import CoordinationError, StateChangedError, StepExistsError
from tiercheck.format.codec import CHECKSUM_BYTES, checksum, checksum_trailer
from tiercheck.format.paths import COMMIT_FILE, pack_file, refs_file, step_dir
from tiercheck.save.handle import PendingSave, WriteRequest
from tiercheck.save.pack import RUN_BYTES, Run, as_bytes, leaf_placement, plan_runs, runs_bytes, stamp_reference_map
from tiercheck.state.memory_slots import MemorySlots, SlotPool
from tiercheck.state.staging import HostPool, Region, chunk_views, copy_pieces, set_copy_threads
from tiercheck.tiers.local import LocalTier

log = logging.getLogger("tiercheck")


class Pipeline:
    def __init__(
        self,
        tier: LocalTier,
        pool: HostPool,
        *,
        io_threads: int,
        max_host_bytes: int | None,
        nice: int,
        own_dir: bool,
        commit: Callable[[PendingSave], None],
        on_commit: Callable[[PendingSave], None],
        memory: MemorySlots | None = None,
    ) -> None:
        self.tier = tier
        self.pool = pool
        self.memory = memory  # the memory tier's slots: each save stages into one, as its pack's image
        if memory is not None:
            memory.pin = pool.pin_memory  # page-locked where the pool would be: where CUDA tensors are staged
        self.max_host_bytes = max_host_bytes
        self.own_dir = own_dir  # no other rank writes into this tier
        self.commit = commit  # publishes a written save (or reports its failure) and waits for the other ranks
        self.on_commit = on_commit
        self._queue: queue.Queue[PendingSave | None] = queue.Queue()
        # Absolute target: threads the stager spawns would otherwise inherit its raised niceness.
        self._niceness = (
            min(os.getpriority(os.PRIO_PROCESS, 0) + nice, 19) if nice and sys.platform == "linux" else None
        )
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="tiercheck-io", initializer=self._lower_priority)
        # Commits wait for the other ranks; they do it here, in order, not on an I/O thread.
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="tiercheck-commit")
        self._submitted = 0  # saves submitted so far (each job's seq)
        self._next_commit = 0  # the seq of the save to commit next
        self._written: dict[int, PendingSave] = {}  # saves whose writes are done, waiting for earlier saves' commits
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._inflight: dict[int, PendingSave] = {}
        self._inflight_lock = threading.Lock()
        self._idle = threading.Condition(self._inflight_lock)
        # state_changed: failed saves whose lazily staged state changed before it was copied (StateChangedError)
        self.counters = {"committed": 0, "failed": 0, "state_changed": 0, "bytes_written": 0}
        self._stager = threading.Thread(target=self._stage_loop, name="tiercheck-stage", daemon=True)
        self._stager.start()

    # --- training-thread side -------------------------------------------------------------

    def submit(self, job: PendingSave) -> None:
        with self._inflight_lock:
            self._inflight[job.step] = job
            job.seq, self._submitted = self._submitted, self._submitted + 1
        self._queue.put(job)

    def inflight_steps(self) -> set[int]:
        with self._inflight_lock:
            return set(self._inflight)

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: not self._inflight, timeout)

    def close(self, timeout: float | None = None) -> list[int]:
        """Stop once the saves in flight are committed or failed, waiting at most ``timeout`` s; returns the steps
        abandoned then: their handles fail with ``CoordinationError``, writes and commits not begun are dropped,
        and a commit already waiting ends at its own timeout (the coordinator's)."""
        idle = self.wait_idle(timeout)
        self._queue.put(None)
        if idle:
            self._stager.join()
            self._io.shutdown(wait=True)
            self._committer.shutdown(wait=True)
            return []
        with self._inflight_lock:
            abandoned = dict(self._inflight)
        for step, job in sorted(abandoned.items()):
            error = CoordinationError(
                f"the save of step {step} to {self.tier.url} was abandoned: still in flight when the "
                f"Checkpointer closed at exit, {timeout:.0f} s later"
            )
            self._fail(job, error)
            job.eager_staged.set()
            h = job.handle
            for fut in (h.staged, h.committed, h.persisted, h.drained, h.replicated):
                with contextlib.suppress(InvalidStateError):  # done meanwhile
                    fut.set_exception(error)
        self._io.shutdown(wait=False, cancel_futures=True)
        self._committer.shutdown(wait=False, cancel_futures=True)
        return sorted(abandoned)

    # --- stager thread ----------------------------------------------------------------------

    def _lower_priority(self) -> None:
        """Make the calling background thread yield the CPU to training threads (Linux: per thread)."""
        if self._niceness is not None:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._niceness)
            except OSError:  # e.g. a sandbox without setpriority: run at normal priority
                log.debug("could not lower the priority of %s", threading.current_thread().name)

    def _stage_loop(self) -> None:
        # Not niced: the copy is on the training's critical path (save() or the next
        # optimizer.step() waits for it); only the I/O threads' work has slack.
        self._cpu_threads = torch.get_num_threads()
        while (job := self._queue.get()) is not None:
            try:
                self._stage(job)
            except BaseException as e:
                self._fail(job, e)
                if not job.handle.staged.done():
                    job.handle.staged.set_exception(e)
                job.eager_staged.set()
            finally:
                self._done_one(job)

    def _stage(self, job: PendingSave) -> None:
        job.t_stage0 = time.perf_counter()
        plan, d = job.plan, step_dir(job.step)
        if job.persist:  # else to the memory tier only: the node-local directory is not written
            self._make_room(job.step)
        runs, need = plan.runs, plan.pool_bytes
        eager, lazy = plan.tasks[: plan.n_eager], plan.tasks[plan.n_eager :]
        if leaf_placement(job.leaves) != plan.placement:  # same shapes, moved or re-strided since the plan
            runs = plan_runs(job.leaves, eager, lazy, RUN_BYTES)
            need = runs_bytes(runs)
        if self.memory is not None:  # the pack's image, each run at its place in it
            job.slot = self.memory.take(job.step, max((t.offset + t.nbytes + CHECKSUM_BYTES for t in plan.tasks),
                                                      default=0))  # fmt: skip
        else:
            bound = self.max_host_bytes
            self.pool.reserve(need if bound is None else min(need, bound))
            if self.pool.capacity < need:  # bounded below one snapshot: runs of half the pool at most
                runs = plan_runs(job.leaves, eager, lazy, self.pool.capacity // 2)
        if plan.refs:
            refs = stamp_reference_map(plan.refs, step=job.step, save=job.save_id)
            if self.memory is not None:
                self.memory.root.write(f"{d}/{refs_file(plan.rank)}", [refs])
            if job.persist:
                self._submit_write(job, WriteRequest(f"{d}/{refs_file(plan.rank)}", parts=[refs]))
        if plan.tasks and job.persist:
            job.pack = self.tier.open_pack(f"{d}/{pack_file(plan.rank)}")
        events: list[torch.cuda.Event] = []
        on_device: list[Run] = []  # lazy runs copied on a side stream: checked once their copies are done
        if plan.n_eager == 0:
            job.eager_staged.set()
        for part, part_runs in zip(("eager", "lazy"), runs, strict=True):
            # save() waits for the eager copies: all of torch's threads. Training goes on beside
            # the lazy ones: one thread, which copies as fast per CPU-second spent (see set_copy_threads).
            set_copy_threads(self._cpu_threads if part == "eager" else 1)
            for run in part_runs:
                if job.error is not None:
                    break
                event = self._copy_run(job, run, lazy=part == "lazy")
                if event is not None:
                    events.append(event)
                    if part == "lazy":
                        on_device.append(run)
            if part == "eager" and plan.n_eager:
                self._wait_events(events)
                job.eager_staged.set()
        self._wait_events(events)
        if on_device and job.error is None:
            # Counters move when a change is launched: one that did not move before the copies
            # ended left them whole. Conservative: a change after a run's copy ended counts too.
            error = job.changed((t for run in on_device for t in run.tasks), copying=True)
            if error is not None:
                self._fail(job, error)
        job.handle.timings["stage_s"] = time.perf_counter() - job.t_stage0
        job.eager_staged.set()
        if job.error is not None:
            raise job.error
        job.handle.staged.set_result(None)

    def _make_room(self, step: int) -> None:
        """Refuse a step committed in the local directory; remove a partial one a failure left there."""
        d = step_dir(step)
        if self.tier.exists(f"{d}/{COMMIT_FILE}"):  # committed by a run before this one: never overwritten
            raise StepExistsError(f"step {step} is already committed in {self.tier.url}; a save never overwrites it")
        if self.own_dir and self.tier.list_dir(d):  # a partial step of this number left by a failure
            log.warning("removing partial step %d from %s (left by a failed save) before saving it again", step,
                        self.tier.url)  # fmt: skip
            self.tier.delete_tree(d)

    def _copy_run(self, job: PendingSave, run: Run, *, lazy: bool) -> torch.cuda.Event | None:
        """Copy ``run``'s chunks into the pool and hand them to the I/O threads; returns the event
        after the copies on CUDA. The tensors of a lazy run are held to their version counters at
        save() (``PendingSave.changed``) right before the copy and, on the CPU, right after it (on
        CUDA once the copy has ended, in ``_stage``): a change fails the save, and bytes copied
        from a changed tensor are never written."""
        stream = self._stream_for(job.leaves[run.tasks[0].leaf].tensor, job)
        pool = self._pool_of(job)
        if job.slot is not None:
            region = job.slot.region(run.offset - run.lead, run.lead + run.nbytes)
        else:
            region = self.pool.acquire(run.lead + run.nbytes)
        try:
            error = job.changed(run.tasks, copying=False) if lazy else None
            if error is None:
                outs, pieces = self._stage_run(job, run, region)
                copy_pieces(outs, pieces, stream)
                if lazy and stream is None:
                    error = job.changed(run.tasks, copying=True)
        except BaseException:
            pool.release(region)
            raise
        if error is not None:
            pool.release(region)
            self._fail(job, error)
            return None
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        self._submit_write(job, WriteRequest(run.tasks[0].path, staged=(run, region), event=event))
        return event

    def _stage_run(self, job: PendingSave, run: Run, region: Region) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The (destination, source) pairs that copy ``run``'s chunks to their places in
        ``region``; alignment gaps between chunks are zeroed (the pool's memory is reused)."""
        outs, pieces = [], []
        end = run.lead
        pool = self._pool_of(job)
        for t in run.tasks:
            at = run.at(t)
            if at > end:
                pool.view(region, at - end, end).zero_()
            src = job.leaves[t.leaf].tensor
            dst = pool.view(region, t.nbytes, at)
            piece = as_bytes(src, t)
            if piece is not None:
                outs.append(dst)
                pieces.append(piece)
            else:
                out, piece = chunk_views(src, t.local, t.chunk_shape, dst)
                outs.append(out)
                pieces.append(piece)
            end = at + t.nbytes + CHECKSUM_BYTES
        return outs, pieces

    def _pool_of(self, job: PendingSave) -> HostPool | SlotPool:
        return self.pool if job.slot is None else job.slot

    def _stream_for(self, src: torch.Tensor, job: PendingSave) -> torch.cuda.Stream | None:
        if src.device.type != "cuda":
            return None
        stream = self._streams.get(src.device)
        if stream is None:
            stream = self._streams[src.device] = torch.cuda.Stream(device=src.device)
        if job.ready is not None:
            stream.wait_event(job.ready)  # copies must see every kernel queued before save()
        return stream

    @staticmethod
    def _wait_events(events: list[torch.cuda.Event]) -> None:
        for ev in events:
            ev.synchronize()
        events.clear()

    # --- I/O threads ------------------------------------------------------------------------

    def _submit_write(self, job: PendingSave, write: WriteRequest) -> None:
        with job._lock:
            job._pending += 1
        self._io.submit(self._write, job, write)

    def _write(self, job: PendingSave, write: WriteRequest) -> None:
        try:
            if job.error is not None:
                return
            t0 = time.perf_counter()
            if not job.t_write0:
                job.t_write0 = t0
            if write.staged is None:
                self.tier.write(write.path, write.parts)
            else:
                run, region = write.staged
                if write.event is not None:
                    write.event.synchronize()
                staged = memoryview(self._pool_of(job).view(region, run.nbytes, run.lead).numpy())  # type: ignore[arg-type]
                crcs = []
                for task in run.tasks:
                    at = task.offset - run.offset
                    crcs.append(checksum(staged[at : at + task.nbytes]))
                    staged[at + task.nbytes : at + task.nbytes + CHECKSUM_BYTES] = checksum_trailer(crcs[-1])
                if job.pack is not None:  # None: a save to the memory tier only, whose slot is its pack
                    job.pack.write_at(run.offset, [staged])  # the pack's bytes from the run's first chunk on
                with job._lock:
                    for task, crc in zip(run.tasks, crcs, strict=True):
                        job.checksums.setdefault(task.path, {})[task.chunk.key] = crc
            job.t_write1 = time.perf_counter()
        except BaseException as e:
            self._fail(job, e)
        finally:
            if write.staged is not None:
                self._pool_of(job).release(write.staged[1])
            self._done_one(job)

    def _fail(self, job: PendingSave, e: BaseException) -> None:
        with job._lock:
            if job.error is None:
                job.error = e

    def _done_one(self, job: PendingSave) -> None:
        with job._lock:
            job._pending -= 1
            last = job._pending == 0
        if last:
            self._finish(job)

    def _finish(self, job: PendingSave) -> None:
        """Hand a written save to the committer, in the order the saves were made: every rank meets
        the others at each commit in turn. A later save whose writes end first (it had less to
        write on this rank) waits here; committing it first deadlocked a job whose other ranks were
        still waiting for the earlier commit."""
        with self._inflight_lock:
            self._written[job.seq] = job
            while self._next_commit in self._written:
                self._committer.submit(self._commit, self._written.pop(self._next_commit))
                self._next_commit += 1

    def _remove_partial(self, job: PendingSave) -> None:
        """A failed save's files go at once (a full disk gets its space back), where this rank
        alone writes the directory; in a directory shared by a node's ranks, the next start removes
        them. A step with a commit marker, or a newer save of the same step, is never touched."""
        step = job.step
        with self._inflight_lock:  # held throughout: a save of this step submitted now waits
            if not self.own_dir or not job.persist or self._inflight.get(step) is not job:
                return
            try:
                if not self.tier.exists(f"{step_dir(step)}/{COMMIT_FILE}"):
                    self.tier.delete_tree(step_dir(step))
            except OSError as e:
                log.warning("could not remove the partial step %d from %s: %s", step, self.tier.url, e)

    def _commit(self, job: PendingSave) -> None:
        h = job.handle
        try:
            h.timings["persist_s"] = job.t_write1 - job.t_write0 if job.t_write0 else 0.0
            t0 = time.perf_counter()
            if job.pack is not None:
                try:
                    job.pack.close()  # one fsync for all of this rank's chunks
                except BaseException as e:
                    self._fail(job, e)
            self.commit(job)  # raises job.error, if any, once the other ranks know
            h.timings["commit_s"] = time.perf_counter() - t0
            h.timings["durable_s"] = time.perf_counter() - job.t_call
            self.counters["committed"] += 1
            self.counters["bytes_written"] += h.nbytes
            log.info(
                "step %d committed to %s: %.1f MiB, durable after %.3f s (stage %.3f s, persist %.3f s)",
                job.step,
                self.tier.url if job.persist else "the memory tier",
                h.nbytes / 2**20,
                h.timings["durable_s"],
                h.timings.get("stage_s", 0.0),
                h.timings["persist_s"],
            )
            if h.committed.done():  # abandoned at exit meanwhile (see close)
                return
            h.committed.set_result(None)  # before retention: the step is durable, deletions can wait
            h.persisted.set_result(job.persist)
            if not job.persist:  # in the memory tier only: neither replicated nor drained
                h.replicated.set_result(False)
                h.drained.set_result(False)
                return
            try:
                self.on_commit(job)
            except Exception:  # retention trouble must not turn a committed save into a failed one
                log.exception("retention after step %d failed", job.step)
        except BaseException as e:
            self.counters["failed"] += 1
            self.counters["state_changed"] += isinstance(e, StateChangedError)
            log.error("saving step %d to %s failed: %r", job.step, self.tier.url, e)
            self._remove_partial(job)
            if not h.staged.done():
                h.staged.set_exception(e)
            for fut in (h.committed, h.persisted, h.drained, h.replicated):  # a failed save goes nowhere
                if not fut.done():
                    fut.set_exception(e)
        finally:
            with self._idle:
                self._inflight.pop(job.step, None)
                self._idle.notify_all()


