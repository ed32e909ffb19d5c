"""The lineage a local directory or remote prefix belongs to (``LINEAGE.json`` at its root).

A lineage is the chain of runs that continued one training trajectory: the run that started it,
and every run since that restored one of its steps. Its id is the starting run's. The file is
written when a run first commits to a place that has none (or adopts a lineage by restoring), and
replaced only when a run takes the place over: then it names the lineage it replaced.

``{"format": 1, "lineage": "<hex>", "run": "<hex>", "host": "...", "since": <unix time>,
"previous": "<hex>" | null}``: ``run`` is the run that last claimed the place for the lineage.

Two optional fields name what the place holds that is not the lineage's trajectory (absent when
empty, and ignored by readers that predate them): ``"abandoned": [[step, "<save id>"], ...]``, the
saves of steps a rollback branched away from, or that the place held when the lineage took it
over: no restore takes them; and ``"rollback": <step>`` (a local directory only), a rollback to
that step whose abandoned steps on the remote prefix are not recorded there yet.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import time
from dataclasses import dataclass

from tiercheck.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LineageError,
    TiercheckError,
    UnsafeCheckpointError,
)
from tiercheck.format.paths import LINEAGE_FILE, MEMORY_OWNER_FILE
from tiercheck.format.steps import list_steps, read_marker
from tiercheck.tiers.base import Tier

_ID = re.compile(r"[0-9a-f]{8,64}")
_MAX_BYTES = 1 << 20
_LATEST = 253402300799  # 9999-12-31 23:59:59 UTC: the last second every platform's gmtime can show


@dataclass(frozen=True, slots=True)
class Lineage:
    id: str
    run: str  # the run that last claimed the place for this lineage
    host: str = ""
    since: float = 0.0
    previous: str | None = None  # the lineage this one took the place over from
    abandoned: frozenset[tuple[int, str]] = frozenset()  # (step, save id): saves that are not this lineage's
    rollback: int | None = None  # a rollback to this step, its abandoned remote steps not yet recorded there

    def named(self) -> str:
        """How messages name it: the lineage, and the run and host that claimed the place."""
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.since)) if self.since else "an unknown time"
        host = f" on {self.host}" if self.host else ""
        return f"lineage {self.id[:12]} (claimed by run {self.run[:12]}{host}, {when})"


def new_lineage(
    lineage: str, run: str, *, previous: str | None = None, abandoned: frozenset[tuple[int, str]] = frozenset()
) -> Lineage:
    return Lineage(lineage, run, socket.gethostname(), time.time(), previous, abandoned)


def read_lineage(tier: Tier) -> Lineage | None:
    """The lineage ``tier`` belongs to; None when it names none (a new place, or one written
    before lineages existed). A file that cannot be read or parsed is refused, naming it: who owns
    the place is then unknown, and nothing is written there on a guess."""
    where = f"{tier.url}: {LINEAGE_FILE}"
    try:
        data = tier.read_range(LINEAGE_FILE, 0, _MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CorruptCheckpointError(f"{where}: cannot read it: {e.strerror or e}") from None
    if len(data) > _MAX_BYTES:
        raise CorruptCheckpointError(f"{where}: larger than {_MAX_BYTES >> 10} KiB; no lineage file is")
    try:
        doc = json.loads(bytes(data))
        if not isinstance(doc, dict) or doc.get("format") != 1:
            raise ValueError("not a format-1 lineage document")
        ids = [doc["lineage"], doc["run"]] + ([doc["previous"]] if doc.get("previous") is not None else [])
        if not all(isinstance(i, str) and _ID.fullmatch(i) for i in ids):
            raise ValueError("an id is not 8-64 lowercase hex digits")
        host, since = doc.get("host", ""), doc.get("since", 0.0)
        if not isinstance(host, str) or len(host) > 255:
            raise ValueError('"host" is not a host name')
        # A time messages can show (``Lineage.named``): NaN, infinities and 1e300 are none.
        if isinstance(since, bool) or not isinstance(since, int | float) or not 0 <= since <= _LATEST:
            raise ValueError(f'"since" is {since!r}, not a unix time from 1970 to 9999')
        abandoned = _abandoned(doc.get("abandoned", []))
        rollback = doc.get("rollback")
        if rollback is not None and not _is_step(rollback):
            raise ValueError("rollback is not a step number")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"{where}: unreadable ({e}); delete it to let the next run that restores from here claim the place"
        ) from None
    return Lineage(doc["lineage"], doc["run"], host, float(since), doc.get("previous"), abandoned, rollback)


def _is_step(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


def _abandoned(value: object) -> frozenset[tuple[int, str]]:
    if not isinstance(value, list):
        raise ValueError("abandoned is not a list")
    out = set()
    for entry in value:
        if not (isinstance(entry, list) and len(entry) == 2 and _is_step(entry[0])):
            raise ValueError("an abandoned entry is not [step, save id]")
        if not (isinstance(entry[1], str) and _ID.fullmatch(entry[1])):
            raise ValueError("an abandoned save id is not 8-64 lowercase hex digits")
        out.add((int(entry[0]), entry[1]))
    return frozenset(out)


def write_lineage(tier: Tier, lineage: Lineage) -> None:
    """Claim ``tier`` for ``lineage``: atomically, replacing what was there."""
    doc: dict[str, object] = {
        "format": 1,
        "lineage": lineage.id,
        "run": lineage.run,
        "host": lineage.host,
        "since": lineage.since,
        "previous": lineage.previous,
    }
    if lineage.abandoned:
        doc["abandoned"] = [[step, save] for step, save in sorted(lineage.abandoned)]
    if lineage.rollback is not None:
        doc["rollback"] = lineage.rollback
    tier.publish(LINEAGE_FILE, json.dumps(doc).encode())


def check_claimable(tier: Tier) -> None:
    """Before a restore reads a byte into the state: the claim that follows it (the directory then
    belongs to the restored step's lineage, ``tiering.lineage.after_restore``) can replace the
    directory's lineage file, which is absent or a regular file. A directory, a symbolic link
    (never followed: it may lead out of the checkpoint) or a device there is refused, naming it,
    while the state is still as it was. A tier without a local path (an object store) is not
    claimed after a restore."""
    root = tier.local_path
    if root is None:
        return
    path = root / LINEAGE_FILE
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise LineageError(f"{path}: cannot look at it ({e.strerror or e}); a restore could not claim {root}") from None
    if stat.S_ISLNK(mode):
        raise UnsafeCheckpointError(
            f"{path} is a symbolic link; a checkpoint never holds one, so tiercheck will not follow it "
            f"(remove it: the run that restores next claims {root} for its lineage)"
        )
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise LineageError(
            f"{path} is {kind}, not a lineage file: who owns {root} is unknown, and the restore could not "
            "record the lineage it continues (remove it: the run that restores next claims the directory)"
        )


def saves_above(tier: Tier, step: int) -> set[tuple[int, str]]:
    """``(step, save id)`` of each committed step of ``tier`` numbered above ``step`` (-1: every
    one); a step whose marker cannot be read is left out (no restore takes it anyway)."""
    out = set()
    for s in list_steps(tier).committed:
        if s <= step:
            continue
        try:
            save = read_marker(tier, s).save_id
        except (CheckpointNotFoundError, CorruptCheckpointError):
            continue
        if save is not None:
            out.add((s, save))
    return out


def abandoned_on(tier: Tier) -> frozenset[tuple[int, str]]:
    """The saves ``tier``'s lineage disowns (see the module's docstring); none where its file
    cannot be read (refused, naming it, wherever a run would write there)."""
    try:
        found = read_lineage(tier)
    except CorruptCheckpointError:
        return frozenset()
    return found.abandoned if found is not None else frozenset()


def abandoned_why(tier: Tier, step: int, abandoned: frozenset[tuple[int, str]]) -> str | None:
    """Why committed ``step`` of ``tier`` is no step of its lineage (None: it is): its save is
    among ``abandoned`` (``abandoned_on(tier)``)."""
    if not any(s == step for s, _ in abandoned):
        return None
    try:
        save = read_marker(tier, step).save_id
    except (CheckpointNotFoundError, CorruptCheckpointError) as e:
        return str(e)
    if (step, save) in abandoned:
        return f"its lineage abandoned save {save} (a rollback branched below it, or a take-over)"
    return None


_MAX_OWNER = 256  # bytes of a memory directory's OWNER read: a lineage id is 32 hex digits


def memory_owner(memory: Tier) -> str | None:
    """The lineage a memory directory's steps belong to, as its ``OWNER`` file names it (None: no
    file). Bytes that are not ASCII come back replaced, and an ``OWNER`` that cannot be read (a
    directory, say) as what went wrong: neither names a lineage."""
    try:
        raw = memory.read_range(MEMORY_OWNER_FILE, 0, _MAX_OWNER)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"<{MEMORY_OWNER_FILE} unreadable: {e.strerror or e}>"
    return bytes(raw).decode("ascii", "replace").strip()


def lineage_id(tier: Tier) -> str | None:
    """The id of the lineage ``tier`` belongs to; None where it names none or its file cannot be read."""
    try:
        lineage = read_lineage(tier)
    except (OSError, TiercheckError):
        return None
    return lineage.id if lineage is not None else None


def owns_memory(local: Tier, memory: Tier) -> bool:
    """Whether the memory directory's steps are ``local``'s lineage: its ``OWNER`` names the lineage
    ``local``'s ``LINEAGE.json`` does. False where either is missing or cannot be read (a memory of
    an unknown owner is never restored)."""
    return lineage_owns(lineage_id(local), memory_owner(memory))


def lineage_owns(lineage: str | None, owner: str | None) -> bool:
    """The memory tier's ownership rule: a memory directory's steps are lineage ``lineage``'s (a local
    directory's id) only where its ``OWNER`` names it (``owner``, as ``memory_owner`` reads it). A
    directory of no lineage owns no memory, and a memory of no ``OWNER`` is no one's."""
    return lineage is not None and owner == lineage
