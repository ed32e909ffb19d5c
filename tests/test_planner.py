"""The pure planning behind distributed saves and restores: chunk grids, who writes, who reads."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch.distributed as dist

from tiercheck.cluster.assign import LeafDesc, Need, assign_all_reads, assign_writes, needed_chunks, route_chunks
from tiercheck.cluster.coordination import Coordinator, lockstep, shard_of
from tiercheck.cluster.keys import scope_key
from tiercheck.cluster.keys.save import plan_holders_scope
from tiercheck.cluster.nodes import join_in_lockstep
from tiercheck.errors import CoordinationError, IncompatibleStateError
from tiercheck.format.layout import chunks, chunks_in_box, grid_for_boxes
from tiercheck.save import plan as save_plan
from tiercheck.save.patterns import pattern_offer
from tiercheck.save.plan import plan_save


def split(extent: int, parts: int) -> list[tuple[int, int]]:
    size = math.ceil(extent / parts)
    return [(min(i * size, extent), min(size, extent - min(i * size, extent))) for i in range(parts)]


@pytest.mark.parametrize(
    ("shape", "boxes"),
    [
        ((1000,), [((o,), (n,)) for o, n in split(1000, 4)]),  # ZeRO partitions: 250 each
        ((1001,), [((o,), (n,)) for o, n in split(1001, 4)]),  # last one short: 251, 251, 251, 248
        ((64, 48), [((0, 0), (32, 48)), ((32, 0), (32, 48))]),  # TP rows
        ((64, 48), [((0, 0), (64, 24)), ((0, 24), (64, 24))]),  # TP columns
        ((64, 48), [((r, c), (32, 24)) for r in (0, 32) for c in (0, 24)]),  # 2-D mesh
        ((10, 6), [((0, 0), (4, 6)), ((4, 0), (3, 6)), ((7, 0), (3, 6))]),  # uneven: boundaries 4 and 7
    ],
)
def test_the_grid_never_crosses_a_shard_boundary(shape: tuple[int, ...], boxes: list) -> None:  # type: ignore[type-arg]
    for target in (64, 4096, 1 << 20):
        grid = grid_for_boxes(shape, boxes, 4, target)
        for offsets, extents in boxes:
            for c in chunks_in_box(shape, grid, offsets, extents):
                inside = all(
                    o <= a and b <= o + n for a, b, o, n in zip(c.starts, c.stops, offsets, extents, strict=True)
                )
                assert inside, (grid, c, offsets, extents)


def test_the_grid_stays_near_the_target_where_shards_allow() -> None:
    assert grid_for_boxes((1000,), [((0,), (500,)), ((500,), (500,))], 4, 4000) == (500,)
    assert grid_for_boxes((1000,), [((0,), (500,)), ((500,), (500,))], 4, 400) == (100,)
    # 4 x 251 floats: 251 is prime, so a chunk is one whole partition rather than 251 one-float files.
    assert grid_for_boxes((1001,), [((o,), (n,)) for o, n in split(1001, 4)], 4, 400) == (251,)


def descs(path: str, shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[LeafDesc]:
    return [LeafDesc(path, "float32", "tensor", shape, o, n, False) for o, n in boxes]


def test_replicated_data_is_written_once_and_spread_over_the_replicas() -> None:
    world = 4
    per_rank = [descs("w", (4096,), [((0,), (4096,))]) + descs("b", (16,), [((0,), (16,))]) for _ in range(world)]
    plan = assign_writes(per_rank, target_chunk_bytes=1024)
    written = Counter((t.leaf, t.chunk.key) for rank_tasks in plan.tasks for t in rank_tasks)
    assert all(n == 1 for n in written.values())
    assert sum(plan.nbytes) == (4096 + 16) * 4  # no chunk twice
    assert max(plan.nbytes) - min(plan.nbytes) <= 1024  # within one chunk of even
    owners = plan.records["w"].owners
    assert set(owners.values()) == set(range(world))
    for rank, rank_tasks in enumerate(plan.tasks):
        for t in rank_tasks:
            assert plan.records[per_rank[rank][t.leaf].path].owners[t.chunk.key] == rank


def test_sharded_data_is_written_by_its_holder_in_local_coordinates() -> None:
    per_rank = [descs("w", (8, 4), [((4 * r, 0), (4, 4))]) for r in range(2)]
    plan = assign_writes(per_rank, target_chunk_bytes=1 << 20)
    assert plan.records["w"].chunks == (4, 4)
    [t0], [t1] = plan.tasks
    assert (t0.chunk.starts, t0.local.starts) == ((0, 0), (0, 0))
    assert (t1.chunk.starts, t1.local.starts, t1.local.stops) == ((4, 0), (0, 0), (4, 4))


def test_a_hole_or_a_disagreement_between_ranks_is_refused() -> None:
    with pytest.raises(IncompatibleStateError, match=r"array 'w'\[8, 4\]: \[4:8, 0:4\] is held by no rank"):
        assign_writes([descs("w", (8, 4), [((0, 0), (4, 4))])], target_chunk_bytes=1 << 20)
    with pytest.raises(IncompatibleStateError, match=r"rank 0 has float32\[8\] but rank 1 has float32\[9\]"):
        assign_writes([descs("w", (8,), [((0,), (8,))]), descs("w", (9,), [((0,), (9,))])], target_chunk_bytes=64)


def test_reads_go_to_ranks_that_can_read_and_the_rest_is_sent() -> None:
    per_rank = [descs("w", (8,), [((0,), (8,))]) for _ in range(2)]  # replicated, 2 chunks of 4
    records = assign_writes(per_rank, target_chunk_bytes=16).records
    assert sorted(records["w"].owners.values()) == [0, 1]
    needs = [[Need("w", (0,), (8,))] for _ in range(3)]
    readable = [frozenset({0}), frozenset({1}), frozenset()]  # restoring rank 2 sits on a fresh node
    each = assign_all_reads(records, needs, readable, read_once=False)
    assert [len(r) for r in each.reads] == [1, 1, 0]
    assert sorted((t.src, t.dst) for t in each.transfers) == [(0, 1), (0, 2), (1, 0), (1, 2)]
    assert len({(t.tag, t.dst) for t in each.transfers}) == len(each.transfers)  # a receiver's tags are its own
    with pytest.raises(IncompatibleStateError, match="whose files no restoring rank can read"):
        assign_all_reads(records, needs, [frozenset({0})] * 3, read_once=False)


def test_read_once_reads_every_chunk_once() -> None:
    per_rank = [descs("w", (64,), [((0,), (64,))])]
    records = assign_writes(per_rank, target_chunk_bytes=64).records  # 4 chunks of 16 floats
    needs = [[Need("w", (0,), (64,))] for _ in range(4)]
    plan = assign_all_reads(records, needs, [frozenset({0})] * 4, read_once=True)
    assert sorted(x.chunk.key for r in plan.reads for x in r) == sorted(c.key for c in chunks((64,), (16,)))
    assert all(len(r) == 1 for r in plan.reads)  # balanced: one chunk per rank
    assert len(plan.transfers) == 4 * 3
    every = assign_all_reads(records, needs, [frozenset({0})] * 4, read_once=False)
    assert all(len(r) == 4 for r in every.reads) and not every.transfers


def test_each_node_reads_a_chunk_once_and_passes_it_to_its_ranks() -> None:
    per_rank = [descs("w", (128,), [((0,), (128,))]) for _ in range(2)]  # replicated, 8 chunks of 16
    records = assign_writes(per_rank, target_chunk_bytes=64).records
    needs = [[Need("w", (0,), (128,))] for _ in range(4)]  # 4 data-parallel ranks, 2 per node
    nodes = [0, 0, 2, 2]
    keys = sorted(c.key for c in chunks((128,), (16,)))
    # Each node holds one saving rank's files: every chunk is read once in the job, by the node
    # holding it, half by each of its ranks; its other rank and the other node's receive it.
    split = assign_all_reads(records, needs, [frozenset({0})] * 2 + [frozenset({1})] * 2, read_once=False, nodes=nodes)
    assert sorted(x.chunk.key for r in split.reads for x in r) == keys
    assert [len(r) for r in split.reads] == [2, 2, 2, 2]
    assert len(split.transfers) == 8 * 3 and not any(t.shared for t in split.transfers)
    # Both nodes hold every file: each node reads each chunk once and passes it only to its other rank.
    both = assign_all_reads(records, needs, [frozenset({0, 1})] * 4, read_once=False, nodes=nodes)
    assert sorted(x.chunk.key for r in both.reads for x in r) == sorted(keys * 2)
    assert [len(r) for r in both.reads] == [4, 4, 4, 4]
    assert all(nodes[t.src] == nodes[t.dst] for t in both.transfers) and len(both.transfers) == 8 * 2
    # Ranks with one host key pass chunks through shared memory; a rank with none, or another, never.
    hosts = ["h1", "h1", "h1", None]
    shared = assign_all_reads(records, needs, [frozenset({0, 1})] * 4, read_once=False, nodes=nodes, hosts=hosts)
    assert {(t.src, t.dst): t.shared for t in shared.transfers} == {
        (0, 1): True,
        (1, 0): True,
        (2, 3): False,
        (3, 2): False,
    }


def test_a_writer_reading_its_own_chunks_is_its_nodes_reader_and_the_route_tells_each_rank_its_part() -> None:
    """With ``owners_read`` (a rank reads alone the chunks its saving rank wrote), the planner has
    the writer read for the others too, even where it asked for nothing: each chunk is read once,
    on its node. Each rank's part comes from the route alone."""
    per_rank = [descs("w", (128,), [((0,), (128,))]) for _ in range(4)]  # replicated, 8 chunks of 16
    records = assign_writes(per_rank, target_chunk_bytes=64).records
    assert set(records["w"].owners.values()) == {0, 1, 2, 3}  # the writing spread over the replicas
    # Two nodes of two ranks, restoring the layout they saved: each node holds its ranks' files.
    # Ranks 0 and 2 ask for nothing (here: they read their own alone); 1 and 3 ask for all of it.
    wanted = needed_chunks(records, {1: [Need("w", (0,), (128,))], 3: [Need("w", (0,), (128,))]})
    readers = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    node = {0: 0, 1: 0, 2: 2, 3: 2}
    routes, _ = route_chunks(
        records, wanted, readers.__getitem__, read_once=False, remote=False, node_of=node.__getitem__,
        host_of=lambda r: f"h{node[r]}", owners_read=True,
    )  # fmt: skip
    for route in routes:
        writer = records["w"].owner(route.chunk.key)
        assert [s.rank for s in route.sources] == [writer]  # read once, by its writer, on its node
        mate = writer ^ 1  # the writer's node-mate, through shared memory; the other node over the group
        assert route.sends(route.sources[0]) == sorted({(1, mate == 1), (3, mate == 3)} - {(writer, False)})
        assert all(route.source_of(r).rank == writer for r in route.needers - {writer})
    without, _ = route_chunks(records, wanted, readers.__getitem__, read_once=False, remote=False, node_of=node.__getitem__)
    assert {s.rank for r in without for s in r.sources} == {1, 3}  # without it: the ranks that asked


def test_a_replaced_nodes_chunks_are_read_by_every_rank_of_the_node_holding_its_files() -> None:
    """Node 1 (ranks 8-15) was replaced: node 2 (ranks 16-23) holds its writers' files. Each array has
    a coordinator of its own, which plans alone: every writer's chunks, needed by its own rank only (a
    distributed optimizer's slices), are read each by a different rank of node 2, not all by its first
    (whose reads would then bound the replaced node's restore)."""
    node = {r: r // 8 for r in range(24)}
    readers = {w: list(range(16, 24)) for w in range(8, 16)}
    read_by: dict[int, set[int]] = {}
    for w in range(8, 16):  # one array per writer, each planned by its own coordinator
        path = f"optim/{w}"
        records = assign_writes([descs(path, (16,), [((0,), (16,))]) if r == w else [] for r in range(24)],
                                target_chunk_bytes=64).records  # fmt: skip
        wanted = needed_chunks(records, {w: [Need(path, (0,), (16,))]})
        routes, _ = route_chunks(records, wanted, readers.__getitem__, read_once=False, remote=False,
                                 node_of=node.__getitem__, owners_read=True)  # fmt: skip
        read_by[w] = {s.rank for route in routes for s in route.sources}
    assert read_by == {w: {16 + w % 8} for w in range(8, 16)}


# ------------------------------------------------------------------ the plan made through the store


def megatron_like(world: int, tp: int) -> list[list[LeafDesc]]:
    """TP-split and replicated weights, and a flat optimizer partition over the data-parallel ranks."""
    dp = world // tp
    out = []
    for r in range(world):
        t, d = r % tp, r // tp
        leaves = descs("fc", (64, 48), [((64 // tp * t, 0), (64 // tp, 48))])
        leaves += descs("norm", (48,), [((0,), (48,))])
        o, n = split(1001, dp)[d]
        leaves += descs(f"optim/tp{t}", (1001,), [((o,), (n,))])
        leaves += descs("empty", (0, 4), [((0, 0), (0, 4))])
        out.append(leaves)
    return out


@pytest.mark.parametrize(("world", "tp"), [(1, 1), (4, 2), (8, 2), (12, 4)])
def test_the_plan_made_through_the_store_is_the_whole_job_plan(world: int, tp: int) -> None:
    per_rank = megatron_like(world, tp)
    store = dist.HashStore()
    coords = [Coordinator(store, rank=r, world_size=world, namespace="t", timeout_s=5) for r in range(world)]
    for generation in range(2):  # a second plan reuses nothing of the first
        plans = lockstep([plan_save(c, generation, per_rank[c.rank], target_chunk_bytes=256) for c in coords])
    whole = assign_writes(per_rank, target_chunk_bytes=256)
    for rank, plan in enumerate(plans):
        assert [(t.leaf, t.chunk, t.local) for t in plan.tasks] == [
            (t.leaf, t.chunk, t.local) for t in whole.tasks[rank]
        ]
        assert plan.nbytes == whole.nbytes[rank]
        assert set(plan.records) == {d.path for d in per_rank[rank]}
    shards = [p.shard for p in plans]
    assert {path: rec for shard in shards for path, rec in shard.items()} == whole.records
    assert sum(len(s) for s in shards) == len(whole.records), "each array has one coordinator"
    # Every key of both plans was deleted once every rank was past it.
    assert store.num_keys() == 0


def test_a_disagreement_found_by_a_coordinator_fails_every_rank() -> None:
    per_rank = [descs("w", (8,), [((0,), (8,))]), descs("w", (9,), [((0,), (9,))]), descs("v", (2,), [((0,), (2,))])]
    store = dist.HashStore()
    coords = [Coordinator(store, rank=r, world_size=3, namespace="t", timeout_s=5) for r in range(3)]
    protocols = [plan_save(c, 0, per_rank[c.rank], target_chunk_bytes=64) for c in coords]
    for p in protocols:
        next(p)  # everyone posts
    for p in protocols:
        next(p)  # the coordinators lay out their arrays
    for p in protocols:  # and every rank, not only the holders of "w", learns of the failure
        with pytest.raises(IncompatibleStateError, match=r"rank 0 has float32\[8\] but rank 1 has float32\[9\]"):
            next(p)


def test_store_traffic_per_rank_does_not_grow_with_the_job() -> None:
    """A rank's bytes through the store depend on the pieces it holds (and, as a coordinator, on the
    holders of its arrays), not on how many ranks the job has."""

    def pairs(world: int) -> list[list[LeafDesc]]:  # each tensor held by a pair of replicas
        out = []
        for r in range(world):
            g = r // 2
            leaves = descs(f"layer{g}.w", (64, 48), [((0, 0), (64, 48))])
            leaves += descs(f"optim{g}", (1001,), [((0,), (501,)), ((501,), (500,))][r % 2 : r % 2 + 1])
            out.append(leaves)
        return out

    means = []
    for world in (8, 512):
        store = dist.HashStore()
        coords = [Coordinator(store, rank=r, world_size=world, namespace="t", timeout_s=5) for r in range(world)]
        per_rank = pairs(world)
        lockstep([plan_save(c, 0, per_rank[c.rank], target_chunk_bytes=4096) for c in coords])
        sent = [c.store_bytes for c in coords]
        means.append(sum(sent) / world)
        # Arrays go to coordinators by a hash, so some rank coordinates a few more than average.
        assert max(sent) < 3 * means[-1], (world, max(sent), means[-1])
    assert means[1] < 1.2 * means[0], means


def _plan_through_store(
    per_rank: list[list[LeafDesc]], target: int, per_node: int = 0
) -> tuple[list[int], list[Coordinator]]:
    """Plan ``per_rank`` through one store (with ``per_node``, its ranks on nodes of that many, each
    node's holders registered by its first rank), checked against the whole-job plan; each rank's
    store bytes."""
    world = len(per_rank)
    store = dist.HashStore()
    coords = [Coordinator(store, rank=r, world_size=world, namespace="t", timeout_s=5) for r in range(world)]
    if per_node:
        join_in_lockstep(coords, [f"node{r // per_node}" for r in range(world)])
        for c in coords:
            c.counters.update(dict.fromkeys(c.counters, 0))
    plans = lockstep([plan_save(c, 0, per_rank[c.rank], target_chunk_bytes=target) for c in coords])
    whole = assign_writes(per_rank, target_chunk_bytes=target)
    for rank, plan in enumerate(plans):
        assert [(t.leaf, t.chunk, t.local) for t in plan.tasks] == [(t.leaf, t.chunk, t.local) for t in whole.tasks[rank]]
    assert {path: rec for p in plans for path, rec in p.shard.items()} == whole.records
    assert store.num_keys() == 0
    return [c.store_bytes for c in coords], coords


def test_a_buffer_split_over_every_data_parallel_rank_costs_its_coordinator_a_few_bytes_a_slice() -> None:
    """A distributed optimizer's flat buffers, cut into equal slices over the data-parallel ranks, and
    TP-split weights replicated over them: posted and offered once each as a block pattern. Where
    each slice was a description and an offer of its own (some 400 bytes), its coordinator's traffic
    grew with the data-parallel ranks; now by a register entry of a few bytes a slice."""

    def layout(world: int, tp: int = 2) -> list[list[LeafDesc]]:
        dp = world // tp
        out = []
        for r in range(world):
            t, d = r % tp, r // tp
            leaves = descs("fc", (64, 48), [((64 // tp * t, 0), (64 // tp, 48))])
            for state in ("param", "exp_avg", "exp_avg_sq"):
                leaves += descs(f"optim/tp{t}/{state}", (dp * 64,), [((d * 64,), (64,))])
            out.append(leaves)
        return out

    small, _ = _plan_through_store(layout(16), 256)
    big, _ = _plan_through_store(layout(256), 256)
    # 120 more slices an array: as exact pieces the busiest rank paid 56 KB more (10.2 KB, then 66.2 KB),
    # some 400 B a slice of the (up to 3) arrays it coordinates; now under 20 B a slice.
    assert max(big) - max(small) < 3 * 120 * 20, (max(small), max(big))
    # On nodes of 8 ranks (4 replicas of the 2 TP ranks): the same plan, its holders registered by node.
    _plan_through_store(layout(256), 256, per_node=8)


def test_a_node_of_ranks_holding_a_replicated_array_costs_its_coordinator_one_entry() -> None:
    """Every rank holds a norm: by node, its coordinator reads one run a node (``"8+8,"``), not a rank
    a holder, and the plan is the same."""
    per_rank = [descs("norm", (1024,), [((0,), (1024,))]) for _ in range(1024)]
    alone, _ = _plan_through_store(per_rank, 4096)
    by_node, _ = _plan_through_store(per_rank, 4096, per_node=8)
    c = shard_of("norm", 1024)
    # 1,024 entries of 4-5 bytes ("517,") against 128 of 6-8 ("512+8,")
    assert by_node[c] < alone[c] - 3000, (alone[c], by_node[c])


def test_a_garbled_node_register_fails_every_rank_naming_it_without_a_hang() -> None:
    world = 8
    store = dist.HashStore()
    coords = [Coordinator(store, rank=r, world_size=world, namespace="t", timeout_s=5) for r in range(world)]
    join_in_lockstep(coords, [f"node{r // 4}" for r in range(world)])
    per_rank = [descs("w", (64,), [((8 * r,), (8,))]) for r in range(world)]
    protocols = [plan_save(c, 0, per_rank[c.rank], target_chunk_bytes=64) for c in coords]
    node = coords[4].node
    assert node is not None
    node.append(scope_key(node, plan_holders_scope("plan0")), "1:zz:9:;")
    outcomes = lockstep(protocols, capture=True)
    assert all(isinstance(o, CoordinationError) for o in outcomes), outcomes
    assert all("field 'holders[0]'" in str(o) for o in outcomes), outcomes


@pytest.mark.parametrize("blocks", [[0, 1, 3, 2], [0, 2, 1, 3, 4, 5]])
def test_slices_held_in_no_fixed_order_are_offered_each_its_own(
    blocks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Equal slices whose ranks are no fixed step apart block after block (rank 2 holds block 3): the
    pattern's one offer cannot say it, so each block's holders get their own, and the plan is the same."""
    made: list[bool] = []

    def spy(*args: Any) -> Any:
        out = pattern_offer(*args)
        made.append(out is not None)
        return out

    monkeypatch.setattr(save_plan, "pattern_offer", spy)
    per_rank = [descs("optim", (len(blocks) * 64,), [((k * 64,), (64,))]) + descs("n", (8,), [((0,), (8,))]) for k in blocks]
    per_rank += per_rank  # each block held twice: by rank i and rank i + len(blocks)
    _plan_through_store(per_rank, 128)
    assert made == [False], "one pattern, offered block by block"
