"""Copying committed steps from the node-local tier to the remote tier, in the background.

Each node uploads the files in its own directory (with several nodes they are disjoint: each chunk
was written once, on one node), then leaves a ``__drained.<first rank>.json`` object naming the
saving ranks whose files it uploaded. The node that finds every rank accounted for uploads the
manifest and writes the remote ``COMMIT`` last, then applies remote retention. The remote tier
is thus its own record: a drain cut short by a crash resumes from what the remote already holds,
in this job or the next. A local step is pending until the remote holds its save (``pending_steps``:
by save, never by step number). It resumes by content: a node's files there are kept only under its
marker naming the same save (``transfer.resumable``), its drained object counts only for the save
it names, and a remote step committed by another save of the step number (saved again after a
rollback) is replaced, never taken for this one.

Nothing here blocks training: uploads run on their own threads with their own retries, a failing
remote fails the drain of a step (reported on its handle, in ``status()`` and in the log) and
never the local checkpoint, and local retention keeps any step still waiting to be drained.
"""



from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tiercheck.cluster.coordination import Coordinator
from tiercheck.cluster.keys.tiering import drain_aside_key, drain_decision_key, drain_node_key, remote_commit_key
from tiercheck.cluster.nodes import Nodes
from tiercheck.errors import (
    CheckpointNotFoundError,
    ContestedStepError,
    CoordinationError,
    CorruptCheckpointError,
    RemoteStorageError,
    TiercheckError,
)
from tiercheck.format.commit import copy_aside, withdraw_step
from tiercheck.format.lineage import abandoned_on, abandoned_why
from tiercheck.format.paths import (
    COMMIT_FILE,
    step_dir,
)
from tiercheck.format.steps import list_steps, read_marker
from tiercheck.format.verify import step_damage
from tiercheck.humanize import fmt_steps
from tiercheck.options import DrainOptions
from tiercheck.tiering.retention import steps_to_delete
from tiercheck.tiering.suppliers import post_held, unsupplied
from tiercheck.tiering.upload import contested, upload_step
from tiercheck.tiers.base import Tier
from tiercheck.tiers.local import LocalTier

log = logging.getLogger("tiercheck")


class Drainer:
    """One per rank. The first rank of a node uploads; the others learn the outcome via the store."""

    def __init__(
        self,
        local: LocalTier,
        remote: Tier,
        options: DrainOptions,
        *,
        coord: Coordinator,
        nodes: Nodes,
        on_settled: Callable[[], None] = lambda: None,
        take_over: bool = False,
    ) -> None:
        self.local = local
        self.remote = remote
        self.options = options
        self.coord = coord
        self.node_ranks = nodes.ranks
        self.node_count = nodes.count
        self._held: set[tuple[int, str]] = set()  # (step, save) this node's directory held at the start
        self.uploads = uploads = coord.rank == nodes.leader  # the node's first rank
        self.on_settled = on_settled  # a drain finished or steps were skipped: local retention may act
        self.take_over = take_over  # the remote prefix may hold another lineage's steps (lineage.check_remote)
        self._cond = threading.Condition()
        self._queue: dict[int, list[Future[bool]]] = {}
        self._current: int | None = None
        self._failed: set[int] = set()  # drains that failed in this run (the local copy is kept)
        self._checking: set[int] = set()  # local steps whose save the resume is looking for on the remote
        # (step, save) this run restored or saved: its lineage's, whatever else the remote holds under the number
        self._ours: set[tuple[int, str]] = set()
        self._owned = False  # the run restored or saved: a step it did not own is contested no longer, it failed
        # Steps whose drain found the remote's other save in the way before the run restored or saved anything
        # (a resumed drain at start): they wait for that, which says whether the step is the run's.
        self._contested: dict[int, tuple[list[Future[bool]], ContestedStepError]] = {}
        self._settling = False
        self._stop = False
        self._pool = ThreadPoolExecutor(options.concurrency, thread_name_prefix="tiercheck-upload") if uploads else None
        self.status: dict[str, Any] = {
            "url": remote.url,
            "last_drained": None,
            "drained": 0,
            "skipped": 0,
            "failed": 0,
            "last_error": None,
            "bytes_uploaded": 0,
            "files_uploaded": 0,
            "files_already_there": 0,
            "last_drain_s": None,
        }
        self._resumer: threading.Thread | None = None
        self._thread = threading.Thread(target=self._loop, name="tiercheck-drain", daemon=True)
        self._thread.start()

    # --- caller side --------------------------------------------------------------------------

    def submit(self, step: int, future: Future[bool] | None = None) -> None:
        """Drain ``step`` (committed locally) unless the policy skips it; ``future`` gets the outcome."""
        if step % self.options.every:
            if future is not None:
                future.set_result(False)
            return
        with self._cond:
            self._queue.setdefault(step, [])
            if future is not None:
                self._queue[step].append(future)
            self._cond.notify_all()

    def submit_many(self, steps: list[int]) -> None:
        """Queue several steps at once (a resumed drain): the backlog policy sees them together."""
        with self._cond:
            for step in steps:
                if step % self.options.every == 0:
                    self._queue.setdefault(step, [])
            self._cond.notify_all()

    def own(self, step: int, save: str | None) -> None:
        """This run restored or saved ``step`` as the save ``save``: the step is its lineage's, and a
        remote step of that number committed by another save, not abandoned, is set aside (kept) when
        it is drained (``_set_aside``). A step whose drain waits for that goes again now."""
        with self._cond:
            if save is not None:
                self._ours.add((step, save))
            self._owned = True
            for waiting, (futures, _) in self._contested.items():
                self._queue.setdefault(waiting, []).extend(futures)
            self._contested.clear()
            self._cond.notify_all()

    def resume(self, local_steps: list[int]) -> None:
        """In the background: queue the local steps a previous run committed but did not finish
        draining (those whose save the remote does not hold). Until that is known, local
        retention keeps them all (``pinned``)."""
        with self._cond:
            self._checking = set(local_steps)

        def run() -> None:
            if self.coord.world_size > 1:
                try:
                    held = post_held(self.coord.connect_again(), self.local, local_steps, self.node_count)
                    with self._cond:
                        self._held = held
                except (RuntimeError, CoordinationError) as e:  # drains of other nodes' files wait as before
                    log.debug("could not post the steps this node holds: %s", e)
            try:
                steps = pending_steps(self.local, local_steps, self.remote, self.options.every)
            except Exception as e:  # an unreachable remote must not stop training: the drains find out
                log.error("could not check %s for unfinished drains (%s): queueing every local step",
                          self.remote.url, e)  # fmt: skip
                steps = [s for s in local_steps if s % self.options.every == 0]
            if steps:
                log.info("resuming the drain of step(s) %s to %s", fmt_steps(steps), self.remote.url)
                self.submit_many(steps)  # queued: pinned from here on
            with self._cond:
                self._checking = set()

        self._resumer = threading.Thread(target=run, name="tiercheck-resume", daemon=True)
        self._resumer.start()

    def pinned(self) -> set[int]:
        """Steps local retention must keep: waiting to be drained, being drained, or whose drain
        failed in this run (the remote holds no copy verified as the same save: the local one is
        the only one)."""
        with self._cond:
            current = {self._current} if self._current is not None else set()
            return set(self._queue) | self._failed | current | self._checking | set(self._contested)

    def wait(self, timeout: float | None = None) -> bool:
        if self._resumer is not None:
            self._resumer.join(timeout)
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._queue and self._current is None and not self._settling, timeout
            )

    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            out = dict(self.status)
            out["pending"] = sorted(self._queue)
            out["draining"] = self._current
            out["contested"] = sorted(self._contested)
        counters = getattr(self.remote, "counters", None)
        if counters is not None:
            out["retries"] = counters["retries"]
            out["requests"] = counters["requests"]
        return out

    def close(self, *, drain: bool, timeout: float | None = None) -> list[int]:
        """Stop, after waiting (with ``drain``) for the queued drains; ``timeout`` bounds the whole
        wait. Returns the steps left undrained: queued, in flight when the wait ran out (their
        requests stop retrying), or failed in this run. Without ``drain`` nothing in flight is
        waited for (a drain waiting for other nodes' files would hold it up to the retry deadline):
        it is stopped, and the next job resumes it from the local directory (invariant 11)."""
        deadline = None if timeout is None or not drain else time.monotonic() + timeout

        def left() -> float | None:
            return 0.0 if not drain else None if deadline is None else max(0.0, deadline - time.monotonic())

        if not drain:
            with self._cond:
                self._stop = True  # the drain thread acts no more (``_loop``): no verdict, no local retention
            self.remote.abort()
        if self._resumer is not None:
            self._resumer.join(left())
        if drain:
            self.wait(left())
        with self._cond:
            for step, (futures, e) in self._contested.items():  # the run never said the step is its own
                self._fail(step, futures, e)
            self._contested.clear()
            current = {self._current} if self._current is not None else set()
            undrained = set(self._queue) | self._failed | current | self._checking
            self._stop = True
            for futures in self._queue.values():
                for f in futures:
                    f.cancel()
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(left())
        if self._thread.is_alive():  # an upload still in flight: its requests give up at their next retry
            self.remote.abort()
        if self._pool is not None:
            self._pool.shutdown(wait=not self._thread.is_alive(), cancel_futures=True)
        return sorted(undrained)

    # --- drain thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop)
                if self._stop:
                    return
                waiting = sorted(self._queue)
                chosen = self._choose(waiting)
                skipped = {s: self._queue.pop(s) for s in waiting if s < chosen}
                futures = self._queue.pop(chosen)
                self._current = chosen
            for s, fs in skipped.items():
                self.status["skipped"] += 1
                log.info("drain: skipping step %d, step %d is newer (DrainOptions(backlog='newest'))", s, chosen)
                for f in fs:
                    f.set_result(False)
            try:
                t0 = time.perf_counter()
                self._drain(chosen)
                with self._cond:
                    self.status.update(drained=self.status["drained"] + 1, last_drained=chosen)
                    self.status["last_drain_s"] = time.perf_counter() - t0
                    self._failed.discard(chosen)
                for f in futures:
                    f.set_result(True)
            except BaseException as e:
                if isinstance(e, OSError) and not isinstance(e, TiercheckError):  # a file:// remote's own
                    cause, e = e, RemoteStorageError(f"{self.remote.url}: draining step {chosen}: {e}")
                    e.__cause__ = cause
                with self._cond:
                    if isinstance(e, _Contested) and self._owned:  # the run restored or saved meanwhile: again
                        self._queue.setdefault(chosen, []).extend(futures)
                    elif isinstance(e, _Contested):
                        self._contested[chosen] = (futures, e.error)
                        log.info("drain: step %d waits for this run to restore or save it: %s", chosen, e.error)
                    else:
                        self._fail(chosen, futures, e)
            finally:
                with self._cond:
                    self._current = None
                    stopped = self._stop  # closed meanwhile (``close``): the Checkpointer no longer owns the directory
                    self._settling = not stopped
                if not stopped:
                    try:
                        self.on_settled()
                    except Exception:
                        log.exception("local retention after draining step %d failed", chosen)
                    with self._cond:
                        self._settling = False
                        self._cond.notify_all()

    def _fail(self, step: int, futures: list[Future[bool]], e: BaseException) -> None:
        """The drain of ``step`` failed (under ``_cond``): counted, said, and each future told."""
        self.status["failed"] += 1
        self._failed.add(step)
        self.status["last_error"] = f"step {step}: {type(e).__name__}: {e}"
        log.error("drain of step %d to %s failed (the local copy is kept): %s", step, self.remote.url, e)
        for f in futures:
            if not f.cancelled():
                f.set_exception(e)

    def _choose(self, waiting: list[int]) -> int:
        """The step to drain next. With several nodes, the nodes must pick the same steps: the
        first node to decide about a step decides for all (through the store)."""
        if self.options.backlog == "all":
            return waiting[0]
        newest = waiting[-1]
        if self.coord.world_size == 1:
            return newest
        for s in waiting:
            wanted = "go" if s == newest else "skip"
            try:
                decided = self.coord.decide(drain_decision_key(self.coord, s), wanted)
            except (RuntimeError, CoordinationError):  # the job's store is gone: decide alone
                decided = wanted
            if decided == "go":
                return s
        return newest

    def _drain(self, step: int) -> None:
        if not self.uploads:
            self._follow(step)
            return
        outcome = drain_node_key(self.coord, step, self.node_ranks[0])
        try:
            self._upload(step)
        except BaseException as e:
            if isinstance(e, ContestedStepError):
                with self._cond:
                    waits = not self._owned
                if waits:  # for the run's restore or save (``_loop``), then goes again: no verdict yet
                    raise _Contested(e) from e
            why = f"error: {type(e).__name__}: {e}"
            self._tell(outcome, why)
            # The other nodes wait for the remote commit this node's files would complete: tell them it
            # will not come (unless it already did), or they wait out the retry deadline (900 s).
            if self.coord.world_size > 1:
                try:
                    self.coord.decide(
                        remote_commit_key(self.coord, step), f"the node of rank {self.node_ranks[0]}: {why}"
                    )
                except (RuntimeError, CoordinationError):
                    log.debug("could not post the drain failure to the store")
            raise
        self._tell(outcome, "ok")

    def _tell(self, key: str, value: str, *, everyone: bool = False) -> None:
        if self.coord.world_size > 1 and (everyone or len(self.node_ranks) > 1):
            try:
                self.coord.set(key, value)
            except (RuntimeError, CoordinationError):
                log.debug("could not post the drain outcome to the store")

    def _follow(self, step: int) -> None:
        """A rank that does not upload: wait for its node's first rank to say how it went."""
        key = drain_node_key(self.coord, step, self.node_ranks[0])
        self.coord.wait(
            [key], what=f"rank {self.node_ranks[0]} to drain step {step}", timeout_s=4 * self.options.retry.deadline_s
        )
        verdict = self.coord.get(key).decode()
        if verdict != "ok":
            raise CoordinationError(f"rank {self.node_ranks[0]} could not drain step {step}: {verdict}")

    def _upload(self, step: int) -> None:
        def count(nbytes: int) -> None:
            with self._cond:
                self.status["bytes_uploaded"] += nbytes
                self.status["files_uploaded"] += 1

        assert self._pool is not None
        self._set_aside(step)
        result = upload_step(self.local, self.remote, step, pool=self._pool, on_file=count, take_over=self.take_over)
        with self._cond:
            self.status["files_already_there"] += result.files_already_there
        committed = remote_commit_key(self.coord, step)
        if result.committed:
            self._tell(committed, "ok", everyone=True)
            self._retain()
        elif not result.was_committed:
            # Another node will find every rank accounted for and commit; wait for its word.
            self._check_supplied(step)
            self.coord.wait(
                [committed], what=f"the remote commit of step {step}", timeout_s=self.options.retry.deadline_s
            )
            if not self.remote.exists(f"{step_dir(step)}/{COMMIT_FILE}"):
                verdict = self.coord.get(committed).decode()
                raise CoordinationError(f"step {step} was not committed on {self.remote.url}: {verdict}")

    def _check_supplied(self, step: int) -> None:
        """Of a step the local directory held at the start (a resumed drain): raise where some saving
        rank's files are neither on the remote nor in any node's directory (``tiering.suppliers``),
        rather than wait out the retry deadline for a commit that cannot come."""
        save = read_marker(self.local, step).save_id
        with self._cond:
            resumed = (step, save) in self._held
        if not resumed:  # saved or persisted in this run: each node uploads its files of it
            return
        try:
            missing = unsupplied(self.coord, self.local, self.remote, step)
        except (RuntimeError, CoordinationError) as e:
            log.debug("drain: could not learn which nodes hold step %d (%s): waiting for its commit", step, e)
            return
        if missing:
            raise CoordinationError(
                f"not committing step {step} on {self.remote.url}: no node of this job holds the files of "
                f"{len(missing)} saving rank(s), e.g. {missing[:8]} (a node's directory lost since?), nor does the "
                "remote; this node's files stay there, and its local copy is kept for a job holding them all to drain"
            )

    def _set_aside(self, step: int) -> None:
        """Where this run restored or saved the local ``step`` (``own``) and the remote holds that
        number committed by another save its lineage has not abandoned (planted there, or left by a
        run whose save the lineage never restored): set it aside on the remote, kept and named in
        the log (``format.commit.copy_aside``), so that this run's save drains. Job rank 0's node
        sets it aside; a node that sees it in the way waits for its word before it replaces files."""
        save = read_marker(self.local, step).save_id
        if save is None or (step, save) not in self._ours:
            return
        other = contested(self.remote, step, save)
        word = drain_aside_key(self.coord, step, save)
        if self.coord.rank == 0:
            if other is not None:
                try:
                    to = copy_aside(self.remote, step)
                except BaseException as e:  # the other nodes hear why instead of waiting out the deadline
                    self._tell(word, f"error: {type(e).__name__}: {e}", everyone=True)
                    raise
                log.warning("drain: %s held step %d of another save (%s; this run's is %s, the save it restored "
                            "or saved), which its lineage never abandoned: set it aside as %s (kept: delete it once "
                            "it is of no more use)", self.remote.url, step, other, save, to)  # fmt: skip
            self._tell(word, "ok", everyone=True)
        elif other is not None:
            self.coord.wait([word], what=f"rank 0 to set aside the remote's step {step}",
                            timeout_s=self.options.retry.deadline_s)  # fmt: skip
            verdict = self.coord.get(word).decode()
            if verdict != "ok":
                raise CoordinationError(f"rank 0 could not set aside step {step} on {self.remote.url}: {verdict}")

    def _retain(self) -> None:
        """Remote retention. ``keep_last`` counts the steps whose index reads back whole (the
        cheap check: two small reads a step, whatever the job's size); one that does not is
        reported and kept, and never costs an older whole step its place."""

        abandoned = abandoned_on(self.remote)

        def damage(step: int) -> str | None:
            why = abandoned_why(self.remote, step, abandoned) or step_damage(self.remote, step, depth="index")
            if why is not None:
                log.warning(
                    "remote retention: step %d on %s cannot be restored (%s); it does not count toward "
                    "keep_last, and is kept",
                    step,
                    self.remote.url,
                    why,
                )
            return why

        committed = list_steps(self.remote).committed
        for old in steps_to_delete(committed, self.options.retention, damage=damage):
            withdraw_step(self.remote, old)
            log.info("remote retention: deleted step %d from %s", old, self.remote.url)


class _Contested(Exception):
    """A drain that met ``ContestedStepError`` before the run restored or saved anything (``Drainer._drain``)."""

    def __init__(self, error: ContestedStepError) -> None:
        super().__init__(str(error))
        self.error = error


def pending_steps(local: Tier, local_steps: list[int], remote: Tier, every: int = 1) -> list[int]:
    """Of ``local_steps`` (committed on ``local``, drained every ``every``), those whose save the
    remote does not hold: by save, never by step number. A remote step of the same number
    committed by another save (another run's, or this run's before a rollback) does not count,
    nor does one whose marker is damaged; a local step whose marker cannot be read is left out
    (logged: there is nothing to drain it from)."""
    out = []
    for step in local_steps:
        if step % every:
            continue
        try:
            save = read_marker(local, step).save_id
        except (CheckpointNotFoundError, CorruptCheckpointError) as e:
            log.warning("not draining step %d: %s", step, e)
            continue
        try:
            there = read_marker(remote, step)
        except (CheckpointNotFoundError, CorruptCheckpointError):  # not there, or not known to be whole
            out.append(step)
            continue
        if save is not None and there.save_id != save:
            out.append(step)
    return out
