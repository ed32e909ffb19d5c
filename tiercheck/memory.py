"""The memory tier at run time: commit to memory, restore from it, persist what a crash left there.

The memory tier is a directory of the usual format on a tmpfs (``state.memory_slots``), so the
steps in it are committed by the save's vote (a vote of its own, before the local one) and read by
the usual restore. What this module adds is the choice between tiers, made alike on every rank:

* A restore reads the memory tier when the newest step whole in the memory of every node is at
  least as new as the newest step the local and remote tiers offer (or is the step asked for). A
  chunk missing or damaged in memory is read from the next tier holding the same save of the step
  (its commit marker names the same save): the node's local directory, else the remote tier, by the
  restore's own fallback for a damaged local chunk (``restore.read``); where that fails too, the
  step is read again with that writer's files from a peer's memory copy (``restore.protocol``'s
  ``_CopyDamaged``). Only where no copy holds the chunk whole does the restore try the next older
  step whole in memory (while it is as new as the local and remote tiers' newest), then those tiers.
* A memory step belongs to the lineage of the node-local directory it was saved for (invariants
  11 and 13): a memory directory whose owner is not that lineage is never restored, and is
  withdrawn, with a warning, before this run saves.
* A step restored from memory that the local tier lacks is persisted there (and drained, by
  policy) by the run that restored it, in the background once ``restore()`` has returned
  (``tiering.persisting``, invariant 15): nothing a crash interrupted is lost. With peers' copies,
  the step is then made whole again on every node, in the background too (``tiering.whole_again``):
  a replaced node gets its files back into its memory from a peer before it persists them.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from tiercheck.cluster.coordination import drive
from tiercheck.cluster.job import Job
from tiercheck.cluster.keys.restore import disk_scope, memory_choice_scope, memory_scope
from tiercheck.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MemoryTierError,
    PartlyRestoredError,
    StepExistsError,
    TiercheckError,
)
from tiercheck.format.lineage import Lineage, lineage_id, memory_owner, owns_memory, read_lineage
from tiercheck.format.memory_steps import doubt, judge, record_memory, remote_doubt
from tiercheck.format.paths import MEMORY_OWNER_FILE
from tiercheck.format.steps import list_steps, read_marker
from tiercheck.options import ReplicationOptions
from tiercheck.restore.agree import Trust, agree_on_step, remote_steps
from tiercheck.restore.protocol import Restored, RestoreRequest, restore_state
from tiercheck.restore.report import with_choice
from tiercheck.save.handle import PendingSave
from tiercheck.save.vote import commit_job
from tiercheck.state.memory_pool import MemoryTier
from tiercheck.state.memory_slots import MemorySlots
from tiercheck.tiering.manager import TierManager
from tiercheck.tiering.memory_peers import NO_PARITY, MemoryPeers
from tiercheck.tiering.persisting import NOT_STARTED, Persisting
from tiercheck.tiering.rebuild import Rebuild, vouched
from tiercheck.tiering.retention import LocalSteps
from tiercheck.tiering.transfer import copy_step
from tiercheck.tiering.whole_again import NOT_WHOLE, WholeAgain
from tiercheck.tiers.base import Tier

log = logging.getLogger("tiercheck")

_NOT_OWNED = "the memory tier of rank 0's node holds another lineage's steps: none is restored from memory"


class Memory:
    """A Checkpointer's memory tier: its slots, and the job as the memory tier sees it."""

    def __init__(self, tier: MemoryTier, job: Job, replication: ReplicationOptions | None = None) -> None:
        """Every rank calls it together (with ``replication`` on several nodes, it joins the peers)."""
        self.options = tier.options
        self.local_job = job
        self.slots = MemorySlots(tier, job.coord.rank)
        self.job = replace(job, tier=self.slots.root, remote=None)
        self.leader = job.nodes.leader == job.coord.rank
        self._owner: str | None = None  # the lineage this rank last named in OWNER (the leader's)
        self.peers: MemoryPeers | None = None
        self._persisting: Persisting | None = None  # the step the last restore persists in the background
        self._whole: WholeAgain | None = None  # the last restore's step made whole again on every node
        self._rebuilt: dict[int, str | None] = {}  # steps this run rebuilt from parity: their saves
        self._pending: Rebuild | None = None  # the last restore's rebuild in this node's group: its parity next
        if replication is not None and job.nodes.count > 1:
            self.peers = MemoryPeers(self.slots.root, replication, coord=job.coord, nodes=job.nodes)
        self.slots.before_reuse = self._before_reuse

    def held(self) -> int:  # bytes of memory this rank's slots hold (stats()'s memory_held_bytes)
        return self.slots.held()

    def stats(self) -> dict[str, Any]:
        """``Checkpointer.stats()``'s entries of the memory tier: ``memory_held_bytes``, where the
        background persist of the step a restore read from memory stands (``tiering.persisting``), and,
        on a node's leader, where making that step whole again on every node stands (``tiering.whole_again``)."""
        persisting = NOT_STARTED if self._persisting is None else self._persisting.stats()
        whole = NOT_WHOLE if self._whole is None else self._whole.stats()
        parity = NO_PARITY if self.peers is None else self.peers.parity_stats()
        rebuilt = max(self._rebuilt, default=None)
        return {"memory_held_bytes": self.held(), **parity, "memory_rebuilt_step": rebuilt, **persisting, **whole}

    def _before_reuse(self, step: int) -> None:
        """Before a save stages into the slot of memory step ``step``: its copies (to the local
        directory in the background, to peers) are done."""
        if self._persisting is not None and self._persisting.step == step:
            self._persisting.wait()
        if self.peers is not None:
            self.peers.before_reuse(step)

    def before_save(self, step: int) -> None:
        """Refuse a save of the step being persisted in the background: it is committed (restored from
        memory), and a save of its number would withdraw its memory copy under the copy."""
        if self._persisting is not None and self._persisting.step == step and self._persisting.pending():
            where = self.local_job.tier.url
            raise StepExistsError(f"step {step} is committed in the memory tier (restored from it) and being "
                                  f"persisted to {where}; saving it again would overwrite it")  # fmt: skip

    def wait_persisted(self, timeout: float | None = None) -> None:
        """Wait until the memory's copies or parity of every save are over, and the background persist of
        the step a restore read from memory has ended (committed locally, or the failure logged);
        ``TimeoutError`` after ``timeout`` s."""
        if self.peers is not None and not self.peers.replicator.wait(timeout):
            raise TimeoutError(f"the memory tier's copies or parity on peers still running after {timeout} s")
        if self._persisting is not None and not self._persisting.wait(timeout):
            raise TimeoutError(f"step {self._persisting.step} still being persisted after {timeout} s")
        if self._whole is not None and not self._whole.wait(timeout):
            raise TimeoutError(f"step {self._whole.step} still being made whole again after {timeout} s")

    def persists(self, step: int) -> bool:
        """Whether the save of ``step`` goes to the local tier too (``MemoryOptions.persist_every``)."""
        return step % self.options.persist_every == 0

    # ---------------------------------------------------------------------------------- saving

    def commit(self, job: Job, save: PendingSave, *, library_version: str, lineage: str | None) -> None:
        """The memory tier's vote for ``save`` (``job``: the commit thread's, for its store connection),
        of the run's ``lineage`` (the local directory's). Its slot is released either way; a failure is
        the save's (raised)."""
        try:
            commit_job(replace(self.job, coord=job.coord), save, library_version=library_version, vote="memory",
                       lineage=lineage)  # fmt: skip
        except BaseException:
            self.slots.done(save.step, committed=False)
            raise
        self.slots.done(save.step, committed=True)
        if self.peers is not None:
            self.peers.committed(save.step)
        if self.leader and lineage != self._owner:  # named once a lineage, not at every save
            if (self.slots.root.local_path / MEMORY_OWNER_FILE).is_dir():  # damaged: no file can replace it
                self.slots.root.delete_tree(MEMORY_OWNER_FILE)
            self.slots.root.publish(MEMORY_OWNER_FILE, (lineage or "").encode())
            self._owner = lineage
            self._record()

    def _record(self) -> None:
        """Record in the local directory where its memory tier lives (``format.memory_steps``): a job
        started there without ``MemoryOptions`` then finds this lineage's memory steps."""
        try:
            record_memory(self.local_job.tier, self.slots.root.root)
        except (OSError, TiercheckError) as e:  # a hint for other jobs: the save stands without it
            log.warning("could not record the memory tier's place in %s: %s", self.local_job.tier.url, e)

    # ------------------------------------------------------------------------------- restoring

    def owned(self) -> bool:
        """Whether the memory's steps are this local directory's lineage (never restored otherwise)."""
        steps = list_steps(self.slots.root).committed
        if not steps or owns_memory(self.local_job.tier, self.slots.root):
            return True
        owner, mine = memory_owner(self.slots.root), lineage_id(self.local_job.tier)
        log.warning(
            "the memory tier at %s holds step(s) %s of %s, not of this directory's lineage (%s): not restored; "
            "withdrawn",
            self.slots.root.url,
            steps,
            f"lineage {owner}" if owner else "an unknown lineage",
            mine or "none yet",
        )
        if self.leader:
            for step in steps:
                self.slots.withdraw(step)
        return False

    def restore(
        self, state: Mapping[str, Any], request: RestoreRequest, name: str, disk: Callable[[], Restored | None]
    ) -> Restored | None:
        """Restore from the memory tier where it holds the step to restore, else by ``disk`` (the
        local and remote tiers' restore; see the module's docstring). A memory step damaged beyond
        its chunks' fallbacks gives way to the next older one, while that is as new as the other
        tiers' newest. Every rank calls it together."""
        t0 = time.perf_counter()  # choosing between memory and the other tiers is a part of agreeing (with_choice)
        newest: int | None = None  # the local and remote tiers' newest step every rank can get
        below: int | None = None
        partly: PartlyRestoredError | None = None  # a memory step read in part into the state's own memory
        # Whether this node's memory is this lineage's (its leader withdraws it where not). Rank 0's answer
        # decides for every rank: where its node's is not, rank 0 answers _choose's collective, which every
        # rank joins alike, with no step, and the memory tier is skipped.
        skip = not self.owned()
        self._rebuild(request.step)
        passed = "the memory tier held another lineage's steps (withdrawn)" if skip else ""  # why not memory
        for n in itertools.count():
            mem = self._choose(memory_choice_scope(name, n), request.step, below, skip=skip)
            if mem is None:
                passed = passed or (_held_none(request.step) if n == 0 else "no step in memory could be read whole")
                break
            if request.step is None and n == 0:
                newest = self._newest_elsewhere(disk_scope(name))
            if newest is not None and newest > mem:
                passed = passed or f"its step {newest} is newer than the memory tier's newest whole step, {mem}"
                break
            try:
                done = self._restore_step(state, request, mem, memory_scope(name, n))
            except PartlyRestoredError as e:
                if not (request.in_place and request.strict):
                    raise
                partly = e
            except (CorruptCheckpointError, CheckpointNotFoundError):
                pass
            else:
                if done is not None:
                    return with_choice(done, time.perf_counter() - t0)
                break
            passed = "no step in memory could be read whole (see the warnings above)"
            if request.step is not None:
                break
            below = mem
        done = disk()
        if done is None and partly is not None:  # a fresh start over a state the memory's steps were read into
            raise partly
        if done is not None and self.job.coord.rank == 0:
            log.info("restored step %d from %s: %s", done.step,
                     "the remote tier" if done.from_remote else "the local directory", passed)  # fmt: skip
        return done and with_choice(done, time.perf_counter() - t0)

    def _rebuild(self, requested: int | None) -> None:
        """With parity: a memory step this node lacks rebuilt from its group, before the step is chosen."""
        if self.peers is None or not self.peers.parity:
            return
        trust = functools.partial(doubt, lineage=self._lineage(), local=self.local_job.tier)
        self._pending = self.peers.rebuild(trust, self._own_lineage, requested)
        if self._pending is not None and self._pending.here:
            self._rebuilt[self._pending.step] = _save_of(self.slots.root, self._pending.step)

    def _newest_elsewhere(self, name: str) -> int | None:
        """The newest step every rank can get from the local and remote tiers (None: none, or none whole
        there: a replaced node's peers may hold steps it lacks, and the memory's step is then taken)."""
        local, remote = self.local_job.tier, self.local_job.remote
        choice = agree_on_step(self.local_job, name, requested=None, remote_steps=lambda: remote_steps(remote, local))
        with contextlib.suppress(CheckpointNotFoundError):  # the same decision on every rank
            return drive(self.job.coord, choice).step
        return None

    def _restore_step(self, state: Mapping[str, Any], request: RestoreRequest, mem: int, name: str) -> Restored | None:
        """Restore memory step ``mem``; its damage, beyond its chunks' fallbacks, is raised."""
        coord = self.job.coord
        # In place only where the fallback overwrites whatever a failed attempt wrote: every tensor (strict).
        in_place = request.in_place and request.strict
        backup = self._backup(mem)
        job = replace(self.job, remote=backup)
        try:
            done = restore_state(state, job, replace(request, step=mem, in_place=in_place), name=name)
        except (CorruptCheckpointError, CheckpointNotFoundError) as e:
            partly = isinstance(e, PartlyRestoredError)
            if coord.rank == 0:
                log.warning("cannot restore step %d from the memory tier%s, %s; reading %s: %s", mem,
                            " (read in part, in place)" if partly else "", _no_backup(backup),
                            "the next older step in memory, or the other tiers" if request.step is None else
                            "the other tiers", e)  # fmt: skip
            raise
        if done is None:
            return None
        # The step came from memory, whatever the backup supplied: not "from the remote" (that would
        # populate the local directory from there). What the restore read from its "remote" (planned,
        # or after a bad copy: ``fallbacks``) was read from the local directory where that is the backup.
        if backup is not None and backup is self.local_job.tier:
            done = replace(done, remote_reads=0, local_reads=done.remote_reads + done.fallbacks)
        done = replace(done, from_remote=False, from_memory=True)
        log.info("restored step %d from memory (%s)%s", done.step, self.slots.root.url,
                 f" ({done.fallbacks} chunk(s) read from {backup.url} after a bad copy in memory)"
                 if done.fallbacks and backup is not None else "")  # fmt: skip
        return done

    def _backup(self, step: int) -> Tier | None:
        """The tier a memory chunk of ``step`` missing or damaged here is read from: this node's local
        directory, else the remote tier, the first whose commit marker of ``step`` names the save the
        memory's does (invariant: a chunk is read only from a copy of its own save). None: neither.

        Each node chooses its own; rank 0's choice says whether any node reads a backup at all (the
        restore's ``from_remote``). The local directory holds this node's ranks' files only: a
        damaged chunk of a peer's copy in memory, or a node whose memory manifest is damaged (it
        then reads all of the step from the backup, as a node holding none of it), may find
        nothing there, and the restore then fails and falls back whole, as without a backup."""
        save = _save_of(self.slots.root, step)
        if save is None:
            return None
        for tier in (self.local_job.tier, self.local_job.remote):
            if tier is not None and _save_of(tier, step) == save:
                return tier
        return None

    def _choose(self, name: str, requested: int | None, below: int | None, *, skip: bool = False) -> int | None:
        """The step every rank would restore from memory, older than ``below`` when given (None:
        none, or not the one asked for). ``skip``, rank 0's only: its node's memory is not this
        lineage's, so none of the tier's steps is (None on every rank, after the same collective)."""
        # Each node's leader judges its node's steps (the other ranks learn the choice from it).
        trust: Trust | None = None
        if self.leader:
            lineage = self._lineage()
            trust = functools.partial(doubt, lineage=lineage, local=self.local_job.tier)
            if lineage is None and self._rebuilt:  # a replaced node: its group vouched for what it rebuilt
                trust = functools.partial(vouched, dict(self._rebuilt), trust)
        try:
            choice = agree_on_step(self.job, name, requested=requested, remote_steps=list, below=below,
                                   trust=trust, veto=self._veto,
                                   refuse=_NOT_OWNED if skip else None)  # fmt: skip
            return drive(self.job.coord, choice).step
        except CheckpointNotFoundError:
            return None

    def _lineage(self) -> Lineage | None:
        """The local directory's lineage (None: none, or its file unreadable: no memory step is then
        restorable, ``format.memory_steps.doubt``)."""
        try:
            return read_lineage(self.local_job.tier)
        except (OSError, TiercheckError):
            return None

    def _veto(self, step: int) -> str | None:
        """Rank 0: why memory step ``step`` is not the lineage's, as the remote prefix says (None:
        it is, or there is no remote)."""
        remote = self.local_job.remote
        return None if remote is None else remote_doubt(remote, step, _save_of(self.slots.root, step))

    def _doubted(self) -> dict[int, str]:  # this node's memory steps not its lineage's, each with why
        return {s: why for s, _, why in judge(self.slots.root, self.local_job.tier) if why is not None}

    def after_restore(self, step: int, *, from_memory: bool, local: LocalSteps, tiers: TierManager) -> None:
        """Memory steps newer than the restored one belong to a future this run abandoned: withdrawn.
        A step restored from memory that the local tier lacks is persisted there (this node's
        ranks' files) and drained by policy, in the background (``tiering.persisting``): it is
        committed in memory, and the restart does not wait for a copy that can run beside training."""
        # Its copies made whole again (tiering.whole_again), or its group's parity (tiering.rebuild).
        peers = self.peers if from_memory else None
        if not self.leader:
            if peers is not None:
                peers.make_whole(step, None, Future())
            return
        if self.peers is not None:
            self.peers.wait()  # a copy to or from a peer runs in the steps withdrawn next
        self.wait_persisted()  # an earlier restore's copy reads a step that may be withdrawn next
        doubted = self._doubted()
        for s in list_steps(self.slots.root).committed:
            if s > step:
                log.info("withdrawing step %d from the memory tier: the restore went back to step %d", s, step)
                self.slots.withdraw(s)
            elif s in doubted:
                log.info("withdrawing step %d from the memory tier: %s", s, doubted[s])
                self.slots.withdraw(s)
        rebuilt: Future[bool] | None = None  # this node's own files back in its memory (a replaced node)
        if peers is not None and not peers.parity and not self._holds_own(step):
            rebuilt = Future()
        if from_memory and (rebuilt is not None or step not in list_steps(self.local_job.tier).committed):
            log.info("persisting step %d from the memory tier to %s in the background%s", step,
                     self.local_job.tier.url, "" if rebuilt is None else ", once its peers gave it back")  # fmt: skip
            copy = functools.partial(self._persist_said, step, local=local, tiers=tiers, rebuilt=rebuilt)
            self._persisting = Persisting(step, copy)
        if peers is not None and peers.parity:
            peers.reprotect(step, self._pending)
        elif peers is not None:
            self._whole = peers.whole_again(step, rebuilt, self._persisting, owner=self._own_lineage,
                                                 where=self.local_job.tier.url)  # fmt: skip

    def _holds_own(self, step: int) -> bool:
        """Whether this node's memory holds its own files of ``step``, committed (not a replaced node's)."""
        try:
            read_marker(self.slots.root, step)
        except (TiercheckError, OSError):
            return False
        return True

    def _own_lineage(self, lineage: str | None) -> None:
        """Name ``lineage`` as the memory directory's (a step rebuilt there from a peer is committed next)."""
        if lineage != self._owner:
            self.slots.root.publish(MEMORY_OWNER_FILE, (lineage or "").encode())
            self._owner = lineage
            self._record()

    def _persist_said(
        self, step: int, *, local: LocalSteps, tiers: TierManager, rebuilt: Future[bool] | None = None
    ) -> bool:
        """``persist``, on the background thread: True once committed there; a step that cannot be, said.
        ``rebuilt``: this node's files are first given back to its memory by its peers (True: they were)."""
        if rebuilt is not None and not rebuilt.result():
            log.warning("step %d is not persisted to %s: this node's memory lacks its files, and no peer gave them "
                        "back (see the warnings above)", step, self.local_job.tier.url)  # fmt: skip
            return False
        try:
            self.persist(step, local=local, tiers=tiers)
        except CheckpointNotFoundError as e:  # a replaced node, restored from its peers' memory
            log.warning("step %d is not persisted to %s: this node's memory lacks its files (%s)",
                        step, self.local_job.tier.url, e)  # fmt: skip
            return False
        except CorruptCheckpointError as e:  # the restore read the damaged files from a peer's copy
            log.warning("step %d is not persisted to %s: this node's memory copy of it is damaged, and no "
                        "tier holds this node's files of that save whole but peers' memory; the next save "
                        "that persists carries the state on (%s)", step, self.local_job.tier.url, e)  # fmt: skip
            return False
        return True

    def persist(self, step: int, *, local: LocalSteps, tiers: TierManager) -> None:
        """Copy this node's files of memory step ``step`` to the local tier, committed there. A chunk
        damaged in memory (the restore read it from the remote tier) is copied from the remote
        tier, where it holds the same save: the copy resumes, keeping what memory gave whole."""
        # The saving ranks whose files this node's memory holds (its marker's): the ranks of the job that
        # saved the step, which may not be this job's (a restore onto another number of ranks).
        ranks, dst = set(read_marker(self.slots.root, step).ranks), self.local_job.tier
        try:
            copy_step(self.slots.root, dst, step, ranks=ranks)
        except CorruptCheckpointError as e:
            remote = self.local_job.remote
            if remote is None or _save_of(remote, step) != _save_of(self.slots.root, step):
                raise
            log.warning("step %d is damaged in the memory tier, persisting it from %s: %s", step, remote.url, e)
            copy_step(remote, dst, step, ranks=ranks)
        local.add(step)
        local.whole(step)
        tiers.persisted(step, Future())
        log.info("persisted step %d from the memory tier to %s", step, self.local_job.tier.url)

    def close(self, *, local: LocalSteps, tiers: TierManager) -> None:
        """At a clean close: the newest memory step not on the local tier is persisted there, then the
        tier's memory is given back (its steps and slot files), unless ``MemoryOptions.keep_at_close``
        or the persisting failed (then the steps stay, and a next run restores them). A restored
        step still being persisted in the background is waited for first."""
        self.wait_persisted()
        self.slots.unmap()
        if self.peers is not None:
            self.peers.close()
        keep = self.options.keep_at_close
        if self.leader:
            committed = list_steps(self.slots.root).committed
            doubted = self._doubted()
            ours = [s for s in committed if s not in doubted]  # only the lineage's is persisted
            if ours and ours[-1] not in list_steps(self.local_job.tier).committed:
                try:
                    self.persist(ours[-1], local=local, tiers=tiers)
                except (OSError, TiercheckError) as e:
                    keep = True
                    log.error("could not persist step %d from the memory tier at close (it stays there): %s",
                              ours[-1], e)  # fmt: skip
            if not keep:
                with _said_at_close():
                    for step in committed:  # the doubted ones too: no restore takes them
                        self.slots.withdraw(step)
                    self.slots.root.delete_tree(MEMORY_OWNER_FILE)  # a file, or whatever damage put there
                self._owner = None
        if not self.options.keep_at_close:
            with _said_at_close():
                self.slots.remove()


@contextlib.contextmanager
def _said_at_close() -> Iterator[None]:
    """Memory not given back at close (a read-only mount over it) is said, not raised: the close
    goes on (its lock released, its drains ended), the steps left there are whole."""
    try:
        yield
    except MemoryTierError as e:
        log.error("could not give the memory tier's memory back at close (what is left there stays whole; "
                  "`tiercheck gc --memory` reclaims it): %s", e)  # fmt: skip


def _save_of(tier: Tier, step: int) -> str | None:
    """The save ``tier``'s commit marker of ``step`` names; None where it holds no readable one."""
    try:
        return read_marker(tier, step).save_id
    except (TiercheckError, OSError):
        return None


def _no_backup(backup: Tier | None) -> str:
    """Why a damaged memory copy of a step was not made whole from another tier."""
    if backup is None:
        return "and no other tier holds that save of it"
    return f"nor from {backup.url}, which holds that save of it"


def _held_none(step: int | None) -> str:
    """Why a restore read no memory step, where the memory tier offered none."""
    if step is None:
        return "the memory tier held no step of this lineage whole on every node"
    return f"the memory tier does not hold step {step} of this lineage whole on every node"
