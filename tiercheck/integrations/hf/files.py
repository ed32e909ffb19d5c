"""The Hugging Face safetensors layout: one file's header, a sharded directory's names and index.

A safetensors file is an 8-byte little-endian header length, that many bytes of JSON (each tensor's
``dtype``, ``shape`` and ``data_offsets`` into the data that follows, plus ``__metadata__``), then
the tensors' bytes, back to back. A sharded directory holds ``model-0000k-of-0000n.safetensors``
and ``model.safetensors.index.json`` (``metadata.total_size`` and ``weight_map``: tensor -> file); a
single file is ``model.safetensors``, as ``transformers``' ``save_pretrained`` writes them.

Headers and indexes read back are untrusted: every size is bounded before anything is allocated
from it, and a file name from an index must be a plain name in the directory.
"""


from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tiercheck.errors import CorruptCheckpointError, UnsafeCheckpointError

SINGLE_FILE = "model.safetensors"
METADATA_KEY = "__metadata__"  # the header's own entry: no tensor may take its name
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
MAX_INDEX_BYTES = 64 << 20
MAX_NDIM = 64
MAX_ELEMENTS = 1 << 48

# torch dtype name -> safetensors dtype; and back
DTYPES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "complex64": "C64",
}  # fmt: skip
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
            "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "C64": 8}  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are, relative to the file's start."""

    name: str
    dtype: str  # torch's name, e.g. "bfloat16"
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    nbytes: int


def st_dtype(dtype: str, *, where: str) -> str:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise CorruptCheckpointError(f"{where}: dtype {dtype} has no safetensors name") from None


def encode_header(entries: Sequence[tuple[str, str, tuple[int, ...], int]], metadata: Mapping[str, str]) -> bytes:
    """The length prefix and header of a file holding ``entries`` (name, torch dtype, shape, bytes)
    in that order, back to back; padded with spaces to 8 bytes, as the safetensors library does,
    so every tensor's data starts aligned."""
    doc: dict[str, object] = {"__metadata__": dict(metadata)}
    pos = 0
    for name, dtype, shape, nbytes in entries:
        if name == METADATA_KEY:  # it would replace the header's metadata: a file no reader opens
            raise ValueError(f"a tensor cannot be named {METADATA_KEY}: the safetensors header keeps that name")
        doc[name] = {"dtype": st_dtype(dtype, where=name), "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)
    return struct.pack("<Q", len(text)) + text


def header_length(prefix: bytes, *, where: str) -> int:
    """The header's length from a file's first 8 bytes, bounded."""
    if len(prefix) < 8:
        raise CorruptCheckpointError(f"{where}: shorter than a safetensors header ({len(prefix)} bytes)")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(f"{where}: header length {n:,} is beyond the limit ({MAX_HEADER_BYTES:,})")
    return int(n)


def parse_header(data: bytes, file_size: int, *, where: str) -> dict[str, TensorEntry]:
    """The tensors of a file from its header (the bytes after the length prefix); every entry's
    dtype, shape and offsets checked against each other and against ``file_size``."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: header is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: header is not a JSON object")
    base = 8 + len(data)
    out: dict[str, TensorEntry] = {}
    for name, rec in doc.items():
        if name == METADATA_KEY:
            if not isinstance(rec, dict) or not all(isinstance(v, str) for v in rec.values()):
                raise CorruptCheckpointError(f"{where}: {METADATA_KEY} is not a map of strings")
            continue
        here = f"{where}: tensor {name!r}"
        try:
            dtype, shape, (begin, end) = rec["dtype"], rec["shape"], rec["data_offsets"]
            if dtype not in TORCH_DTYPES:
                raise ValueError(f"dtype {dtype!r} is not one tiercheck reads")
            dims = tuple(_count(d) for d in shape)
            begin, end = _count(begin), _count(end)
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{here}: malformed entry ({e})") from None
        if len(dims) > MAX_NDIM or math.prod(dims) > MAX_ELEMENTS:
            raise CorruptCheckpointError(f"{here}: shape {list(dims)[:8]} is beyond any tensor")
        nbytes = math.prod(dims) * ITEMSIZE[dtype]
        if end - begin != nbytes or end < begin:
            raise CorruptCheckpointError(
                f"{here}: data_offsets [{begin}, {end}) hold {end - begin:,} bytes, its {dtype}{list(dims)} {nbytes:,}"
            )
        if base + end > file_size:
            raise CorruptCheckpointError(
                f"{here}: data_offsets end at {base + end:,}, past the end of the file ({file_size:,} bytes)"
            )
        out[name] = TensorEntry(name=name, dtype=TORCH_DTYPES[dtype], shape=dims, start=base + begin, nbytes=nbytes)
    _check_covered(out, base, file_size, where=where)
    return out


def _check_covered(entries: Mapping[str, TensorEntry], base: int, file_size: int, *, where: str) -> None:
    """The tensors' data, in order of ``data_offsets``, must lie back to back from the data's start (``base``)
    to the file's end, as the safetensors library requires: an overlap would hand two tensors the same bytes,
    and a gap or bytes after the last tensor are data no tensor accounts for."""
    pos = 0
    for e in sorted(entries.values(), key=lambda e: (e.start, e.nbytes)):
        begin = e.start - base
        if begin != pos:
            raise CorruptCheckpointError(
                f"{where}: tensor {e.name!r}: data_offsets start at {begin:,}, where the previous tensor ends at "
                f"{pos:,} ({'an overlap' if begin < pos else 'a gap'}, which safetensors refuses)"
            )
        pos = begin + e.nbytes
    if base + pos != file_size:
        raise CorruptCheckpointError(
            f"{where}: the tensors' data_offsets end at {pos:,}, and the file holds {file_size - base:,} bytes of "
            "data: bytes no tensor covers, which safetensors refuses"
        )


def _count(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v >= 1 << 62:
        raise ValueError(f"expected a non-negative integer, got {str(v)[:40]}")
    return v


def shard_name(i: int, n: int) -> str:
    """The ``i``-th (from 0) of ``n`` files, named as ``save_pretrained`` names them."""
    return SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def index_document(weight_map: Mapping[str, str], total_size: int) -> bytes:
    doc = {"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}
    return (json.dumps(doc, indent=2) + "\n").encode()


def parse_index(data: bytes, *, where: str) -> dict[str, str]:
    """``weight_map`` of an index: tensor name -> a plain file name of the same directory."""
    try:
        doc = json.loads(data)
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (ValueError, UnicodeDecodeError, RecursionError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{where}: not a safetensors index ({e})") from None
    for name, file in weight_map.items():
        if not isinstance(file, str) or not _PLAIN_FILE.fullmatch(file) or file in (".", ".."):
            raise UnsafeCheckpointError(
                f"{where}: weight_map[{name!r}]: {str(file)[:200]!r} is not a file of the directory"
            )
    return weight_map


_PLAIN_FILE = re.compile(r"[A-Za-z0-9._-]{1,255}")

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?)B?\s*", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """``5GB`` (10**9, as ``transformers`` counts), ``2GiB``, ``500MB``, ``50KB``, or a byte count."""
    if isinstance(text, int):
        n = text
    else:
        m = _SIZE.fullmatch(text)
        if m is None:
            raise ValueError(f"not a size: {text!r} (expected e.g. 5GB, 500MB, 2GiB or a byte count)")
        power = "KMGT".find(m.group(2).upper()) + 1
        n = int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)
    if n <= 0:
        raise ValueError(f"a shard size must be positive, got {text!r}")
    return n
