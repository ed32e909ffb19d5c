"""One tiercheck ``Checkpointer`` per local directory and process, shared by DCP writers and readers.

tiercheck allows one writer per directory (a second Checkpointer there gets ``DirectoryInUseError``), and a
DCP reader may load from a directory whose writer is open in the same process (torchtitan loads, then saves).
Both go through here: the first user creates the Checkpointer (every rank together: a collective), the last
one closes it. Writers and readers take the Checkpointer's keyword options, checked by :func:`checked_options`.
"""


from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiercheck.checkpointer import Checkpointer
from tiercheck.errors import DirectoryInUseError

__all__ = ["CHECKPOINTER_OPTIONS", "Shared", "acquire", "checked_options", "release"]

CHECKPOINTER_OPTIONS = frozenset(
    {"remote_options", "process_group", "staging", "write", "retention", "distributed", "drain", "replication"}
)


@dataclass
class Shared:
    """The Checkpointer of one local directory in this process, and who uses it."""

    key: str
    ckpt: Checkpointer
    state: dict[str, Any]  # what the Checkpointer saves / restores: filled for one call, then emptied
    lock: threading.Lock = field(default_factory=threading.Lock)  # one save or restore fills `state` at a time
    users: int = 0
    writer: bool = False


def checked_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` if each is a Checkpointer option that writers and readers pass on; else ``TypeError``."""
    unknown = sorted(set(options) - CHECKPOINTER_OPTIONS)
    if unknown:
        raise TypeError(
            f"unknown Checkpointer option(s) {', '.join(unknown)}; known: {', '.join(sorted(CHECKPOINTER_OPTIONS))}"
        )
    return options


_open: dict[str, Shared] = {}
_open_lock = threading.Lock()


def acquire(local: Path, remote: str | None, options: dict[str, Any], *, writer: bool) -> Shared:
    """The directory's Checkpointer, created (by every rank together: a collective) if none is open."""
    key = str(local.resolve())
    with _open_lock:
        shared = _open.get(key)
        if shared is not None and writer and shared.writer:
            raise DirectoryInUseError(f"another TiercheckWriter of this process writes {key}; close it first")
        if shared is None:
            state: dict[str, Any] = {}
            shared = Shared(key, Checkpointer(state, local=local, remote=remote, **options), state)
            _open[key] = shared
        shared.users += 1
        shared.writer = shared.writer or writer
        return shared


def release(shared: Shared, *, drain: bool, timeout: float | None = None) -> list[int]:
    """Drop one use; the last closes the Checkpointer (waiting for its saves, and with ``drain`` its drains)."""
    with _open_lock:
        shared.users -= 1
        last = shared.users == 0
        if last:
            del _open[shared.key]
    return shared.ckpt.close(drain=drain, timeout=timeout) if last else []
