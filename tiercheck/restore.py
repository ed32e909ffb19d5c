"""Reading a committed step back: verified chunk reads into destination tensors.

Callers plan first (match every stored array to a destination and check shapes and dtypes)
and read second, so an incompatible state is refused before a single byte is overwritten.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .codec import chunk_nbytes, verify_chunk
from .commit import step_dir
from .errors import CorruptCheckpointError
from .flatten import torch_dtype
from .layout import Chunk, chunks
from .manifest import ArrayRecord
from .tiers.base import Tier


@dataclass(frozen=True, slots=True)
class ReadItem:
    record: ArrayRecord
    dest: torch.Tensor  # shape and dtype already checked against the record; any device


def read_arrays(tier: Tier, step: int, items: list[ReadItem], *, io_threads: int) -> int:
    """Fill every destination from storage, verifying each chunk. Returns the bytes read."""
    jobs = [(item, c) for item in items for c in chunks(item.record.shape, item.record.chunks)]
    if not jobs:
        return 0
    d = step_dir(step)

    def read_one(job: tuple[ReadItem, Chunk]) -> int:
        item, c = job
        rec = item.record
        key = c.key
        where = f"{tier.url}: step {step}: array {rec.path!r} chunk {key}"
        nbytes = chunk_nbytes(rec)
        try:
            raw = tier.read(f"{d}/{rec.path}/{key}")
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where}: chunk file is missing") from None
        if key not in rec.checksums:
            raise CorruptCheckpointError(f"{where}: the manifest has no checksum for this chunk")
        data = verify_chunk(raw, expected_crc=rec.checksums[key], nbytes=nbytes, where=where)
        src = torch.frombuffer(data, dtype=torch.uint8).view(torch_dtype(rec.dtype)).view(rec.chunks)
        valid = src[tuple(slice(0, v) for v in c.valid_shape)]
        item.dest[c.slices()].copy_(valid)
        return len(raw)

    if io_threads <= 1 or len(jobs) == 1:
        return sum(read_one(j) for j in jobs)
    with ThreadPoolExecutor(io_threads, thread_name_prefix="tiercheck-read") as pool:
        return sum(pool.map(read_one, jobs))
