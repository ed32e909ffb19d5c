"""bench/scale_sim.py's "after": tiercheck's own protocols for a simulated job, in one process.

Every rank of the job joins its node and opens its node's channel (``cluster.nodes``), commits two
saves (``save.vote.commit_save``: its manifest part into a directory per simulated node of 8
ranks, no chunk data) and agrees on the step to restore (``restore.agree.agree_on_step``): all of
them, for real. The save plan and the restore's planning (``save.plan.plan_save``,
``restore.holders.find_holders``, ``restore.needed.manifest_for``, ``restore.plan.plan_restore``)
run for the ranks given descriptions (every rank, or with ``--stage`` the ranks of one pipeline
stage) and the nodes of their arrays' coordinators; the other stages' ranks do the same work on
other arrays (symmetry, ``scale_model``), and take the manifest part of the rank at their place in
the simulated stage for their commit. Method and columns: bench/README.md (Scale simulation).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

import torch.distributed as dist
from scale_model import Clock, SimCoordinator, Timed

from tiercheck import __version__
from tiercheck.cluster.assign import LeafDesc, Need
from tiercheck.cluster.coordination import lockstep, shard_of
from tiercheck.cluster.job import Job
from tiercheck.cluster.nodes import Nodes, join_in_lockstep
from tiercheck.format.codec import chunk_nbytes, seal
from tiercheck.format.manifest import RankPart
from tiercheck.format.saveid import new_save_id
from tiercheck.format.shards import owners_bytes, shard_bytes
from tiercheck.restore.agree import StepChoice, agree_on_step, settle
from tiercheck.restore.holders import find_holders
from tiercheck.restore.needed import manifest_for
from tiercheck.restore.plan import ReadRequest, plan_restore
from tiercheck.save.plan import SavePlan, plan_save
from tiercheck.save.vote import RankOutcome, commit_save
from tiercheck.tiers.local import LocalTier

RANKS_PER_NODE = 8


class CountingTier(LocalTier):
    """A node's directory that counts the bytes each simulated rank reads from it."""

    current: ClassVar[list[int]] = [0]  # the simulated rank whose protocol runs (set by the runner)
    reads: ClassVar[dict[int, int]] = {}

    def read(self, path: str) -> bytearray:
        data = super().read(path)
        self.reads[self.current[0]] = self.reads.get(self.current[0], 0) + len(data)
        return data


def tree(descs: list[LeafDesc]) -> dict[str, Any]:
    """The state tree a rank saves, approximated: nested dicts along each path's components."""
    root: dict[str, Any] = {}
    for d in descs:
        *parents, name = d.path.split("/")
        node = root
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = {"$tensor": d.path}
    return root


def _part(descs: list[LeafDesc], plan: SavePlan, save: str) -> bytes:
    """The rank's manifest part as ``Checkpointer`` writes it, its chunks laid out as a pack is."""
    crcs: dict[str, dict[str, int]] = {}
    offsets: dict[str, dict[str, int]] = {}
    sizes: dict[str, int] = {}
    end = 0
    for t in plan.tasks:
        path = descs[t.leaf].path
        sizes[path] = chunk_nbytes(plan.records[path])
        crcs.setdefault(path, {})[t.chunk.key] = 0
        offsets.setdefault(path, {})[t.chunk.key] = end
        end += sizes[path] + 4
    return seal(RankPart(tree(descs), crcs, offsets, sizes, save).to_bytes())


class Sim:
    """One simulated job: its coordinators, nodes, node directories and clocks."""

    def __init__(self, descs: list[list[LeafDesc]], tmp: Path, args: argparse.Namespace) -> None:
        n = self.n = len(descs)
        self.descs, self.args = descs, args
        self.store = dist.HashStore()
        self.clocks = [Clock() for _ in range(n)]
        stamps: dict[str, float] = {}
        self.coords = [
            SimCoordinator(self.store, rank=r, world_size=n, namespace="sim", timeout_s=60, clock=self.clocks[r],
                           stamps=stamps, rtt_s=args.rtt_ms / 1e3)
            for r in range(n)
        ]
        self.tiers = [CountingTier(tmp / f"node{k}", fsync=False) for k in range(-(-n // RANKS_PER_NODE))]
        self.nodes: list[Nodes] = join_in_lockstep(self.coords, [f"node{r // RANKS_PER_NODE}" for r in range(n)])
        described = {r for r in range(n) if descs[r]}
        coordinators = {shard_of(d.path, n) for r in described for d in descs[r]}
        self.group = sorted({m for r in described | coordinators for m in self.nodes[r].ranks})
        self.stage = sorted(described)  # ranks whose parts the others take by symmetry

    def job(self, r: int) -> Job:
        return Job(coord=self.coords[r], nodes=self.nodes[r], tier=self.tiers[r // RANKS_PER_NODE])

    def run(self, ranks: list[int], protocols: list[Any]) -> tuple[list[Any], Cost]:
        """Run the ranks' protocols from clocks at 0 (in lockstep, each rank's own steps timed):
        their results, and what they cost."""
        for r in ranks:
            self.clocks[r].now = 0.0
        pairs = [(self.coords[r], self.coords[r].node) for r in ranks]
        before = [(dict(g.counters), dict(nd.counters) if nd else {}) for g, nd in pairs]
        timed = Timed(self.n, self.clocks)

        def tracked(i: int, p: Any) -> Any:
            inner = timed.wrap(i, p)
            try:
                CountingTier.current[0] = i
                barrier = next(inner)
                while True:
                    value = yield barrier
                    CountingTier.current[0] = i
                    barrier = inner.send(value)
            except StopIteration as stop:
                return stop.value

        results = lockstep([tracked(r, p) for r, p in zip(ranks, protocols, strict=True)])
        cost = Cost(time_s=max(self.clocks[r].now for r in ranks), rank0_peak=timed.rank0_peak)
        node_ops: dict[int, int] = {}
        for r, (g, nd), (bg, bn) in zip(ranks, pairs, before, strict=True):
            moved = {k: g.counters[k] - bg[k] for k in bg}
            cost.bytes[r] = moved["store_bytes_out"] + moved["store_bytes_in"]
            cost.ops[r] = moved["store_ops"]
            cost.server_ops += moved["store_ops"]
            cost.seconds[r] = timed.seconds[r]
            if nd is not None and nd.store is not g.store:
                k = self.nodes[r].number
                node_ops[k] = node_ops.get(k, 0) + nd.counters["store_ops"] - bn["store_ops"]
        cost.node_server_ops_max = max(node_ops.values(), default=0)
        return results, cost


class Cost:
    """What a protocol cost: per rank (bytes and requests to the job's store, own seconds), the job's
    store's requests in all, the busiest node store's, the time it took, rank 0's peak allocation."""

    def __init__(self, *, time_s: float, rank0_peak: int) -> None:
        self.time_s, self.rank0_peak = time_s, rank0_peak
        self.bytes: dict[int, int] = {}
        self.ops: dict[int, int] = {}
        self.seconds: dict[int, float] = {}
        self.server_ops = 0
        self.node_server_ops_max = 0


def _commit(sim: Sim, plans: dict[int, SavePlan], parts: dict[tuple[int, int], bytes], r: int, step: int) -> Any:
    """Rank ``r``'s commit of ``step``: its manifest part (by symmetry, that of the simulated rank at
    its place in the stage), and its shard of the arrays it coordinates, if any."""
    rep = r if sim.descs[r] else sim.stage[r % len(sim.stage)]
    save = new_save_id(sim.nodes[r].run, step, 0)
    if (rep, step) not in parts:
        parts[rep, step] = _part(sim.descs[rep], plans[rep], save)
    own = plans.get(r)
    shard = own.shard if own is not None and own.shard else None
    outcome = RankOutcome(
        step=step,
        attempt=0,
        save_id=save,
        part=parts[rep, step],
        shard=seal(shard_bytes(shard, save)) if shard else None,
        owners=seal(owners_bytes(shard, save)) if shard else None,
        metadata={"simulated": True},
        library_version=__version__,
    )
    return (yield from commit_save(sim.job(r), outcome))


def restore_plan(sim: Sim, r: int, choice: StepChoice, name: str = "restore0") -> Any:
    """What ``restore.protocol`` runs after agreeing on the step and before moving bytes, for a rank
    restoring the layout it saved (the live state is not built: its needs are the pieces it holds)."""
    job = sim.job(r)
    assert choice.step is not None
    here, _, own = choice.held.get(str(choice.step), [[], 0, []])  # a replaced node holds none
    # As ``restore.protocol`` asks (``restore.read.share_key``): with its node's host (one host per node: its
    # first rank), so the reads are planned per node and shared memory is used in one.
    host = str(sim.nodes[r].host)
    st = yield from find_holders(job, name, choice.step, here, own, from_remote=False, host=host)
    parts: dict[int, RankPart] = {}  # the saving ranks' parts it parses (its own: it reads its chunks alone)
    manifest = yield from manifest_for(job, name, st, {}, others=False, parts=parts)
    yield from settle(job, f"{name}/prepared", None)
    needs = [Need(d.path, d.offsets, d.shape) for d in sim.descs[r]]
    request = ReadRequest(needs=needs, records=manifest.arrays, read_once=False, parts=parts, host=host)
    return (yield from plan_restore(job, name, st, request))


def in_group(sim: Sim, on: bool) -> None:
    nodes = len({sim.nodes[r].number for r in sim.group})
    for r in sim.group:
        c = sim.coords[r]
        c.participants = len(sim.group) if on else sim.n
        c.nodes_total, c.participant_nodes = sim.nodes[r].count, nodes if on else 0


def simulate_after(descs: list[list[LeafDesc]], args: argparse.Namespace) -> dict[str, Any]:
    """The row of one layout and world size (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="tiercheck-scale-") as tmp:
        t0 = time.perf_counter()
        sim = Sim(descs, Path(tmp), args)
        group, everyone = sim.group, list(range(sim.n))
        join_s = time.perf_counter() - t0
        in_group(sim, True)
        planned, plan = sim.run(group, [plan_save(sim.coords[r], 0, descs[r], target_chunk_bytes=args.chunk_bytes)
                                        for r in group])  # fmt: skip
        in_group(sim, False)
        plans = dict(zip(group, planned, strict=True))
        parts: dict[tuple[int, int], bytes] = {}
        _, first = sim.run(everyone, [_commit(sim, plans, parts, r, 1) for r in everyone])
        files = sum(len(t.sizes("step-00000001")) for t in sim.tiers)
        _, second = sim.run(everyone, [_commit(sim, plans, parts, r, 2) for r in everyone])
        del parts
        choices, latest = sim.run(everyone, [agree_on_step(sim.job(r), "restore0/step", requested=None,
                                                            remote_steps=list) for r in everyone])  # fmt: skip
        CountingTier.reads.clear()
        start_in = {r: sim.coords[r].counters["store_bytes_in"] for r in group}
        in_group(sim, True)
        protocols = [restore_plan(sim, r, choices[r]) for r in group]
        cpu: dict[int, float] = {}  # with --replace, each rank's own CPU seconds (the replacement's are too)
        heap: Any = contextlib.nullcontext()
        if getattr(args, "replace", 0):
            from scale_replace import cpu_timed, own_heap

            protocols = [cpu_timed(r, p, cpu) for r, p in zip(group, protocols, strict=True)]
            heap = own_heap()
        with heap:
            restored, restore = sim.run(group, protocols)
        in_group(sim, False)
        read = {r: CountingTier.reads.get(r, 0) + sim.coords[r].counters["store_bytes_in"] - start_in[r] for r in group}
        keys_left = sim.store.num_keys()
        replaced = None
        if getattr(args, "replace", 0):  # a node replaced, its files in peers' memory (bench/scale_replace.py)
            from scale_replace import Baseline, simulate_replace

            base = Baseline(dict(zip(group, restored, strict=True)), latest, restore, read, cpu)
            replaced = simulate_replace(sim, base, replicas=args.replace)
    row = _row(sim, plans, plan, first, second, latest, restore, read, files=files, keys_left=keys_left,
               join_s=join_s)  # fmt: skip
    return row if replaced is None else {**row, "replace": replaced}


def _row(sim: Sim, plans: dict[int, SavePlan], plan: Cost, first: Cost, second: Cost, latest: Cost, restore: Cost,
         read: dict[int, int], *, files: int, keys_left: int, join_s: float) -> dict[str, Any]:  # fmt: skip
    n, stage = sim.n, sim.stage
    coordinators = {r for r, p in plans.items() if p.shard}

    def busiest(per_rank: dict[int, Any]) -> Any:
        """The most a rank pays. Where one stage was planned, a rank holds pieces of its own stage
        and may coordinate arrays of another: the most a holder pays plus the most a coordinator
        pays (an upper bound)."""
        if len(sim.group) == n:
            return max(per_rank.values())
        top = max((v for r, v in per_rank.items() if r not in coordinators), default=0)
        return top + max((per_rank.get(r, 0) for r in coordinators), default=0)

    save_bytes = {r: first.bytes[r] + plan.bytes.get(r, 0) for r in range(n)}
    save_ops = {r: first.ops[r] + plan.ops.get(r, 0) for r in range(n)}
    restore_bytes = {r: latest.bytes[r] + restore.bytes.get(r, 0) for r in range(n)}
    scale = n / len(sim.group)  # the plan's requests for the whole job, by symmetry
    rep = [plans[sim.stage[r % len(stage)]] for r in range(len(stage))]
    packs = sum(bool(p.tasks) for p in rep) * n // len(stage)
    return {
        "nodes": sim.nodes[0].count,
        "simulated_plan_ranks": len(sim.group),
        "store_bytes_max_rank": busiest(save_bytes),
        "store_ops_max_rank": busiest(save_ops),
        "store_bytes_total": sum(plan.bytes.values()),
        "store_ops_server_per_save": second.server_ops,
        "store_ops_server_per_node": second.server_ops / sim.nodes[0].count,
        "store_ops_server_first_save": first.server_ops + round(plan.server_ops * scale),
        "node_store_ops_per_save": second.node_server_ops_max,
        "rank0_coord_peak_bytes": max(c.rank0_peak for c in (plan, first, second, latest, restore)),
        "plan_s_max_rank": busiest(plan.seconds),
        "plan_s_mean_rank": sum(plan.seconds.values()) / len(plan.seconds),
        "commit_s": max(first.time_s, second.time_s),
        "commit_server_ops": second.server_ops,
        "find_latest_s": latest.time_s,
        "first_save_store_bytes": busiest(save_bytes),
        "second_save_store_bytes": max(second.bytes.values()),
        "commit_store_bytes_per_save": sum(second.bytes.values()),
        "objects_per_step": files + 2 * packs,  # + a pack and a reference map per rank with chunks
        "manifest_bytes_read_max_rank": busiest(read),
        "restore_plan_s_max_rank": busiest(restore.seconds),
        "restore_store_bytes_max_rank": busiest(restore_bytes),
        "restore_store_ops_max_rank": busiest({r: latest.ops[r] + restore.ops.get(r, 0) for r in range(n)}),
        "find_latest_server_ops": latest.server_ops,
        "arrays": sum(len(p.shard) for p in plans.values()),
        "chunks": sum(len(p.tasks) for p in plans.values()),
        "store_keys_left": keys_left,
        "join_s": join_s,
    }
