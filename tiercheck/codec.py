"""Arrays on storage: dtype mapping, zarr v3 metadata documents, and chunk checksums.

Every chunk is stored as zarr v3's ``bytes`` codec (little endian) followed by its ``crc32c``
codec: the raw array bytes with a 4-byte CRC32C appended. Plain zarr therefore reads a step and
verifies its checksums by itself; tiercheck writes the same bytes straight from its staging
buffers (no extra copy, fsync'd) and records each CRC in the manifest too.

Dtypes zarr has no name for (bfloat16, float8) are stored as unsigned integers of the same
width; the real dtype is in the array's attributes (``tiercheck.dtype``) and in the manifest.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterable

import google_crc32c
import numpy as np
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec
from zarr.storage import MemoryStore

from .errors import CorruptCheckpointError, UnsupportedValueError
from .manifest import FORMAT_NAME, FORMAT_VERSION, ArrayRecord

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little endian
    raise ImportError("tiercheck writes raw little-endian bytes and needs a little-endian host")

# real dtype name -> (zarr data type it is stored as, item size in bytes)
STORAGE_DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("float64", 8),
    "float32": ("float32", 4),
    "float16": ("float16", 2),
    "bfloat16": ("uint16", 2),
    "float8_e4m3fn": ("uint8", 1),
    "float8_e5m2": ("uint8", 1),
    "float8_e4m3fnuz": ("uint8", 1),
    "float8_e5m2fnuz": ("uint8", 1),
    "complex128": ("complex128", 16),
    "complex64": ("complex64", 8),
    "int64": ("int64", 8),
    "int32": ("int32", 4),
    "int16": ("int16", 2),
    "int8": ("int8", 1),
    "uint64": ("uint64", 8),
    "uint32": ("uint32", 4),
    "uint16": ("uint16", 2),
    "uint8": ("uint8", 1),
    "bool": ("bool", 1),
}

CHECKSUM_BYTES = 4


def itemsize(dtype: str) -> int:
    try:
        return STORAGE_DTYPES[dtype][1]
    except KeyError:
        raise UnsupportedValueError(
            f"dtype {dtype!r} cannot be stored; supported: {', '.join(STORAGE_DTYPES)}"
        ) from None


def chunk_nbytes(record: ArrayRecord) -> int:
    """Bytes of one full (padded) chunk of ``record``, without its checksum."""
    n = itemsize(record.dtype)
    for c in record.chunks:
        n *= c
    return n


def zarr_documents(records: Iterable[ArrayRecord]) -> dict[str, bytes]:
    """The ``zarr.json`` documents of a step's group hierarchy, keyed by path inside the step.

    Built by zarr itself (into memory) so the format is exactly what zarr expects to read.
    """
    backing: dict[str, object] = {}
    store = MemoryStore(store_dict=backing)  # type: ignore[arg-type]
    zarr.create_group(
        store=store, attributes={FORMAT_NAME: {"format_version": FORMAT_VERSION, "manifest": "manifest.json"}}
    )
    for rec in records:
        storage_dtype, _ = STORAGE_DTYPES[rec.dtype]
        zarr.create_array(
            store=store,
            name=rec.path,
            shape=rec.shape,
            chunks=rec.chunks,
            dtype=storage_dtype,
            fill_value=False if storage_dtype == "bool" else 0,
            filters=None,
            serializer=BytesCodec(endian="little"),
            compressors=[Crc32cCodec()],
            attributes={FORMAT_NAME: {"dtype": rec.dtype, "kind": rec.kind}},
        )
    return {key: buf.to_bytes() for key, buf in backing.items()}  # type: ignore[attr-defined]


def checksum(data: memoryview | bytes | bytearray) -> int:
    # google_crc32c refuses memoryviews but takes numpy arrays: wrap without copying.
    return int(google_crc32c.value(np.frombuffer(data, dtype=np.uint8)))


def checksum_trailer(crc: int) -> bytes:
    """The 4 bytes zarr's crc32c codec appends: the CRC as little-endian uint32."""
    return struct.pack("<I", crc)


def verify_chunk(
    raw: memoryview | bytes | bytearray, *, expected_crc: int | None, nbytes: int, where: str
) -> memoryview:
    """Check a stored chunk (data + trailer) and return a view of its data bytes."""
    view = memoryview(raw)
    if len(view) != nbytes + CHECKSUM_BYTES:
        raise CorruptCheckpointError(
            f"{where}: chunk has {len(view)} bytes, expected {nbytes + CHECKSUM_BYTES} (truncated or damaged)"
        )
    data = view[:nbytes]
    actual = checksum(data)
    (stored,) = struct.unpack("<I", view[nbytes:])
    if actual != stored or (expected_crc is not None and actual != expected_crc):
        raise CorruptCheckpointError(
            f"{where}: checksum mismatch (computed {actual:#010x}, chunk says {stored:#010x}, "
            f"manifest says {expected_crc:#010x})"
            if expected_crc is not None
            else f"{where}: checksum mismatch (computed {actual:#010x}, chunk says {stored:#010x})"
        )
    return data
