"""Peer replicas on a node's local tier: the markers that make a peer's files of a step count, and
where each node's copies go. No torch here: ``tiercheck ls`` and ``verify`` read these too.

A replica of node B's files in node A's directory of step N is B's saving ranks' files, under their own
names (``files.files_of_ranks``), plus ``REPLICA-<B's first rank>.json`` naming the ranks, each file's size and
CRC32C, and B's node directory. The marker is written last, once every file is durable and checked.
"""



from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from tiercheck.errors import CorruptCheckpointError, TiercheckError
from tiercheck.format.codec import checksum
from tiercheck.format.files import files_of_ranks
from tiercheck.format.paths import (
    is_replica_marker,
    pack_owner,
    step_dir,
)
from tiercheck.format.steps import read_small
from tiercheck.options import ReplicationOptions
from tiercheck.tiers.base import Tier

log = logging.getLogger("tiercheck")
_FORMAT = "tiercheck-replica"
MAX_FILES_PER_RANK = 5  # its manifest part, arrays shard, owners, refs and pack


@dataclass(frozen=True, slots=True)
class Replica:
    """One peer node's files in this node's directory of a step: what its marker says."""

    step: int
    ranks: tuple[int, ...]
    world_size: int
    files: dict[str, tuple[int, int]]  # name -> (size, crc32c)
    node: str  # the node directory the files came from

    def to_bytes(self) -> bytes:
        files = {n: list(v) for n, v in self.files.items()}
        doc = {"format": _FORMAT, "step": self.step, "ranks": list(self.ranks), "world_size": self.world_size}
        return json.dumps({**doc, "node": self.node, "files": files}, sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes, *, step: int, where: str) -> Replica:
        """A replica marker, checked: its step, ranks in range, and only the named files of those ranks."""
        try:
            doc = json.loads(data)
            ok = isinstance(doc, dict) and doc.get("format") == _FORMAT and doc.get("step") == step
            ranks = tuple(int(r) for r in doc["ranks"]) if ok and isinstance(doc.get("ranks"), list) else ()
            world = doc.get("world_size") if ok else None
            files = {
                str(n): (int(v[0]), int(v[1]))
                for n, v in (doc.get("files") or {}).items()
                if isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v)
            }
        except (ValueError, TypeError, KeyError, RecursionError) as e:
            raise CorruptCheckpointError(f"{where}: replica marker is damaged ({e!r})") from None
        good = (
            ok
            and ranks
            and isinstance(world, int)
            and all(0 <= r < world for r in ranks)
            and files_of_ranks(dict.fromkeys(files, 0), ranks).keys() == files.keys()
            and len(files) == len(doc["files"])
            and all(size >= 0 and 0 <= crc < 2**32 for size, crc in files.values())
            and isinstance(doc.get("node"), str)
        )
        if not good:
            raise CorruptCheckpointError(f"{where}: replica marker is damaged (fields out of range)")
        return cls(step, ranks, int(world), files, doc["node"])  # type: ignore[arg-type]


def read_replicas(tier: Tier, step: int, *, checked: bool = False) -> list[Replica]:
    """The replicas a committed step directory holds; a damaged marker is reported and passed by.

    ``checked``: only those whose files are all here and match their marker (``replica_problems``);
    a restore and ``ls`` count no other. A replica that does not match (another step's or another
    save's files under the same names, a copy that left its packs behind) is reported and passed by:
    the step is then not whole here, and a restore takes those ranks from another tier or an older step."""
    d = step_dir(step)
    out = []
    for name in tier.list_dir(d):
        if not is_replica_marker(name):
            continue
        where = f"{tier.url}: step {step}: {name}"
        try:
            replica = Replica.parse(read_small(tier, f"{d}/{name}", where=where), step=step, where=where)
        except (TiercheckError, OSError) as e:
            log.warning("ignoring a replica in %s: %s", tier.url, e)
            continue
        bad = replica_problems(tier, step, replica) if checked else []
        if bad:
            log.warning("ignoring the replica %s in %s: %s", name, tier.url, "; ".join(bad))
            continue
        out.append(replica)
    return out


def replica_problems(tier: Tier, step: int, replica: Replica) -> list[str]:
    """A replica's files against its marker; returns the problems found, one line each.

    Every file must be there with the size the marker gives. The manifest files (parts, arrays,
    owners, refs) are read and their CRC32C compared: the checksums of every chunk a replica's
    rank wrote are in its part, so a pack of another step or save of the same size is caught by
    the chunks' checksums when they are read (``verify``, a restore), not here by re-reading it.
    Nothing is read past the size the marker gives plus one byte."""
    # TODO(save_id): once markers carry the save id, compare it with COMMIT's here as well.
    bad = []
    d = step_dir(step)
    for name, (size, crc) in sorted(replica.files.items()):
        pack = pack_owner(name) is not None
        try:
            data = tier.read_range(f"{d}/{name}", max(0, size - 1) if pack else 0, 2 if pack else size + 1)
        except FileNotFoundError:
            bad.append(f"step {step}: replica file {name} is missing")
            continue
        except OSError as e:
            bad.append(f"step {step}: replica file {name}: cannot read it: {e.strerror or e}")
            continue
        if pack:
            if len(data) != min(size, 1):
                bad.append(f"step {step}: replica file {name}: its size differs from its replica marker")
        elif len(data) != size or checksum(data) != crc:
            bad.append(f"step {step}: replica file {name}: size or CRC32C differs from its replica marker")
    return bad


def placement(index: int, count: int, options: ReplicationOptions) -> tuple[list[int], list[int]]:
    """The nodes node ``index`` sends its copies to, and those it holds copies of (of ``count`` nodes)."""
    jump = options.jump or 1
    offsets = [(j * jump) % count for j in range(1, options.replicas + 1)]
    if 0 in offsets or len(set(offsets)) != len(offsets):
        raise ValueError(
            f"ReplicationOptions(replicas={options.replicas}, jump={jump}) on {count} node(s): the copies of a node "
            f"would land on itself or twice on one node; need replicas * jump < nodes (and no wrap onto a node "
            f"already chosen)"
        )
    return [(index + o) % count for o in offsets], [(index - o) % count for o in offsets]
