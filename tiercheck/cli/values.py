"""The plain values of a saved state for ``tiercheck inspect``: a progress dict, the learning rate, an
optimizer's ``param_groups``. Read from the manifest's encoded tree (``tiercheck.state.flatten`` documents
its tags) without torch, and never unpickled: a pickled value is named, not run.
"""


from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Iterator
from typing import Any

JSON = Any  # a value json.loads can return

_ARRAY_TAGS = ("$tensor", "$ndarray")
MAX_TEXT = 300  # characters of one value in the text listing; --json shows it whole


def plain_values(tree: JSON) -> dict[str, JSON]:
    """Every largest part of ``tree`` that holds no tensor, by its path in the state (``progress``,
    ``optim/param_groups``), as stored: tagged JSON, safe to print and to parse."""

    def walk(node: JSON, parts: list[str]) -> tuple[bool, list[tuple[list[str], JSON]]]:
        """Whether ``node`` holds an array and, if it does, its largest plain parts in order."""
        if _tag(node) in _ARRAY_TAGS:
            return True, []
        children = list(_children(node, parts))
        below = [walk(child, path) for path, child in children]
        if not any(has_array for has_array, _ in below):
            return False, []  # plain: its parent lists it whole
        found: list[tuple[list[str], JSON]] = []
        for (path, child), (has_array, plain) in zip(children, below, strict=True):
            found.extend(plain if has_array else [(path, child)])
        return True, found

    has_array, found = walk(tree, [])
    if not has_array and isinstance(tree, dict):  # no tensor at all: each top-level entry
        return {str(k): v for k, v in tree.items()}
    return {"/".join(path): value for path, value in found}


def _tag(node: JSON) -> str | None:
    if isinstance(node, dict) and len(node) == 1:
        key = next(iter(node))
        if isinstance(key, str) and key.startswith("$"):
            return key
    return None


def _children(node: JSON, parts: list[str]) -> Iterator[tuple[list[str], JSON]]:
    tag = _tag(node)
    if isinstance(node, list):
        yield from (([*parts, str(i)], v) for i, v in enumerate(node))
    elif tag in ("$tuple", "$size") and isinstance(node[tag], list):
        yield from (([*parts, str(i)], v) for i, v in enumerate(node[tag]))
    elif tag == "$dict" and isinstance(node[tag], list):
        for item in node[tag]:
            if isinstance(item, list) and len(item) == 2:
                yield [*parts, render(item[0])], item[1]
    elif isinstance(node, dict) and tag is None:
        yield from (([*parts, str(k)], v) for k, v in node.items())


def render(node: JSON, limit: int = MAX_TEXT) -> str:
    """A stored value as Python would show it (``(0.9, 0.999)``, ``{0: 'a'}``, ``nan``), cut at
    ``limit`` characters."""
    text = "".join(_render(node, 0))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _render(node: JSON, depth: int) -> Iterator[str]:
    if depth > 100:
        yield "…"
        return
    tag = _tag(node)
    if isinstance(node, list):
        yield from _sequence("[", node, "]", depth)
    elif tag is None and isinstance(node, dict):
        yield from _mapping(((repr(k), v) for k, v in node.items()), depth)
    elif tag is not None:
        yield from _tagged(tag, node[tag], depth)
    else:
        yield repr(node)


def _sequence(open_: str, items: list[JSON], close: str, depth: int) -> Iterator[str]:
    yield open_
    for i, v in enumerate(items):
        yield ", " if i else ""
        yield from _render(v, depth + 1)
    yield "," + close if open_ == "(" and len(items) == 1 else close


def _mapping(items: Iterator[tuple[str, JSON]], depth: int) -> Iterator[str]:
    yield "{"
    for i, (key, v) in enumerate(items):
        yield f"{', ' if i else ''}{key}: "
        yield from _render(v, depth + 1)
    yield "}"


def _tagged(tag: str, val: JSON, depth: int) -> Iterator[str]:
    if tag == "$float" and val in ("nan", "inf", "-inf"):
        yield val
    elif tag == "$tuple" and isinstance(val, list):
        yield from _sequence("(", val, ")", depth)
    elif tag == "$size" and isinstance(val, list):
        yield from _sequence("torch.Size([", val, "])", depth)
    elif tag == "$dict" and isinstance(val, list):
        pairs = (p for p in val if isinstance(p, list) and len(p) == 2)
        yield from _mapping((("".join(_render(k, depth + 1)), v) for k, v in pairs), depth)
    elif tag == "$dtype":
        yield f"torch.{val}"
    elif tag == "$device":
        yield f"device({val!r})"
    elif tag == "$bytes":
        yield _bytes(val)
    elif tag == "$npscalar":
        yield _npscalar(val)
    elif tag == "$pickle":
        yield "<a pickled object: not unpickled>"
    elif tag in _ARRAY_TAGS:
        yield f"<array {val}>"
    else:
        yield f"<{tag} value>"


def _bytes(val: JSON) -> str:
    try:
        data = base64.b64decode(str(val), validate=True)
    except (binascii.Error, ValueError):
        return "<bytes (undecodable)>"
    return repr(data) if len(data) <= 32 else f"<{len(data)} bytes>"


def _npscalar(val: JSON) -> str:
    """A numpy scalar's value: a bool, integer, float or complex of 1 to 16 bytes (as ``flatten``
    stores them), decoded without numpy's dtype parser meeting anything else."""
    try:
        dtype, raw = val
        data = base64.b64decode(str(raw), validate=True)
        if not (isinstance(dtype, str) and len(dtype) <= 4 and dtype[:1] in "<>|=" and dtype[1:2] in "biufc"):
            raise ValueError(dtype)
        import numpy as np  # only here: inspect answers without it otherwise

        kind = np.dtype(dtype)
        if kind.itemsize != len(data):
            raise ValueError(dtype)
        value = np.frombuffer(data, dtype=kind)[0].item()
    except (ValueError, TypeError, binascii.Error):
        return "<numpy scalar (undecodable)>"
    text = repr(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return f"{text} ({np.dtype(dtype).name})"
