"""DCP's ``Metadata`` as tiercheck step metadata (JSON, never pickle), and DCP's ``checkpoint_id`` as a step.

What a step saved through :class:`~tiercheck.integrations.dcp.TiercheckWriter` records about DCP, in the
commit's metadata under ``"dcp"``::

    {"format": "tiercheck-dcp", "version": 1, "dcp_version": "1.0.0",
     "tensors": {fqn: [dtype, [global size...]]}, "bytes": [fqn, ...],
     "planner_data": {fqn: [path component, ...]} or null}

DCP's own metadata lists every saved chunk of every tensor (a tensor's chunk per rank): its size grows with
parameters x ranks. tiercheck's manifest already knows where each chunk lies, so only what DCP's planners use
is kept (each tensor's dtype and global size) and the reader describes every tensor as one chunk covering it:
DCP's load planner then asks for the region each rank needs within that chunk, which is all a reader needs.
The size grows with the number of tensors only (about 75 bytes a tensor, twice that with planner data); the
commit metadata is bounded (16 MiB), which holds about 100,000 tensors with their planner data and 200,000
without (it is left out above that, with a warning; DCP's default planners do not use it to load into a given
state dict).
"""


from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections import ChainMap
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan

from tiercheck.errors import CorruptCheckpointError, IncompatibleStateError
from tiercheck.seam import JSON, MAX_METADATA_BYTES, dtype_name, torch_dtype

__all__ = ["FORMAT", "VERSION", "describe_metadata", "describe_plans", "layout_digest", "step_of", "to_metadata"]

log = logging.getLogger("tiercheck")

FORMAT = "tiercheck-dcp"
VERSION = 1
_DIGITS = re.compile(r"^[0-9]+$")
_ROOM = MAX_METADATA_BYTES - 4096  # what the rest of the commit metadata may take


def step_of(checkpoint_id: str | os.PathLike[str] | int) -> int:
    """The tiercheck step a DCP ``checkpoint_id`` names: a non-negative int, or its decimal string."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool) and checkpoint_id >= 0:
        return checkpoint_id
    if isinstance(checkpoint_id, str) and _DIGITS.match(checkpoint_id.strip()):
        return int(checkpoint_id.strip())
    raise ValueError(
        f"checkpoint_id {checkpoint_id!r} is not a step: tiercheck's DCP storage takes the step number "
        "(an int such as 100, or its decimal string '100') as checkpoint_id; the directory is the "
        "writer's / reader's local=..."
    )


def _tensor_entry(dtype: torch.dtype, size: Sequence[int]) -> JSON:
    return [dtype_name(dtype), [int(n) for n in size]]


def _planner_data(data: Any) -> JSON:
    """DefaultSavePlanner's mappings (fqn -> path of str / int keys) as JSON; None for anything else."""
    if not isinstance(data, dict):
        return None
    out: dict[str, JSON] = {}
    for fqn, path in data.items():
        if not isinstance(fqn, str) or not isinstance(path, tuple | list):
            return None
        if not all(isinstance(p, str) or (type(p) is int) for p in path):
            return None
        out[fqn] = list(path)
    return out


def _finish(doc: dict[str, JSON]) -> dict[str, JSON]:
    if len(json.dumps(doc)) > _ROOM and doc.get("planner_data") is not None:
        log.warning("DCP planner data left out of the step's metadata: it would exceed %d bytes", _ROOM)
        doc["planner_data"] = None
    return doc


def describe_metadata(md: Metadata) -> dict[str, JSON]:
    """The JSON kept for DCP's global ``Metadata`` (made by the coordinator's planner)."""
    tensors: dict[str, JSON] = {}
    blobs: list[str] = []
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            tensors[fqn] = _tensor_entry(entry.properties.dtype, entry.size)
        else:
            blobs.append(fqn)
    return _finish(
        {
            "format": FORMAT,
            "version": VERSION,
            "dcp_version": md.version,
            "tensors": tensors,
            "bytes": sorted(blobs),
            "planner_data": _planner_data(md.planner_data),
        }
    )


def describe_plans(plans: list[SavePlan]) -> dict[str, JSON]:
    """The same JSON, from the global save plans (for planners that keep no ``metadata`` attribute)."""
    tensors: dict[str, JSON] = {}
    blobs: set[str] = set()
    for plan in plans:
        for item in plan.items:
            if item.tensor_data is not None:
                tensors[item.index.fqn] = _tensor_entry(item.tensor_data.properties.dtype, item.tensor_data.size)
            else:
                blobs.add(item.index.fqn)
    data = [p.planner_data for p in plans if isinstance(p.planner_data, dict)]
    return _finish(
        {
            "format": FORMAT,
            "version": VERSION,
            "dcp_version": None,
            "tensors": tensors,
            "bytes": sorted(blobs),
            "planner_data": _planner_data(dict(ChainMap(*data))) if data else None,
        }
    )


def layout_digest(plans: list[SavePlan]) -> str:
    """A digest of which rank writes which tensor region: equal digests, equal tiercheck save plans."""
    h = hashlib.blake2b(digest_size=16)
    for rank, plan in enumerate(plans):
        for item in plan.items:
            td = item.tensor_data
            if td is None:
                continue
            h.update(
                repr(
                    (
                        rank,
                        item.index.fqn,
                        tuple(td.chunk.offsets),
                        tuple(td.chunk.sizes),
                        tuple(td.size),
                        td.properties.dtype,
                    )
                ).encode()
            )
    return h.hexdigest()


def to_metadata(doc: JSON, step: int, *, where: str) -> Metadata:
    """DCP ``Metadata`` from the JSON a step keeps; each tensor is one chunk covering it (see the module doc)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise IncompatibleStateError(
            f"{where} was not saved through tiercheck.integrations.dcp.TiercheckWriter (its metadata has no DCP "
            "description); load it with tiercheck.Checkpointer.restore or tiercheck.load"
        )
    if doc.get("version") != VERSION:
        raise CorruptCheckpointError(f"{where}: DCP description version {doc.get('version')!r}; this reads {VERSION}")
    try:
        entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        tensors = doc["tensors"]
        blobs = doc["bytes"]
        if not isinstance(tensors, dict) or not isinstance(blobs, list):
            raise TypeError("tensors must be an object and bytes a list")
        for fqn, (dtype, size) in tensors.items():
            shape = torch.Size(int(n) for n in size)
            if any(n < 0 for n in shape):
                raise ValueError(f"{fqn}: negative size")
            entries[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch_dtype(str(dtype))),
                size=shape,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)],
            )
        for fqn in blobs:
            entries[str(fqn)] = BytesStorageMetadata()
        raw = doc.get("planner_data")
        planner_data = None if raw is None else {str(k): tuple(v) for k, v in raw.items()}  # type: ignore[union-attr]
        version = doc.get("dcp_version")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(f"{where}: malformed DCP description ({e!r})") from None
    return Metadata(
        state_dict_metadata=entries,
        planner_data=planner_data,
        storage_meta=StorageMeta(checkpoint_id=str(step)),
        version=version if isinstance(version, str) else None,
    )
