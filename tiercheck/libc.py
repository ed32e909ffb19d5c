"""The C library's calls that Python's ``os`` and ``mmap`` modules lack, through ctypes (which
lets go of the GIL for each call): page-aligned allocation for staging memory, and ``mincore`` to
ask the page cache what it holds without reading anything in, ``statfs`` for a filesystem's type.
``libc`` is None where the process has no such library (Windows)."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_int, c_long, c_size_t, c_ubyte, c_void_p

MAP_FAILED = c_void_p(-1).value


def _load() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.posix_memalign.argtypes = [POINTER(c_void_p), c_size_t, c_size_t]
        libc.free.argtypes = [c_void_p]
        libc.mmap.argtypes = [c_void_p, c_size_t, c_int, c_int, c_int, c_long]
        libc.mmap.restype = c_void_p
        libc.munmap.argtypes = [c_void_p, c_size_t]
        libc.mincore.argtypes = [c_void_p, c_size_t, POINTER(c_ubyte)]
        libc.statfs.argtypes = [c_char_p, c_void_p]
    except (OSError, AttributeError, TypeError):  # no C library by that name (Windows), or a call missing
        return None
    return libc


libc = _load()


TMPFS_MAGIC = 0x01021994  # statfs(2)'s f_type of a tmpfs (linux/magic.h), and of a ramfs:
RAMFS_MAGIC = 0x858458F6


def filesystem_type(path: str | bytes) -> int | None:
    """``statfs(2)``'s ``f_type`` of the filesystem ``path`` is on (the struct's first field, a
    ``long`` on Linux); None where it cannot be asked (no such call, no such path)."""
    if libc is None:
        return None
    buf = ctypes.create_string_buffer(512)  # struct statfs is 120 bytes on 64-bit Linux
    target = path if isinstance(path, bytes) else path.encode()
    if libc.statfs(target, buf) != 0:
        return None
    return c_long.from_buffer(buf).value & 0xFFFFFFFF
