"""``tiercheck restore``, ``export-deepspeed`` and ``gc``: the commands that copy steps onto a node or
out of tiercheck's format, and the one that deletes them (``drain`` is in ``cli.drain``).

Nothing committed is ever deleted or overwritten except by ``gc`` without ``--dry-run``, which
never deletes the newest committed step.
"""


from __future__ import annotations

import os
import time
from contextlib import ExitStack
from shlex import quote
from typing import Literal

import click

from tiercheck.cli.common import (
    ASCII_INT,
    AT_LEAST_ONE,
    THREADS,
    Context,
    err,
    errors_as_one_line,
    fail,
    human,
    non_negative_number,
    out,
    pass_context,
    pick_step,
    progress,
    remote_options,
    step_bytes,
    step_progress,
    step_value,
    typed_options,
)
from tiercheck.cli.memory import MEMORY_ROLES, Locked, gc_memory, memory_role
from tiercheck.cluster.lock import DirectoryLock
from tiercheck.errors import CorruptCheckpointError
from tiercheck.format.commit import withdraw_step
from tiercheck.format.paths import (
    COMMIT_FILE,
    LINEAGE_FILE,
    LOCK_FILE,
    MEMORY_RECORD_FILE,
    NODE_FILE,
    SET_ASIDE_DIR,
    step_dir,
    step_of,
)
from tiercheck.format.steps import list_steps, read_manifest, read_marker
from tiercheck.format.verify import step_damage, verify_step
from tiercheck.humanize import fmt_steps, ranges
from tiercheck.options import RetentionOptions
from tiercheck.tiering.lineage import carry as carry_lineage
from tiercheck.tiering.lineage import carry_conflict, one_lineage
from tiercheck.tiering.retention import steps_to_delete
from tiercheck.tiering.transfer import copy_step
from tiercheck.tiers.base import Tier

# ------------------------------------------------------------------------------------ restore


@click.command("restore")
@click.argument("source", metavar="SRC")
@click.option("--to", "target", required=True, metavar="DIR", help="The node's local checkpoint directory.")
@click.option("--step", default="latest", show_default=True, callback=step_value, help="Step number, or 'latest'.")
@click.option(
    "--ranks",
    default=None,
    metavar="A-B[,C]",
    help="Only the files these saving ranks wrote (this node's share, e.g. 0-7).",
)
@click.option("--verify", "verify_after", is_flag=True, help="Re-read and check every copied chunk at the target.")
@click.option("--threads", default=8, show_default=True, type=THREADS, help="Files copied at once.")
@click.option(
    "--take-over",
    is_flag=True,
    help="Copy even where DIR holds another lineage's steps (making it SRC's) or files that are not a checkpoint's.",
)
@remote_options
@pass_context
def restore_command(
    ctx: Context,
    source: str,
    target: str,
    step: str,
    ranks: str | None,
    verify_after: bool,
    threads: int,
    take_over: bool,
) -> None:
    """Pre-stage a committed step from SRC onto a node's local tier before a job restarts.

    Copies in parallel, verifies every chunk's checksum on the way, and commits the step in DIR
    only when every file is there, so the job's restore() then reads locally. Interrupted, it
    resumes: packs a copy of the same save left in DIR are kept once read back and checked (any
    other file of the step there is copied again). With --verify, a step already committed in DIR
    is verified, and copied again if damaged. It holds DIR's writer lock, as a job does: it
    refuses a directory a job is writing, and a job cannot start there while it copies. DIR
    becomes SRC's lineage: a DIR holding another lineage's steps, or files that are not a
    checkpoint's, is refused unless --take-over.
    """  # fmt: skip
    with errors_as_one_line():
        src = ctx.tier(source)
        dst = ctx.tier(target, must_exist=False)
        n = pick_step(src, step)
        spans = _parse_ranks(ranks) if ranks else None
        source_marker = read_marker(src, n)
        world = source_marker.world_size
        wanted = None
        if spans is not None:
            if any(b >= world for _, b in spans):  # checked before a set is built: 0-999999999 is one line
                asked = ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)
                raise ValueError(f"step {n} was saved by ranks 0-{world - 1}; asked for {asked}")
            wanted = {r for a, b in spans for r in range(a, b + 1)}
        total_hint = step_bytes(read_manifest(src, n))
        if not take_over:
            _refuse_foreign(dst)
        lock = None
        if dst.local_path is not None:  # only now: a refused restore leaves no new directory behind
            dst.local_path.mkdir(parents=True, exist_ok=True)
            lock = DirectoryLock(dst.local_path)
            lock.acquire()  # a job's Checkpointer would delete the copy in flight as a partial step
        try:
            if n in list_steps(dst).committed:
                have, want = read_marker(dst, n).save_id, source_marker.save_id
                if have != want:
                    fail(
                        f"{dst.url} holds another save of step {n} (save {have}; {src.url} has save {want}): "
                        f"delete {step_dir(n)} there to restore this one"
                    )
                if not verify_after:
                    out.print(f"step {n} is already committed in {dst.url}; nothing to do (--verify checks it)")
                    return
                bad = verify_step(dst, n, threads=threads, progress=step_progress(ctx, n))
                if not bad:
                    out.print(f"ok: step {n} is already committed in {dst.url}, intact")
                    return
                err.print(f"step {n} in {dst.url} is damaged ({bad[0]}); copying it again", markup=False)
                dst.delete(f"{step_dir(n)}/{COMMIT_FILE}")  # never kept: the copy below replaces it whole
            why = None if take_over else carry_conflict(src, dst)
            if why is not None:
                fail(why)
            try:
                with progress(ctx, f"step {n}", total_hint) as report:
                    result = copy_step(src, dst, n, ranks=wanted, concurrency=threads, progress=report)
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(f"{e}{_fallback_hint(src, n) if step == 'latest' else ''}") from None
            carry_lineage(src, dst, n)
        finally:
            if lock is not None:
                lock.release()
        out.print(
            f"restored step {n} to {dst.url}: {result.files_copied} files copied "
            f"({human(result.bytes_copied)}), {result.files_already_there} already there, {result.seconds:.1f} s"
        )
        if verify_after:
            bad = verify_step(dst, n, threads=threads, progress=step_progress(ctx, n))
            if bad:
                for line in bad:
                    err.print(f"damaged: {line}", markup=False)
                fail(f"{len(bad)} damaged chunk(s) in {dst.url} after the copy")
            out.print(f"ok: step {n} intact in {dst.url}")


#: What a checkpoint directory may hold beside its steps: a directory holding none of these
#: (but something) is another tool's, and a copy would add files beside its own.
_CHECKPOINT_NAMES = {LINEAGE_FILE, LOCK_FILE, NODE_FILE, SET_ASIDE_DIR, MEMORY_RECORD_FILE}


def _not_checkpoint(tier: Tier) -> str | None:
    """What a non-empty ``tier`` holding no checkpoint holds ("a.txt, b and 3 more"); None where it
    is empty or holds a checkpoint's files."""
    names = tier.list_dir()
    if not names or any(name in _CHECKPOINT_NAMES or step_of(name) is not None for name in names):
        return None
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _refuse_foreign(dst: Tier) -> None:
    """Refuse a copy into a non-empty ``dst`` that holds no checkpoint (before anything, the
    writer lock included, is put there)."""
    shown = _not_checkpoint(dst)
    if shown is not None:
        fail(
            f"{dst.url} is not a checkpoint directory (it holds {shown}): the copy would add its files beside "
            "them. Use an empty or new directory, or pass --take-over"
        )


def _fallback_hint(src: Tier, n: int) -> str:
    """What a job's restore() would do where the newest step ``n`` of ``src`` is damaged: the
    newest older step whose manifest files read back whole, and the option that copies it."""
    for older in reversed([s for s in list_steps(src).committed if s < n]):
        if step_damage(src, older) is None:
            return f"; restore() would fall back to step {older}, the newest older step whole there: --step {older}"
    return "; no older step there reads back whole"


def _parse_ranks(text: str) -> list[tuple[int, int]]:
    """``--ranks`` as inclusive ``(first, last)`` spans; an empty or inverted span is an error."""
    spans: list[tuple[int, int]] = []
    try:
        for part in text.split(","):
            a, _, b = part.strip().partition("-")
            if not ASCII_INT.fullmatch(a.strip()) or not ASCII_INT.fullmatch((b or a).strip()):
                raise ValueError(part)
            spans.append((int(a), int(b or a)))
    except ValueError:
        raise click.BadParameter(f"expected ranks like 0-7 or 0,2,4-5, got {text!r}", param_hint="--ranks") from None
    for first, last in spans:
        if first < 0 or last < first:
            raise click.BadParameter(
                f"{first}-{last} is an empty range of ranks (write it low-high)", param_hint="--ranks"
            )
    return spans


# ---------------------------------------------------------------------------- export, gc


@click.command("export-deepspeed")
@click.argument("source", metavar="SRC")
@click.argument("save_dir", metavar="SAVE_DIR")
@click.option("--step", default="latest", show_default=True, callback=step_value, help="Step number, or 'latest'.")
@click.option(
    "--allow-pickle", is_flag=True, help="Unpickle objects outside the allow-list (only for checkpoints you trust)."
)
@remote_options
@pass_context
def export_deepspeed_command(ctx: Context, source: str, save_dir: str, step: str, allow_pickle: bool) -> None:
    """Write a step saved through the DeepSpeed plugin as DeepSpeed's own files.

    SRC must hold every rank's chunks: a remote URL, a single node's directory, or one filled by
    `tiercheck restore`. Writes SAVE_DIR/<tag>/*.pt with torch.save and SAVE_DIR/latest, which
    DeepSpeed's load_checkpoint and zero_to_fp32.py read without tiercheck. Needs DeepSpeed.
    """  # fmt: skip
    with errors_as_one_line():
        n = pick_step(ctx.tier(source), step)
        try:
            from tiercheck.integrations import deepspeed as tiercheck_ds
        except ImportError as e:
            fail(str(e))
        tag = tiercheck_ds.export(
            source, save_dir, step=n, allow_pickle=allow_pickle, storage_options=typed_options(ctx.options) or None
        )
        out.print(f"exported step {n} as DeepSpeed checkpoint {tag!r}: {os.path.join(save_dir, tag)} and its latest")


@click.command("gc")
@click.argument("locations", metavar="URL_OR_DIR...", nargs=-1, required=True)
@click.option("--keep-last", type=AT_LEAST_ONE, default=None, help="Keep this many newest committed steps.")
@click.option("--keep-every", type=AT_LEAST_ONE, default=None, help="Also keep every step divisible by this.")
@click.option(
    "--grace-hours",
    type=float,
    callback=non_negative_number,
    default=24.0,
    show_default=True,
    help="Remove partial steps only when older than the newest committed step and this old.",
)
@click.option("--dry-run", is_flag=True, help="List what would be removed; remove nothing.")
@click.option(
    "--memory",
    default=None,
    metavar="PATH",
    help="Also reclaim the memory tiers under PATH (MemoryOptions.path) of the directories given whose job "
    "has ended and whose steps are on the directory, or are another lineage's.",
)
@click.option(
    "--quick",
    is_flag=True,
    help="Judge the steps kept by --keep-last from their manifest files alone, without re-reading their chunks.",
)
@remote_options
@pass_context
def gc_command(
    ctx: Context,
    locations: tuple[str, ...],
    keep_last: int | None,
    keep_every: int | None,
    grace_hours: float,
    dry_run: bool,
    memory: str | None,
    quick: bool,
) -> None:
    """Apply retention: delete committed steps the policy lets go, and abandoned partial steps.

    Give one remote URL, or every node directory of a job (each holds its node's ranks' files of
    a step): a step counts as whole only where the locations given hold all its saving ranks'
    files of one save; locations of different lineages (two jobs' directories) are refused, deleting
    nothing. Never removes the newest committed step. --keep-last counts whole steps
    only: the newest steps are verified (every chunk re-read, as `verify` does, unless --quick)
    until that many are whole; a damaged one, or one whose other nodes' directories were not
    given, is reported and kept, and never costs an older whole step its place. A partial step
    counts as abandoned when it is older than the newest committed step and older than the grace
    period (a drain may still be writing it). With --memory (alone, or with a policy), a node
    directory's memory tier is removed where no job holds the directory's lock and its steps are on
    the directory already, or are another lineage's (never restored). The policy holds each local
    directory's writer lock, as a job does: it refuses a directory a job is writing. A location that
    is not a checkpoint directory (other files, a memory tier: see --memory) is an error.
    """
    with errors_as_one_line():
        if keep_last is None and keep_every is None and memory is None:
            raise click.UsageError("say what to keep: --keep-last K and/or --keep-every M (or reclaim: --memory PATH)")
        tiers = [ctx.tier(location) for location in dict.fromkeys(locations)]
        for tier in tiers:
            _refuse_to_collect(tier)
        if memory is not None:
            if any(tier.local_path is None for tier in tiers):
                raise click.UsageError("--memory goes with node directories: a remote URL has no memory tier")
            gc_memory(ctx, tiers, memory, dry_run=dry_run)
        if keep_last is None and keep_every is None:
            return
        if len(tiers) > 1:
            one_lineage(tiers)  # one job's directories: steps of two jobs are never pooled
        with ExitStack() as held:
            for tier in tiers:  # as a job does (restore and persist too): none deletes under a running job
                if tier.local_path is not None:
                    held.enter_context(Locked(tier))
            _apply_policy(tiers, RetentionOptions(keep_last=keep_last, keep_every=keep_every), grace_hours,
                          dry_run=dry_run, quick=quick)  # fmt: skip


def _refuse_to_collect(tier: Tier) -> None:
    """Refuse (exit status 1, before anything is removed) a location that is no checkpoint directory:
    one holding other files, or a memory tier's path or a node's memory tier (``--memory`` says which
    local directory's memory may go, and judges it by that directory)."""
    found = memory_role(tier.local_path) if tier.local_path is not None else None
    if found is not None:
        role, path = found
        fail(
            f"{tier.url} is {MEMORY_ROLES[role]}: nothing removed; `tiercheck gc DIR --memory {quote(str(path))}` "
            "reclaims the memory tier of the local directory DIR"
        )
    shown = _not_checkpoint(tier)
    if shown is not None:
        fail(f"{tier.url} is not a checkpoint directory (it holds {shown}): nothing removed")


def _apply_policy(
    tiers: list[Tier], policy: RetentionOptions, grace_hours: float, *, dry_run: bool, quick: bool
) -> None:
    """gc's retention: the committed steps ``policy`` lets go, and abandoned partial steps (the
    caller holds the local directories' locks)."""
    listings = {tier.url: list_steps(tier) for tier in tiers}
    committed = sorted({s for listing in listings.values() for s in listing.committed})

    def damage(s: int) -> str | None:
        holders = [tier for tier in tiers if s in listings[tier.url].committed]
        found = job_damage(holders, s, depth="manifest" if quick else "chunks")
        if found is None:
            return None
        label, why = found
        err.print(f"{label}: step {s}: {why}; kept, and not counted toward --keep-last", markup=False)
        return why

    doomed = steps_to_delete(committed, policy, damage=damage)
    newest = committed[-1] if committed else None
    verb = "would remove" if dry_run else "removed"
    for s in doomed:
        for tier in tiers:
            if s in listings[tier.url].committed:
                if not dry_run:
                    withdraw_step(tier, s)
                out.print(f"{verb} committed step {s}{_in(tier, tiers)}")
    for tier in tiers:
        for s in listings[tier.url].partial:
            if newest is not None and s < newest and _older_than(tier, s, grace_hours * 3600):
                if not dry_run:
                    tier.delete_tree(step_dir(s))
                out.print(f"{verb} partial step {s}{_in(tier, tiers)}")
    kept = [s for s in committed if s not in doomed]
    out.print(f"{'would keep' if dry_run else 'kept'} committed step(s): {fmt_steps(kept)}")


def _in(tier: Tier, tiers: list[Tier]) -> str:
    return f" in {tier.url}" if len(tiers) > 1 else ""


def job_damage(holders: list[Tier], step: int, *, depth: Literal["manifest", "chunks"]) -> tuple[str, str] | None:
    """Why ``step`` cannot be restored from ``holders`` together (None: it can), as ("damaged",
    why) where a holder's copy is damaged, else ("not whole", why) where the holders' markers name
    different saves or some saving rank's files are in none of them (another node's directory,
    not given)."""
    ranks: set[int] = set()
    saves: set[str | None] = set()
    world = 0
    for tier in holders:
        why = step_damage(tier, step, depth=depth)
        if why is not None:
            return "damaged", f"{tier.url}: {why}" if len(holders) > 1 else why
        marker = read_marker(tier, step)
        ranks.update(marker.ranks)
        saves.add(marker.save_id)
        world = marker.world_size
    if len(saves) > 1:
        return "not whole", f"the directories hold different saves of it ({', '.join(sorted(map(str, saves)))})"
    missing = sorted(set(range(world)) - ranks)
    if missing:
        return "not whole", (
            f"the files of saving rank(s) {ranges(missing)} of {world} are in none of the locations given: "
            "gc cannot tell whether the job can restore it (give every node directory of the job)"
        )
    return None


def _older_than(tier: Tier, step: int, seconds: float) -> bool:
    """Whether every file of a partial step is older than ``seconds`` (local: by mtime)."""
    if tier.local_path is None:
        return True  # object stores: age is judged by being older than the newest committed step
    root = tier.local_path / step_dir(step)
    newest = max((p.stat().st_mtime for p in root.rglob("*")), default=root.stat().st_mtime)
    return time.time() - newest > seconds
