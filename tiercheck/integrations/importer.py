"""``tiercheck import``: one checkpoint of another framework becomes a step of a new tiercheck lineage.

    from tiercheck.integrations.importer import import_checkpoint
    import_checkpoint("/ckpt/run1/step-10", "/nvme/ckpt/run1")          # step 10, from the name
    import_checkpoint("/ckpt/model_1000.pt", "/nvme/ckpt/run1", remote="s3://bucket/run1")  # drained too

Sources, told apart by their files (never by trying to unpickle them):

- a DCP checkpoint directory (``dcp.save``'s ``FileSystemWriter``, torchtitan's ``step-N/``), read through DCP's
  own ``FileSystemReader`` (``dcp.source``: no pickle for its ``.metadata``; byte items kept as stored), every
  tensor whole however many ranks saved it, written through :class:`TiercheckWriter` with ``dcp.save``: the step
  is what tiercheck's DCP writer would have saved, so ``dcp.load`` with a ``TiercheckReader`` (torchtitan's
  tiercheck manager) and ``Checkpointer.restore`` of the flattened names both read it back;
- a ``torch.save`` file (a loop's ``.pt``, Lightning's ``.ckpt``): ``torch.load(weights_only=True)`` (plain
  pickle only with ``allow_pickle``), its mapping saved as the state of a ``Checkpointer``;
- a DeepSpeed checkpoint (its ``save_dir``, holding ``latest``, or one tag's folder): its ``torch.save`` files with
  ``torch.load(weights_only=True)`` and the DeepSpeed plugin's allow-list, written as the step the plugin would
  have saved, numbered by DeepSpeed's ``global_steps`` (``deepspeed.source``: it needs DeepSpeed installed), so
  ``engine.load_checkpoint`` with the plugin installed continues from it.

One process writes the step, every chunk with its CRC32C, committed as any other; with ``remote`` it drains
before the call returns. The step is staged through a pool of at most ``max_host_bytes`` (1 GiB), straight
from the source: a ``torch.save`` file (and DeepSpeed's) is memory-mapped, and so is each tensor of a DCP
checkpoint saved in one piece (a tensor saved in pieces by several ranks is put together by DCP's reader in a
scratch file on ``to``'s disk, unlinked at once, ``dcp.mapped``), so the import's own memory stays at that bound
whatever the checkpoint's size.
The step is of a new lineage: ``to`` must hold no tiercheck step of another run (``LineageError``).
Resharding is left to the restore, as for any step.
"""


from __future__ import annotations

import logging
import os
import time
import warnings
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiercheck import Checkpointer, StagingOptions
from tiercheck.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    UnsafeCheckpointError,
)
from tiercheck.seam import step_in_name

__all__ = ["Imported", "import_checkpoint", "source_kind"]

log = logging.getLogger("tiercheck")

IMPORT_HOST_BYTES = 1 << 30  # the staging pool an import streams the source through


@dataclass(frozen=True, slots=True)
class Imported:
    """What ``import_checkpoint`` wrote: the step, the source's kind, its tensors and their bytes."""

    step: int
    kind: str  # "dcp", "deepspeed" or "torch"
    tensors: int
    nbytes: int
    seconds: float
    tag: str | None = None  # a DeepSpeed checkpoint's
    staged_peak_bytes: int | None = None  # the most host memory the staging held (a DCP or torch.save source's)


def source_kind(src: str | os.PathLike[str]) -> str:
    """``"dcp"`` for a DCP checkpoint directory, ``"deepspeed"`` for DeepSpeed's ``save_dir`` (holding ``latest``)
    or one of its tags' folders, ``"torch"`` for a ``torch.save`` file; anything else is refused."""
    from tiercheck.integrations.dcp.source import is_dcp_checkpoint

    path = Path(src)
    if not path.exists():
        raise CheckpointNotFoundError(f"{src}: no such checkpoint")
    if path.is_dir():
        if is_dcp_checkpoint(path):
            return "dcp"
        if (path / "latest").is_file() or any(path.glob("*model_states.pt")):  # DeepSpeed's save_dir, or a tag
            return "deepspeed"
        raise InvalidArgumentError(f"{src} is a directory without DCP's .metadata: not a checkpoint tiercheck imports")
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04" or head[:1] == b"\x80":
        return "torch"
    raise InvalidArgumentError(
        f"{src} is neither a torch.save file (zip or pickle) nor a DCP or DeepSpeed checkpoint directory"
    )


def import_checkpoint(
    src: str | os.PathLike[str],
    to: str | os.PathLike[str],
    *,
    step: int | None = None,
    remote: str | None = None,
    remote_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
    tag: str | None = None,
    max_host_bytes: int = IMPORT_HOST_BYTES,
) -> Imported:
    """Write the checkpoint at ``src`` as step ``step`` (default: the last number in its name, else 0; for
    DeepSpeed, the ``global_steps`` it saved) of a new lineage in the local directory ``to`` (and drain it to
    ``remote`` where given). ``tag`` picks a DeepSpeed checkpoint's tag (default: the one its ``latest`` names).
    ``max_host_bytes`` bounds the host memory the step is staged through (``StagingOptions.max_host_bytes``)."""
    begin = time.monotonic()
    kind = source_kind(src)
    if step is not None and step < 0:
        raise InvalidArgumentError(f"step must be a non-negative int, not {step}")
    if tag is not None and kind != "deepspeed":
        raise InvalidArgumentError(f"tag {tag!r}: tags are DeepSpeed's, and {src} is not a DeepSpeed checkpoint")
    options: dict[str, Any] = {"remote_options": remote_options} if remote_options else {}
    # Staged a bounded pool at a time, straight from the source (memory-mapped where torch can map it): the
    # import's own memory stays at the bound however large the checkpoint.
    options["staging"] = StagingOptions(mode="eager", max_host_bytes=max_host_bytes)
    if kind == "deepspeed":  # its own module: it needs DeepSpeed, for the types DeepSpeed's files hold
        try:
            from tiercheck.integrations.deepspeed.source import import_deepspeed
        except ImportError as e:  # the install command, as one line of the CLI's rather than a traceback
            raise InvalidArgumentError(f"{src} is a DeepSpeed checkpoint: {e}") from e

        done = import_deepspeed(src, to, tag=tag, step=step, remote=remote, options=options, allow_pickle=allow_pickle)
        _say_undrained(done.undrained, remote)
        return Imported(step=done.step, kind=kind, tensors=done.tensors, nbytes=done.nbytes,
                        seconds=time.monotonic() - begin, tag=done.tag)  # fmt: skip
    if step is None:
        step = step_in_name(Path(src).name) or 0
    peak = None
    if kind == "dcp":
        tensors, nbytes, peak = _import_dcp(src, to, step, remote, options, allow_pickle=allow_pickle)
    else:
        tensors, nbytes, peak = _import_torch(src, to, step, remote, options, allow_pickle=allow_pickle)
    log.info("imported %s as step %d of %s (%d tensors, %d bytes)", src, step, to, tensors, nbytes)
    return Imported(step=step, kind=kind, tensors=tensors, nbytes=nbytes, seconds=time.monotonic() - begin,
                    staged_peak_bytes=peak)  # fmt: skip


def _import_dcp(src: str | os.PathLike[str], to: str | os.PathLike[str], step: int, remote: str | None,
                options: dict[str, Any], *, allow_pickle: bool) -> tuple[int, int, int | None]:  # fmt: skip
    import torch.distributed.checkpoint as dcp

    from tiercheck.integrations.dcp.source import RawBytesSavePlanner, count_tensors, read_dcp
    from tiercheck.integrations.dcp.writer import TiercheckWriter

    Path(to).mkdir(parents=True, exist_ok=True)  # the scratch file for tensors saved in pieces lies there
    state = read_dcp(src, to, allow_pickle=allow_pickle)
    writer = TiercheckWriter(to, remote, **options)
    try:
        with warnings.catch_warnings():  # DCP's note that this process saves alone: it does, on purpose
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.save(state, storage_writer=writer, checkpoint_id=step, planner=RawBytesSavePlanner(), no_dist=True)
        ck = writer.checkpointer
        peak = None if ck is None else ck.stats()["pool_peak_bytes"]
    finally:
        undrained = writer.close()
    _say_undrained(undrained, remote)
    return (*count_tensors(state), peak)


def _import_torch(src: str | os.PathLike[str], to: str | os.PathLike[str], step: int, remote: str | None,
                  options: dict[str, Any], *, allow_pickle: bool) -> tuple[int, int, int]:  # fmt: skip
    from tiercheck.integrations.dcp.source import count_tensors, unpickling_refused

    try:
        # memory-mapped where torch can (its zip format): the tensors are read as the save copies them
        state = torch.load(src, map_location="cpu", weights_only=not allow_pickle, mmap=zipfile.is_zipfile(src))
    except Exception as e:
        if not allow_pickle and _refused_by_weights_only(e):
            raise UnsafeCheckpointError(
                f"{src} needs unpickling beyond torch.load(weights_only=True) ({unpickling_refused(e)}); import it "
                "with --allow-pickle (allow_pickle=True) only if you trust the checkpoint"
            ) from None
        if allow_pickle and isinstance(e, (AttributeError, ImportError)):  # read whole; a class it names is not here
            raise InvalidArgumentError(
                f"{src} cannot be unpickled here: it names what this process cannot import ({_why(e)}); import it "
                "where the code that saved it is importable"
            ) from None
        raise CorruptCheckpointError(f"{src} is truncated or damaged: torch.load cannot read it ({_why(e)})") from None
    if not isinstance(state, Mapping):
        raise InvalidArgumentError(f"{src} holds a {type(state).__name__}, not a mapping: nothing tiercheck saves")
    state = dict(state)
    with Checkpointer(state, local=to, remote=remote, allow_pickle=allow_pickle, **options) as ck:
        ck.save(step).wait()
        peak = ck.stats()["pool_peak_bytes"]
        undrained = ck.close()
    _say_undrained(undrained, remote)
    return (*count_tensors(state), peak)


def _refused_by_weights_only(e: BaseException) -> bool:
    """Whether ``torch.load(weights_only=True)`` read the file and refused what it names (a class, an
    operation: --allow-pickle would load it), not failed to read it (a truncated or damaged file, whose
    error torch words as a refusal too, with an empty reason)."""
    return any("WeightsUnpickler error: Unsupported" in line for line in str(e).splitlines())


def _why(e: BaseException) -> str:
    """torch's reason for a file it cannot read, in a few words (its message runs on with advice)."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    for advice in (". This is an internal miniz error", ". The file might be corrupted"):
        first = first.split(advice)[0]
    return first or f"{type(e).__name__}: it ends early"


def _say_undrained(undrained: list[int], remote: str | None) -> None:
    if undrained:
        raise CheckpointNotFoundError(
            f"the imported step {undrained} is committed locally but not on {remote} yet: `tiercheck drain` finishes it"
        )
