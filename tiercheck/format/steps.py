"""Step directories on a tier: what counts as committed, and reading a committed step's manifest
back. How a step becomes committed, and stops being, is ``format.commit``'s: a step is committed
exactly when ``step-NNNNNNNN/COMMIT`` exists under the step's one name (``paths.step_dir``; any
other spelling of the number is no step).
"""


from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field

from tiercheck.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError
from tiercheck.format.codec import checksum, unseal
from tiercheck.format.extents import check_pack, check_sizes
from tiercheck.format.manifest import (
    JSON,
    ArrayRecord,
    CommitMarker,
    Manifest,
    ManifestIndex,
    RankPart,
    parse_manifest_doc,
    parse_rank_part,
)
from tiercheck.format.paths import (
    COMMIT_FILE,
    MANIFEST_FILE,
    PARTS_DIR,
    STEP_PREFIX,
    owners_file,
    part_file,
    shard_file,
    step_dir,
    step_of,
)
from tiercheck.format.saveid import check_file_save, save_id_of
from tiercheck.format.shards import parse_owners, parse_shard
from tiercheck.tiers.base import Tier

log = logging.getLogger("tiercheck")


@dataclass(frozen=True, slots=True)
class StepListing:
    committed: list[int]  # ascending
    partial: list[int]  # directories without a commit marker (in flight, or left by a crash)
    unreadable: dict[int, str] = field(default_factory=dict)  # step directories that cannot be read: why
    ignored: list[str] = field(default_factory=list)  # names spelled like a step that are none (not step_dir(n))


def list_steps(tier: Tier) -> StepListing:
    """The steps on a tier, by their directories' names as ``step_of`` reads them. A name spelled
    like a step but not ``step_dir(n)`` (``step-000000002`` beside ``step-00000002``) is ignored
    aloud: counted neither committed nor partial, so nothing restores, keeps or deletes it."""
    committed: list[int] = []
    partial: list[int] = []
    unreadable: dict[int, str] = {}
    ignored: list[str] = []
    for name in tier.list_dir(""):
        step = step_of(name)
        if step is None:
            if name.startswith(STEP_PREFIX):
                ignored.append(name)
            continue
        try:
            done = tier.exists(f"{name}/{COMMIT_FILE}")
        except OSError as e:
            # A step directory that is a symbolic link (UnsafeCheckpointError), or one that cannot
            # be read: neither committed (restore passes it by) nor partial (never removed).
            why = str(e) if isinstance(e, UnsafeCheckpointError) else f"cannot read it ({e.strerror or e})"
            log.warning("ignoring %s in %s: %s", name, tier.url, why)
            unreadable[step] = why
            continue
        (committed if done else partial).append(step)
    if ignored:
        # An example from the names found: torchtitan's and DCP's own step-N beside tiercheck's step-0000000N.
        digits = "".join(c for c in ignored[0][len(STEP_PREFIX) :] if c.isdigit())
        n = int(digits[:18]) if digits else 2
        log.warning(
            "ignoring %s in %s: not tiercheck's name for a step (tiercheck's step %d is %s), so never counted "
            "as a step nor deleted",
            ", ".join(ignored),
            tier.url,
            n,
            step_dir(n),
        )
    return StepListing(sorted(committed), sorted(partial), dict(sorted(unreadable.items())), ignored)


MAX_MANIFEST_BYTES = 256 << 20  # a manifest file, part or marker; 16,384 ranks commit 2.75 MiB in all


def read_small(tier: Tier, path: str, *, where: str) -> bytes:
    """A manifest file, part or commit marker, read whole, refused past ``MAX_MANIFEST_BYTES``
    without reading (or allocating) more: a hostile sparse file of many GiB costs nothing.
    Raises ``FileNotFoundError`` when it is missing; any other failure to read it (a directory
    in its place, no permission, EIO) is the step's damage."""
    try:
        data = tier.read_range(path, 0, MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CorruptCheckpointError(f"{where}: cannot read {path}: {e.strerror or e}") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{where}: {path} is larger than {MAX_MANIFEST_BYTES >> 20} MiB; no manifest is")
    return bytes(data)


def read_marker(tier: Tier, step: int) -> CommitMarker:
    d = step_dir(step)
    where = f"{tier.url}: step {step}"
    try:
        marker_bytes = read_small(tier, f"{d}/{COMMIT_FILE}", where=where)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{where} is not committed (no {d}/{COMMIT_FILE})") from None
    marker = CommitMarker.from_bytes(marker_bytes, where=where)
    if marker.step != step or not all(0 <= r < marker.world_size for r in marker.ranks):
        raise CorruptCheckpointError(f"{where}: the commit marker names step {marker.step} or ranks out of range")
    return marker


def read_index(tier: Tier, step: int) -> tuple[CommitMarker, dict[str, JSON], bytes]:
    """A committed step's commit marker and ``manifest.json`` (parsed, and as stored), checked
    against each other; a step of another format than this library's is refused here
    (``manifest.parse_manifest_doc``), before any other file of it is read."""
    d = step_dir(step)
    where = f"{tier.url}: step {step}"
    marker = read_marker(tier, step)
    try:
        data = read_small(tier, f"{d}/{MANIFEST_FILE}", where=where)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: {MANIFEST_FILE} is missing from a committed step") from None
    if len(data) != marker.manifest_size or checksum(data) != marker.manifest_crc32c:
        raise CorruptCheckpointError(
            f"{where}: {MANIFEST_FILE} is damaged (size or checksum differs from the commit marker)"
        )
    doc = parse_manifest_doc(data, where=where, step=step)
    if save_id_of(doc, where=where) != marker.save_id:
        raise CorruptCheckpointError(f"{where}: {MANIFEST_FILE} and {COMMIT_FILE} name different saves")
    saved_by = ManifestIndex.from_doc(doc, where=where).world_size
    if saved_by != marker.world_size:  # which ranks' files to look for: a reader must not guess
        raise CorruptCheckpointError(
            f"{where}: {MANIFEST_FILE} says the step was saved by {saved_by} rank(s), its commit marker "
            f"by {marker.world_size}"
        )
    return marker, doc, data


def read_manifest(tier: Tier, step: int) -> Manifest:
    """The manifest of a committed step as this tier holds it, checked against its commit marker.

    A step's manifest is in parts: each saving rank's (its tree and chunk checksums) and each
    coordinating rank's (its arrays). A node-local tier holds its own ranks' parts only, so
    what is returned describes those (the other ranks' trees are absent, see ``Manifest.tree``);
    the remote tier, or a copy of the whole step, holds all of them. A peer's replica file here
    (of a saving rank the commit marker does not list) that is damaged or names another save is
    left out with a WARNING: it never makes this node's own step unreadable (``verify`` reports it).
    """
    where = f"{tier.url}: step {step}"
    marker, doc, _ = read_index(tier, step)
    index = ManifestIndex.from_doc(doc, where=where)
    files = {}
    try:
        names = tier.list_dir(f"{step_dir(step)}/{PARTS_DIR}")
    except OSError as e:  # a file in its place, no permission
        raise CorruptCheckpointError(f"{where}: cannot list {PARTS_DIR}/: {e.strerror or e}") from None
    for name in names:
        m = _PART.match(name)
        if m and int(m.group(2)) < index.world_size:
            raw = read_small(tier, f"{step_dir(step)}/{PARTS_DIR}/{name}", where=where)
            if int(m.group(2)) not in marker.ranks:  # a peer's replica: used only if it is this save's
                here = f"{where}: {PARTS_DIR}/{name}"
                try:
                    check_file_save(unseal(raw, where=here), index.save_id, where=here)
                except CorruptCheckpointError as e:
                    log.warning("ignoring a peer's replica file: %s", e)
                    continue
            files[m.group(1), int(m.group(2))] = raw
    manifest = assemble(index, files, where=where)
    if manifest.step != step or manifest.world_size != marker.world_size:
        raise CorruptCheckpointError(f"{where}: manifest and commit marker disagree (step or world size)")
    return manifest


def rank_parts(tier: Tier, step: int, ranks: list[int], *, save: str | None) -> dict[int, RankPart]:
    """The given saving ranks' parts of a step's manifest on this tier: their trees, and
    the checksum and place of every chunk they wrote; each written by the step's save ``save``."""
    out: dict[int, RankPart] = {}
    for rank in ranks:
        path = f"{step_dir(step)}/{part_file(rank)}"
        where = f"{tier.url}: {path}"
        try:
            raw = read_small(tier, path, where=where)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where} is missing from a committed step") from None
        out[rank] = parse_rank_part(unseal(raw, where=where), where=where, save=save)
    return out


_PART = re.compile(r"^(rank|arrays|owners)-([0-9]{6,})\.json$")
_FILES = {"rank": part_file, "arrays": shard_file, "owners": owners_file}


def manifest_file(kind: str, rank: int) -> str:
    """The path, inside a step, of a manifest file: a rank part, an arrays shard, an owners file."""
    return _FILES[kind](rank)


def assemble(
    index: ManifestIndex,
    files: dict[tuple[str, int], bytes],
    *,
    where: str,
    only: set[str] | None = None,
    owners: bool = True,
    parts: dict[int, RankPart] | None = None,
) -> Manifest:
    """A step's manifest from its index and the part files at hand (``("rank"|"arrays", rank)``
    to the file's bytes as stored); with ``only``, the records of those arrays alone, and without
    their chunks' owners unless ``owners`` (see ``parse_shard``). ``parts`` holds the rank parts
    parsed so far (by saving rank): they are taken from there, and those parsed here are added
    (a restore assembles the same parts several times, and each is a state's worth of JSON)."""
    arrays: dict[str, ArrayRecord] = {}
    checksums: dict[str, dict[str, int]] = defaultdict(dict)
    offsets: dict[str, dict[str, int]] = defaultdict(dict)
    writers: dict[str, dict[str, int]] = {}
    got: dict[int, RankPart] = {}
    for (kind, rank), raw in sorted(files.items()):
        here = f"{where}: {manifest_file(kind, rank)}"
        part = parts.get(rank) if parts is not None and kind == "rank" else None
        doc = unseal(raw, where=here) if part is None else b""
        if kind == "arrays":
            arrays.update(parse_shard(doc, where=here, save=index.save_id, only=only, owners=owners))
            continue
        if kind == "owners":
            if owners:
                writers.update(parse_owners(doc, where=here, save=index.save_id, only=only))
            continue
        if part is None:
            part = parse_rank_part(doc, where=here, save=index.save_id)
            check_pack(part, rank, where=where)  # once per part: ``parts`` keeps it checked
            if parts is not None:
                parts[rank] = part
        got[rank] = part
        if arrays and owners:  # arrays files come first (sorted); records without owners keep no checksums
            for path, by_key in part.checksums.items():
                checksums[path].update(by_key)
            for path, by_key in part.offsets.items():
                offsets[path].update(by_key)
    for rank, part in got.items():  # what load and restore size their reads from: the record's chunks
        check_sizes(part, rank, arrays, where=where)
    trees: list[JSON] = []
    tree_of_rank: dict[int, int] = {}  # of the parts read only: a rank's restore holds nothing per saving rank
    seen: dict[str, int] = {}
    for rank, part in got.items():  # ranks that saved the same tree share it
        text = json.dumps(part.tree, sort_keys=True) if len(got) > 1 else ""
        if text not in seen:
            seen[text] = len(trees)
            trees.append(part.tree)
        tree_of_rank[rank] = seen[text]
    if not owners:  # as parsed: a chunk's checksum and offset are kept only with its owner
        return _manifest(index, trees, tree_of_rank, arrays)
    records = {}
    for path, rec in arrays.items():
        if path in writers:
            rec = rec.with_chunks(owners=writers[path])
        for key, owner in rec.owners.items():
            if owner >= index.world_size:
                raise CorruptCheckpointError(
                    f"{where}: array {path!r} chunk {key}: owner {owner} is not a rank of the "
                    f"{index.world_size} that saved the step"
                )
        kept = {k: v for k, v in checksums.get(path, {}).items() if k in rec.owners}
        at = {k: v for k, v in offsets.get(path, {}).items() if k in kept}
        records[path] = rec.with_chunks(checksums=dict(sorted(kept.items())), offsets=at)
    return _manifest(index, trees, tree_of_rank, records)


def _manifest(
    index: ManifestIndex, trees: list[JSON], tree_of_rank: dict[int, int], arrays: dict[str, ArrayRecord]
) -> Manifest:
    return Manifest(
        step=index.step,
        library_version=index.library_version,
        created_unix=index.created_unix,
        trees=trees,
        tree_of_rank=tree_of_rank,
        world_size=index.world_size,
        arrays=arrays,
        metadata=index.metadata,
        topology={"world_size": index.world_size, "nodes": index.nodes},
        format_version=index.format_version,
        save_id=index.save_id,
    )
