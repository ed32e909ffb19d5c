"""Where a restore's bytes land before the state sees them: each live destination is swapped for
host memory (new, or carved out of the idle save pool), and once every chunk is verified the
staged data is handed to the live tensors (``copy_in``): all or nothing."""



from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiercheck.dist.assign import Need
from tiercheck.format.manifest import ArrayRecord
from tiercheck.state.staging import page_aligned_empty
from tiercheck.tiers.local import BLOCK, DIRECT_MIN_BYTES


@dataclass(frozen=True, slots=True)
class ReadItem:
    record: ArrayRecord
    dest: torch.Tensor  # shape and dtype already checked; any device
    offsets: tuple[int, ...]  # where dest sits in the global array
    fresh: bool = False  # dest is a new tensor, not (part of) the live state

    @property
    def need(self) -> Need:
        return Need(self.record.path, self.offsets, tuple(self.dest.shape))


def staged(
    items: Sequence[ReadItem], arena: torch.Tensor | None = None
) -> tuple[list[ReadItem], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The same reads with every live destination swapped for a host tensor, and the (live,
    staged) pairs to ``copy_in`` once every chunk is verified: a restore that fails part-way
    leaves the live state as it was. The host tensors are carved out of ``arena`` (uint8 memory
    the process holds resident, at least ``staging_bytes(items)``) where given, else new; new ones
    for CUDA destinations are page-locked."""
    out: list[ReadItem] = []
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    pos = 0
    for item in items:
        if item.fresh:
            out.append(item)
            continue
        live = item.dest
        n = live.numel() * live.element_size()
        if arena is not None and (not live.is_cuda or arena.is_pinned()):
            pos = _arena_align(pos, n)
            buf = arena[pos : pos + n].view(live.dtype).view(tuple(live.shape))
            pos += n
        elif not live.is_cuda:
            buf = host_read_buffer(tuple(live.shape), live.dtype)
        else:  # page-locked memory starts on a page as it is
            buf = torch.empty(tuple(live.shape), dtype=live.dtype, pin_memory=True)
        out.append(ReadItem(item.record, buf, item.offsets, fresh=True))
        pairs.append((live, buf))
    return out, pairs


def host_read_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """New host memory for a restore to read an array into: a big one on a page, so that its
    chunks can skip the page cache (see ``LocalTier.read_vectored``)."""
    if math.prod(shape) * dtype.itemsize >= DIRECT_MIN_BYTES:
        return page_aligned_empty(shape, dtype)
    return torch.empty(shape, dtype=dtype)


def staging_bytes(items: Sequence[ReadItem]) -> int:
    """The arena ``staged`` needs for ``items``."""
    pos = 0
    for i in items:
        if not i.fresh:
            n = i.dest.numel() * i.dest.element_size()
            pos = _arena_align(pos, n) + n
    return pos


def _arena_align(pos: int, n: int) -> int:
    """Where ``n`` bytes go in an arena from ``pos`` on: a big array on a block (its chunks can
    skip the page cache), the others on 64 bytes (any dtype's alignment, whole cache lines)."""
    align = BLOCK if n >= DIRECT_MIN_BYTES else 64
    return -(-pos // align) * align


def copy_in(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, swap: bool = True) -> None:
    """Hand verified, staged data to the live tensors (see ``staged``): with ``swap`` (staged in
    new memory, not an arena), a live CPU tensor that is the whole of its memory takes the staged
    memory over (``_swappable``: every tensor that shares that memory, a module's parameter behind a
    ``state_dict()`` alias, sees the restored values, and nothing is copied); the others are copied
    into."""
    with torch.no_grad():
        for live, buf in pairs:
            if swap and _swappable(live, buf):
                live.untyped_storage()._swap_data_ptr_(buf.untyped_storage())  # type: ignore[attr-defined]
                torch.autograd.graph.increment_version(live)  # as copy_ would: autograd sees the change
            else:
                live.copy_(buf, non_blocking=live.is_cuda)
    if any(live.is_cuda for live, _ in pairs):
        torch.cuda.synchronize()


def _swappable(live: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether ``live``'s memory can take ``buf``'s over instead of a copy: on the CPU, ordinary
    memory (not page-locked, not shared with other processes), and holding ``live`` alone, laid
    out as ``buf`` is (contiguous from its start). A tensor that is part of a larger buffer (a
    flat parameter, a view) is copied into. Skipped where torch lacks the swap."""
    if live.device.type != "cpu" or type(live) not in (torch.Tensor, torch.nn.Parameter):
        return False
    if not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        return False
    storage = live.untyped_storage()
    nbytes = live.numel() * live.element_size()
    return (
        nbytes > 0
        and live.storage_offset() == 0
        and live.is_contiguous()
        and storage.nbytes() == nbytes == buf.untyped_storage().nbytes()
        and not storage.is_shared()
        and not live.is_pinned()  # the storage's own is_pinned() builds a tensor to ask: 3x as long
    )
