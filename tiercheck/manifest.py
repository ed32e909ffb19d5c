"""The manifest of one step: what was saved, where, and with which checksums. JSON, never pickle.

A manifest is untrusted input when read back (it may come from shared storage), so parsing
validates types and refuses any array path that could leave the step's directory.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import CorruptCheckpointError, UnsafeCheckpointError

FORMAT_NAME = "tiercheck"
FORMAT_VERSION = 2  # 2: per-rank trees and chunk owners (distributed saves); 1 is still read
MANIFEST_FILE = "manifest.json"
COMMIT_FILE = "COMMIT"

JSON = Any  # a value json.loads can return

# One path component of an array: no separators, no "."/".." and nothing zarr reserves.
_COMPONENT = re.compile(r"^[A-Za-z0-9._%~-]+$")


def check_array_path(path: object, *, where: str) -> str:
    """Return ``path`` if it is a safe relative array path inside a step; raise otherwise."""
    if not isinstance(path, str) or not path:
        raise CorruptCheckpointError(f"{where}: array path must be a non-empty string, got {path!r}")
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", "..") or not _COMPONENT.match(part) or part.startswith("__"):
            raise UnsafeCheckpointError(
                f"{where}: array path {path!r} is not a plain relative path inside the step "
                "(absolute paths, '..', empty or unusual components are refused)"
            )
    if parts[0] in (MANIFEST_FILE, COMMIT_FILE, "zarr.json") or "zarr.json" in parts or "c" in parts:
        raise UnsafeCheckpointError(f"{where}: array path {path!r} collides with a reserved name")
    return path


@dataclass(frozen=True, kw_only=True, slots=True)
class ArrayRecord:
    """One stored array: a tensor (or numpy array) of the state, chunked as zarr v3 wants."""

    path: str  # relative to the step directory, "/"-separated
    dtype: str  # the real dtype, e.g. "bfloat16" (the zarr array may store its bits as uint16)
    kind: str  # "tensor" or "ndarray": what load() gives back
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    checksums: dict[str, int] = field(default_factory=dict)  # chunk key -> crc32c of its data
    owners: dict[str, int] = field(default_factory=dict)  # chunk key -> saving rank that wrote it (default 0)

    def to_json(self) -> dict[str, JSON]:
        return {
            "dtype": self.dtype,
            "kind": self.kind,
            "shape": list(self.shape),
            "chunks": list(self.chunks),
            "crc32c": self.checksums,
            "owner": self.owners,
        }

    def owner(self, key: str) -> int:
        return self.owners.get(key, 0)

    @classmethod
    def from_json(cls, path: str, doc: JSON, *, where: str) -> ArrayRecord:
        here = f"{where}: array {path!r}"
        check_array_path(path, where=where)
        try:
            shape = tuple(_nonneg_int(v) for v in doc["shape"])
            chunk = tuple(_nonneg_int(v) for v in doc["chunks"])
            dtype, kind = doc["dtype"], doc["kind"]
            checksums = {str(k): int(v) for k, v in doc["crc32c"].items()}
            owners = {str(k): _nonneg_int(v) for k, v in (doc.get("owner") or {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptCheckpointError(f"{here}: malformed record ({e!r})") from None
        if not isinstance(dtype, str) or kind not in ("tensor", "ndarray") or len(shape) != len(chunk):
            raise CorruptCheckpointError(f"{here}: malformed record")
        if any(c == 0 for c in chunk):
            raise CorruptCheckpointError(f"{here}: chunk extents must be positive")
        return cls(path=path, dtype=dtype, kind=kind, shape=shape, chunks=chunk, checksums=checksums, owners=owners)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _nonneg_int(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"expected a non-negative integer, got {v!r}")
    return v


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """Everything needed to read one step back; serialised as ``manifest.json``."""

    step: int
    library_version: str
    created_unix: float
    trees: list[JSON]  # encoded states (nested JSON whose leaves refer to arrays, see flatten.py); no repeats
    tree_of_rank: list[int]  # saving rank -> index into trees
    arrays: dict[str, ArrayRecord]
    metadata: JSON = None  # the caller's own JSON metadata
    topology: dict[str, JSON] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "library_version": self.library_version,
            "step": self.step,
            "created_unix": self.created_unix,
            "topology": self.topology,
            "metadata": self.metadata,
            "arrays": {path: rec.to_json() for path, rec in self.arrays.items()},
            "trees": self.trees,
            "tree_of_rank": self.tree_of_rank,
        }
        return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()

    @property
    def world_size(self) -> int:
        """Number of ranks that saved this step."""
        return len(self.tree_of_rank)

    def tree(self, rank: int = 0) -> JSON:
        """The encoded state saving ``rank`` held."""
        return self.trees[self.tree_of_rank[rank]]

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str) -> Manifest:
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"{where}: manifest is not valid JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(f"{where}: not a tiercheck manifest")
        version = doc.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"{where}: manifest format version {version!r} is newer than this tiercheck "
                f"understands ({FORMAT_VERSION}); upgrade tiercheck"
            )
        try:
            arrays_doc = doc["arrays"]
            if not isinstance(arrays_doc, dict):
                raise TypeError("arrays must be an object")
            arrays = {path: ArrayRecord.from_json(path, rec, where=where) for path, rec in arrays_doc.items()}
            trees = [doc["tree"]] if version < 2 else list(doc["trees"])
            tree_of_rank = [0] if version < 2 else [int(i) for i in doc["tree_of_rank"]]
            if not tree_of_rank or any(not 0 <= i < len(trees) for i in tree_of_rank):
                raise ValueError("tree_of_rank must map every saving rank to one of the trees")
            return cls(
                step=_nonneg_int(doc["step"]),
                library_version=str(doc["library_version"]),
                created_unix=float(doc["created_unix"]),
                trees=trees,
                tree_of_rank=tree_of_rank,
                arrays=arrays,
                metadata=doc.get("metadata"),
                topology=dict(doc.get("topology") or {}),
                format_version=version,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{where}: malformed manifest ({e!r})") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class CommitMarker:
    """Written last; its presence makes a step visible. It pins the manifest by checksum."""

    step: int
    manifest_crc32c: int
    manifest_size: int
    ranks: tuple[int, ...] = (0,)  # saving ranks whose chunk files are in this directory (its node's)
    world_size: int = 1  # saving ranks in all; the step is whole where the directories hold them all

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT_NAME,
                "step": self.step,
                "manifest_crc32c": self.manifest_crc32c,
                "manifest_size": self.manifest_size,
                "ranks": list(self.ranks),
                "world_size": self.world_size,
            }
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray, *, where: str) -> CommitMarker:
        try:
            doc = json.loads(data)
            return cls(
                step=_nonneg_int(doc["step"]),
                manifest_crc32c=_nonneg_int(doc["manifest_crc32c"]),
                manifest_size=_nonneg_int(doc["manifest_size"]),
                ranks=tuple(_nonneg_int(r) for r in doc.get("ranks", [0])),
                world_size=_nonneg_int(doc.get("world_size", 1)),
            )
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"{where}: commit marker is damaged ({e!r})") from None
