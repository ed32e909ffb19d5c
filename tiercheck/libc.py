"""The C library's calls that Python's ``os`` and ``mmap`` modules lack, through ctypes (which
lets go of the GIL for each call): page-aligned allocation for staging memory, and ``mincore`` to
ask the page cache what it holds without reading anything in. ``libc`` is None where the process
has no such library (Windows)."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_int, c_long, c_size_t, c_ubyte, c_void_p

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
    except (OSError, AttributeError, TypeError):  # no C library by that name (Windows), or a call missing
        return None
    return libc


libc = _load()
