"""The file Lightning asked for (``epoch=3-step=400.ckpt``, ``last.ckpt``): a small JSON pointer to a tiercheck step.

Lightning finds, sorts, links and deletes checkpoint files by their paths (``ModelCheckpoint``'s top-k files,
``ckpt_path="last"``), so each save leaves a file there; the tensors are in tiercheck step ``global_step``. The
pointer holds the save's own tree of plain values (tiercheck's tagged JSON, never pickle unless the caller opted
in) and its small tensors (callbacks' scores, counters: at most ``SMALL`` elements each) inline, so two saves at one
global step (a top-k file and ``last.ckpt``) each restore their own bookkeeping, while the step holds what cannot
differ within one global step (weights, optimizer state). Written once the step is committed, atomically::

    {"format": "tiercheck-lightning", "version": 2, "step": 400, "save_id": "<32 hex digits>",
     "local": "/nvme/ckpt/run1", "remote": "s3://...",
     "tree": {...}, "small": {"callbacks/.../best_model_score": ["float32", [], "<base64>"]}}

``save_id`` names the save of the step the pointer belongs to (the step's commit marker states it): step numbers
repeat (a rollback saves a step again), so a pointer is bound to its save, never to the number alone, and a
pointer whose step now holds another save (or whose ``step`` was edited) is refused. Version 1 pointers named
none and are refused too: save again, or restore the step by number (``tiercheck restore``).
"""


from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from tiercheck.errors import CorruptCheckpointError
from tiercheck.seam import Leaf, dtype_name, torch_dtype

__all__ = ["FORMAT", "MAX_BYTES", "SMALL", "decode_small", "encode_small", "is_pointer", "read", "write"]

FORMAT = "tiercheck-lightning"
VERSION = 2
SMALL = 1024  # elements: a tensor this small is kept in the pointer too
MAX_BYTES = 64 << 20  # a pointer read back larger than this is refused before it is read
_SAVE_ID = re.compile(r"[0-9a-f]{32}")


def encode_small(leaves: list[Leaf]) -> dict[str, Any]:
    """The save's small CPU tensors, inline: ``{path: [dtype, shape, base64 of the bytes]}``."""
    out: dict[str, Any] = {}
    for leaf in leaves:
        t = leaf.tensor
        if leaf.kind != "tensor" or t.numel() > SMALL or leaf.global_shape != tuple(t.shape):
            continue
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out[leaf.path] = [dtype_name(t.dtype), list(t.shape), base64.b64encode(raw).decode("ascii")]
    return out


def decode_small(entry: Any, where: str) -> torch.Tensor:
    try:
        dtype_s, shape, raw_s = entry
        dtype = torch_dtype(dtype_s)
        raw = base64.b64decode(raw_s, validate=True)
        n = 1
        for d in shape:
            n *= int(d)
        if n > SMALL or len(raw) != n * torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"{len(raw)} bytes for {n} elements of {dtype_s}")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape([int(d) for d in shape]).clone()
    except (TypeError, ValueError, RuntimeError) as e:
        raise CorruptCheckpointError(f"{where}: a small tensor cannot be decoded ({str(e)[:200]})") from None


def write(path: str | os.PathLike[str], doc: dict[str, Any]) -> None:
    """Write ``doc`` at ``path`` atomically (a reader sees the old file or the new one), durably."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tiercheck-tmp")
    data = json.dumps({"format": FORMAT, "version": VERSION, **doc}, separators=(",", ":")).encode()
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def is_pointer(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a file this plugin wrote (it starts as a pointer's JSON does)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return False
    return head.startswith(b'{"format":"' + FORMAT.encode() + b'"')


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A pointer's document, checked; ``CorruptCheckpointError`` for anything else."""
    size = os.stat(path).st_size
    if size > MAX_BYTES:
        raise CorruptCheckpointError(f"{path}: {size} bytes, more than a tiercheck pointer may hold ({MAX_BYTES})")
    try:
        doc = json.loads(Path(path).read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: not a tiercheck pointer ({str(e)[:200]})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{path}: not a tiercheck pointer")
    if doc.get("version") != VERSION:
        raise CorruptCheckpointError(f"{path}: pointer version {doc.get('version')!r}; this tiercheck reads {VERSION}")
    step = doc.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CorruptCheckpointError(f"{path}: pointer names no step ({step!r})")
    save = doc.get("save_id")
    if not isinstance(save, str) or not _SAVE_ID.fullmatch(save):
        raise CorruptCheckpointError(f"{path}: pointer names no save of step {step} ({str(save)[:40]!r})")
    if not isinstance(doc.get("tree"), dict) or not isinstance(doc.get("small"), dict):
        raise CorruptCheckpointError(f"{path}: pointer lacks its tree of values")
    return doc
