"""Where DCP's read items lie in a saved tensor, and which of DCP's tensors a restore may read straight into.

Plain functions on DCP's ``ReadItem`` regions and on tensors' memory, used by
:class:`~tiercheck.integrations.dcp.reader.TiercheckReader`: it restores the smallest box holding a tensor's
items (:func:`read_box`), straight into DCP's tensor where :func:`own_target` allows it, else into a new buffer
copied in once every chunk is verified.
"""


from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["item_start", "memory_span", "own_target", "read_box", "state_memory"]


def read_box(items: list[ReadItem]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The smallest box of the global tensor holding every item's region."""
    starts = [item_start(i) for i in items]
    lo = tuple(min(col) for col in zip(*starts, strict=True)) if starts[0] else ()
    ends = [[s + n for s, n in zip(st, i.lengths, strict=True)] for st, i in zip(starts, items, strict=True)]
    hi = tuple(max(col) for col in zip(*ends, strict=True)) if ends[0] else ()
    return lo, hi


def item_start(item: ReadItem) -> list[int]:
    """Where an item's region starts in the global tensor."""
    chunk = item.storage_index.offset or torch.Size([0] * len(item.lengths))
    return [s + o for s, o in zip(chunk, item.storage_offsets, strict=True)]


def own_target(
    targets: list[torch.Tensor], shape: list[int], dtype: torch.dtype, state: list[tuple[int, int]]
) -> bool:
    """Whether restore may read straight into DCP's tensor: the only one of its fqn, a CPU tensor of the stored
    dtype and of the box's shape, sharing no memory with the planner's state dict. DCP's contract
    (``LoadPlanner.resolve_tensor``) is that such a tensor reaches the state only through ``commit_tensor``,
    which is called once the restore succeeded."""
    if len(targets) != 1:
        return False
    t = targets[0]
    if type(t) is not torch.Tensor or t.device.type != "cpu" or t.dtype != dtype or list(t.shape) != shape:
        return False
    lo, hi = memory_span(t)
    return hi > lo and not any(a < hi and lo < b for a, b in state)


def state_memory(value: Any) -> list[tuple[int, int]] | None:
    """The memory every tensor of the planner's state dict lies in (DTensors' and ShardedTensors' local
    tensors), or None where that cannot be told: then no target counts as made for the load."""
    if not isinstance(value, Mapping):
        return None
    spans: list[tuple[int, int]] = []
    todo: list[Any] = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, Mapping):
            todo.extend(v.values())
        elif isinstance(v, list | tuple):
            todo.extend(v)
        elif callable(getattr(v, "local_shards", None)):  # a ShardedTensor (a Tensor with no storage of its own)
            todo.extend(s.tensor for s in v.local_shards())
        elif hasattr(v, "__tensor_flatten__"):  # a wrapper subclass (DTensor, float8, ...): its inner tensors
            todo.extend(getattr(v, name) for name in v.__tensor_flatten__()[0])
        elif isinstance(v, torch.Tensor):
            try:
                spans.append(memory_span(v))
            except (RuntimeError, NotImplementedError):  # some other subclass without a plain storage
                return None
    return spans


def memory_span(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()
