"""Nested training state <-> an encoded JSON tree plus the tensors it refers to.

The tree is what the manifest stores; tensors (and numeric numpy arrays) become zarr arrays and
appear in the tree as ``{"$tensor": path}`` / ``{"$ndarray": path}``. Everything else is encoded
as JSON with explicit tags, so restoring a checkpoint never runs code from it:

    None, bool, int, str, finite float     as themselves
    float nan/inf                          {"$float": "nan" | "inf" | "-inf"}
    list                                   [...]
    dict with str keys not starting "$"    {...}
    any other dict (int keys, e.g. optimizer state)   {"$dict": [[key, value], ...]}
    tuple / torch.Size                     {"$tuple": [...]} / {"$size": [...]}
    bytes                                  {"$bytes": base64}
    numpy scalar                           {"$npscalar": [dtype, base64 of its bytes]}
    torch.dtype / torch.device             {"$dtype": "float32"} / {"$device": "cuda:0"}
    anything else, only with allow_pickle  {"$pickle": base64}
"""


from __future__ import annotations

import base64
import contextlib
import functools
import gc
import math
import pickle
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard, runtime_checkable

import numpy as np
import torch

from tiercheck.errors import (
    CorruptCheckpointError,
    IncompatibleStateError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from tiercheck.format.codec import STORAGE_DTYPES
from tiercheck.format.manifest import JSON
from tiercheck.format.paths import COMMIT_FILE, MANIFEST_FILE
from tiercheck.format.values import MAX_TREE_DEPTH, check_array_path
from tiercheck.state.sharding import Shard, is_dtensor, local_tensor, placement_of


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any], /) -> Any: ...


def is_stateful(obj: object) -> TypeGuard[Stateful]:
    return not isinstance(obj, Mapping) and isinstance(obj, Stateful)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_STORABLE = frozenset(
    dt for dt in vars(torch).values() if isinstance(dt, torch.dtype) and dtype_name(dt) in STORAGE_DTYPES
)
"""The dtypes whose names (``dtype_name``) are in STORAGE_DTYPES: one set lookup per tensor a save flattens."""


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise UnsupportedValueError(f"dtype {name!r} is not known to this torch build")
    return dt


@dataclass(frozen=True, slots=True)
class Leaf:
    """A tensor of the state to be stored as one array."""

    path: str
    tensor: torch.Tensor  # this rank's live tensor (any device); numpy arrays wrapped with torch.from_numpy
    kind: str  # "tensor" or "ndarray"
    lazy: bool  # may be copied after save() returns (changes only in optimizer.step())
    global_shape: tuple[int, ...]  # the whole array's shape (the tensor's own shape unless sharded)
    offsets: tuple[int, ...]  # where the tensor sits in the whole array
    # A lazy leaf's live tensors whose version counters an in-place change to it moves: the tensor (for a
    # module's parameter, the live parameter's local tensor: a DTensor's state_dict() aliases it with a
    # counter of its own) and its DTensor (whose ops move the DTensor's counter, not the local tensor's).
    watch: tuple[torch.Tensor, ...] = ()


_PLAIN = re.compile(r"[A-Za-z0-9._-]+")  # the characters _escape keeps as they are


@functools.lru_cache(maxsize=1 << 16)
def _escape(component: str) -> str:
    """One path component, safe for every filesystem and object store, and readable. Kept: every
    save escapes the path of every tensor again, and their components repeat ("0", "weight")."""
    if _PLAIN.fullmatch(component):
        text = component  # the usual case, without a loop over its characters (save() escapes every path)
    else:
        out = []
        for ch in component:
            if ch.isascii() and (ch.isalnum() or ch in "._-"):
                out.append(ch)
            else:
                out.extend(f"%{b:02X}" for b in ch.encode())
        text = "".join(out)
    # Names that would collide with zarr's layout or the step's own files, or leave the directory.
    if not text or text in (".", "..", "c", "zarr.json", MANIFEST_FILE, COMMIT_FILE) or text.startswith("__"):
        text = "%" + f"{ord(text[0]):02X}" + text[1:] if text else "%00"
    return text


MAX_DEPTH = MAX_TREE_DEPTH
"""How deeply a state may nest (dicts, lists, tuples): far beyond any training state, and well
within what decoding can recurse through. Saving refuses deeper states, loading deeper trees (a
manifest's are refused as it is parsed: ``format.values.check_tree_depth``)."""


class _Encoder:
    def __init__(self, *, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.leaves: list[Leaf] = []
        self._paths: set[str] = set()
        # The live parameters of the module being encoded (``_live_params``): what its lazy leaves watch.
        self.live: dict[tuple[int, torch.Size], torch.Tensor] = {}

    def _path(self, parts: list[str]) -> str:
        base = "/".join(map(_escape, parts)) or "%00"
        path, n = base, 1
        while path in self._paths:  # e.g. keys 0 and "0" in one dict
            path, n = f"{base}~{n}", n + 1
        self._paths.add(path)
        return check_array_path(path, where="encoding the state")

    def encode(self, obj: Any, parts: list[str], lazy: Callable[[torch.Tensor], bool]) -> JSON:
        if len(parts) > MAX_DEPTH:
            raise UnsupportedValueError(f"{'/'.join(parts[:8])}/...: nested deeper than {MAX_DEPTH} levels")
        # Only tensors and Shards are placed: no path string for the other nodes' error messages.
        placed = placement_of(obj, where="/".join(parts)) if isinstance(obj, torch.Tensor | Shard) else None
        if placed is not None:
            tensor, global_shape, offsets = placed
            if tensor.dtype not in _STORABLE:
                raise UnsupportedValueError(f"{'/'.join(parts)}: tensors of dtype {tensor.dtype} cannot be stored")
            path = self._path(parts)
            is_lazy = lazy(tensor)
            watch: tuple[torch.Tensor, ...] = ()
            if is_lazy:
                live = self.live.get((tensor.data_ptr(), tensor.shape), tensor) if self.live else tensor
                outer = type(obj) not in (torch.Tensor, torch.nn.Parameter) and is_dtensor(obj)
                watch = (live, obj) if outer else (live,)
            self.leaves.append(Leaf(path, tensor, "tensor", is_lazy, global_shape, offsets, watch))
            return {"$tensor": path}
        if type(obj) is dict:  # before the scalar checks: most nodes that are not tensors are dicts
            return self._mapping(obj, parts, lazy)
        if obj is None or isinstance(obj, bool | str):
            return obj
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return float(obj) if math.isfinite(obj) else {"$float": repr(float(obj))}
        if isinstance(obj, Mapping):
            return self._mapping(obj, parts, lazy)
        if isinstance(obj, list):
            return [self.encode(v, [*parts, str(i)], lazy) for i, v in enumerate(obj)]
        if type(obj) is tuple or isinstance(obj, torch.Size):
            tag = "$size" if isinstance(obj, torch.Size) else "$tuple"
            return {tag: [self.encode(v, [*parts, str(i)], lazy) for i, v in enumerate(obj)]}
        if isinstance(obj, bytes):
            return {"$bytes": base64.b64encode(obj).decode()}
        if isinstance(obj, np.ndarray) and obj.dtype.name in STORAGE_DTYPES:
            path = self._path(parts)
            # Not np.ascontiguousarray alone: it makes a 0-d array 1-d, which then restores into nothing.
            if not obj.dtype.isnative:  # torch views native byte order only: the values, swapped
                obj = obj.astype(obj.dtype.newbyteorder("="))
            t = torch.from_numpy(obj if obj.flags.c_contiguous else np.ascontiguousarray(obj))
            self.leaves.append(Leaf(path, t, "ndarray", False, tuple(t.shape), (0,) * t.dim()))
            return {"$ndarray": path}
        if isinstance(obj, np.generic) and obj.dtype.kind in "biufc":
            return {"$npscalar": [obj.dtype.str, base64.b64encode(obj.tobytes()).decode()]}
        if isinstance(obj, torch.dtype):
            return {"$dtype": dtype_name(obj)}
        if isinstance(obj, torch.device):
            return {"$device": str(obj)}
        if self.allow_pickle:
            return {"$pickle": base64.b64encode(pickle.dumps(obj)).decode()}
        raise UnsupportedValueError(
            f"{'/'.join(parts) or '<state>'}: a value of type {type(obj).__qualname__} cannot be stored "
            "without pickle; convert it to plain values, or pass allow_pickle=True to store it pickled"
        )

    def _mapping(self, obj: Mapping[Any, Any], parts: list[str], lazy: Callable[[torch.Tensor], bool]) -> JSON:
        items = list(obj.items())
        if all(isinstance(k, str) and not k.startswith("$") for k, _ in items):
            return {k: self.encode(v, [*parts, k], lazy) for k, v in items}
        return {"$dict": [[self.encode_key(k, parts), self.encode(v, [*parts, str(k)], lazy)] for k, v in items]}

    def encode_key(self, key: Any, parts: list[str]) -> JSON:
        if isinstance(key, torch.Tensor | np.ndarray):
            raise UnsupportedValueError(f"{'/'.join(parts)}: arrays cannot be dictionary keys")
        return self.encode(key, [*parts, "<key>"], lambda t: False)


def _live_params(obj: object) -> dict[tuple[int, torch.Size], torch.Tensor]:
    """A module's parameters (their local tensors), by address and shape."""
    if not isinstance(obj, torch.nn.Module):
        return {}
    return {(p.data_ptr(), p.shape): p for p in map(local_tensor, obj.parameters())}


def _lazy_predicate(obj: object, params: Mapping[tuple[int, torch.Size], Any]) -> Callable[[torch.Tensor], bool]:
    """Which tensors of a Stateful object change only inside ``optimizer.step()`` (``params``: ``_live_params``)."""
    if isinstance(obj, torch.optim.Optimizer):
        return lambda t: True
    if isinstance(obj, torch.nn.Module):
        # Parameters change only in the optimizer; buffers may change in forward (BatchNorm).
        return lambda t: (t.data_ptr(), t.shape) in params
    return lambda t: False


def flatten(state: Mapping[str, Any], *, allow_pickle: bool) -> tuple[JSON, list[Leaf]]:
    """Encode ``state`` (Stateful objects are asked for their ``state_dict()``)."""
    enc = _Encoder(allow_pickle=allow_pickle)
    tree: dict[str, JSON] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise UnsupportedValueError(f"top-level state keys must be strings, got {key!r}")
        if is_stateful(value):
            entries = value.state_dict()  # first: what it does may move parameters (as FSDP's can)
            enc.live = _live_params(value)
            tree[key] = enc.encode(entries, [key], _lazy_predicate(value, enc.live))
            enc.live = {}
        else:
            tree[key] = enc.encode(value, [key], lambda t: False)
    return tree, enc.leaves


def tensor_sizes(state: Mapping[str, Any]) -> list[int]:
    """The bytes of each tensor (this rank's piece of it) and numeric array ``flatten`` would find in
    ``state``, and nothing else: what the memory tier's start-up bound needs (``memory_pool.pool_bound``),
    without naming and checking every leaf (on a restart, 0.07 s of ``Checkpointer()`` for 3,200 tensors).
    Values ``flatten`` would refuse are refused by the first save, as without the memory tier."""
    out: list[int] = []

    def walk(obj: Any, depth: int) -> None:
        if depth > MAX_DEPTH:
            return
        if isinstance(obj, torch.Tensor | Shard):
            t = obj.local if isinstance(obj, Shard) else local_tensor(obj)
            out.append(t.nelement() * t.element_size())
        elif isinstance(obj, Mapping):
            for v in obj.values():
                walk(v, depth + 1)
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v, depth + 1)
        elif isinstance(obj, np.ndarray) and obj.dtype.name in STORAGE_DTYPES:
            out.append(obj.nbytes)

    for value in state.values():
        walk(value.state_dict() if is_stateful(value) else value, 1)
    return out


# ----------------------------------------------------------------------------------- decoding


TensorSource = Callable[[str, str, Any], Any]
"""(tag, array path, live value or None) -> the decoded tensor/ndarray."""


def decode(
    node: JSON, source: TensorSource, *, allow_pickle: bool, where: str, live: Any = None, depth: int = 0
) -> Any:
    """Rebuild a value from its encoding. ``live`` is the value it replaces, if any: tensors are
    handed to ``source`` together with their live counterpart so it can restore them in place."""
    if depth > MAX_DEPTH:
        raise CorruptCheckpointError(f"{where[:300]}...: nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, list):
        live_list = live if isinstance(live, list) else []
        return [
            decode(
                v,
                source,
                allow_pickle=allow_pickle,
                where=f"{where}/{i}",
                live=live_list[i] if i < len(live_list) else None,
                depth=depth + 1,
            )
            for i, v in enumerate(node)
        ]
    if not isinstance(node, dict):
        return node
    if len(node) == 1:
        ((tag, val),) = node.items()
        if tag in ("$tensor", "$ndarray"):
            return source(tag, val, live)
        if tag.startswith("$"):
            return _decode_tagged(tag, val, source, allow_pickle=allow_pickle, where=where, live=live, depth=depth)
    live_map = live if isinstance(live, Mapping) else {}
    return {
        k: decode(v, source, allow_pickle=allow_pickle, where=f"{where}/{k}", live=live_map.get(k), depth=depth + 1)
        for k, v in node.items()
    }


def _decode_tagged(
    tag: str, val: Any, source: TensorSource, *, allow_pickle: bool, where: str, live: Any, depth: int
) -> Any:
    def sub(v: Any, w: str, lv: Any = None) -> Any:
        return decode(v, source, allow_pickle=allow_pickle, where=w, live=lv, depth=depth + 1)

    try:
        if tag == "$float":
            return float(val)
        if tag == "$dict":
            live_map = live if isinstance(live, Mapping) else {}
            out = {}
            for k_enc, v_enc in val:
                k = sub(k_enc, f"{where}/<key>")
                out[k] = sub(v_enc, f"{where}/{k}", live_map.get(k))
            return out
        if tag in ("$tuple", "$size"):
            live_seq = list(live) if isinstance(live, tuple) else []
            items = [sub(v, f"{where}/{i}", live_seq[i] if i < len(live_seq) else None) for i, v in enumerate(val)]
            return torch.Size(items) if tag == "$size" else tuple(items)
        if tag == "$bytes":
            return base64.b64decode(val, validate=True)
        if tag == "$npscalar":
            dtype, raw = val
            return np.frombuffer(base64.b64decode(raw, validate=True), dtype=np.dtype(dtype))[0]
        if tag == "$dtype":
            return torch_dtype(val)
        if tag == "$device":
            return torch.device(val)
        if tag == "$pickle":
            if not allow_pickle:
                raise UnsafeCheckpointError(
                    f"{where}: this value was stored with pickle; loading it could run code from the "
                    "checkpoint. Pass allow_pickle=True only if you trust where the checkpoint came from"
                )
            return pickle.loads(base64.b64decode(val, validate=True))
    except (UnsafeCheckpointError, IncompatibleStateError):
        raise
    except (ValueError, TypeError, IndexError, RuntimeError, UnsupportedValueError) as e:
        # RuntimeError: torch.device("garbage"); UnsupportedValueError: a dtype torch lacks
        raise CorruptCheckpointError(f"{where}: cannot decode {tag} value ({str(e)[:200]})") from None
    raise CorruptCheckpointError(f"{where}: unknown tag {tag!r} (written by a newer tiercheck?)")


def tensor_paths(node: JSON) -> list[str]:
    """Array paths referenced anywhere in an encoded tree."""
    out: list[str] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, list):
            stack.extend(n)
        elif isinstance(n, dict):
            if len(n) == 1 and next(iter(n)) in ("$tensor", "$ndarray"):
                out.append(next(iter(n.values())))
            else:
                stack.extend(n.values())
    return out


# ----------------------------------------------------------------------------- the protocol


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a restore builds and drops its plan, or ``save()``
    flattens the state: parsing the manifest and planning the reads of 1,836 arrays allocates
    ~10^6 objects, which set off full collections over the training process's whole heap (0.13 s
    of a 1.4 s restore of 1.5 GiB here; planning took 0.22 s instead of 0.08), and they took
    30-40 ms of the 55-70 ms save() spent on the training thread for the same state. Reference
    counting still frees everything dropped; cycles wait for the next collection after it."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
