"""bench/scale_sim.py --replace: one node of the simulated job replaced, its files held by peers' memory.

A node whose memory is gone (its tmpfs empty: no step, no file) restarts, and restores from the copies
``replicas`` peers hold of its files (``tiering.memory_peers``: the node's files of the step under their
own names in the peers' directories, counted by a replica marker, ``format.replicas``). The peers are
the nodes ``tiering.replication`` places them on (``format.replicas.placement``). The simulation copies
the node's manifest files of the restored step into its peers' directories, writes the markers, empties
the node's directory, and runs the restore's agreement (every rank) and planning (the simulated stage's
ranks and its coordinators' nodes, as the run without a replacement does) again, with tiercheck's own
code: ``restore.agree.agree_on_step`` counts the markers as holders, ``restore.holders.find_holders``
has a peer claim the node's saving ranks, and ``restore.plan.plan_restore`` routes the node's chunks
from the peer that holds them. What each rank pays is compared with the same job's restore without a
replacement, in the same run. Method and columns: bench/README.md (Scale simulation).
"""

from __future__ import annotations

import gc
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from scale_after import RANKS_PER_NODE, Cost, CountingTier, Sim, in_group, restore_plan

from tiercheck.format.codec import checksum
from tiercheck.format.paths import replica_marker, step_dir
from tiercheck.format.replicas import Replica, placement
from tiercheck.options import ReplicationOptions
from tiercheck.restore.agree import agree_on_step
from tiercheck.restore.plan import RestorePlan
from tiercheck.tiering.replication import replica_files
from tiercheck.tiers.local import LocalTier

STEP = 2  # the step the simulation restores (its second commit)


@dataclass(frozen=True)
class Baseline:
    """The same job's restore without a replacement: each planning rank's plan, and what it cost."""

    plans: dict[int, RestorePlan]
    agree: Cost
    plan: Cost
    read: dict[int, int]  # manifest bytes read, from its node's directory and the store
    cpu: dict[int, float]  # its own CPU seconds planning (``cpu_timed``)


def replace_node(sim: Sim, node: int, replicas: int) -> list[int]:
    """Node ``node``'s files of ``STEP`` copied into the directories of the ``replicas`` peers that
    hold its copies, each copy counted by its marker (as ``tiering.replication`` writes them); then its
    own directory emptied, as a replaced node's tmpfs is. Returns the peers."""
    peers, _ = placement(node, len(sim.tiers), ReplicationOptions(replicas=replicas))
    src, d = sim.tiers[node], step_dir(STEP)
    ranks = tuple(sim.nodes[node * RANKS_PER_NODE].ranks)
    files = replica_files(src, STEP, ranks)
    for peer in peers:
        tier = sim.tiers[peer]
        crcs = {}
        for name, _ in files:
            data = LocalTier.read(src, f"{d}/{name}")  # not a simulated rank's read
            tier.write(f"{d}/{name}", [data])
            crcs[name] = checksum(data)
        replica = Replica(STEP, ranks, sim.n, {n: (s, crcs[n]) for n, s in files}, f"node{node}")
        tier.publish(f"{d}/{replica_marker(ranks[0])}", replica.to_bytes())
    shutil.rmtree(src.local_path)
    src.local_path.mkdir()
    return peers


def _node_ranks(sim: Sim, nodes: Iterable[int]) -> list[int]:
    return sorted(r for k in nodes for r in sim.nodes[k * RANKS_PER_NODE].ranks)


def simulate_replace(sim: Sim, base: Baseline, *, replicas: int, node: int = 1) -> dict[str, Any]:
    """Replace ``node`` (its peers hold ``replicas`` copies) and restore again: what its ranks, its
    peers' ranks and the other planning ranks paid, against ``base`` (the module docstring)."""
    t0 = time.perf_counter()
    peers = replace_node(sim, node, replicas)
    replaced, held = _node_ranks(sim, [node]), _node_ranks(sim, peers)
    group = sim.group
    if not set(replaced + held) <= set(group):
        raise SystemExit(f"--replace: node {node} and its peers {peers} must plan (be in the simulated stage)")
    everyone = list(range(sim.n))
    choices, agree = sim.run(everyone, [agree_on_step(sim.job(r), "replace/step", requested=None, remote_steps=list)
                                        for r in everyone])  # fmt: skip
    if {c.step for c in choices} != {STEP}:
        raise AssertionError(f"the replaced job agreed on step(s) {sorted({c.step for c in choices})}, not {STEP}")
    CountingTier.reads.clear()
    start_in = {r: sim.coords[r].counters["store_bytes_in"] for r in group}
    in_group(sim, True)
    cpu: dict[int, float] = {}
    with own_heap():
        planned, plan = sim.run(group, [cpu_timed(r, restore_plan(sim, r, choices[r], "replace"), cpu) for r in group])
    in_group(sim, False)
    read = {r: CountingTier.reads.get(r, 0) + sim.coords[r].counters["store_bytes_in"] - start_in[r] for r in group}
    plans = dict(zip(group, planned, strict=True))
    others = sorted(set(group) - set(replaced) - set(held))
    after = _Run(plans, agree, plan, read, cpu)
    before = _Run(base.plans, base.agree, base.plan, base.read, base.cpu)
    return {
        "replicas": replicas,
        "replaced_node": node,
        "peer_nodes": peers,
        "planning_ranks": len(group),
        "replaced": after.summary(replaced),
        "peers": after.summary(held),
        "others": after.summary(others),
        "replaced_without": before.summary(replaced),
        "peers_without": before.summary(held),
        "others_without": before.summary(others),
        "others_reading_more": sum(after.plans[r].read_bytes > before.plans[r].read_bytes for r in others),
        "others_sending_more": sum(after.sends(r) > before.sends(r) for r in others),
        "others_extra_read_bytes": sum(max(0, after.plans[r].read_bytes - before.plans[r].read_bytes) for r in others),
        "replace_restore_plan_s": plan.time_s,
        "restore_plan_s": base.plan.time_s,
        "replace_sim_s": time.perf_counter() - t0,
    }


@contextmanager
def own_heap() -> Iterator[None]:
    """Within: the simulation's objects left out of Python's garbage collector (``gc.freeze``). The simulation
    holds every rank's state in one process, and a collection walks it all: it would charge a rank planning
    for the world's objects, which a real rank's process does not hold."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def cpu_timed(r: int, protocol: Any, cpu: dict[int, float]) -> Any:
    """``protocol``, its own steps' CPU seconds (``time.thread_time``) put in ``cpu[r]``: unlike the clock's
    seconds (``perf_counter``), they do not count the time this process waited for a core on a busy machine."""
    spent, value, first = 0.0, None, True
    while True:
        t0 = time.thread_time()
        try:
            barrier = next(protocol) if first else protocol.send(value)
        except StopIteration as stop:
            cpu[r] = spent + time.thread_time() - t0
            return stop.value
        spent += time.thread_time() - t0
        first = False
        value = yield barrier


@dataclass(frozen=True)
class _Run:
    """One restore's planning, per rank."""

    plans: Mapping[int, RestorePlan]
    agree: Cost
    plan: Cost
    read: Mapping[int, int]
    cpu: Mapping[int, float] | None = None  # its own steps' CPU seconds (``cpu_timed``)

    def sends(self, r: int) -> int:
        return sum(t.src == r for t in self.plans[r].transfers)

    def summary(self, ranks: list[int]) -> dict[str, Any]:
        """The most any of ``ranks`` paid: its own seconds planning, its store bytes and requests (the
        agreement's and the planning's), the manifest bytes it read, and what its plan has it read,
        send and receive."""
        p, a = self.plan, self.agree
        received = [sum(t.dst == r for t in self.plans[r].transfers) for r in ranks]
        return {
            "ranks": len(ranks),
            "plan_s_max": max(p.seconds[r] for r in ranks),
            "plan_cpu_s_max": max(self.cpu[r] for r in ranks) if self.cpu is not None else None,
            "store_bytes_max": max(p.bytes[r] + a.bytes[r] for r in ranks),
            "store_ops_max": max(p.ops[r] + a.ops[r] for r in ranks),
            "manifest_read_bytes_max": max(self.read[r] for r in ranks),
            "chunk_read_bytes_max": max(self.plans[r].read_bytes for r in ranks),
            "chunk_read_bytes_sum": sum(self.plans[r].read_bytes for r in ranks),
            "chunks_read_max": max(len(self.plans[r].reads) for r in ranks),
            "chunks_sent_max": max(self.sends(r) for r in ranks),
            "chunks_received_max": max(received),
        }


def table_rows(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The replacement's table (bench/README.md): per world size and role, the busiest rank's figures with the
    replacement / without it, in the same run."""
    from harness import fmt_bytes

    head = ["ranks (nodes)", "ranks of", "plan s (own)", "plan CPU s", "store bytes", "store requests", "manifest read",
            "chunk bytes read", "chunks sent"]  # fmt: skip
    out = []
    for row in rows:
        got = row.get("replace")
        if not got:
            continue
        where = f"{row['world_size']:,} ({row['nodes']:,})"
        for role, name in (("replaced", "the replaced node"), ("peers", "its peers"), ("others", "the others")):
            a, b = got[role], got[f"{role}_without"]

            def pair(key: str, fmt: Any = str, a: dict[str, Any] = a, b: dict[str, Any] = b) -> str:
                return f"{fmt(a[key])} / {fmt(b[key])}"

            cpu = "-" if a.get("plan_cpu_s_max") is None else f"{a['plan_cpu_s_max']:.3f}"
            if a.get("plan_cpu_s_max") is not None and b.get("plan_cpu_s_max") is not None:
                cpu = pair("plan_cpu_s_max", lambda v: f"{v:.3f}")
            out.append([where, f"{name} ({a['ranks']:,})", pair("plan_s_max", lambda v: f"{v:.3f}"), cpu,
                        pair("store_bytes_max", fmt_bytes), pair("store_ops_max"),
                        pair("manifest_read_bytes_max", fmt_bytes), pair("chunk_read_bytes_max", fmt_bytes),
                        pair("chunks_sent_max")])  # fmt: skip
    return head, out
