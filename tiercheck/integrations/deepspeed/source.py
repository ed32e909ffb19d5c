"""``tiercheck import`` of a DeepSpeed checkpoint: DeepSpeed's own ``<save_dir>/<tag>/`` files become the step the
DeepSpeed plugin would have saved, so that ``engine.load_checkpoint`` with the plugin installed continues from it.

    from tiercheck.integrations.deepspeed.source import import_deepspeed
    import_deepspeed("checkpoints", "/nvme/ckpt/run1", tag=None, step=None, remote=None, options={},
                     allow_pickle=False)   # the tag `checkpoints/latest` names

A DeepSpeed checkpoint is ``<save_dir>/latest`` (the newest tag's name) and ``<save_dir>/<tag>/``, one ``torch.save``
file per part: ``mp_rank_NN_model_states.pt`` (the module, DeepSpeed's counters, the user's ``client_state``),
``[bf16_]zero_pp_rank_N_mp_rank_NN_optim_states.pt`` (a rank's ZeRO partition), a pipeline's ``layer_NN-...``.
Each file is read with ``torch.load(weights_only=True)`` and the plugin's allow-list (DeepSpeed's loss scalers,
``fragment_address``, ...), memory-mapped; what needs more (a class of the user's in ``client_state``) is refused,
naming the file, unless the caller allows pickle. The step holds each file's state dict under the file's name,
packed as the plugin packs what DeepSpeed hands it, and the plugin's entry naming the tag and the files; it is
numbered by the model states' ``global_steps`` (what the plugin numbers DeepSpeed's saves by), else by the tag's
``global_stepN``, else by the caller's step. Written in this one process; ranks restoring it read each other's
files as they would any step's.
"""


from __future__ import annotations

import logging
import os
import pickle
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiercheck import Checkpointer
from tiercheck.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    UnsafeCheckpointError,
)
from tiercheck.integrations.dcp.source import count_tensors, unpickling_refused
from tiercheck.integrations.deepspeed.compat import SAFE_GLOBALS
from tiercheck.integrations.deepspeed.files import META, checked_tag, pack, read_pointer

__all__ = ["DeepSpeedImport", "DeepSpeedSource", "find_source", "import_deepspeed"]

log = logging.getLogger("tiercheck.deepspeed")

LATEST = "latest"  # DeepSpeed's file naming the newest tag of a save_dir
_MODEL_STATES = "model_states.pt"  # the end of every file of DeepSpeed's holding the module and its counters
_TAG_STEP = re.compile(r"global_step([0-9]+)")  # DeepSpeed's default tag


@dataclass(frozen=True, slots=True)
class DeepSpeedSource:
    """One DeepSpeed checkpoint: its tag's folder, the tag, and its files (names within the folder)."""

    folder: Path
    tag: str
    files: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DeepSpeedImport:
    """What :func:`import_deepspeed` wrote: the step, the tag, the steps not drained yet, the tensors and bytes."""

    step: int
    tag: str
    undrained: list[int]
    tensors: int
    nbytes: int


def find_source(src: str | os.PathLike[str], tag: str | None) -> DeepSpeedSource:
    """The checkpoint at ``src``: with ``tag``, ``<src>/<tag>/``; else the tag ``<src>/latest`` names; else
    ``src`` itself where it is a tag's folder."""
    path = Path(src)
    if tag is not None:
        folder = path / checked_tag(tag, where="--tag")
    elif (path / LATEST).is_file():
        named = (path / LATEST).read_text(errors="replace").strip()
        folder = path / checked_tag(named, where=str(path / LATEST))
    else:
        folder = path
    if not folder.is_dir():
        there = sorted(p.name for p in path.iterdir() if p.is_dir())[:8]
        raise CheckpointNotFoundError(f"{folder}: no such DeepSpeed tag folder (folders in {path}: {there or 'none'})")
    files = tuple(sorted(p.name for p in folder.glob("*.pt") if p.is_file()))
    if not any(f.endswith(_MODEL_STATES) for f in files):
        raise CheckpointNotFoundError(f"{folder} holds no DeepSpeed model states (*{_MODEL_STATES}): no tag's folder")
    for name in files:
        pointer = read_pointer(str(folder / name))
        if pointer is not None:  # the plugin's own save: its data is a tiercheck step already
            raise InvalidArgumentError(
                f"{folder / name} is tiercheck's pointer to step {pointer.get('step')} in {pointer.get('root')}: "
                "this checkpoint is a tiercheck step already (`tiercheck copy` or `tiercheck restore` moves it)"
            )
    named = checked_tag(folder.resolve().name, where=str(folder))  # `.` for the tag's folder: its real name
    return DeepSpeedSource(folder=folder, tag=named, files=files)


def import_deepspeed(
    src: str | os.PathLike[str],
    to: str | os.PathLike[str],
    *,
    tag: str | None,
    step: int | None,
    remote: str | None,
    options: dict[str, Any],
    allow_pickle: bool,
) -> DeepSpeedImport:
    """Write DeepSpeed's checkpoint at ``src`` (see :func:`find_source`) as a step of a new lineage in ``to``
    (drained to ``remote`` where given)."""
    source = find_source(src, tag)
    contents = {name: _read(source.folder / name, allow_pickle=allow_pickle) for name in source.files}
    step = _step(source, contents, step)
    state: dict[str, Any] = {name: pack(value) for name, value in contents.items()}
    state[META] = {"tag": source.tag, "files": list(source.files)}
    with Checkpointer(state, local=to, remote=remote, **options) as ck:
        ck.save(step, metadata={"deepspeed": {"tag": source.tag}}).wait()
        undrained = ck.close()
    log.info("imported DeepSpeed checkpoint %r (%d files) as step %d", source.tag, len(source.files), step)
    return DeepSpeedImport(step, source.tag, undrained, *count_tensors(contents))


def _read(path: Path, *, allow_pickle: bool) -> Any:
    """One of DeepSpeed's files, memory-mapped where torch can (its zip format): the tensors are read as the
    save copies them. Without ``allow_pickle``, only the types ``torch.load(weights_only=True)`` and the
    plugin's allow-list rebuild."""
    mmap = zipfile.is_zipfile(path)
    if allow_pickle:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:  # what torch.load(weights_only=True) raises for a type it does not rebuild
        raise UnsafeCheckpointError(
            f"{path} needs unpickling beyond torch.load(weights_only=True) and DeepSpeed's allow-listed types "
            f"({unpickling_refused(e)}); import it with --allow-pickle (allow_pickle=True) only if you trust the "
            "checkpoint"
        ) from None
    except (RuntimeError, OSError, EOFError) as e:
        raise CorruptCheckpointError(f"{path}: not a readable torch.save file ({e})") from None


def _step(source: DeepSpeedSource, contents: Mapping[str, Any], given: int | None) -> int:
    """The model states' ``global_steps`` (DeepSpeed restores the engine's from it, and the plugin numbers the
    next saves by it), else the tag's ``global_stepN``, else ``given``; ``given`` may only agree with the
    others, since a step of another number would not be where the resumed run's saves continue."""
    counted = next(
        (
            (name, v["global_steps"])
            for name, v in contents.items()
            if name.endswith(_MODEL_STATES) and isinstance(v, Mapping) and type(v.get("global_steps")) is int
        ),
        None,
    )
    named = _TAG_STEP.fullmatch(source.tag)
    if counted is not None:
        found, why = counted[1], f"{source.folder / counted[0]} says global_steps={counted[1]}"
    elif named is not None:
        found, why = int(named.group(1)), f"the tag {source.tag!r} names step {named.group(1)}"
    elif given is None:
        raise InvalidArgumentError(
            f"{source.folder}: neither its model states' global_steps nor its tag name a step: give --step N"
        )
    else:
        return given
    if given is not None and given != found:
        raise InvalidArgumentError(
            f"--step {given}: {why}, the step the DeepSpeed plugin numbers this checkpoint by (the engine resumes "
            "at that count and numbers its next saves after it); leave --step out"
        )
    return found
