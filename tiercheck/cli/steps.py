"""``tiercheck ls``, ``inspect`` and ``verify``: what a tier holds, and whether it is intact.

They only read, and they answer without torch or zarr (the checks themselves are the library's,
``tiercheck.format.verify``).
"""


from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from shlex import quote
from typing import Any

import click
from rich.table import Table

from tiercheck.cli.common import (
    THREADS,
    Context,
    age,
    err,
    errors_as_one_line,
    fail,
    human,
    out,
    pass_context,
    pick_step,
    remote_options,
    step_bytes,
    step_progress,
    step_value,
)
from tiercheck.cli.memory import MEMORY_HELP, MEMORY_ROLES, NodeMemory, memory_dir, memory_role, open_memory
from tiercheck.cli.values import plain_values, render
from tiercheck.errors import CheckpointNotFoundError, TiercheckError
from tiercheck.format.codec import chunk_nbytes
from tiercheck.format.lineage import read_lineage
from tiercheck.format.paths import REFS_DIR, step_dir
from tiercheck.format.replicas import read_replicas
from tiercheck.format.steps import list_steps, read_manifest, read_marker
from tiercheck.format.verify import short_packs, verify_step
from tiercheck.humanize import fmt_steps, plural, ranges
from tiercheck.tiers.base import Tier
from tiercheck.tiers.remote import redact

# ----------------------------------------------------------------------------------------- ls


@click.command("ls")
@click.argument("locations", nargs=-1, required=True, metavar="URL_OR_DIR...")
@click.option("--memory", default=None, metavar="PATH", help=f"{MEMORY_HELP} Shown beside each DIR given.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@remote_options
@pass_context
def ls_command(ctx: Context, locations: tuple[str, ...], memory: str | None, as_json: bool) -> None:
    """Steps in one or more tiers: committed, partial, draining or persisting, size, age, which tier holds them.

    Give a node's local directory and the remote URL together to see both tiers side by side: a
    step committed locally and partial on the remote is "draining". With --memory, each local
    directory's memory tier is a column too, and what it holds that the directory lacks is named; a
    step committed in memory and partial on the directory is "persisting". Locations of different
    lineages (two runs') are listed with a warning: their steps of one number are different saves.
    """
    with errors_as_one_line():
        rows: dict[int, dict[str, Any]] = {}
        tiers = [(ctx.tier(loc), redact(loc)) for loc in locations]
        _warn_lineages([t for t, _ in tiers])
        memories = _memories(ctx, [t for (t, _), loc in zip(tiers, locations, strict=True) if "://" not in loc], memory)
        in_memory = {str(m.directory) for m in memories}
        tiers += [(m.tier, str(m.directory)) for m in memories]
        names = [name for _, name in tiers]
        for tier, name in tiers:
            _add_rows(rows, tier, name)
        for row in rows.values():  # committed on one tier, partial on another: a drain (a persist) in progress
            holders = [n for n, t in row["tiers"].items() if t["status"].startswith("committed")]
            if holders:
                moving = "persisting" if all(n in in_memory for n in holders) else "draining"
                for t in row["tiers"].values():
                    if t["status"] == "partial":
                        t["status"] = moving
        ordered = [rows[s] for s in sorted(rows)]
        notes = [_memory_note(m, memory) for m in memories]
        if as_json:
            click.echo(json.dumps({"locations": names, "steps": ordered, "memory": notes}, indent=2))
            return
        if not ordered:
            out.print(f"no steps in {', '.join(names)}")
        else:
            _print_table(ordered, names)
        for note in notes:
            _print_memory_note(note)
        for tier, _ in tiers[: len(locations)]:
            _point_to_memory(tier)


def _warn_lineages(tiers: list[Tier]) -> None:
    """Warn where the locations name different lineages (two runs'): side by side, a step number in
    two columns would read as one step. Locations naming none (empty, or written before lineages) pass."""
    named = {}
    for tier in tiers if len(tiers) > 1 else []:
        try:
            found = read_lineage(tier)
        except TiercheckError:  # an unreadable LINEAGE.json: `ls` lists what it can
            continue
        if found is not None:
            named[tier.url] = found
    if len({lineage.id for lineage in named.values()}) > 1:
        err.print(
            "warning: the locations belong to different lineages (different runs' steps; a step number in two "
            f"columns is two different saves): {'; '.join(f'{url}: {n.named()}' for url, n in named.items())}",
            markup=False,
        )


def _point_to_memory(tier: Tier) -> None:
    """Where a location given is a memory tier's path or a node's memory tier: the ``--memory``
    form, which shows it beside its local directory, and what that directory lacks."""
    found = memory_role(tier.local_path) if tier.local_path is not None else None
    if found is not None:
        role, path = found
        err.print(
            f"{tier.url} is {MEMORY_ROLES[role]}: `tiercheck ls DIR --memory {quote(str(path))}` shows the memory "
            "tier of the local directory DIR beside it, with the steps DIR lacks",
            markup=False,
        )


def _add_rows(rows: dict[int, dict[str, Any]], tier: Tier, name: str) -> None:
    """``tier``'s steps into ``rows`` (by step), under ``name``."""
    listing = list_steps(tier)
    for s in listing.committed:
        row = rows.setdefault(s, {"step": s, "tiers": {}})
        try:
            manifest = read_manifest(tier, s)
            marker = read_marker(tier, s)
            short = short_packs(tier, s, manifest, set(marker.ranks))
        except TiercheckError as e:
            row["tiers"][name] = {"status": "damaged", "error": str(e)}
            continue
        if short:  # cheap: the packs' sizes against the manifest; `verify` reads every byte
            row["tiers"][name] = {"status": "damaged", "error": f"step {s}: {'; '.join(short)}"}
            continue
        whole = set(marker.ranks) == set(range(marker.world_size))
        copies = sorted({r for c in read_replicas(tier, s, checked=True) for r in c.ranks} - set(marker.ranks))
        status = "committed" if whole else f"committed (ranks {ranges(sorted(marker.ranks))})"
        if copies:  # peers' files this node keeps a replica of
            status += f" + replicas of ranks {ranges(copies)}"
        row.setdefault("bytes", step_bytes(manifest))
        row.setdefault("created_unix", manifest.created_unix)
        row["tiers"][name] = {
            "status": status,
            "ranks": list(marker.ranks),
            "replica_ranks": copies,
            "world_size": marker.world_size,
        }
    for s in listing.partial:
        rows.setdefault(s, {"step": s, "tiers": {}})["tiers"][name] = {"status": "partial"}


def _print_table(ordered: list[dict[str, Any]], names: list[str]) -> None:
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
    for row in ordered:
        for n, t in row["tiers"].items():
            if "error" in t:
                err.print(f"damaged: {n}: {t['error']}", markup=False)
    if any(t["status"].startswith("committed") for row in ordered for t in row["tiers"].values()):
        out.print(
            "committed: COMMIT, manifest and pack sizes agree (`tiercheck verify` re-reads every chunk); "
            "size: the bytes of its arrays' chunks"
        )


def _memories(ctx: Context, tiers: list[Tier], path: str | None) -> list[NodeMemory]:
    """The memory tiers under ``path`` of the local directories ``tiers`` (none without ``path``)."""
    if path is None:
        return []
    if not tiers:
        raise click.UsageError("--memory goes with a node's local directory: a remote URL has no memory tier")
    found = []
    for tier in tiers:
        m = open_memory(ctx, tier, path)
        if m is None:
            err.print(f"no memory tier for {tier.url} under {path}", markup=False)
        else:
            found.append(m)
    return found


def _memory_note(m: NodeMemory, path: str | None) -> dict[str, Any]:
    foreign = m.foreign()
    return {
        "local": m.local.url,
        "path": path,
        "directory": str(m.directory),
        "owner": m.owner,
        "lineage": m.lineage,
        "foreign": foreign,
        "unpersisted": [] if foreign is not None else m.unpersisted(),
    }


def _print_memory_note(note: dict[str, Any]) -> None:
    where = f"the memory tier of {note['local']} ({note['directory']})"
    args = f"{quote(note['local'])} --memory {quote(note['path'])}"  # the path ls was given, default or not
    if note["foreign"] is not None:
        err.print(f"{where} is another lineage's: {note['foreign']}; never restored, removed by "
                  f"`tiercheck gc {args}`", markup=False)  # fmt: skip
    elif note["unpersisted"]:
        out.print(
            f"{where} holds {_steps(note['unpersisted'])} that the directory lacks: the next run restores "
            f"and persists them, or `tiercheck persist {args}` does"
        )


# ------------------------------------------------------------------------------------ inspect


@click.command("inspect")
@click.argument("location", metavar="URL_OR_DIR")
@click.option("--step", default="latest", show_default=True, callback=step_value, help="Step number, or 'latest'.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@remote_options
@pass_context
def inspect_command(ctx: Context, location: str, step: str, as_json: bool) -> None:
    """Tensors, shapes, dtypes, shard layout, saving topology and user metadata of a step."""
    with errors_as_one_line():
        tier = ctx.tier(location)
        n = pick_step(tier, step)
        manifest = read_manifest(tier, n)
        marker = read_marker(tier, n)
        # The plain values (not tensors) of the first saving rank whose part this tier holds: stored
        # as tagged JSON, shown as such by --json and as Python would in the listing.
        rank = min(manifest.tree_of_rank, default=None)
        values = plain_values(manifest.tree(rank)) if rank is not None else {}
        arrays: list[dict[str, Any]] = []
        for rec in sorted(manifest.arrays.values(), key=lambda rec: _natural(rec.path)):  # state/2 before state/10
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
            "bytes": step_bytes(manifest),
            "topology": manifest.topology,
            "this_tier_holds_ranks": list(marker.ranks),
            "metadata": manifest.metadata,
            "distinct_rank_states": len(manifest.trees),
            "values_of_rank": rank,
            "values": values,
            "arrays": arrays,
        }
        if as_json:
            click.echo(json.dumps(doc, indent=2))
            return
        world = manifest.world_size
        raw = manifest.topology.get("nodes", 1)
        nodes = raw if isinstance(raw, int) else 1
        out.print(f"step {n} in {doc['location']}: {human(doc['bytes'])} in {len(arrays)} arrays")
        out.print(
            f"  saved {doc['created_utc']} by tiercheck {manifest.library_version} (format {doc['format_version']})"
        )
        out.print(f"  saving topology: {plural(world, 'rank')} on {plural(nodes, 'node')}; this tier holds the files "
                  f"of {'rank' if len(marker.ranks) == 1 else 'ranks'} {ranges(sorted(marker.ranks))}")  # fmt: skip
        out.print(f"  metadata: {json.dumps(manifest.metadata)}", markup=False)
        _print_values(values, rank, len(manifest.trees))
        columns = (("array", "<"), ("dtype", "<"), ("shape", "<"), ("chunks", "<"), ("n", ">"), ("size", ">"),
                   ("written by ranks", "<"))  # fmt: skip
        rows = [(a["path"], a["dtype"], str(a["shape"]), str(a["chunks"]), str(a["n_chunks"]), human(a["bytes"]),
                 ranges(a["written_by_ranks"])) for a in arrays]  # fmt: skip
        # Plain aligned lines: rich's table takes ~1 ms a row (20,000 arrays: 18 s).
        widths = [max([len(name), *(len(r[i]) for r in rows)]) for i, (name, _) in enumerate(columns)]
        line = "  ".join(f"{{:{align}{w}}}" for (_, align), w in zip(columns, widths, strict=True))
        click.echo(line.format(*(name for name, _ in columns)).rstrip())
        click.echo("\n".join(line.format(*r).rstrip() for r in rows))


MAX_VALUES = 50  # plain values in the listing; --json has them all


def _print_values(values: dict[str, Any], rank: int | None, states: int) -> None:
    if not values:
        return
    whose = f" of saving rank {rank} (the ranks saved {states} different states)" if states > 1 else ""
    out.print(f"  values{whose}:", markup=False)
    for path, value in list(values.items())[:MAX_VALUES]:
        out.print(f"    {path} = {render(value)}", markup=False)
    if len(values) > MAX_VALUES:
        out.print(f"    ... and {len(values) - MAX_VALUES} more (--json shows them all)", markup=False)


# ------------------------------------------------------------------------------------- verify


@click.command("verify")
@click.argument("location", metavar="URL_OR_DIR")
@click.option("--step", default=None, callback=step_value, help="Step number, or 'latest'.  [default: latest]")
@click.option("--all", "every", is_flag=True, help="Verify every committed step (not with --step).")
@click.option("--threads", default=8, show_default=True, type=THREADS, help="Chunks read at once.")
@click.option("--memory", default=None, metavar="PATH", help=f"{MEMORY_HELP} Verify DIR's memory tier, not DIR.")
@remote_options
@pass_context
def verify_command(
    ctx: Context, location: str, step: str | None, every: bool, threads: int, memory: str | None
) -> None:
    """Re-read every chunk and check its checksum. Exit status 0: all intact; 1: damage found.

    Names every damaged array and chunk, or the step's manifest. A node's local directory holds only its
    ranks' chunks, and the peers' replicas it keeps: those are the ones checked there (replicas also against
    the size and CRC32C of each of their files). With --memory, the steps in DIR's memory tier are
    the ones checked.
    """
    if every and step is not None:
        raise click.UsageError("--step and --all exclude each other: give one")
    step = step or "latest"
    with errors_as_one_line():
        tier = ctx.tier(location)
        if memory is not None:
            found = open_memory(ctx, tier, memory)
            if found is None:
                fail(f"{tier.url} has no memory tier under {memory} (no {memory_dir(memory, location)})")
            if (why := found.foreign()) is not None:
                err.print(f"the memory tier at {found.directory} is another lineage's: {why}", markup=False)
            tier = found.tier
        listing = list_steps(tier)
        steps = listing.committed if every else [pick_step(tier, step)]
        if not steps:
            raise CheckpointNotFoundError(f"{tier.url} holds no committed step")
        damaged = [  # a step directory that cannot be read is not intact either
            f"step {n}: cannot read {step_dir(n)}: {why}"
            for n, why in listing.unreadable.items()
            if every or (step == "latest" and n > steps[-1])
        ]
        for n in steps:
            damaged.extend(verify_step(tier, n, threads=threads, progress=step_progress(ctx, n)))
        if damaged:
            for line in damaged:
                err.print(f"damaged: {line}", markup=False)
            bad = sorted({int(m.group(1)) for line in damaged if (m := re.match(r"step (\d+):", line))})
            intact = [n for n in steps if n not in bad]
            if intact:
                out.print(f"intact: {_steps(intact)}")
            fail(f"{_damage(damaged)} in {_steps(bad)} of {tier.url}")
        out.print(f"ok: {_steps(steps)} intact in {tier.url}")


def _natural(path: str) -> list[Any]:
    """Sorts numbered names by number: optimizer state 0, 1, 2, ..., 10 (as strings: 0, 1, 10, 11, ..., 2)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"([0-9]+)", path)]


def _steps(steps: list[int]) -> str:
    return f"{'step' if len(steps) == 1 else 'steps'} {fmt_steps(steps)}"


def _damage(lines: list[str]) -> str:
    """What ``verify_step``'s problem lines are, counted: damaged reference maps (``refs/``: plain
    zarr's way in; they name chunks, which are not damaged for it), chunks, manifests, the rest."""
    in_maps = [line for line in lines if f" {REFS_DIR}/" in line]
    maps = len({line.split(f" {REFS_DIR}/", 1)[1].split(":", 1)[0] for line in in_maps})  # each map once
    chunks = sum(" chunk " in line and f" {REFS_DIR}/" not in line for line in lines)
    manifests = sum(" chunk " not in line and f" {REFS_DIR}/" not in line and "manifest" in line for line in lines)
    others = len(lines) - len(in_maps) - chunks - manifests
    counts = [(maps, "damaged reference map"), (chunks, "damaged chunk"), (manifests, "damaged manifest"),
              (others, "other problem")]  # fmt: skip
    return ", ".join(plural(n, what) for n, what in counts if n)
