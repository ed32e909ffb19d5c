"""A node's memory tier seen from the command line: where it is, whose it is, what it holds that the
node's local directory lacks; ``tiercheck persist``, and the memory part of ``gc``.

A memory tier is a directory of the usual format on a tmpfs, ``<MemoryOptions.path>/<id>``, its id
a hash of the node-local directory's absolute path (``state.memory_pool.pool_dir``, computed here
again: that module maps memory with torch, and ``ls`` and ``verify`` answer without torch). Its
steps belong to the lineage its ``OWNER`` file names (``tiercheck.memory``): only the local
directory of that lineage ever gets them.

Persisting and reclaiming hold the local directory's writer lock, as a job does: a job that is
running (its lock held) keeps its memory, and no job starts in the directory while its memory is
copied or removed.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from shlex import quote
from typing import Literal

import click

from tiercheck.cli.common import (
    THREADS,
    Context,
    err,
    errors_as_one_line,
    fail,
    human,
    out,
    pass_context,
    progress,
    remote_options,
    step_bytes,
)
from tiercheck.cli.drain import drain_steps
from tiercheck.cluster.lock import DirectoryLock
from tiercheck.errors import DirectoryInUseError, InvalidArgumentError, TiercheckError
from tiercheck.format.commit import withdraw_step
from tiercheck.format.lineage import lineage_owns, memory_owner, read_lineage
from tiercheck.format.paths import MEMORY_OWNER_FILE, memory_dir
from tiercheck.format.steps import list_steps, read_manifest, read_marker
from tiercheck.humanize import fmt_steps
from tiercheck.options import MemoryOptions
from tiercheck.tiering.drain import pending_steps
from tiercheck.tiering.transfer import copy_step
from tiercheck.tiers.base import Tier
from tiercheck.tiers.local import LocalTier

DEFAULT_PATH = os.fspath(MemoryOptions().path)

MEMORY_HELP = (
    "The memory tier's path (MemoryOptions.path): DIR's memory is the directory under it named for DIR."
)


@dataclass(frozen=True)
class NodeMemory:
    """A local directory's memory tier, and whose steps it holds."""

    local: Tier
    tier: LocalTier
    owner: str | None  # the lineage OWNER names; None: no OWNER file ("" : the run had no lineage yet)
    lineage: str | None  # the local directory's

    @property
    def directory(self) -> Path:
        assert self.tier.local_path is not None
        return self.tier.local_path

    def foreign(self) -> str | None:
        """Why the memory's steps are not the local directory's (None: they are, or there are none):
        a restore never reads them then, and ``gc --memory`` reclaims them."""
        if not list_steps(self.tier).committed or lineage_owns(self.lineage, self.owner):
            return None
        whose = f"lineage {self.owner[:12]}" if self.owner else "an unknown lineage"
        mine = f"lineage {self.lineage[:12]}" if self.lineage else "no lineage"
        return f"its steps are {whose}'s, and {self.local.url} is {mine}'s"

    def unpersisted(self) -> list[int]:
        """The memory steps the local directory lacks and would want: newer than its newest committed
        step (an older one was let go by retention, or belongs to a future a rollback abandoned), and
        not a save the lineage abandoned."""
        local = list_steps(self.local).committed
        newest = local[-1] if local else -1
        abandoned = _abandoned(self.local)
        steps = []
        for n in list_steps(self.tier).committed:
            if n <= newest:
                continue
            try:
                save = read_marker(self.tier, n).save_id
            except TiercheckError:  # kept as wanted: persist says why it cannot copy it, gc keeps it
                steps.append(n)
                continue
            if save is None or (n, save) not in abandoned:
                steps.append(n)
        return steps

    def why_not(self, step: int) -> str:
        """Why a memory step that is not ``unpersisted`` needs no copy."""
        if step not in list_steps(self.local).committed:
            return f"older than {self.local.url}'s newest step, not persisted"
        try:
            same = read_marker(self.local, step).save_id == read_marker(self.tier, step).save_id
        except TiercheckError as e:
            return f"not persisted: {str(e).splitlines()[0]}"
        return f"already on {self.local.url}" if same else f"{self.local.url} holds another save of it, not persisted"


def _abandoned(local: Tier) -> frozenset[tuple[int, str]]:
    lineage = read_lineage(local)
    return lineage.abandoned if lineage is not None else frozenset()


def open_memory(ctx: Context, local: Tier, path: str) -> NodeMemory | None:
    """``local``'s memory tier under ``path``; None where there is none (no directory there)."""
    if local.local_path is None:
        raise InvalidArgumentError(
            f"--memory: {local.url} is not a local directory: a memory tier belongs to a node's local directory"
        )
    directory = memory_dir(path, local.local_path)
    if not directory.is_dir():
        return None
    tier = ctx.tier(str(directory))
    assert isinstance(tier, LocalTier)
    owner = memory_owner(tier)
    lineage = read_lineage(local)
    return NodeMemory(local, tier, owner, lineage.id if lineage is not None else None)


#: What ``memory_role`` found, as a sentence's object.
MEMORY_ROLES = {
    "tier": "a node's memory tier (one local directory's, under MemoryOptions.path), not a local directory",
    "path": "a memory tier's path (MemoryOptions.path), holding local directories' memory tiers",
}


def memory_role(directory: Path) -> tuple[Literal["tier", "path"], Path] | None:
    """Whether ``directory`` is one local directory's memory tier ("tier": it holds an ``OWNER``
    file) or a ``MemoryOptions.path`` holding such tiers ("path"), with that path; None: neither.
    Given to ``ls`` or ``gc`` as if a local directory, each is pointed at ``--memory``."""
    if (directory / MEMORY_OWNER_FILE).is_file():
        return "tier", directory.parent
    try:
        children = [p for p in directory.iterdir() if p.is_dir()]
    except OSError:
        return None
    if children and any((p / MEMORY_OWNER_FILE).is_file() for p in children):
        return "path", directory
    return None


def held_bytes(directory: Path) -> int:
    """Bytes of memory the directory's files hold, each file once (a step's pack is a link to a slot)."""
    seen = {}
    for p in directory.rglob("*"):
        st = p.lstat()
        if stat.S_ISREG(st.st_mode):
            seen[st.st_ino] = st.st_blocks * 512
    return sum(seen.values())


def steps_named(steps: list[int]) -> str:
    return f"{'step' if len(steps) == 1 else 'steps'} {fmt_steps(steps)}"


def reclaim(memory: NodeMemory) -> None:
    """Remove a memory tier: each step's commit marker first (a step is whole or no step), then
    everything, slot files included. The caller holds the local directory's lock."""
    for n in list_steps(memory.tier).committed:
        withdraw_step(memory.tier, n)
    shutil.rmtree(memory.directory)


class Locked:
    """The local directory's writer lock, held while its memory is persisted or removed."""

    def __init__(self, local: Tier) -> None:
        assert local.local_path is not None
        self.lock = DirectoryLock(local.local_path)

    def __enter__(self) -> DirectoryLock:
        self.lock.acquire()
        return self.lock

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


# ------------------------------------------------------------------------------------ persist


@click.command("persist")
@click.argument("local", metavar="DIR")
@click.option("--memory", "path", default=DEFAULT_PATH, show_default=True, metavar="PATH", help=MEMORY_HELP)
@click.option("--remote", default=None, metavar="URL", help="Drain the persisted steps to this remote tier too.")
@click.option("--reclaim", "then_reclaim", is_flag=True, help="Then remove DIR's memory tier, freeing its memory.")
@click.option("--threads", default=8, show_default=True, type=THREADS, help="Files copied at once.")
@remote_options
@pass_context
def persist_command(
    ctx: Context, local: str, path: str, remote: str | None, then_reclaim: bool, threads: int
) -> None:
    """Copy the steps a job left in a node's memory tier to its local directory DIR (and --remote).

    For a job that will not restart (a scheduler's epilog, a pod's preStop hook): the steps in
    memory newer than DIR's newest are copied to DIR, every chunk checked on the way, and committed
    there; with --remote, then drained as `tiercheck drain` does. It holds DIR's writer lock, as a
    job does: it refuses while a job is writing DIR (run it once the job has ended). It refuses
    memory of another lineage than DIR's (never restored; `tiercheck gc DIR --memory PATH` reclaims it).
    Run again, it copies nothing twice. Exit status 1 where a step could not be persisted.
    """  # fmt: skip
    with errors_as_one_line():
        tier = ctx.tier(local)
        memory = open_memory(ctx, tier, path)
        if memory is None:
            out.print(f"nothing to persist: {tier.url} has no memory tier under {path}")
            return
        with Locked(tier):
            why = memory.foreign()
            if why is not None:
                fail(f"the memory tier at {memory.directory} is not {tier.url}'s: {why}; nothing persisted")
            failed = _persist(ctx, memory, threads)
            in_memory = list_steps(memory.tier).committed
            on_local = [n for n in list_steps(tier).committed if n in in_memory]
            if remote is not None:
                dst = ctx.tier(remote, must_exist=False)
                todo = pending_steps(tier, on_local, dst)
                if not todo:
                    held = steps_named(on_local) if on_local else "every step"
                    out.print(f"nothing to drain: {dst.url} holds the save of {held}")
                drain_steps(ctx, tier, dst, todo, threads=threads)
            if then_reclaim and not failed:
                freed = held_bytes(memory.directory)
                reclaim(memory)
                out.print(f"removed the memory tier at {memory.directory} ({human(freed)})")
        if failed:
            fail(f"could not persist {steps_named(failed)} from {memory.directory} (kept there)")


def _persist(ctx: Context, memory: NodeMemory, threads: int) -> list[int]:
    """Copy ``memory``'s unpersisted steps to its local directory; the steps that failed."""
    local, failed = memory.local, []
    todo = memory.unpersisted()
    for n in list_steps(memory.tier).committed:
        if n not in todo:
            out.print(f"step {n}: {memory.why_not(n)}")
    for n in todo:
        try:
            marker = read_marker(memory.tier, n)
            with progress(ctx, f"step {n}", step_bytes(read_manifest(memory.tier, n))) as report:
                done = copy_step(memory.tier, local, n, ranks=set(marker.ranks), concurrency=threads, progress=report)
        except (TiercheckError, OSError) as e:
            err.print(f"step {n}: not persisted: {str(e).splitlines()[0]}", markup=False)
            failed.append(n)
            continue
        out.print(
            f"persisted step {n} to {local.url}: {done.files_copied} files ({human(done.bytes_copied)}), "
            f"{done.files_already_there} already there, {done.seconds:.1f} s"
        )
    return failed


# -------------------------------------------------------------------------------- gc --memory


def gc_memory(ctx: Context, locals_: list[Tier], path: str, *, dry_run: bool) -> None:
    """Reclaim the memory tiers under ``path`` of the local directories given whose job is not
    running (their lock is free) and whose steps are on the local directory already, or are another
    lineage's; report those under ``path`` that belong to no directory given. Each directory's lock
    is taken for a moment, ``dry_run`` or not: a job holding it is running."""
    verb = "would remove" if dry_run else "removed"
    mine = set()
    for local in locals_:
        assert local.local_path is not None
        mine.add(memory_dir(path, local.local_path).name)
        memory = open_memory(ctx, local, path)
        if memory is None:
            continue
        try:
            with Locked(local):
                why = memory.foreign()
                pending = [] if why is not None else memory.unpersisted()
                if pending:
                    out.print(
                        f"kept the memory tier of {local.url} at {memory.directory}: {steps_named(pending)} not on "
                        f"the local directory (`tiercheck persist {quote(local.url)} --memory {quote(path)}` "
                        "copies them)"
                    )
                    continue
                freed = held_bytes(memory.directory)
                if not dry_run:
                    reclaim(memory)
                reason = f"another lineage's ({why})" if why is not None else "no step the local directory lacks"
                out.print(f"{verb} the memory tier of {local.url} at {memory.directory} ({human(freed)}): {reason}")
        except DirectoryInUseError:
            out.print(f"kept the memory tier of {local.url} at {memory.directory}: a job is running there")
    root = Path(path)
    ours = re.compile(r"[0-9a-f]{16}")  # memory_dir's names: PATH may hold other things (PATH=/dev/shm)
    others = sorted(p for p in root.iterdir() if ours.fullmatch(p.name) and p.is_dir() and p.name not in mine) \
        if root.is_dir() else []  # fmt: skip
    for p in others:
        err.print(
            f"not judged: the memory tier {p} belongs to a local directory not given "
            f"(give it: tiercheck gc DIR --memory {quote(path)})",
            markup=False,
        )

