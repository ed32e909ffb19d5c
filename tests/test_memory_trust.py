"""The memory tier restores only what its lineage holds (invariant 13): never a step a rollback
abandoned, another save of a step number the other tiers hold, or a step of another lineage planted
there; it finds its directory however the local directory is spelled; and a save after a restore
that passed over a damaged memory step never hangs nor writes into a committed step."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

import tiercheck
from tests.conftest import assert_identical
from tests.distributed import run_ranks
from tests.killed import die
from tests.ondisk import flip_chunk_byte
from tiercheck import Checkpointer, MemoryOptions, StagingOptions
from tiercheck.format.paths import MEMORY_OWNER_FILE, MEMORY_RECORD_FILE, step_dir
from tiercheck.format.steps import list_steps
from tiercheck.state import memory_pool
from tiercheck.tiers.local import LocalTier


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 512, generator=g), "b": torch.randint(0, 1 << 30, (2048,), generator=g)}


def _memory_dir(shm: Path, local: Path) -> Path:
    return memory_pool.pool_dir(MemoryOptions(path=shm), os.path.abspath(local))


def _job(
    local: str, shm: str | None, every: int, steps: list[int], *, restore: bool, seed: int = 0, die: bool = False
) -> int | None:
    """A job on ``local`` (with the memory tier at ``shm``, or none), restoring first where told,
    then saving ``steps`` with the state ``_state(step + seed)`` at each, then closing (or killed,
    where ``die``); returns what it restored."""
    state = _state(99)
    memory = MemoryOptions(path=shm, persist_every=every) if shm is not None else None
    ck = Checkpointer(state, local=local, memory=memory, staging=StagingOptions(mode="eager"))
    got = ck.restore() if restore else None
    for step in steps:
        for k, v in _state(step + seed).items():
            state[k].copy_(v)
        ck.save(step).wait()
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    ck.close()
    return got


def _job_then_die(local: str, shm: str | None, every: int, steps: list[int], restore: bool, seed: int = 0) -> None:
    _job(local, shm, every, steps, restore=restore, seed=seed, die=True)


def _restart(local: Path, shm: Path, every: int, step: int | None = None) -> tuple[int | None, dict, dict]:
    state = _state(99)
    with Checkpointer(state, local=local, memory=MemoryOptions(path=shm, persist_every=every)) as ck:
        got = ck.restore(step)
        stats = ck.stats()
    return got, state, stats


# ------------------------------------------------------------------------------ A: abandoned steps


@pytest.mark.parametrize("record", ["kept", "lost"])
def test_a_memory_step_another_save_replaced_on_the_local_directory_is_never_restored(
    shm: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, record: str
) -> None:
    """Issue 64 A.1: memory saves 1..5 (persist_every=2); a job without memory restores 4 from disk and
    saves a new 5 (seed 100); the next job with memory restores the local 5, not memory's abandoned 5.
    With the directory's record of its memory tier, the job without it withdrew memory's 5 as it
    branched; without the record ("lost": a job of a release before it), memory's 5 is still there,
    and passed over for not being the save the local directory holds."""
    local = tmp_path / "ckpt"
    die(_job_then_die, str(local), str(shm), 2, [1, 2, 3, 4, 5], False)
    if record == "lost":
        (local / MEMORY_RECORD_FILE).unlink(missing_ok=True)
    assert _job(str(local), None, 2, [5], restore=True, seed=100) == 4  # saves 5'
    assert list_steps(LocalTier(local)).committed == [2, 4, 5]
    got, state, stats = _restart(local, shm, 2)
    assert got == 5
    assert_identical(state, _state(105)), "the local directory's 5, the save its lineage holds"
    assert stats["restore_from_memory"] == 0
    assert ("holds another save of step 5" in caplog.text) == (record == "lost"), "withdrawn at the branch"
    assert "restored step 5 from the local directory: its step 5 is newer than the memory tier's newest" in caplog.text


def test_restore_of_a_step_number_asks_the_save_the_lineage_holds(shm: Path, tmp_path: Path) -> None:
    """A.1, ``restore(step=5)`` with the local directory holding 5' and 6'."""
    local = tmp_path / "ckpt"
    die(_job_then_die, str(local), str(shm), 2, [1, 2, 3, 4, 5], False)
    assert _job(str(local), None, 2, [5, 6], restore=True, seed=100) == 4
    got, state, stats = _restart(local, shm, 2, step=5)
    assert got == 5
    assert_identical(state, _state(105))
    assert stats["restore_from_memory"] == 0


def test_a_rollback_by_a_job_without_memory_abandons_the_memory_steps_above_it(
    shm: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A.3: a job without ``memory=`` that finds committed memory steps of its lineage newer than the
    step it restores says so, in one warning; once it saves (a branch), no restore takes them."""
    local = tmp_path / "ckpt"
    die(_job_then_die, str(local), str(shm), 2, [1, 2, 3, 4, 5, 6, 7], False)  # memory: 6, 7; local: 2, 4, 6
    caplog.clear()
    assert _job(str(local), None, 2, [], restore=True) == 6
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "memory tier" in r.getMessage()]
    assert len(said) == 1, said
    assert "step(s) 7" in said[0] and str(shm) in said[0] and "MemoryOptions" in said[0], said[0]
    assert _job(str(local), None, 2, [8], restore=True, seed=100) == 6  # saves 8': a branch at 6
    with pytest.raises(tiercheck.CheckpointNotFoundError):
        _restart(local, shm, 2, step=7)
    got, state, stats = _restart(local, shm, 2)
    assert got == 8 and stats["restore_from_memory"] == 0
    assert_identical(state, _state(108))


def test_the_memory_directory_is_found_through_a_symlinked_local_directory(shm: Path, tmp_path: Path) -> None:
    """A.2: the memory tier is named by what the local directory is, not how its path was spelled."""
    local = tmp_path / "ckpt"
    die(_job_then_die, str(local), str(shm), 100, [1, 2, 3], False)
    link = tmp_path / "link"
    link.symlink_to(local)
    got, state, stats = _restart(link, shm, 100)
    assert got == 3 and stats["restore_from_memory"] == 1, "the memory tier of the directory the link names"
    assert_identical(state, _state(3))


@pytest.mark.parametrize("forgery", ["step directory", "memory directory"])
def test_a_forged_placement_of_another_lineages_memory_is_never_restored(
    shm: Path, tmp_path: Path, forgery: str
) -> None:
    """A.4: another lineage's step directory planted in our memory directory, or another lineage's
    memory directory with our ``OWNER`` copied in: neither is restored."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    die(_job_then_die, str(ours), str(shm), 100, [1, 2], False)
    die(_job_then_die, str(theirs), str(shm), 100, [3, 4], False, 50)
    mine, other = _memory_dir(shm, ours), _memory_dir(shm, theirs)
    if forgery == "step directory":
        for step in (3, 4):
            shutil.copytree(other / step_dir(step), mine / step_dir(step))
    else:
        shutil.copy(mine / MEMORY_OWNER_FILE, other / MEMORY_OWNER_FILE)
        shutil.rmtree(mine)
        shutil.copytree(other, mine)
    got, state, _ = _restart(ours, shm, 100)
    assert got != 4 and got != 3
    assert not any(torch.equal(state["w"], _state(s + 50)["w"]) for s in (3, 4))


# ------------------------------------------------------------------------------ B: no hang


def test_a_save_after_a_restore_that_passed_over_a_damaged_memory_step_neither_hangs_nor_overwrites(
    shm: Path, tmp_path: Path
) -> None:
    """B.5: the newest memory step's pack damaged; the restore falls back to the older memory step;
    the next saves return (they never write into a committed step), and the damaged step is withdrawn."""
    local = tmp_path / "ckpt"
    die(_job_then_die, str(local), str(shm), 100, [1, 2], False)
    memory = _memory_dir(shm, local)
    flip_chunk_byte(memory / step_dir(2), "w", "c.0.0", 5)
    state = _state(99)
    with Checkpointer(state, local=local, memory=MemoryOptions(path=shm, persist_every=100, keep_at_close=True)) as ck:
        assert ck.restore() == 1
        assert_identical(state, _state(1))
        assert list_steps(LocalTier(memory)).committed == [1], "the step the restore passed over is withdrawn"
        for step in (2, 3, 4):
            for k, v in _state(step).items():
                state[k].copy_(v)
            ck.save(step).wait(timeout=60)
            assert list_steps(LocalTier(memory)).committed[-1] == step
    restored = _state(99)
    with Checkpointer(restored, local=local, memory=MemoryOptions(path=shm, persist_every=100)) as ck:
        assert ck.restore() == 4
    assert_identical(restored, _state(4))


# ------------------------------------------------------------------------------ D: the library's errors


def _restore_on_one_node(rank: int, world: int, local: str, shm: str) -> int | None:
    state = _state(99)
    with Checkpointer(state, local=local, memory=MemoryOptions(path=shm, persist_every=100)) as ck:
        got = ck.restore()
        assert_identical(state, _state(2))
    return got


def test_two_ranks_of_a_node_restore_what_one_rank_saved_to_memory_and_persist_it_at_close(
    shm: Path, tmp_path: Path
) -> None:
    """D.8: one rank saved step 2 to memory only; two ranks of one node restore it, and the close
    persists it to the local directory (it once raised a raw ValueError there, the step left unpersisted)."""
    local = tmp_path / "ckpt"
    die(_job_then_die, str(local), str(shm), 100, [1, 2], False)
    assert run_ranks(_restore_on_one_node, 2, str(local), str(shm)) == [2, 2]
    assert list_steps(LocalTier(local)).committed == [2]
    assert_identical(tiercheck.load(local, step=2), _state(2))


def test_a_clean_close_gives_back_the_memory_of_steps_it_does_not_trust_too(shm: Path, tmp_path: Path) -> None:
    """A step of another lineage planted in the memory directory is never persisted at a clean close,
    and its memory is given back with the rest: no step directory, slot or memory directory stays."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    die(_job_then_die, str(ours), str(shm), 100, [1, 2], False)
    die(_job_then_die, str(theirs), str(shm), 100, [3], False, 50)
    mine = _memory_dir(shm, ours)
    shutil.copytree(_memory_dir(shm, theirs) / step_dir(3), mine / step_dir(3))
    Checkpointer(_state(99), local=ours, memory=MemoryOptions(path=shm, persist_every=100)).close()
    assert list_steps(LocalTier(ours)).committed == [2], "the lineage's newest persisted, never the planted 3"
    assert not mine.exists()
