"""The lineage a local directory or remote prefix belongs to (``LINEAGE.json`` at its root).

A lineage is the chain of runs that continued one training trajectory: the run that started it,
and every run since that restored one of its steps. Its id is the starting run's. The file is
written when a run first commits to a place that has none (or adopts a lineage by restoring), and
replaced only when a run takes the place over: then it names the lineage it replaced.

``{"format": 1, "lineage": "<hex>", "run": "<hex>", "host": "...", "since": <unix time>,
"previous": "<hex>" | null}``: ``run`` is the run that last claimed the place for the lineage.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import time
from dataclasses import dataclass

from tiercheck.errors import CorruptCheckpointError, LineageError, UnsafeCheckpointError
from tiercheck.format.paths import LINEAGE_FILE
from tiercheck.tiers.base import Tier

_ID = re.compile(r"[0-9a-f]{8,64}")
_MAX_BYTES = 64 << 10
_LATEST = 253402300799  # 9999-12-31 23:59:59 UTC: the last second every platform's gmtime can show


@dataclass(frozen=True, slots=True)
class Lineage:
    id: str
    run: str  # the run that last claimed the place for this lineage
    host: str = ""
    since: float = 0.0
    previous: str | None = None  # the lineage this one took the place over from

    def named(self) -> str:
        """How messages name it: the lineage, and the run and host that claimed the place."""
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.since)) if self.since else "an unknown time"
        host = f" on {self.host}" if self.host else ""
        return f"lineage {self.id[:12]} (claimed by run {self.run[:12]}{host}, {when})"


def new_lineage(lineage: str, run: str, *, previous: str | None = None) -> Lineage:
    return Lineage(lineage, run, socket.gethostname(), time.time(), previous)


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
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"{where}: unreadable ({e}); delete it to let the next run that restores from here claim the place"
        ) from None
    return Lineage(doc["lineage"], doc["run"], host, float(since), doc.get("previous"))


def write_lineage(tier: Tier, lineage: Lineage) -> None:
    """Claim ``tier`` for ``lineage``: atomically, replacing what was there."""
    doc = {
        "format": 1,
        "lineage": lineage.id,
        "run": lineage.run,
        "host": lineage.host,
        "since": lineage.since,
        "previous": lineage.previous,
    }
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
