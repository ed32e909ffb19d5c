"""Copying one whole committed step between tiers (remote -> local to pre-stage a restart).

Resumable: files already at the destination with the right size are not copied again. Chunks
are verified against the manifest's checksums on the way. The destination's commit marker is
written last and names every saving rank, so a copy cut short leaves a partial step, never a
wrong one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .codec import chunk_nbytes, verify_chunk
from .commit import commit_step, read_manifest, read_marker, step_dir
from .errors import CheckpointNotFoundError
from .manifest import COMMIT_FILE, MANIFEST_FILE
from .tiers.base import Tier

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
    """Copy committed ``step`` from ``src`` to ``dst``: all of it, or with ``ranks`` only the chunk
    files those saving ranks wrote (a node's share: its restore gets the rest from other ranks
    or the remote tier). ``src`` must hold the files asked for."""
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
    manifest_bytes = bytes(src.read(f"{d}/{MANIFEST_FILE}"))
    chunk_records = {}
    for rec in manifest.arrays.values():
        for key in rec.checksums:
            chunk_records[f"{rec.path}/{key}"] = (rec, key)
    files = {
        f: n
        for f, n in src.sizes(d).items()
        if f not in (COMMIT_FILE, MANIFEST_FILE)
        and not f.startswith("__")
        and (f not in chunk_records or chunk_records[f][0].owner(chunk_records[f][1]) in wanted)
    }
    there = dst.sizes(d)
    todo = sorted(f for f, n in files.items() if there.get(f) != n)
    total = sum(files[f] for f in todo)
    done = 0

    def copy(f: str) -> int:
        data = src.read_bytes(f"{d}/{f}")
        if f in chunk_records:
            rec, key = chunk_records[f]
            verify_chunk(
                data, expected_crc=rec.checksums[key], nbytes=chunk_nbytes(rec), where=f"{src.url}: step {step}: {f}"
            )
        dst.write(f"{d}/{f}", [data])
        return len(data)

    with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="tiercheck-copy") as pool:
        for n in pool.map(copy, todo):
            done += n
            if progress is not None:
                progress(done, total)
    commit_step(dst, step, manifest_bytes, ranks=tuple(sorted(wanted)), world_size=marker.world_size)
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
