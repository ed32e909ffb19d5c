"""A replaced node (its tmpfs and local directory empty) restores from the copies of its memory steps
in its peers' memory, over the process group (real gloo processes, each rank a node of its own with
its own state): bit-identical with one copy and with two (each holder serving part of it), with two
nodes replaced at once, past a holder's damaged copy chunk by chunk, and with a clear error, never
a hang, where a serving peer dies mid-transfer.

A holder's damaged copy on a node that was not replaced is covered by
``test_memory_tier.test_a_chunk_damaged_in_a_nodes_memory_and_nowhere_else_on_it_is_read_from_its_peers_memory``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import assert_identical, seeded_tensors
from tests.distributed import run_ranks
from tests.ondisk import written_by
from tiercheck import Checkpointer, DistributedOptions, MemoryOptions, ReplicationOptions, per_rank
from tiercheck.format.paths import step_dir
from tiercheck.state import memory_pool

TENSORS = 6  # a chunk each, per rank


def _values(rank: int, step: int) -> dict[str, torch.Tensor]:
    return seeded_tensors(1000 * step + rank, {f"t{i}": (64, 257) for i in range(TENSORS)})


def _node(
    rank: int, world: int, root: str, phase: str, replicas: int, die_at: int | None = None, timeout_s: float = 900
) -> dict[str, Any] | None:
    """One rank, a node of its own with a state of its own (``per_rank`` tensors). "save": steps 1
    and 2 into memory, each copied to ``replicas`` peers' memory. "restore": restores (without
    replication: the copies back into a replaced node's memory are not what is tested), checks
    the state is step's bit for bit, and says how. ``die_at``: this rank's process exits as it
    serves its ``die_at``-th chunk to another rank, where it is rank 0."""
    tensors = {k: torch.zeros_like(v) for k, v in _values(rank, 0).items()}
    state = {k: per_rank(t) for k, t in tensors.items()}
    memory = MemoryOptions(path=Path(root) / f"shm{rank}", persist_every=10**9, keep_at_close=True)
    peers = ReplicationOptions(replicas=replicas) if phase == "save" else None
    options = DistributedOptions(share_memory=False, timeout_s=timeout_s)  # as between hosts: the process group
    if die_at is not None and rank == 0:
        import tiercheck.restore.serve as serve

        mapped, served = serve._mapped, [0]

        def dying(moves: Any, job: Any) -> torch.Tensor | None:
            served[0] += 1
            if served[0] == die_at:
                os._exit(3)
            return mapped(moves, job)

        serve._mapped = dying
    with Checkpointer(state, local=Path(root) / f"node{rank}", memory=memory, replication=peers,
                      distributed=options) as ck:  # fmt: skip
        if phase == "save":
            for step in (1, 2):
                for k, v in _values(rank, step).items():
                    tensors[k].copy_(v)
                ck.save(step).wait()
            return None
        step = ck.restore()
        stats = ck.stats()
    assert step is not None
    assert_identical(tensors, _values(rank, step))
    return {k: stats[f"restore_{k}"] for k in ("from_memory", "bytes_read", "chunks_received", "copies_passed_over",
                                                "own_placed_s")} | {"step": step}  # fmt: skip


def _memory_step(root: Path, rank: int, step: int) -> Path:
    return memory_pool.pool_dir(MemoryOptions(path=root / f"shm{rank}"), os.path.abspath(root / f"node{rank}")) / (
        step_dir(step)
    )


def _saved(root: Path, world: int, replicas: int, replaced: tuple[int, ...]) -> None:
    """Steps 1 and 2 saved into memory, copied to peers; the ``replaced`` nodes' tmpfs and local
    directories emptied; and every node's local copies of the steps removed (the clean close persisted
    them): the steps are in memory only, the replaced nodes' files in their peers' alone."""
    run_ranks(_node, world, str(root), "save", replicas)
    for r in replaced:
        shutil.rmtree(root / f"shm{r}")
        shutil.rmtree(root / f"node{r}")
    for r in set(range(world)) - set(replaced):
        for step in (root / f"node{r}").glob("step-*"):
            shutil.rmtree(step)


CHUNK_BYTES = 64 * 257 * 4


@pytest.mark.parametrize(("world", "replicas"), [(2, 1), (3, 2)])
def test_a_replaced_node_restores_bit_identically_from_its_peers_memory(shm: Path, world: int, replicas: int) -> None:
    shm.mkdir()
    _saved(shm, world, replicas, (1,))
    got = run_ranks(_node, world, str(shm), "restore", replicas)
    assert [g["step"] for g in got] == [2] * world and [g["from_memory"] for g in got] == [1] * world
    assert got[1]["chunks_received"] == TENSORS and got[1]["bytes_read"] == 0, "all of node 1's chunks were sent"
    assert got[1]["own_placed_s"] is None, "it read nothing itself"
    servers = [r for r in range(world) if r != 1]
    served = {r: got[r]["bytes_read"] - TENSORS * CHUNK_BYTES for r in servers}  # beyond their own chunks
    assert sum(served.values()) == TENSORS * CHUNK_BYTES
    assert all(served.values()), f"every node holding a copy served part of it: {served}"
    assert all(got[r]["own_placed_s"] is not None and got[r]["chunks_received"] == 0 for r in servers)


def test_two_nodes_replaced_at_once_restore_from_the_node_holding_both_copies(shm: Path) -> None:
    shm.mkdir()
    _saved(shm, 3, 2, (1, 2))
    got = run_ranks(_node, 3, str(shm), "restore", 2)
    assert [g["step"] for g in got] == [2, 2, 2]
    assert [g["chunks_received"] for g in got] == [0, TENSORS, TENSORS]
    assert got[0]["bytes_read"] == 3 * TENSORS * CHUNK_BYTES, "node 0 read its own chunks and served both nodes'"


def test_a_holders_damaged_copy_is_passed_over_and_the_other_holder_serves_it(shm: Path) -> None:
    """Replicas 2, node 1 replaced: its chunks are damaged in node 0's copy (every one: which of them
    node 0 serves depends on which holder's claim the store took first). Node 0 finds the damage as
    it serves (never sends a chunk as verified), passes over its copy of node 1's files, and node
    2's copy serves them: step 2, bit-identical, on every node."""
    shm.mkdir()
    _saved(shm, 3, 2, (1,))
    step = _memory_step(shm, 0, 2)
    from tests.ondisk import flip_chunk_byte

    for array, key in written_by(step, 1):
        flip_chunk_byte(step, array, key, 7)
    got = run_ranks(_node, 3, str(shm), "restore", 2)
    assert [g["step"] for g in got] == [2, 2, 2]
    assert [g["copies_passed_over"] for g in got] == [1, 0, 0], "node 0 passed over its copy of node 1's files"
    assert got[2]["bytes_read"] == 2 * TENSORS * CHUNK_BYTES, "node 2 served all of node 1's chunks"


def test_a_replaced_node_whose_only_copy_is_damaged_restores_the_step_before(shm: Path) -> None:
    shm.mkdir()
    _saved(shm, 2, 1, (1,))
    step = _memory_step(shm, 0, 2)
    array, key = written_by(step, 1)[-1]
    from tests.ondisk import flip_chunk_byte

    flip_chunk_byte(step, array, key, 7)
    got = run_ranks(_node, 2, str(shm), "restore", 1)
    assert [g["step"] for g in got] == [1, 1], "step 1 from memory, never step 2 with a damaged chunk"


@pytest.mark.parametrize("world", [2, 3])
def test_a_serving_peer_that_dies_mid_transfer_fails_the_replaced_node_naming_it(shm: Path, world: int) -> None:
    """Node 0 serves node 1's chunks from its copy (with replicas 2, node 2 serves the rest) and dies
    as it serves its second. Node 1 fails at once with an error naming rank 0, never waits out a
    timeout or restores part of its state; with a third node, that one gives up at its timeout."""
    shm.mkdir()
    _saved(shm, world, world - 1, (1,))
    # Rank 0 dies; the others' process group and the job's store (the launcher's) outlive it.
    out = run_ranks(
        _node, world, str(shm), "restore", world - 1, check=False, timeout=240, pg_timeout=120,
        die_at=2, timeout_s=10,
    )  # fmt: skip
    assert out[0].exitcode == 3
    said = out[1].error or ""
    assert "TransferError: rank 1: receiving array" in said and "from rank 0 failed" in said, said
    assert "may hold parts of step(s) 2" in said, "a job start reads in place: it says what it overwrote"
    if world == 3:
        assert out[2].error is not None and "CoordinationError" in out[2].error and "gave up waiting" in out[2].error


def test_over_a_group_that_matches_by_order_sends_to_each_rank_are_posted_in_ascending_tags() -> None:
    """NCCL matches sends to receives by the order they are posted, not by tag: chunks verified in any
    order (read threads, the serving thread) are posted to each rank in the tag order its receives
    were posted in; over gloo (by tag), each at once."""
    from tiercheck.restore.order import SendOrder, receive_order

    posted: list[tuple[int, int]] = []
    tags = [(1, 7), (1, 3), (2, 4), (1, 5)]
    order = SendOrder(tags, ordered=True)
    for dst, tag in [(1, 5), (2, 4), (1, 7), (1, 3)]:
        order.post(dst, tag, lambda dst=dst, tag=tag: posted.append((dst, tag)))
    assert posted == [(2, 4), (1, 3), (1, 5), (1, 7)]
    assert list(receive_order([7, 3, 5], lambda t: t, ordered=True)) == [3, 5, 7]
    posted.clear()
    unordered = SendOrder(tags, ordered=False)
    for dst, tag in [(1, 5), (1, 3)]:
        unordered.post(dst, tag, lambda dst=dst, tag=tag: posted.append((dst, tag)))
    assert posted == [(1, 5), (1, 3)]
