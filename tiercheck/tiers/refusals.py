"""A node-local directory's refusals (a full disk, a quota) as the library's
``StorageError``: same ``errno``, and a message naming the directory, its free space where that is
the cause, and what to do instead. A raw ``OSError`` names a file the user never chose (the lock,
the node's name file) and says neither why tiercheck writes there nor how to go on."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from tiercheck.errors import StorageError

FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def storage_error(e: OSError, directory: str | os.PathLike[str], doing: str) -> StorageError:
    """``e``, raised while tiercheck tried ``doing`` (a phrase about the directory: "lock it") in the
    local ``directory``, as the ``StorageError`` to raise ``from e``."""
    if isinstance(e, StorageError):
        return e
    where = os.fspath(directory)
    reason = e.strerror or str(e)
    if e.errno in FULL:
        message = (
            f"{where} is full: could not {doing} ({reason}; {free_space(where)}). "
            "Free some space there, or give the Checkpointer another local directory"
        )
    else:
        message = f"{where}: could not {doing}: {reason}"
    return StorageError(e.errno, message)


def free_space(where: str | os.PathLike[str]) -> str:
    """The free space of the filesystem holding ``where`` (or its nearest existing parent), for a message."""
    here = Path(where)
    while not here.exists() and here != here.parent:
        here = here.parent
    try:
        st = os.statvfs(here)
    except OSError:
        return "free space unknown"
    text = f"{st.f_bavail * st.f_frsize / 2**20:,.1f} MiB free"
    return text + (", no free inodes" if st.f_files and not st.f_favail else "")
