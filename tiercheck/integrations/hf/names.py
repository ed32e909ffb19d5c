"""Training names <-> Hugging Face names: which tensors of a saved step are exported, under which
names, and the same map for loading a published model into a training state.

A tensor's training name is its place in the state, its keys joined by dots below the selected
top-level entry: ``{"model": model}`` saves ``model.layers.0.mlp.up_proj.weight`` of a Llama as
that name inside the entry ``model`` (exactly its Hugging Face name). ``drop_prefix`` strips a
leading ``prefix`` (``"_orig_mod."`` of a compiled model, say), then ``names`` maps what is left:
a mapping (a name it lacks is kept; one mapped to None is left out) or a callable.
"""


from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tiercheck.errors import CorruptCheckpointError, IncompatibleStateError
from tiercheck.seam import JSON, Manifest, decode

NameMap = Mapping[str, str | None] | Callable[[str], str | None]


@dataclass(frozen=True, slots=True)
class _Ref:
    path: str  # the array's path in the step


def rename(name: str, *, drop_prefix: str | None, names: NameMap | None) -> str | None:
    """The Hugging Face name of training name ``name`` (None: leave the tensor out)."""
    if drop_prefix and name.startswith(drop_prefix):
        name = name[len(drop_prefix) :]
    if names is None:
        return name
    if callable(names):
        return names(name)
    return names.get(name, name)


def read_name_map(path: str | os.PathLike[str]) -> dict[str, str | None]:
    """A JSON object mapping training names to Hugging Face names (null: leave out), from a file."""
    with open(path, "rb") as f:
        data = f.read(64 << 20)
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{os.fspath(path)}: not a JSON name map ({e})") from None
    if not isinstance(doc, dict) or not all(isinstance(v, str | None) for v in doc.values()):
        raise ValueError(f"{os.fspath(path)}: a name map is a JSON object of names to names (or null)")
    return doc


def exported_arrays(
    manifest: Manifest,
    only: Iterable[str],
    *,
    drop_prefix: str | None,
    names: NameMap | None,
    where: str,
) -> dict[str, str]:
    """Hugging Face name -> array path, in the order of the saved state, for the tensors of the
    top-level entries ``only`` in every saving rank's tree (pipeline stages hold different layers)."""
    chosen = list(only)
    out: dict[str, str] = {}
    source: dict[str, str] = {}  # HF name -> the training name it came from
    present: set[str] = set()
    for tree in manifest.trees:
        if not isinstance(tree, dict):
            raise CorruptCheckpointError(f"{where}: manifest tree is not an object")
        for entry in chosen:
            if entry not in tree:
                continue
            present.add(entry)
            for inner, path in _leaves(tree[entry], where=f"{where}: {entry}"):
                name = inner or entry  # the entry is itself a tensor
                hf = rename(name, drop_prefix=drop_prefix, names=names)
                if hf is None:
                    continue
                if hf in out and out[hf] != path:
                    raise IncompatibleStateError(
                        f"{where}: {source[hf]!r} and {name!r} would both be exported as {hf!r}"
                    )
                out[hf], source[hf] = path, name
    missing = [e for e in chosen if e not in present]
    if missing:
        held = sorted({k for t in manifest.trees if isinstance(t, dict) for k in t})
        raise IncompatibleStateError(
            f"{where}: the step has no entry {', '.join(map(repr, missing))} (it holds: {', '.join(map(repr, held))})"
        )
    return out


def _leaves(node: JSON, *, where: str) -> list[tuple[str, str]]:
    """(dotted name, array path) of every tensor under ``node``, decoded as ``load`` decodes it
    (int keys of optimizer state, lists, tuples) without reading anything."""
    value = decode(node, lambda tag, path, live: _Ref(path), allow_pickle=False, where=where)
    found: list[tuple[str, str]] = []

    def walk(v: Any, parts: list[str]) -> None:
        if isinstance(v, _Ref):
            found.append((".".join(parts), v.path))
        elif isinstance(v, Mapping):
            for k, sub in v.items():
                walk(sub, [*parts, str(k)])
        elif isinstance(v, list | tuple):
            for i, sub in enumerate(v):
                walk(sub, [*parts, str(i)])

    walk(value, [])
    return found
