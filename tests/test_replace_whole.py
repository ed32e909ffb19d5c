"""A replaced node made whole again (invariant 15): after it restores a step from its peers' memory,
its files of the step are back in its own memory and on its local directory (checked by verify), the
peers' copies of them stay, and the copies it held for its peers are in its memory again, so that the
step survives the loss of a former peer next. Each rank is a node of its own (real gloo processes,
their own tmpfs and local directories), restarted with the options it saved with."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import assert_identical, seeded_tensors, tiercheck_said
from tests.distributed import run_ranks
from tests.test_memory_tier import _memory_dir
from tiercheck import Checkpointer, MemoryOptions, ReplicationOptions, per_rank
from tiercheck.format.paths import replica_marker, step_dir
from tiercheck.format.replicas import read_replicas
from tiercheck.format.steps import list_steps, read_marker
from tiercheck.format.verify import verify_step
from tiercheck.tiers.local import LocalTier

_SHAPES = {"w": (128, 1024), "b": (4096,)}


def _state(step: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s own shard at ``step``: each node's files hold values of their own."""
    return seeded_tensors(100 * step + rank, _SHAPES)


def _node(rank: int, world: int, root: str, phase: str, replicas: int, then: tuple[int, ...] = ()) -> dict[str, Any]:
    """One rank, a node of its own: ``save`` saves steps 1 to 3 to memory (the clean close persists
    step 3); ``restore`` restores (step 3, bit-identical), waits for the background work
    (``Checkpointer.wait``), saves the steps ``then``, and returns its stats and the tiercheck INFO
    and WARNING lines it logged."""
    live = _state(0, rank)
    state = {k: per_rank(v) for k, v in live.items()}
    memory = MemoryOptions(path=Path(root) / f"shm{rank}", persist_every=100, keep_at_close=True)
    with tiercheck_said(logging.INFO) as said, Checkpointer(state, local=Path(root) / f"node{rank}", memory=memory,
                      replication=ReplicationOptions(replicas=replicas)) as ck:  # fmt: skip
        if phase == "save":
            for step in (1, 2, 3):
                for k, v in _state(step, rank).items():
                    live[k].copy_(v)
                ck.save(step).wait()
            return {}
        step = ck.restore()
        assert step == 3
        assert_identical(live, _state(3, rank))
        ck.wait()  # its persist and its copies made whole again: not a sleep
        stats = {k: v for k, v in ck.stats().items() if k.startswith(("memory_", "restore_from"))}
        for step in then:
            for k, v in _state(step, rank).items():
                live[k].copy_(v)
            ck.save(step).wait()
    torch.distributed.barrier()  # the job goes on after the close (its training group), as a job would
    return {"stats": stats, "said": said}


def _memory(root: Path, rank: int) -> Path:
    return _memory_dir(root / f"shm{rank}", root / f"node{rank}")


def _replace(root: Path, *nodes: int) -> None:
    """``nodes`` replaced: their tmpfs and local directories empty. The others lose their local
    copies of step 3 (the close persisted it there): memory alone holds it."""
    for rank in nodes:
        shutil.rmtree(root / f"shm{rank}")
        shutil.rmtree(root / f"node{rank}")
    for d in root.glob(f"node*/{step_dir(3)}"):
        shutil.rmtree(d)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_replaced_node_is_whole_again_and_outlives_the_loss_of_its_former_peers(shm: Path, replicas: int) -> None:
    shm.mkdir()
    world = replicas + 1  # every node holds a copy of every other's files
    run_ranks(_node, world, str(shm), "save", replicas)
    _replace(shm, 1)
    got = run_ranks(_node, world, str(shm), "restore", replicas, timeout=240)
    for rank, out in enumerate(got):
        stats = out["stats"]
        assert stats["restore_from_memory"] == 1, stats
        assert (stats["memory_rereplicate"], stats["memory_rereplicated_step"]) == ("done", 3), (rank, stats)
        assert stats["memory_rereplicate_s"] > 0
        assert (stats["memory_persist"], stats["memory_persisted_step"]) == ("done", 3), (rank, stats)
    assert any(f"step 3 is whole again on this node: memory and {shm / 'node1'}" in m for m in got[1]["said"])
    assert not [m for out in got for m in out["said"] if "not persisted" in m or "not made whole" in m]

    memory = LocalTier(_memory(shm, 1))
    local = LocalTier(shm / "node1")
    for tier in (memory, local):  # the replaced node's own files of step 3, the same save, checked chunk by chunk
        assert 3 in list_steps(tier).committed
        assert read_marker(tier, 3).ranks == (1,)
        assert read_marker(tier, 3).save_id == read_marker(LocalTier(_memory(shm, 0)), 3).save_id
        assert verify_step(tier, 3) == [], tier.url
    others = [r for r in range(world) if r != 1]
    assert sorted(r.ranks[0] for r in read_replicas(memory, 3, checked=True)) == others, "its peers' copies again"
    for rank in others:  # the copies of its files its peers held stay, whole
        peer = LocalTier(_memory(shm, rank))
        assert (peer.local_path / step_dir(3) / replica_marker(1)).exists()
        assert 1 in [r.ranks[0] for r in read_replicas(peer, 3, checked=True)]
        assert verify_step(peer, 3) == []

    # The point of being whole again: every former peer lost now, node 1 alone holds the step (every
    # node's files), and it restores on every node, bit-identical, with the same options (no hang).
    _replace(shm, *others)
    got = run_ranks(_node, world, str(shm), "restore", replicas, timeout=240)
    assert [out["stats"]["memory_rereplicate"] for out in got] == ["done"] * world
    for rank in others:
        assert any(
            f"step 3 is whole again on this node: memory and {shm / f'node{rank}'}" in m for m in got[rank]["said"]
        )
        assert verify_step(LocalTier(_memory(shm, rank)), 3) == []
        assert verify_step(LocalTier(shm / f"node{rank}"), 3) == []


def test_a_restart_after_a_replacement_with_replication_on_does_not_wait_for_a_copy_never_sent(shm: Path) -> None:
    """Both nodes restart with the options they saved with (replication of the local tier on too):
    the step each persists from memory is never copied over the local tier's pairs, where one node
    would wait on a receive its peer never posts (its close then waits for the pair's timeout, 300 s
    here, while its peer waits at the job's barrier: the launch's 120 s ends first). A replaced node
    does not move the job onto a lineage of its own either: node 0 keeps its memory step and persists it."""
    shm.mkdir()
    run_ranks(_node, 2, str(shm), "save", 1)
    _replace(shm, 1)
    got = run_ranks(_node, 2, str(shm), "restore", 1, timeout=120)
    assert [out["stats"]["memory_persisted_step"] for out in got] == [3, 3]
    assert not [m for out in got for m in out["said"] if "withdrawing" in m or "failed" in m], got[0]["said"]
    got = run_ranks(_node, 2, str(shm), "restore", 1, (4, 5), timeout=120)  # the next restart: from memory, whole
    assert [out["stats"]["restore_from_memory"] for out in got] == [1, 1]
    for rank in (0, 1):  # step 3 given back to node 1 (in no slot) is reclaimed as node 0's slot of it is
        assert list_steps(LocalTier(_memory(shm, rank))).committed == [4, 5], rank


def _restore_with_a_dying_giver(rank: int, world: int, root: str) -> dict[str, Any]:
    """``_node``'s restore with a pair timeout of 20 s (the pairs' gloo groups are made within it too:
    5 s was too short on two busy cores), where node 0 dies (killed, as a node is lost)
    when it would give node 1 its files back."""
    import os

    from tiercheck.tiering import whole_again

    if rank == 0:
        whole_again.MakeWhole._give = lambda self, pair: os._exit(9)  # type: ignore[method-assign]
    live = _state(0, rank)
    state = {k: per_rank(v) for k, v in live.items()}
    memory = MemoryOptions(path=Path(root) / f"shm{rank}", persist_every=100, keep_at_close=True)
    peers = ReplicationOptions(replicas=1, timeout_s=20)
    with tiercheck_said() as said, Checkpointer(state, local=Path(root) / f"node{rank}", memory=memory,
                                                replication=peers) as ck:  # fmt: skip
        assert ck.restore() == 3
        assert_identical(live, _state(3, rank))
        ck.wait()
        stats = ck.stats()
    return {"stats": stats, "said": said}


def test_a_peer_that_dies_while_giving_a_replaced_node_its_files_back_ends_the_copy_at_the_pair_timeout(
    shm: Path,
) -> None:
    """Said, never hung: node 1 restored step 3 (from node 0's copy) and learns at the pair's timeout
    that it is not whole again; its persist says why it has nothing to persist."""
    shm.mkdir()
    run_ranks(_node, 2, str(shm), "save", 1)
    _replace(shm, 1)
    got = run_ranks(_restore_with_a_dying_giver, 2, str(shm), timeout=120, pg_timeout=60, check=False)
    assert got[0].exitcode == 9 and got[1].ok, got[1].error
    stats, said = got[1].result["stats"], got[1].result["said"]
    assert (stats["memory_rereplicate"], stats["memory_rereplicated_step"]) == ("failed", None), stats
    assert (stats["memory_persist"], stats["memory_persisted_step"]) == ("failed", None), stats
    assert any("getting this node's files back from node 0 failed" in m for m in said), said
    assert any("step 3 is not persisted to" in m and "no peer gave them back" in m for m in said), said
    assert any("step 3 is not made whole again on every node" in m for m in said), said
    assert 3 not in list_steps(LocalTier(_memory(shm, 1))).committed, "nothing half-given counts"
    assert 3 in list_steps(LocalTier(_memory(shm, 0))).committed, "the step stays where it is whole"
