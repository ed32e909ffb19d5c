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
import re
import socket
import time
from dataclasses import dataclass

from tiercheck.errors import CorruptCheckpointError
from tiercheck.format.paths import LINEAGE_FILE
from tiercheck.tiers.base import Tier

_ID = re.compile(r"[0-9a-f]{8,64}")
_MAX_BYTES = 64 << 10


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
        if not isinstance(host, str) or len(host) > 255 or not isinstance(since, int | float):
            raise ValueError("host or since has the wrong type")
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
