"""The ``tiercheck`` command and a node's memory tier (issue 52 item 7): ``ls`` and ``verify --memory``,
``persist`` after a crash, ``gc --memory``. Real saves on a real tmpfs: a Checkpointer with the memory tier
saving to memory only (``persist_every`` large), killed with SIGKILL, as a job that will not restart."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

import tiercheck
from tests.cli import run
from tests.conftest import assert_identical
from tests.distributed import run_ranks
from tests.killed import die
from tiercheck import Checkpointer, MemoryOptions
from tiercheck.cli.memory import memory_dir
from tiercheck.format.paths import pack_file, step_dir
from tiercheck.format.steps import list_steps
from tiercheck.state import memory_pool
from tiercheck.tiers.local import LocalTier


def state_of(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 512, generator=g), "b": torch.randint(0, 1 << 30, (1024,), generator=g)}


def _save_and_die(local: str, shm: str) -> None:
    state = state_of(0)
    ck = Checkpointer(state, local=local, memory=MemoryOptions(path=shm, persist_every=100))
    for step in (1, 2, 3):
        for k, v in state_of(step).items():
            state[k].copy_(v)
        ck.save(step).wait()
    os.kill(os.getpid(), signal.SIGKILL)  # the job dies: steps 2 and 3 are in memory only


@pytest.fixture
def crashed(shm: Path, tmp_path: Path) -> Path:
    """A node's local directory whose job saved steps 1-3 to memory only and was killed."""
    local = tmp_path / "local"
    die(_save_and_die, str(local), str(shm))
    assert list_steps(LocalTier(local)).committed == []
    assert list_steps(LocalTier(memory_dir(str(shm), local))).committed == [2, 3]
    return local


def flip_bit(path: Path, at: int = 100) -> None:
    """One flipped bit in a memory step's pack (the slot itself: they are one file)."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))


def test_the_memory_directory_is_the_one_the_checkpointer_uses(tmp_path: Path) -> None:
    for local in (tmp_path / "a", Path("relative/dir")):
        assert memory_dir("/dev/shm/x", local) == memory_pool.pool_dir(MemoryOptions(path="/dev/shm/x"), os.path.abspath(local))


def test_ls_and_verify_show_and_check_the_memory_steps(crashed: Path, shm: Path) -> None:
    mem = memory_dir(str(shm), crashed)
    doc = json.loads(run("ls", str(crashed), "--memory", str(shm), "--json").stdout)
    assert doc["locations"] == [str(crashed), str(mem)]
    assert [(s["step"], list(s["tiers"])) for s in doc["steps"]] == [(2, [str(mem)]), (3, [str(mem)])]
    [note] = doc["memory"]
    assert (note["directory"], note["foreign"], note["unpersisted"]) == (str(mem), None, [2, 3])
    assert note["owner"] == note["lineage"] is not None
    table = run("ls", str(crashed), "--memory", str(shm)).stdout
    assert "holds steps 2, 3 that the directory lacks" in table and f"tiercheck persist {crashed}" in table
    assert run("verify", str(crashed), "--memory", str(shm), "--all").stdout.startswith(f"ok: steps 2, 3 intact in {mem}")
    flip_bit(mem / step_dir(3) / pack_file(0))
    bad = run("verify", str(crashed), "--memory", str(shm), "--all", check=False)
    assert bad.returncode == 1 and "intact: step 2" in bad.stdout
    assert "damaged: step 3:" in bad.stderr and "1 damaged chunk in step 3" in bad.stderr, bad.stderr


def test_ls_hints_carry_the_memory_path_and_a_memory_path_given_alone_points_to_memory(
    crashed: Path, shm: Path
) -> None:
    """The hints ``ls --memory PATH`` prints work as printed: they carry ``--memory PATH`` (without it, persist and
    gc look under the default path and find nothing). A memory tier's path, or one memory tier, given to ``ls`` as
    if a local directory, is pointed at ``--memory``."""
    mem = memory_dir(str(shm), crashed)
    table = run("ls", str(crashed), "--memory", str(shm)).stdout
    assert f"`tiercheck persist {crashed} --memory {shm}` does" in table, table
    for given, what in ((shm, "a memory tier's path"), (mem, "a node's memory tier")):
        proc = run("ls", str(given))
        assert f"{given} is {what}" in proc.stderr, proc.stderr
        assert f"`tiercheck ls DIR --memory {shm}`" in proc.stderr, proc.stderr
    gc = run("gc", str(shm), "--keep-last", "1", check=False)
    assert gc.returncode == 1 and f"`tiercheck gc DIR --memory {shm}`" in gc.stderr, gc.stderr
    assert list_steps(LocalTier(mem)).committed == [2, 3]
    shutil.rmtree(crashed)  # a new run in a new directory at the same path: another lineage
    with Checkpointer(state_of(7), local=crashed) as ck:
        ck.save(1).wait()
    ls = run("ls", str(crashed), "--memory", str(shm))
    assert f"`tiercheck gc {crashed} --memory {shm}`" in ls.stderr, ls.stderr


def test_ls_calls_a_step_committed_in_memory_and_partial_on_disk_persisting(crashed: Path, shm: Path) -> None:
    """Memory to disk is persisting (draining is disk to the remote tier): a persist cut short leaves the step's
    files on the local directory without its COMMIT, which it writes last."""
    mem = memory_dir(str(shm), crashed)
    shutil.copytree(mem / step_dir(3), crashed / step_dir(3))
    (crashed / step_dir(3) / "COMMIT").unlink()
    doc = json.loads(run("ls", str(crashed), "--memory", str(shm), "--json").stdout)
    [row] = [s for s in doc["steps"] if s["step"] == 3]
    assert row["tiers"][str(crashed)]["status"] == "persisting", row
    assert "persisting" in run("ls", str(crashed), "--memory", str(shm)).stdout


def test_persist_after_a_crash_leaves_the_steps_on_the_local_directory_and_the_remote(
    crashed: Path, shm: Path, tmp_path: Path
) -> None:
    remote = tmp_path / "remote"
    done = run("persist", str(crashed), "--memory", str(shm), "--remote", f"file://{remote}").stdout
    assert f"persisted step 2 to {crashed}" in done and f"persisted step 3 to {crashed}" in done
    assert "step 3 -> " in done and "committed" in done
    assert list_steps(LocalTier(crashed)).committed == [2, 3]
    assert list_steps(LocalTier(remote)).committed == [2, 3]
    assert_identical(tiercheck.load(crashed, step=3), state_of(3))
    assert_identical(tiercheck.load(remote, step=2), state_of(2))
    files = {p: p.stat().st_mtime_ns for p in [*crashed.rglob("step-*/**/*"), *remote.rglob("*")] if p.is_file()}
    again = run("persist", str(crashed), "--memory", str(shm), "--remote", f"file://{remote}").stdout
    assert "step 3: already on" in again and "nothing to drain" in again, again
    assert {p: p.stat().st_mtime_ns for p in files} == files, "run again, it writes no step file"
    restored = state_of(9)
    with Checkpointer(restored, local=crashed, memory=MemoryOptions(path=shm, persist_every=100)) as ck:
        assert ck.restore() == 3
    assert_identical(restored, state_of(3))


def test_persist_refuses_while_a_job_writes_the_directory(crashed: Path, shm: Path) -> None:
    with Checkpointer(state_of(0), local=crashed):  # a job holds the directory's lock
        proc = run("persist", str(crashed), "--memory", str(shm), check=False)
    assert proc.returncode == 1 and "in use by another tiercheck writer" in proc.stderr, proc.stderr
    assert list_steps(LocalTier(crashed)).committed == []


def test_persist_refuses_another_lineages_memory_and_gc_removes_it(crashed: Path, shm: Path) -> None:
    shutil.rmtree(crashed)  # a new job in a new directory at the same path: another lineage
    with Checkpointer(state_of(7), local=crashed) as ck:
        ck.save(1).wait()
    proc = run("persist", str(crashed), "--memory", str(shm), check=False)
    assert proc.returncode == 1 and "is not" in proc.stderr and "nothing persisted" in proc.stderr, proc.stderr
    assert list_steps(LocalTier(crashed)).committed == [1]
    ls = run("ls", str(crashed), "--memory", str(shm))
    assert "is another lineage's" in ls.stderr and "never restored" in ls.stderr
    gone = run("gc", str(crashed), "--memory", str(shm)).stdout
    assert "removed the memory tier" in gone and "another lineage's" in gone
    assert not memory_dir(str(shm), crashed).exists()
    assert list_steps(LocalTier(crashed)).committed == [1], "the local directory is untouched"


def test_gc_keeps_memory_a_job_needs_and_removes_it_once_persisted(
    crashed: Path, shm: Path, tmp_path: Path
) -> None:
    mem = memory_dir(str(shm), crashed)
    kept = run("gc", str(crashed), "--memory", str(shm)).stdout
    assert "kept the memory tier" in kept and "steps 2, 3 not on the local directory" in kept
    assert f"(`tiercheck persist {crashed} --memory {shm}` copies them)" in kept, kept  # as it runs, path and all
    run("persist", str(crashed), "--memory", str(shm))
    with Checkpointer(state_of(0), local=crashed):
        assert "a job is running there" in run("gc", str(crashed), "--memory", str(shm)).stdout
    other = shm / "0123456789abcdef"  # another directory's memory, not given: reported, not judged
    other.mkdir()
    dry = run("gc", str(crashed), "--memory", str(shm), "--dry-run")
    assert "would remove the memory tier" in dry.stdout and mem.is_dir()
    assert f"not judged: the memory tier {other}" in dry.stderr and f"tiercheck gc DIR --memory {shm}" in dry.stderr
    assert "removed the memory tier" in run("gc", str(crashed), "--memory", str(shm)).stdout
    assert not mem.exists() and other.is_dir()
    assert list_steps(LocalTier(crashed)).committed == [2, 3]


def test_persist_reclaim_frees_the_memory_in_one_command(crashed: Path, shm: Path) -> None:
    out = run("persist", str(crashed), "--memory", str(shm), "--reclaim").stdout
    assert "persisted step 3" in out and "removed the memory tier" in out
    assert not memory_dir(str(shm), crashed).exists()
    assert_identical(tiercheck.load(crashed, step=3), state_of(3))


def test_persist_copies_no_damaged_step_and_keeps_it_in_memory(crashed: Path, shm: Path) -> None:
    mem = memory_dir(str(shm), crashed)
    flip_bit(mem / step_dir(3) / pack_file(0))
    proc = run("persist", str(crashed), "--memory", str(shm), "--reclaim", check=False)
    assert proc.returncode == 1, proc.stderr
    assert "persisted step 2" in proc.stdout and "step 3: not persisted" in proc.stderr, proc.stderr
    assert "could not persist step 3" in proc.stderr
    assert list_steps(LocalTier(crashed)).committed == [2], "the damaged step never commits on the local directory"
    assert list_steps(LocalTier(mem)).committed == [2, 3], "nothing reclaimed while a step could not be persisted"
    assert_identical(tiercheck.load(crashed, step=2), state_of(2))


def _node_crashes(rank: int, world: int, root: str) -> None:
    """One rank of two, each a node of its own (its own local directory and memory path), killed after
    saving steps 1 and 2 to memory only."""
    state = state_of(0)
    memory = MemoryOptions(path=Path(root) / f"shm{rank}", persist_every=100)
    ck = Checkpointer(state, local=Path(root) / f"node{rank}", memory=memory)
    for step in (1, 2):
        for k, v in state_of(step).items():
            state[k].copy_(v)
        ck.save(step).wait()
    os.kill(os.getpid(), signal.SIGKILL)


def test_persist_on_each_node_commits_the_step_on_the_remote_once_both_have_run(shm: Path, tmp_path: Path) -> None:
    shm.mkdir()
    outcomes = run_ranks(_node_crashes, 2, str(shm), check=False)
    assert [o.exitcode for o in outcomes] == [-signal.SIGKILL] * 2, outcomes
    remote = f"file://{tmp_path / 'remote'}"
    first = run("persist", str(shm / "node0"), "--memory", str(shm / "shm0"), "--remote", remote).stdout
    assert "persisted step 2" in first and "waiting for the other nodes' files" in first, first
    assert list_steps(LocalTier(shm / "node0")).committed == [1, 2]
    assert list_steps(LocalTier(tmp_path / "remote")).committed == []
    second = run("persist", str(shm / "node1"), "--memory", str(shm / "shm1"), "--remote", remote).stdout
    assert "step 2 -> " in second and "; committed" in second, second
    assert list_steps(LocalTier(tmp_path / "remote")).committed == [1, 2]
    assert_identical(tiercheck.load(remote, step=2), state_of(2))


def test_memory_bad_input_is_one_line(shm: Path, tmp_path: Path) -> None:
    local = tmp_path / "local"
    local.mkdir()
    proc = run("verify", str(local), "--memory", str(shm), check=False)
    assert proc.returncode == 1 and "has no memory tier under" in proc.stderr
    proc = run("ls", f"file://{local}", "--memory", str(shm), check=False)
    assert proc.returncode == 2 and "--memory goes with a node's local directory" in proc.stderr, proc.stderr
    proc = run("gc", str(local), check=False)
    assert proc.returncode == 2 and "--memory PATH" in proc.stderr
    proc = run("persist", str(tmp_path / "never"), "--memory", str(shm), check=False)
    assert proc.returncode == 1 and "no such directory" in proc.stderr
    done = run("persist", str(local), "--memory", str(shm))
    assert "nothing to persist" in done.stdout
    assert not shm.exists(), "nothing is made on the tmpfs"
