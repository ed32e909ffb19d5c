"""Who may write to a local directory or remote prefix: the run continuing its lineage.

A run continues a lineage only by restoring one of its steps (``restored``); a run that restored
nothing starts a lineage of its own, named after itself. Before its first save a run checks the
places it will write to (``settle``): one holding committed steps of another lineage, or of none
(saved before lineages existed), is refused with ``LineageError``, naming both runs and the ways
out, unless the run was told to take it over. A run that continues a lineage may replace its
same-numbered steps (a rollback); a drain checks the remote prefix again before each step
(``check_remote``), since another job may have claimed it meanwhile.

Within one process, a directory's lineage is remembered once a run restored or saved there:
frameworks open several Checkpointers on one directory in turn (one to load, another to save).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from tiercheck.cluster.coordination import Barrier, Exchange, drive
from tiercheck.cluster.hierarchy import node_of, verdict
from tiercheck.cluster.job import Job
from tiercheck.cluster.keys.tiering import (
    LINEAGE,
    lineage_agreed_key,
    lineage_found_scope,
    lineage_read_scope,
    lineage_restored_key,
)
from tiercheck.errors import CheckpointNotFoundError, CorruptCheckpointError, LineageError, StorageError
from tiercheck.format.lineage import Lineage, new_lineage, read_lineage, saves_above, write_lineage
from tiercheck.format.paths import COMMIT_FILE, LINEAGE_FILE, step_dir
from tiercheck.format.steps import list_steps, read_marker
from tiercheck.humanize import fmt_steps
from tiercheck.tiering.memory_found import abandon_above
from tiercheck.tiers.base import Tier
from tiercheck.tiers.refusals import storage_error

log = logging.getLogger("tiercheck")

_continued: dict[str, str] = {}  # local directory (its URL) -> the lineage this process continues there
_guard = threading.Lock()


def continued(local: Tier) -> str | None:
    """The lineage this process continues in ``local`` (it restored or saved there), if any."""
    with _guard:
        return _continued.get(local.url)


def remember(local: Tier, lineage: str) -> None:
    with _guard:
        _continued[local.url] = lineage


def forget_all() -> None:
    """Forget every directory's lineage, as a new process would (for tests that play several jobs)."""
    with _guard:
        _continued.clear()


def restored(source: Tier, other: Tier | None, run: str) -> str:
    """The lineage a run continues by restoring a step from ``source``: the one ``source``
    belongs to, else (a place from before lineages, or filled by a copy) ``other``'s, else a new
    one named after the run."""
    found = found_lineage(source, other)
    return run if found is None else found


def found_lineage(source: Tier, other: Tier | None) -> str | None:
    """The lineage ``source`` belongs to, else ``other``'s; None where neither names one."""
    for tier in (source, other):
        if tier is None:
            continue
        try:
            found = read_lineage(tier)
        except CorruptCheckpointError as e:
            log.warning("%s", e)
            continue
        if found is not None:
            return found.id
    return None


def claim(tier: Tier, lineage: str, run: str, *, keep: frozenset[tuple[int, str]] = frozenset()) -> Lineage | None:
    """Make ``tier`` belong to ``lineage`` (if it does not already); returns the lineage it
    replaced, if any. The steps the place holds of the lineage it replaced are not ``lineage``'s:
    they are recorded as abandoned (but those in ``keep``, copied there for ``lineage``), so no
    restore of ``lineage`` takes them; they stay until retention or an operator deletes them."""
    there = _readable(tier)
    if there is not None and there.id == lineage:
        return None
    theirs = frozenset(saves_above(tier, -1) - keep) if there is not None else frozenset[tuple[int, str]]()
    write_lineage(tier, new_lineage(lineage, run, previous=there.id if there is not None else None, abandoned=theirs))
    if there is not None:
        # A second look, after the claim: a commit of the old lineage's that landed meanwhile (its
        # drain was in flight) is disowned too. That drain looks at the claim after its commit
        # (``committed_for``): whichever looks last sees the other.
        late = saves_above(tier, -1) - keep - theirs
        if late:
            disown(tier, lineage, late)
    return there


def committed_for(remote: Tier, lineage: str | None, step: int, save: str | None) -> None:
    """After a drain committed ``step`` (save ``save``) on ``remote`` for ``lineage``: the prefix
    must still be ``lineage``'s. Where another run took it over while the step was uploading, its
    commit marker is withdrawn (the take-over's second look may not have seen it) and
    ``LineageError`` says so."""
    if lineage is None:
        return
    there = _readable(remote)
    if there is None or there.id == lineage:
        return
    try:
        if read_marker(remote, step).save_id == save:
            remote.delete(f"{step_dir(step)}/{COMMIT_FILE}")
    except (CheckpointNotFoundError, CorruptCheckpointError):
        pass  # not ours, or already gone
    raise LineageError(
        f"{remote.url} was taken over by {there.named()} while step {step} was uploading: its commit there is "
        "withdrawn (its files stay for retention or an operator to delete)"
    )


def disown(tier: Tier, lineage: str, saves: set[tuple[int, str]]) -> None:
    """Record ``saves`` (step, save id) as abandoned by ``lineage`` in ``tier``'s lineage file,
    where the place is ``lineage``'s. Entries whose step the place no longer holds with that save
    (deleted, or saved again) are dropped: the file stays as small as the place."""
    there = read_lineage(tier)
    if there is None or there.id != lineage:
        return
    merged = set(there.abandoned | saves)
    for step, save in sorted(merged):
        try:
            if read_marker(tier, step).save_id != save:
                merged.discard((step, save))
        except CheckpointNotFoundError:
            merged.discard((step, save))
        except CorruptCheckpointError:
            continue  # kept: never restorable on a guess
    if frozenset(merged) != there.abandoned:
        write_lineage(tier, replace(there, abandoned=frozenset(merged)))


def mark_rollback(tier: Tier, lineage: str, step: int | None) -> None:
    """Note in a local directory's lineage file that the remote's steps above ``step`` are
    abandoned by a rollback not yet recorded on the remote (None: it is recorded now)."""
    there = read_lineage(tier)
    if there is not None and there.id == lineage and there.rollback != step:
        write_lineage(tier, replace(there, rollback=step))


def _disown_remote(remote: Tier, lineage: str, branch: int) -> None:
    """A run of ``lineage`` that restored step ``branch`` saves: the remote's committed steps
    above it are the abandoned branch (where the prefix is ``lineage``'s; another lineage's is
    taken over, and its steps disowned, by the drain that claims it)."""
    there = read_lineage(remote)
    if there is not None and there.id == lineage:
        abandoned = saves_above(remote, branch)
        if abandoned:
            disown(remote, lineage, abandoned)
            log.info("%s: step(s) %s are abandoned by the rollback to step %d: no restore of this lineage "
                     "takes them", remote.url, fmt_steps(sorted(s for s, _ in abandoned)), branch)  # fmt: skip


def _readable(tier: Tier) -> Lineage | None:
    try:
        return read_lineage(tier)
    except CorruptCheckpointError:
        return None  # replaced by the claim; the refusal (``conflict``) already named it


def conflict(tier: Tier, lineage: str | None, *, run: str, kind: str) -> str | None:
    """Why a run of ``lineage`` (None: it restored nothing) may not write to ``tier`` without
    taking it over; None when it may: the place is its lineage's, or holds no committed step."""
    unreadable: str | None = None
    try:
        there = read_lineage(tier)
    except CorruptCheckpointError as e:
        there, unreadable = None, str(e)
    if there is not None and there.id == lineage:
        return None
    listing = list_steps(tier)
    committed = listing.committed
    if not committed and there is not None and listing.partial and kind == "remote prefix":
        # No step committed yet, but another lineage's first step being written (or left by a
        # crash): its run owns the place; a second run racing there would drop its uploads. (A
        # local directory has one writer at a time, its lock's holder: its partial steps are a
        # crash's.)
        mine = f"run {run[:12]}" if lineage is None else f"run {run[:12]} (lineage {lineage[:12]})"
        return (
            f"the {kind} {tier.url} holds step(s) {fmt_steps(listing.partial)} being written (or left by a crash) "
            f"by {there.named()}, and {mine} did not restore from it: writing there could abort that run's uploads. "
            f"Use another {kind}, or pass WriteOptions(take_over=True) (tiercheck drain --take-over) to take it over"
        )
    if not committed:
        return None
    if unreadable is not None:
        owner = f"a lineage whose file cannot be read ({unreadable})"
    elif there is None:
        owner = "no named lineage (saved before lineages, or copied there)"
    else:
        owner = there.named()
    mine = f"run {run[:12]}" if lineage is None else f"run {run[:12]} (lineage {lineage[:12]})"
    return (
        f"the {kind} {tier.url} holds step(s) {fmt_steps(committed)} of {owner}, and {mine} did not restore "
        f"from it: writing there could replace that run's steps. Use another {kind}, restore from this one "
        f"first (Checkpointer.restore() continues its lineage), or pass WriteOptions(take_over=True) to take it "
        f"over (its steps stay until retention deletes them; steps saved under the same numbers replace them)"
    )


def settle(
    job: Job, *, lineage: str | None, take_over: bool, branch: int | None = None, memory: bool = True
) -> Exchange[str]:
    """Before a run's first save: every node's leader checks its directory, rank 0 the remote
    prefix; all ranks raise the same ``LineageError`` if one may not write, else every leader
    claims its directory. Returns the run's lineage (``lineage``, or a new one: the job's run).
    ``branch``: the step the run restored; the committed steps above it, on each directory and
    the remote, are the branch it abandons (a rollback): recorded as such, no restore takes them. A
    job without the memory tier (not ``memory``) withdraws them from the memory tier its directory
    records (``tiering.memory_found``; a job with it withdrew them as it restored)."""
    coord, local, remote, run = job.coord, job.tier, job.remote, job.nodes.run
    leader = job.nodes.leader == coord.rank
    failure: BaseException | None = None
    mine = lineage if lineage is not None else run
    try:
        if leader:  # claimed at once where it may be: a directory holding no other lineage's step is anyone's
            _check(local, lineage, run=run, kind="local directory", take_over=take_over)
            try:
                claim(local, mine, run)
                if branch is not None:
                    disown(local, mine, saves_above(local, branch))
                    if not memory:
                        abandon_above(local, branch)
            except OSError as e:
                raise storage_error(e, local.local_path or local.url, f"record its lineage in {LINEAGE_FILE}") from e
        recorded = remote is not None and coord.rank != 0  # the remote is rank 0's to check
        if remote is not None and coord.rank == 0:
            recorded = _check_remote_soon(remote, lineage, run=run, take_over=take_over, branch=branch)
        if branch is not None and not recorded and leader:  # the next drain records it, before it writes
            mark_rollback(local, mine, branch)
    except (LineageError, CorruptCheckpointError, OSError) as e:  # StorageError is an OSError
        failure = e
    yield from verdict(coord, job.nodes, LINEAGE, failure, what="every node to check who owns its directory",
                       shared=(LineageError, StorageError))  # fmt: skip
    remember(local, mine)
    return mine


REMOTE_CHECK_S = 10.0  # how long a first save waits for the remote prefix to say who owns it


def _check_remote_soon(
    remote: Tier, lineage: str | None, *, run: str, take_over: bool, branch: int | None = None
) -> bool:
    """``_check`` of the remote prefix (and the record of a rollback to ``branch`` there), waiting
    at most ``REMOTE_CHECK_S``: a failing or stuck remote never stops training; each drain checks
    the prefix before it writes there anyway. Returns whether it was checked (and recorded)."""
    verdict: list[BaseException | None] = []

    def check() -> None:
        try:
            _check(remote, lineage, run=run, kind="remote prefix", take_over=take_over)
            if branch is not None and lineage is not None:
                _disown_remote(remote, lineage, branch)
            verdict.append(None)
        except BaseException as e:
            verdict.append(e)

    thread = threading.Thread(target=check, name="tiercheck-lineage", daemon=True)
    thread.start()
    thread.join(REMOTE_CHECK_S)
    if not verdict:
        log.warning("%s did not say who owns it within %.0f s; each drain checks first", remote.url, REMOTE_CHECK_S)
    elif isinstance(verdict[0], LineageError):
        raise verdict[0]
    elif verdict[0] is not None:
        log.warning("could not check who owns %s (%s); each drain checks first", remote.url, verdict[0])
    return bool(verdict) and verdict[0] is None


def _check(tier: Tier, lineage: str | None, *, run: str, kind: str, take_over: bool) -> None:
    why = conflict(tier, lineage, run=run, kind=kind)
    if why is not None and not take_over:
        raise LineageError(why)
    if why is not None:
        log.warning("taking over: %s", why.split(": writing there")[0])


def check_remote(local: Tier, remote: Tier, *, take_over: bool) -> str | None:
    """Before a drain writes a step of ``local`` to ``remote``: the prefix must belong to the
    local directory's lineage, or hold no committed step (it is then claimed for it). A local
    directory that names no lineage (written before lineages) drains only to a prefix naming none.
    Returns the lineage the drain writes for (None: the directory names none)."""
    try:
        mine = read_lineage(local)
    except CorruptCheckpointError as e:
        raise LineageError(f"not draining {local.url} to {remote.url}: {e}") from None
    if mine is None:
        there = _readable(remote)
        if there is not None and not take_over:
            raise LineageError(
                f"not draining {local.url} to {remote.url}: the prefix belongs to {there.named()}, and the "
                "directory names no lineage (restore from the prefix first, or pass take_over)"
            )
        return None
    why = conflict(remote, mine.id, run=mine.run, kind="remote prefix")
    if why is not None and not take_over:
        raise LineageError(f"not draining {local.url}: {why}")
    replaced = claim(remote, mine.id, mine.run)
    if mine.rollback is not None:  # a rollback the remote did not hear of: before any step of the branch lands
        _disown_remote(remote, mine.id, mine.rollback)
        mark_rollback(local, mine.id, None)
    if why is not None:
        log.warning("took over %s from %s for lineage %s", remote.url,
                    replaced.named() if replaced else "no named lineage", mine.id[:12])  # fmt: skip
    return mine.id


def one_lineage(tiers: list[Tier]) -> None:
    """Refuse (``LineageError``, naming each place and its lineage) where ``tiers`` do not all
    belong to one lineage: step numbers of two jobs are not one sequence, and housekeeping that
    pooled them would judge one job's steps by the other's. Places that all name no lineage
    (written before lineages) pass: nothing tells them apart."""
    found = {tier.url: read_lineage(tier) for tier in tiers}  # an unreadable file is refused, naming it
    ids = {there.id if there is not None else None for there in found.values()}
    if len(ids) > 1:
        named = "; ".join(
            f"{url}: {there.named() if there is not None else 'no named lineage'}" for url, there in found.items()
        )
        raise LineageError(
            f"the locations given belong to different lineages (different jobs' directories or prefixes): {named}. "
            "Give the directories of one job at a time"
        )


def carry_conflict(source: Tier, target: Tier) -> str | None:
    """Why a step of ``source`` may not be copied into ``target`` (``tiercheck restore --to``)
    without taking it over: ``target`` holds committed steps of another lineage (or of none, where
    ``source`` names one), and the copy would make it ``source``'s: its job's later drains would
    then carry those steps to ``source``'s prefix. None when it may."""
    mine = read_lineage(source)  # an unreadable file is refused, naming it: the copy's owner is unknown
    there = read_lineage(target)
    if (there.id if there is not None else None) == (mine.id if mine is not None else None):
        return None
    committed = list_steps(target).committed
    if not committed:
        return None
    owner = there.named() if there is not None else "no named lineage"
    source_owner = mine.named() if mine is not None else "no named lineage"
    return (
        f"{target.url} holds step(s) {fmt_steps(committed)} of {owner}, and {source.url} belongs to {source_owner}: "
        f"the copy would make the directory {source.url}'s, and a later job there would drain its steps to "
        f"{source.url}'s prefix. Use another directory, or pass --take-over"
    )


def carry(source: Tier, target: Tier, step: int) -> None:
    """After ``step`` of ``source`` was copied into ``target`` (``tiercheck restore --to``): the
    target continues the source's lineage, as the job restoring the copy will (the steps it held
    of another lineage are abandoned, the copy kept)."""
    try:
        found = read_lineage(source)
    except CorruptCheckpointError as e:
        log.warning("%s: %s keeps its own lineage", e, target.url)
        return
    if found is not None:
        save = read_marker(target, step).save_id
        claim(target, found.id, found.run, keep=frozenset({(step, save)}) if save is not None else frozenset())


def after_restore(job: Job, *, from_remote: bool, key: str) -> Exchange[str]:
    """A job restored a step (from ``remote`` where ``from_remote``, else from its directories):
    it continues that step's lineage. The node leaders agree on one (``key``: this restore's, removed
    once all have read it) and tell their nodes; each leader claims its directory for it; the remote prefix is checked
    and claimed at the next save (``settle``) and drain (``check_remote``). A leader whose directory
    names no lineage (a replaced node's, empty) proposes a new one only after every leader that
    found one has proposed it: a replaced node never moves the job onto a lineage of its own, which
    would abandon every other node's steps."""
    coord, local, remote, nodes = job.coord, job.tier, job.remote, job.nodes
    node, leader = node_of(coord), nodes.leader == coord.rank
    here = lineage_agreed_key(node, key)
    if leader:  # the leaders read the source's lineage (the remote's: one request per node), the first wins
        source, other = (remote, local) if from_remote and remote is not None else (local, remote)
        found = found_lineage(source, other)
        if found is not None:
            coord.decide(key, found)
        yield coord.arrive(lineage_found_scope(key), what="every node's leader to propose the lineage it found",
                           count=nodes.count)  # fmt: skip
        agreed = coord.decide(key, nodes.run)  # a found one where any leader found one
        coord.finish(lineage_found_scope(key), count=nodes.count)
        node.set(here, agreed)
    else:
        agreed = bytes((yield Barrier(here, "the node's leader to learn the lineage", node, fetch=True))).decode()
    yield from verdict(coord, nodes, lineage_read_scope(key), None, what="every rank to learn the lineage it continues")
    if coord.rank == 0:
        coord.delete(key)
    if leader:  # its node's ranks are past reading it (verdict)
        node.delete(here)
        claim(local, agreed, nodes.run)
    remember(local, agreed)
    return agreed


class Owner:
    """A Checkpointer's side of its lineage: what it continues, checked before its first save
    (and the first after each restore)."""

    def __init__(self, job: Job, *, take_over: bool, memory: bool = True) -> None:
        self.job, self.coord, self.take_over, self.memory = job, job.coord, take_over, memory
        self.lineage = continued(job.tier)  # None: a new run, until it restores or saves
        self._settled = False
        self._branch: int | None = None  # the step last restored: the first save after it branches there

    def before_save(self) -> None:
        if not self._settled:
            settling = settle(self.job, lineage=self.lineage, take_over=self.take_over, branch=self._branch,
                              memory=self.memory)  # fmt: skip
            self.lineage = drive(self.coord, settling)
            self._settled, self._branch = True, None

    def restored(self, *, from_remote: bool, restore: int, step: int) -> None:
        key = lineage_restored_key(self.coord, restore)
        self.lineage = drive(self.coord, after_restore(self.job, from_remote=from_remote, key=key))
        self._settled, self._branch = False, step
