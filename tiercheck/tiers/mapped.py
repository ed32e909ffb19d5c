"""A local file's pages without reading them: ``mincore`` (what the page cache holds) and read-only
mappings (``map_file_range``), which a restore serves a memory tier's chunks from with no copy.

A file on a tmpfs is its page cache: mapping it hands out those pages themselves. A mapping is
private (copy on write: the file is never written through it, and the memory it lends is writable
only as a private copy would be); its pages are the file's until written, faulted in as they are
first read. A file shorter than the range is refused before anything is mapped (a
read past its end would be a ``SIGBUS``): the committed files a restore maps are never truncated,
only unlinked, and an unlinked file's pages live on while mapped.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from tiercheck.libc import MAP_FAILED, libc


def map_file_range(fd: int, offset: int, length: int) -> memoryview | None:
    """``length`` bytes of the file ``fd`` from ``offset`` on, mapped private (its pages faulted in as
    first read) and writable as a private copy (never written: its pages are the file's); None where
    the file holds fewer bytes there. The mapping lives while any view of it does (``fd`` may be
    closed at once)."""
    if length <= 0 or os.fstat(fd).st_size < offset + length:
        return None
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    # Not populated when made (MAP_POPULATE): on a writable private mapping that faults every page in
    # for writing, a copy of each (64 MiB: 30-200 ms, against 4 ms to map and 6 ms to fault in as read).
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    mapped = mmap.mmap(fd, length + offset - start, flags=mmap.MAP_PRIVATE, prot=prot, offset=start)
    return memoryview(mapped)[offset - start :]


def resident_pages(fd: int, offset: int, length: int) -> int | None:
    """How many pages of ``length`` bytes of the file ``fd`` from ``offset`` on the page cache
    holds: ``mincore`` of a mapping of them that is never touched, so nothing is read in (a read
    that must not wait, ``RWF_NOWAIT``, says as much, but reads in the page it misses: the next
    restore of the same cold pack would take it for cached). None where that cannot be told."""
    if libc is None:
        return None
    start = offset - offset % mmap.PAGESIZE
    length += offset - start
    if length <= 0:
        return 0
    address = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if address is None or address == MAP_FAILED:
        return None
    try:
        pages = np.zeros(-(-length // mmap.PAGESIZE), dtype=np.uint8)
        if libc.mincore(address, length, pages.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte))) != 0:
            return None
        return int(np.count_nonzero(pages & 1))
    finally:
        libc.munmap(address, length)
