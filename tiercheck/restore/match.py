"""Matching a saved state tree to the live state: what to read into which tensor, and handing the
decoded values back (in place where possible). Shapes, dtypes and keys are checked here, before a
single byte is read, so an incompatible state is refused with nothing overwritten."""


from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

from tiercheck.errors import CorruptCheckpointError, IncompatibleStateError, StagingError
from tiercheck.format.manifest import JSON, ArrayRecord, Manifest
from tiercheck.humanize import some
from tiercheck.restore.stage import ReadItem
from tiercheck.state.flatten import _Encoder, decode, dtype_name, is_stateful, tensor_paths, torch_dtype
from tiercheck.state.sharding import Shard, placement_of


class FreshShard(Shard):
    """A ``Shard`` of a tensor made for this restore, which no one uses before it succeeded (an
    integration's read buffer). Restore reads and verifies chunks straight into it: the staging
    buffer and copy that keep a failed restore from leaving a live tensor half-written would
    protect nothing here."""

    __slots__ = ()


def tree_for(manifest: Manifest, rank: int, world_size: int, state: Mapping[str, Any], *, extra: bool) -> JSON:
    """The saved tree to restore into ``rank``.

    On the saving world size it is the same rank's tree: entries the state lacks are added, as in
    a single process (a fresh optimizer gets its saved state). On another world size the layout
    changed and other ranks' entries mean nothing here: only the state's own keys are filled,
    each from the same rank's tree where it has it (rank 0's if there was no such rank), else
    from the first saving rank that had it (a pipeline stage that moved to this rank, say).
    """
    first = rank if rank < manifest.world_size else 0
    order = [first, *sorted(r for r in manifest.tree_of_rank if r != first)]  # the ranks whose parts were read
    seen: set[int] = set()
    trees = []
    manifest.tree(first)  # raises if this rank's own part was not read
    for r in order:
        i = manifest.tree_of_rank[r]
        if i not in seen:
            seen.add(i)
            trees.append(manifest.trees[i])
    live = {k: v.state_dict() if is_stateful(v) else v for k, v in state.items()}
    return _merge(trees[0], trees[1:], live, only_live=not extra or world_size != manifest.world_size)


def covers(tree: JSON, state: Mapping[str, Any]) -> bool:
    """Whether ``tree`` has every entry of the live state, at every level of plain dicts (if not,
    ``tree_for`` looks in the other saving ranks' trees)."""

    def walk(node: JSON, live: Any) -> bool:
        if not _plain_dict(node) or not isinstance(live, Mapping):
            return True
        return all(k in node and walk(node[k], v) for k, v in live.items())

    return walk(tree, {k: v.state_dict() if is_stateful(v) else v for k, v in state.items()})


def add_entries(
    state: Mapping[str, Any], manifest: Manifest, others: bool | Callable[[list[str]], Iterable[str]], *, where: str
) -> None:
    """Add to ``state`` (as None, to be filled) the saved top-level entries ``others`` selects."""
    names = sorted({k for t in manifest.trees if _plain_dict(t) for k in t} - set(state))
    chosen = [n for n in others(names) if n in names] if callable(others) else names
    if not chosen:
        return
    if not isinstance(state, MutableMapping):
        raise TypeError(f"{where}: restoring other ranks' entries needs a mutable state mapping")
    for name in chosen:
        state[name] = None


def _merge(node: JSON, others: list[JSON], live: Any, *, only_live: bool) -> JSON:
    if not _plain_dict(node) or not isinstance(live, Mapping):
        return node
    out = {k: v for k, v in node.items() if k in live or not only_live}
    for k, v in live.items():
        subs = [o[k] for o in others if _plain_dict(o) and k in o]
        if k in out:
            out[k] = _merge(out[k], subs, v, only_live=only_live)
        elif subs:
            out[k] = _merge(subs[0], subs[1:], v, only_live=only_live)
    return out


def _plain_dict(node: JSON) -> bool:
    return isinstance(node, dict) and not (len(node) == 1 and next(iter(node)).startswith("$"))


def prepare(
    state: Mapping[str, Any],
    manifest: Manifest,
    tree: JSON,
    *,
    strict: bool,
    allow_pickle: bool,
    where: str,
    fresh: bool = False,
    before_allocating: Callable[[ArrayRecord], None] | None = None,
    before_refusing: Callable[[ArrayRecord], None] | None = None,
) -> tuple[list[ReadItem], dict[str, Any]]:
    """Match the saved tree to the state: what to read into which tensor, and the decoded values.
    ``before_allocating`` is called with the record of each new array before it is allocated (a
    fresh load checks there that its size is backed by the step's files); ``before_refusing`` with
    the record of an array whose shape or dtype the live value does not have, before the state is
    refused for it (a restore checks there that the step's own files agree with the record: one
    that they contradict is the step's damage, raised as ``CorruptCheckpointError``, not the state's).

    Raises before anything is overwritten if a shape, dtype or key does not fit. With ``fresh``,
    ``state`` is an empty dict to take everything the tree holds, as new CPU tensors (``load``).
    """
    if not isinstance(tree, dict):
        raise CorruptCheckpointError(f"{where}: manifest tree is not an object")
    items: list[ReadItem] = []

    def source(tag: str, path: Any, live: Any) -> Any:
        rec = manifest.arrays.get(path) if isinstance(path, str) else None
        if rec is None:
            raise CorruptCheckpointError(f"{where}: the state refers to array {path!r}, which the manifest lacks")
        here = f"{where}: {path}"
        # The live value decides how it is filled, as a tensor's device does: a tensor or numpy
        # array of the saved shape and dtype is written into, whichever of the two was saved.
        try:
            view = _numpy_view(live, rec, where=here) if isinstance(live, np.ndarray) else None
            live_placed = placement_of(live if view is None else view, where=here)
            if live_placed is not None:
                local, global_shape, offsets = live_placed
                if global_shape != rec.shape or dtype_name(local.dtype) != rec.dtype:
                    raise IncompatibleStateError(
                        f"{here}: checkpoint has {rec.dtype}{list(rec.shape)}, "
                        f"the state to restore into has {dtype_name(local.dtype)}{list(global_shape)}"
                    )
        except IncompatibleStateError:
            if before_refusing is not None:
                before_refusing(rec)
            raise
        if live_placed is not None:
            items.append(ReadItem(rec, local, offsets, fresh=isinstance(live, FreshShard), borrowed=view is not None))
            return live
        if before_allocating is not None:
            before_allocating(rec)
        dest = _allocate(rec, where=here)
        items.append(ReadItem(rec, dest, (0,) * dest.dim(), fresh=True))
        return dest.numpy() if tag == "$ndarray" or isinstance(live, np.ndarray) else dest

    keys = list(tree) if fresh else list(state)
    missing = [k for k in keys if k not in tree]
    if missing and strict:
        raise IncompatibleStateError(
            f"{where}: the checkpoint has no entry for {', '.join(map(repr, missing))} "
            f"(it holds: {', '.join(map(repr, tree))})"
        )
    decoded: dict[str, Any] = {}
    for key in keys:
        if key not in tree:
            continue
        live = None if fresh else state[key]
        module = live if isinstance(live, torch.nn.Module) else None
        if is_stateful(live):
            live = live.state_dict()
        if strict and live is not None:
            _check_no_missing_tensors(live, tree[key], key, where)
        if module is not None:
            _check_module_keys(module, tree[key], key, where)
        decoded[key] = decode(tree[key], source, allow_pickle=allow_pickle, where=f"{where}: {key}", live=live)
    return items, decoded


def _check_module_keys(module: torch.nn.Module, saved: JSON, key: str, where: str) -> None:
    """Refuse, before anything is read or overwritten, a saved state that ``module.load_state_dict``
    would refuse (it insists on its own keys exactly, whatever ``strict`` says for the rest)."""
    if not _plain_dict(saved):
        raise IncompatibleStateError(f"{where}: {key}: the checkpoint holds no module state for it")
    assert isinstance(saved, dict)
    own = set(module.state_dict())
    missing, unexpected = sorted(own - set(saved)), sorted(set(saved) - own)
    if missing or unexpected:
        why = "; ".join(
            ([f"missing from the checkpoint: {some([repr(n) for n in missing])}"] if missing else [])
            + ([f"in the checkpoint, not in the module: {some([repr(n) for n in unexpected])}"] if unexpected else [])
        )
        raise IncompatibleStateError(
            f"{where}: {key}: {type(module).__name__}.load_state_dict would refuse the saved state ({why})"
        )


def apply(state: Mapping[str, Any], decoded: dict[str, Any], *, where: str, strict: bool = True) -> None:
    """Hand the decoded values (their tensors now filled) to the state. A Stateful that refuses
    its value (``prepare`` checks what it can beforehand) is the library's error, naming it. Not
    ``strict``, the entries of the state's plain dicts that the checkpoint does not name are left
    as they were (``strict``: removed, as the saved dicts lack them)."""
    for key, value in decoded.items():
        live = state.get(key)
        if is_stateful(live):
            try:
                live.load_state_dict(value)
            except (RuntimeError, ValueError, KeyError, TypeError) as e:
                raise IncompatibleStateError(
                    f"{where}: {key}: {type(live).__name__}.load_state_dict refused the saved state: {e}"
                ) from e
        elif not _update_in_place(live, value, strict=strict):
            if not isinstance(state, MutableMapping):
                raise IncompatibleStateError(
                    f"{where}: cannot restore {key!r} in place and the state mapping is read-only"
                )
            state[key] = value


def _check_no_missing_tensors(live: Any, saved: JSON, key: str, where: str) -> None:
    probe = _Encoder(allow_pickle=True)
    probe.encode(live, [key], lambda t: False)
    saved_paths = set()
    for path in tensor_paths(saved):
        if not isinstance(path, str):  # a hand-edited tree: a list or object where an array path belongs
            raise CorruptCheckpointError(
                f"{where}: {key}: an array is referred to by a {type(path).__name__}, not a path"
            )
        saved_paths.add(path)
    missing = [leaf.path for leaf in probe.leaves if leaf.path not in saved_paths]
    if missing:
        raise IncompatibleStateError(f"{where}: tensors of the state are missing from the checkpoint: {some(missing)}")


def _update_in_place(live: Any, new: Any, *, strict: bool) -> bool:
    """Make ``live`` hold ``new`` without replacing it. False when only replacement works. A dict's
    entries ``new`` does not name are removed where ``strict`` (the state's plain dicts become the
    saved ones; ``prepare`` has refused a tensor the checkpoint lacks), else left as they were: the
    checkpoint says nothing of them (a restore into a grown state, a tensor an in-place fallback
    names as holding parts of a damaged step)."""
    if live is new:
        return True
    if isinstance(live, dict) and isinstance(new, dict):
        if strict:
            for k in [k for k in live if k not in new]:
                del live[k]
        for k, v in new.items():
            if k not in live or not _update_in_place(live[k], v, strict=strict):
                live[k] = v
        return True
    if isinstance(live, list) and isinstance(new, list):
        if len(live) != len(new):
            live[:] = new
            return True
        for i, v in enumerate(new):
            if not _update_in_place(live[i], v, strict=strict):
                live[i] = v
        return True
    return False


def _numpy_view(live: np.ndarray, rec: ArrayRecord, *, where: str) -> torch.Tensor | None:
    """A tensor over a live numpy array's own memory, for a restore to fill it in place (the
    array stays the object the state and its owner hold); None where it cannot be written
    (read-only) or viewed (negative strides): then it is replaced by a new array. An array of
    another shape or dtype (an object array, a byte order torch cannot view) is refused, as a
    tensor is, before torch is asked to view it."""
    if live.shape != rec.shape or live.dtype.name != rec.dtype or not live.dtype.isnative:
        raise IncompatibleStateError(
            f"{where}: checkpoint has {rec.dtype}{list(rec.shape)}, "
            f"the state to restore into has a numpy array of {live.dtype}{list(live.shape)}"
        )
    if not live.flags.writeable:
        return None
    try:
        return torch.from_numpy(live)
    except ValueError:
        return None


def _allocate(rec: ArrayRecord, *, where: str) -> torch.Tensor:
    """A new tensor for an array a fresh load returns, sized from the manifest (bounded there to
    2**48 elements): one too large for this machine is the library's error, not the allocator's."""
    try:
        return torch.empty(rec.shape, dtype=torch_dtype(rec.dtype))
    except (RuntimeError, MemoryError) as e:
        nbytes = rec.numel * torch.empty((), dtype=torch_dtype(rec.dtype)).element_size()
        raise StagingError(
            f"{where}: cannot allocate {nbytes:,} bytes for its {rec.dtype}{list(rec.shape)} "
            f"({type(e).__name__}); the manifest may be damaged, or the array larger than this machine's memory"
        ) from None
