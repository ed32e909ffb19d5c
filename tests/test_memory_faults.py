"""The memory tier's directory damaged under a running job, or unusable at start: the library's own
error naming the path (a save's through its handle), never a raw ``OSError`` or a signal, and no
committed step damaged by the failed save. Real files on the real ``/dev/shm``, real mounts, and a
real process for what once was a SIGBUS."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import tiercheck
from tests.conftest import assert_identical
from tests.distributed import run_ranks
from tiercheck import Checkpointer, MemoryOptions
from tiercheck.errors import MemoryTierError
from tiercheck.format.steps import list_steps
from tiercheck.tiers.local import LocalTier


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(256, 512, generator=torch.Generator().manual_seed(seed))}


def _save(ck: Checkpointer, step: int) -> tiercheck.SaveHandle:
    ck.state["w"].copy_(_state(step)["w"])
    return ck.save(step)


def _directory(shm: Path) -> Path:
    (directory,) = [p for p in shm.iterdir()]  # the one memory directory: the local directory's
    return directory


@contextmanager
def _read_only(directory: Path) -> Iterator[None]:
    """``directory`` seen through a read-only bind mount of itself while inside."""
    done = subprocess.run(["mount", "--bind", str(directory), str(directory)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here (needs root): {done.stderr.decode().strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(directory)], check=True, capture_output=True)
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_the_memory_directory_removed_while_training_fails_the_save_with_the_librarys_error(
    shm: Path, tmp_path: Path
) -> None:
    local = tmp_path / "ckpt"
    with Checkpointer(_state(), local=local, memory=MemoryOptions(path=shm)) as ck:
        _save(ck, 1).wait()
        _save(ck, 2).wait()
        directory = _directory(shm)
        shutil.rmtree(directory)
        for step in (3, 4):  # and again: each save says so
            with pytest.raises(MemoryTierError, match=f"{directory}.* removed") as info:
                _save(ck, step).wait()
            assert info.value.errno == errno.ENOENT
        assert not directory.exists(), "made again behind the operator's back"
    assert list_steps(LocalTier(local)).committed == [1, 2]
    assert_identical(tiercheck.load(local, step=2), _state(2))


def test_a_read_only_mount_over_the_memory_directory_fails_the_save_and_close_names_it(
    shm: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = tmp_path / "ckpt"
    ck = Checkpointer(_state(), local=local, memory=MemoryOptions(path=shm, persist_every=100))
    _save(ck, 1).wait()
    _save(ck, 2).wait()
    directory = _directory(shm)
    with _read_only(directory):
        with pytest.raises(MemoryTierError, match=f"{directory}.* read-only") as info:
            _save(ck, 3).wait()
        assert info.value.errno == errno.EROFS
        with caplog.at_level(logging.ERROR, logger="tiercheck"):
            ck.close()  # persists step 2 from memory; the memory cannot be given back: said, not raised raw
        assert any(directory.name in r.getMessage() and "read-only" in r.getMessage() for r in caplog.records
                   if r.levelno >= logging.ERROR), caplog.text  # fmt: skip
    assert list_steps(LocalTier(directory)).committed == [1, 2], "the failed save withdrew no committed step"
    assert list_steps(LocalTier(local)).committed == [2]
    restored = _state(9)
    with Checkpointer(restored, local=local, memory=MemoryOptions(path=shm, persist_every=100)) as again:
        assert again.restore() == 2, "the lock was released, the step whole"
        assert again.stats()["restore_from_memory"] == 1
    assert_identical(restored, _state(2))


def test_a_slot_whose_step_could_not_be_withdrawn_is_never_staged_over(shm: Path, tmp_path: Path) -> None:
    """A save that failed to withdraw the step in the slot it took (read-only then) leaves the slot to
    that step: once writable again, the next save withdraws it first, never stages over a committed step."""
    local = tmp_path / "ckpt"
    with Checkpointer(_state(), local=local, memory=MemoryOptions(path=shm, persist_every=100)) as ck:
        _save(ck, 1).wait()
        _save(ck, 2).wait()
        directory = _directory(shm)
        with _read_only(directory), pytest.raises(MemoryTierError):
            _save(ck, 3).wait()
        _save(ck, 3).wait()
        assert list_steps(LocalTier(directory)).committed == [2, 3], "step 1 still committed over step 3's bytes"
    restored = _state(9)
    with Checkpointer(restored, local=local, memory=MemoryOptions(path=shm, persist_every=100)) as again:
        assert again.restore() == 3
    assert_identical(restored, _state(3))


def _truncate_slots_then_save(rank: int, world_size: int, local: str, shm: str) -> list[int]:
    """Saves 1 and 2 to memory, truncates every slot file under the live mappings, saves 3 and 4."""
    with Checkpointer(_state(), local=local, memory=MemoryOptions(path=shm, persist_every=100)) as ck:
        _save(ck, 1).wait()
        _save(ck, 2).wait()
        for slot in (_directory(Path(shm)) / "slots").iterdir():
            os.truncate(slot, 0)
        _save(ck, 3).wait()
        _save(ck, 4).wait()
        return list_steps(LocalTier(_directory(Path(shm)))).committed


def test_a_slot_truncated_under_a_live_process_is_mapped_again_never_a_sigbus(shm: Path, tmp_path: Path) -> None:
    local = tmp_path / "ckpt"
    (committed,) = run_ranks(_truncate_slots_then_save, 1, str(local), str(shm), timeout=300)
    assert committed == [3, 4]
    assert_identical(tiercheck.load(local, step=4), _state(4))


@pytest.mark.parametrize("level", ["path", "directory"])
def test_a_memory_path_that_is_a_file_is_refused_at_start(shm: Path, tmp_path: Path, level: str) -> None:
    local = tmp_path / "ckpt"
    if level == "directory":
        with Checkpointer(_state(), local=local, memory=MemoryOptions(path=shm, keep_at_close=True)) as ck:
            _save(ck, 1).wait()
        target = _directory(shm)
        shutil.rmtree(target)
    else:
        target = shm
    target.write_bytes(b"a file")
    try:
        with pytest.raises(MemoryTierError, match=f"{target} is a file, not a directory") as info:
            Checkpointer(_state(), local=local, memory=MemoryOptions(path=shm))
        assert info.value.errno == errno.ENOTDIR
        assert target.read_bytes() == b"a file"
    finally:
        target.unlink()  # the fixture removes a directory tree, not a file
