"""Which of a memory tier's steps are its lineage's, and where a local directory's memory tier lives.

A memory step is restorable only while it is the save its lineage holds for that step number
everywhere that number is held, and no rollback recorded in the lineage abandoned it (invariant
13). Its commit marker names the lineage it was committed for (``CommitMarker.lineage``), so a
step directory planted in the memory directory, or another lineage's memory directory with this
one's ``OWNER`` copied in, is told apart by what its own marker says, not by where it lies.

``MEMORY.json`` at the root of a node-local directory records where its memory tier lives
(``{"format": 1, "path": "<the memory directory>"}``), so that a job started without
``MemoryOptions`` (and ``tiercheck``'s commands) can find the memory steps of the directory's
lineage: such a job says so instead of restoring an older step silently, and the first save of a
branch below them abandons them there too (``tiering.lineage.settle``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from tiercheck.errors import TiercheckError
from tiercheck.format.lineage import Lineage, read_lineage
from tiercheck.format.manifest import CommitMarker
from tiercheck.format.paths import MEMORY_RECORD_FILE
from tiercheck.format.steps import list_steps, read_marker
from tiercheck.tiers.base import Tier

_MAX_RECORD = 4096  # bytes of MEMORY.json read: a path and a few fields


def doubt(step: int, marker: CommitMarker, *, lineage: Lineage | None, local: Tier | None) -> str | None:
    """Why committed memory step ``step`` (its ``marker``) is not its lineage's to restore; None
    when it is. ``lineage``: the node-local directory's; ``local``: that directory, whose
    committed step of the same number must be the same save."""
    if lineage is None:
        return "the local directory names no lineage, so no memory step can be told to be its own"
    if marker.lineage != lineage.id:
        named = f"lineage {marker.lineage[:12]}" if marker.lineage else "no lineage"
        return f"its commit marker names {named}, not the local directory's ({lineage.id[:12]}): another job's step"
    if (step, marker.save_id) in lineage.abandoned:
        return f"its lineage abandoned save {marker.save_id} (a rollback branched below it)"
    if local is not None:
        other = other_save(local, step, marker.save_id)
        if other is not None:
            return f"{local.url} holds another save of step {step} ({other}): the memory's is an abandoned branch's"
    return None


def other_save(tier: Tier, step: int, save: str | None) -> str | None:
    """The save of committed ``step`` on ``tier`` where it is not ``save``; None where ``tier``
    holds no readable commit of ``step`` or holds that very save."""
    try:
        there = read_marker(tier, step).save_id
    except (TiercheckError, OSError):
        return None
    return there if there != save else None


def remote_doubt(remote: Tier, step: int, save: str | None) -> str | None:
    """Why memory step ``step`` (save ``save``) is not its lineage's, as the remote prefix says: it
    holds another save of the step, or its lineage abandoned this one. None: neither."""
    other = other_save(remote, step, save)
    if other is not None:
        return f"{remote.url} holds another save of step {step} ({other}): the memory's is an abandoned branch's"
    try:
        found = read_lineage(remote)
    except (TiercheckError, OSError):
        return None
    if found is not None and save is not None and (step, save) in found.abandoned:
        return f"{remote.url}'s lineage abandoned save {save} of step {step} (a rollback branched below it)"
    return None


def judge(memory: Tier, local: Tier) -> Iterator[tuple[int, str | None, str | None]]:
    """``(step, save id, why not)`` for each committed step of ``memory``: ``why not`` is None where
    the step is ``local``'s lineage's to restore (``doubt``); a marker or lineage file that cannot be
    read is a reason too (no step is trusted on a guess)."""
    try:
        lineage = read_lineage(local)
    except (TiercheckError, OSError):
        lineage = None
    for step in list_steps(memory).committed:
        try:
            marker = read_marker(memory, step)
        except (TiercheckError, OSError) as e:
            yield step, None, str(e)
            continue
        yield step, marker.save_id, doubt(step, marker, lineage=lineage, local=local)


def lineage_steps(memory: Tier, local: Tier) -> dict[int, str]:
    """The committed steps of ``memory`` that are ``local``'s lineage's to restore, each with its
    save id (``judge``): what a job without the memory tier, or a command, may say memory holds."""
    return {step: save for step, save, why in judge(memory, local) if why is None and save is not None}


def record_memory(local: Tier, directory: Path) -> None:
    """Record in ``local`` that its memory tier lives in ``directory`` (unless it says so already)."""
    if recorded_memory(local) == directory:
        return
    local.publish(MEMORY_RECORD_FILE, json.dumps({"format": 1, "path": os.fspath(directory)}).encode())


def recorded_memory(local: Tier) -> Path | None:
    """Where ``local``'s memory tier lives, as its ``MEMORY.json`` says; None where it says nothing
    readable (no file, or one that is not a record: a hint only, never trusted for more than where
    to look, since every step found there is checked by ``doubt``)."""
    try:
        raw = bytes(local.read_range(MEMORY_RECORD_FILE, 0, _MAX_RECORD + 1))
    except (OSError, TiercheckError):
        return None
    try:
        doc = json.loads(raw) if len(raw) <= _MAX_RECORD else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    path = doc.get("path") if isinstance(doc, dict) and doc.get("format") == 1 else None
    if not isinstance(path, str) or not os.path.isabs(path) or "\0" in path:
        return None
    return Path(path)
