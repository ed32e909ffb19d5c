"""The memory tier's bound, checked at start (invariant 13: never a SIGBUS later): a tmpfs or a cgroup too small
for the slots is refused naming both numbers, options that cannot work are refused, and on CUDA the slots are
page-locked. On a real tmpfs (mounted for the test where it may be) and real cgroup files' formats."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
import torch

import tiercheck
from tests.conftest import assert_identical
from tests.test_memory_tier import _state
from tiercheck import Checkpointer, MemoryOptions, MemoryTierError, StagingOptions
from tiercheck.errors import InvalidArgumentError
from tiercheck.libc import RAMFS_MAGIC, TMPFS_MAGIC, filesystem_type
from tiercheck.state import memory_pool


def test_a_tmpfs_too_small_is_refused_at_start(tiny_tmpfs: Path, tmp_path: Path) -> None:
    state = {"w": torch.zeros(1 << 20)}  # 4 MiB: two slots of it do not fit 8 MiB with anything else there
    (tiny_tmpfs / "other").write_bytes(bytes(1 << 20))
    memory = MemoryOptions(path=tiny_tmpfs / "tier")
    local = tmp_path / "ckpt"
    with pytest.raises(MemoryTierError) as info:
        Checkpointer(state, local=local, memory=memory)
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert str(tiny_tmpfs / "tier") in message
    assert f"needs {2 * (4 << 20):,} bytes" in message
    st = os.statvfs(tiny_tmpfs)
    assert f"tmpfs free: {st.f_bavail * st.f_frsize:,} bytes" in message
    assert "cgroup limit:" in message and "--shm-size" in message and "slots" in message
    assert not local.exists(), "refused before anything is created"
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["other"]
    with pytest.raises(MemoryTierError, match="needs"):  # a slot holds a whole snapshot, whatever bounds the pool
        Checkpointer(state, local=local, memory=memory, staging=StagingOptions(max_host_bytes=1 << 20))
    small = {"w": torch.ones(1 << 19)}  # 2 MiB: two slots fit
    with Checkpointer(small, local=local, memory=memory) as ck:
        ck.save(1).wait()
        ck.save(2).wait()
    assert_identical(tiercheck.load(local), small)


def _fake_cgroup(root: Path, limit: str, usage: str) -> Path:
    root.mkdir()
    (root / "memory.max").write_text(limit + "\n")
    (root / "memory.current").write_text(usage + "\n")
    return root


def test_a_cgroup_limit_too_small_is_refused_at_start(
    shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cgroup = _fake_cgroup(tmp_path / "cgroup", str(16 << 20), str(10 << 20))
    monkeypatch.setattr(memory_pool, "CGROUP_ROOT", str(cgroup))
    monkeypatch.setattr(memory_pool, "SELF_CGROUP", str(tmp_path / "absent"))
    local = tmp_path / "ckpt"
    state = {"w": torch.zeros(1 << 20)}  # 4 MiB, x 2 slots: more than the 6 MiB the limit leaves
    with pytest.raises(MemoryTierError) as info:
        Checkpointer(state, local=local, memory=MemoryOptions(path=shm))
    message = str(info.value)
    assert f"cgroup's memory limit of {16 << 20:,} bytes ({10 << 20:,} in use) leaves {6 << 20:,}" in message
    assert f"cgroup limit: {16 << 20:,} bytes" in message and str(shm) in message
    assert not local.exists() and not shm.exists()


def test_no_cgroup_limit_is_no_refusal(shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_pool, "CGROUP_ROOT", str(_fake_cgroup(tmp_path / "cgroup", "max", "123")))
    monkeypatch.setattr(memory_pool, "SELF_CGROUP", str(tmp_path / "absent"))
    assert memory_pool.cgroup_room() == (None, 0)
    with Checkpointer({"w": torch.zeros(1 << 20)}, local=tmp_path / "ckpt", memory=MemoryOptions(path=shm)) as ck:
        ck.save(1).wait()


def test_the_tightest_of_the_own_cgroup_and_its_parents_binds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    own = tmp_path / "cg" / "job" / "step"
    own.mkdir(parents=True)
    (own / "memory.max").write_text("max\n")
    (own / "memory.current").write_text(f"{1 << 20}\n")
    (own.parent / "memory.max").write_text(f"{64 << 20}\n")  # the job's limit binds its steps
    (own.parent / "memory.current").write_text(f"{60 << 20}\n")
    (tmp_path / "cg" / "memory.max").write_text(f"{1 << 30}\n")
    (tmp_path / "cg" / "memory.current").write_text(f"{100 << 20}\n")
    (tmp_path / "self-cgroup").write_text("0::/job/step\n")
    monkeypatch.setattr(memory_pool, "SELF_CGROUP", str(tmp_path / "self-cgroup"))
    assert memory_pool.cgroup_room(tmp_path / "cg") == (64 << 20, 60 << 20)


def test_cgroup_v1_files_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "self-cgroup").write_text("4:memory:/elsewhere\n3:cpu,cpuacct:/\n")
    monkeypatch.setattr(memory_pool, "SELF_CGROUP", str(tmp_path / "self-cgroup"))
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text("42\n")
    assert memory_pool.cgroup_room(tmp_path) == (None, 0)
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{1 << 30}\n")
    assert memory_pool.cgroup_room(tmp_path) == (1 << 30, 42)
    assert memory_pool.cgroup_room(tmp_path / "absent") == (None, 0)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"path": ""}, "MemoryOptions.path"),
        ({"path": 3}, "MemoryOptions.path"),
        ({"slots": 1}, "MemoryOptions.slots"),
        ({"slots": True}, "MemoryOptions.slots"),
        ({"slots": 2.0}, "MemoryOptions.slots"),
        ({"persist_every": 0}, "MemoryOptions.persist_every"),
        ({"keep_at_close": 1}, "MemoryOptions.keep_at_close"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, object], names: str) -> None:
    with pytest.raises(InvalidArgumentError, match=names):
        MemoryOptions(**kwargs)  # type: ignore[arg-type]


def test_memory_must_be_memory_options(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="memory must be a MemoryOptions"):
        Checkpointer(_state(), local=tmp_path / "ckpt", memory="/dev/shm")  # type: ignore[arg-type]
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_slots_are_page_locked_and_restore_bit_identical(
    shm: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = {k: v.cuda() for k, v in _state(4).items()}
    local = tmp_path / "ckpt"
    with Checkpointer(state, local=local, memory=MemoryOptions(path=shm, persist_every=100)) as ck:
        ck.save(1).wait()
        assert ck.stats()["memory_held_bytes"] > 0
    assert "could not page-lock" not in caplog.text, "cudaHostRegister took the shared mapping"
    restored = {k: torch.zeros_like(v) for k, v in state.items()}
    with Checkpointer(restored, local=local, memory=MemoryOptions(path=shm)) as ck:
        assert ck.restore() == 1
    assert_identical(restored, state)


def test_a_pool_file_the_tmpfs_cannot_hold_is_refused_when_reserved(tiny_tmpfs: Path) -> None:
    """The start-up check estimates; state that grew after it is caught when the file is reserved,
    before a byte is written to it, not as a SIGBUS on a page the tmpfs cannot give."""
    path = tiny_tmpfs / "tier" / "rank-000000.pool"
    with pytest.raises(MemoryTierError, match=f"cannot reserve {16 << 20:,} bytes .*{path}") as info:
        memory_pool.mapped_empty(path, 16 << 20, pin=False)
    assert info.value.errno == errno.ENOSPC
    assert not path.exists()


def test_a_memory_path_off_a_tmpfs_is_warned_at_start(
    shm: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``MemoryOptions(path=)`` on a disk works, at the disk's pace: the start says so, naming the path; on the
    real /dev/shm tmpfs it says nothing."""
    if filesystem_type(str(tmp_path)) in (TMPFS_MAGIC, RAMFS_MAGIC):
        pytest.skip(f"{tmp_path} is on a tmpfs here: no disk to try")
    state = {"w": torch.zeros(1024)}
    on_disk = tmp_path / "not" / "memory"  # not made yet: the directory above it that exists is judged
    caplog.set_level(logging.WARNING, logger="tiercheck")
    with Checkpointer(state, local=tmp_path / "a", memory=MemoryOptions(path=on_disk)) as ck:
        ck.save(1).wait()
    [warned] = [r.getMessage() for r in caplog.records if "not on a tmpfs" in r.getMessage()]
    assert warned.startswith(f"MemoryOptions.path {on_disk} is not on a tmpfs ({tmp_path} is on a filesystem of type")
    assert "/dev/shm" in warned
    caplog.clear()
    caplog.set_level(logging.INFO, logger="tiercheck")
    with Checkpointer(state, local=tmp_path / "b", memory=MemoryOptions(path=shm, persist_every=5)):
        pass
    assert not [r for r in caplog.records if "not on a tmpfs" in r.getMessage()]
    # the start-up line names the memory tier, where it is and what goes on to the local directory
    [started] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory tier at ")]
    assert started.startswith(f"memory tier at {shm}/") and "every save commits there (2 slots of " in started
    assert started.endswith(f"those of a step divisible by 5 to {tmp_path / 'b'} too"), started
