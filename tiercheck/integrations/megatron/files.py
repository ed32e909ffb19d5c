"""The files tiercheck's Megatron plugin keeps beside Megatron's own in a checkpoint directory, and the wait
for a commit that Megatron's async machinery runs. Nothing here imports megatron-core.

- ``tiercheck.json``: the pointer from a Megatron checkpoint directory to the tiercheck root and step holding
  its data, with the saved layouts (written by rank 0 before Megatron writes ``metadata.json``).
- The common state (megatron-core 0.19+, where ``dist_checkpointing.save`` hands it to the strategy as the
  ``ShardedObject("common_state")``): written as Megatron's own ``torch_dist`` writer does, a one-entry DCP
  checkpoint in the directory, so that Megatron's ``load_common_state_dict`` reads it unchanged.
"""


from __future__ import annotations

import io
import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from tiercheck import SaveHandle
from tiercheck.errors import CheckpointNotFoundError, CorruptCheckpointError

BACKEND = "tiercheck"
VERSION = 1
POINTER_FILE = "tiercheck.json"
POINTER_FORMAT = "tiercheck-megatron"


# ------------------------------------------------------------------------------- async commits


class AwaitCommit:
    """The ``async_fn`` of an AsyncRequest: returns once tiercheck committed the step (or failed).

    tiercheck's threads do the writing; this only waits. Megatron's ``AsyncCallsQueue`` runs it in a forked
    process, whose liveness it polls: the child learns the outcome through a pipe. In the saving process
    (``AsyncRequest.execute_sync``) it waits on the handle. Pickled into another process (the persistent
    worker) it returns at once. Either way the finalize function waits too, and raises the save's error.
    """

    def __init__(self, handle: SaveHandle) -> None:
        self._handle: SaveHandle | None = handle
        self._pid = os.getpid()
        self._read: int | None
        self._read, self._write = os.pipe()
        self._pipe = os.fstat(self._read).st_ino
        self._lock = threading.Lock()
        self._written = self._closing = False
        handle.committed.add_done_callback(self._signal)

    def _signal(self, fut: Any) -> None:
        with self._lock:
            os.write(self._write, b"\x01" if fut.exception() is None else b"\x00")  # a pipe: never blocks
            os.close(self._write)
            self._written = True
            if self._closing:
                self._close_read()

    def __call__(self) -> None:
        if os.getpid() == self._pid and self._handle is not None:
            self._handle.committed.exception()  # waits; the finalize function raises
        elif self._read is not None:  # a forked child
            try:  # drop its copy of the write end (if still open) so that the parent's death ends the read
                if os.fstat(self._write).st_ino == self._pipe:
                    os.close(self._write)
            except OSError:
                pass
            os.read(self._read, 1)

    def close(self) -> None:
        """Close the read end, once the outcome is written (a reader-less pipe would fail the write)."""
        with self._lock:
            if self._written:
                self._close_read()
            else:
                self._closing = True

    def _close_read(self) -> None:
        if self._read is not None:
            os.close(self._read)
            self._read = None

    def __getstate__(self) -> dict[str, Any]:
        return {"_handle": None, "_pid": -1, "_read": None}


# ------------------------------------------------------------------------------- tiercheck.json


def write_pointer(checkpoint_dir: Path, pointer: dict[str, Any]) -> None:
    """Write ``tiercheck.json`` durably and atomically (before Megatron writes ``metadata.json``)."""
    path = checkpoint_dir / POINTER_FILE
    tmp = path.with_name(f".{POINTER_FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump(pointer, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(checkpoint_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_pointer(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The contents of a checkpoint directory's ``tiercheck.json``, checked."""
    path = Path(checkpoint_dir) / POINTER_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{checkpoint_dir}: no {POINTER_FILE}; this checkpoint was not saved through tiercheck, "
            "or its save never finished (the finalize functions of its AsyncRequest did not run)"
        ) from None
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: cannot read ({e})") from None
    ok = (
        isinstance(doc, dict)
        and doc.get("format") == POINTER_FORMAT
        and isinstance(doc.get("step"), int)
        and isinstance(doc.get("local"), str)
        and isinstance(doc.get("tensors"), dict)
        and isinstance(doc.get("objects"), list)
    )
    if not ok:
        raise CorruptCheckpointError(f"{path}: not a tiercheck pointer file")
    if doc.get("version") != VERSION:
        raise CorruptCheckpointError(
            f"{path}: pointer format version {doc.get('version')!r}; this tiercheck reads {VERSION}"
        )
    return doc  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------- the common state


COMMON_STATE = "common_state"  # the ShardedObject key megatron-core 0.19+ gives the common state


def encode_common_state(data: Any) -> bytes:
    """Megatron's own encoding of the common state (its ``torch_dist`` writer: ``torch.save`` of a one-item
    list), taken when the save starts: the training loop may change the objects while tiercheck writes."""
    buffer = io.BytesIO()
    torch.save([data], buffer)
    return buffer.getvalue()


def write_common_state(checkpoint_dir: Path, unique_key: str, payload: bytes) -> None:
    """Write the common state as a one-entry DCP checkpoint (``.metadata`` and one ``.distcp`` file, fsynced),
    where Megatron's ``load_common_state_dict`` reads it (with ``torch.load(weights_only=True)``). Rank 0 only,
    before Megatron writes ``metadata.json``."""
    import torch.distributed.checkpoint as dcp  # only on this path: DCP's import costs ~1 s

    writer = dcp.FileSystemWriter(checkpoint_dir, sync_files=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({unique_key: io.BytesIO(payload)}, storage_writer=writer, no_dist=True)
