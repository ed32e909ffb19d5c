"""Every name tiercheck gives on storage: the format's name and version, the step directories, the
files of a step (index, commit marker, manifest parts, packs, reference maps), the tiers' markers and
the memory tier's slots. Other modules join these names and spell none of their own, with three
kinds of exception: the manifest index writes the per-rank names out again as templates for other
readers of the format (``manifest.ManifestIndex``) and ``refmaps`` reads a rank back from a
reference map's name; ``zarr.json`` and ``c`` are zarr's names, and the torchtitan integration's
``step-N`` folders torchtitan's; a few temporaries (``.tiercheck-import-*``,
``.tiercheck-measure-*``) are named where they are made and removed."""


from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

FORMAT_NAME = "tiercheck"
FORMAT_VERSION = 5  # the one format this library writes and reads (docs/format.md); a step of another is refused
MANIFEST_FILE = "manifest.json"  # the step's index
COMMIT_FILE = "COMMIT"
PARTS_DIR = "manifest"  # rank-NNNNNN.json (each saving rank's), arrays-NNNNNN.json and owners-NNNNNN.json
PACKS_DIR = "packs"  # rank-NNNNNN.bin, every chunk a saving rank wrote
REFS_DIR = "refs"  # rank-NNNNNN.json, the zarr keys of a rank's chunks (plain JSON)


def part_file(rank: int) -> str:
    """A saving rank's part of the manifest: its state tree and the checksums of its chunks."""
    return f"{PARTS_DIR}/rank-{rank:06d}.json"


def shard_file(rank: int) -> str:
    """The arrays a saving rank coordinated: shape, dtype, chunk grid and every chunk's owner."""
    return f"{PARTS_DIR}/arrays-{rank:06d}.json"


@functools.lru_cache(maxsize=4096)  # asked for once per chunk a restore reads
def pack_file(rank: int) -> str:
    """A saving rank's chunks, one after another (each as zarr stores it: data, then its CRC32C)."""
    return f"{PACKS_DIR}/rank-{rank:06d}.bin"


def pack_owner(path: str) -> int | None:
    """The saving rank whose pack ``path`` (inside a step) is, or None when it is not a pack."""
    m = _PACK.match(path)
    return int(m.group(1)) if m else None


_PACK = re.compile(rf"^{PACKS_DIR}/rank-([0-9]{{6,}})\.bin$")


def chunk_location(writer: int, offset: int) -> tuple[str, int]:
    """Where a chunk is stored, relative to its step: its writer's pack and its offset there."""
    return pack_file(writer), offset


def owners_file(rank: int) -> str:
    """Who wrote each chunk of the arrays a saving rank coordinated. Only the rank planning an
    array's reads needs it: a restoring rank matching its state reads shapes and dtypes, which
    stay small when every rank writes a chunk of every array (FSDP2)."""
    return f"{PARTS_DIR}/owners-{rank:06d}.json"


def refs_file(rank: int) -> str:
    """A saving rank's zarr keys as a kerchunk reference map: its chunks' byte ranges in its pack,
    and the ``zarr.json`` documents of the arrays it coordinated. Plain zarr reads a step through
    the union of these (see docs/format.md); tiercheck itself reads the sealed parts, never these."""
    return f"{REFS_DIR}/rank-{rank:06d}.json"


STEP_PREFIX = "step-"


def step_dir(step: int) -> str:
    """The one name of a step's directory: the number zero-padded to 8 digits (more if it has more)."""
    return f"{STEP_PREFIX}{step:08d}"


def step_of(name: str) -> int | None:
    """The step whose directory ``name`` is, or None. Only ``step_dir(n)`` names step ``n``:
    another spelling of the number (``step-000000002``, ``step-2``) is no step, so two directories
    can never both be step 2 and housekeeping never deletes one in the other's name."""
    m = _STEP.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir(step) == name else None


_STEP = re.compile(r"step-([0-9]+)")  # ASCII digits: int() also reads other scripts' digits

SET_ASIDE_DIR = "set-aside"  # steps a restore passed over as damaged, moved out of the way of a new save


def set_aside_dir(step: int, stamp: str) -> str:
    """Where a damaged step is moved (``stamp``: when, UTC) so that its number can be saved again.
    Not a step's name at the top level, so nothing counts, restores, drains or deletes it."""
    return f"{SET_ASIDE_DIR}/{step_dir(step)}.{stamp}"


LOCK_FILE = ".tiercheck-lock"

NODE_FILE = ".tiercheck-node"

LINEAGE_FILE = "LINEAGE.json"  # at the root of a local directory or remote prefix: the lineage it belongs to

DRAINED_PREFIX = "__drained."  # + first rank + .json: a node's files of the step are on the remote


def drained_marker(first_rank: int) -> str:
    return f"{DRAINED_PREFIX}{first_rank:06d}.json"


COPYING_PREFIX = "__copying."  # + first rank + .json: the save whose files a resumable copy puts here


def copying_marker(first_rank: int) -> str:
    """Written into a step directory before a copy (a drain, a pre-stage) puts any file of a save
    there, naming that save: a copy resumed later trusts the files it finds only under its own."""
    return f"{COPYING_PREFIX}{first_rank:06d}.json"

REPLICA_PREFIX = "REPLICA-"


def rank_files(rank: int) -> list[str]:
    """The files the manifest index names for one saving rank, whether or not they
    exist; which of a directory's files are a set of ranks' is ``files.files_of_ranks``'s to say."""
    return [part_file(rank), shard_file(rank), owners_file(rank), refs_file(rank), pack_file(rank)]


def replica_marker(first_rank: int) -> str:
    return f"{REPLICA_PREFIX}{first_rank:06d}.json"


def is_replica_marker(name: str) -> bool:
    return name.startswith(REPLICA_PREFIX) and name.endswith(".json")


MEMORY_OWNER_FILE = "OWNER"  # in a memory directory: the lineage its steps belong to (tiercheck.memory)
SLOTS_DIR = "slots"  # in a memory directory: every rank's slot files (state.memory_slots)
SLOT_FILES = f"{SLOTS_DIR}/rank-*"  # a glob of them, relative to the memory directory


def slot_file(rank: int, k: int) -> str:
    """A rank's slot ``k`` in a memory directory: a save stages into it, and a memory step links it as
    the rank's pack."""
    return f"{SLOTS_DIR}/rank-{rank:06d}.{k}"


MEMORY_RECORD_FILE = "MEMORY.json"  # at a local directory's root: where its memory tier lives (format.memory_steps)


def memory_dir(path: str | os.PathLike[str], local: str | os.PathLike[str]) -> Path:
    """The memory tier's directory of the node-local directory ``local`` under ``MemoryOptions.path``:
    named by a hash of the directory's real path (symbolic links resolved: a job that opens it
    through a link finds the same memory tier), so a run restarted on the same node with the same
    directory finds it, and the CLI finds it from the directory's name. The directory records it
    too (``MEMORY_RECORD_FILE``), for a job started without the memory tier."""
    digest = hashlib.sha256(os.path.realpath(local).encode()).hexdigest()[:16]
    return Path(os.fspath(path)) / digest
