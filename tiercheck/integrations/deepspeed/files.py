"""The DeepSpeed plugin's files: its state dicts packed for tiercheck, and the pointer files.

DeepSpeed's state dicts hold objects tiercheck cannot keep as JSON (its loss scaler, say):
:func:`pack` stores them with ``torch.save`` and :func:`unpack` rebuilds them with
``torch.load(weights_only=True)`` and an allow-list, or with pickle only if the caller allows it.
Pointer files, named like DeepSpeed's own files in ``<save_dir>/<tag>/``, say which tiercheck step
holds the data: DeepSpeed globs for its files and checks that they exist before it loads them.
:func:`export` (with :func:`export_files`) writes a step back as DeepSpeed's own ``torch.save`` files.
"""


from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import os
import re
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiercheck import Checkpointer, load
from tiercheck.errors import CheckpointNotFoundError, TiercheckError, UnsafeCheckpointError
from tiercheck.integrations.deepspeed.compat import SAFE_GLOBALS
from tiercheck.seam import Tier, list_steps, read_manifest

log = logging.getLogger("tiercheck.deepspeed")

POINTER_FORMAT = "tiercheck-deepspeed-pointer"
META = "tiercheck.deepspeed"  # the entry of each rank's saved state naming the tag and this rank's files
OBJECT = "tiercheck.deepspeed.object"  # {OBJECT: torch.save bytes}: a value tiercheck cannot store as JSON

_PLAIN = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)


def pack(obj: Any) -> Any:
    """A copy of ``obj`` tiercheck can store: containers rebuilt (so plain values are captured now),
    tensors kept by reference (copied when the step is staged), other objects serialised with
    ``torch.save`` now."""
    if isinstance(obj, (torch.Tensor, np.ndarray, *_PLAIN)):
        return obj
    if isinstance(obj, dict):  # OrderedDict too: tiercheck keeps the order, DeepSpeed needs no more
        return {k: pack(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [pack(v) for v in obj]
    if type(obj) is tuple:
        return tuple(pack(v) for v in obj)
    buf = io.BytesIO()
    torch.save(obj, buf)
    return {OBJECT: buf.getvalue()}


def unpack(obj: Any, *, allow_pickle: bool, safe_globals: tuple[Any, ...], where: str) -> Any:
    """The inverse of :func:`_pack`."""
    again = functools.partial(unpack, allow_pickle=allow_pickle, safe_globals=safe_globals, where=where)
    if isinstance(obj, dict):
        if len(obj) == 1 and OBJECT in obj:
            return load_object(obj[OBJECT], allow_pickle=allow_pickle, safe_globals=safe_globals, where=where)
        return {k: again(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [again(v) for v in obj]
    if type(obj) is tuple:
        return tuple(again(v) for v in obj)
    return obj


def load_object(
    data: bytes | str, *, allow_pickle: bool, safe_globals: tuple[Any, ...], where: str, map_location: Any = None
) -> Any:
    """``torch.load`` of ``data`` (bytes, or a file's path): with ``weights_only=True`` and the
    allow-list ``safe_globals`` unless the caller allows pickle."""
    source = io.BytesIO(data) if isinstance(data, bytes) else data
    if allow_pickle:
        return torch.load(source, map_location=map_location, weights_only=False)
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(source, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises UnpicklingError (and others) for a type not allowed
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = f"of type {found.group(1)}" if found else f"that torch.load(weights_only=True) refuses ({e})"
        raise UnsafeCheckpointError(
            f"{where}: the checkpoint holds an object {what}, which is not allowed without pickle. "
            "Pass safe_globals=[TheClass] to install()/export() if you trust it, or allow_pickle=True "
            "only if you trust where the checkpoint came from"
        ) from None


def move(obj: Any, map_location: Any) -> Any:
    """Apply a ``torch.load``-style ``map_location`` that names a device (tensors come back on CPU)."""
    if map_location is None or callable(map_location):
        return obj
    device = torch.device(map_location) if isinstance(map_location, str | torch.device) else None
    if device is None or device.type == "cpu":
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: move(v, map_location) for k, v in obj.items()}
    if isinstance(obj, list):
        return [move(v, map_location) for v in obj]
    if type(obj) is tuple:
        return tuple(move(v, map_location) for v in obj)
    return obj


def checked_tag(tag: object, *, where: str) -> str:
    """A tag read from a checkpoint, refused unless it is one plain directory name: a tag like
    ``../x`` or ``/etc`` would make export and load write outside the directory the caller named."""
    if not isinstance(tag, str) or tag in ("", ".", "..") or len(tag) > 255 or any(c in tag for c in "/\\\0"):
        raise UnsafeCheckpointError(f"{where}: the DeepSpeed tag {str(tag)[:300]!r} is not a plain directory name")
    return tag


def find_tag(tier: Tier, tag: str) -> int | None:
    """The newest committed step on ``tier`` whose metadata names ``tag``."""
    guess = re.fullmatch(r"global_step([0-9]+)", tag)
    steps = list_steps(tier).committed
    if guess and int(guess.group(1)) in steps:  # DeepSpeed's default tags: try the step they name first
        steps.remove(int(guess.group(1)))
        steps.append(int(guess.group(1)))
    for step in reversed(steps):
        try:
            meta = read_manifest(tier, step).metadata
        except TiercheckError as e:
            log.warning("tiercheck: ignoring step %d of %s: %s", step, tier.url, e)
            continue
        if isinstance(meta, dict) and isinstance(meta.get("deepspeed"), dict) and meta["deepspeed"].get("tag") == tag:
            return step
    return None


def _pointer(ckpt: Checkpointer, step: int, name: str) -> bytes:
    remote = ckpt.remote.url if ckpt.remote is not None else None
    doc = {"format": POINTER_FORMAT, "root": str(ckpt.tier.root), "remote": remote, "step": step, "file": name}
    return (json.dumps(doc) + "\n").encode()


def write_pointers(folder: str, ckpt: Checkpointer, step: int, names: Iterable[str]) -> None:
    """Small JSON files named like DeepSpeed's, where DeepSpeed looks for them (it globs and
    checks ``os.path.exists`` before calling ``load``); they say which tiercheck step holds the data."""
    base = Path(folder).resolve()
    for name in names:
        target = (base / name).resolve()
        if not target.is_relative_to(base):
            raise UnsafeCheckpointError(f"{name!r}: a file name that escapes {folder}")
        if target.exists() and read_pointer(str(target)) is None:
            continue  # DeepSpeed's own file of the same tag: keep it
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(str(target), _pointer(ckpt, step, name))


def read_pointer(path: str) -> dict[str, Any] | None:
    """The pointer file's contents, or None when ``path`` is not one (a torch.save file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    if not head.startswith(b"{"):
        return None
    with contextlib.suppress(ValueError):
        doc = json.loads(head)
        if isinstance(doc, dict) and doc.get("format") == POINTER_FORMAT:
            return doc
    return None


def export(
    source: str | os.PathLike[str],
    save_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
    allow_pickle: bool = False,
    safe_globals: Iterable[Any] = (),
    storage_options: dict[str, Any] | None = None,
) -> str:
    """Write a tiercheck step of a DeepSpeed run as DeepSpeed's own files, in one process.

    ``source`` is a local tiercheck directory holding every rank's chunks (one node, or a copy made
    with ``tiercheck restore``) or a remote URL. Writes ``<save_dir>/<tag>/*.pt`` with
    ``torch.save`` and ``<save_dir>/latest``; returns the tag. DeepSpeed (and its
    ``zero_to_fp32.py`` and ``ds_to_universal``) then loads them without tiercheck.
    """
    return export_files(
        source,
        save_dir,
        step=step,
        allow_pickle=allow_pickle,
        safe_globals=(*SAFE_GLOBALS, *safe_globals),
        storage_options=storage_options,
    )


def export_files(
    source: str | os.PathLike[str],
    save_dir: str | os.PathLike[str],
    *,
    step: int | None,
    allow_pickle: bool,
    safe_globals: tuple[Any, ...],
    storage_options: dict[str, Any] | None,
) -> str:
    """``tiercheck.integrations.deepspeed.export``: the step's files with ``torch.save``, then ``latest``."""
    state = load(source, step, allow_pickle=False, storage_options=storage_options)
    meta = state.pop(META, None)
    if not isinstance(meta, dict) or not isinstance(meta.get("tag"), str):
        raise CheckpointNotFoundError(f"{os.fspath(source)}: the step was not saved by the DeepSpeed integration")
    tag = checked_tag(meta["tag"], where=os.fspath(source))
    folder = Path(save_dir) / tag
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in state.items():
        target = folder / name
        if not target.resolve().is_relative_to(folder.resolve()):
            raise UnsafeCheckpointError(f"{name!r}: a file name that escapes {folder}")
        target.parent.mkdir(parents=True, exist_ok=True)
        obj = unpack(value, allow_pickle=allow_pickle, safe_globals=safe_globals, where=str(target))
        torch.save(obj, target)
    write_atomically(os.path.join(save_dir, "latest"), tag.encode())
    return tag


def refuse_universal(load_dir: str, tag: str | None) -> None:
    """With ``checkpoint.load_universal``, DeepSpeed reads ``<load_dir>/<tag>/zero/`` itself (with
    ``torch.load``, not through the checkpoint engine): a tiercheck step is not one. Refuse it with the
    way to make one, rather than let DeepSpeed fail on a missing file."""
    if tag is None:
        latest = os.path.join(load_dir, "latest_universal")
        if not os.path.isfile(latest):
            return  # DeepSpeed raises its own error
        tag = Path(latest).read_text().strip()
    folder = Path(load_dir, tag)
    ours = sorted(p.name for p in folder.glob("*.pt") if read_pointer(str(p)) is not None) if folder.is_dir() else []
    if ours:
        raise CheckpointNotFoundError(
            f"{folder} is a tiercheck step (its {ours[0]} is a pointer), not a universal checkpoint: write it as "
            "DeepSpeed's own files with tiercheck.integrations.deepspeed.export() or `tiercheck export-deepspeed`, "
            "convert those with `python -m deepspeed.checkpoint.ds_to_universal`, and load the result"
        )


def write_atomically(path: str, data: bytes) -> None:
    # Data-parallel replicas write the same pointer file at once, maybe from hosts with equal pids.
    tmp = f"{path}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
