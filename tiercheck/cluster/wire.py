"""Checking a message another rank sent, field by field: the parsers every message's ``from_json``
is made of (``restore.messages``, ``save.messages``, ``tiering.replication.ReplicaHeader``).

A message comes from a rank of the same job (so the same library), but through the store or a
socket: one that is not what it should be fails with ``CoordinationError`` naming where it came
from (its store key, or its peer) and the field, never with a ``KeyError`` or ``TypeError`` from
deep inside the protocol that reads it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from tiercheck.errors import CoordinationError


def loads(raw: bytes | str, *, where: str) -> object:
    """A message's JSON, or ``CoordinationError`` naming ``where`` (its store key)."""
    try:
        doc: object = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CoordinationError(f"{where}: not a JSON message from another rank ({e})") from None
    return doc


def bad(where: str, field: str, what: str, value: object) -> CoordinationError:
    shown = repr(value)
    return CoordinationError(f"{where}: field {field!r} is not {what}: {shown[:80]}")


def as_int(v: object, where: str, field: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(where, field, "an integer", v)
    return v


def as_rank(v: object, where: str, field: str) -> int:
    n = as_int(v, where, field)
    if n < 0:
        raise bad(where, field, "a rank", v)
    return n


def as_float(v: object, where: str, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad(where, field, "a number", v)
    return float(v)


def as_str(v: object, where: str, field: str) -> str:
    if not isinstance(v, str):
        raise bad(where, field, "a string", v)
    return v


def as_bool(v: object, where: str, field: str) -> bool:
    if not isinstance(v, bool):
        raise bad(where, field, "true or false", v)
    return v


def as_list(v: object, where: str, field: str, n: int | None = None) -> list[object]:
    if not isinstance(v, list) or (n is not None and len(v) != n):
        raise bad(where, field, "a list" if n is None else f"a list of {n}", v)
    return v


def as_ranks(v: object, where: str, field: str) -> tuple[int, ...]:
    """A list of ranks (or of other non-negative integers: sizes, grid positions)."""
    return tuple(as_rank(x, where, f"{field}[{i}]") for i, x in enumerate(as_list(v, where, field)))


def as_fields(doc: object, where: str, field: str, parsers: Sequence[Callable[[object, str, str], Any]]) -> list[Any]:
    """A positional message (a JSON list), each item checked by its parser, named ``field[i]``."""
    items = as_list(doc, where, field, len(parsers))
    return [parse(v, where, f"{field}[{i}]") for i, (parse, v) in enumerate(zip(parsers, items, strict=True))]


def as_dict(v: object, where: str, field: str) -> dict[str, object]:
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise bad(where, field, "an object", v)
    return v
