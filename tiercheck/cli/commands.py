"""The ``tiercheck`` command: pre-stage restores, list, inspect, verify, drain, collect garbage, plan.

Every subcommand takes local directories and remote URLs alike (``s3://``, ``az://``, ``file://``);
``-o key=value`` passes fsspec options (endpoint, credentials) for remote URLs, which otherwise come
from the environment as s3fs / adlfs read it. Errors end the command with one line on stderr and
exit status 1; nothing committed is ever deleted or overwritten except by ``gc`` without
``--dry-run``, which never deletes the newest committed step.
"""


from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import click
from rich.table import Table

from tiercheck.cli.common import (
    Context,
    OneLineGroup,
    _typed,
    age,
    configure_logging,
    err,
    errors_as_one_line,
    fail,
    human,
    out,
    parameter_count,
    parse_options,
    positive_number,
    progress,
    remote_options,
    step_value,
)
from tiercheck.errors import CheckpointNotFoundError, CorruptCheckpointError, TiercheckError
from tiercheck.fmt import fmt_steps as _fmt_steps
from tiercheck.fmt import plural as _plural
from tiercheck.fmt import ranges as _ranges
from tiercheck.format.codec import CHECKSUM_BYTES, checksum, chunk_nbytes, verify_chunk
from tiercheck.format.layout import grid_size
from tiercheck.format.manifest import Manifest
from tiercheck.format.paths import chunk_location, step_dir
from tiercheck.format.replicas import read_replicas
from tiercheck.format.steps import list_steps, rank_parts, read_manifest, read_marker, withdraw_step
from tiercheck.options import RetentionOptions, RetryOptions
from tiercheck.tiering.drain import upload_step
from tiercheck.tiering.retention import steps_to_delete
from tiercheck.tiering.transfer import copy_step
from tiercheck.tiers.base import Tier
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.remote import redact
from tiercheck.version import __version__


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="tiercheck")
@click.option(
    "-o",
    "--option",
    "options",
    multiple=True,
    metavar="KEY=VALUE",
    help="fsspec option for remote URLs (e.g. -o endpoint_url=http://... -o key=...); repeatable; also "
    "after the subcommand.",
)
@click.option(
    "--retry-deadline",
    type=float,
    default=120.0,
    callback=positive_number,
    show_default=True,
    metavar="SECONDS",
    help="Give up on a remote request that keeps failing transiently after this long.",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
@click.option("-v", "--verbose", is_flag=True, help="Log what tiercheck does (to stderr).")
@click.pass_context
def main(ctx: click.Context, options: tuple[str, ...], retry_deadline: float, quiet: bool, verbose: bool) -> None:
    """Checkpoints on local disks and in object stores: inspect them, move them, size them.

    URL_OR_DIR is a local directory, or a remote URL: s3://bucket/prefix, az://container/prefix,
    abfs://..., file:///path (credentials from -o options or the environment).
    """  # fmt: skip
    ctx.call_on_close(configure_logging(verbose))
    retry = RetryOptions(attempts=50, initial_backoff_s=0.2, max_backoff_s=10.0, deadline_s=retry_deadline)
    ctx.obj = Context(parse_options(options), retry, quiet or not sys.stderr.isatty())


pass_context = click.make_pass_decorator(Context)


def _pick_step(tier: Tier, step: str) -> int:
    committed = list_steps(tier).committed
    if not committed:
        raise CheckpointNotFoundError(f"{tier.url} holds no committed step")
    if step == "latest":
        return committed[-1]
    try:
        n = int(step)
    except ValueError:
        raise click.BadParameter(f"expected a step number or 'latest', got {step!r}", param_hint="--step") from None
    if n not in committed:
        raise CheckpointNotFoundError(f"step {n} is not committed in {tier.url} (committed: {_fmt_steps(committed)})")
    return n


def _step_bytes(manifest: Manifest) -> int:
    return sum(len(rec.checksums) * chunk_nbytes(rec) for rec in manifest.arrays.values())


# ----------------------------------------------------------------------------------------- ls


@main.command("ls")
@click.argument("locations", nargs=-1, required=True, metavar="URL_OR_DIR...")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@remote_options
@pass_context
def ls_command(ctx: Context, locations: tuple[str, ...], as_json: bool) -> None:
    """Steps in one or more tiers: committed, partial or draining, size, age, which tier holds them.

    Give a node's local directory and the remote URL together to see both tiers side by side: a
    step committed locally and partial on the remote is "draining".
    """
    with errors_as_one_line():
        rows: dict[int, dict[str, Any]] = {}
        names = [redact(loc) for loc in locations]
        for loc, name in zip(locations, names, strict=True):
            tier = ctx.tier(loc)
            listing = list_steps(tier)
            for s in listing.committed:
                row = rows.setdefault(s, {"step": s, "tiers": {}})
                try:
                    manifest = read_manifest(tier, s)
                    marker = read_marker(tier, s)
                except TiercheckError as e:
                    row["tiers"][name] = {"status": "damaged", "error": str(e)}
                    continue
                whole = set(marker.ranks) == set(range(marker.world_size))
                copies = sorted({r for c in read_replicas(tier, s) for r in c.ranks} - set(marker.ranks))
                status = "committed" if whole else f"committed (ranks {_ranges(sorted(marker.ranks))})"
                if copies:  # peers' files this node keeps a replica of
                    status += f" + replicas of ranks {_ranges(copies)}"
                row.setdefault("bytes", _step_bytes(manifest))
                row.setdefault("created_unix", manifest.created_unix)
                row["tiers"][name] = {
                    "status": status,
                    "ranks": list(marker.ranks),
                    "replica_ranks": copies,
                    "world_size": marker.world_size,
                }
            for s in listing.partial:
                rows.setdefault(s, {"step": s, "tiers": {}})["tiers"][name] = {"status": "partial"}
        for row in rows.values():  # committed on one tier, partial on another: a drain in progress
            statuses = [t["status"] for t in row["tiers"].values()]
            if any(st.startswith("committed") for st in statuses):
                for t in row["tiers"].values():
                    if t["status"] == "partial":
                        t["status"] = "draining"
        ordered = [rows[s] for s in sorted(rows)]
        if as_json:
            click.echo(json.dumps({"locations": names, "steps": ordered}, indent=2))
            return
        if not ordered:
            out.print(f"no steps in {', '.join(names)}")
            return
        table = Table(box=None, pad_edge=False)
        table.add_column("step", justify="right")
        for name in names:
            table.add_column(name)
        table.add_column("size", justify="right")
        table.add_column("age", justify="right")
        for row in ordered:
            cells = [row["tiers"].get(n, {}).get("status", "-") for n in names]
            size = human(row["bytes"]) if "bytes" in row else "-"
            created = age(row["created_unix"]) if "created_unix" in row else "-"
            table.add_row(str(row["step"]), *cells, size, created)
        out.print(table)


# ------------------------------------------------------------------------------------ inspect


@main.command("inspect")
@click.argument("location", metavar="URL_OR_DIR")
@click.option("--step", default="latest", show_default=True, callback=step_value, help="Step number, or 'latest'.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@remote_options
@pass_context
def inspect_command(ctx: Context, location: str, step: str, as_json: bool) -> None:
    """Tensors, shapes, dtypes, shard layout, saving topology and user metadata of a step."""
    with errors_as_one_line():
        tier = ctx.tier(location)
        n = _pick_step(tier, step)
        manifest = read_manifest(tier, n)
        marker = read_marker(tier, n)
        arrays: list[dict[str, Any]] = []
        for rec in manifest.arrays.values():
            writers = sorted(set(rec.owners.values())) if rec.owners else [0]
            arrays.append({
                "path": rec.path, "dtype": rec.dtype, "kind": rec.kind, "shape": list(rec.shape),
                "chunks": list(rec.chunks), "n_chunks": len(rec.checksums),
                "bytes": len(rec.checksums) * chunk_nbytes(rec), "written_by_ranks": writers,
            })  # fmt: skip
        doc = {
            "location": redact(location),
            "step": n,
            "format_version": manifest.format_version,
            "library_version": manifest.library_version,
            "created_utc": datetime.fromtimestamp(manifest.created_unix, timezone.utc).isoformat(timespec="seconds"),
            "bytes": _step_bytes(manifest),
            "topology": manifest.topology,
            "this_tier_holds_ranks": list(marker.ranks),
            "metadata": manifest.metadata,
            "distinct_rank_states": len(manifest.trees),
            "arrays": arrays,
        }
        if as_json:
            click.echo(json.dumps(doc, indent=2))
            return
        world = manifest.world_size
        raw = manifest.topology.get("nodes", 1)  # a count since format 3, node ids before
        nodes = raw if isinstance(raw, int) else (len(set(map(str, raw))) if isinstance(raw, list) else 1) or 1
        out.print(f"step {n} in {doc['location']}: {human(doc['bytes'])} in {len(arrays)} arrays")
        out.print(
            f"  saved {doc['created_utc']} by tiercheck {manifest.library_version} (format {doc['format_version']})"
        )
        out.print(f"  saving topology: {world} rank(s) on {nodes} node(s); this tier holds the files of ranks "
                  f"{_ranges(sorted(marker.ranks))}")  # fmt: skip
        out.print(f"  metadata: {json.dumps(manifest.metadata)}", markup=False)
        columns = (("array", "<"), ("dtype", "<"), ("shape", "<"), ("chunks", "<"), ("n", ">"), ("size", ">"),
                   ("written by ranks", "<"))  # fmt: skip
        rows = [(a["path"], a["dtype"], str(a["shape"]), str(a["chunks"]), str(a["n_chunks"]), human(a["bytes"]),
                 _ranges(a["written_by_ranks"])) for a in arrays]  # fmt: skip
        # Plain aligned lines: rich's table takes ~1 ms a row (20,000 arrays: 18 s).
        widths = [max([len(name), *(len(r[i]) for r in rows)]) for i, (name, _) in enumerate(columns)]
        line = "  ".join(f"{{:{align}{w}}}" for (_, align), w in zip(columns, widths, strict=True))
        click.echo(line.format(*(name for name, _ in columns)).rstrip())
        click.echo("\n".join(line.format(*r).rstrip() for r in rows))


# ------------------------------------------------------------------------------------- verify


@main.command("verify")
@click.argument("location", metavar="URL_OR_DIR")
@click.option("--step", default="latest", show_default=True, callback=step_value, help="Step number, or 'latest'.")
@click.option("--all", "every", is_flag=True, help="Verify every committed step.")
@click.option("--threads", default=8, show_default=True, help="Chunks read at once.")
@remote_options
@pass_context
def verify_command(ctx: Context, location: str, step: str, every: bool, threads: int) -> None:
    """Re-read every chunk and check its checksum. Exit status 0: all intact; 1: damage found.

    Names every damaged array and chunk. A node's local directory holds only its ranks' chunks,
    and the peers' replicas it keeps: those are the ones checked there (replicas also against the
    size and CRC32C of each of their files).
    """
    with errors_as_one_line():
        tier = ctx.tier(location)
        listing = list_steps(tier)
        steps = listing.committed if every else [_pick_step(tier, step)]
        if not steps:
            raise CheckpointNotFoundError(f"{tier.url} holds no committed step")
        damaged = [  # a step directory that cannot be read is not intact either
            f"step {n}: cannot read {step_dir(n)}: {why}"
            for n, why in listing.unreadable.items()
            if every or (step == "latest" and n > steps[-1])
        ]
        for n in steps:
            damaged.extend(_verify_step(ctx, tier, n, threads))
        if damaged:
            for line in damaged:
                err.print(f"damaged: {line}", markup=False)
            fail(f"{len(damaged)} damaged chunk(s) in {tier.url}")
        out.print(f"ok: {_plural(len(steps), 'step')} intact in {tier.url}")


def _verify_step(ctx: Context, tier: Tier, n: int, threads: int) -> list[str]:
    bad: list[str] = []
    try:
        manifest = read_manifest(tier, n)
        marker = read_marker(tier, n)
        replicas = read_replicas(tier, n)
        held = sorted(set(marker.ranks) | {r for c in replicas for r in c.ranks})
        for c in replicas:
            bad.extend(_verify_replica_files(tier, n, c.files))
        # Every chunk this directory's saving ranks wrote: its checksum, its size where known (in
        # the writer's part, format 4, or where this directory holds the array's record), and
        # where it is (its own file, or an offset in its writer's pack).
        jobs: list[tuple[str, str, int, int | None, str, int | None]] = []
        whole = set(marker.ranks) == set(range(marker.world_size))
        if not marker.ranks:  # load refuses it: nothing here is anyone's
            bad.append(f"step {n}: the commit marker names no saving rank")
        if manifest.format_version >= 3:  # the ranks' parts list every chunk they wrote
            for rank, part in sorted(rank_parts(tier, n, held).items()):
                for path, crcs in sorted(part.checksums.items()):
                    rec = manifest.arrays.get(path)
                    if rec is None and whole:  # every shard is here: some record of the array must be
                        bad.append(
                            f"step {n}: array {path!r}: rank {rank} wrote chunks of it, the manifest has no record"
                        )
                    size = part.chunk_bytes.get(path, chunk_nbytes(rec) if rec else None)
                    for key, crc in sorted(crcs.items()):
                        file, offset = chunk_location(path, key, rank, part.offsets.get(path, {}).get(key))
                        jobs.append((path, key, crc, size, file, offset))
        else:
            ranks = set(marker.ranks)
            for rec in manifest.arrays.values():
                for key, crc in sorted(rec.checksums.items()):
                    if rec.owner(key) in ranks:
                        jobs.append((rec.path, key, crc, chunk_nbytes(rec), *rec.location(key)))
    except TiercheckError as e:
        return [*bad, f"step {n}: {e}"]
    if len(marker.ranks) == marker.world_size:  # every saving rank's part is here: every chunk is named
        for rec in manifest.arrays.values():
            if len(rec.checksums) != grid_size(rec.shape, rec.chunks):
                bad.append(
                    f"step {n}: array {rec.path!r}: the manifest names {len(rec.checksums):,} chunks "
                    f"of its {grid_size(rec.shape, rec.chunks):,}"
                )
    total = sum(job[3] or 0 for job in jobs)

    def check(job: tuple[str, str, int, int | None, str, int | None]) -> int:
        path, key, crc, nbytes, file, offset = job
        where = f"{tier.url}: step {n}: array {path!r} chunk {key}"
        try:
            try:
                if nbytes is None:  # a format-3 chunk file of an array recorded elsewhere: all of it
                    assert offset is None
                    raw = tier.read(f"{step_dir(n)}/{file}")
                else:  # in its pack; or its own file, read one byte past its end so one too long shows
                    raw = tier.read_range(
                        f"{step_dir(n)}/{file}", offset or 0, nbytes + CHECKSUM_BYTES + (offset is None)
                    )
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{where}: {file} is missing") from None
            size = len(raw) - CHECKSUM_BYTES if nbytes is None else nbytes
            verify_chunk(raw, expected_crc=crc, nbytes=size, where=where)
        except TiercheckError as e:
            bad.append(f"step {n}: array {path!r} chunk {key}: {str(e).rsplit(': ', 1)[-1]}")
        except OSError as e:  # no permission, EIO, a directory in its place
            bad.append(f"step {n}: array {path!r} chunk {key}: cannot read {file}: {e.strerror or e}")
        return nbytes or 0

    done = 0
    with progress(ctx, f"step {n}", total) as report, ThreadPoolExecutor(max(1, threads)) as pool:
        for nbytes in pool.map(check, jobs):
            done += nbytes
            report(done, total)
    return sorted(bad)


def _verify_replica_files(tier: Tier, n: int, files: dict[str, tuple[int, int]]) -> list[str]:
    """A replica's files other than packs (whose chunks are checked one by one) against their marker."""
    bad = []
    for name, (size, crc) in sorted(files.items()):
        if name.endswith(".bin"):
            continue
        try:
            data = tier.read_range(f"{step_dir(n)}/{name}", 0, size + 1)
        except FileNotFoundError:
            bad.append(f"step {n}: replica file {name} is missing")
            continue
        except OSError as e:
            bad.append(f"step {n}: replica file {name}: cannot read it: {e.strerror or e}")
            continue
        if len(data) != size or checksum(data) != crc:
            bad.append(f"step {n}: replica file {name}: size or CRC32C differs from its replica marker")
    return bad


# ------------------------------------------------------------------------------------ restore


@main.command("restore")
@click.argument("source", metavar="SRC")
@click.option("--to", "target", required=True, metavar="DIR", help="The node's local checkpoint directory.")
@click.option("--step", default="latest", show_default=True, callback=step_value, help="Step number, or 'latest'.")
@click.option(
    "--ranks",
    default=None,
    metavar="A-B[,C]",
    help="Only the chunk files these saving ranks wrote (this node's share, e.g. 0-7).",
)
@click.option("--verify", "verify_after", is_flag=True, help="Re-read and check every copied chunk at the target.")
@click.option("--threads", default=8, show_default=True, help="Files copied at once.")
@remote_options
@pass_context
def restore_command(
    ctx: Context, source: str, target: str, step: str, ranks: str | None, verify_after: bool, threads: int
) -> None:
    """Pre-stage a committed step from SRC onto a node's local tier before a job restarts.

    Copies in parallel, verifies every chunk's checksum on the way, and commits the step in DIR
    only when every file is there, so the job's restore() then reads locally. Interrupted, it
    resumes: files already in DIR with the right size are not copied again.
    """  # fmt: skip
    with errors_as_one_line():
        src = ctx.tier(source)
        dst = ctx.tier(target, must_exist=False)
        n = _pick_step(src, step)
        spans = _parse_ranks(ranks) if ranks else None
        world = read_marker(src, n).world_size
        wanted = None
        if spans is not None:
            if any(b >= world for _, b in spans):  # checked before a set is built: 0-999999999 is one line
                asked = ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)
                raise ValueError(f"step {n} was saved by ranks 0-{world - 1}; asked for {asked}")
            wanted = {r for a, b in spans for r in range(a, b + 1)}
        if n in list_steps(dst).committed:
            out.print(f"step {n} is already committed in {dst.url}; nothing to do")
            return
        total_hint = _step_bytes(read_manifest(src, n))
        if isinstance(dst, LocalTier):
            dst.create()  # only now: a refused restore leaves no new directory behind
        with progress(ctx, f"step {n}", total_hint) as report:
            result = copy_step(src, dst, n, ranks=wanted, concurrency=threads, progress=report)
        out.print(
            f"restored step {n} to {dst.url}: {result.files_copied} files copied "
            f"({human(result.bytes_copied)}), {result.files_already_there} already there, {result.seconds:.1f} s"
        )
        if verify_after:
            bad = _verify_step(ctx, dst, n, threads)
            if bad:
                for line in bad:
                    err.print(f"damaged: {line}", markup=False)
                fail(f"{len(bad)} damaged chunk(s) in {dst.url} after the copy")
            out.print(f"ok: step {n} intact in {dst.url}")


def _parse_ranks(text: str) -> list[tuple[int, int]]:
    """``--ranks`` as inclusive ``(first, last)`` spans; an empty or inverted span is an error."""
    spans: list[tuple[int, int]] = []
    try:
        for part in text.split(","):
            a, _, b = part.strip().partition("-")
            spans.append((int(a), int(b or a)))
    except ValueError:
        raise click.BadParameter(f"expected ranks like 0-7 or 0,2,4-5, got {text!r}", param_hint="--ranks") from None
    for first, last in spans:
        if first < 0 or last < first:
            raise click.BadParameter(
                f"{first}-{last} is an empty range of ranks (write it low-high)", param_hint="--ranks"
            )
    return spans


# -------------------------------------------------------------------------------------- drain


@main.command("drain")
@click.argument("local", metavar="DIR")
@click.option("--to", "remote", required=True, metavar="URL", help="The remote tier.")
@click.option(
    "--step",
    default=None,
    callback=step_value,
    help="Drain this step (default: every committed step newer than the remote's).",
)
@click.option("--threads", default=8, show_default=True, help="Files uploaded at once.")
@remote_options
@pass_context
def drain_command(ctx: Context, local: str, remote: str, step: str | None, threads: int) -> None:
    """Finish drains from a node's local tier to the remote tier (e.g. after a job ended early).

    Uploads what is missing (files already there with the right size are skipped) and commits
    the step on the remote once every saving rank's files are there; with several nodes, run it
    on each.
    """
    with errors_as_one_line():
        src = ctx.tier(local)
        assert isinstance(src, LocalTier)
        dst = ctx.tier(remote, must_exist=False)
        if step is not None:
            steps = [_pick_step(src, step)]
        else:
            remote_steps = list_steps(dst).committed
            newest = remote_steps[-1] if remote_steps else -1
            steps = [s for s in list_steps(src).committed if s > newest]
        if not steps:
            out.print(f"nothing to drain: {dst.url} has every step of {src.url}")
            return
        with ThreadPoolExecutor(max(1, threads)) as pool:
            for n in steps:
                total = _step_bytes(read_manifest(src, n))
                done = 0
                with progress(ctx, f"step {n}", total) as report:

                    def on_file(nbytes: int, report: Callable[[int, int], None] = report, total: int = total) -> None:
                        nonlocal done
                        done += nbytes
                        report(done, total)

                    result = upload_step(src, dst, n, pool=pool, on_file=on_file)
                state = (
                    "already committed there" if result.was_committed
                    else "committed" if result.committed
                    else "uploaded; waiting for the other nodes' files before it can commit"
                )  # fmt: skip
                out.print(
                    f"step {n} -> {dst.url}: {result.files_uploaded} files ({human(result.bytes_uploaded)}), "
                    f"{result.files_already_there} already there; {state}"
                )


# ----------------------------------------------------------------------------------------- gc


@main.command("export-deepspeed")
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
        n = _pick_step(ctx.tier(source), step)
        try:
            from tiercheck.integrations import deepspeed as tiercheck_ds
        except ImportError as e:
            fail(str(e))
        tag = tiercheck_ds.export(
            source, save_dir, step=n, allow_pickle=allow_pickle, storage_options=_typed(ctx.options) or None
        )
        out.print(f"exported step {n} as DeepSpeed checkpoint {tag!r}: {os.path.join(save_dir, tag)} and its latest")


@main.command("gc")
@click.argument("location", metavar="URL_OR_DIR")
@click.option("--keep-last", type=int, default=None, help="Keep this many newest committed steps.")
@click.option("--keep-every", type=int, default=None, help="Also keep every step divisible by this.")
@click.option(
    "--grace-hours",
    type=float,
    default=24.0,
    show_default=True,
    help="Remove partial steps only when older than the newest committed step and this old.",
)
@click.option("--dry-run", is_flag=True, help="List what would be removed; remove nothing.")
@remote_options
@pass_context
def gc_command(
    ctx: Context, location: str, keep_last: int | None, keep_every: int | None, grace_hours: float, dry_run: bool
) -> None:
    """Apply retention: delete committed steps the policy lets go, and abandoned partial steps.

    Never removes the newest committed step. A partial step counts as abandoned when it is older
    than the newest committed step and older than the grace period (a drain may still be writing it).
    """
    with errors_as_one_line():
        if keep_last is None and keep_every is None:
            raise click.UsageError("say what to keep: --keep-last K and/or --keep-every M")
        tier = ctx.tier(location)
        listing = list_steps(tier)
        policy = RetentionOptions(keep_last=keep_last, keep_every=keep_every)
        doomed = steps_to_delete(listing.committed, policy)
        newest = listing.committed[-1] if listing.committed else None
        abandoned = [
            s for s in listing.partial
            if newest is not None and s < newest and _older_than(tier, s, grace_hours * 3600)
        ]  # fmt: skip
        verb = "would remove" if dry_run else "removed"
        for s in doomed:
            if not dry_run:
                withdraw_step(tier, s)
            out.print(f"{verb} committed step {s}")
        for s in abandoned:
            if not dry_run:
                tier.delete_tree(step_dir(s))
            out.print(f"{verb} partial step {s}")
        kept = [s for s in listing.committed if s not in doomed]
        out.print(f"{'would keep' if dry_run else 'kept'} committed step(s): {_fmt_steps(kept)}")


def _older_than(tier: Tier, step: int, seconds: float) -> bool:
    """Whether every file of a partial step is older than ``seconds`` (local: by mtime)."""
    if not isinstance(tier, LocalTier):
        return True  # object stores: age is judged by being older than the newest committed step
    root = tier.root / step_dir(step)
    newest = max((p.stat().st_mtime for p in root.rglob("*")), default=root.stat().st_mtime)
    return time.time() - newest > seconds


# --------------------------------------------------------------------------------------- plan

_PRECISION = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


@main.command("plan")
@click.option(
    "--params",
    type=float,
    default=None,
    callback=parameter_count,
    help="Total parameters (e.g. 7e9); or give the layer sizes.",
)
@click.option("--layers", type=int, default=None)
@click.option("--hidden", type=int, default=None)
@click.option("--vocab", type=int, default=None)
@click.option("--ffn", type=int, default=None, help="MLP width (default 4 x hidden).")
@click.option(
    "--precision", type=click.Choice(sorted(_PRECISION)), default="bf16", show_default=True, help="Weight precision."
)
@click.option(
    "--optimizer",
    type=click.Choice(["adam", "sgd", "none"]),
    default="adam",
    show_default=True,
    help="adam: fp32 master weights + 2 moments (12 B/param more); sgd: 8; none: 0.",
)
@click.option("--tp", type=int, default=1, show_default=True)
@click.option("--pp", type=int, default=1, show_default=True)
@click.option("--dp", type=int, default=1, show_default=True)
@click.option("--gpus-per-node", type=int, default=8, show_default=True)
@click.option(
    "--node-mtbf-hours",
    type=float,
    default=5000.0,
    show_default=True,
    callback=positive_number,
    help="Mean time between failures of one node; the job's is this divided by the node count.",
)
@click.option(
    "--restart-s", type=float, default=None, help="Time to restart the job (default: the tier's restore time)."
)
@click.option(
    "--tier",
    "tiers",
    multiple=True,
    metavar="NAME:WRITE_GBPS:READ_GBPS:node|shared",
    help="A tier's bandwidth in GB/s, per node or shared by the job; repeatable (default: typical figures).",
)
@click.option(
    "--measure",
    "measured",
    multiple=True,
    metavar="DIR_OR_URL",
    help="Measure a tier with a short real write and read (256 MiB); repeatable.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@remote_options
@pass_context
def plan_command(ctx: Context, **kw: Any) -> None:
    """Size a model's checkpoints: bytes in total, per rank and per node, save and restore time on
    each tier, and the checkpoint interval that loses the least work (Young / Daly).

    Example: tiercheck plan --layers 96 --hidden 12288 --vocab 50257 --tp 8 --pp 16 --dp 8
    """  # fmt: skip
    from tiercheck.cli import sizing

    with errors_as_one_line():
        params = kw["params"]
        spec = sizing.ModelSpec(
            params=int(params) if params is not None else None,
            layers=kw["layers"], hidden=kw["hidden"], vocab=kw["vocab"], ffn=kw["ffn"],
            weight_bytes=_PRECISION[kw["precision"]], optimizer=kw["optimizer"],
            tp=kw["tp"], pp=kw["pp"], dp=kw["dp"], gpus_per_node=kw["gpus_per_node"],
        )  # fmt: skip
        tiers = [_parse_tier(t) for t in kw["tiers"]]
        for loc in kw["measured"]:
            if not ctx.quiet:
                err.print(f"measuring {redact(loc)} ...", markup=False)
            tiers.append(sizing.measure(loc, storage_options=_typed(ctx.options) or None))
        table = sizing.plan_table(
            spec,
            tiers or sizing.DEFAULT_TIERS,
            node_mtbf_hours=kw["node_mtbf_hours"],
            restart_s=kw["restart_s"],
            staging=sizing.HOST_MEMORY_TIER,
        )
        if kw["as_json"]:
            click.echo(json.dumps(table, indent=2))
            return
        _print_plan(table, defaults=not tiers)


def _parse_tier(text: str) -> Any:
    from tiercheck.cli import sizing

    try:
        name, w, r, kind = text.split(":")
        if kind not in ("node", "shared"):
            raise ValueError
        return sizing.Tier(name, float(w) * 1e9, float(r) * 1e9, shared=kind == "shared")
    except ValueError:
        raise click.BadParameter(f"expected NAME:WRITE_GBPS:READ_GBPS:node|shared, got {text!r}") from None


def _dur(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _print_plan(t: dict[str, Any], *, defaults: bool) -> None:
    m, z = t["model"], t["sizes"]
    out.print(
        f"model: {m['n_params'] / 1e9:.2f} B parameters, {m['weight_bytes']} B/param weights, "
        f"optimizer {m['optimizer']}; TP={m['tp']} PP={m['pp']} DP={m['dp']} on {z['ranks']} GPUs, {z['nodes']} node(s)"
    )
    dec = {k: human(z[k], binary=False) for k in ("total_bytes", "weights_bytes", "optimizer_bytes",
                                                    "per_rank_bytes", "per_node_bytes")}  # fmt: skip
    out.print(
        f"checkpoint: {dec['total_bytes']} in all (weights {dec['weights_bytes']}, optimizer "
        f"{dec['optimizer_bytes']}); written per rank {dec['per_rank_bytes']}, per node {dec['per_node_bytes']}"
    )
    out.print(f"job MTBF: {_dur(t['job_mtbf_s'])} ({t['node_mtbf_hours']:.0f} h per node)")
    table = Table(box=None, pad_edge=False)
    for col in (
        "tier",
        "write",
        "read",
        "save",
        "restore",
        "interval (Daly)",
        "lost work",
        "async interval",
        "async lost",
    ):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for row in t["tiers"]:
        tier = row["tier"]
        per = "shared" if tier["shared"] else "/node"
        a = row.get("async") or {}
        table.add_row(
            tier["name"], f"{tier['write_bytes_per_s'] / 1e9:.2f} GB/s {per}",
            f"{tier['read_bytes_per_s'] / 1e9:.2f} GB/s",
            _dur(row["save_s"]), _dur(row["restore_s"]), _dur(row["daly_interval_s"]),
            f"{100 * row['waste_fraction_daly']:.1f} %",
            _dur(a["interval_s"]) if a else "-", f"{100 * a['waste_fraction']:.1f} %" if a else "-",
        )  # fmt: skip
    out.print(table)
    out.print(
        "interval: Daly's optimum for a blocking checkpoint of that tier; async: tiercheck blocks only for the "
        "copy to host memory and writes in the background."
    )
    if defaults:
        out.print("bandwidths are typical figures, not measurements: give --tier or --measure for yours.")


if __name__ == "__main__":
    main()
