"""Save ids: every file of a step names the save that wrote it, and a reader checks that
it names the step's save. Step numbers repeat (a rollback saves them again), so a file is bound to its
step by this id, never by its name, size or presence (invariant 9)."""


from __future__ import annotations

import hashlib
import json
import re

from tiercheck.errors import CorruptCheckpointError
from tiercheck.format.values import JSON

REFS_STAMP = "tiercheck"  # the key of a reference map naming its step and save (kerchunk readers pass it by)
_SAVE_ID = re.compile(r"[0-9a-f]{32}")


def new_save_id(run: str, step: int, attempt: int) -> str:
    """The id of one save: the same on every rank of the job (``run`` is agreed once, when the
    job's Checkpointer starts), unique to this run, step and attempt, and no two runs share a
    ``run``. A step saved again (after a rollback, or by a later job) is another save."""
    return hashlib.blake2b(f"{run}/{step}/{attempt}".encode(), digest_size=16).hexdigest()


def save_id_of(doc: dict[str, JSON], *, where: str) -> str:
    """The save id ``manifest.json`` (or a commit marker) states: required."""
    got = doc.get("save_id")
    if not isinstance(got, str) or not _SAVE_ID.fullmatch(got):
        raise CorruptCheckpointError(f"{where}: save_id {str(got)[:80]!r} is not a save id (32 hex digits)")
    return got


def check_save(doc: JSON, save: str | None, *, where: str) -> None:
    """A file of a step (a rank part, arrays or owners file, a reference map) must have been
    written by the step's save ``save`` (``None``: not checked, for a look at one file alone). A
    file that names another save is another step's, another run's or another trajectory's: its
    bits are consistent and wrong."""
    if save is None:
        return
    got = doc.get("save_id") if isinstance(doc, dict) else None
    if got != save:
        raise CorruptCheckpointError(
            f"{where}: written by save {str(got)[:40]!r}, not by this step's save {save!r} "
            "(a file of another step, run or trajectory)"
            if got is not None
            else f"{where}: names no save, and this step's files name theirs ({save!r}): "
            "a file of another step or format"
        )


def check_file_save(doc: bytes, save: str | None, *, where: str) -> None:
    """A manifest file's document must name the step's save ``save`` (``None``: not checked):
    ``check_save`` on the bytes as stored. (A reference map names it under ``REFS_STAMP``:
    ``refmaps.check_map``.)"""
    if save is None:
        return
    try:
        parsed = json.loads(doc)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e})") from None
    check_save(parsed, save, where=where)


def save_field(save: str | None) -> dict[str, str]:
    return {} if save is None else {"save_id": save}
