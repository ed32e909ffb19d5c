"""Copying one whole committed step between tiers (remote -> local to pre-stage a restart).

Resumable by content, never by size alone: before it writes anything a copy names the save it
copies in the destination's step directory (``paths.copying_marker``), and a copy resumed later
keeps the files it finds only under a marker naming the same save (files are written whole, so a
file there under it is that save's). Files another save left there (a step number saved again
after a rollback, another run's) are deleted first. Chunks are verified against the manifest's
checksums on the way, and every manifest file must name the step's save. The destination's
commit marker is written last and names every saving rank, so a copy cut short leaves a partial
step, never a wrong one.
"""



from __future__ import annotations

import json
import logging
import mmap
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from tiercheck.cluster.coordination import shard_of
from tiercheck.errors import CheckpointNotFoundError, CorruptCheckpointError
from tiercheck.format.codec import CHECKSUM_BYTES, PackCheck, Span, checksum, unseal
from tiercheck.format.commit import commit_step
from tiercheck.format.files import files_of_ranks
from tiercheck.format.manifest import ArrayRecord, Manifest, RankPart
from tiercheck.format.paths import (
    MANIFEST_FILE,
    PARTS_DIR,
    copying_marker,
    is_replica_marker,
    pack_file,
    pack_owner,
    shard_file,
    step_dir,
)
from tiercheck.format.refmaps import check_map, map_owner, parse_map
from tiercheck.format.replicas import Replica
from tiercheck.format.saveid import check_file_save
from tiercheck.format.steps import rank_parts, read_manifest, read_marker, read_small
from tiercheck.tiers.base import Tier
from tiercheck.tiers.local import BLOCK
from tiercheck.tiers.parts import composite_of

log = logging.getLogger("tiercheck")

Progress = Callable[[int, int], None]  # (bytes done, bytes to do)


@dataclass(frozen=True, slots=True)
class CopyReport:
    step: int
    files_copied: int
    files_already_there: int
    bytes_copied: int
    seconds: float


def copy_step(
    src: Tier,
    dst: Tier,
    step: int,
    *,
    ranks: set[int] | None = None,
    concurrency: int = 8,
    progress: Progress | None = None,
) -> CopyReport:
    """Copy committed ``step`` from ``src`` to ``dst``: every saving rank's files, or with ``ranks``
    those ranks' only (a node's share: its restore gets the rest from other ranks or the remote
    tier), as ``files.files_of_ranks`` decides. ``src`` must hold the files asked for."""
    t0 = time.perf_counter()
    d = step_dir(step)
    marker = read_marker(src, step)
    wanted = set(range(marker.world_size)) if ranks is None else set(ranks)
    if not wanted <= set(range(marker.world_size)):
        raise ValueError(f"step {step} was saved by ranks 0-{marker.world_size - 1}; asked for {sorted(wanted)}")
    if not wanted <= set(marker.ranks):
        raise CheckpointNotFoundError(
            f"{src.url}: step {step} holds the files of ranks {list(marker.ranks)} of {marker.world_size} only"
        )
    manifest = read_manifest(src, step)
    save = manifest.save_id
    manifest_bytes = bytes(src.read(f"{d}/{MANIFEST_FILE}"))
    listing = src.sizes(d)
    files = files_of_ranks(listing, wanted)
    # A peer's replica marker is no rank's file, but the copy of its ranks' files carries it along.
    markers = [f for f in listing if is_replica_marker(f)]
    files.update({f: listing[f] for f in markers if _with_its_files(src, step, f, files)})
    writers = {rec.owner(k) for rec in manifest.arrays.values() for k in rec.offsets}
    lost = sorted(r for r in writers & wanted if pack_file(r) not in files)
    if lost:
        raise CorruptCheckpointError(f"{src.url}: step {step}: the packs of saving ranks {lost} are missing")
    check_complete(src, step, manifest, rank_parts(src, step, sorted(wanted), save=save), wanted)
    there = resumable(src, dst, step, save, min(wanted), files)
    todo = sorted(f for f in files if f not in there)
    total = sum(files[f] for f in todo)
    done = 0

    def copy(f: str) -> int:
        if pack_owner(f) is not None:
            return copy_pack(src, dst, step, f, files[f], save=save)
        return copy_file(src, dst, step, f, save=save, records=manifest.arrays)  # each checked as load would

    with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="tiercheck-copy") as pool:
        for n in pool.map(copy, todo):
            done += n
            if progress is not None:
                progress(done, total)
    commit_step(dst, step, manifest_bytes, save_id=save, ranks=tuple(sorted(wanted)), world_size=marker.world_size)
    finish_copy(dst, step, min(wanted))
    report = CopyReport(step, len(todo), len(files) - len(todo), done, time.perf_counter() - t0)
    log.info(
        "copied step %d from %s to %s: %d files (%d already there), %.1f MiB in %.2f s",
        step,
        src.url,
        dst.url,
        report.files_copied,
        report.files_already_there,
        done / 2**20,
        report.seconds,
    )
    return report


def _with_its_files(src: Tier, step: int, marker: str, files: dict[str, int]) -> bool:
    """Whether a peer's replica marker goes with this copy: only with every file it names, of the
    size it names (a copy of a node's own ranks leaves its peers' packs behind, and a marker without
    them would claim ranks the target does not hold). A damaged marker never goes."""
    where = f"{src.url}: step {step}: {marker}"
    try:
        replica = Replica.parse(read_small(src, f"{step_dir(step)}/{marker}", where=where), step=step, where=where)
    except (CorruptCheckpointError, OSError) as e:
        log.warning("not copying %s: %s", where, e)
        return False
    return all(files.get(name) == size for name, (size, _) in replica.files.items())


def resumable(
    src: Tier, dst: Tier, step: int, save: str, first: int, files: dict[str, int]
) -> dict[str, int]:
    """Before a copy of ``files`` of save ``save`` from ``src`` into ``dst``'s directory of
    ``step`` (a node's share: ``first`` is its first saving rank): the packs a copy of the same
    save left there whose content checks out (``copy_holds``: never by size), with their sizes
    there, which it need not copy again (every other file is small, and copied again). Any
    file of ``files`` there under another save's marker (or none) is deleted,
    and so are unfinished uploads of any of ``files``, then the directory is marked as receiving
    ``save``'s files, before the copy writes any."""
    d = step_dir(step)
    # An upload of these files a crash cut short left parts no listing shows: drop them first,
    # and the temporaries of a killed copy into a directory (never part of a step).
    dst.discard_unfinished(d, set(files))
    there = dst.sizes(d)
    for f in sorted(f for f in there if temporary_of(f) in files):  # not another node's, in flight
        dst.delete(f"{d}/{f}")
    there = {f: n for f, n in there.items() if not is_temporary(f)}
    marker = copying_marker(first)
    if marker in there:
        try:
            doc = json.loads(read_small(dst, f"{d}/{marker}", where=f"{dst.url}: step {step}"))
            if isinstance(doc, dict) and doc.get("save_id") == save:
                return {
                    f: n
                    for f, n in there.items()
                    if f in files and pack_owner(f) is not None and copy_holds(src, dst, step, f, files[f], save=save)
                }
        except (FileNotFoundError, CorruptCheckpointError, ValueError, RecursionError):
            pass  # unreadable: trust nothing
    stale = sorted(f for f in files if f in there)
    if stale:
        log.warning(
            "%s: step %d: %d file(s) there are not known to be of the save being copied; replacing them",
            dst.url, step, len(stale),
        )  # fmt: skip
        for f in stale:
            dst.delete(f"{d}/{f}")
    dst.write(f"{d}/{marker}", [json.dumps({"save_id": save}).encode()])
    return {}


def is_temporary(f: str) -> bool:
    """Whether ``f`` (a path in a step) is a file being written (``LocalTier.write_stream``'s
    ``.name.tmp-PID-TID``, a replica being received): a dot-name, never part of a step."""
    return f.rsplit("/", 1)[-1].startswith(".")


def temporary_of(f: str) -> str | None:
    """The file the temporary ``f`` (``dir/.name.tmp-PID-TID``) was being written as; None for
    a path that is no such temporary."""
    head, _, name = f.rpartition("/")
    if not name.startswith(".") or ".tmp-" not in name:
        return None
    final = name[1:].rsplit(".tmp-", 1)[0]
    return f"{head}/{final}" if head else final


def finish_copy(dst: Tier, step: int, first: int) -> None:
    """The copy of a node's share is whole: its marker (``resumable``) is no longer needed."""
    try:
        dst.delete(f"{step_dir(step)}/{copying_marker(first)}")
    except OSError as e:  # a leftover marker only names the save the files are of
        log.debug("%s: could not remove the copy marker of step %d: %s", dst.url, step, e)


def check_complete(src: Tier, step: int, manifest: Manifest, parts: dict[int, RankPart], wanted: set[int]) -> None:
    """Every manifest file a restore of the ``wanted`` ranks' share of a step needs is
    there: each array their chunks belong to has its record (arrays file) and chunk owners
    (owners file) where the step keeps them, so no copy commits what ``load`` would refuse."""
    world = manifest.world_size
    for rank, part in parts.items():
        for path, crcs in part.checksums.items():
            shard = shard_of(path, world)
            if shard not in wanted:
                continue  # another node's share keeps the record
            where = f"{src.url}: {step_dir(step)}/{shard_file(shard)}"
            rec = manifest.arrays.get(path)
            if rec is None:
                raise CorruptCheckpointError(
                    f"{where}: holds no record of array {path!r} (saving rank {rank} wrote chunks of it): "
                    "the file is missing or damaged"
                )
            if any(k not in rec.owners for k in crcs):
                raise CorruptCheckpointError(
                    f"{where}: the owners file of array {path!r} is missing or does not name its chunks' writers"
                )


def pack_spans(src: Tier, step: int, f: str, size: int, *, save: str) -> tuple[list[Span], int]:
    """The chunks of the pack file ``f`` of ``step`` (``size`` bytes at ``src``) in file order, from
    its writer's part of the manifest, each checked to follow the one before; and where the last
    one's checksum ends (what a copy of the pack holds)."""
    rank = pack_owner(f)
    assert rank is not None
    where = f"{src.url}: {step_dir(step)}/{f}"
    spans = rank_parts(src, step, [rank], save=save)[rank].spans()
    end = 0
    for offset, nbytes, path, key, _ in spans:
        if offset < end or offset - end >= BLOCK:
            raise CorruptCheckpointError(
                f"{where}: array {path!r} chunk {key}: offset {offset} overlaps the chunk before it or leaves a gap"
            )
        end = offset + nbytes + CHECKSUM_BYTES
    if end > size:
        raise CorruptCheckpointError(f"{where}: has {size} bytes, its chunks end at {end} (truncated)")
    return spans, end


def copy_pack(src: Tier, dst: Tier, step: int, f: str, size: int, *, save: str) -> int:
    """Copy the pack file ``f`` of ``step`` (``size`` bytes at ``src``), streaming it in pieces and
    checking each chunk against its writer's part of the manifest as it is read: a chunk that
    rotted on ``src`` fails the copy, and the half-written copy is never committed. Returns the
    bytes copied."""
    spans, end = pack_spans(src, step, f, size, save=save)
    path = f"{step_dir(step)}/{f}"
    piece = dst.piece_bytes(end)

    def pieces() -> Iterator[memoryview]:
        return pack_pieces(src, path, spans, end, piece, f"{src.url}: {path}")

    dst.write_stream(path, pieces, size=end)
    return end


def copy_holds(src: Tier, dst: Tier, step: int, f: str, size: int, *, save: str) -> bool:
    """Whether ``dst``'s copy of the pack file ``f`` (left by a copy of the same save, resumed now)
    holds ``src``'s bytes, never judged by its size: read back and every chunk checked against the
    manifest where ``dst`` is a directory; its parts' checksums, as the store kept them, compared
    with ``src``'s where it is an object store that keeps them (S3). False (logged where it does
    not check out): copy it again."""
    path = f"{step_dir(step)}/{f}"
    try:
        spans, end = pack_spans(src, step, f, size, save=save)
        if dst.local_path is not None:
            for _ in pack_pieces(dst, path, spans, end, dst.piece_bytes(end), f"{dst.url}: {path}"):
                pass
            return True
        kept = dst.part_checksums(path)
        if kept is None:
            return False
        composite, part = kept
        ours = composite_of([checksum(p) for p in pack_pieces(src, path, spans, end, part, f"{src.url}: {path}")])
        if ours == composite:
            return True
        why = f"its parts' checksums are {composite}, the local pack's {ours}"
    except (CorruptCheckpointError, OSError) as e:
        why = str(e)
    log.warning("%s: %s: the copy there does not check out (%s); copying it again", dst.url, path, why)
    return False


def pack_pieces(src: Tier, path: str, spans: list[Span], end: int, piece: int, where: str) -> Iterator[memoryview]:
    """The first ``end`` bytes of the pack ``path`` in pieces of ``piece`` bytes, each read in one
    request (around the page cache where ``src`` can: whole blocks into page-aligned memory) and
    its chunks checked as they pass (``PackCheck``): a chunk that rotted on ``src`` stops the
    stream before the copy completes. A piece's memory is the writer's until it lets go of every
    view of it (a part sent), then is read into again."""
    check = PackCheck(spans, where)
    ring = _Ring(-(-min(piece, end) // BLOCK) * BLOCK)
    for at in range(0, end, piece):
        n = min(piece, end - at)
        view = ring.take()
        got, _ = src.read_vectored(path, at, [view[: -(-n // BLOCK) * BLOCK]], direct=True)
        if got < n:
            raise CorruptCheckpointError(f"{where}: has {at + got} bytes, its chunks end at {end} (truncated)")
        check.feed(view[:n])
        yield view[:n]
    check.close()


class _Ring:
    """Page-aligned buffers (O_DIRECT reads into them), each taken again once nothing refers to
    the view it was lent as: no first touch of new memory per piece (the kernel zeroes every new
    page: 0.4 s of CPU per GiB drained here), and never a buffer a writer still holds."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self) -> memoryview:
        with self._lock:
            buf = self._free.pop() if self._free else mmap.mmap(-1, self.size)
        lent = np.frombuffer(buf, dtype=np.uint8)  # views of it keep it alive; when it goes, buf is free
        weakref.finalize(lent, self._give, buf)
        return lent.data  # a view that keeps ``lent`` alive

    def _give(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._free.append(buf)


def copy_file(
    src: Tier, dst: Tier, step: int, f: str, *, save: str, records: Mapping[str, ArrayRecord] | None = None
) -> int:
    """Copy the file ``f`` of ``step``, not a pack (:func:`copy_pack`): a manifest part, arrays
    shard or owners file, checked against its seal and the step's save ``save``, or a reference
    map, checked as ``load`` checks it (``refmaps.check_map``: it names this step and ``save``, and
    its documents agree with ``records``, the step's array records where the caller has them); so a
    rotted file, or another save's, is never committed on ``dst``. Each is small and read bounded.
    Returns the bytes copied."""
    d = step_dir(step)
    where = f"{src.url}: {d}/{f}"
    data = read_small(src, f"{d}/{f}", where=f"{src.url}: step {step}")
    if f.startswith(f"{PARTS_DIR}/"):
        check_file_save(unseal(data, where=where), save, where=where)
    elif (rank := map_owner(f)) is not None:
        check_map(parse_map(data, where=where), step, rank, records or {}, save=save, where=where)
    dst.write(f"{d}/{f}", [data])
    return len(data)
