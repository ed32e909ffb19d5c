"""The manifest of one step: what was saved, where, and with which checksums. JSON, never pickle.

A manifest is untrusted input when read back (it may come from shared storage), so parsing
validates types and refuses any array path that could leave the step's directory.
"""


from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from tiercheck.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError
from tiercheck.format.layout import MAX_CHUNKS, grid_size
from tiercheck.format.metadata import decode as decode_metadata
from tiercheck.format.paths import (
    COMMIT_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FILE,
    PACKS_DIR,
    PARTS_DIR,
    REFS_DIR,
    WHOLE_FORMAT,
    chunk_location,
)

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

    def location(self, key: str) -> tuple[str, int | None]:
        """Where chunk ``key`` is stored, relative to its step: the owner's pack file and the
        chunk's offset there (format 4), or the chunk's own file (``None``: all of it)."""
        return chunk_location(self.path, key, self.owner(key), self.offsets.get(key))

    @classmethod
    def from_json(cls, path: str, doc: JSON, *, where: str, checksums: bool = True, owners: bool = True) -> ArrayRecord:
        """A record from its JSON, every field checked; without the chunks' checksums (or owners)
        where ``checksums`` (``owners``) is false. A restore parses one per array of the state
        (tens of thousands for some), so the checks are plain loops and messages are made only
        for a record that fails them."""
        check_array_path(path, where=where)
        try:
            shape = tuple([_nonneg_int(v) for v in doc["shape"]])
            chunk = tuple([_nonneg_int(v) for v in doc["chunks"]])
            dtype, kind = doc["dtype"], doc["kind"]
            crcs = {str(k): _crc(v) for k, v in doc["crc32c"].items()} if checksums else {}
            writers = {str(k): _nonneg_int(v) for k, v in (doc.get("owner") or {}).items()} if owners else {}
            offsets = {str(k): _file_offset(v) for k, v in (doc.get("offset") or {}).items()} if checksums else {}
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise CorruptCheckpointError(f"{where}: array {path!r}: malformed record ({e!r})") from None
        if not isinstance(dtype, str) or kind not in ("tensor", "ndarray") or len(shape) != len(chunk):
            raise CorruptCheckpointError(f"{where}: array {path!r}: malformed record")
        _check_grid(shape, chunk, where=f"{where}: array {path!r}")
        return cls(
            path=path, dtype=dtype, kind=kind, shape=shape, chunks=chunk,
            checksums=crcs, owners=writers, offsets=offsets,
        )  # fmt: skip

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


MAX_NDIM = 64
MAX_ELEMENTS = 1 << 48


def _check_grid(shape: tuple[int, ...], chunk: tuple[int, ...], *, where: str) -> None:
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


def _world_size(v: object) -> int:
    n = _nonneg_int(v)
    if n > MAX_WORLD_SIZE:
        raise ValueError(f"world_size {n} is beyond any job ({MAX_WORLD_SIZE} ranks)")
    return n


def _nonneg_int(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"expected a non-negative integer, got {v!r}")
    return v


MAX_FILE_BYTES = 1 << 62  # beyond any file a filesystem or object store holds, within an off_t


def _file_offset(v: object) -> int:
    """A place or size in a pack: 2**70 would reach os.lseek, which raises a raw ValueError."""
    n = _nonneg_int(v)
    if n >= MAX_FILE_BYTES:
        raise ValueError(f"expected a file offset or size below 2**62, got {n}")
    return n


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """Everything needed to read one step back; serialised as ``manifest.json``."""

    step: int
    library_version: str
    created_unix: float
    trees: list[JSON]  # encoded states (nested JSON whose leaves refer to arrays, see flatten.py); no repeats
    tree_of_rank: list[int]  # saving rank -> index into trees (-1: that rank's part was not read)
    arrays: dict[str, ArrayRecord]
    metadata: JSON = None  # the caller's own JSON metadata
    topology: dict[str, JSON] = field(default_factory=dict)
    format_version: int = WHOLE_FORMAT  # as read; 3 for one assembled from its parts
    save_id: str | None = None  # format 5: the save that wrote the step and every file of it

    def to_bytes(self) -> bytes:
        """The whole manifest as one document: format 2, which every tiercheck since reads."""
        doc = {
            "format": FORMAT_NAME,
            "format_version": WHOLE_FORMAT,
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
        i = self.tree_of_rank[rank]
        if i < 0:
            raise CheckpointNotFoundError(f"step {self.step}: the manifest part of saving rank {rank} is not here")
        return self.trees[i]

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str) -> Manifest:
        """A whole manifest in one document (formats 1 and 2; see ``format.steps.read_manifest``)."""
        doc = parse_manifest_doc(data, where=where)
        version = doc["format_version"]
        if version > WHOLE_FORMAT:
            raise CorruptCheckpointError(f"{where}: a format {version} manifest is in parts, not in one document")
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
                metadata=decode_metadata(doc.get("metadata"), where=where),
                topology=dict(doc.get("topology") or {}),
                format_version=version,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{where}: malformed manifest ({e!r})") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class ManifestIndex:
    """Format 3's ``manifest.json``: what the step is, not what is in it (that is in the parts)."""

    step: int
    library_version: str
    created_unix: float
    world_size: int
    nodes: int
    metadata: JSON = None
    format_version: int = FORMAT_VERSION
    save_id: str | None = None  # format 5: the save that wrote the step (None before)

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "library_version": self.library_version,
            "step": self.step,
            **({"save_id": self.save_id} if self.save_id is not None else {}),
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
                step=_nonneg_int(doc["step"]),
                library_version=str(doc["library_version"]),
                created_unix=float(doc["created_unix"]),
                world_size=_positive_int(_world_size(doc["world_size"])),
                nodes=_nonneg_int((doc.get("topology") or {}).get("nodes", 1)),
                metadata=decode_metadata(doc.get("metadata"), where=where),
                format_version=_nonneg_int(doc["format_version"]),
                save_id=save_id_of(doc, where=where),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptCheckpointError(f"{where}: malformed manifest ({e!r})") from None


def parse_manifest_doc(data: bytes | bytearray, *, where: str, step: int | None = None) -> dict[str, JSON]:
    """``manifest.json`` parsed and its format checked (any version this library reads); with
    ``step``, it must describe that step (the directory it was read from): an index copied in from
    another step would otherwise pass for this one."""
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
            f"{where}: manifest format version {version} is newer than this tiercheck understands "
            f"({FORMAT_VERSION}); upgrade tiercheck"
        )
    if step is not None and doc.get("step") != step:
        raise CorruptCheckpointError(f"{where}: {MANIFEST_FILE} describes step {doc.get('step')!r}, not this step")
    return doc


SAVE_ID_FORMAT = 5  # the first format whose every file names the save that wrote it
REFS_STAMP = "tiercheck"  # the key of a reference map naming its step and save (kerchunk readers pass it by)
_SAVE_ID = re.compile(r"[0-9a-f]{32}")


def new_save_id(run: str, step: int, attempt: int) -> str:
    """The id of one save: the same on every rank of the job (``run`` is agreed once, when the
    job's Checkpointer starts), unique to this run, step and attempt, and no two runs share a
    ``run``. A step saved again (after a rollback, or by a later job) is another save."""
    return hashlib.blake2b(f"{run}/{step}/{attempt}".encode(), digest_size=16).hexdigest()


def save_id_of(doc: dict[str, JSON], *, where: str) -> str | None:
    """The save id ``manifest.json`` (or a commit marker) states: required from format 5, None before."""
    version = doc.get("format_version", SAVE_ID_FORMAT)
    got = doc.get("save_id")
    if got is None and isinstance(version, int) and version < SAVE_ID_FORMAT:
        return None
    if not isinstance(got, str) or not _SAVE_ID.fullmatch(got):
        raise CorruptCheckpointError(f"{where}: save_id {str(got)[:80]!r} is not a save id (32 hex digits)")
    return got


def check_save(doc: JSON, save: str | None, *, where: str) -> None:
    """A file of a step (a rank part, arrays or owners file, a reference map) must have been
    written by the step's save ``save`` (``None``: a format before 5, whose files name none). A
    file that names another save is another step's, another run's or another trajectory's: its
    bits are consistent and wrong."""
    if save is None:
        return
    got = doc.get("save_id") if isinstance(doc, dict) else None
    if got != save:
        raise CorruptCheckpointError(
            f"{where}: written by save {str(got)[:40]!r}, not by this step's save {save!r} "
            "(a file of another step, run or trajectory)"
            if got is not None
            else f"{where}: names no save, and this step's files name theirs ({save!r}): "
            "a file of another step or format"
        )


def check_file_save(doc: bytes, save: str | None, *, where: str, key: str | None = None) -> None:
    """A manifest file's document (or a reference map's, whose save is under ``key``) must name
    the step's save ``save`` (none before format 5): ``check_save`` on the bytes as stored."""
    if save is None:
        return
    try:
        parsed = json.loads(doc)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e})") from None
    if key is not None:
        parsed = parsed.get(key) if isinstance(parsed, dict) else None
    check_save(parsed, save, where=where)


@dataclass(frozen=True, slots=True)
class RankPart:
    """A saving rank's part of a format-3/4 manifest: its state tree, and the checksum (and in
    format 4 the offset in its pack) of every chunk it wrote, ``{array path: {chunk key: n}}``."""

    tree: JSON
    checksums: dict[str, dict[str, int]]
    offsets: dict[str, dict[str, int]]  # empty in format 3: each chunk is its own file
    chunk_bytes: dict[str, int]  # format 4: each array's (padded) chunk size, to check a pack alone
    save_id: str | None = None  # format 5: the save that wrote it (and its pack, via the checksums)

    def to_bytes(self) -> bytes:
        doc = {
            **_save_field(self.save_id),
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


def _save_field(save: str | None) -> dict[str, str]:
    return {} if save is None else {"save_id": save}


def parse_rank_part(doc: bytes, *, where: str, save: str | None) -> RankPart:
    """A rank part, which must have been written by the step's save ``save`` (see ``check_save``)."""
    try:
        part = json.loads(doc)
        check_save(part, save, where=where)
        checksums = {
            check_array_path(p, where=where): {str(k): _crc(v) for k, v in crcs.items()}
            for p, crcs in part["crc32c"].items()
        }
        offsets = {
            check_array_path(p, where=where): {str(k): _file_offset(v) for k, v in by_key.items()}
            for p, by_key in (part.get("offset") or {}).items()
        }
        chunk_bytes = {str(p): _file_offset(n) for p, n in (part.get("nbytes") or {}).items()}
        if offsets and (
            set(offsets) != set(checksums)
            or any(set(offsets[p]) != set(crcs) for p, crcs in checksums.items())
            or not set(offsets) <= set(chunk_bytes)
        ):
            raise ValueError("the chunks with offsets and sizes are not the chunks with checksums")
        return RankPart(part["tree"], checksums, offsets, chunk_bytes, save)
    except CorruptCheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: malformed manifest part ({e!r})") from None


def shard_bytes(records: dict[str, ArrayRecord], save: str | None) -> bytes:
    """The arrays file of a coordinator: each array's dtype, kind, shape and chunks."""
    drop = ("crc32c", "owner", "offset")
    arrays = {path: {k: v for k, v in rec.to_json().items() if k not in drop} for path, rec in records.items()}
    return json.dumps({**_save_field(save), "arrays": arrays}, allow_nan=False, separators=(",", ":")).encode()


def owners_bytes(records: dict[str, ArrayRecord], save: str | None) -> bytes:
    """The owners file of a coordinator: ``{"owner": {array path: {chunk key: writing rank}}}``."""
    doc = {**_save_field(save), "owner": {path: rec.owners for path, rec in records.items()}}
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()


def parse_owners(
    doc: bytes, *, where: str, save: str | None, only: set[str] | None = None
) -> dict[str, dict[str, int]]:
    try:
        whole = json.loads(doc)
        check_save(whole, save, where=where)
        owners = whole["owner"]
        return {
            check_array_path(path, where=where): {str(k): _nonneg_int(v) for k, v in by_key.items()}
            for path, by_key in owners.items()
            if only is None or path in only
        }
    except CorruptCheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: malformed owners file ({e!r})") from None


def parse_shard(
    doc: bytes, *, where: str, save: str | None, only: set[str] | None = None, owners: bool = True
) -> dict[str, ArrayRecord]:
    """The array records (without checksums) of a coordinator's shard of the manifest: all of
    them, or those in ``only``; without the chunk owners unless ``owners`` (a restoring rank
    matching its state needs shapes and dtypes; only the rank planning an array's reads needs who
    wrote each chunk)."""
    try:
        whole = json.loads(doc)
        check_save(whole, save, where=where)
        arrays = whole["arrays"]
        if not isinstance(arrays, dict):
            raise TypeError("arrays must be an object")
        return {
            path: ArrayRecord.from_json(path, rec, where=where, checksums=False, owners=owners)
            for path, rec in arrays.items()
            if only is None or path in only
        }
    except CorruptCheckpointError:
        raise
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: malformed manifest shard ({e!r})") from None


def _crc(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**32:
        raise ValueError(f"expected a CRC32C (0 to 2**32-1), got {v!r}")
    return v


def _positive_int(v: object) -> int:
    n = _nonneg_int(v)
    if n == 0:
        raise ValueError("expected a positive integer, got 0")
    return n


@dataclass(frozen=True, kw_only=True, slots=True)
class CommitMarker:
    """Written last; its presence makes a step visible. It pins the manifest by checksum."""

    step: int
    manifest_crc32c: int
    manifest_size: int
    ranks: tuple[int, ...] = (0,)  # saving ranks whose chunk files are in this directory (its node's)
    world_size: int = 1  # saving ranks in all; the step is whole where the directories hold them all
    save_id: str | None = None  # format 5: the manifest's; two tiers hold the same save where these agree

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT_NAME,
                "step": self.step,
                **_save_field(self.save_id),
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
                world_size=_world_size(doc.get("world_size", 1)),
                save_id=None if doc.get("save_id") is None else save_id_of(doc, where=where),
            )
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as e:
            raise CorruptCheckpointError(f"{where}: commit marker is damaged ({e!r})") from None
