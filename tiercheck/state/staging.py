"""Host staging: a bounded, reusable pool of host memory and the device-to-host chunk copies.

The pool is allocated once (page-locked when CUDA tensors are staged) and handed out as a ring:
chunks are staged in order and mostly written out in order, so regions come back roughly FIFO.
A region released out of order is reclaimed once everything older is released too. Staging
blocks while the pool is full, which is how a bound smaller than a snapshot stays a bound.
"""


from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from tiercheck.errors import StagingError
from tiercheck.format.layout import Chunk, is_edge
from tiercheck.libc import libc

log = logging.getLogger("tiercheck")

TOUCH_BYTES = 64 << 20  # pre-faulting goes this far between checks whether to stop
ALIGN = 4096  # page-aligned regions: any dtype view, and writes that bypass the page cache (O_DIRECT)


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def aligned_empty(nbytes: int, *, pin_memory: bool = False) -> torch.Tensor:
    """``nbytes`` of new uint8 memory starting on a page (torch's allocator aligns to 64 bytes;
    O_DIRECT wants whole blocks), a view into an allocation a page longer."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
    shift = -raw.data_ptr() % ALIGN
    return raw[shift : shift + nbytes]


def page_aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor that is the whole of its memory, and that memory starts on a page. A
    restore stages big arrays here so their chunks can be read with O_DIRECT, and hands the memory
    over to the live tensor (``restore.stage.copy_in``), which needs a storage of exactly the tensor's
    size. The memory comes from the C library's ``posix_memalign`` (memory the process freed is
    reused, resident, as torch's allocator would) and goes back with the last reference to it;
    torch does not resize such a storage in place (``resizable()`` is False). Where the C library
    has no ``posix_memalign``, torch's own memory (64-byte aligned: read through the page cache).
    Memory this machine cannot give is ``StagingError``."""
    nbytes = math.prod(shape) * dtype.itemsize
    if libc is None or nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    address = _memalign(nbytes, f"for a {dtype}{list(shape)}")
    return _owning(address, nbytes, libc.free, address).view(dtype).view(shape)


def pinned_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked memory, starting on a page, at the size asked: the C library's
    page-aligned memory, registered with CUDA (``cudaHostRegister``) and unregistered before it is
    freed, with the last reference to it. torch's own page-locked memory (``pin_memory=True``)
    comes from a caching allocator that rounds each request up to a power of two: a 4.1 GiB pool
    locked 8 GiB of the host's RAM. Where registering is refused (no CUDA runtime, or a C library
    without ``posix_memalign``), torch's, with that rounding."""
    cudart = torch.cuda.cudart() if torch.cuda.is_available() else None
    if cudart is None or libc is None or nbytes == 0:
        return aligned_empty(nbytes, pin_memory=True)
    address = _memalign(nbytes, "to page-lock")
    status = cudart.cudaHostRegister(address, nbytes, 0)
    if int(getattr(status, "value", status)) != 0:
        libc.free(address)
        log.warning("could not page-lock %d bytes with cudaHostRegister (%s); using torch's pinned memory",
                    nbytes, status)  # fmt: skip
        return aligned_empty(nbytes, pin_memory=True)
    return _owning(address, nbytes, _unregister_and_free, cudart, address)


def _unregister_and_free(cudart: object, address: int) -> None:
    cudart.cudaHostUnregister(address)  # type: ignore[attr-defined]
    assert libc is not None
    libc.free(address)


def _memalign(nbytes: int, what: str) -> int:
    """The address of ``nbytes`` of the C library's memory, starting on a page (``StagingError``
    where this machine cannot give them)."""
    assert libc is not None
    address = ctypes.c_void_p()
    if libc.posix_memalign(ctypes.byref(address), ALIGN, nbytes) != 0 or not address.value:
        raise StagingError(f"cannot allocate {nbytes:,} bytes of page-aligned host memory {what}")
    return address.value


def _owning(address: int, nbytes: int, release: Callable[..., None], *args: object) -> torch.Tensor:
    """A uint8 tensor over C memory at ``address`` that holds it, and calls ``release(*args)``
    with the last reference to it (not at exit: tensors may outlive it there)."""
    memory = (ctypes.c_char * nbytes).from_address(address)
    weakref.finalize(memory, release, *args).atexit = False
    return torch.frombuffer(memory, dtype=torch.uint8)  # holds ``memory``


NO_POOL = {"pool_capacity_bytes": 0, "pool_peak_bytes": 0, "pool_allocations": 0, "pool_pinned": False,
           "pool_pinned_bytes": 0}  # fmt: skip


@dataclass(eq=False, slots=True)
class Region:
    offset: int
    nbytes: int  # aligned size held in the pool
    freed: bool = field(default=False)


class HostPool:
    def __init__(self, *, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._buf: torch.Tensor | None = None
        self._cond = threading.Condition()
        self._live: deque[Region] = deque()
        self.in_use = 0
        self.peak_in_use = 0
        self.allocations = 0  # how often host memory was (re)allocated: 1 in steady state
        self.touched = 0  # bytes from the start that were written: resident, faulting no more

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    @property
    def pinned_bytes(self) -> int:
        """Host memory the pool holds page-locked: its capacity (rounded to a page) where it is
        registered at that size (``pinned_empty``); where torch's allocator gave it instead, the
        power of two that rounds the request up to; 0 when it is not page-locked."""
        if not self.pin_memory or self._buf is None:
            return 0
        held = self._buf.untyped_storage().nbytes()
        return held if held == self.capacity else 1 << (held - 1).bit_length()

    @classmethod
    def for_tensors(
        cls, tensors: Iterable[torch.Tensor], pin_memory: bool | None
    ) -> HostPool:
        """A pool for staging ``tensors``: page-locked as ``pin_memory`` says (None: where any is on a
        GPU)."""
        pin = any(t.is_cuda for t in tensors) if pin_memory is None else pin_memory
        return cls(pin_memory=pin)

    def stats(self) -> dict[str, int | bool]:
        """``Checkpointer.stats()``'s ``pool_*`` entries (``NO_POOL`` before a pool exists)."""
        return {
            "pool_capacity_bytes": self.capacity,
            "pool_peak_bytes": self.peak_in_use,
            "pool_allocations": self.allocations,
            "pool_pinned": self.pin_memory,
            "pool_pinned_bytes": self.pinned_bytes,
        }

    def reserve(self, capacity: int, *, touch: threading.Event | None = None) -> None:
        """Make the pool at least ``capacity`` bytes, waiting until it is idle to grow it; with
        ``touch``, fault in the pages of new memory now rather than during the first copies, a
        piece at a time until the event is set."""
        capacity = align_up(capacity)
        with self._cond:
            if capacity <= self.capacity:
                return
            self._cond.wait_for(lambda: not self._live)
            self._buf = None  # free the old buffer before allocating the new one
            self._buf = pinned_empty(capacity) if self.pin_memory else aligned_empty(capacity)
            self.allocations += 1
            self.touched = capacity if self.pin_memory else 0  # page-locked memory is resident already
            if touch is not None:
                for start in range(self.touched, capacity, TOUCH_BYTES):
                    if touch.is_set():
                        break
                    self._buf[start : start + TOUCH_BYTES].zero_()
                    self.touched = min(start + TOUCH_BYTES, capacity)
            log.info(
                "staging pool: %.1f MiB of %s host memory",
                capacity / 2**20,
                "pinned" if self.pin_memory else "pageable",
            )

    def drop(self) -> None:
        """Give the memory back while nothing is staged (a restore is about to need as much)."""
        with self._cond:
            if not self._live:
                self._buf = None
                self.touched = 0

    def acquire(self, nbytes: int) -> Region:
        n = align_up(max(nbytes, 1))
        with self._cond:
            if n > self.capacity:
                raise StagingError(f"a chunk of {nbytes} bytes does not fit the {self.capacity}-byte staging pool")
            while (offset := self._fit(n)) is None:
                self._cond.wait()
            region = Region(offset, n)
            self._live.append(region)
            self.touched = max(self.touched, offset + n)  # the stager writes all of it
            self.in_use += n
            self.peak_in_use = max(self.peak_in_use, self.in_use)
            return region

    def _fit(self, n: int) -> int | None:
        if not self._live:
            return 0
        tail = self._live[0].offset
        last = self._live[-1]
        head = last.offset + last.nbytes
        if last.offset >= tail:  # not wrapped: free space is [head, capacity) and [0, tail)
            if head + n <= self.capacity:
                return head
            return 0 if n <= tail else None
        return head if head + n <= tail else None  # wrapped: free space is [head, tail)

    def release(self, region: Region) -> None:
        with self._cond:
            region.freed = True
            while self._live and self._live[0].freed:
                self.in_use -= self._live.popleft().nbytes
            self._cond.notify_all()

    @contextlib.contextmanager
    def lend(self, nbytes: int) -> Iterator[torch.Tensor | None]:
        """``nbytes`` of resident memory while nothing is staged (a restore's staging), as uint8;
        None when the pool is busy or has not yet touched that much (new memory would fault in
        just the same, and cost a copy on top)."""
        n = align_up(max(nbytes, 1))
        with self._cond:
            ok = not self._live and n <= self.touched
            region = Region(0, n) if ok else None
            if region is not None:
                self._live.append(region)
                self.in_use += n
        if region is None:
            yield None
            return
        try:
            yield self.view(region, nbytes)
        finally:
            self.release(region)

    def view(self, region: Region, nbytes: int, start: int = 0) -> torch.Tensor:
        """``nbytes`` of ``region`` from ``start`` on, as uint8."""
        assert self._buf is not None
        return self._buf[region.offset + start : region.offset + start + nbytes]


def chunk_views(
    src: torch.Tensor, chunk: Chunk, chunk_shape: tuple[int, ...], dst: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (destination, source) pair that copies one chunk of ``src`` into the uint8 host view
    ``dst``, padded to the full chunk: the padding of an edge chunk is zeroed here."""
    out = dst.view(src.dtype).view(chunk_shape)
    piece = src[chunk.slices()]
    if is_edge(chunk, chunk_shape):
        out.zero_()  # zarr stores edge chunks at full size; make the padding deterministic
        out = out[tuple(slice(0, v) for v in chunk.valid_shape)]
    return out, piece


def _omp_set_num_threads() -> Callable[[int], None] | None:
    try:
        return ctypes.CDLL(None).omp_set_num_threads  # type: ignore[no-any-return]
    except (AttributeError, OSError):  # torch built without OpenMP, or its runtime not global
        return None


_set_omp_threads = _omp_set_num_threads()


def set_copy_threads(n: int) -> None:
    """Copies on the CPU from this thread use ``n`` threads from now on (OpenMP's thread count
    is each thread's own, so training's is untouched). A copy is bound by memory bandwidth: two
    threads staged 1.5 GiB in 0.125 s and 0.25 CPU-s here, one in 0.16 s and 0.16 CPU-s. Where
    the OpenMP runtime cannot be reached, copies keep torch's count."""
    torch.get_num_threads()  # torch sets a thread's OpenMP count when the thread first asks: before us
    if _set_omp_threads is not None:
        _set_omp_threads(max(n, 1))


def copy_pieces(outs: list[torch.Tensor], pieces: list[torch.Tensor], stream: torch.cuda.Stream | None) -> None:
    """Copy every ``pieces[i]`` into ``outs[i]`` in one call, which holds the GIL once for all of
    them: one ``copy_`` per chunk gave up and took back the GIL per chunk, and a background thread
    waits up to the interpreter's switch interval (5 ms) each time it takes it back from a busy
    training thread. On CUDA each copy is queued on ``stream`` (non-blocking, so a ``copy_`` each
    costs no wait); the caller records an event after them."""
    if stream is None:
        torch._foreach_copy_(outs, pieces)
        return
    with torch.cuda.stream(stream):
        for out, piece in zip(outs, pieces, strict=True):
            out.copy_(piece, non_blocking=True)
