"""How a rank's tensor maps onto a global tensor: ``Shard`` and DTensor support.

A tensor of the state is either plain (replicated: every rank that has it holds all of it), a
``torch.distributed.tensor.DTensor`` (its placements say which slice this rank holds), or a
``Shard`` wrapping a local tensor with its place in the global tensor: Megatron-style tensor
parallel shards, pipeline-stage parameters under global names, ZeRO flat partitions.
"""


from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from tiercheck.errors import InvalidArgumentError, UnsupportedValueError


@dataclass(frozen=True, slots=True, init=False)
class Shard:
    """This rank's slice ``global[offsets[0]:offsets[0]+local.shape[0], ...]`` of a global tensor.

    Ranks holding the same slice are replicas: one of them writes it. ``restore()`` fills
    ``local`` in place with whatever slice it describes then, from any saved layout.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __init__(self, local: torch.Tensor, *, global_shape: Any, offsets: Any) -> None:
        if not isinstance(local, torch.Tensor):
            raise UnsupportedValueError(f"Shard wraps a tensor, not {type(local).__qualname__}")
        gshape = tuple(int(d) for d in global_shape)
        offs = tuple(int(o) for o in offsets)
        if not (len(gshape) == len(offs) == local.dim()):
            raise InvalidArgumentError(
                f"Shard: global_shape {list(gshape)}, offsets {list(offs)} and the local tensor's "
                f"shape {list(local.shape)} must have the same number of dimensions"
            )
        for d, (o, n, g) in enumerate(zip(offs, local.shape, gshape, strict=True)):
            if o < 0 or o + n > g:
                raise InvalidArgumentError(
                    f"Shard: dimension {d}: slice [{o}, {o + n}) does not fit in the global extent {g}"
                )
        object.__setattr__(self, "local", local)
        object.__setattr__(self, "global_shape", gshape)
        object.__setattr__(self, "offsets", offs)

    def __repr__(self) -> str:
        return (
            f"Shard({self.local.dtype} {list(self.local.shape)} at {list(self.offsets)} of {list(self.global_shape)})"
        )


def is_dtensor(obj: object) -> bool:
    # A DTensor exists only once its module is imported; importing it ourselves would cost ~1 s.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(obj, module.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The storage-backed tensor of a plain tensor or a DTensor."""
    return t._local_tensor if is_dtensor(t) else t  # type: ignore[attr-defined, no-any-return]


def placement_of(obj: Any, *, where: str) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]] | None:
    """``(local tensor, global shape, offsets)`` for a Shard, DTensor or plain tensor; else None."""
    if isinstance(obj, Shard):
        return obj.local.detach(), obj.global_shape, obj.offsets
    if type(obj) not in (torch.Tensor, torch.nn.Parameter) and is_dtensor(obj):  # plain ones, most, skip the check
        if any(p.is_partial() for p in obj.placements):
            raise UnsupportedValueError(
                f"{where}: a DTensor with a Partial placement holds unreduced values; "
                "redistribute it to Shard or Replicate before checkpointing"
            )
        if any(type(p).__name__ == "_StridedShard" for p in obj.placements[1:]):
            # torch reports the wrong slice for these (only FSDP2's strided first dimension is right).
            raise UnsupportedValueError(
                f"{where}: a DTensor with a strided shard placement after the first mesh dimension "
                f"({obj.placements}) is not supported; redistribute it first"
            )
        local = obj._local_tensor.detach()
        (meta,) = obj.__create_chunk_list__()
        return local, tuple(obj.shape), tuple(int(o) for o in meta.offsets)
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return t, tuple(t.shape), (0,) * t.dim()
    return None


def per_rank(tensor: torch.Tensor, *, process_group: Any = None) -> Shard:
    """Mark a tensor as this rank's own, not a replica: e.g. a per-rank RNG state or data position.

    Plain tensors are taken as replicated (as by torch.distributed.checkpoint): only one rank's copy
    is written. ``per_rank(t)`` is row ``rank`` of a ``[world_size, *t.shape]`` tensor instead, so
    every rank's value is kept; restore it on the same world size (``.local[0]`` is the value).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    else:
        rank, world = 0, 1
    return Shard(tensor.unsqueeze(0), global_shape=(world, *tensor.shape), offsets=(rank, *([0] * tensor.dim())))
