"""The memory tier's foundation: the staging pool mapped from a file on a real tmpfs, that outlives
the process, and the memory bound checked at start (invariant 13: never a SIGBUS later)."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tiercheck
from tests.conftest import assert_identical
from tiercheck import Checkpointer, MemoryOptions, MemoryTierError, StagingOptions
from tiercheck.errors import InvalidArgumentError
from tiercheck.state import memory_pool, staging

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def shm() -> Iterator[Path]:
    """A directory of its own on the real /dev/shm, removed after the test."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm tmpfs on this machine")
    path = Path("/dev/shm") / f"tiercheck-test-{uuid.uuid4().hex}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB tmpfs (a container's /dev/shm is 64 MiB), mounted for the test."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(512, 1024, generator=g), "b": torch.randint(0, 1 << 30, (4096,), generator=g)}


def _pool_file(shm: Path, local: Path, rank: int = 0) -> Path:
    return memory_pool.pool_file(memory_pool.pool_dir(MemoryOptions(path=shm), os.path.abspath(local)), rank)


def test_save_and_restore_with_memory_are_bit_identical(shm: Path, tmp_path: Path) -> None:
    state = _state()
    memory = MemoryOptions(path=shm)
    with Checkpointer(state, local=tmp_path / "ckpt", memory=memory) as ck:
        ck.save(1).wait()
    restored = {k: torch.zeros_like(v) for k, v in state.items()}
    with Checkpointer(restored, local=tmp_path / "ckpt", memory=memory) as ck:
        assert ck.restore() == 1
    assert_identical(restored, state)
    assert_identical(tiercheck.load(tmp_path / "ckpt"), state)


def test_the_staged_snapshot_is_in_the_pool_file(shm: Path, tmp_path: Path) -> None:
    state = _state(1)
    local = tmp_path / "ckpt"
    opts = StagingOptions(prefault=False)
    with Checkpointer(state, local=local, memory=MemoryOptions(path=shm), staging=opts) as ck:
        ck.save(1).wait()
        capacity = ck.stats()["pool_capacity_bytes"]
    path = _pool_file(shm, local)
    assert path.stat().st_size == capacity > 0
    data = path.read_bytes()
    assert state["w"].numpy().tobytes() in data, "the snapshot save() staged is the file's bytes: no second copy"
    assert state["b"].numpy().tobytes() in data


def test_a_new_checkpointer_maps_the_same_file_again(shm: Path, tmp_path: Path) -> None:
    local = tmp_path / "ckpt"
    opts = StagingOptions(prefault=False)
    with Checkpointer(_state(), local=local, memory=MemoryOptions(path=shm), staging=opts) as ck:
        ck.save(1).wait()
    path = _pool_file(shm, local)
    before = path.stat()
    with Checkpointer(_state(2), local=local, memory=MemoryOptions(path=shm), staging=opts) as ck:
        ck.save(2).wait()
    after = path.stat()
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    assert _state(2)["w"].numpy().tobytes() in path.read_bytes()
    assert [p.name for p in path.parent.iterdir()] == ["rank-000000.pool"]


def test_without_memory_no_pool_file_is_made(shm: Path, tmp_path: Path) -> None:
    with Checkpointer(_state(), local=tmp_path / "ckpt") as ck:
        ck.save(1).wait()
    assert not shm.exists()


def test_the_pool_file_outlives_a_killed_process(shm: Path, tmp_path: Path) -> None:
    local = tmp_path / "ckpt"
    child = textwrap.dedent(f"""
        import os, signal
        import torch
        from tests.test_memory_tier import _state
        from tiercheck import Checkpointer, MemoryOptions, StagingOptions
        ck = Checkpointer(_state(3), local={str(local)!r}, memory=MemoryOptions(path={str(shm)!r}),
                          staging=StagingOptions(prefault=False))
        ck.save(1).wait()
        print(ck.stats()["pool_capacity_bytes"], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", child], cwd=ROOT, env=env, capture_output=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    capacity = int(done.stdout.split()[-1])
    path = _pool_file(shm, local)
    assert path.stat().st_size == capacity > 0
    data = path.read_bytes()
    assert _state(3)["w"].numpy().tobytes() in data, "the staged snapshot survives the process"


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
    with Checkpointer(state, local=local, memory=MemoryOptions(path=tiny_tmpfs / "tier", slots=2),
                      staging=StagingOptions(max_host_bytes=1 << 20)) as ck:  # fmt: skip
        ck.save(1).wait()  # a smaller bound fits
    assert_identical(tiercheck.load(local), state)


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
def test_on_cuda_the_pool_file_is_page_locked_at_its_size(
    shm: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = {k: v.cuda() for k, v in _state(4).items()}
    local = tmp_path / "ckpt"
    with Checkpointer(state, local=local, memory=MemoryOptions(path=shm)) as ck:
        ck.save(1).wait()
        stats = ck.stats()
    assert stats["pool_pinned"] and stats["pool_pinned_bytes"] == stats["pool_capacity_bytes"] > 0
    assert "could not page-lock" not in caplog.text, "cudaHostRegister took the shared mapping"
    assert _pool_file(shm, local).stat().st_size == stats["pool_capacity_bytes"]
    restored = {k: torch.zeros_like(v) for k, v in state.items()}
    with Checkpointer(restored, local=local, memory=MemoryOptions(path=shm)) as ck:
        assert ck.restore() == 1
    assert_identical(restored, state)


def test_prefaulting_a_mapped_pool_keeps_the_bytes_a_run_left(shm: Path) -> None:
    path = shm / "rank-000000.pool"
    first = staging.HostPool(pin_memory=False, allocate=lambda n, pin: memory_pool.mapped_empty(path, n, pin=pin))
    first.reserve(1 << 20)
    region = first.acquire(1 << 20)
    first.view(region, 1 << 20).fill_(7)
    first.release(region)
    first.drop()
    again = staging.HostPool(pin_memory=False, allocate=lambda n, pin: memory_pool.mapped_empty(path, n, pin=pin))
    again.reserve(1 << 20, touch=threading.Event())  # as the prefaulter does: pages of a new pool are touched
    assert again.touched == 1 << 20 and again.allocations == 1
    assert path.read_bytes() == bytes([7]) * (1 << 20), "a tmpfs file is resident already: touching would zero it"


def test_a_pool_file_the_tmpfs_cannot_hold_is_refused_when_reserved(tiny_tmpfs: Path) -> None:
    """The start-up check estimates; state that grew after it is caught when the file is reserved,
    before a byte is written to it, not as a SIGBUS on a page the tmpfs cannot give."""
    path = tiny_tmpfs / "tier" / "rank-000000.pool"
    with pytest.raises(MemoryTierError, match=f"cannot reserve {16 << 20:,} bytes .*{path}") as info:
        memory_pool.mapped_empty(path, 16 << 20, pin=False)
    assert info.value.errno == errno.ENOSPC
    assert not path.exists()
