"""Megatron-core ShardedTensors as tiercheck arrays: the mapping, apart from Megatron's strategy classes.

Plain functions on Megatron's ShardedTensor fields (key, global shape and offset, replica id,
prepended axes), so that another seam (0.17's ``TorchDistSaveShardedStrategy`` subclass or a DCP
storage writer) reuses them unchanged. See ``tiercheck.integrations.megatron`` for the rules.
"""


from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from tiercheck import Shard
from tiercheck.errors import CorruptCheckpointError, IncompatibleStateError, UnsupportedValueError
from tiercheck.seam import dtype_name

__all__ = ["KeyLayout", "layouts_of", "merge_layouts", "shard_pieces", "tensor_state"]


# ------------------------------------------------------------------------------- the mapping


@dataclass(frozen=True, slots=True)
class KeyLayout:
    """How the global tensor of one Megatron key is kept as tiercheck arrays.

    ``prepend`` leading axes are split into one array per index (layers, experts); after them, with
    ``parts = (axis, n)``, the axis is cut into ``n`` equal parts kept as separate arrays.
    """

    dtype: str
    shape: tuple[int, ...]
    prepend: int = 0
    parts: tuple[int, int] | None = None

    def to_json(self) -> list[Any]:
        return [self.dtype, list(self.shape), self.prepend, list(self.parts) if self.parts else None]

    @classmethod
    def from_json(cls, doc: Any, *, where: str) -> KeyLayout:
        try:
            dtype, shape, prepend, parts = doc
            a, n = parts if parts is not None else (0, 0)
            return cls(str(dtype), tuple(int(s) for s in shape), int(prepend), (int(a), int(n)) if parts else None)
        except (TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{where}: malformed tensor layout {doc!r} ({e})") from None


def _check_box(st: Any) -> None:
    if getattr(st, "flattened_range", None) is not None:
        raise UnsupportedValueError(
            f"ShardedTensor {st.key!r} is flattened (flattened_range={st.flattened_range}): Megatron's legacy "
            "distributed-optimizer formats keep slices of a flattened tensor, which are no box of the global "
            "tensor. Save the optimizer with metadata={'distrib_optim_sharding_type': 'fully_reshardable'}"
        )


def layouts_of(tensors: Iterable[Any]) -> dict[str, KeyLayout]:
    """Each key's layout as this rank's ``ShardedTensor``s show it (``merge_layouts`` joins the ranks')."""
    first: dict[str, Any] = {}
    groups: dict[tuple[str, tuple[int, ...]], list[Any]] = defaultdict(list)
    for st in tensors:
        _check_box(st)
        f = first.setdefault(st.key, st)
        if (st.dtype, tuple(st.global_shape), st.prepend_axis_num) != (
            f.dtype,
            tuple(f.global_shape),
            f.prepend_axis_num,
        ):
            raise IncompatibleStateError(
                f"ShardedTensor {st.key!r}: pieces on this rank disagree on the global tensor "
                f"({f.dtype}{list(f.global_shape)}, {f.prepend_axis_num} prepended axes vs "
                f"{st.dtype}{list(st.global_shape)}, {st.prepend_axis_num})"
            )
        groups[(st.key, tuple(st.global_offset[: st.prepend_axis_num]))].append(st)
    parts: dict[str, tuple[int, int] | None] = {}
    for (key, _), pieces in groups.items():
        found = _equal_parts(key, pieces)
        if parts.setdefault(key, found) != found:
            raise UnsupportedValueError(f"ShardedTensor {key!r}: layers of it are split differently on this rank")
    return {
        key: KeyLayout(dtype_name(st.dtype), tuple(st.global_shape), st.prepend_axis_num, parts.get(key))
        for key, st in first.items()
    }


def _equal_parts(key: str, pieces: list[Any]) -> tuple[int, int] | None:
    """None for one piece per layer; (axis, n) when n pieces lie one in each of n equal parts of one axis
    (SwiGLU's gate and up halves); else an error."""
    p = pieces[0].prepend_axis_num
    shape = tuple(pieces[0].global_shape)[p:]
    boxes = sorted({(tuple(st.global_offset)[p:], tuple(st.local_shape)) for st in pieces})
    n = len(boxes)
    if n == 1:
        return None
    differ = [d for d in range(len(shape)) if len({o[d] for o, _ in boxes}) > 1]
    if len(differ) == 1:
        a = differ[0]
        size = shape[a] // n
        if size > 0 and shape[a] % n == 0:
            boxes.sort(key=lambda b: b[0][a])
            if all(j * size <= o[a] and o[a] + s[a] <= (j + 1) * size for j, (o, s) in enumerate(boxes)):
                return a, n
    raise UnsupportedValueError(
        f"ShardedTensor {key!r}: this rank holds {n} pieces of it in one layer "
        f"(offsets {[list(o) for o, _ in boxes]}) that do not lie one in each equal part of one axis, "
        "so they cannot be named independently of the parallel layout"
    )


def merge_layouts(per_rank: Iterable[dict[str, KeyLayout]]) -> dict[str, KeyLayout]:
    """Every rank's layouts as one: the same on every rank, so all name the arrays alike."""
    out: dict[str, KeyLayout] = {}
    for rank, layouts in enumerate(per_rank):
        for key, lay in layouts.items():
            have = out.setdefault(key, lay)
            if (have.dtype, have.shape, have.prepend) != (lay.dtype, lay.shape, lay.prepend):
                raise IncompatibleStateError(
                    f"ShardedTensor {key!r}: rank {rank} has {lay.dtype}{list(lay.shape)} with {lay.prepend} "
                    f"prepended axes, another rank {have.dtype}{list(have.shape)} with {have.prepend}"
                )
            if lay.parts is not None and have.parts != lay.parts:
                if have.parts is not None:
                    raise UnsupportedValueError(
                        f"ShardedTensor {key!r}: ranks split it into different parts ({have.parts} vs {lay.parts})"
                    )
                out[key] = lay
    return out


def shard_pieces(
    st: Any, layout: KeyLayout, data: torch.Tensor | None = None, *, clip: bool = False
) -> list[tuple[tuple[str, ...], Shard]]:
    """``st``'s local tensor (or ``data``) as tiercheck Shards: (place under the key, Shard) pairs.

    Every Shard's local tensor is a view of the data, so restoring fills the data in place. With ``clip``
    (loading), a tensor marked ``allow_shape_mismatch`` whose stored global shape differs gets the part of
    it the checkpoint covers; the rest keeps its values.
    """
    _check_box(st)
    full = st.data if data is None else data
    for _ in range(st.prepend_axis_num):
        full = full.unsqueeze(0)
    offs = tuple(int(o) for o in st.global_offset)
    shape = layout.shape
    if len(shape) != len(offs) or (tuple(st.global_shape) != shape and not (clip and st.allow_shape_mismatch)):
        raise IncompatibleStateError(
            f"ShardedTensor {st.key!r}: the checkpoint holds a global tensor of shape {list(shape)}, "
            f"the state asks for {list(st.global_shape)}"
        )
    for d in range(len(shape)):
        full = full.narrow(d, 0, max(0, min(full.shape[d], shape[d] - offs[d])))
    if full.numel() == 0 and math.prod(shape) > 0:
        return []  # nothing of the stored tensor (a clipped piece wholly outside it)
    p = layout.prepend
    out: list[tuple[tuple[str, ...], Shard]] = []
    for idx in itertools.product(*(range(offs[d], offs[d] + full.shape[d]) for d in range(p))):
        piece = full[tuple(i - offs[d] for d, i in enumerate(idx))] if p else full
        here, inner = tuple(str(i) for i in idx), shape[p:]
        if layout.parts is None:
            out.append((here, Shard(piece, global_shape=inner, offsets=offs[p:])))
            continue
        a, n = layout.parts
        size = inner[a] // n
        lo, hi = offs[p + a], offs[p + a] + piece.shape[a]
        for j in range(lo // size, -(-hi // size)):
            start, stop = max(lo, j * size), min(hi, (j + 1) * size)
            o, g = list(offs[p:]), list(inner)
            o[a], g[a] = start - j * size, size
            out.append(
                ((*here, f"part{j}"), Shard(piece.narrow(a, start - lo, stop - start), global_shape=g, offsets=o))
            )
    return out


def _put(tree: dict[str, Any], place: tuple[str, ...], shard: Shard) -> Shard | None:
    """Place ``shard`` in the nested state; returns the Shard already there (a second copy on this rank)."""
    node = tree
    for name in place[:-1]:
        nxt = node.setdefault(name, {})
        if not isinstance(nxt, dict):
            raise IncompatibleStateError(f"ShardedTensor {place[0]!r}: pieces at {list(place)} clash")
        node = nxt
    have = node.get(place[-1])
    if have is None:
        node[place[-1]] = shard
        return None
    if not isinstance(have, Shard) or (have.offsets, have.local.shape) != (shard.offsets, shard.local.shape):
        raise IncompatibleStateError(f"ShardedTensor {place[0]!r}: two different pieces at {list(place[1:])}")
    return have


def tensor_state(
    tensors: list[Any], layouts: dict[str, KeyLayout], *, loading: bool, where: str
) -> tuple[dict[str, Any], dict[int, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The ``tensors`` entry of tiercheck's state; each ShardedTensor's local tensor (by id); and, when
    loading, (copy, original) pairs of pieces a rank holds twice, to fill after the restore."""
    tree: dict[str, Any] = {}
    data: dict[int, torch.Tensor] = {}
    twins: list[tuple[torch.Tensor, torch.Tensor]] = []
    missing = sorted({st.key for st in tensors if st.key not in layouts})
    if missing:
        raise IncompatibleStateError(f"{where}: the checkpoint has no tensor {', '.join(map(repr, missing))}")
    for st in tensors:
        t = st.data
        if t is None and loading:
            t = torch.empty(st.local_shape, dtype=st.dtype)
        data[id(st)] = t
        for place, shard in shard_pieces(st, layouts[st.key], t, clip=loading):
            first = _put(tree, (st.key, *place), shard)
            if first is not None and first.local is not shard.local:
                twins.append((shard.local, first.local))
    return tree, data, twins
