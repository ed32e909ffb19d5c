"""A node-local directory's refusals (a full disk, a read-only mount, no permission) as the library's
``StorageError``: same ``errno``, and a message naming the directory, its free space where that is
the cause, and what to do instead. A raw ``OSError`` names a file the user never chose (the lock,
the node's name file) and says neither why tiercheck writes there nor how to go on."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from tiercheck.errors import StorageError

FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
UNWRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


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
    elif e.errno in UNWRITABLE and not os.path.isdir(where):
        message = f"cannot create {where} ({reason}): give the Checkpointer a local directory it can write in"
    elif e.errno in UNWRITABLE:
        message = (
            f"cannot write in {where} ({reason}), so a Checkpointer cannot {doing}: it locks its directory and "
            "removes partial steps, even to restore. Make it writable; or read a step from this read-only copy "
            f"with tiercheck.load({where!r}), or copy it to a writable directory DIR with "
            f"`tiercheck restore {where} --to DIR` and give the Checkpointer local=DIR"
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
