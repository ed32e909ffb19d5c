"""The manifest of one step: what was saved, where, and with which checksums. JSON, never pickle.

A manifest is untrusted input when read back (it may come from shared storage), so parsing
validates types and refuses any array path that could leave the step's directory.
"""


from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from tiercheck.errors import CheckpointNotFoundError, CorruptCheckpointError
from tiercheck.format.metadata import decode as decode_metadata
from tiercheck.format.paths import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FILE,
    PACKS_DIR,
    PARTS_DIR,
    REFS_DIR,
    chunk_location,
)
from tiercheck.format.saveid import check_save, save_field, save_id_of
from tiercheck.format.values import (
    JSON,
    check_array_path,
    check_grid,
    check_tree_depth,
    crc32c_value,
    file_offset,
    nonneg_int,
    positive_int,
    world_size_of,
)


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
    offsets: dict[str, int] = field(default_factory=dict)  # chunk key -> where it starts in its owner's pack

    def to_json(self) -> dict[str, JSON]:
        return {
            "dtype": self.dtype,
            "kind": self.kind,
            "shape": list(self.shape),
            "chunks": list(self.chunks),
            "crc32c": self.checksums,
            "owner": self.owners,
            **({"offset": self.offsets} if self.offsets else {}),
        }

    def with_chunks(
        self,
        *,
        checksums: dict[str, int] | None = None,
        owners: dict[str, int] | None = None,
        offsets: dict[str, int] | None = None,
    ) -> ArrayRecord:
        """This record with other chunk maps: a restore or a save plan makes one per array, and
        ``dataclasses.replace`` took 2.5 times as long."""
        return ArrayRecord(
            path=self.path, dtype=self.dtype, kind=self.kind, shape=self.shape, chunks=self.chunks,
            checksums=self.checksums if checksums is None else checksums,
            owners=self.owners if owners is None else owners,
            offsets=self.offsets if offsets is None else offsets,
        )  # fmt: skip

    def owner(self, key: str) -> int:
        return self.owners.get(key, 0)

    def location(self, key: str) -> tuple[str, int]:
        """Where chunk ``key`` is stored, relative to its step: the owner's pack file and the
        chunk's offset there. ``KeyError`` for a chunk this record gives no offset (it gives one
        with each checksum)."""
        return chunk_location(self.owner(key), self.offsets[key])

    @classmethod
    def from_json(cls, path: str, doc: JSON, *, where: str, checksums: bool = True, owners: bool = True) -> ArrayRecord:
        """A record from its JSON, every field checked; without the chunks' checksums (or owners)
        where ``checksums`` (``owners``) is false. A restore parses one per array of the state
        (tens of thousands for some), so the checks are plain loops and messages are made only
        for a record that fails them."""
        check_array_path(path, where=where)
        try:
            shape = tuple([nonneg_int(v) for v in doc["shape"]])
            chunk = tuple([nonneg_int(v) for v in doc["chunks"]])
            dtype, kind = doc["dtype"], doc["kind"]
            crcs = {str(k): crc32c_value(v) for k, v in doc["crc32c"].items()} if checksums else {}
            writers = {str(k): nonneg_int(v) for k, v in (doc.get("owner") or {}).items()} if owners else {}
            offsets = {str(k): file_offset(v) for k, v in (doc.get("offset") or {}).items()} if checksums else {}
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise CorruptCheckpointError(f"{where}: array {path!r}: malformed record ({e!r})") from None
        if not isinstance(dtype, str) or kind not in ("tensor", "ndarray") or len(shape) != len(chunk):
            raise CorruptCheckpointError(f"{where}: array {path!r}: malformed record")
        check_grid(shape, chunk, where=f"{where}: array {path!r}")
        return cls(
            path=path, dtype=dtype, kind=kind, shape=shape, chunks=chunk,
            checksums=crcs, owners=writers, offsets=offsets,
        )  # fmt: skip

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """Everything needed to read one step back; serialised as ``manifest.json``."""

    step: int
    library_version: str
    created_unix: float
    trees: list[JSON]  # encoded states (nested JSON whose leaves refer to arrays, see flatten.py); no repeats
    tree_of_rank: dict[int, int]  # saving rank -> index into trees, for the ranks whose part was read
    world_size: int  # ranks that saved this step
    arrays: dict[str, ArrayRecord]
    metadata: JSON = None  # the caller's own JSON metadata
    topology: dict[str, JSON] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION  # as read (``parse_manifest_doc`` accepts this library's only)
    save_id: str  # the save that wrote the step and every file of it

    def tree(self, rank: int = 0) -> JSON:
        """The encoded state saving ``rank`` held."""
        i = self.tree_of_rank.get(rank)
        if i is None:
            raise CheckpointNotFoundError(f"step {self.step}: the manifest part of saving rank {rank} is not here")
        return self.trees[i]


@dataclass(frozen=True, kw_only=True, slots=True)
class ManifestIndex:
    """``manifest.json``, the step's index: what the step is, not what is in it (that is in the parts)."""

    step: int
    library_version: str
    created_unix: float
    world_size: int
    nodes: int
    metadata: JSON = None
    format_version: int = FORMAT_VERSION
    save_id: str  # the save that wrote the step

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "library_version": self.library_version,
            "step": self.step,
            "save_id": self.save_id,
            "created_unix": self.created_unix,
            "world_size": self.world_size,
            "topology": {"world_size": self.world_size, "nodes": self.nodes},
            "metadata": self.metadata,
            "parts": {
                "ranks": f"{PARTS_DIR}/rank-{{rank:06d}}.json",
                "arrays": f"{PARTS_DIR}/arrays-{{rank:06d}}.json",
                "owners": f"{PARTS_DIR}/owners-{{rank:06d}}.json",
                "arrays_of": "zlib.crc32(path) % world_size",
                "packs": f"{PACKS_DIR}/rank-{{rank:06d}}.bin",
                "refs": f"{REFS_DIR}/rank-{{rank:06d}}.json",
            },
        }
        return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()

    @classmethod
    def from_doc(cls, doc: dict[str, JSON], *, where: str) -> ManifestIndex:
        try:
            return cls(
                step=nonneg_int(doc["step"]),
                library_version=str(doc["library_version"]),
                created_unix=float(doc["created_unix"]),
                world_size=positive_int(world_size_of(doc["world_size"])),
                nodes=nonneg_int((doc.get("topology") or {}).get("nodes", 1)),
                metadata=decode_metadata(doc.get("metadata"), where=where),
                format_version=nonneg_int(doc["format_version"]),
                save_id=save_id_of(doc, where=where),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptCheckpointError(f"{where}: malformed manifest ({e!r})") from None


def parse_manifest_doc(data: bytes | bytearray, *, where: str, step: int | None = None) -> dict[str, JSON]:
    """``manifest.json`` parsed and its format checked: this library reads its own format
    (``FORMAT_VERSION``) only, and refuses a step of another, older or newer, here, where every
    reader of a step (restore, load, verify, a copy, a drain, retention) parses its index first.
    With ``step``, it must describe that step (the directory it was read from): an index copied in
    from another step would otherwise pass for this one."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: manifest is not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not a tiercheck manifest")
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CorruptCheckpointError(f"{where}: manifest format version {version!r} is not a format version")
    if version > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where}: {MANIFEST_FILE}: manifest format version {version} is newer than this tiercheck understands "
            f"({FORMAT_VERSION}); upgrade tiercheck"
        )
    if version < FORMAT_VERSION:
        written = doc.get("library_version")
        by = f"tiercheck {written}" if isinstance(written, str) else "an older tiercheck"
        raise CorruptCheckpointError(
            f"{where}: {MANIFEST_FILE}: manifest format version {version} is older than this tiercheck reads "
            f"({FORMAT_VERSION} only; the step was written by {by}): restore it with the tiercheck that wrote it "
            "and save it again, or delete the step"
        )
    if step is not None and doc.get("step") != step:
        raise CorruptCheckpointError(f"{where}: {MANIFEST_FILE} describes step {doc.get('step')!r}, not this step")
    return doc


@dataclass(frozen=True, slots=True)
class RankPart:
    """A saving rank's part of a step's manifest: its state tree, and the checksum and the offset in
    its pack of every chunk it wrote, ``{array path: {chunk key: n}}``."""

    tree: JSON
    checksums: dict[str, dict[str, int]]
    offsets: dict[str, dict[str, int]]
    chunk_bytes: dict[str, int]  # each array's (padded) chunk size, to check a pack alone
    save_id: str | None = None  # the save that wrote it (and its pack, via the checksums)

    def to_bytes(self) -> bytes:
        doc = {
            **save_field(self.save_id),
            "tree": self.tree,
            "crc32c": self.checksums,
            "offset": self.offsets,
            "nbytes": self.chunk_bytes,
        }
        return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()

    def spans(self) -> list[tuple[int, int, str, str, int]]:
        """The chunks in this rank's pack in file order: ``(offset, data bytes, array path, chunk
        key, crc32c)``."""
        return sorted(
            (offset, self.chunk_bytes[path], path, key, self.checksums[path][key])
            for path, by_key in self.offsets.items()
            for key, offset in by_key.items()
        )


def parse_rank_part(doc: bytes, *, where: str, save: str | None) -> RankPart:
    """A rank part, which must have been written by the step's save ``save`` (see ``check_save``)."""
    try:
        part = json.loads(doc)
        check_save(part, save, where=where)
        checksums = {
            check_array_path(p, where=where): {str(k): crc32c_value(v) for k, v in crcs.items()}
            for p, crcs in part["crc32c"].items()
        }
        offsets = {
            check_array_path(p, where=where): {str(k): file_offset(v) for k, v in by_key.items()}
            for p, by_key in (part.get("offset") or {}).items()
        }
        chunk_bytes = {str(p): file_offset(n) for p, n in (part.get("nbytes") or {}).items()}
        if (
            set(offsets) != set(checksums)
            or any(set(offsets[p]) != set(crcs) for p, crcs in checksums.items())
            or not set(offsets) <= set(chunk_bytes)
        ):  # every chunk is in its writer's pack, at an offset this part gives
            raise ValueError("the chunks with offsets and sizes are not the chunks with checksums")
        check_tree_depth(part["tree"], where=where)  # before any reader walks it
        return RankPart(part["tree"], checksums, offsets, chunk_bytes, save)
    except CorruptCheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: malformed manifest part ({e!r})") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class CommitMarker:
    """Written last; its presence makes a step visible. It pins the manifest by checksum."""

    step: int
    manifest_crc32c: int
    manifest_size: int
    ranks: tuple[int, ...] = (0,)  # saving ranks whose packs are in this directory (its node's)
    world_size: int = 1  # saving ranks in all; the step is whole where the directories hold them all
    save_id: str | None = None  # the manifest's; two tiers hold the same save where these agree
    # The lineage the save was committed for: written by the memory tier, whose directory is named
    # by no lineage file of its own (``tiercheck.memory``); absent elsewhere.
    lineage: str | None = None

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT_NAME,
                "step": self.step,
                **save_field(self.save_id),
                "manifest_crc32c": self.manifest_crc32c,
                "manifest_size": self.manifest_size,
                "ranks": list(self.ranks),
                "world_size": self.world_size,
                **({"lineage": self.lineage} if self.lineage is not None else {}),
            }
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray, *, where: str) -> CommitMarker:
        try:
            doc = json.loads(data)
            return cls(
                step=nonneg_int(doc["step"]),
                manifest_crc32c=nonneg_int(doc["manifest_crc32c"]),
                manifest_size=nonneg_int(doc["manifest_size"]),
                ranks=tuple(nonneg_int(r) for r in doc.get("ranks", [0])),
                world_size=world_size_of(doc.get("world_size", 1)),
                save_id=None if doc.get("save_id") is None else save_id_of(doc, where=where),
                lineage=_lineage_of(doc.get("lineage")),
            )
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as e:
            raise CorruptCheckpointError(f"{where}: commit marker is damaged ({e!r})") from None


_LINEAGE_ID = re.compile(r"[0-9a-f]{8,64}")


def _lineage_of(value: object) -> str | None:
    """A commit marker's ``lineage`` (absent: None): a lineage id, 8-64 lowercase hex digits."""
    if value is None:
        return None
    if not isinstance(value, str) or not _LINEAGE_ID.fullmatch(value):
        raise ValueError(f"lineage {str(value)[:80]!r} is not a lineage id")
    return value
