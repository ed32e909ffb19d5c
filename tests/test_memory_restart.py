"""A restart at memory speed (issue 64 E.9, invariant 15): a step restored from the memory tier is persisted
to the local directory beside training, not before ``restore()`` returns. What the tests hold to: the state
is restored and ``stats()`` says the persist is pending or done; ``wait()`` (or ``close()``) leaves the step
committed on the local directory, bit-identical; saves of later steps go on while it runs and never reuse
its memory; a kill while it runs leaves the memory step restorable; its failures are still said."""

from __future__ import annotations

import shutil
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

import tiercheck
from tests.conftest import assert_identical, tiercheck_said
from tests.distributed import run_ranks
from tests.killed import die
from tests.test_memory_tier import _memory_dir, _save_and_die, _state, _two_ranks
from tiercheck import Checkpointer, MemoryOptions, ReplicationOptions
from tiercheck.errors import StepExistsError
from tiercheck.format.paths import step_dir
from tiercheck.format.steps import list_steps
from tiercheck.tiers.local import LocalTier


def test_a_restore_from_memory_returns_and_the_step_is_persisted_beside_training(shm: Path, tmp_path: Path) -> None:
    local = tmp_path / "ckpt"
    die(_save_and_die, str(local), str(shm), 100, [1, 2, 3])
    assert not list_steps(LocalTier(local)).committed, "in memory only"
    restored = _state(9)
    with Checkpointer(restored, local=local, memory=MemoryOptions(path=shm, persist_every=100)) as ck:
        assert ck.restore() == 3
        assert_identical(restored, _state(3))
        got = ck.stats()
        assert got["restore_from_memory"] == 1
        assert got["memory_persist"] in ("pending", "done"), got
        ck.wait()  # the persist, not a sleep
        got = ck.stats()
        assert (got["memory_persist"], got["memory_persisted_step"]) == ("done", 3), got
        assert got["restore_persist_s"] > 0
        assert ck.steps() == [3], "committed on the local directory once the persist is done"
    assert_identical(tiercheck.load(local, step=3), _state(3))


def test_saves_of_later_steps_during_the_persist_leave_the_persisted_step_whole(shm: Path, tmp_path: Path) -> None:
    """Two slots: step 4 stages into the slot step 3's restore left free; step 5 needs step 3's slot, and
    waits for its persist (``MemorySlots.before_reuse``) instead of overwriting what the copy reads.
    A save of step 3 itself is refused (it is committed) while the copy runs and after."""
    local = tmp_path / "ckpt"
    die(_save_and_die, str(local), str(shm), 100, [1, 2, 3])
    state = _state(9)
    with Checkpointer(state, local=local, memory=MemoryOptions(path=shm, persist_every=100)) as ck:
        assert ck.restore() == 3
        with pytest.raises(StepExistsError):
            ck.save(3)
        for step in (4, 5, 6):
            for k, v in _state(step).items():
                state[k].copy_(v)
            ck.save(step).wait()
        ck.wait()
        assert ck.steps() == [3]
        assert list_steps(LocalTier(_memory_dir(shm, local))).committed == [5, 6]
    assert_identical(tiercheck.load(local, step=3), _state(3))
    assert_identical(tiercheck.load(local, step=6), _state(6)), "the clean close persisted the newest"


def _restore_then_die_while_persisting(local: str, shm: str, returned: str, announce: Connection) -> None:
    """Restores step 3 from memory with the persist's commit held (its files copied, no commit marker):
    says so once ``restore()`` has returned, then hangs there and is killed. Under a restore that
    persisted before returning, it never returns, and never says so."""
    from tiercheck.tiering import transfer

    held = threading.Event()

    def commit_never(*args: Any, **kwargs: Any) -> None:
        held.set()
        threading.Event().wait()

    transfer.commit_step = commit_never  # type: ignore[assignment]
    ck = Checkpointer(_state(9), local=local, memory=MemoryOptions(path=shm, persist_every=100))
    assert ck.restore() == 3
    held.wait()  # the copy reached its commit, beside this thread
    Path(returned).write_text(str(ck.stats()["memory_persist"]))
    announce.send("persisting")  # killed here
    threading.Event().wait()


def test_a_kill_during_the_background_persist_leaves_the_memory_step_restorable(shm: Path, tmp_path: Path) -> None:
    local, returned = tmp_path / "ckpt", tmp_path / "returned"
    die(_save_and_die, str(local), str(shm), 100, [1, 2, 3])
    die(_restore_then_die_while_persisting, str(local), str(shm), str(returned), announces=True, timeout=120)
    assert returned.exists(), "restore() returned while its step was still being persisted"
    assert returned.read_text() == "pending"
    assert (local / step_dir(3)).is_dir() and not list_steps(LocalTier(local)).committed, "killed before its commit"
    assert list_steps(LocalTier(_memory_dir(shm, local))).committed == [2, 3]
    restored = _state(0)
    with Checkpointer(restored, local=local, memory=MemoryOptions(path=shm, persist_every=100)) as ck:
        assert ck.restore() == 3
        assert ck.stats()["restore_from_memory"] == 1
        ck.wait()
        assert ck.steps() == [3]
    assert_identical(restored, _state(3))
    assert_identical(tiercheck.load(local, step=3), _state(3))


def _restore_and_say(rank: int, world: int, root: str) -> list[str]:
    """``_two_ranks``' restore with a peer copy each, the tiercheck warnings this rank logged until closed."""
    state = _state(0)
    memory = MemoryOptions(path=Path(root) / f"shm{rank}", persist_every=100, keep_at_close=True)
    with tiercheck_said() as said, Checkpointer(state, local=Path(root) / f"node{rank}", memory=memory,
                      replication=ReplicationOptions(replicas=1)) as ck:  # fmt: skip
        assert ck.restore() == 3
        assert_identical(state, _state(3))
    return said


def test_a_replaced_node_persists_from_the_background_once_its_peers_gave_its_files_back(shm: Path) -> None:
    """Node 1 was replaced (its tmpfs empty): it restores step 3 from node 0's memory, and its persist,
    in the background, waits for node 0 to give its files back to its memory, then persists them
    (``tiering.whole_again``; tests/test_replace_whole.py for the rest, and for a peer that dies)."""
    shm.mkdir()
    run_ranks(_two_ranks, 2, str(shm), "save", False, 1)
    shutil.rmtree(shm / "shm1")
    for rank in (0, 1):
        shutil.rmtree(shm / f"node{rank}" / step_dir(3))  # persisted at close: only memory holds it now
    said = run_ranks(_restore_and_say, 2, str(shm))
    assert said == [[], []], said
    for rank in (0, 1):
        assert list_steps(LocalTier(shm / f"node{rank}")).committed[-1] == 3, "each node persisted its files"


def test_the_start_up_bound_counts_the_bytes_a_save_flattens() -> None:
    """``Checkpointer()`` with ``memory=`` sizes its slots from ``tensor_sizes``, a walk that names nothing
    (``flatten`` took 0.07 s of a restart's start for 3,200 tensors): the same tensors, the same bytes."""
    import numpy as np
    import torch

    from tiercheck import Shard
    from tiercheck.state.flatten import flatten, tensor_sizes

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt, "extra": {"a": [torch.arange(5, dtype=torch.int16), (np.ones(3),)],
             "n": 3, "s": "x"}, "piece": Shard(torch.ones(2, 3), global_shape=(4, 3), offsets=(2, 0))}  # fmt: skip
    _, leaves = flatten(state, allow_pickle=False)
    assert sorted(tensor_sizes(state)) == sorted(x.tensor.nelement() * x.tensor.element_size() for x in leaves)
