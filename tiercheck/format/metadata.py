"""The caller's ``save(step, metadata=...)``: checked before anything is written, stored as JSON.

Metadata is for small plain values (a loss, a learning rate, a data position). What JSON holds
round-trips exactly: dicts with string keys, lists, strings, ints, bools, None and floats, NaN
and infinities included (a diverging loss must not make saving fail), which are stored as
``{"$float": "nan"}`` and come back as floats. Anything that would come back changed (a tuple as a
list, an int key as a string, a numpy scalar as a float) or not at all (a tensor, a set, bytes) is
refused with an error naming where it is.
"""


from __future__ import annotations

import json
import math
from typing import Any

from tiercheck.errors import CorruptCheckpointError, UnsupportedValueError

MAX_DEPTH = 64
# Metadata rides in the manifest index every restore reads: bounded, but with room for what plugins
# keep there (DCP's per-tensor dtypes and sizes: about 2.5 MiB for a 34,560-tensor MoE state).
MAX_BYTES = 16 << 20

_FLOAT_TAG = "$float"
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def encode(value: Any) -> Any:
    """``value`` as JSON-ready data, or ``UnsupportedValueError`` naming what cannot be stored."""
    out = _encode(value, "metadata", 0)
    size = len(json.dumps(out))
    if size > MAX_BYTES:
        raise UnsupportedValueError(
            f"metadata is {size:,} bytes as JSON; keep it under {MAX_BYTES:,} (store large values as state)"
        )
    return out


def _encode(value: Any, where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise UnsupportedValueError(f"{where}: metadata nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, bool | str) or type(value) is int:
        return value
    if type(value) is float:
        if math.isfinite(value):
            return value
        return {_FLOAT_TAG: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if type(value) is list:
        return [_encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if type(value) is dict:
        for k in value:
            if not isinstance(k, str):
                raise UnsupportedValueError(f"{where}: key {k!r} is not a string; JSON would turn it into one")
        if list(value) == [_FLOAT_TAG]:
            raise UnsupportedValueError(f"{where}: a dict whose only key is {_FLOAT_TAG!r} is reserved")
        return {k: _encode(v, f"{where}[{k!r}]", depth + 1) for k, v in value.items()}
    hint = ""
    if isinstance(value, tuple):
        hint = " (it would come back as a list: pass a list)"
    elif hasattr(value, "item") and hasattr(value, "dtype"):
        hint = " (a tensor or numpy value: pass value.item() or value.tolist())"
    raise UnsupportedValueError(f"{where}: a {type(value).__qualname__} cannot be stored as metadata{hint}")


def decode(value: Any, *, where: str) -> Any:
    """The inverse of ``encode``, for metadata read back from storage."""

    def walk(v: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError(f"{where}: metadata nested deeper than {MAX_DEPTH} levels")
        if isinstance(v, list):
            return [walk(x, depth + 1) for x in v]
        if isinstance(v, dict):
            if len(v) == 1 and _FLOAT_TAG in v:
                if v[_FLOAT_TAG] not in _NON_FINITE:
                    raise CorruptCheckpointError(
                        f"{where}: metadata: bad {_FLOAT_TAG} value {str(v[_FLOAT_TAG])[:40]!r}"
                    )
                return _NON_FINITE[v[_FLOAT_TAG]]
            return {k: walk(x, depth + 1) for k, x in v.items()}
        return v

    return walk(value, 0)
