"""A Checkpointer whose local directory cannot be written at start (a full disk, a read-only
snapshot) raises StorageError naming the directory and what to do, and holds nothing afterwards:
no open file, no lock, nothing removed or left half-written, so the next start in the same process
works once the disk has room again (issue 42, items 7 and 8).

The faults are the operating system's. Where this machine lets the test mount a tmpfs (root with
CAP_SYS_ADMIN), a real full and a real read-only filesystem are used; everywhere, the same failures
are raised at the OS boundary (``os.pwrite``, ``os.open``, ``os.mkdir``) under the real code."""

from __future__ import annotations

import errno
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import tiercheck
from tiercheck import Checkpointer, CoordinationError, DistributedOptions, StorageError
from tiercheck.cli import main
from tiercheck.cluster.nodes import node_id
from tiercheck.format.paths import LOCK_FILE

from .distributed import run_ranks


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(16, dtype=torch.float32)}


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _open_under(root: Path) -> list[str]:
    """Files under ``root`` this process holds open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the listing's own descriptor, closed since
            continue
        if target.startswith(f"{root}/"):
            found.append(target)
    return found


def _is_lock(fd: int) -> bool:
    return os.readlink(f"/proc/self/fd/{fd}").endswith(LOCK_FILE)


def _fail_lock_writes(monkeypatch: pytest.MonkeyPatch, code: int) -> Callable[[], None]:
    """The kernel refuses the holder's description written into the lock file (the disk filled up);
    every other write goes through. Returns the undo (the disk has room again)."""
    real = os.pwrite

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if _is_lock(fd):
            raise OSError(code, os.strerror(code))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    return lambda: monkeypatch.setattr(os, "pwrite", real)


def _fail_lock_open(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    real = os.open

    def open_(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if os.fspath(path).endswith(LOCK_FILE):
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", open_)


def test_a_full_disk_at_start_raises_storage_error_and_holds_nothing(tmp_path: Path, monkeypatch) -> None:
    before = _fds()
    room_again = _fail_lock_writes(monkeypatch, errno.ENOSPC)
    with pytest.raises(StorageError) as e:
        Checkpointer({"m": _state()}, local=tmp_path)
    assert e.value.errno == errno.ENOSPC
    assert isinstance(e.value, OSError)
    message = str(e.value)
    assert str(tmp_path) in message and "free" in message, message
    assert _fds() == before  # the lock file's descriptor was closed: nothing holds the directory
    assert (tmp_path / LOCK_FILE).read_bytes() == b""  # nothing half-written naming a holder
    room_again()
    with Checkpointer({"m": _state()}, local=tmp_path) as ckpt:  # was DirectoryInUseError "holder unknown"
        ckpt.save(1).wait()
    assert _open_under(tmp_path) == []
    assert torch.equal(tiercheck.load(tmp_path)["m"]["w"], _state()["w"])


def test_a_full_disk_when_the_directory_is_created_raises_storage_error(tmp_path: Path, monkeypatch) -> None:
    local = tmp_path / "new" / "ckpt"
    real = os.mkdir

    def mkdir(path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        if Path(path) == local:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
        real(path, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "mkdir", mkdir)
    with pytest.raises(StorageError) as e:
        Checkpointer({"m": _state()}, local=local)
    assert e.value.errno == errno.ENOSPC and str(local) in str(e.value)
    monkeypatch.setattr(os, "mkdir", real)
    with Checkpointer({"m": _state()}, local=local) as ckpt:
        ckpt.save(1).wait()


def _partial_step(root: Path) -> dict[str, bytes]:
    """A directory holding step 1 committed and step 2 begun and never committed (a crash)."""
    with Checkpointer({"m": _state()}, local=root) as ckpt:
        ckpt.save(1).wait()
    (root / "step-00000002").mkdir()
    (root / "step-00000002" / "partial").write_bytes(b"x")
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _read_only_advice(message: str, root: Path) -> None:
    assert str(root) in message, message
    assert "tiercheck.load(" in message and "tiercheck restore" in message and "--to" in message, message


def test_a_read_only_directory_is_refused_pointing_at_load_and_restore_to(tmp_path: Path, monkeypatch) -> None:
    files = _partial_step(tmp_path)
    before = _fds()
    _fail_lock_open(monkeypatch, errno.EROFS)
    with pytest.raises(StorageError) as e:
        Checkpointer({"m": _state()}, local=tmp_path)
    assert e.value.errno == errno.EROFS
    _read_only_advice(str(e.value), tmp_path)
    assert _fds() == before
    # Nothing written or removed: the uncommitted step 2 is still there, the lock file unchanged.
    assert {str(p.relative_to(tmp_path)): p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == files


def test_a_full_disk_refusing_to_remove_a_partial_step_at_start(tmp_path: Path, monkeypatch) -> None:
    """On a full copy-on-write filesystem (btrfs, ZFS) even a deletion can fail with ENOSPC."""
    _partial_step(tmp_path)
    real = os.unlink

    def unlink(path: Any, *, dir_fd: int | None = None) -> None:
        if os.path.basename(os.fspath(path)) == "partial":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
        real(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(StorageError) as e:
        Checkpointer({"m": _state()}, local=tmp_path)
    assert e.value.errno == errno.ENOSPC and str(tmp_path) in str(e.value) and "partial steps" in str(e.value)
    assert _open_under(tmp_path) == []  # the lock was given back
    monkeypatch.setattr(os, "unlink", real)
    with Checkpointer({"m": _state()}, local=tmp_path) as ckpt:
        assert ckpt.steps() == [1]
    assert not (tmp_path / "step-00000002").exists()


def _rank_with_a_full_disk(rank: int, world_size: int, roots: list[str]) -> str:
    room_again = None
    if rank == 1:  # this node's disk is full: the lock's holder text cannot be written
        room_again = _fail_lock_writes(pytest.MonkeyPatch(), errno.ENOSPC)  # in this rank's process alone
    try:
        Checkpointer({"w": torch.zeros(4)}, local=roots[rank], distributed=DistributedOptions(timeout_s=300))
    except (StorageError, CoordinationError) as e:
        outcome = f"{type(e).__name__}: {e}"
    else:
        return "opened"
    if room_again is not None:
        room_again()
    # Nothing of the failed start holds the directory in this process: it opens again (alone).
    with Checkpointer({"w": torch.zeros(4)}, local=roots[rank], distributed=DistributedOptions(enabled=False)):
        pass
    return outcome


def test_a_full_disk_on_one_node_stops_every_rank_at_once(tmp_path: Path) -> None:
    """Before, the other ranks waited for the failed one for DistributedOptions.timeout_s (300 s here)."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    results = run_ranks(_rank_with_a_full_disk, 2, roots, timeout=120)
    assert results[1].startswith("StorageError: ") and roots[1] in results[1], results
    assert results[0].startswith("CoordinationError: rank 1 failed") and "StorageError" in results[0], results


# ----------------------------------------------------------------- real filesystems, where one can be mounted


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``mount(size=..., ro=...)``: a tmpfs of that size under ``tmp_path``, unmounted afterwards."""
    mounted: list[Path] = []

    def mount(*, size: str = "1m", inodes: str | None = None) -> Path:
        where = tmp_path / f"fs-{uuid.uuid4().hex[:8]}"
        where.mkdir()
        options = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
            why = done.stderr.decode().strip() if done.returncode else ""
        except OSError as e:  # no mount command at all
            why = str(e)
        if why:
            pytest.skip(f"cannot mount a tmpfs here ({why}): the injected faults cover this")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _remount(where: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(where)], check=True)


def _fill(where: Path) -> None:
    with open(where / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC


def test_a_really_full_disk_at_start(tmpfs) -> None:
    fs = tmpfs(size="256k")
    local = fs / "ckpt"
    local.mkdir()
    _fill(fs)
    before = _fds()
    for _ in range(2):  # the second start met "in use (holder unknown)" before
        with pytest.raises(StorageError) as e:
            Checkpointer({"m": _state()}, local=local)
        assert e.value.errno == errno.ENOSPC and str(local) in str(e.value) and "free" in str(e.value)
        assert _fds() == before
    # Several ranks name their node in the directory: a full disk leaves no half-written name file.
    with pytest.raises(StorageError, match=str(local)):
        node_id(local)
    assert sorted(p.name for p in local.iterdir()) == [LOCK_FILE]
    (fs / "filler").unlink()
    with Checkpointer({"m": _state()}, local=local) as ckpt:
        ckpt.save(1).wait()
    assert torch.equal(tiercheck.load(local)["m"]["w"], _state()["w"])


def test_no_inode_left_when_the_directory_is_created(tmpfs) -> None:
    fs = tmpfs(size="1m", inodes="4")
    for i in range(8):  # use up every inode
        try:
            (fs / f"f{i}").touch()
        except OSError as e:
            assert e.errno == errno.ENOSPC
            break
    with pytest.raises(StorageError) as e:
        Checkpointer({"m": _state()}, local=fs / "ckpt")
    assert e.value.errno == errno.ENOSPC and str(fs / "ckpt") in str(e.value)


def test_a_really_read_only_snapshot(tmpfs, tmp_path: Path) -> None:
    fs = tmpfs(size="4m")
    local = fs / "ckpt"
    files = _partial_step(local)
    (local / LOCK_FILE).unlink()  # a snapshot taken of a directory no Checkpointer had opened
    del files[LOCK_FILE]
    _remount(fs, "ro")
    before = _fds()
    with pytest.raises(StorageError) as e:
        Checkpointer({"m": _state()}, local=local)
    assert e.value.errno == errno.EROFS
    _read_only_advice(str(e.value), local)
    assert _fds() == before
    with pytest.raises(StorageError, match=str(local)):
        node_id(local)
    # What the message points at works on the read-only copy.
    assert torch.equal(tiercheck.load(local)["m"]["w"], _state()["w"])
    copy = tmp_path / "writable"
    result = CliRunner().invoke(main, ["restore", str(local), "--to", str(copy)])
    assert result.exit_code == 0, result.output
    state = {"m": {"w": torch.zeros(16)}}
    with Checkpointer(state, local=copy) as ckpt:
        assert ckpt.restore() == 1
    assert torch.equal(state["m"]["w"], _state()["w"])
    assert {str(p.relative_to(local)): p.read_bytes() for p in sorted(local.rglob("*")) if p.is_file()} == files
