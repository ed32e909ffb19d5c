"""One tiercheck ``Checkpointer`` per local directory and process, shared by DCP writers and readers.

tiercheck allows one writer per directory (a second Checkpointer there gets ``DirectoryInUseError``), while DCP's
idiom is a new ``StorageWriter`` per save (``dcp.save(sd, storage_writer=Writer(...), checkpoint_id=step)``), and
a DCP reader may load from a directory whose writer is open in the same process (torchtitan loads, then saves).
All of them go through here: the first user creates the Checkpointer (every rank together: a collective) and the
last one closes it. The writers of a directory are one user, however many there are: a writer per call shares
the first one's Checkpointer (host pool, save plan, directory lock) and its layout record (``Layout``), so it
behaves as one long-lived writer. The Checkpointer then lives until a writer's ``close()``, or until interpreter
exit, which closes it within ``DistributedOptions(timeout_s=)`` (``Checkpointer``'s exit hook), after letting an
``async_save`` nobody awaited reach it (``_wait_for_saves``), both within that one bound.
Writers and readers take the Checkpointer's keyword options, checked by :func:`checked_options`.
"""


from __future__ import annotations

import atexit
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiercheck import Checkpointer
from tiercheck.errors import DirectoryInUseError
from tiercheck.options import DistributedOptions
from tiercheck.seam import exit_deadline

__all__ = [
    "CHECKPOINTER_OPTIONS",
    "Layout",
    "Shared",
    "acquire",
    "checked_options",
    "layout_of",
    "release",
    "writer_made",
]

log = logging.getLogger("tiercheck")

CHECKPOINTER_OPTIONS = frozenset(
    {"remote_options", "process_group", "staging", "write", "retention", "distributed", "drain", "replication",
     "memory"}
)


@dataclass
class Layout:
    """Which rank writes which region, as this process's writers of one directory last saw it: the coordinator's
    digest of the ranks' plans and its generation, and the generation this rank last planned its writing for."""

    digest: str | None = None
    generation: int = 0
    planned: int = 0


@dataclass
class Shared:
    """The Checkpointer of one local directory in this process, and who uses it."""

    key: str
    ckpt: Checkpointer
    state: dict[str, Any]  # what the Checkpointer saves / restores: filled for one call, then emptied
    remote: str | None = None  # what the writers asked for (a writer with other ones is refused)
    options: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one save or restore fills `state` at a time
    users: int = 0  # readers in read_data, plus one for all of the directory's writers together
    writer: bool = False
    closed: bool = False


def checked_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` if each is a Checkpointer option that writers and readers pass on; else ``TypeError``."""
    unknown = sorted(set(options) - CHECKPOINTER_OPTIONS)
    if unknown:
        raise TypeError(
            f"unknown Checkpointer option(s) {', '.join(unknown)}; known: {', '.join(sorted(CHECKPOINTER_OPTIONS))}"
        )
    return options


_open: dict[str, Shared] = {}
_layouts: dict[str, Layout] = {}
_open_lock = threading.Lock()


def key_of(local: Path) -> str:
    return str(local.resolve())


def layout_of(local: Path) -> Layout:
    """The layout record of this process's writers of ``local`` (it outlives their Checkpointer)."""
    with _open_lock:
        return _layouts.setdefault(key_of(local), Layout())


def acquire(local: Path, remote: str | None, options: dict[str, Any], *, writer: bool) -> Shared:
    """The directory's Checkpointer, created (by every rank together: a collective) if none is open.

    A writer joins the directory's writers: the first adds one use, the others share it. A writer whose
    ``remote`` or options differ from those the open Checkpointer's writers gave is refused: it would not save
    as it asked."""
    key = key_of(local)
    with _open_lock:
        shared = _open.get(key)
        if shared is not None and writer and shared.writer:
            if (remote, options) != (shared.remote, shared.options):
                raise DirectoryInUseError(
                    f"{key}: the TiercheckWriters of one process and directory share one Checkpointer, opened "
                    f"with remote={shared.remote!r} and options {sorted(shared.options)}; this writer asks for "
                    f"remote={remote!r} and options {sorted(options)}: give every writer the same ones, or "
                    "close() the open writer first"
                )
            return shared
        if shared is None:
            state: dict[str, Any] = {}
            shared = Shared(key, Checkpointer(state, local=local, remote=remote, **options), state)
            _open[key] = shared
        if writer:
            shared.remote, shared.options = remote, options
        shared.users += 1
        shared.writer = shared.writer or writer
        return shared


def release(shared: Shared, *, drain: bool, timeout: float | None = None, writer: bool = False) -> list[int]:
    """Drop one use (``writer``: the use of all the directory's writers; nothing if they dropped it already); the
    last closes the Checkpointer (waiting for its saves, and with ``drain`` its drains)."""
    with _open_lock:
        if writer:
            if not shared.writer or shared.closed:
                return []
            shared.writer = False
        shared.users -= 1
        last = shared.users == 0
        if last:
            shared.closed = True
            del _open[shared.key]
    return shared.ckpt.close(drain=drain, timeout=timeout) if last else []


# -- DCP saves still running on DCP's thread (an async_save nobody awaited), waited for at interpreter exit

_DCP_THREAD = "AsyncCheckpointExecutor"  # the name of the thread DCP's async_save (THREAD) saves on
_timeouts: set[float] = set()  # DistributedOptions.timeout_s of the writers made in this process


def writer_made(options: dict[str, Any]) -> None:
    """Note a TiercheckWriter: exit waits, for its ``timeout_s`` at most, for DCP's saves still running."""
    with _open_lock:
        _timeouts.add((options.get("distributed") or DistributedOptions()).timeout_s)


def _wait_for_saves() -> None:
    """At interpreter exit, before the Checkpointers close (their hook, registered first, runs after this one):
    let an ``async_save`` still running on DCP's thread reach its writer's Checkpointer and commit. That thread
    calls the writer first only once DCP's collectives are done, so it is recognised by its name; DCP ends it once
    the save is over. Waits for at most the writers' ``timeout_s``, counted from the start of exit."""
    with _open_lock:
        bound = max(_timeouts, default=None)
    running = [t for t in threading.enumerate() if t.name.startswith(_DCP_THREAD) and t.is_alive()]
    if bound is None or not running:
        return
    deadline = exit_deadline(bound)
    for thread in running:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            log.warning(
                "exiting: abandoning the DCP save still running on thread %s after %.0f s "
                "(DistributedOptions.timeout_s): its step is not committed",
                thread.name,
                bound,
            )


getattr(threading, "_register_atexit", atexit.register)(_wait_for_saves)
