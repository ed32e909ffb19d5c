"""What a parity group's leaders share while they code or rebuild a step (``tiering.parity``,
``tiering.rebuild``): their gloo group, and a node's region (its files of a step, one after another)
read and written by offset.

The group is a gloo process group of tiercheck's own over the group's leaders (made from the job's
store at start, never the training's group). Within a round, each shard a leader sends to another
goes with the tag ``stripe * n + position``: distinct for every pair of leaders in a round, and in
order across rounds (gloo matches a tag's messages in the order they are posted).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tiercheck.errors import CorruptCheckpointError
from tiercheck.format.codec import checksum
from tiercheck.tiers.base import PackWriter
from tiercheck.tiers.local import LocalTier


class Group:
    """The gloo group of a parity group's leaders (``rank``: this leader's member number)."""

    def __init__(self, store: Any, prefix: str, rank: int, size: int, timeout_s: float) -> None:
        self.rank, self.size = rank, size
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timedelta(seconds=timeout_s))

    def allgather(self, data: bytes, *, limit: int, what: str) -> list[bytes]:
        """Every member's ``data``, in member order (each at most ``limit`` bytes, checked before
        anything of that size is allocated)."""
        n = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self.size)]
        self.pg.allgather([sizes], [n]).wait()  # type: ignore[attr-defined]
        lens = [int(t.item()) for t in sizes]
        for member, size in enumerate(lens):
            if not 0 <= size <= limit:
                raise CorruptCheckpointError(f"parity group member {member} announced {size} bytes of {what}")
        top = max(lens) or 1
        buf = torch.zeros(top, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.empty(top, dtype=torch.uint8) for _ in range(self.size)]
        self.pg.allgather([outs], [buf]).wait()  # type: ignore[attr-defined]
        return [o[:size].numpy().tobytes() for o, size in zip(outs, lens, strict=True)]

    def send(self, t: torch.Tensor, member: int, tag: int) -> Any:
        return self.pg.send([t], member, tag)  # type: ignore[attr-defined]

    def recv(self, t: torch.Tensor, member: int, tag: int) -> Any:
        return self.pg.recv([t], member, tag)  # type: ignore[attr-defined]


class Region:
    """A node's files of a step (``files``: name, size, in order) as one run of bytes: read by
    offset, zero beyond its end; or written by offset (``open``, then ``write``, then ``close``)."""

    def __init__(self, tier: LocalTier, directory: str, files: Sequence[tuple[str, int]]) -> None:
        self.tier, self.dir, self.files = tier, directory, list(files)
        self.starts: list[int] = []
        at = 0
        for _, size in self.files:
            self.starts.append(at)
            at += size
        self.size = at
        self._writers: dict[str, PackWriter] = {}

    def _spans(self, offset: int, length: int) -> list[tuple[str, int, int, int]]:
        """``(file, offset in it, offset in the request, length)`` for the region's bytes in range."""
        out = []
        end = min(offset + length, self.size)
        for (name, size), start in zip(self.files, self.starts, strict=True):
            lo, hi = max(offset, start), min(end, start + size)
            if lo < hi:
                out.append((name, lo - start, lo - offset, hi - lo))
        return out

    def read(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the region's bytes from ``offset`` (zeros past the end)."""
        filled = 0
        for name, at, into, n in self._spans(offset, len(out)):
            got, _ = self.tier.read_into(f"{self.dir}/{name}", out[into : into + n], offset=at, length=n)
            if got != n:
                raise CorruptCheckpointError(f"{self.tier.url}: {self.dir}/{name} is shorter than its record says")
            filled = max(filled, into + n)
        out[filled:] = bytes(len(out) - filled)

    def open(self) -> None:
        for name, _ in self.files:
            self._writers[name] = self.tier.open_pack(f"{self.dir}/{name}")

    def write(self, offset: int, data: memoryview) -> None:
        """Write ``data`` at region offset ``offset`` (bytes past the region's end are padding: dropped)."""
        for name, at, into, n in self._spans(offset, len(data)):
            self._writers[name].write_at(at, [data[into : into + n]])

    def close(self) -> None:
        writers, self._writers = self._writers, {}
        for w in writers.values():
            w.close()

    def crcs(self, piece_bytes: int) -> list[int]:
        """Each file's CRC32C, read back."""
        return [file_crc(self.tier, f"{self.dir}/{name}", size, piece_bytes) for name, size in self.files]


def file_crc(tier: LocalTier, path: str, size: int, piece_bytes: int) -> int:
    """The CRC32C of ``size`` bytes of ``path`` (``CorruptCheckpointError`` where it is shorter)."""
    buf = memoryview(bytearray(min(max(size, 1), piece_bytes)))
    crc = 0
    for offset in range(0, size, len(buf)):
        n = min(len(buf), size - offset)
        got, _ = tier.read_into(path, buf[:n], offset=offset, length=n)
        if got != n:
            raise CorruptCheckpointError(f"{tier.url}: {path} is shorter than its record says ({size} bytes)")
        crc = checksum(buf[:n], crc)
    return crc
