"""Whether a stored step is intact: every chunk its saving ranks wrote is where the manifest says,
of the right size and CRC32C, and every replica file matches its marker.

``read_stored_chunk`` is the one read-and-check of a chunk: a restore reads its chunks through it
(``restore.read.read_chunk``) and ``verify_step`` re-reads a whole step with it: a chunk is at its
offset in its writer's pack (``ArrayRecord.location``; ``verify_step`` takes it from the writer's
part), checked with ``codec.verify_chunk``/``verify_parts``. Nothing here sees a tensor.
"""


from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Literal

from tiercheck.errors import CorruptCheckpointError, TiercheckError
from tiercheck.format.codec import CHECKSUM_BYTES, chunk_nbytes, verify_chunk, verify_parts
from tiercheck.format.extents import check_extents
from tiercheck.format.layout import grid_size, is_chunk_key
from tiercheck.format.manifest import ArrayRecord, Manifest, RankPart
from tiercheck.format.paths import PACKS_DIR, pack_file, refs_file, step_dir
from tiercheck.format.refmaps import document_problems, read_map, stamp_problem
from tiercheck.format.replicas import read_replicas, replica_problems
from tiercheck.format.steps import rank_parts, read_index, read_manifest, read_marker
from tiercheck.tiers.base import Tier

#: Given the bytes a check will read, a context (a progress bar) whose value is called with
#: (bytes done, total) after each chunk.
Progress = Callable[[int], AbstractContextManager[Callable[[int, int], None]]]

CHUNK_KEY = re.compile(r"c(\.(0|[1-9][0-9]*))*", re.ASCII)

# A chunk to check: array path, chunk key, CRC32C, data bytes, and where it is (its writer's pack
# and its offset there).
_Job = tuple[str, str, int, int, str, int]


def read_stored_chunk(
    tier: Tier,
    step: int,
    file: str,
    offset: int,
    *,
    nbytes: int,
    crc: int,
    where: str,
    into: memoryview | None = None,
) -> memoryview:
    """A stored chunk's data, its size and CRC32C checked (``CorruptCheckpointError`` when not).

    ``file`` and ``offset`` say where it is (``paths.chunk_location``): at ``offset`` in a pack.
    With ``into``, the chunk's first ``len(into)`` bytes are read there (see ``Tier.read_into``)
    and a view of them is returned. A missing file raises ``FileNotFoundError`` and an unreadable one ``OSError``: each
    caller words those its own way."""
    path = f"{step_dir(step)}/{file}"
    length = nbytes + CHECKSUM_BYTES
    if into is None:
        return verify_chunk(tier.read_range(path, offset, length), expected_crc=crc, nbytes=nbytes, where=where)
    n, rest = tier.read_into(path, into, offset=offset, length=length)
    return verify_parts(into[:n], rest, expected_crc=crc, nbytes=nbytes, where=where)


def verify_step(tier: Tier, step: int, *, threads: int = 8, progress: Progress | None = None) -> list[str]:
    """Re-read every chunk of ``step`` that this tier's saving ranks wrote, and the replica files it
    keeps; returns the problems found, one line each (``"step N: ..."``), none when it is intact.

    A node's local directory holds only its ranks' chunks and its peers' replicas: those are the
    ones checked there. Every chunk's checksum is checked, its size (in the writer's part, or
    where this directory holds the array's record), and that it is where it should be (at its
    offset in its writer's pack)."""
    bad: list[str] = []
    try:
        manifest = read_manifest(tier, step)
        marker = read_marker(tier, step)
        replicas = read_replicas(tier, step)
        held = sorted(set(marker.ranks) | {r for c in replicas for r in c.ranks})
        for c in replicas:
            bad.extend(replica_problems(tier, step, c))
        jobs: list[_Job] = []
        whole = set(marker.ranks) == set(range(marker.world_size))
        if not marker.ranks:  # load refuses it: nothing here is anyone's
            bad.append(f"step {step}: the commit marker names no saving rank")
        parts = rank_parts(tier, step, held, save=manifest.save_id)  # the ranks' parts list every chunk they wrote
        for rank, part in sorted(parts.items()):
            bad.extend(check_refs(tier, step, rank, part, save=manifest.save_id, records=manifest.arrays))
        for rank, part in sorted(parts.items()):
            for path, crcs in sorted(part.checksums.items()):
                rec = manifest.arrays.get(path)
                if rec is None and whole:  # every shard is here: some record of the array must be
                    bad.append(
                        f"step {step}: array {path!r}: rank {rank} wrote chunks of it, the manifest has no record"
                    )
                # the part's size is the record's (extents.check_sizes, as read_manifest assembled them)
                size = part.chunk_bytes[path]
                for key in [k for k in crcs if not _is_key(k, rec)]:  # never a path to read
                    bad.append(f"step {step}: array {path!r}: rank {rank}'s part names {key!r}, not its chunk")
                    del crcs[key]
                for key, crc in sorted(crcs.items()):
                    jobs.append((path, key, crc, size, pack_file(rank), part.offsets[path][key]))
    except TiercheckError as e:  # its message names the tier and the step already
        return [*bad, f"step {step}: {re.sub(rf'^(.*?: )?step {step}: ', '', str(e), count=1)}"]
    if len(marker.ranks) == marker.world_size:  # every saving rank's part is here: every chunk is named
        counted = len(bad)
        for rec in manifest.arrays.values():
            if len(rec.checksums) != grid_size(rec.shape, rec.chunks):
                bad.append(
                    f"step {step}: array {rec.path!r}: the manifest names {len(rec.checksums):,} chunks "
                    f"of its {grid_size(rec.shape, rec.chunks):,}"
                )
        if len(bad) == counted:  # what load checks before it sizes a buffer: no chunk overlaps, each inside its file
            try:
                check_extents(tier, step, manifest.arrays, where=f"step {step}")
            except CorruptCheckpointError as e:
                bad.append(str(e))
            except TiercheckError:  # a file not to be read (a symbolic link): each chunk's read below says so
                pass
    total = sum(job[3] for job in jobs)

    def check(job: _Job) -> int:
        path, key, crc, nbytes, file, offset = job
        where = f"{tier.url}: step {step}: array {path!r} chunk {key}"
        try:
            try:
                read_stored_chunk(tier, step, file, offset, nbytes=nbytes, crc=crc, where=where)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{where}: {file} is missing") from None
        except TiercheckError as e:
            bad.append(f"step {step}: array {path!r} chunk {key}: {str(e).rsplit(': ', 1)[-1]}")
        except OSError as e:  # no permission, EIO, a directory in its place
            bad.append(f"step {step}: array {path!r} chunk {key}: cannot read {file}: {e.strerror or e}")
        return nbytes

    done = 0
    bar = progress(total) if progress is not None else nullcontext(_no_progress)
    with bar as report, ThreadPoolExecutor(max(1, threads)) as pool:
        for nbytes in pool.map(check, jobs):
            done += nbytes
            report(done, total)
    return sorted(bad)


def _is_key(key: str, rec: ArrayRecord | None) -> bool:
    if rec is not None:
        return is_chunk_key(key, rec.shape, rec.chunks)
    return CHUNK_KEY.fullmatch(key) is not None  # the record is on another node: the grammar at least


def check_refs(
    tier: Tier, step: int, rank: int, part: RankPart, *, save: str | None, records: Mapping[str, ArrayRecord]
) -> list[str]:
    """A saving rank's reference map (``refs/rank-N.json``, read by plain zarr; see ``refmaps``)
    against its part: written by the step's save ``save`` for this step, every entry is a
    ``zarr.json`` document or a byte range of this rank's own pack in this step, exactly the range
    of a chunk the part names (offset, and size with its CRC32C), inside the pack; no absolute
    path, no ``..``, no other file; and the documents of arrays in ``records`` agree with them.
    Returns the problems."""
    where = f"step {step}: {refs_file(rank)}"
    d = step_dir(step)
    try:
        doc = read_map(tier, step, rank, where=where)
    except CorruptCheckpointError as e:
        return [str(e)]
    if doc is None:
        return [f"{where} is missing"] if part.offsets else []
    templates, refs = doc.get("templates"), doc["refs"]
    stamp = stamp_problem(doc, step, save, where=where)
    if stamp is not None:
        return [stamp]
    if templates != {"u": "."}:
        return [f"{where}: its templates {templates!r} are not this step's ({{'u': '.'}})"]
    pack = "{{u}}/" + pack_file(rank)
    bad: list[str] = document_problems(doc, rank, records, where=where)
    end = 0
    for key, ref in refs.items():
        if isinstance(ref, str):
            if not (key == "zarr.json" or key.endswith("/zarr.json")) or ".." in key.split("/"):
                bad.append(f"{where}: {key!r} is inline data, and not a zarr.json document")
            continue
        path, _, chunk = str(key).rpartition("/")
        offset = part.offsets.get(path, {}).get(chunk)
        length = part.chunk_bytes.get(path, -1) + CHECKSUM_BYTES
        expected = [pack, offset, length]
        if not isinstance(ref, list) or offset is None or ref != expected:
            bad.append(f"{where}: {key!r} points at {ref!r}, not at that chunk in {pack_file(rank)} ({expected!r})")
            continue
        end = max(end, offset + length)
    named = {f"{p}/{k}" for p, by_key in part.offsets.items() for k in by_key}
    if named - set(refs):
        bad.append(f"{where}: names {len(named - set(refs)):,} of the rank's chunks nowhere")
    if end:
        try:
            if len(tier.read_range(f"{d}/{pack_file(rank)}", end - 1, 1)) != 1:
                bad.append(f"{where}: its ranges run past the end of {pack_file(rank)} ({end:,} bytes)")
        except OSError as e:
            bad.append(f"{where}: cannot read {pack_file(rank)}: {e.strerror or e}")
    return [f"step {step}: {b}" if not b.startswith("step ") else b for b in bad]


def _no_progress(done: int, total: int) -> None:
    pass


def short_packs(tier: Tier, step: int, manifest: Manifest, ranks: set[int]) -> list[str]:
    """The packs of ``ranks`` (the saving ranks this tier holds) that end before their last chunk does, by the
    manifest's offsets: one listing of the step's ``packs/``, no chunk read (``tiercheck ls`` shows such a step
    as damaged; ``verify_step`` checks every byte). Empty for tiers that cannot list sizes."""
    ends: dict[int, int] = {}
    for rec in manifest.arrays.values():
        size = chunk_nbytes(rec) + CHECKSUM_BYTES
        for key, offset in rec.offsets.items():
            rank = rec.owner(key)
            if rank in ranks:
                ends[rank] = max(ends.get(rank, 0), offset + size)
    if not ends:
        return []
    try:
        sizes = tier.sizes(f"{step_dir(step)}/{PACKS_DIR}")
    except OSError as e:
        return [f"cannot list {PACKS_DIR}/: {e.strerror or e}"]
    if not sizes:  # a tier that cannot tell (or no pack at all, which a listing of the step shows)
        return []
    short = []
    for rank, end in sorted(ends.items()):
        name = pack_file(rank)
        have = sizes.get(name[len(PACKS_DIR) + 1 :])
        if have is None:
            short.append(f"{name} is missing")
        elif have < end:
            short.append(f"{name} holds {have:,} bytes, its chunks end at byte {end:,}")
    return short


def step_damage(tier: Tier, step: int, *, depth: Literal["index", "manifest", "chunks"] = "manifest") -> str | None:
    """Why the committed ``step`` on this tier cannot be restored, or None when it looks whole.

    ``depth`` says how far to look. ``"index"``: the commit marker and ``manifest.json``, each
    against the other (two small reads, whatever the job's size: what the remote tier's retention
    affords after every drain). ``"manifest"``: also every manifest file this tier holds (each
    read whole, its seal checked, the marker's saving ranks' parts present): a few small reads per
    saving rank here, none of the data (what a node's retention affords). ``"chunks"``: also every
    chunk re-read (``verify_step``), which catches rot inside a pack (what ``tiercheck gc`` does)."""
    if depth == "chunks":
        bad = verify_step(tier, step)
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        return "; ".join(line.removeprefix(f"step {step}: ") for line in bad[:3]) + more if bad else None
    try:
        if depth == "index":
            read_index(tier, step)
            return None
        marker = read_marker(tier, step)
        manifest = read_manifest(tier, step)  # the index, and every part file here unsealed
        rank_parts(tier, step, sorted(marker.ranks), save=manifest.save_id)  # its saving ranks': none missing
    except TiercheckError as e:
        return str(e)
    except OSError as e:  # a directory in a file's place, no permission, EIO
        return f"cannot read it: {e.strerror or e}"
    return None
