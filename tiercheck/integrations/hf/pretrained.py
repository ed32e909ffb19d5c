"""``load_pretrained``: a training state's tensors filled from a Hugging Face safetensors directory
(a published model, or one ``export`` wrote), to start training from it; the job then saves
tiercheck steps as usual.

Each rank reads only what its tensors hold: a ``tiercheck.Shard`` or DTensor reads the rows its
slice spans (one read each, ranged GETs in parallel on an object store); a slice of columns reads
its own runs from a local file (one ``preadv`` each), its rows whole from an object store. Every
header, the index and each tensor's shape and dtype are checked against the state before a byte
of tensor data is read. A job's first state, it is read as ``restore()`` reads at a job start:
straight into the live CPU tensors where their slice is one run of the file (``in_place``), else
into new memory, which the live tensors take over (a whole tensor: no copy) once every rank has
read all of its own; ``in_place=False`` reads all of it that way (all or nothing).
A safetensors file carries no checksums: what is checked is its structure, not its bytes. A local directory
is read as files from outside (``source``): links to regular files are followed (the hub cache's layout), and
anything else where a file should be (a FIFO, a directory) is refused without blocking.
"""


from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tiercheck.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleStateError,
    PartlyRestoredError,
    TiercheckError,
)
from tiercheck.integrations.hf.files import (
    INDEX_FILE,
    MAX_INDEX_BYTES,
    SINGLE_FILE,
    TensorEntry,
    header_length,
    parse_header,
    parse_index,
)
from tiercheck.integrations.hf.names import NameMap, rename
from tiercheck.integrations.hf.source import ImportDir, open_regular
from tiercheck.seam import LocalTier, Tier, copy_in, dtype_name, is_stateful, open_tier, placement_of, some, torch_dtype


@dataclass(frozen=True, slots=True)
class _Fill:
    name: str  # the state's name
    entry: TensorEntry
    file: str
    local: torch.Tensor  # the live tensor (this rank's slice)
    offsets: tuple[int, ...]


def load_pretrained(
    source: str | os.PathLike[str],
    state: Mapping[str, Any] | torch.nn.Module,
    *,
    drop_prefix: str | None = None,
    names: NameMap | None = None,
    strict: bool = True,
    cast: bool = False,
    storage_options: dict[str, Any] | None = None,
    io_threads: int = 8,
    process_group: Any = None,
    in_place: bool = True,
) -> list[str]:
    """Fill ``state``'s tensors from the safetensors directory ``source`` (local, or a remote URL:
    ``s3://``, ``az://``, ``file://``). Returns the state names filled.

    ``state`` is a module (its ``state_dict()``) or a mapping of names to plain tensors,
    ``tiercheck.Shard``s and DTensors (a module or mapping in it counts under ``name.``). Each name
    becomes a Hugging Face name as ``export`` maps it (``drop_prefix``, then ``names``; None: not
    loaded). With ``strict``, every tensor must be in the files. A dtype that differs from the
    file's is refused unless ``cast``. Under ``torch.distributed``, every rank of ``process_group``
    calls this.

    It loads a job's first state, so by default (``in_place``), as ``restore()`` at a job start, a
    CPU tensor of the file's dtype whose slice spans whole rows is read straight into its own
    memory: no second copy, and no new memory to fault in. Where a read then fails, on any rank,
    ``PartlyRestoredError`` names the tensors already overwritten. ``in_place=False``: every slice
    is read into new memory first, and no rank writes its tensors unless all read theirs.
    """
    where = os.fspath(source)
    tier = open_tier(where, storage_options=storage_options)
    if isinstance(tier, LocalTier):  # files from outside: links to regular files followed, nothing else read
        tier = ImportDir(tier.root)
    written: list[str] = []  # read in place so far (a failure leaves them partly loaded)
    fills: list[_Fill] = []
    try:
        fills = _plan(tier, _tensors(state), drop_prefix=drop_prefix, names=names, strict=strict, cast=cast,
                      where=where)  # fmt: skip
        staged = _read_all(tier, fills, io_threads=io_threads, where=where, into=written if in_place else None)
        error: BaseException | None = None
    except (TiercheckError, OSError) as e:
        error, staged = e, []
    try:
        _agree(error, process_group)
    except (TiercheckError, OSError) as e:
        if written:
            raise PartlyRestoredError(
                f"{e}; load_pretrained had already read into tensor(s) {some(sorted(written), 8)} in place: "
                "load again, or rebuild them, before using them (in_place=False reads all first)"
            ) from e
        raise
    # as a restore hands its staged data over: a whole tensor takes the new memory over, others are copied into
    copy_in([(f.local, data, True) for f, data in zip(fills, staged, strict=True) if data is not f.local])
    return [f.name for f in fills]


def _tensors(state: Any, prefix: str = "") -> dict[str, Any]:
    """Names to tensors, Shards and DTensors, modules and mappings opened under ``name.``."""
    items: Mapping[str, Any] = state.state_dict() if is_stateful(state) else state
    out: dict[str, Any] = {}
    for k, v in items.items():
        name = f"{prefix}{k}"
        if is_stateful(v) or isinstance(v, Mapping):
            out.update(_tensors(v, f"{name}."))
        elif placement_of(v, where=name) is not None:
            out[name] = v
    return out


def _plan(
    tier: Tier,
    tensors: dict[str, Any],
    *,
    drop_prefix: str | None,
    names: NameMap | None,
    strict: bool,
    cast: bool,
    where: str,
) -> list[_Fill]:
    """Each state tensor matched to its file entry, shapes and dtypes checked; nothing read yet."""
    sizes = tier.sizes("")
    if INDEX_FILE in sizes:
        if sizes[INDEX_FILE] > MAX_INDEX_BYTES:
            raise CorruptCheckpointError(f"{where}/{INDEX_FILE}: {sizes[INDEX_FILE]:,} bytes, beyond any index")
        weight_map = parse_index(bytes(tier.read(INDEX_FILE)), where=f"{where}/{INDEX_FILE}")
    elif SINGLE_FILE in sizes:
        weight_map = None
    else:
        raise CheckpointNotFoundError(f"{where}: neither {INDEX_FILE} nor {SINGLE_FILE} is there")
    wanted: dict[str, str] = {}  # HF name -> state name
    for name in tensors:
        hf = rename(name, drop_prefix=drop_prefix, names=names)
        if hf is not None:
            wanted[hf] = name
    files = sorted({weight_map[n] for n in wanted if n in weight_map}) if weight_map is not None else [SINGLE_FILE]
    entries: dict[str, tuple[str, TensorEntry]] = {}
    for file in files:
        if file not in sizes:
            raise CorruptCheckpointError(f"{where}: {INDEX_FILE} names {file}, which is not there")
        for n, e in _header(tier, file, sizes[file], where=f"{where}/{file}").items():
            entries[n] = (file, e)
    missing = sorted(n for n in wanted if n not in entries and not _tied(tensors, wanted[n], entries, wanted))
    if missing and strict:
        shown = some([repr(n) for n in missing])
        raise IncompatibleStateError(f"{where}: the state's tensors {shown} are not in the files")
    fills = []
    for hf, name in wanted.items():
        if hf not in entries:
            continue
        file, entry = entries[hf]
        placed = placement_of(tensors[name], where=name)
        assert placed is not None
        local, global_shape, offsets = placed
        if tuple(global_shape) != entry.shape or (dtype_name(local.dtype) != entry.dtype and not cast):
            raise IncompatibleStateError(
                f"{where}/{file}: {hf}: the file has {entry.dtype}{list(entry.shape)}, the state's {name} "
                f"{dtype_name(local.dtype)}{list(global_shape)}" + ("" if cast else " (cast=True converts dtypes)")
            )
        fills.append(_Fill(name, entry, file, local, tuple(offsets)))
    return fills


def _tied(tensors: dict[str, Any], name: str, entries: Mapping[str, Any], wanted: dict[str, str]) -> bool:
    """Whether ``name``'s tensor is the very memory of another tensor the files hold (tied weights:
    ``save_pretrained`` writes ``lm_head.weight`` tied to the embedding once), so it is filled too."""
    placed = placement_of(tensors[name], where=name)
    assert placed is not None
    t = placed[0]
    for hf, other in wanted.items():
        if other != name and hf in entries:
            o = placement_of(tensors[other], where=other)
            if o is not None and o[0].data_ptr() == t.data_ptr() and o[0].shape == t.shape and t.numel():
                return True
    return False


def _header(tier: Tier, file: str, size: int, *, where: str) -> dict[str, TensorEntry]:
    n = header_length(bytes(tier.read_range(file, 0, 8)), where=where)
    if 8 + n > size:
        raise CorruptCheckpointError(f"{where}: header length {n:,} runs past the end of the file ({size:,} bytes)")
    return parse_header(bytes(tier.read_range(file, 8, n)), size, where=where)


def _read_all(
    tier: Tier, fills: list[_Fill], *, io_threads: int, where: str, into: list[str] | None
) -> list[torch.Tensor]:
    """Every fill's slice, read into new memory of the live tensor's dtype (and device); with
    ``into`` (a list), each one that can be read straight into its live tensor is (that tensor
    itself is returned for it), its name added to ``into`` before the first byte lands."""

    def read(f: _Fill) -> torch.Tensor:
        if into is not None and _in_place(f):
            into.append(f.name)
            return _read_in_place(tier, f, where=where)
        return _read_slice(tier, f, where=where)

    with ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="tiercheck-hf-read") as pool:
        return list(pool.map(read, fills))


def _in_place(f: _Fill) -> bool:
    """Whether ``f``'s slice can be read straight into its live tensor: on the CPU, contiguous, of
    the file's dtype, spanning whole rows (its bytes are one run of the file)."""
    t, shape = f.local, f.entry.shape
    return (
        t.device.type == "cpu"
        and t.is_contiguous()
        and t.numel() > 0
        and t.dtype == torch_dtype(f.entry.dtype)
        and (not shape or tuple(t.shape[1:]) == shape[1:])
    )


def _read_in_place(tier: Tier, f: _Fill, *, where: str) -> torch.Tensor:
    shape, nbytes = f.entry.shape, f.local.numel() * f.local.element_size()
    row = f.entry.nbytes // max(shape[0], 1) if shape else f.entry.nbytes
    lo = f.offsets[0] if shape else 0
    memory = f.local.detach().view(-1).view(torch.uint8).numpy().data
    n, _ = tier.read_into(f.file, memory, offset=f.entry.start + lo * row, length=nbytes)
    if n != nbytes:
        raise CorruptCheckpointError(f"{where}/{f.file}: {f.entry.name}: the file ends inside its data")
    return f.local


def _read_slice(tier: Tier, f: _Fill, *, where: str) -> torch.Tensor:
    """One read of the rows the slice spans, into new memory, then the slice of those rows; from a
    local file, a slice of columns reads its own runs only (``_read_runs``).

    Read, not mapped (as ``safetensors.safe_open`` maps the file): a slice of a mapping is read from
    disk only when it is copied into the live tensor, which would break all-or-nothing, and a
    file cut short under the mapping kills the process with SIGBUS instead of raising."""
    shape, dtype = f.entry.shape, torch_dtype(f.entry.dtype)
    row = f.entry.nbytes // max(shape[0], 1) if shape else f.entry.nbytes
    lo, rows = (f.offsets[0], f.local.shape[0]) if shape else (0, 1)
    if row == 0 or rows == 0:
        return _to_live(torch.empty(f.local.shape, dtype=dtype), f)
    if shape and tuple(f.local.shape[1:]) != shape[1:] and tier.local_path is not None:
        runs = _read_runs(tier.local_path / f.file, f, dtype, where=where)
        if runs is not None:
            return _to_live(runs, f)
    buf = torch.empty(rows * row, dtype=torch.uint8)
    n, _ = tier.read_into(f.file, buf.numpy().data, offset=f.entry.start + lo * row, length=rows * row)
    if n != rows * row:
        raise CorruptCheckpointError(f"{where}/{f.file}: {f.entry.name}: the file ends inside its data")
    t = buf.view(dtype)
    if not shape:
        return _to_live(t.view(()), f)
    t = t.view(rows, *shape[1:])
    if tuple(f.local.shape[1:]) != shape[1:]:  # a slice across rows: keep only it, not the rows read
        t = t[(slice(None), *_box(f)[1:])].contiguous()
    return _to_live(t, f)


MAX_RUNS = 1 << 16  # past this many reads for one slice, its rows are read whole (one read) instead
MIN_RUN_BYTES = 4096  # and below this size of one, too: whole rows cost less than page-sized reads


def _read_runs(path: Path, f: _Fill, dtype: torch.dtype, *, where: str) -> torch.Tensor | None:
    """A slice that cuts a dimension after the first (a row-parallel weight's columns), read as its
    contiguous runs with one ``preadv`` each straight into new memory: this rank reads its own bytes,
    not every row whole. None where the runs are too many or too small."""
    shape, box = f.entry.shape, _box(f)
    cut = max(d for d in range(len(shape)) if f.local.shape[d] != shape[d])  # dimensions after it are whole
    run = math.prod(f.local.shape[cut:]) * dtype.itemsize
    outer = list(itertools.product(*(range(b.start, b.stop) for b in box[:cut])))
    if len(outer) > MAX_RUNS or run < MIN_RUN_BYTES:
        return None
    strides = [math.prod(shape[d + 1 :]) * dtype.itemsize for d in range(len(shape))]
    out = torch.empty(f.local.shape, dtype=dtype)
    flat = out.view(-1).view(torch.uint8).numpy().data
    fd = open_regular(path, where=f"{where}/{f.file}")
    base = f.entry.start + box[cut].start * strides[cut]
    try:
        for i, index in enumerate(outer):
            at = base + sum(x * st for x, st in zip(index, strides, strict=False))
            view = flat[i * run : (i + 1) * run]
            if os.preadv(fd, [view], at) != run:
                raise CorruptCheckpointError(f"{where}/{f.file}: {f.entry.name}: the file ends inside its data")
    finally:
        os.close(fd)
    return out


def _box(f: _Fill) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(f.offsets, f.local.shape, strict=True))


def _to_live(t: torch.Tensor, f: _Fill) -> torch.Tensor:
    """``t`` (new memory, read for this load) in the live tensor's dtype and device, ready to copy in."""
    return t.to(device=f.local.device, dtype=f.local.dtype)


def _agree(error: BaseException | None, group: Any) -> None:
    """Raise this rank's error, or another rank's failure, before any rank writes a live tensor."""
    if dist.is_available() and dist.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
        flag = torch.tensor([0 if error is None else 1], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if error is None and flag.item():
            raise IncompatibleStateError("load_pretrained: another rank failed to read its tensors; none was written")
    if error is not None:
        raise error
