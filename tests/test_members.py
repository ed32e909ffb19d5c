"""A read plan's groups reach their coordinator by node (``restore.members``): every member with its
node and host, whoever posted first, at a few bytes per node however many groups a node is in."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tiercheck.cluster.coordination import Coordinator
from tiercheck.errors import CoordinationError
from tiercheck.restore.members import Member, collect, sign

A, B, C = "a" * 24, "b" * 24, "c" * 24


def _coords(world: int) -> tuple[object, list[Coordinator]]:
    store = dist.HashStore()
    return store, [Coordinator(store, rank=r, world_size=world, namespace="m", timeout_s=5) for r in range(world)]


def test_every_member_comes_back_with_its_node_and_host_whoever_posted_first() -> None:
    """Four nodes of four ranks; rank 1 coordinates. Group A (offsets 0-1 of every node) was posted
    first by node 0, group B (offset 2) by node 8: a race; C is node 4's alone (an optimizer slice).
    Nodes 0 and 4 share a host (0), node 8 has its own, node 12 shares no memory."""
    store, coords = _coords(16)
    sign(coords[0], "r", 0, "0", {(1, A): ([0, 1], True), (1, B): ([2], False)})
    sign(coords[4], "r", 4, "0", {(1, A): ([4, 5], False), (1, B): ([6], False), (1, C): ([7], True)})
    sign(coords[8], "r", 8, "8", {(1, A): ([8, 9], False), (1, B): ([10], True)})
    sign(coords[12], "r", 12, None, {(1, A): ([12, 13], False), (1, B): ([14], False)})
    got = collect(coords[1], "r", [A, B, C])
    assert {d: sorted(ms, key=lambda m: m.rank) for d, ms in got.items()} == {
        A: [Member(0, 0, "0"), Member(1, 0, "0"), Member(4, 4, "0"), Member(5, 4, "0"), Member(8, 8, "8"),
            Member(9, 8, "8"), Member(12, 12), Member(13, 12)],
        B: [Member(2, 0, "0"), Member(6, 4, "0"), Member(10, 8, "8"), Member(14, 12)],
        C: [Member(7, 4, "0")],
    }  # fmt: skip
    assert store.num_keys() == 0  # the coordinator deleted every key it read


def test_a_coordinator_reads_a_few_bytes_per_node_however_many_groups_the_node_is_in() -> None:
    """The eight tensor-parallel slices of a weight are eight groups with members on the same nodes:
    a coordinator reads each node once (its first rank), not once per group."""
    costs = []
    for nodes in (64, 512):
        world = 8 * nodes
        _, coords = _coords(world)
        groups = [f"{k:024x}" for k in range(8)]
        for n in range(nodes):
            leader = 8 * n
            sign(coords[leader], "r", leader, str(leader), {(3, d): ([leader + k], n == 0) for k, d in enumerate(groups)})
        before = coords[3].store_bytes
        got = collect(coords[3], "r", groups)
        assert all(len(got[d]) == nodes for d in groups)
        costs.append(coords[3].store_bytes - before)
    per_node = (costs[1] - costs[0]) / (512 - 64)
    assert per_node <= 6, costs  # "4088," at most: the first rank's digits and a comma


def test_a_signature_naming_a_group_not_posted_to_the_coordinator_is_refused() -> None:
    _, coords = _coords(8)
    sign(coords[0], "r", 0, "0", {(1, A): ([0], True)})
    sign(coords[4], "r", 4, "4", {(1, A): ([4], False), (1, B): ([5], False)})
    with pytest.raises(CoordinationError, match="r/sigs/1: field '[0-9a-f]{24}' is not groups posted to rank 1"):
        collect(coords[1], "r", [A])
