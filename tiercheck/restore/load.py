"""``load``: a committed step read into a plain nested dict of CPU tensors, with no live state and
no other ranks (inspection, conversion, tests); ``open_step``: the step such a reader starts from."""

from __future__ import annotations

import os
from typing import Any

from tiercheck.cluster.assign import assign_all_reads
from tiercheck.errors import CheckpointNotFoundError
from tiercheck.format.extents import check_extents
from tiercheck.format.manifest import ArrayRecord, CommitMarker, Manifest
from tiercheck.format.refmaps import check_documents
from tiercheck.format.steps import list_steps, read_manifest, read_marker
from tiercheck.humanize import fmt_steps, ranges
from tiercheck.restore.match import apply, prepare
from tiercheck.restore.plan import RestorePlan
from tiercheck.restore.read import ReadSource, move_chunks
from tiercheck.state.flatten import gc_paused
from tiercheck.tiers.base import Tier
from tiercheck.tiers.remote import open_tier

# --------------------------------------------------------------------------- load()


@gc_paused()
def load(
    path: str | os.PathLike[str],
    step: int | None = None,
    *,
    allow_pickle: bool = False,
    io_threads: int = 4,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Read a committed step into a plain nested dict of CPU tensors (state_dicts become dicts).

    ``path`` is a local directory or a remote URL (``s3://``, ``az://``, ``abfs://``, ``file://``;
    ``storage_options`` go to fsspec). Sharded tensors come back whole. A local directory must
    hold every chunk: a step saved by ranks on several nodes is spread over their directories.
    ``step``: the step to read (default: the newest committed). ``allow_pickle``: read values
    stored with pickle (only from a checkpoint you trust).
    """
    tier, step, manifest, marker = open_step(path, step, storage_options=storage_options)
    where = f"{tier.url}: step {step}"
    out: dict[str, Any] = {}
    checked: list[bool] = []

    def backed_by_the_files(rec: ArrayRecord) -> None:
        """Before the first array is allocated from its record: every record's sizes, against the files."""
        if not checked:
            check_extents(tier, step, manifest.arrays, where=where)
            checked.append(True)

    items, decoded = prepare(
        out,
        manifest,
        manifest.tree(0),
        strict=False,
        allow_pickle=allow_pickle,
        where=where,
        fresh=True,
        before_allocating=backed_by_the_files,
    )
    plan = assign_all_reads(manifest.arrays, [[i.need for i in items]], [frozenset(marker.ranks)], read_once=True)
    source = ReadSource(tier=tier, step=step, io_threads=io_threads)
    move_chunks(source, RestorePlan.alone(plan, manifest.arrays), items)
    apply(out, decoded, where=where)
    return out


def open_step(
    path: str | os.PathLike[str], step: int | None = None, *, storage_options: dict[str, Any] | None = None
) -> tuple[Tier, int, Manifest, CommitMarker]:
    """The tier at ``path``, the committed step (the newest where ``step`` is None), its manifest and
    commit marker, for a reader that needs every chunk of the step in one process (``load``, exports).
    Raises ``CheckpointNotFoundError`` where the step is not committed there, or where a node-local
    directory lacks other nodes' chunks, and ``CorruptCheckpointError`` where the step's reference
    maps name another step or contradict its arrays' records (``format.refmaps``), as ``verify`` says."""
    root = os.fspath(path)
    tier = open_tier(root, storage_options=storage_options)
    if tier.local_path is not None and not tier.local_path.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint directory at {root!r}")
    committed = list_steps(tier).committed
    if step is None and not committed:
        raise CheckpointNotFoundError(f"{root!r} holds no committed step")
    if step is None:
        step = committed[-1]
    elif step not in committed:
        raise CheckpointNotFoundError(f"step {step} is not committed in {root!r} (committed: {fmt_steps(committed)})")
    manifest = read_manifest(tier, step)
    marker = read_marker(tier, step)
    where = f"{tier.url}: step {step}"
    absent = sorted(set(range(marker.world_size)) - set(marker.ranks))  # their parts of the manifest too
    if absent:
        raise CheckpointNotFoundError(
            f"{where}: the chunks written by saving rank(s) {ranges(absent)} are in other nodes' local "
            f"directories; this one holds ranks {ranges(sorted(marker.ranks))} of {marker.world_size}"
        )
    for rank in sorted(marker.ranks):  # a map per saving rank here: each read once, before any buffer
        check_documents(tier, step, rank, manifest.arrays, save=manifest.save_id, where=where)
    return tier, step, manifest, marker
