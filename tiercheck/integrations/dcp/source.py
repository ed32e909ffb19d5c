"""A DCP checkpoint directory (``dcp.save``'s ``FileSystemWriter``, torchtitan's ``step-N/``) opened in one
process, through DCP's own ``FileSystemReader`` (its tensors mapped, not read: ``dcp.mapped``), for
``tiercheck import``; and raw DCP byte items written back verbatim (``RawBytesSavePlanner``), for the import
and ``tiercheck export --format dcp``.

DCP's ``.metadata`` is a pickle, and ``FileSystemReader`` unpickles it with ``pickle.load``: here it is read
with an unpickler that builds only DCP's own metadata classes, ``torch.Size``, dtypes and paths (plain pickle
only with ``allow_pickle``). DCP's byte items (non-tensor values, themselves ``torch.save`` pickles) are never
unpickled for use: each is kept as the bytes stored, after ``torch.load(weights_only=True)`` showed it holds
nothing beyond plain values (unchecked with ``allow_pickle``), as ``TiercheckReader`` does.
"""


from __future__ import annotations

import io
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from tiercheck.errors import CorruptCheckpointError, TiercheckError, UnsafeCheckpointError
from tiercheck.integrations.dcp.mapped import Mapped, scratch_tensors

__all__ = [
    "METADATA_FILE",
    "RawBytes",
    "RawBytesSavePlanner",
    "count_tensors",
    "is_dcp_checkpoint",
    "read_dcp",
    "unpickling_refused",
]

METADATA_FILE = ".metadata"


class RawBytes(bytes):
    """A DCP byte item as stored (a ``torch.save`` pickle): written back as it is, not pickled again."""


class RawBytesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that a ``RawBytes`` value is written as its bytes (DCP's would
    ``torch.save`` it, wrapping the pickle in another)."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO and isinstance(object, RawBytes):
            return io.BytesIO(object)
        return super().transform_object(write_item, object)


def is_dcp_checkpoint(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / METADATA_FILE).is_file()


def read_dcp(
    path: str | os.PathLike[str], scratch: str | os.PathLike[str], *, allow_pickle: bool = False
) -> dict[str, Any]:
    """Every item of the DCP checkpoint at ``path``, by DCP's flattened name: tensors whole (however many
    ranks saved their shards), byte items as ``RawBytes``. No tensor is read here: each is mapped from its file,
    or, if saved in pieces, put together by DCP's reader in a scratch file in ``scratch`` (``dcp.mapped``)."""
    reader = _Reader(path, allow_pickle=allow_pickle)
    metadata = reader.read_metadata()
    mapped = Mapped(Path(path), metadata)
    state: dict[str, Any] = {}
    pieces: dict[str, TensorStorageMetadata] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            view = mapped.view(fqn, md)
            if view is None:
                pieces[fqn] = md
            state[fqn] = view
        elif isinstance(md, BytesStorageMetadata):
            state[fqn] = None  # filled by the planner's load_bytes
        else:
            raise UnsafeCheckpointError(f"{path}: {fqn} is a {type(md).__name__}, which tiercheck does not import")
    to_read: dict[str, Any] = {fqn: value for fqn, value in state.items() if value is None}
    to_read.update(scratch_tensors(pieces, Path(scratch)))
    if to_read:
        planner = _RawBytesLoadPlanner(path, allow_pickle=allow_pickle)
        try:
            dcp_load(to_read, storage_reader=reader, planner=planner, no_dist=True)
        except CheckpointException as e:  # DCP wraps every error: the library's own goes out as it was raised
            for error, _ in e.failures.values():
                if isinstance(error, TiercheckError):
                    raise error from None
            raise
    state.update(to_read)
    return state


def count_tensors(value: Any) -> tuple[int, int]:
    """The tensors in a nested state (mappings, lists, tuples) and their bytes."""
    if isinstance(value, torch.Tensor):
        return 1, value.numel() * value.element_size()
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, list | tuple) else ()
    counts = [count_tensors(v) for v in items]
    return sum(c for c, _ in counts), sum(b for _, b in counts)


def unpickling_refused(e: BaseException) -> str:
    """What ``torch.load(weights_only=True)`` refused, in one line (its message runs to a dozen)."""
    lines = str(e).splitlines()
    why = next((line.strip() for line in lines if "WeightsUnpickler error" in line), lines[0] if lines else "")
    return why.split(" was not an allowed global")[0]


class _Reader(FileSystemReader):
    """DCP's ``FileSystemReader``, its ``.metadata`` unpickled only into DCP's metadata classes."""

    def __init__(self, path: str | os.PathLike[str], *, allow_pickle: bool) -> None:
        super().__init__(path)
        self._metadata_path = Path(path) / METADATA_FILE
        self._allow_pickle = allow_pickle

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(self._metadata_path, "rb") as f:
            try:
                md = pickle.load(f) if self._allow_pickle else _MetadataUnpickler(f).load()
            except UnsafeCheckpointError:
                raise
            except Exception as e:
                raise CorruptCheckpointError(f"{self._metadata_path}: not DCP's metadata ({e})") from None
        if not isinstance(md, Metadata):
            raise CorruptCheckpointError(f"{self._metadata_path}: not DCP's metadata (a {type(md).__name__})")
        meta = getattr(md, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        md.storage_meta = meta
        return md


# The globals besides DCP's own classes that DCP's metadata pickles name: its sizes, layouts, paths.
_PLAIN = frozenset({("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                    ("pathlib", "PureWindowsPath")})  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes and the plain values in them; any other global is refused by name."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in _PLAIN:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            if module.startswith("torch.distributed.checkpoint."):
                found = super().find_class(module, name)
                if isinstance(found, type) and found.__module__ == module:  # a class of DCP's own, not a function
                    return found
        raise UnsafeCheckpointError(
            f"DCP metadata names {module}.{name}, which is not one of DCP's metadata classes: import it with "
            "--allow-pickle (allow_pickle=True) only if you trust the checkpoint"
        )


class _RawBytesLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that byte items are kept as stored (``RawBytes``), not unpickled."""

    def __init__(self, path: str | os.PathLike[str], *, allow_pickle: bool) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._where = str(path)
        self._allow_pickle = allow_pickle

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        raw = value.getvalue() if isinstance(value, io.BytesIO) else value.read()
        if not self._allow_pickle:
            try:
                torch.load(io.BytesIO(raw), weights_only=True)
            except Exception as e:
                raise UnsafeCheckpointError(
                    f"{self._where}: {fqn} needs unpickling beyond torch.load(weights_only=True) "
                    f"({unpickling_refused(e)}); import it "
                    "with --allow-pickle (allow_pickle=True) only if you trust the checkpoint"
                ) from None
        self.state_dict[fqn] = RawBytes(raw)
