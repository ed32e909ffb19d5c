"""A rank's pack, planned once per save plan: its chunks in copy order at their places in the pack,
the runs they are staged and written in, and its reference map (``PackPlan``, ``pack_plan``).

The save plan (``save.plan``) says which chunks each rank writes; this lays them out: eager leaves
first, big chunks block-aligned for direct I/O, consecutive chunks staged together in runs of up to
``RUN_BYTES`` exactly as they lie in the pack.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from tiercheck.cluster.assign import LeafDesc
from tiercheck.format.codec import CHECKSUM_BYTES, chunk_nbytes, zarr_documents
from tiercheck.format.layout import Chunk, is_edge
from tiercheck.format.manifest import ArrayRecord
from tiercheck.format.paths import pack_file
from tiercheck.format.saveid import REFS_STAMP
from tiercheck.save.plan import SavePlan
from tiercheck.state.flatten import Leaf, dtype_name
from tiercheck.state.staging import ALIGN, align_up
from tiercheck.tiers.local import DIRECT_MIN_BYTES


@dataclass(frozen=True, slots=True)
class ChunkTask:
    leaf: int  # index into the save's leaves
    path: str  # array path
    chunk: Chunk  # in the global array (its key names the file)
    local: Chunk  # the same chunk in the leaf tensor's own coordinates
    chunk_shape: tuple[int, ...]
    nbytes: int  # full (padded) chunk bytes
    offset: int  # where the chunk (data, then its CRC32C) starts in this rank's pack


RUN_BYTES = 64 << 20  # chunks are staged and written together in runs of up to this many bytes
RUN_CHUNKS = 512  # and this many chunks


@dataclass(frozen=True, slots=True)
class Run:
    """Consecutive chunks staged in one region of the pool exactly as they lie in the pack (data,
    checksum, data, ..., with the zeros of alignment gaps) and written with one call: one copy
    call, one write, one pool region for many chunks. A chunk longer than a run is one alone.

    The run starts ``lead`` bytes into its region: its offset in the pack modulo a page, so that
    the pack's block-aligned middle of the run is page-aligned in memory too, and is written with
    direct I/O wherever the run starts (0 where its first chunk cannot be placed there)."""

    tasks: list[ChunkTask]
    lead: int = 0

    @property
    def offset(self) -> int:
        return self.tasks[0].offset  # in the pack; each chunk's place in the region is relative to it

    @property
    def nbytes(self) -> int:
        last = self.tasks[-1]
        return last.offset + last.nbytes + CHECKSUM_BYTES - self.offset

    def at(self, t: ChunkTask) -> int:
        """Where chunk ``t`` starts in the run's region."""
        return self.lead + t.offset - self.offset

    @staticmethod
    def plan(tasks: list[ChunkTask], limit: int, placeable: Callable[[ChunkTask, int], bool]) -> list[Run]:
        """``tasks`` (in pack order) cut into runs spanning at most ``limit`` bytes. A chunk joins
        the run before it where ``placeable(task, place in the region)`` (its copy can land there)."""
        runs: list[Run] = []
        cur: list[ChunkTask] = []
        lead = 0
        for t in tasks:
            if cur and (
                len(cur) >= RUN_CHUNKS
                or t.offset + t.nbytes + CHECKSUM_BYTES - cur[0].offset > limit
                or not placeable(t, lead + t.offset - cur[0].offset)
            ):
                runs.append(Run(cur, lead))
                cur = []
            if not cur:
                lead = t.offset % ALIGN if placeable(t, t.offset % ALIGN) else 0
            cur.append(t)
        if cur:
            runs.append(Run(cur, lead))
        return runs


@dataclass(frozen=True, slots=True)
class PackPlan:
    """What this rank writes into its pack and how it stages it (chunks, runs, pool bytes): computed
    once and reused while the layout of every rank is unchanged."""

    signature: tuple[Any, ...]
    shard: dict[str, ArrayRecord]  # the arrays this rank coordinates, with their chunk owners
    tasks: list[ChunkTask]  # this rank's chunks: eager ones first, then lazy ones
    n_eager: int
    runs: tuple[list[Run], list[Run]]  # the eager tasks and the lazy ones in runs (``plan_runs``)
    placement: tuple[tuple[torch.device, tuple[int, ...]], ...]  # what the runs assumed (``leaf_placement``)
    rank: int
    refs: bytes  # this rank's zarr keys: its chunks in its pack, the zarr.json of the arrays it coordinates
    pool_bytes: int  # host memory this rank's whole snapshot needs


def pack_plan(
    leaves: list[Leaf],
    save_plan: SavePlan,
    *,
    signature: tuple[Any, ...],
    rank: int,
    root_doc: bool,
    align: int = 1,
) -> PackPlan:
    """This rank's part of the save plan: its chunks in copy order, eager leaves first, each at
    its place in the rank's pack (in that order; big chunks block-aligned, for direct I/O, the others
    at a multiple of ``align``: ``RUN_ALIGN`` where a slot of the memory tier stages the pack's image), and
    its reference map (its chunks, and the zarr documents of the arrays it coordinates; the
    step's own group with ``root_doc``)."""
    eager: list[ChunkTask] = []
    lazy: list[ChunkTask] = []
    for t in save_plan.tasks:
        leaf = leaves[t.leaf]
        rec = save_plan.records[leaf.path]
        task = ChunkTask(t.leaf, leaf.path, t.chunk, t.local, rec.chunks, chunk_nbytes(rec), 0)
        (lazy if leaf.lazy else eager).append(task)
    tasks, end = [], 0
    for task in eager + lazy:
        end = align_up(end) if task.nbytes >= DIRECT_MIN_BYTES else -(-end // align) * align
        tasks.append(replace(task, offset=end))
        end += task.nbytes + CHECKSUM_BYTES
    runs = plan_runs(leaves, tasks[: len(eager)], tasks[len(eager) :], RUN_BYTES)
    return PackPlan(
        signature=signature,
        shard=save_plan.shard,
        tasks=tasks,
        n_eager=len(eager),
        rank=rank,
        runs=runs,
        placement=leaf_placement(leaves),
        refs=reference_map(rank, tasks, zarr_documents(list(save_plan.shard.values()), root=root_doc)),
        pool_bytes=runs_bytes(runs),
    )


def leaf_placement(leaves: list[Leaf]) -> tuple[tuple[torch.device, tuple[int, ...]], ...]:
    """Each leaf's device and strides, which decide where ``plan_runs`` may place its chunks (which
    pieces are contiguous, which stream copies them). The plan's signature (shapes and dtypes, on
    which every rank re-plans together) leaves them out."""
    return tuple((leaf.tensor.device, leaf.tensor.stride()) for leaf in leaves)


def runs_bytes(runs: tuple[list[Run], list[Run]]) -> int:
    """The pool memory ``runs`` take at once: one region of whole pages a run."""
    return sum(align_up(r.lead + r.nbytes) for part in runs for r in part)


def plan_runs(
    leaves: list[Leaf], eager: list[ChunkTask], lazy: list[ChunkTask], limit: int
) -> tuple[list[Run], list[Run]]:
    """The eager and the lazy tasks in runs (``Run.plan``) whose chunks all come from one device
    (one stream copies a run), each chunk where its view can be taken: at a place aligned for its
    dtype, or anywhere when it is copied as bytes (a contiguous piece, no edge padding)."""

    def placeable(t: ChunkTask, at: int) -> bool:
        return at % RUN_ALIGN == 0 or as_bytes(leaves[t.leaf].tensor, t) is not None

    def cut(tasks: list[ChunkTask]) -> list[Run]:
        runs: list[Run] = []
        start = 0
        devices = [leaves[t.leaf].tensor.device for t in tasks]
        for i in range(1, len(tasks) + 1):
            if i == len(tasks) or devices[i] != devices[start]:
                runs.extend(Run.plan(tasks[start:i], limit, placeable))
                start = i
        return runs

    return cut(eager), cut(lazy)


def reference_map(rank: int, tasks: list[ChunkTask], docs: dict[str, bytes]) -> bytes:
    """A kerchunk reference map (version 1) of this rank's zarr keys: each chunk's byte range in
    its pack, under the template ``{{u}}`` a reader sets to the step's URL, and the ``zarr.json``
    documents inline. The union of every rank's map is the step as one zarr group."""
    if not tasks and not docs:
        return b""
    pack = "{{u}}/" + pack_file(rank)
    refs: dict[str, object] = {k: v.decode() for k, v in docs.items()}
    for t in tasks:
        refs[f"{t.path}/{t.chunk.key}"] = [pack, t.offset, t.nbytes + CHECKSUM_BYTES]
    return json.dumps({"version": 1, "templates": {"u": "."}, "refs": refs}, separators=(",", ":")).encode()


def stamp_reference_map(refs: bytes, *, step: int, save: str) -> bytes:
    """A rank's reference map (made once per plan) naming the step and save it is written for, as
    every file of a step does (format 5), under a key kerchunk readers pass over."""
    assert refs.endswith(b"}")
    stamp = json.dumps({"step": step, "save_id": save}, separators=(",", ":"))
    return refs[:-1] + f',"{REFS_STAMP}":{stamp}}}'.encode()


RUN_ALIGN = 64  # a chunk copied through a view of its dtype starts at a multiple of this in its run


def as_bytes(src: torch.Tensor, t: ChunkTask) -> torch.Tensor | None:
    """Chunk ``t`` of ``src`` as bytes, where it can be copied as such: a contiguous piece (a whole
    small tensor, rows of a big one) filling its chunk (no edge padding). None otherwise."""
    if src.device.type != "cpu" or is_edge(t.local, t.chunk_shape):
        return None
    whole = t.local.stops == src.shape and not any(t.local.starts)  # most chunks: no indexing to pay for
    piece = src if whole else src[t.local.slices()]
    if not piece.is_contiguous():
        return None
    return piece.reshape(-1).view(torch.uint8)


def leaf_descs(leaves: list[Leaf]) -> tuple[LeafDesc, ...]:
    """What planning needs of each leaf (and what tells a changed layout from an unchanged one)."""
    return tuple(
        LeafDesc(
            leaf.path,
            dtype_name(leaf.tensor.dtype),
            leaf.kind,
            leaf.global_shape,
            leaf.offsets,
            tuple(leaf.tensor.shape),
            leaf.lazy,
        )
        for leaf in leaves
    )
