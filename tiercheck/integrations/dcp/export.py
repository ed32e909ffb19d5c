"""``tiercheck export --format dcp``: a committed step as a DCP checkpoint directory (``FileSystemWriter``'s
files and ``.metadata``), which ``dcp.load`` and torchtitan's own manager read without tiercheck.

The step is read whole into this process (``tiercheck.load``: every chunk verified), nested entries as DCP
flattens them. A step saved through :class:`TiercheckWriter` (DCP's flattened names, its byte items as
stored) is written back with those byte items verbatim, so the directory holds what ``dcp.save`` would have;
any other step's plain values become DCP byte items the usual way (``torch.save``). The directory appears
only once whole (written beside it, then renamed).
"""


from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercheck import load
from tiercheck.errors import IncompatibleStateError, InvalidArgumentError
from tiercheck.integrations.dcp.source import RawBytes, RawBytesSavePlanner, count_tensors
from tiercheck.seam import open_step, read_index

__all__ = ["ExportedDcp", "export_dcp"]


@dataclass(frozen=True, slots=True)
class ExportedDcp:
    directory: Path
    tensors: int
    nbytes: int
    seconds: float


def export_dcp(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    step: int | None = None,
    only: Iterable[str] = (),
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
    io_threads: int = 4,
) -> ExportedDcp:
    """Write committed ``step`` of ``source`` (a directory holding every rank's chunks, or a remote URL) as a
    DCP checkpoint in the new (or empty) directory ``target``; ``only``: these top-level entries alone."""
    import torch.distributed.checkpoint as dcp

    begin = time.monotonic()
    out = Path(target).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InvalidArgumentError(f"{out} exists and is not an empty directory: give a new one")
    tier, n, _, _ = open_step(source, step, storage_options=storage_options)
    _, doc, _ = read_index(tier, n)
    meta = doc.get("metadata")
    from_dcp = isinstance(meta, dict) and "dcp" in meta  # saved by TiercheckWriter: bytes are DCP's byte items
    tree = load(source, n, allow_pickle=allow_pickle, io_threads=io_threads, storage_options=storage_options)
    wanted = list(only)
    if wanted:
        missing = [k for k in wanted if k not in tree]
        if missing:
            raise IncompatibleStateError(f"{tier.url}: step {n} has no entry {', '.join(missing)} (it has "
                                         f"{', '.join(sorted(tree))})")  # fmt: skip
        tree = {k: tree[k] for k in wanted}
    if from_dcp:
        tree = {k: RawBytes(v) if isinstance(v, bytes) else v for k, v in tree.items()}
    tensors, nbytes = count_tensors(tree)
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # a copy an interrupted export left
    with warnings.catch_warnings():  # DCP's note that this process saves alone: it does, on purpose
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(tree, storage_writer=dcp.FileSystemWriter(partial), planner=RawBytesSavePlanner(), no_dist=True)
    if out.exists():
        out.rmdir()  # empty, checked above
    os.replace(partial, out)
    return ExportedDcp(out, tensors, nbytes, time.monotonic() - begin)

