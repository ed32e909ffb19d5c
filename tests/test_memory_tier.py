"""The memory tier, on a real tmpfs, with real processes killed: saves committed to memory, a restart
from memory, the fallbacks, its lineage, and the memory bound checked at start (invariant 13: never a
SIGBUS later, never a torn slot restored)."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tests.cli import run
from tests.conftest import assert_identical
from tests.distributed import run_ranks
from tests.killed import die
from tests.ondisk import chunk_span, chunks_of, flip_chunk_byte
from tiercheck import Checkpointer, MemoryOptions, ReplicationOptions, StagingOptions
from tiercheck.format.paths import pack_file, replica_marker, step_dir
from tiercheck.format.steps import list_steps
from tiercheck.state import memory_pool
from tiercheck.tiers.local import LocalTier


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(512, 1024, generator=g), "b": torch.randint(0, 1 << 30, (4096,), generator=g)}


def _memory_dir(shm: Path, local: Path) -> Path:
    return memory_pool.pool_dir(MemoryOptions(path=shm), os.path.abspath(local))


def _save(local: str, shm: str, every: int, steps: list[int]) -> tuple[dict[str, torch.Tensor], Checkpointer]:
    """A job that saved ``steps`` (the state ``_state(step)`` at each) with the memory tier."""
    state = _state(0)
    memory = MemoryOptions(path=shm, persist_every=every)
    ck = Checkpointer(state, local=local, memory=memory, staging=StagingOptions(mode="eager"))
    for step in steps:
        for k, v in _state(step).items():
            state[k].copy_(v)
        ck.save(step).wait()
    return state, ck


def _save_and_die(local: str, shm: str, every: int, steps: list[int]) -> None:
    _save(local, shm, every, steps)
    os.kill(os.getpid(), signal.SIGKILL)


def _die_while_staging_step_3(local: str, shm: str, announce: Connection) -> None:
    """Saves steps 1 and 2 to memory, then announces once part of step 3 is in its slot, and hangs there."""
    from tiercheck.save.pipeline import Pipeline

    state, ck = _save(local, shm, 100, [1, 2])
    copy = Pipeline._copy_run

    def copy_then_hang(self: Pipeline, job: Any, run: Any, *, lazy: bool) -> Any:
        copy(self, job, run, lazy=lazy)
        announce.send("staging")  # killed here
        threading.Event().wait()

    Pipeline._copy_run = copy_then_hang  # type: ignore[method-assign]
    for k, v in _state(3).items():
        state[k].copy_(v)
    ck.save(3)


def test_save_and_restore_with_memory_are_bit_identical(shm: Path, tmp_path: Path) -> None:
    state = _state()
    memory = MemoryOptions(path=shm, keep_at_close=True)  # kept: the next job reads memory, not the disk
    with Checkpointer(state, local=tmp_path / "ckpt", memory=memory) as ck:
        ck.save(1).wait()
    restored = {k: torch.zeros_like(v) for k, v in state.items()}
    with Checkpointer(restored, local=tmp_path / "ckpt", memory=memory) as ck:
        assert ck.restore() == 1
        assert ck.stats()["restore_from_memory"] == 1, "read from the memory tier"
    assert_identical(restored, state)
    assert_identical(tiercheck.load(tmp_path / "ckpt"), state)


def test_a_save_to_memory_only_is_committed_there_and_its_pack_is_the_slot(shm: Path, tmp_path: Path) -> None:
    state, local = _state(1), tmp_path / "ckpt"
    with Checkpointer(state, local=local, memory=MemoryOptions(path=shm, persist_every=2)) as ck:
        h1, h2 = ck.save(1), ck.save(2)
        h1.wait(), h2.wait()
        assert (h1.persisted.result(), h1.drained.result(), h1.replicated.result()) == (False, False, False)
        assert h2.persisted.result() is True
        assert ck.steps() == [2], "a save to memory only writes nothing to the local directory"
        held = ck.stats()["memory_held_bytes"]
        pack = _memory_dir(shm, local) / step_dir(1) / pack_file(0)
        slot = os.stat(pack)
        assert slot.st_nlink == 2, "the memory step's pack is a link to a slot: no second copy"
        assert (slot.st_ino, slot.st_size) in {(p.stat().st_ino, p.stat().st_size) for p in (pack.parents[2] / "slots").iterdir()}
        assert held == 2 * slot.st_size > 0, "two slots, each the pack's size"
        assert state["w"].numpy().tobytes() in pack.read_bytes()
        assert list_steps(LocalTier(_memory_dir(shm, local))).committed == [1, 2]


def test_slots_are_reused_and_the_newest_memory_step_stays(shm: Path, tmp_path: Path) -> None:
    local = tmp_path / "ckpt"
    with Checkpointer(_state(), local=local, memory=MemoryOptions(path=shm, persist_every=100)) as ck:
        inodes = []
        for step in range(1, 6):
            ck.save(step).wait()
            inodes.append({p.stat().st_ino for p in (_memory_dir(shm, local) / "slots").iterdir()})
        assert list_steps(LocalTier(_memory_dir(shm, local))).committed == [4, 5]
    assert all(i == inodes[-1] for i in inodes[1:]) and len(inodes[-1]) == 2, "two slot files, mapped once"


def test_without_memory_nothing_is_made_on_the_tmpfs(shm: Path, tmp_path: Path) -> None:
    with Checkpointer(_state(), local=tmp_path / "ckpt") as ck:
        ck.save(1).wait()
    assert not shm.exists()


def test_a_killed_process_restarts_from_memory_bit_identical(shm: Path, tmp_path: Path) -> None:
    local = tmp_path / "ckpt"
    die(_save_and_die, str(local), str(shm), 4, [1, 2, 3])
    assert not list_steps(LocalTier(local)).committed, "every save went to memory only"
    restored = _state(9)
    with Checkpointer(restored, local=local, memory=MemoryOptions(path=shm, persist_every=4)) as ck:
        assert ck.restore() == 3
        assert_identical(restored, _state(3))
        assert ck.stats()["memory_persist"] in ("pending", "done"), "persisted beside training, not before restore()"
        ck.wait()
        assert ck.steps() == [3], "the step the crash left in memory only is persisted by the run that restored it"
        assert (ck.stats()["memory_persist"], ck.stats()["memory_persisted_step"]) == ("done", 3)
    assert_identical(tiercheck.load(local, step=3), _state(3))


def test_a_process_killed_while_staging_restarts_from_the_step_before_never_the_torn_slot(
    shm: Path, tmp_path: Path
) -> None:
    local = tmp_path / "ckpt"
    die(_die_while_staging_step_3, str(local), str(shm), announces=True)
    memory = _memory_dir(shm, local)
    assert list_steps(LocalTier(memory)).committed == [2], "step 1's slot was withdrawn before step 3 staged into it"
    restored = _state(9)
    with Checkpointer(restored, local=local, memory=MemoryOptions(path=shm, persist_every=100)) as ck:
        assert ck.restore() == 2
    assert_identical(restored, _state(2))


def test_with_the_memory_gone_a_restart_reads_the_local_directory(shm: Path, tmp_path: Path) -> None:
    local = tmp_path / "ckpt"
    die(_save_and_die, str(local), str(shm), 1, [1, 2])
    shutil.rmtree(shm)  # the node rebooted, or the tmpfs was emptied
    restored = _state(9)
    with Checkpointer(restored, local=local, memory=MemoryOptions(path=shm)) as ck:
        assert ck.restore() == 2
    assert_identical(restored, _state(2))


@pytest.mark.parametrize("in_place", [True, False])
def test_a_flipped_byte_in_a_memory_chunk_reads_that_chunk_from_the_local_directory(
    shm: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, in_place: bool
) -> None:
    local = tmp_path / "ckpt"
    die(_save_and_die, str(local), str(shm), 1, [1, 2])  # step 2 in memory and on the local directory
    memory = _memory_dir(shm, local) / step_dir(2)
    assert chunks_of(memory, "b"), "the state has another chunk, read from memory"
    flip_chunk_byte(memory, "w", "c.0.0", 5)  # one flipped bit in the slot itself
    restored = _state(9)
    with Checkpointer(restored, local=local, memory=MemoryOptions(path=shm)) as ck:
        assert ck.restore(in_place=in_place) == 2
        got = ck.stats()
    assert_identical(restored, _state(2))
    assert got["restore_from_memory"] == 1, "the step came from memory"
    assert (got["restore_fallbacks"], got["restore_local_reads"], got["restore_remote_reads"]) == (1, 1, 0), (
        "that chunk alone was read from the local directory"
    )
    assert f"reading it from {LocalTier(local).url} instead" in caplog.text
    assert "cannot restore step 2 from the memory tier" not in caplog.text


def _another_save_of_step_3(local: Path, elsewhere: Path) -> None:
    """The local directory gets step 3 of another save (another job's, state ``_state(33)``)."""
    with Checkpointer(_state(33), local=elsewhere) as ck:
        ck.save(3).wait()
    shutil.copytree(elsewhere / step_dir(3), local / step_dir(3))


def test_every_memory_step_damaged_and_no_other_tier_is_an_error_never_a_fresh_start(
    shm: Path, tmp_path: Path
) -> None:
    """The job start reads in place: memory's steps 3 and 2 both damaged, the local directory empty.
    The restore says the state was read into, where it once returned None (a fresh start) over it."""
    local = tmp_path / "ckpt"
    die(_save_and_die, str(local), str(shm), 100, [1, 2, 3])  # memory only: slots hold steps 2 and 3
    assert list_steps(LocalTier(local)).committed == []
    for step in (2, 3):
        flip_chunk_byte(_memory_dir(shm, local) / step_dir(step), "w", "c.0.0", 5)
    memory = MemoryOptions(path=shm, persist_every=100)
    with (
        Checkpointer(_state(9), local=local, memory=memory) as ck,
        pytest.raises(tiercheck.PartlyRestoredError, match="checksum mismatch"),
    ):
        ck.restore()


@pytest.mark.parametrize("copy", ["none", "local", "remote", "another save"])
def test_a_damaged_chunk_of_a_memory_only_step_is_read_from_a_copy_of_the_same_save_or_the_restore_says_so(
    shm: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, copy: str
) -> None:
    """persist_every=2: step 3 is in memory only (the local directory has step 2). A chunk of it damaged
    in memory is read from a copy of the same save where one exists (``tiercheck persist`` made one on
    the local directory and the remote; "remote": the local one lost since), never an older step. Where
    none does, the restore falls back as before the chunk fallback, and says so; a copy of another save
    of step 3 is never read for the chunk (the step restored is all of that save)."""
    local, remote = tmp_path / "ckpt", tmp_path / "remote"
    die(_save_and_die, str(local), str(shm), 2, [1, 2, 3])
    assert list_steps(LocalTier(local)).committed == [2]
    if copy in ("local", "remote"):
        run("persist", str(local), "--memory", str(shm), "--remote", f"file://{remote}")
        assert list_steps(LocalTier(remote)).committed[-1] == 3
    if copy == "remote":
        shutil.rmtree(local / step_dir(3))
    if copy == "another save":
        _another_save_of_step_3(local, tmp_path / "elsewhere")
    flip_chunk_byte(_memory_dir(shm, local) / step_dir(3), "w", "c.0.0", 5)
    restored = _state(9)
    memory = MemoryOptions(path=shm, persist_every=2)
    with Checkpointer(restored, local=local, memory=memory, remote=f"file://{remote}" if copy != "none" else None) as ck:
        step = ck.restore()
        got = ck.stats()
    if copy in ("local", "remote"):
        assert step == 3
        assert_identical(restored, _state(3))
        assert (got["restore_from_memory"], got["restore_fallbacks"]) == (1, 1)
        assert got["restore_local_reads"] == int(copy == "local"), "the damaged chunk's tier: local, else the remote"
        assert f"reading it from {local if copy == 'local' else remote} instead" in caplog.text
        assert list_steps(LocalTier(local)).committed[-1] == 3, "persisted, the damaged chunk from the remote"
        assert_identical(tiercheck.load(local, step=3), _state(3))
        assert "cannot restore step 3 from the memory tier" not in caplog.text
        return
    if copy == "another save":  # memory's step 3 is not the save the local directory holds: never tried
        assert "holds another save of step 3" in caplog.text
        assert "cannot restore step 3 from the memory tier" not in caplog.text
    else:
        said = next(m for r in caplog.records if "cannot restore step 3 from the memory tier" in (m := r.getMessage()))
        assert "no other tier holds that save of it" in said
        assert "reading the next older step in memory, or the other tiers" in said
    if copy == "none":
        assert step == 2, "the newest step no tier holds whole is lost, and the restore says so"
        assert_identical(restored, _state(2))
        assert got["restore_from_memory"] == 1, "step 2, whole in memory, as new as the local directory's"
    else:
        assert step == 3
        assert_identical(restored, _state(33)), "all of the other save, not one chunk of it among memory's"
        assert got["restore_from_memory"] == 0


def test_another_lineages_memory_is_never_restored(
    shm: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = tmp_path / "ckpt"
    die(_save_and_die, str(local), str(shm), 100, [1])
    shutil.rmtree(local)  # a new job in a new directory at the same path: another lineage
    with Checkpointer(_state(9), local=local, memory=MemoryOptions(path=shm, persist_every=100)) as ck:
        assert ck.restore() is None
    assert "not of this directory's lineage" in caplog.text
    assert not list_steps(LocalTier(_memory_dir(shm, local))).committed, "withdrawn"


def test_an_owner_file_that_cannot_be_read_names_no_lineage(
    shm: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = tmp_path / "ckpt"
    die(_save_and_die, str(local), str(shm), 100, [1])
    owner = _memory_dir(shm, local) / "OWNER"
    owner.unlink()
    owner.mkdir()  # hostile or damaged: read as a file, it fails with IsADirectoryError
    state = _state(9)
    with Checkpointer(state, local=local, memory=MemoryOptions(path=shm, persist_every=100)) as ck:
        assert ck.restore() is None
        ck.save(2).wait()  # names this run's lineage there, in place of what was in the way
    assert "OWNER unreadable" in caplog.text and "not restored" in caplog.text
    assert_identical(tiercheck.load(local, step=2), state)


@pytest.mark.parametrize("keep", [False, True])
def test_a_clean_close_persists_the_newest_memory_step_and_gives_the_memory_back(
    shm: Path, tmp_path: Path, keep: bool
) -> None:
    local = tmp_path / "ckpt"
    state = _state(5)
    memory = MemoryOptions(path=shm, persist_every=100, keep_at_close=keep)
    with Checkpointer(state, local=local, memory=memory) as ck:
        ck.save(1).wait()
        ck.save(2).wait()
        assert ck.steps() == []
    assert list_steps(LocalTier(local)).committed == [2]
    assert_identical(tiercheck.load(local, step=2), state)
    held = _memory_dir(shm, local)
    if keep:
        assert list_steps(LocalTier(held)).committed == [1, 2]
        assert len(list((held / "slots").iterdir())) == 2
    else:
        assert not held.exists(), "a clean close leaves no empty slots/ or memory directory behind"
    if keep:  # the next job on this node restarts from memory
        shutil.rmtree(local / step_dir(2))
        restored = _state(9)
        with Checkpointer(restored, local=local, memory=memory) as ck:
            assert ck.restore() == 2
        assert_identical(restored, state)


def _two_ranks(
    rank: int, world: int, root: str, phase: str, one_node: bool = False, replicas: int = 0
) -> int | None:
    """One rank of two: each a node of its own (its own local directory and tmpfs directory), or
    with ``one_node`` both on one node (one local directory, one memory directory, a slot file each);
    with ``replicas``, each node's memory steps copied to the other's memory."""
    state = _state(0)
    node = "" if one_node else rank
    memory = MemoryOptions(path=Path(root) / f"shm{node}", persist_every=100, keep_at_close=True)
    peers = ReplicationOptions(replicas=replicas) if replicas else None
    with Checkpointer(state, local=Path(root) / f"node{node}", memory=memory, replication=peers) as ck:
        if phase == "save":
            for step in (1, 2, 3):  # the third reuses the first's slot
                for k, v in _state(step).items():
                    state[k].copy_(v)
                ck.save(step).wait()
            return None
        step = ck.restore()
        assert_identical(state, _state(3))
        return step


def test_two_nodes_restart_from_their_memory_and_fall_back_when_one_lost_it(shm: Path, tmp_path: Path) -> None:
    shm.mkdir()
    root = shm  # the local directories too: the test's own, removed after it
    run_ranks(_two_ranks, 2, str(root), "save")
    for rank in (0, 1):  # the clean close persisted step 2; only memory holds it now
        shutil.rmtree(root / f"node{rank}" / step_dir(3))
        assert list_steps(LocalTier(_memory_dir(root / f"shm{rank}", root / f"node{rank}"))).committed == [2, 3]
    assert run_ranks(_two_ranks, 2, str(root), "restore") == [3, 3]
    for rank in (0, 1):
        assert list_steps(LocalTier(root / f"node{rank}")).committed == [3], "persisted again by the restore"
    shutil.rmtree(root / "shm1")  # node 1 lost its memory: the step is not whole in memory, the local tier has it
    assert run_ranks(_two_ranks, 2, str(root), "restore") == [3, 3]


def test_ranks_of_one_node_share_its_memory_directory_and_restart_from_it(shm: Path) -> None:
    shm.mkdir()
    run_ranks(_two_ranks, 2, str(shm), "save", True)
    memory = _memory_dir(shm / "shm", shm / "node")
    assert list_steps(LocalTier(memory)).committed == [2, 3]
    assert sorted(p.name for p in (memory / step_dir(3) / "packs").iterdir()) == [pack_file(0)[6:], pack_file(1)[6:]]
    assert len(list((memory / "slots").iterdir())) == 4, "two slots a rank"
    shutil.rmtree(shm / "node" / step_dir(3))  # persisted at close; only memory holds it now
    assert run_ranks(_two_ranks, 2, str(shm), "restore", True) == [3, 3]


def test_a_node_that_lost_its_memory_restores_from_its_peers_memory(shm: Path) -> None:
    shm.mkdir()
    run_ranks(_two_ranks, 2, str(shm), "save", False, 1)
    for rank, other in ((0, 1), (1, 0)):  # each node's memory holds its own files and its peer's copy
        step = _memory_dir(shm / f"shm{rank}", shm / f"node{rank}") / step_dir(3)
        assert (step / replica_marker(other)).exists() and (step / pack_file(other)).exists()
    shutil.rmtree(shm / "shm1")  # node 1 was replaced: its tmpfs is empty
    for rank in (0, 1):
        shutil.rmtree(shm / f"node{rank}" / step_dir(3))  # persisted at close: only memory holds it now
    assert run_ranks(_two_ranks, 2, str(shm), "restore", False, 1) == [3, 3]


def _restore_counting(
    rank: int, world: int, root: str, replicas: int = 0, expect: int = 3
) -> tuple[int | None, int, int, int]:
    """``_two_ranks``' restore, each rank a node: the step (its state ``_state(expect)``), and where its
    chunks came from."""
    state = _state(0)
    memory = MemoryOptions(path=Path(root) / f"shm{rank}", persist_every=100, keep_at_close=True)
    peers = ReplicationOptions(replicas=replicas) if replicas else None
    with Checkpointer(state, local=Path(root) / f"node{rank}", memory=memory, replication=peers) as ck:
        step = ck.restore()
        assert_identical(state, _state(expect))
        got = ck.stats()
    return step, got["restore_from_memory"], got["restore_local_reads"], got["restore_copies_passed_over"]


def test_two_nodes_read_a_chunk_damaged_in_one_nodes_memory_from_that_nodes_local_directory(
    shm: Path, tmp_path: Path
) -> None:
    shm.mkdir()
    root = shm
    run_ranks(_two_ranks, 2, str(root), "save")  # the clean close persisted step 3 to both local directories
    steps = [_memory_dir(root / f"shm{r}", root / f"node{r}") / step_dir(3) for r in (0, 1)]
    holder = next(r for r, step in enumerate(steps) if "c.0.0" in chunks_of(step, "w"))
    flip_chunk_byte(steps[holder], "w", "c.0.0", 5)
    counts = run_ranks(_restore_counting, 2, str(root))
    assert [c[:2] for c in counts] == [(3, 1), (3, 1)], "both ranks restored step 3 from memory"
    assert [c[2] for c in counts] == [int(r == holder) for r in (0, 1)], (
        "the damaged chunk alone, read from its node's local directory by the rank reading it"
    )
    assert [c[3] for c in counts] == [0, 0], "the node's copy in memory was not passed over"


def test_a_chunk_damaged_in_a_nodes_memory_and_nowhere_else_on_it_is_read_from_its_peers_memory(
    shm: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Per chunk, a peer's memory before any older step: the step is in memory only (its local copies
    gone), and the chunk's writer's node holds it damaged, its peer a whole replica. The writer's node
    passes over its copy of that rank's files, and its peer reads and sends them: step 3, bit-identical."""
    shm.mkdir()
    run_ranks(_two_ranks, 2, str(shm), "save", False, 1)
    steps = [_memory_dir(shm / f"shm{r}", shm / f"node{r}") / step_dir(3) for r in (0, 1)]
    writer = int(chunk_span(steps[0], "w", "c.0.0")[0].stem.split("-")[1])  # both memories hold its files
    flip_chunk_byte(steps[writer], "w", "c.0.0", 5)  # its own node's copy; the peer's replica stays whole
    for rank in (0, 1):
        shutil.rmtree(shm / f"node{rank}" / step_dir(3))  # persisted at close: only memory holds it now
    counts = run_ranks(_restore_counting, 2, str(shm), 1)
    assert [c[:2] for c in counts] == [(3, 1), (3, 1)], "step 3 from memory, on both ranks, not step 2"
    assert [c[3] for c in counts] == [int(r == writer) for r in (0, 1)], "the writer's node passed its copy over"
    assert [c[2] for c in counts] == [0, 0], "nothing from a local directory: it holds no step 3"


@pytest.mark.parametrize("replicas", [0, 1])
def test_a_chunk_damaged_in_every_nodes_memory_restores_the_step_before(shm: Path, replicas: int) -> None:
    """No whole copy of a chunk of step 3 in any node's memory (the writer's damaged, and the peer's
    replica damaged too, or none): step 2, from memory, never step 3 with a bad chunk."""
    shm.mkdir()
    run_ranks(_two_ranks, 2, str(shm), "save", False, replicas)
    steps = [_memory_dir(shm / f"shm{r}", shm / f"node{r}") / step_dir(3) for r in (0, 1)]
    for step in steps:
        if (step / pack_file(int(chunk_span(steps[0], "w", "c.0.0")[0].stem.split("-")[1]))).exists():
            flip_chunk_byte(step, "w", "c.0.0", 5)
    for rank in (0, 1):
        shutil.rmtree(shm / f"node{rank}" / step_dir(3))
    counts = run_ranks(_restore_counting, 2, str(shm), replicas, 2)
    assert [c[:2] for c in counts] == [(2, 1), (2, 1)], "step 2, from memory"
