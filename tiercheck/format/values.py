"""The values a manifest file holds, checked as they are read: array paths, counts, offsets, checksums
and chunk grids. A manifest may come from shared storage: each value is bounded here before anything is
sized or opened from it, and a bad one raises ``ValueError`` (the parsers turn it into a
``CorruptCheckpointError`` naming the file) or, for a path, ``UnsafeCheckpointError``."""


from __future__ import annotations

import math
import re
from typing import Any

from tiercheck.errors import CorruptCheckpointError, UnsafeCheckpointError
from tiercheck.format.layout import MAX_CHUNKS, grid_size
from tiercheck.format.paths import COMMIT_FILE, MANIFEST_FILE, PARTS_DIR

JSON = Any  # a value json.loads can return

# One path component of an array: no separators, no "."/".." and nothing zarr reserves.
_COMPONENT = re.compile(r"^[A-Za-z0-9._%~-]+$")


_SAFE_PATHS: set[str] = set()  # paths that passed check_array_path, which depends on the string alone
_SAFE_PATHS_MAX = 1 << 17  # bounded: past this many, paths are checked afresh each time


def check_array_path(path: object, *, where: str) -> str:
    """Return ``path`` if it is a safe relative array path inside a step; raise otherwise.

    A restore meets each path a dozen times (the parts, the shards, the owners files, the reads)
    and every save flattens the same paths again: a path that passed once is not checked again
    (22k checks took 0.04-0.07 s of a 1,836-array restore)."""
    if type(path) is str and path in _SAFE_PATHS:
        return path
    if not isinstance(path, str) or not path:
        raise CorruptCheckpointError(f"{where}: array path must be a non-empty string, got {path!r}")
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", "..") or not _COMPONENT.match(part) or part.startswith("__"):
            raise UnsafeCheckpointError(
                f"{where}: array path {path!r} is not a plain relative path inside the step "
                "(absolute paths, '..', empty or unusual components are refused)"
            )
    if parts[0] in (MANIFEST_FILE, COMMIT_FILE, PARTS_DIR, "zarr.json") or "zarr.json" in parts or "c" in parts:
        raise UnsafeCheckpointError(f"{where}: array path {path!r} collides with a reserved name")
    if type(path) is str and len(_SAFE_PATHS) < _SAFE_PATHS_MAX:
        _SAFE_PATHS.add(path)
    return path


MAX_NDIM = 64
MAX_ELEMENTS = 1 << 48


def check_grid(shape: tuple[int, ...], chunk: tuple[int, ...], *, where: str) -> None:
    """A shape and chunk shape tiercheck could have written: bounded before any buffer or chunk
    grid is sized from them."""
    if len(shape) > MAX_NDIM or math.prod(shape) > MAX_ELEMENTS:
        raise CorruptCheckpointError(
            f"{where}: shape {str(list(shape))[:200]} is beyond any tensor tiercheck saves "
            f"(at most {MAX_NDIM} dimensions and 2**48 elements)"
        )
    if 0 in chunk:
        raise CorruptCheckpointError(f"{where}: chunk extents must be positive")
    if any(c > max(d, 1) for c, d in zip(chunk, shape, strict=True)):
        # tiercheck never writes one; readers size a chunk's buffer from it before reading
        raise CorruptCheckpointError(f"{where}: chunk {list(chunk)} is larger than the array {list(shape)}")
    grid = grid_size(shape, chunk)
    if grid > MAX_CHUNKS:
        raise CorruptCheckpointError(
            f"{where}: chunk {list(chunk)} cuts the array {list(shape)[:8]} into "
            f"{grid:,} chunks, more than tiercheck ever writes ({MAX_CHUNKS:,})"
        )


MAX_WORLD_SIZE = 1 << 20  # saving ranks; sets and lists of ranks are sized from it


def world_size_of(v: object) -> int:
    n = nonneg_int(v)
    if n > MAX_WORLD_SIZE:
        raise ValueError(f"world_size {n} is beyond any job ({MAX_WORLD_SIZE} ranks)")
    return n


def nonneg_int(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"expected a non-negative integer, got {v!r}")
    return v


MAX_FILE_BYTES = 1 << 62  # beyond any file a filesystem or object store holds, within an off_t


def file_offset(v: object) -> int:
    """A place or size in a pack: 2**70 would reach os.lseek, which raises a raw ValueError."""
    n = nonneg_int(v)
    if n >= MAX_FILE_BYTES:
        raise ValueError(f"expected a file offset or size below 2**62, got {n}")
    return n


def crc32c_value(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**32:
        raise ValueError(f"expected a CRC32C (0 to 2**32-1), got {v!r}")
    return v


def positive_int(v: object) -> int:
    n = nonneg_int(v)
    if n == 0:
        raise ValueError("expected a positive integer, got 0")
    return n


MAX_TREE_DEPTH = 100
"""How deeply a state tree may nest (dicts, lists, tuples, counted as ``state.flatten.decode``
counts them from each top-level entry): far beyond any training state, and well within what the
readers that walk a tree (decode, ``tiercheck inspect``) can recurse through."""


def check_tree_depth(tree: JSON, *, where: str) -> None:
    """Refuse a state tree nested deeper than ``MAX_TREE_DEPTH``, walked without recursion, before
    any reader recurses through it (JSON itself parses 600 levels; a walk of them raised a raw
    RecursionError). The tree's root is the state's mapping: its entries are level 0."""
    stack: list[tuple[JSON, int]] = [(tree, -1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            raise CorruptCheckpointError(f"{where}: the state tree is nested deeper than {MAX_TREE_DEPTH} levels")
        stack.extend((child, depth + 1) for child in _tree_children(node))


def _tree_children(node: JSON) -> list[JSON]:
    """The nodes one level below ``node``, as decoding meets them: a list's items, a plain dict's
    values, the items of a tagged tuple or size, the keys and values of a tagged dict."""
    if isinstance(node, list):
        return node
    if not isinstance(node, dict):
        return []
    if len(node) == 1:
        ((tag, val),) = node.items()
        if isinstance(tag, str) and tag.startswith("$"):
            if tag == "$dict" and isinstance(val, list):
                return [x for pair in val if isinstance(pair, list) for x in pair]
            if tag in ("$tuple", "$size") and isinstance(val, list):
                return val
            return []
    return list(node.values())
