"""Uploading one committed step of a node's local tier to the remote tier (``Drainer`` and
``tiercheck drain`` both call ``upload_step``).

Each node uploads its own files of the step, then leaves a ``__drained.<first rank>.json`` object
naming the saving ranks whose files it uploaded and the save; the node that finds every rank
accounted for (for that save) uploads the manifest and writes the remote ``COMMIT`` last. Resumable
by content (``transfer.resumable``), and a remote step of the same number from another save is
withdrawn first (``same_save_committed``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tiercheck.errors import CheckpointNotFoundError, ContestedStepError, CorruptCheckpointError
from tiercheck.format.commit import commit_step
from tiercheck.format.files import files_of_ranks
from tiercheck.format.lineage import abandoned_on
from tiercheck.format.paths import (
    COMMIT_FILE,
    DRAINED_PREFIX,
    LINEAGE_FILE,
    MANIFEST_FILE,
    drained_marker,
    pack_owner,
    step_dir,
)
from tiercheck.format.steps import read_index, read_marker, read_small
from tiercheck.tiering.lineage import check_remote, committed_for
from tiercheck.tiering.transfer import (
    copy_file,
    copy_pack,
    finish_copy,
    resumable,
)
from tiercheck.tiers.base import Tier

log = logging.getLogger("tiercheck")


@dataclass(frozen=True, slots=True)
class UploadResult:
    files_uploaded: int
    files_already_there: int
    bytes_uploaded: int
    committed: bool  # this call wrote the remote commit marker
    was_committed: bool  # the remote already had the step


def upload_step(
    local: Tier,
    remote: Tier,
    step: int,
    *,
    pool: ThreadPoolExecutor,
    on_file: Callable[[int], None] = lambda n: None,
    take_over: bool = False,
) -> UploadResult:
    """Upload this node's files of a locally committed step, mark them drained, and commit the
    step on the remote if every saving rank's files are now there. Resumable. The remote prefix
    must belong to the local directory's lineage, or hold no step (``lineage.check_remote``),
    unless ``take_over``."""
    lineage = check_remote(local, remote, take_over=take_over)
    d = step_dir(step)
    marker, _, _ = read_index(local, step)  # a step of another format (or a damaged index): refused here
    save = marker.save_id
    assert save is not None  # read_index found it the index's, which names one
    if same_save_committed(remote, step, save, take_over=take_over):
        log.info("drain: step %d is already committed on %s", step, remote.url)
        return UploadResult(0, 0, 0, committed=False, was_committed=True)
    files = files_of_ranks(local.sizes(d), marker.ranks)  # peers' replicas: theirs to upload
    there = resumable(local, remote, step, save, marker.ranks[0], files)
    todo = sorted(f for f in files if f not in there)
    t0 = time.perf_counter()

    def copy(f: str) -> int:
        if pack_owner(f) is not None:  # every chunk checked as it is read: rot is never uploaded
            n = copy_pack(local, remote, step, f, files[f], save=save)
            on_file(n)
            return n
        n = copy_file(local, remote, step, f, save=save)
        on_file(n)
        return n

    nbytes = sum(pool.map(copy, todo))
    log.info(
        "drain: step %d: %d files (%d already on %s) in %.2f s",
        step,
        len(todo),
        len(files) - len(todo),
        remote.url,
        time.perf_counter() - t0,
    )
    mine = drained_marker(marker.ranks[0])
    remote.write(f"{d}/{mine}", [json.dumps({"ranks": list(marker.ranks), "save_id": save}).encode()])
    have = drained_ranks(remote, step, save)
    if have != set(range(marker.world_size)):
        log.info("drain: step %d: the files of ranks %s are up; the other nodes' follow", step, list(marker.ranks))
        return UploadResult(len(todo), len(files) - len(todo), nbytes, committed=False, was_committed=False)
    manifest = bytes(local.read(f"{d}/{MANIFEST_FILE}"))
    ranks = tuple(range(marker.world_size))
    commit_step(remote, step, manifest, save_id=save, ranks=ranks, world_size=marker.world_size)
    committed_for(remote, lineage, step, save)  # taken over while it uploaded: withdrawn
    finish_copy(remote, step, marker.ranks[0])
    log.info("drain: step %d committed on %s", step, remote.url)
    return UploadResult(len(todo), len(files) - len(todo), nbytes, committed=True, was_committed=False)


def same_save_committed(remote: Tier, step: int, save: str | None, *, take_over: bool = False) -> bool:
    """Whether ``remote`` has ``step`` committed by the save ``save`` (the local step's). A remote
    step of that number committed by another save (the number saved again after a rollback, by
    this job or one before) is withdrawn: its commit marker and index first, so no restore takes it
    while this save's files replace its own (each node replaces its files, see ``resumable``).
    Only a save the prefix's lineage abandoned is replaced (a rollback records its abandoned steps
    before any step of its branch lands, a take-over the old lineage's): any other is refused
    (``ContestedStepError``), unless ``take_over``, or set aside first by a run that restored or
    saved the local step (``contested``, ``format.commit.copy_aside``: ``Drainer``). A lineage
    claim copied into a directory (its ``LINEAGE.json`` from another run's) thus replaces no
    committed step of that run."""
    d = step_dir(step)
    try:
        there = read_marker(remote, step)
    except CheckpointNotFoundError:
        return False
    except CorruptCheckpointError as e:
        log.warning("drain: %s; replacing it with the local copy of step %d", e, step)
        there = None
    if there is not None and there.save_id == save:
        return True
    disowned = there is None or there.save_id is None or take_over or (step, there.save_id) in abandoned_on(remote)
    if not disowned:
        assert there is not None
        raise ContestedStepError(
            f"not draining step {step} to {remote.url}: it holds step {step} of another save ({there.save_id}, "
            f"this one is {save}) that its lineage has not abandoned (no rollback branched below it), and no "
            f"run that restored or saved this one drains it: the local directory's steps are not that "
            f"lineage's trajectory (its {LINEAGE_FILE} copied from another run's?). Nothing was replaced; "
            "restore the step in a job with this remote, or pass take_over to replace it"
        )
    if there is not None:
        log.warning(
            "drain: %s holds step %d of another save (%s, this one is %s): replacing it",
            remote.url, step, there.save_id, save,
        )  # fmt: skip
    remote.delete(f"{d}/{COMMIT_FILE}")
    remote.delete(f"{d}/{MANIFEST_FILE}")
    return False


def drained_ranks(remote: Tier, step: int, save: str | None) -> set[int]:
    """The saving ranks whose files of save ``save`` the nodes have uploaded, by their drained
    objects: one naming another save (an earlier drain of the same step number) counts for none."""
    d = step_dir(step)
    have: set[int] = set()
    for name in remote.list_dir(d):
        if not name.startswith(DRAINED_PREFIX):
            continue
        where = f"{remote.url}: {d}/{name}"
        try:
            doc = json.loads(read_small(remote, f"{d}/{name}", where=where))
            if doc.get("save_id") == save:
                have.update(int(r) for r in doc["ranks"])
        except FileNotFoundError:
            continue
        except (CorruptCheckpointError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
            log.warning("drain: ignoring %s: %s", where, e)
    return have


def contested(remote: Tier, step: int, save: str) -> str | None:
    """The save of the committed step ``step`` on ``remote`` where it is another save than
    ``save`` and one its lineage has not abandoned: a step ``same_save_committed`` refuses to
    replace. None where the remote holds no such step."""
    try:
        there = read_marker(remote, step).save_id
    except (CheckpointNotFoundError, CorruptCheckpointError):
        return None
    if there is None or there == save or (step, there) in abandoned_on(remote):
        return None
    return there
