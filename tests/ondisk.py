"""Where a saved chunk lies on disk (a byte range of its writer's pack), for tests that damage one
on purpose."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tiercheck.format.codec import CHECKSUM_BYTES, checksum, unseal
from tiercheck.format.manifest import RankPart, parse_rank_part
from tiercheck.format.paths import pack_file
from tiercheck.tiers.local import LocalTier, resident_pages


def chunk_span(step: Path, array: str, key: str) -> tuple[Path, int, int]:
    """The pack holding chunk ``key`` of ``array`` in the step directory ``step``, the chunk's
    offset there, and its length (data and checksum trailer)."""
    for part_path in sorted((step / "manifest").glob("rank-*.json")):
        part = parse_rank_part(unseal(part_path.read_bytes(), where=str(part_path)), where=str(part_path), save=None)
        if key in part.offsets.get(array, {}):
            rank = int(part_path.stem.split("-")[1])
            return step / pack_file(rank), part.offsets[array][key], part.chunk_bytes[array] + CHECKSUM_BYTES
    raise KeyError(f"no part in {step} lists array {array!r} chunk {key}")


def written_by(step: Path, rank: int) -> list[tuple[str, str]]:
    """Every chunk saving ``rank`` wrote, as ``(array, key)``, from its part in ``step``, sorted."""
    part_path = step / "manifest" / f"rank-{rank:06d}.json"
    part = parse_rank_part(unseal(part_path.read_bytes(), where=str(part_path)), where=str(part_path), save=None)
    return sorted((array, key) for array, keys in part.offsets.items() for key in keys)


def chunks_of(step: Path, array: str) -> list[str]:
    """The keys of every chunk of ``array`` the parts in ``step`` list, sorted."""
    keys: set[str] = set()
    for part_path in (step / "manifest").glob("rank-*.json"):
        part = parse_rank_part(unseal(part_path.read_bytes(), where=str(part_path)), where=str(part_path), save=None)
        keys.update(part.offsets.get(array, {}))
    return sorted(keys)


def flip_chunk_byte(step: Path, array: str, key: str, index: int) -> None:
    """Flip one bit of byte ``index`` of a stored chunk (negative: from its end, the trailer's)."""
    pack, offset, length = chunk_span(step, array, key)
    data = bytearray(pack.read_bytes())
    data[offset + (index if index >= 0 else length + index)] ^= 0x01
    pack.write_bytes(bytes(data))


def step_parts(step: Path) -> list[RankPart]:
    """The rank parts of the manifest in the step directory ``step`` (those of its node's ranks)."""
    out = []
    for part_path in sorted((step / "manifest").glob("rank-*.json")):
        out.append(
            parse_rank_part(unseal(part_path.read_bytes(), where=str(part_path)), where=str(part_path), save=None)
        )
    return out


def resign_index(step: Path, data: bytes) -> None:
    """Write ``data`` as ``step``'s manifest.json and sign it in its COMMIT (size and CRC32C), so
    that a reader parses it instead of refusing it as damaged."""
    (step / "manifest.json").write_bytes(data)
    marker = json.loads((step / "COMMIT").read_bytes())
    marker.update(manifest_crc32c=checksum(data), manifest_size=len(data))
    (step / "COMMIT").write_text(json.dumps(marker))


def skip_without_direct_io(directory: Path) -> None:
    """Skip the test where the filesystem of ``directory`` refuses O_DIRECT."""
    fd = LocalTier(directory, direct_io=True)._open_direct(directory / "probe", os.O_CREAT)
    if fd is None:
        pytest.skip(f"the filesystem of {directory} refuses O_DIRECT")
    os.close(fd)
    (directory / "probe").unlink()


def evict_packs(step: Path) -> None:
    """Drop the packs of ``step`` from the page cache (written back first), as after a reboot or
    under memory pressure; skip where the cache keeps them (tmpfs) or O_DIRECT is refused. The
    check asks ``mincore`` of a mapping of each pack: a read, even one that must not wait
    (``RWF_NOWAIT``), starts readahead that brings the pages it missed back."""
    skip_without_direct_io(step)
    for pack in (step / "packs").iterdir():
        with open(pack, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            if resident_pages(f.fileno(), 0, os.fstat(f.fileno()).st_size):
                pytest.skip(f"the page cache keeps {pack} (tmpfs?)")
