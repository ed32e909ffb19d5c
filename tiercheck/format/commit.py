"""The commit protocol on one tier: how a step becomes visible, and how it stops being.

A step is committed exactly when ``step-NNNNNNNN/COMMIT`` exists under the step's one name
(``paths.step_dir``). The order that makes that safe at any instant of a crash (invariant 1,
docs/design.md):

1. Every data file of the step (each saving rank's pack, manifest parts, shards, owners and
   reference maps) is written and made durable by its writer.
2. ``commit_step``: the step's index (``manifest.json``) is written, the directory entries made
   durable, then the commit marker is published, last and atomically (``Tier.publish``: a rename
   on a directory, a create-only write on an object store). The marker pins the index by size and
   CRC32C and names the save every other file of the step must name (invariant 9).
3. ``withdraw_step``: deleting a step removes its marker first, durably, then the rest, so a crash
   half-way through a deletion leaves a partial step (cleaned up later), never a damaged committed
   one. ``set_aside_step`` moves a committed step out of the way whole, in one rename;
   ``copy_aside`` copies it out of the way where a tier cannot rename (an object store).

Across ranks, who calls ``commit_step`` and when (every rank's part durable first, each node's
first rank for its node, a failure anywhere withdrawing the step everywhere) is the save's vote,
``save.vote``; copies between tiers (``tiering.transfer``, ``tiering.upload``) commit the same way
once every file is copied and checked.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

from tiercheck.format.codec import checksum
from tiercheck.format.manifest import CommitMarker
from tiercheck.format.paths import COMMIT_FILE, MANIFEST_FILE, set_aside_dir, step_dir
from tiercheck.tiers.base import Tier
from tiercheck.tiers.local import LocalTier


def commit_step(
    tier: Tier,
    step: int,
    manifest: bytes,
    *,
    save_id: str,
    ranks: tuple[int, ...] = (0,),
    world_size: int = 1,
    lineage: str | None = None,
) -> None:
    """Publish a step whose data files are all durably written (by every saving rank).

    ``ranks`` are the saving ranks whose chunk files this tier holds: with node-local tiers, the
    ranks of this node. The step is whole where the tiers together hold all ``world_size`` ranks.
    ``save_id`` is the manifest's: two tiers hold the same save of a step where their commit
    markers name the same one. ``lineage``: the lineage the save is committed for, where the tier
    names none of its own (the memory tier's directory).
    """
    d = step_dir(step)
    tier.write(f"{d}/{MANIFEST_FILE}", [manifest])
    tier.sync_dirs(d)
    marker = CommitMarker(
        step=step,
        manifest_crc32c=checksum(manifest),
        manifest_size=len(manifest),
        ranks=tuple(ranks),
        world_size=world_size,
        save_id=save_id,
        lineage=lineage,
    )
    tier.publish(f"{d}/{COMMIT_FILE}", marker.to_bytes())


def withdraw_step(tier: Tier, step: int) -> None:
    """Delete a step: first its commit marker (durably), then everything else."""
    d = step_dir(step)
    tier.delete(f"{d}/{COMMIT_FILE}")
    tier.delete_tree(d)


def set_aside_step(tier: LocalTier, step: int) -> str:
    """Move a committed step that cannot be restored out of the way, whole, so that a save may
    write its number again; returns where it went (``paths.set_aside_dir``). Only the directory's
    writer (the holder of its lock) may call it. The rename is atomic: the step is either still
    committed under its name or no step at all, never half moved."""
    to = _aside_name(tier, step)
    tier.move(step_dir(step), to)
    return to


def copy_aside(tier: Tier, step: int) -> str:
    """Set a committed step aside on a tier that cannot rename a directory (an object store):
    copy each of its files under ``paths.set_aside_dir``, its commit marker last, then withdraw
    the step's marker and index, so that a copy of another save may take its number; returns where
    the copy went. Its other files stay where they are until that copy replaces them. A crash
    part-way leaves the step committed as it was (and, at worst, a partial copy beside it that
    names no commit), never lost. Each file is streamed in ``piece_bytes`` pieces."""
    d, to = step_dir(step), _aside_name(tier, step)
    files = tier.sizes(d)
    for name in sorted(files, key=lambda n: (n == COMMIT_FILE, n)):
        size = files[name]
        piece = max(1, tier.piece_bytes(size))

        def pieces(name: str = name, size: int = size, piece: int = piece) -> Iterator[bytes | bytearray]:
            for at in range(0, size, piece):
                yield tier.read_range(f"{d}/{name}", at, min(piece, size - at))

        tier.write_stream(f"{to}/{name}", pieces, size=size)
    tier.delete(f"{d}/{COMMIT_FILE}")
    tier.delete(f"{d}/{MANIFEST_FILE}")
    return to


def _aside_name(tier: Tier, step: int) -> str:
    """A name under ``paths.set_aside_dir`` for ``step`` that ``tier`` does not hold yet."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    to = set_aside_dir(step, stamp)
    for n in itertools.count(1):  # set aside twice in one second (saved again, damaged again)
        if not tier.exists(to) and not tier.exists(f"{to}/{COMMIT_FILE}"):
            break
        to = set_aside_dir(step, f"{stamp}-{n}")
    return to
