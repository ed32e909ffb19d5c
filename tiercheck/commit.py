"""Step directories on a tier: naming, the commit protocol, and what counts as committed.

A step is committed exactly when ``step-NNNNNNNN/COMMIT`` exists. It is written last, after
every data file, the manifest and every directory entry are durable, and it pins the manifest
by size and CRC32C. Deleting a step withdraws the marker first, so a crash half-way through a
deletion leaves a partial step (cleaned up later), never a damaged committed one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .codec import checksum
from .errors import CheckpointNotFoundError, CorruptCheckpointError
from .manifest import COMMIT_FILE, MANIFEST_FILE, CommitMarker, Manifest
from .tiers.base import Tier

_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


@dataclass(frozen=True, slots=True)
class StepListing:
    committed: list[int]  # ascending
    partial: list[int]  # directories without a commit marker (in flight, or left by a crash)


def list_steps(tier: Tier) -> StepListing:
    committed: list[int] = []
    partial: list[int] = []
    for name in tier.list_dir(""):
        m = _STEP_DIR.match(name)
        if not m:
            continue
        step = int(m.group(1))
        (committed if tier.exists(f"{name}/{COMMIT_FILE}") else partial).append(step)
    return StepListing(sorted(committed), sorted(partial))


def commit_step(tier: Tier, step: int, manifest: bytes, *, ranks: tuple[int, ...] = (0,), world_size: int = 1) -> None:
    """Publish a step whose data files are all durably written (by every saving rank).

    ``ranks`` are the saving ranks whose chunk files this tier holds: with node-local tiers, the
    ranks of this node. The step is whole where the tiers together hold all ``world_size`` ranks.
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
    )
    tier.publish(f"{d}/{COMMIT_FILE}", marker.to_bytes())


def withdraw_step(tier: Tier, step: int) -> None:
    """Delete a step: first its commit marker (durably), then everything else."""
    d = step_dir(step)
    tier.delete(f"{d}/{COMMIT_FILE}")
    tier.delete_tree(d)


def read_marker(tier: Tier, step: int) -> CommitMarker:
    d = step_dir(step)
    where = f"{tier.url}: step {step}"
    try:
        marker_bytes = tier.read(f"{d}/{COMMIT_FILE}")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{where} is not committed (no {d}/{COMMIT_FILE})") from None
    marker = CommitMarker.from_bytes(marker_bytes, where=where)
    if marker.step != step or not set(marker.ranks) <= set(range(marker.world_size)):
        raise CorruptCheckpointError(f"{where}: the commit marker names step {marker.step} or ranks out of range")
    return marker


def read_manifest(tier: Tier, step: int) -> Manifest:
    """The manifest of a committed step, checked against its commit marker."""
    d = step_dir(step)
    where = f"{tier.url}: step {step}"
    marker = read_marker(tier, step)
    try:
        data = tier.read(f"{d}/{MANIFEST_FILE}")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: {MANIFEST_FILE} is missing from a committed step") from None
    if len(data) != marker.manifest_size or checksum(data) != marker.manifest_crc32c:
        raise CorruptCheckpointError(
            f"{where}: {MANIFEST_FILE} is damaged (size or checksum differs from the commit marker)"
        )
    manifest = Manifest.from_bytes(bytes(data), where=where)
    if manifest.step != step or manifest.world_size != marker.world_size:
        raise CorruptCheckpointError(f"{where}: manifest and commit marker disagree (step or world size)")
    return manifest
