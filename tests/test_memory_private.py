"""The memory tier lives where every user of the node can create names (``/dev/shm``): what it makes
there is its user's alone, and nothing planted there is followed or trusted (invariant 14). Real
files on the real ``/dev/shm``; the other user is uid 65534 (the tests run as root)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_identical
from tests.shm import private_shm
from tiercheck import Checkpointer, MemoryOptions
from tiercheck.errors import UnsafeCheckpointError
from tiercheck.format.paths import step_dir

OTHER_UID = 65534  # nobody


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(256, 512, generator=torch.Generator().manual_seed(seed))}


def _kept(shm: Path, local: Path, steps: list[int]) -> Path:
    """A job that saved ``steps`` to memory only and kept its memory at close: the memory directory."""
    memory = MemoryOptions(path=shm, persist_every=1000, keep_at_close=True)
    with Checkpointer(_state(), local=local, memory=memory) as ck:
        for step in steps:
            ck.state["w"].copy_(_state(step)["w"])
            ck.save(step).wait()
    return _only_dir(shm)


def _only_dir(shm: Path) -> Path:
    (directory,) = [p for p in shm.iterdir()]  # the local directory's memory directory
    return directory


def _victim(tmp_path: Path) -> tuple[Path, bytes]:
    victim = tmp_path / "victim"
    victim.write_bytes(b"not the memory tier's" * 4096)
    return victim, victim.read_bytes()


@pytest.fixture
def umask_zero() -> Iterator[None]:
    old = os.umask(0)  # the most permissive: whatever is private is so by the library's own doing
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def elsewhere() -> Iterator[Path]:
    """A directory outside the memory root on the same tmpfs (a hard link there would succeed)."""
    with private_shm() as path:
        path.mkdir()
        yield path


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# --------------------------------------------------------------------------- C.6: no link followed


def test_a_slot_file_replaced_by_a_symlink_is_refused_never_mapped(shm: Path, tmp_path: Path) -> None:
    local = tmp_path / "ckpt"
    directory = _kept(shm, local, [1])
    victim, before = _victim(tmp_path)
    for slot in (directory / "slots").iterdir():
        slot.unlink()
        slot.symlink_to(victim)
    memory = MemoryOptions(path=shm, persist_every=1000)
    with (
        pytest.raises(UnsafeCheckpointError, match=r"slots/rank-000000\.\d is a symbolic link"),
        Checkpointer(_state(2), local=local, memory=memory) as ck,
    ):
        ck.save(2).wait()
    assert victim.read_bytes() == before, "the link's target was mapped and overwritten"


def test_a_symlinked_slots_directory_is_refused_never_followed(shm: Path, tmp_path: Path, elsewhere: Path) -> None:
    """``slots/`` a link to a directory elsewhere (another filesystem: once a raw EXDEV, or the slot
    files made there): refused with the library's error, nothing made there."""
    local = tmp_path / "ckpt"
    directory = _kept(shm, local, [1])
    for slot in (directory / "slots").iterdir():
        slot.unlink()
    (directory / "slots").rmdir()
    (directory / "slots").symlink_to(elsewhere)
    memory = MemoryOptions(path=shm, persist_every=1000)
    with (
        pytest.raises(UnsafeCheckpointError, match="slots is a symbolic link"),
        Checkpointer(_state(2), local=local, memory=memory) as ck,
    ):
        ck.save(2).wait()
    assert list(elsewhere.iterdir()) == [], "something was made through the link"


@pytest.mark.parametrize("where", [step_dir(2), f"{step_dir(2)}/packs"])
def test_a_directory_of_a_step_planted_as_a_symlink_under_a_live_job_is_refused(
    shm: Path, tmp_path: Path, elsewhere: Path, where: str
) -> None:
    local = tmp_path / "ckpt"
    with Checkpointer(_state(), local=local, memory=MemoryOptions(path=shm, persist_every=1000)) as ck:
        ck.save(1).wait()
        directory = _only_dir(shm)
        (directory / where).parent.mkdir(exist_ok=True)
        (directory / where).symlink_to(elsewhere)
        with pytest.raises(UnsafeCheckpointError, match=f"{where} is a symbolic link"):
            ck.save(2).wait()
        ck.save(3).wait()  # the next save is not hurt
    assert list(elsewhere.iterdir()) == [], "something was made through the link"


# ------------------------------------------------------------------- C.7: private to its user


def test_the_default_memory_path_is_per_user() -> None:
    assert os.fspath(MemoryOptions().path) == f"/dev/shm/tiercheck-{os.geteuid()}"


def test_what_the_memory_tier_creates_is_0700_and_0600_whatever_the_umask(
    shm: Path, tmp_path: Path, umask_zero: None
) -> None:
    local = tmp_path / "ckpt"
    shm.mkdir()
    os.chmod(shm, 0o755)  # the configured path, of this user but readable by all: made private
    directory = _kept(shm, local, [1, 2])
    made = [shm, *shm.rglob("*")]
    assert directory / "slots" in made and directory / step_dir(2) / "COMMIT" in made
    dirs = {str(p): oct(_mode(p)) for p in made if p.is_dir()}
    files = {str(p): oct(_mode(p)) for p in made if p.is_file()}
    assert set(dirs.values()) == {"0o700"}, dirs
    assert set(files.values()) == {"0o600"}, files
    restored = _state(9)
    with Checkpointer(restored, local=local, memory=MemoryOptions(path=shm, persist_every=1000)) as ck:
        assert ck.restore() == 2
    assert_identical(restored, _state(2))


def _refused(shm: Path, local: Path, *, match: str) -> None:
    with pytest.raises(UnsafeCheckpointError, match=match):
        Checkpointer(_state(), local=local, memory=MemoryOptions(path=shm))


@pytest.mark.parametrize("level", ["path", "directory"])
def test_a_memory_root_another_user_owns_is_refused(shm: Path, tmp_path: Path, level: str) -> None:
    local = tmp_path / "ckpt"
    target = _kept(shm, local, [1]) if level == "directory" else shm
    shm.mkdir(mode=0o700, exist_ok=True)
    os.chown(target, OTHER_UID, OTHER_UID)
    _refused(
        shm, local, match=rf"{target} is owned by uid {OTHER_UID}, not by this process's uid {os.geteuid()}.*0o700"
    )


@pytest.mark.parametrize(("level", "mode"), [("path", 0o777), ("path", 0o1777), ("directory", 0o770)])
def test_a_memory_root_others_may_write_is_refused(shm: Path, tmp_path: Path, level: str, mode: int) -> None:
    local = tmp_path / "ckpt"
    target = _kept(shm, local, [1]) if level == "directory" else shm
    shm.mkdir(mode=0o700, exist_ok=True)
    os.chmod(target, mode)
    _refused(shm, local, match=rf"{target} \(owner uid {os.geteuid()}, mode {oct(mode)}\) may be written by")
    assert _mode(target) == mode, "left as found"


def test_a_memory_path_that_is_a_symlink_is_refused(shm: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    shm.symlink_to(elsewhere)
    try:
        _refused(shm, tmp_path / "ckpt", match=f"{shm} is a symbolic link")
    finally:
        shm.unlink()
    assert list(elsewhere.iterdir()) == []
