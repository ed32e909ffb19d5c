"""Where a restore's bytes land before the state sees them: each live destination is swapped for
new memory (host memory, or spare memory on the GPU for a GPU tensor) or for a piece of the idle
save pool, and once every chunk is verified the staged data is handed to the live tensors
(``copy_in``): all or nothing."""

from __future__ import annotations

import contextlib
import math
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from tiercheck.cluster.assign import Need, Read
from tiercheck.format.codec import CHECKSUM_BYTES, chunk_nbytes
from tiercheck.format.layout import Chunk, overlap
from tiercheck.format.manifest import ArrayRecord
from tiercheck.restore.to_device import Ring, ring_worthy
from tiercheck.state.flatten import torch_dtype
from tiercheck.state.staging import aligned_empty, page_aligned_empty, pinned_empty
from tiercheck.tiers.base import Tier
from tiercheck.tiers.local import BLOCK, DIRECT_MIN_BYTES


@dataclass(frozen=True, slots=True)
class ReadItem:
    record: ArrayRecord
    dest: torch.Tensor  # shape and dtype already checked; any device
    offsets: tuple[int, ...]  # where dest sits in the global array
    fresh: bool = False  # dest is a new tensor, not (part of) the live state
    borrowed: bool = False  # dest views memory another library owns (a numpy array's): copied into, never swapped
    deferred: bool = False  # dest is live, every chunk of it in shared memory: filled from there once all verified

    @property
    def need(self) -> Need:
        return Need(self.record.path, self.offsets, tuple(self.dest.shape))


StagedCopy = tuple[torch.Tensor, torch.Tensor, bool]
"""(live tensor, the new memory its data is read into, whether the live tensor may take that memory
over or must be copied into)."""


def staged(items: Sequence[ReadItem], arena: torch.Tensor | None = None) -> tuple[list[ReadItem], list[StagedCopy]]:
    """The same reads with every live destination swapped for a new tensor, and the (live,
    staged, ownable) triples to ``copy_in`` once every chunk is verified: a restore that fails part-way
    leaves the live state as it was. The tensors are carved out of ``arena`` (uint8 memory the
    process holds resident, at least ``staging_bytes(items)``) where given, else new. A GPU
    tensor is staged on its GPU while the GPU has room (``device_room``; chunks are copied up as
    they are verified, see ``read.move_chunks``), the rest in new host memory, copied up at the end
    through a few page-locked buffers (``to_device.Ring``). That memory is not page-locked itself:
    pinning runs at 1-3 GB/s, slower than the one copy it would speed up."""
    out: list[ReadItem] = []
    pairs: list[StagedCopy] = []
    pos = 0
    room = device_room(items) if arena is None or not arena.is_pinned() else {}
    for item in items:
        if item.fresh or item.deferred:
            out.append(item)
            continue
        live = item.dest
        n = live.numel() * live.element_size()
        if arena is not None and (not live.is_cuda or arena.is_pinned()):
            pos = _arena_align(pos, n)
            buf = arena[pos : pos + n].view(live.dtype).view(tuple(live.shape))
            pos += n
        elif live.is_cuda and n <= room.get(live.device, 0):
            buf = torch.empty(tuple(live.shape), dtype=live.dtype, device=live.device)
            room[live.device] -= n
        else:
            buf = host_read_buffer(tuple(live.shape), live.dtype)
        out.append(ReadItem(item.record, buf, item.offsets, fresh=True))
        pairs.append((live, buf, not item.borrowed))
    return out, pairs


DEVICE_HEADROOM = 1 << 30  # GPU memory a restore leaves free, at least (and 5% of the GPU's)


def device_room(items: Sequence[ReadItem]) -> dict[torch.device, int]:
    """The bytes each GPU holding live tensors of ``items`` can stage: its free memory (torch's
    cached blocks included) less a headroom for the training that follows."""
    room = {}
    for device in {i.dest.device for i in items if not i.fresh and i.dest.is_cuda}:
        free, total = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        room[device] = max(0, free - max(DEVICE_HEADROOM, total // 20))
    return room


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
        if not (i.fresh or i.deferred):
            n = i.dest.numel() * i.dest.element_size()
            pos = _arena_align(pos, n) + n
    return pos


def _arena_align(pos: int, n: int) -> int:
    """Where ``n`` bytes go in an arena from ``pos`` on: a big array on a block (its chunks can
    skip the page cache), the others on 64 bytes (any dtype's alignment, whole cache lines)."""
    align = BLOCK if n >= DIRECT_MIN_BYTES else 64
    return -(-pos // align) * align


def copy_in(pairs: Sequence[StagedCopy], *, swap: bool = True) -> int:
    """Hand verified, staged data to the live tensors (see ``staged``): with ``swap`` (staged in
    new memory, not an arena), a live CPU tensor that is the whole of its memory takes the staged
    memory over (``_swappable``: every tensor that shares that memory, a module's parameter behind a
    ``state_dict()`` alias, sees the restored values, and nothing is copied); the others are copied
    into. So is a tensor over a numpy array's memory (not ownable): the array would go on pointing
    at its old memory, which only the tensor's storage would have let go. A GPU tensor staged in
    ordinary host memory goes up through a ``Ring`` of page-locked buffers. Returns the bytes that
    went up that way."""
    rings: dict[torch.device, Ring] = {}
    try:
        with torch.no_grad():
            for live, buf, ownable in pairs:
                if swap and ownable and _swappable(live, buf):
                    live.untyped_storage()._swap_data_ptr_(buf.untyped_storage())  # type: ignore[attr-defined]
                    torch.autograd.graph.increment_version(live)  # as copy_ would: autograd sees the change
                elif ring_worthy(live, buf):
                    if live.device not in rings:
                        rings[live.device] = Ring(live.device)
                    rings[live.device].put(live, buf)  # copies into views of ``live``: its version moves on
                else:
                    live.copy_(buf, non_blocking=live.is_cuda)
    finally:
        for ring in rings.values():
            ring.close()
        for device in {live.device for live, _, _ in pairs if live.is_cuda}:
            # Only these copies are waited for (the staged memory and the rings' buffers are freed
            # after), never the whole device: the current stream's own event, not torch.cuda.synchronize().
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            done.synchronize()
    return sum(ring.copied for ring in rings.values())


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


def whole_blocks(nbytes: int) -> int:
    """``nbytes`` rounded up to whole blocks of the local tier's direct I/O."""
    return -(-nbytes // BLOCK) * BLOCK


def run_span(records: dict[str, ArrayRecord], run: Sequence[Read]) -> tuple[str, int, int] | None:
    """Where a run of chunks lies in its pack: (file, start, end), from the block its first chunk
    starts in to the end of its last chunk's checksum; None for a run read from the remote tier,
    or a chunk the manifest gives no offset (read alone, which reports it)."""
    first, last = run[0], run[-1]
    head, tail = records[first.path], records[last.path]
    if first.remote or first.chunk.key not in head.offsets or last.chunk.key not in tail.offsets:
        return None
    file, start = head.location(first.chunk.key)
    _, last_offset = tail.location(last.chunk.key)
    end = last_offset + chunk_nbytes(records[last.path]) + CHECKSUM_BYTES
    return file, start // BLOCK * BLOCK, end


class Bounce:
    """Page-locked buffers, each starting on a block, that runs bound for one GPU are read into:
    a few runs' worth per restore (not a whole state's worth of page-locked memory, which costs a
    fresh process as long as the reads). Each is made when a reader first finds none free:
    pinning runs at 1-3 GB/s (a fresh H200 host took 0.23-0.28 s for five buffers), so the first
    read starts once one buffer is made, and the others are pinned while it reads. A buffer holds
    a run's data (``nbytes``, whole blocks); the block with its last checksum goes to a small
    buffer of its own (``tail``), so that a 64 MiB chunk takes 64 MiB of page-locked memory
    (``pinned_empty``: registered at the size asked, not torch's next power of two). The chunks
    go up on ``stream``; a buffer is lent again once the copies out of it are done (its event,
    not the device)."""

    def __init__(self, device: torch.device, nbytes: int, count: int) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        # A live tensor read into in place (a job start) may still be written by the job's queued
        # work (its initialisation): that comes first.
        self.stream.wait_stream(torch.cuda.current_stream(device))
        self.nbytes = nbytes
        self.made = 0  # buffers page-locked so far
        self._count = count  # at most
        self._lock = threading.Lock()
        self._free: queue.SimpleQueue[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = queue.SimpleQueue()

    def _take(self) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
        with contextlib.suppress(queue.Empty):
            return self._free.get_nowait()
        with self._lock:
            make = self.made < self._count
            self.made += make
        if not make:
            return self._free.get()  # all made and lent: the first one given back
        return pinned_empty(self.nbytes), aligned_empty(BLOCK), None  # on a page, at the size asked

    @contextlib.contextmanager
    def lend(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """A buffer of ``nbytes`` and its one-block tail, once the copies out of it are done."""
        buf, tail, copied = self._take()
        if copied is not None:
            copied.synchronize()
        try:
            yield buf, tail
        finally:
            done = torch.cuda.Event()
            done.record(self.stream)
            self._free.put((buf, tail, done))

    @classmethod
    def for_runs(
        cls,
        tier: Tier,
        records: dict[str, ArrayRecord],
        items: Sequence[ReadItem],
        runs: list[list[Read]],
        threads: int,
    ) -> Bounce | None:
        """Buffers for the biggest run's data, one more than the threads reading; None where no
        run is read into a single GPU's memory from a pack on this tier."""
        devices = {i.dest.device for i in items if i.dest.is_cuda}
        if len(devices) != 1 or not tier.vectored_reads:
            return None
        spans = [span for span in (run_span(records, run) for run in runs) if span is not None]
        if not spans:
            return None
        body = max(whole_blocks(end - CHECKSUM_BYTES - start) for _, start, end in spans)
        return cls(devices.pop(), body, threads + 1)


def direct_target(rec: ArrayRecord, c: Chunk, items: Sequence[ReadItem], *, whole: bool) -> torch.Tensor | None:
    """The memory chunk ``c`` can be read straight into, as bytes: when the chunk lies within a
    single destination, on the CPU, of the stored dtype, where its part is contiguous (a whole
    tensor, or rows of one). An edge chunk qualifies when its padding trails its data (it is cut
    short in its first dimension only), unless ``whole`` (the full chunk is sent to other ranks).
    None otherwise: the chunk is read, then copied."""
    valid = c.valid_shape
    if valid[1:] != rec.chunks[1:] or (whole and valid != rec.chunks):
        return None
    if len(items) == 1 and not any(items[0].offsets) and items[0].dest.shape == rec.shape:
        item = items[0]  # the usual case, without a box test: one destination, the whole array
    else:
        hits = [i for i in items if overlap(c.starts, c.stops, i.offsets, dest_stops(i)) is not None]
        if len(hits) != 1:
            return None
        item = hits[0]
        stops = dest_stops(item)
        if not all(o <= a and b <= e for a, b, o, e in zip(c.starts, c.stops, item.offsets, stops, strict=True)):
            return None
    dest = item.dest.detach()
    if item.deferred or dest.device.type != "cpu" or dest.dtype != torch_dtype(rec.dtype):
        return None
    if c.stops != dest.shape or any(c.starts) or any(item.offsets):  # a part of the destination
        dest = dest[tuple(slice(a - o, b - o) for a, b, o in zip(c.starts, c.stops, item.offsets, strict=True))]
    if not dest.is_contiguous():
        return None
    return dest.reshape(-1).view(torch.uint8)


def dest_stops(item: ReadItem) -> tuple[int, ...]:
    """Where ``item``'s destination ends in its global array, by dimension."""
    return tuple(o + n for o, n in zip(item.offsets, item.dest.shape, strict=True))
