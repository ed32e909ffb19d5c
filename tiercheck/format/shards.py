"""The coordinators' files of a step's manifest: each array's record without its checksums (the
arrays file) and the rank that wrote each chunk (the owners file). Each array has one coordinating rank,
so a restoring rank reads the files of the arrays it needs, never the whole job's."""


from __future__ import annotations

import json

from tiercheck.errors import CorruptCheckpointError
from tiercheck.format.manifest import ArrayRecord
from tiercheck.format.saveid import check_save, save_field
from tiercheck.format.values import check_array_path, nonneg_int


def shard_bytes(records: dict[str, ArrayRecord], save: str | None) -> bytes:
    """The arrays file of a coordinator: each array's dtype, kind, shape and chunks."""
    drop = ("crc32c", "owner", "offset")
    arrays = {path: {k: v for k, v in rec.to_json().items() if k not in drop} for path, rec in records.items()}
    return json.dumps({**save_field(save), "arrays": arrays}, allow_nan=False, separators=(",", ":")).encode()


def owners_bytes(records: dict[str, ArrayRecord], save: str | None) -> bytes:
    """The owners file of a coordinator: ``{"owner": {array path: {chunk key: writing rank}}}``."""
    doc = {**save_field(save), "owner": {path: rec.owners for path, rec in records.items()}}
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()


def parse_owners(
    doc: bytes, *, where: str, save: str | None, only: set[str] | None = None
) -> dict[str, dict[str, int]]:
    try:
        whole = json.loads(doc)
        check_save(whole, save, where=where)
        owners = whole["owner"]
        return {
            check_array_path(path, where=where): {str(k): nonneg_int(v) for k, v in by_key.items()}
            for path, by_key in owners.items()
            if only is None or path in only
        }
    except CorruptCheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: malformed owners file ({e!r})") from None


def parse_shard(
    doc: bytes, *, where: str, save: str | None, only: set[str] | None = None, owners: bool = True
) -> dict[str, ArrayRecord]:
    """The array records (without checksums) of a coordinator's shard of the manifest: all of
    them, or those in ``only``; without the chunk owners unless ``owners`` (a restoring rank
    matching its state needs shapes and dtypes; only the rank planning an array's reads needs who
    wrote each chunk)."""
    try:
        whole = json.loads(doc)
        check_save(whole, save, where=where)
        arrays = whole["arrays"]
        if not isinstance(arrays, dict):
            raise TypeError("arrays must be an object")
        return {
            path: ArrayRecord.from_json(path, rec, where=where, checksums=False, owners=owners)
            for path, rec in arrays.items()
            if only is None or path in only
        }
    except CorruptCheckpointError:
        raise
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: malformed manifest shard ({e!r})") from None
