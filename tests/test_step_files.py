"""Drain, copy and peer replication take the same files of a step: those the manifest names as the
ranks' own (``format.files.files_of_ranks``), whatever else lies in the step directory.

A 4-rank job on 2 simulated nodes (``tests/distributed.py``) saves one step; node 0's directory (ranks
0 and 1) then gets files no manifest names as its ranks': a ``__`` file, one named like a chunk, another node's
pack and manifest part without a replica marker, a stray file and a write in flight.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import tiercheck
from tiercheck.format.files import files_of_ranks
from tiercheck.format.paths import COMMIT_FILE, MANIFEST_FILE, step_dir
from tiercheck.tiering.replication import replica_files
from tiercheck.tiering.transfer import copy_step
from tiercheck.tiering.upload import upload_step
from tiercheck.tiers.local import LocalTier

from .distributed import run_ranks
from .test_distributed import SMALL, model_state, node_dir

JUNK = [
    "__tmp",
    "model/w/c.0.0",  # named like a chunk of a zarr array: every chunk is in a pack, so no manifest names it
    "packs/rank-000002.bin",  # node 1's pack and part, with no replica marker to make them count
    "manifest/rank-000003.json",
    "stray.bin",
    "packs/.rank-000000.bin.tmp-1-2",  # a write in flight
]


def _save(rank: int, world: int, root: str) -> None:
    state = model_state(SMALL, rank, seed=1)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 2)) as ck:
        ck.save(1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("job")
    run_ranks(_save, 4, str(root), start_method="forkserver")
    return root


def _files(step: Path) -> set[str]:
    """The files of a step directory but its commit marker, index and the tier's ``__`` bookkeeping."""
    names = {p.relative_to(step).as_posix() for p in step.rglob("*") if p.is_file()}
    return {n for n in names if n not in (COMMIT_FILE, MANIFEST_FILE) and not n.startswith("__")}


def test_drain_copy_and_replication_take_the_same_files_of_a_step(saved: Path, tmp_path: Path) -> None:
    node = tmp_path / "node0"
    shutil.copytree(saved / "node0", node)
    step = node / step_dir(1)
    saved_files = _files(step)
    assert saved_files and all("000002" not in f and "000003" not in f for f in saved_files)
    for name in JUNK:
        (step / name).parent.mkdir(parents=True, exist_ok=True)
        (step / name).write_bytes(b"junk")

    with ThreadPoolExecutor(2) as pool:
        upload_step(LocalTier(node), LocalTier(tmp_path / "remote"), 1, pool=pool)
    drained = _files(tmp_path / "remote" / step_dir(1))
    copy_step(LocalTier(node), LocalTier(tmp_path / "copy"), 1, ranks={0, 1})
    copied = _files(tmp_path / "copy" / step_dir(1))
    replicated = {name for name, _ in replica_files(LocalTier(node), 1, (0, 1))}

    assert drained == copied == replicated == saved_files  # a normal step's files, all of them, and no junk


def test_a_file_counts_only_when_the_manifest_names_it_as_the_ranks() -> None:
    listing = {
        "manifest/rank-000001.json": 10,
        "packs/rank-000001.bin": 20,
        "packs/rank-000002.bin": 30,
        "model/w/c.0": 40,
        "model/w/c.1": 50,
        "__drained.000000.json": 1,
        "REPLICA-000002.json": 1,
    }
    assert files_of_ranks(listing, [1]) == {"manifest/rank-000001.json": 10, "packs/rank-000001.bin": 20}
