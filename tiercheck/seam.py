"""The internal interface the bundled integrations (``tiercheck.integrations``) build on: NOT the
public API. Nothing here is promised to users; it may change in any release, together with the
integrations that use it. Users import ``tiercheck`` (its ``__all__``), ``tiercheck.errors`` and
``tiercheck.options``.

The integrations import the public names and this module, nothing else of the package (an
import-linter contract in ``pyproject.toml`` checks it), so that the stages below can change
without reaching into the integrations, and what the integrations need of them is one list here:

Restoring through a ``Checkpointer``
    ``restore_tree``: ``Checkpointer.restore`` choosing how the saved tree maps onto the state
    (DeepSpeed's ranks read each other's entries, Megatron's state says exactly what it needs).
    ``FreshShard``: a read buffer made for one restore, read into without staging (DCP's reader).
    ``host_read_buffer``: new host memory for such a buffer, page-aligned where it is big.
    ``exit_deadline``: when waiting at interpreter exit must end, one bound for every exit hook
    (DCP's shared Checkpointer closes within it).

Reading a committed step without a ``Checkpointer``
    ``open_step``: a source's tier, the step, its manifest and commit marker (``load``'s opening).
    ``read_regions``: regions of a step's arrays into given tensors, every chunk verified (HF export).
    ``check_extents``: that the chunks a manifest gives some arrays are backed by the step's files,
    before any buffer is sized from those records.
    ``copy_in``: verified, staged data handed to live tensors (HF ``load_pretrained``).

Steps and tiers
    ``Tier``, ``LocalTier``, ``open_tier``: where steps live (a local directory, an fsspec URL).
    ``memory_steps``: the memory tier (``MemoryOptions``) of a node-local directory and the steps it
    may restore (those of the directory's lineage), for frameworks that list or read steps by
    themselves (a memory-only step, ``persist_every`` > 1, is on no other tier).
    ``step_tiers``: the tiers to read a step from, fastest first (memory where it holds the step as
    one a restore may read, the local directory, the remote), as a restore tries them.
    ``BLOCK``: the block size of ``LocalTier``'s direct I/O, which buffers written by it align to.
    ``list_steps``, ``read_index``, ``read_manifest``: the steps on a tier, a step's ``manifest.json``
    and its whole manifest.

The format
    ``JSON``, ``Manifest``, ``ArrayRecord``, ``CommitMarker``: the manifest's types.
    ``MAX_METADATA_BYTES``: the most JSON ``save(metadata=)`` takes (DCP keeps its metadata there).
    ``itemsize``: bytes per element of a stored dtype.

The state tree
    ``flatten``, ``decode``, ``Leaf``: a state as the saved tree's leaves, and a saved tree back.
    ``dtype_name``, ``torch_dtype``: a torch dtype as the format names it, and back.
    ``is_stateful``, ``placement_of``: whether a value has a ``state_dict``; where a tensor sits in
    its global tensor (a ``Shard``, a DTensor).
    ``aligned_empty``: page-aligned host memory (direct I/O reads and writes into it).

Formatting
    ``some``, ``fmt_steps``: a few of many items, and a list of steps, for error messages.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tiercheck.cluster.assign import assign_all_reads
from tiercheck.errors import ForeignCheckpointError
from tiercheck.format.codec import itemsize
from tiercheck.format.extents import check_extents
from tiercheck.format.foreign import find_foreign, say_foreign, step_in_name
from tiercheck.format.lineage import owns_memory
from tiercheck.format.manifest import JSON, ArrayRecord, CommitMarker, Manifest
from tiercheck.format.memory_steps import lineage_steps
from tiercheck.format.metadata import MAX_BYTES as MAX_METADATA_BYTES
from tiercheck.format.paths import COMMIT_FILE, step_of
from tiercheck.format.steps import list_steps, read_index, read_manifest
from tiercheck.humanize import fmt_steps, some
from tiercheck.lifecycle import exit_deadline
from tiercheck.options import MemoryOptions
from tiercheck.restore.load import open_step
from tiercheck.restore.match import FreshShard
from tiercheck.restore.plan import RestorePlan
from tiercheck.restore.read import ReadSource, move_chunks
from tiercheck.restore.stage import ReadItem, copy_in, host_read_buffer
from tiercheck.state.flatten import Leaf, decode, dtype_name, flatten, is_stateful, torch_dtype
from tiercheck.state.memory_pool import pool_dir
from tiercheck.state.sharding import placement_of
from tiercheck.state.staging import aligned_empty
from tiercheck.tiers.base import Tier
from tiercheck.tiers.local import BLOCK, LocalTier
from tiercheck.tiers.remote import open_tier

if TYPE_CHECKING:
    from tiercheck.checkpointer import Checkpointer

Region = tuple[ArrayRecord, torch.Tensor, tuple[int, ...]]
"""Part of a saved array to read: its record, the tensor to read it into (its shape is the part's),
and where that part starts in the array."""


def restore_tree(
    checkpointer: Checkpointer,
    step: int | None = None,
    *,
    strict: bool = True,
    allow_pickle: bool | None = None,
    others: bool | Callable[[list[str]], Iterable[str]] = False,
    extra: bool = True,
) -> int | None:
    """``checkpointer.restore(step, strict=, allow_pickle=)`` choosing how the saved tree maps onto
    the state, where a framework needs other than what users get.

    Args:
        checkpointer: the Checkpointer whose state is restored.
        step: as ``Checkpointer.restore``.
        strict: as ``Checkpointer.restore``.
        allow_pickle: as ``Checkpointer.restore``.
        others: for frameworks whose ranks save different top-level entries (DeepSpeed's per-rank
            files) and read each other's: entries of the saved state that this state lacks are added
            to it (the state must be a mutable mapping) and restored too; all of them with True, or
            those a callable picks from the list of their names.
        extra: False restores only what the state holds, for frameworks that describe exactly what
            each rank needs (Megatron, whose layout may change at the same world size); True (what
            users get) adds, on the saving world size, the items this rank saved inside the state's
            entries that the state lacks.

    Returns:
        The restored step, or None when no tier holds a committed step and ``step`` was None.
    """
    return checkpointer._restore(step, strict=strict, allow_pickle=allow_pickle, populate_local=False,
                                 in_place=None, others=others, extra=extra)  # fmt: skip


def read_regions(
    tier: Tier, step: int, regions: Sequence[Region], *, holders: frozenset[int], io_threads: int
) -> int:
    """Read ``regions`` of committed ``step`` on ``tier`` into their tensors in this process, as a
    restore reads them: each chunk once, its checksum verified, from the pack of the saving rank
    that wrote it (``holders``: the saving ranks whose files ``tier`` holds). The tensors are new
    memory no one else uses (nothing is staged). Returns the bytes read."""
    items = [ReadItem(rec, dest, offsets, fresh=True) for rec, dest, offsets in regions]
    records = {i.record.path: i.record for i in items}
    plan = assign_all_reads(records, [[i.need for i in items]], [holders], read_once=True)
    return move_chunks(ReadSource(tier=tier, step=step, io_threads=io_threads), RestorePlan.alone(plan, records), items)


def memory_steps(memory: MemoryOptions | None, local: str | os.PathLike[str]) -> tuple[LocalTier | None, list[int]]:
    """The memory tier of the node-local directory ``local`` with ``memory``'s options, and the steps
    committed there that a restore may read: none where it holds another lineage's, and none that is
    not the save the lineage holds for its number (``Checkpointer`` never restores those either), or
    where ``memory`` is None (then no tier: None). Nothing is created; a missing memory directory
    holds no steps."""
    if memory is None:
        return None, []
    root = pool_dir(memory, os.path.abspath(local))
    tier = LocalTier(root, fsync=False)
    if not root.is_dir():
        return tier, []
    local_tier = LocalTier(Path(local).absolute())
    if not list_steps(tier).committed or not owns_memory(local_tier, tier):
        return tier, []
    return tier, sorted(lineage_steps(tier, local_tier))  # each the save its lineage holds (format.memory_steps)


def step_tiers(
    step: int, local: str | os.PathLike[str], *, memory: MemoryOptions | None = None, remote: Tier | None = None
) -> list[Tier]:
    """The tiers to read committed step ``step`` from, fastest first, as a restore tries them: the memory
    tier of the node-local directory ``local`` (with ``memory``'s options) where it holds ``step`` as one a
    restore may read (``memory_steps``), then ``local``, then ``remote`` where given. Whether a tier holds
    the step whole is for the reader to find, reading the next tier where it does not."""
    tier, held = memory_steps(memory, local)
    tiers: list[Tier] = [tier] if tier is not None and step in held else []
    tiers.append(LocalTier(local))
    if remote is not None:
        tiers.append(remote)
    return tiers


def committed_step_at(path: str | Path) -> int | None:
    """N where the directory ``path`` is committed tiercheck step N of the directory above it (given as a
    framework's checkpoint path, such as torchtitan's ``initial_load_path``), else None."""
    p = Path(path)
    step = step_of(p.name)
    return step if step is not None and (p / COMMIT_FILE).is_file() else None


def refuse_foreign(path: str | Path) -> None:
    """Raise ``ForeignCheckpointError`` where the directory ``path`` holds another framework's checkpoints:
    for an integration that found no tiercheck step to resume from there, instead of a fresh start."""
    tier = LocalTier(path)
    found = find_foreign(tier)
    if found:
        raise ForeignCheckpointError(say_foreign(tier, found))


__all__ = [
    "BLOCK",
    "JSON",
    "MAX_METADATA_BYTES",
    "ArrayRecord",
    "CommitMarker",
    "FreshShard",
    "Leaf",
    "LocalTier",
    "Manifest",
    "Region",
    "Tier",
    "aligned_empty",
    "check_extents",
    "committed_step_at",
    "copy_in",
    "decode",
    "dtype_name",
    "exit_deadline",
    "flatten",
    "fmt_steps",
    "host_read_buffer",
    "is_stateful",
    "itemsize",
    "list_steps",
    "memory_steps",
    "open_step",
    "open_tier",
    "placement_of",
    "read_index",
    "read_manifest",
    "read_regions",
    "refuse_foreign",
    "restore_tree",
    "some",
    "step_in_name",
    "step_tiers",
    "torch_dtype",
]
