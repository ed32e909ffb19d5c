"""Two-level agreement (``cluster.nodes``, ``cluster.hierarchy``): the job's store hears from node
leaders only, a fold of the nodes' steps never has one rank read every node's, and a real job's
non-leader ranks make no request to the job's store in a save that reuses its plan."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tiercheck
from tiercheck.cluster.coordination import Coordinator, lockstep
from tiercheck.cluster.hierarchy import FAN_IN
from tiercheck.cluster.job import Job
from tiercheck.cluster.nodes import Nodes, join_in_lockstep, join_nodes, local_channel, open_channel
from tiercheck.errors import CheckpointNotFoundError, CoordinationError
from tiercheck.format.codec import seal
from tiercheck.format.manifest import RankPart
from tiercheck.format.saveid import new_save_id
from tiercheck.restore.agree import agree_on_step
from tiercheck.save.vote import RankOutcome, commit_save
from tiercheck.tiers.local import LocalTier

from .distributed import run_ranks


def _job(world: int, per_node: int, root: Path) -> tuple[list[Coordinator], list[Nodes], list[Job]]:
    store = dist.HashStore()
    coords = [Coordinator(store, rank=r, world_size=world, namespace="h", timeout_s=5) for r in range(world)]
    nodes = join_in_lockstep(coords, [f"node{r // per_node}" for r in range(world)])
    tiers = [LocalTier(root / f"node{r // per_node}", fsync=False) for r in range(world)]
    return coords, nodes, [Job(coord=c, nodes=nodes[c.rank], tier=tiers[c.rank]) for c in coords]


def _commit(jobs: list[Job], step: int, failing: int | None = None) -> list[Any]:
    def one(job: Job) -> Any:
        save = new_save_id(job.nodes.run, step, 0)
        error = RuntimeError("disk full") if job.coord.rank == failing else None
        outcome = RankOutcome(step=step, attempt=0, save_id=save, part=seal(RankPart({}, {}, {}, {}, save).to_bytes()),
                              error=error, library_version="t")  # fmt: skip
        return (yield from commit_save(job, outcome))

    return lockstep([one(j) for j in jobs], capture=True)


def test_a_commit_costs_the_jobs_store_four_requests_per_node_and_none_from_other_ranks(tmp_path: Path) -> None:
    world, per_node = 32, 4
    coords, nodes, jobs = _job(world, per_node, tmp_path)
    before = [c.counters["store_ops"] for c in coords]
    assert _commit(jobs, 1) == [None] * world
    ops = [c.counters["store_ops"] - b for c, b in zip(coords, before, strict=True)]
    leaders = {n.leader for n in nodes}
    assert all(ops[r] == 0 for r in range(world) if r not in leaders), ops
    # Four per leader (count in, read the outcome, count in again, read the verdict), plus rank 0's
    # metadata and the two decisions of the last leaders to count in.
    assert sum(ops) <= 4 * len(leaders) + 4, ops
    assert all(c.node is not None and c.node.counters["store_ops"] > 0 for c in coords)
    # The job's store keeps the last vote's keys only: the first vote's are gone after the second.
    keys = coords[0].store.num_keys()
    assert _commit(jobs, 2) == [None] * world
    assert coords[0].store.num_keys() == keys == 5
    assert all((tmp_path / f"node{k}" / "step-00000002" / "COMMIT").exists() for k in range(world // per_node))


def test_a_rank_that_fails_fails_the_step_on_every_rank_of_every_node(tmp_path: Path) -> None:
    coords, _, jobs = _job(16, 4, tmp_path)
    outcomes = _commit(jobs, 1, failing=6)
    assert isinstance(outcomes[6], RuntimeError)
    for rank, o in enumerate(outcomes):
        if rank != 6:
            assert isinstance(o, CoordinationError) and "rank 6 failed: RuntimeError('disk full')" in str(o), o
    assert not list(tmp_path.glob("node*/step-00000001/COMMIT"))
    # The next vote commits, and the failed one's keys go with it: only the last vote's stay.
    assert _commit(jobs, 2) == [None] * 16
    assert coords[0].store.num_keys() == 5 and all(c.node is not None and c.node.store.num_keys() == 0 for c in coords)


def test_the_newest_step_whole_on_every_node_folds_up_a_tree_no_rank_hears_every_node_of(tmp_path: Path) -> None:
    world = 2 * FAN_IN + 6  # one rank per node: three levels of the tree
    coords, _, jobs = _job(world, 1, tmp_path)
    for step in (1, 2):
        assert _commit(jobs, step) == [None] * world
    (tmp_path / f"node{world - 1}" / "step-00000002" / "COMMIT").unlink()  # the deepest node lost step 2
    before = [c.counters["store_ops"] for c in coords]
    choices = lockstep([agree_on_step(j, "r/step", requested=None, remote_steps=list) for j in jobs])
    assert {c.step for c in choices} == {1}
    ops = [c.counters["store_ops"] - b for c, b in zip(coords, before, strict=True)]
    assert max(ops) <= 2 * FAN_IN + 8, ops  # a parent reads (and deletes) its children's folds, not every node's
    asked = lockstep([agree_on_step(j, "q/step", requested=2, remote_steps=list) for j in jobs], capture=True)
    assert all(f"saving rank(s) {world - 1} are on no rank's local tier" in str(e) for e in asked), asked[0]


def test_rank_0s_refusal_alone_gives_every_rank_no_step_after_the_same_exchange(tmp_path: Path) -> None:
    """``refuse`` (the memory tier, where rank 0's node's memory is another lineage's): rank 0's alone counts,
    and every rank takes part in the same exchange as for a choice, then learns that no step is restored."""
    world, per_node = 8, 2
    coords, _, jobs = _job(world, per_node, tmp_path)
    assert _commit(jobs, 1) == [None] * world

    def agree(name: str, refusing: set[int]) -> tuple[list[Any], list[int]]:
        before = [c.counters["store_ops"] for c in coords]
        out = lockstep([agree_on_step(j, name, requested=None, remote_steps=list,
                                      refuse="not ours" if j.coord.rank in refusing else None)
                        for j in jobs], capture=True)  # fmt: skip
        return out, [c.counters["store_ops"] - b for c, b in zip(coords, before, strict=True)]

    agree("a/step", set())  # in the first exchange after the vote, rank 0 also deletes the keys it kept for later
    chosen, ops = agree("b/step", set(range(1, world)))  # refusals of other ranks than 0 are not asked
    assert [c.step for c in chosen] == [1] * world
    refused, refused_ops = agree("c/step", {0})
    assert all(isinstance(e, CheckpointNotFoundError) and str(e) == "not ours" for e in refused), refused
    assert refused_ops == ops


def _node_1_meets_in_the_jobs_store(tmp_path: Path, *, serve_fails: int = 0, connect_fails: int = 0) -> Any:
    """8 ranks on 2 nodes open their nodes' channels, the ``serve_fails``-th serve or the
    ``connect_fails``-th connect failing (both on node 1); node 0 meets in its leader's store, node 1 in
    the job's, and a commit works. Returns the job's store."""
    store = dist.HashStore()
    coords = [Coordinator(store, rank=r, world_size=8, namespace="h", timeout_s=5) for r in range(8)]
    nodes = lockstep([join_nodes(c, f"node{c.rank // 4}") for c in coords])
    serve, connect = local_channel()
    calls = {"serve": 0, "connect": 0}

    def serve_or_not() -> tuple[Any, str]:
        calls["serve"] += 1
        if calls["serve"] == serve_fails:
            raise OSError("address already in use")
        return serve()

    def connect_or_not(address: str) -> Any:
        calls["connect"] += 1
        if calls["connect"] == connect_fails:
            raise RuntimeError("connection refused")
        return connect(address)

    for c, node in zip(coords, lockstep([open_channel(c, nodes[c.rank], serve_or_not, connect_or_not)
                                         for c in coords]), strict=True):  # fmt: skip
        c.node = node
    assert [c.node is not None and c.node.store is store for c in coords] == [False] * 4 + [True] * 4
    jobs = [Job(coord=c, nodes=nodes[c.rank], tier=LocalTier(tmp_path / f"node{c.rank // 4}", fsync=False))
            for c in coords]  # fmt: skip
    assert _commit(jobs, 1) == [None] * 8
    return store


def test_a_node_whose_ranks_cannot_reach_their_leaders_store_meets_in_the_jobs_store(tmp_path: Path) -> None:
    # The 4th connect is a rank of node 1 (containers of one host, each a network of its own).
    store = _node_1_meets_in_the_jobs_store(tmp_path, connect_fails=4)
    assert store.num_keys() == 5  # the channel's keys are gone; the vote's stay until the next


def test_a_leader_that_cannot_serve_its_nodes_store_leaves_its_node_in_the_jobs_store(tmp_path: Path) -> None:
    _node_1_meets_in_the_jobs_store(tmp_path, serve_fails=2)  # the 2nd serve is node 1's leader: no port free


def _two_saves(rank: int, world: int, root: str) -> dict[str, Any]:
    state = {"w": torch.full((64,), float(rank)), "step": torch.zeros(())}
    local = os.path.join(root, f"node{rank // 2}")
    with tiercheck.Checkpointer(state, local=local, distributed=tiercheck.DistributedOptions(timeout_s=30)) as ck:
        ck.save(1).wait()
        first = ck.stats()
        ck.save(2).wait()
        second = ck.stats()
    return {k: second[k] - first[k] for k in ("store_ops", "node_store_ops", "plans_made", "plans_reused")}


def test_a_save_that_reuses_its_plan_asks_the_jobs_store_nothing_on_ranks_that_lead_no_node(tmp_path: Path) -> None:
    results = run_ranks(_two_saves, 4, str(tmp_path))  # two ranks on each of two nodes
    for rank, got in enumerate(results):
        assert got["plans_made"] == 0 and got["plans_reused"] == 1, got
        assert got["node_store_ops"] > 0, got
        # A leader: four requests (and, the last to count in, the metadata's read and two decisions);
        # rank 0 also sets the save's metadata and deletes the previous vote's five keys.
        assert got["store_ops"] == 0 if rank % 2 else 4 <= got["store_ops"] <= (13 if rank == 0 else 7), (rank, got)


def test_nodes_of_one_host_learn_its_first_node_and_the_others_their_own() -> None:
    """A node's host is named by the first rank of the host's first node (``Nodes.host``): nodes 0
    and 2 share host A, node 1 is alone on B, and node 3 said no host (a host of its own)."""
    store = dist.HashStore()
    coords = [Coordinator(store, rank=r, world_size=8, namespace="h", timeout_s=5) for r in range(8)]
    hosts: list[str | None] = ["A", "A", "B", "B", "A", "A", None, None]
    nodes = join_in_lockstep(coords, [f"node{r // 2}" for r in range(8)], hosts)
    assert [n.host for n in nodes] == [0, 0, 2, 2, 0, 0, 6, 6]
    assert [n.number for n in nodes] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [n.first_on_host for n in nodes] == [None, None, None, None, 0, 0, None, None]
