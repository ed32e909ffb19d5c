"""Whether a stored step is intact: every chunk its saving ranks wrote is where the manifest says,
of the right size and CRC32C, and every replica file matches its marker.

``read_stored_chunk`` is the one read-and-check of a chunk: a restore reads its chunks through it
(``restore.read.read_chunk``) and ``verify_step`` re-reads a whole step with it. Both find the
chunk with ``paths.chunk_location`` (``ArrayRecord.location``) and check it with
``codec.verify_chunk``/``verify_parts``. Nothing here sees a tensor.
"""


from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext

from tiercheck.errors import CorruptCheckpointError, TiercheckError
from tiercheck.format.codec import CHECKSUM_BYTES, chunk_nbytes, verify_chunk, verify_parts
from tiercheck.format.layout import grid_size
from tiercheck.format.manifest import Manifest
from tiercheck.format.paths import PACKS_DIR, chunk_location, pack_file, step_dir
from tiercheck.format.replicas import read_replicas, replica_problems
from tiercheck.format.steps import rank_parts, read_manifest, read_marker
from tiercheck.tiers.base import Tier

#: Given the bytes a check will read, a context (a progress bar) whose value is called with
#: (bytes done, total) after each chunk.
Progress = Callable[[int], AbstractContextManager[Callable[[int, int], None]]]

# A chunk to check: array path, chunk key, CRC32C, data bytes (None: unknown, all of its file),
# and where it is (chunk_location's file and offset).
_Job = tuple[str, str, int, int | None, str, int | None]


def read_stored_chunk(
    tier: Tier,
    step: int,
    file: str,
    offset: int | None,
    *,
    nbytes: int | None,
    crc: int,
    where: str,
    into: memoryview | None = None,
) -> memoryview:
    """A stored chunk's data, its size and CRC32C checked (``CorruptCheckpointError`` when not).

    ``file`` and ``offset`` say where it is (``paths.chunk_location``): at ``offset`` in a pack,
    or with no offset its own file, which is read one byte past its expected end so that one too
    long shows. ``nbytes`` None: the size is not known here (a format-3 chunk file of an array
    recorded in another directory), so all of the file is the chunk. With ``into``, the chunk's
    first ``len(into)`` bytes are read there (see ``Tier.read_into``) and a view of them is
    returned. A missing file raises ``FileNotFoundError`` and an unreadable one ``OSError``: each
    caller words those its own way."""
    path = f"{step_dir(step)}/{file}"
    if nbytes is None:
        assert offset is None and into is None
        raw = tier.read(path)
        return verify_chunk(raw, expected_crc=crc, nbytes=len(raw) - CHECKSUM_BYTES, where=where)
    length = nbytes + CHECKSUM_BYTES + (offset is None)
    if into is None:
        return verify_chunk(tier.read_range(path, offset or 0, length), expected_crc=crc, nbytes=nbytes, where=where)
    n, rest = tier.read_into(path, into, offset=offset or 0, length=length)
    return verify_parts(into[:n], rest, expected_crc=crc, nbytes=nbytes, where=where)


def verify_step(tier: Tier, step: int, *, threads: int = 8, progress: Progress | None = None) -> list[str]:
    """Re-read every chunk of ``step`` that this tier's saving ranks wrote, and the replica files it
    keeps; returns the problems found, one line each (``"step N: ..."``), none when it is intact.

    A node's local directory holds only its ranks' chunks and its peers' replicas: those are the
    ones checked there. Every chunk's checksum is checked, its size where known (in the writer's
    part, format 4, or where this directory holds the array's record), and that it is where it
    should be (its own file, or an offset in its writer's pack)."""
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
        if manifest.format_version >= 3:  # the ranks' parts list every chunk they wrote
            for rank, part in sorted(rank_parts(tier, step, held, save=manifest.save_id).items()):
                for path, crcs in sorted(part.checksums.items()):
                    rec = manifest.arrays.get(path)
                    if rec is None and whole:  # every shard is here: some record of the array must be
                        bad.append(
                            f"step {step}: array {path!r}: rank {rank} wrote chunks of it, the manifest has no record"
                        )
                    size = part.chunk_bytes.get(path, chunk_nbytes(rec) if rec else None)
                    for key, crc in sorted(crcs.items()):
                        file, offset = chunk_location(path, key, rank, part.offsets.get(path, {}).get(key))
                        jobs.append((path, key, crc, size, file, offset))
        else:
            ranks = set(marker.ranks)
            for rec in manifest.arrays.values():
                for key, crc in sorted(rec.checksums.items()):
                    if rec.owner(key) in ranks:
                        jobs.append((rec.path, key, crc, chunk_nbytes(rec), *rec.location(key)))
    except TiercheckError as e:  # its message names the tier and the step already
        return [*bad, f"step {step}: {re.sub(rf'^(.*?: )?step {step}: ', '', str(e), count=1)}"]
    if len(marker.ranks) == marker.world_size:  # every saving rank's part is here: every chunk is named
        for rec in manifest.arrays.values():
            if len(rec.checksums) != grid_size(rec.shape, rec.chunks):
                bad.append(
                    f"step {step}: array {rec.path!r}: the manifest names {len(rec.checksums):,} chunks "
                    f"of its {grid_size(rec.shape, rec.chunks):,}"
                )
    total = sum(job[3] or 0 for job in jobs)

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
        return nbytes or 0

    done = 0
    bar = progress(total) if progress is not None else nullcontext(_no_progress)
    with bar as report, ThreadPoolExecutor(max(1, threads)) as pool:
        for nbytes in pool.map(check, jobs):
            done += nbytes
            report(done, total)
    return sorted(bad)


def _no_progress(done: int, total: int) -> None:
    pass


def short_packs(tier: Tier, step: int, manifest: Manifest, ranks: set[int]) -> list[str]:
    """The packs of ``ranks`` (the saving ranks this tier holds) that end before their last chunk does, by the
    manifest's offsets: one listing of the step's ``packs/``, no chunk read (``tiercheck ls`` shows such a step
    as damaged; ``verify_step`` checks every byte). Empty for formats without packs, and for tiers that cannot
    list sizes."""
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
