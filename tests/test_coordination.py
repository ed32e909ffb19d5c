"""The store protocols of a whole job, run for every rank in one process (``coordination.lockstep``).

Each rank's save plan, commit and restore plan is the same generator a real rank drives against the
TCPStore; here all of them share one in-memory store and one directory per simulated node, so the
results can be checked against the whole job at once and the cost per rank compared across sizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.test_planner import descs, megatron_like
from tiercheck.cluster.assign import LeafDesc, Need
from tiercheck.cluster.coordination import Coordinator, lockstep, shard_of
from tiercheck.cluster.job import Job
from tiercheck.cluster.nodes import join_in_lockstep
from tiercheck.errors import CorruptCheckpointError
from tiercheck.format.codec import CHECKSUM_BYTES, chunk_nbytes, seal
from tiercheck.format.layout import chunks_in_box
from tiercheck.format.manifest import RankPart
from tiercheck.format.paths import part_file
from tiercheck.format.saveid import new_save_id
from tiercheck.format.shards import owners_bytes, shard_bytes
from tiercheck.format.steps import read_manifest
from tiercheck.restore.agree import agree_on_step
from tiercheck.restore.holders import find_holders
from tiercheck.restore.needed import manifest_for
from tiercheck.restore.plan import ReadRequest, plan_restore
from tiercheck.save.plan import plan_save
from tiercheck.save.vote import RankOutcome, commit_save
from tiercheck.tiers.local import LocalTier

PER_NODE = 4


def job(world: int, root: Path) -> tuple[list[Coordinator], list[LocalTier], list[Any]]:
    store = dist.HashStore()
    coords = [Coordinator(store, rank=r, world_size=world, namespace="t", timeout_s=5) for r in range(world)]
    tiers = [LocalTier(root / f"node{r // PER_NODE}", fsync=False) for r in range(world)]
    nodes = join_in_lockstep(coords, [f"node{r // PER_NODE}" for r in range(world)])
    return coords, tiers, nodes


def hsdp_like(world: int, shard: int) -> list[list[LeafDesc]]:
    """Arrays cut on rows over ``shard`` ranks, the groups of ``shard`` replicas of each other (HSDP):
    with chunks of a piece's size, each piece is written by one of its replicas."""
    return [
        [d for k in range(4) for d in descs(f"w{k}", (8 * shard, 8), [((8 * (r % shard), 0), (8, 8))])]
        for r in range(world)
    ]


def save(world: int, tp: int, root: Path, per_rank: list[list[LeafDesc]] | None = None) -> list[list[LeafDesc]]:
    """Plan and commit step 1 of the Megatron-like layout, or of ``per_rank`` (chunk data is not written)."""
    per_rank = per_rank or megatron_like(world, tp)
    coords, tiers, nodes = job(world, root)
    plans = lockstep([plan_save(c, 0, per_rank[c.rank], target_chunk_bytes=256) for c in coords])
    commits = []
    for c in coords:
        plan = plans[c.rank]
        crcs: dict[str, dict[str, int]] = {}
        offsets: dict[str, dict[str, int]] = {}
        sizes: dict[str, int] = {}
        end = 0
        for t in plan.tasks:  # laid end to end in the rank's pack, as a save places them
            path = per_rank[c.rank][t.leaf].path
            crcs.setdefault(path, {})[t.chunk.key] = c.rank
            offsets.setdefault(path, {})[t.chunk.key] = end
            sizes[path] = chunk_nbytes(plan.records[path])
            end += sizes[path] + CHECKSUM_BYTES
        tree = {"model": {d.path: {"$tensor": d.path} for d in per_rank[c.rank]}, "rank": c.rank}
        save = new_save_id(nodes[c.rank].run, 1, 0)
        part = seal(RankPart(tree, crcs, offsets, sizes, save).to_bytes())
        shard = seal(shard_bytes(plan.shard, save)) if plan.shard else None
        owners = seal(owners_bytes(plan.shard, save)) if plan.shard else None
        commits.append(
            commit_save(
                Job(coord=c, nodes=nodes[c.rank], tier=tiers[c.rank]),
                RankOutcome(
                    step=1,
                    attempt=0,
                    save_id=save,
                    part=part,
                    shard=shard,
                    owners=owners,
                    metadata={"m": 1},
                    library_version="t",
                ),
            )
        )
    lockstep(commits)
    # The job's store keeps only this vote's five keys, which node 0's leader deletes at the next
    # vote (when every leader is past this one); the nodes' stores keep nothing.
    assert coords[0].store.num_keys() == len(coords[0].later) == 5
    assert all(c.node is not None and c.node.store.num_keys() == 0 for c in coords)
    return per_rank


def agreed_manifest(rank_job: Job, parts: dict[int, RankPart] | None = None, host: str | None = None) -> Any:
    """A restore's rounds 1 and 2 on one rank, in lockstep with the others: the newest step, its
    holders and its manifest (as ``restore.protocol`` runs them, under the name ``r``)."""
    choice = yield from agree_on_step(rank_job, "r/step", requested=None, remote_steps=list)
    here = choice.held.get(str(choice.step), [[], 0])[0]
    st = yield from find_holders(rank_job, "r", choice.step, here, from_remote=False, host=host)
    manifest = yield from manifest_for(rank_job, "r", st, {}, others=False, parts=parts)
    return st, manifest


def restore_plan(
    world: int, root: Path, needs: list[list[Need]], *, hosts: bool = False, alone: bool = False
) -> tuple[list[Any], list[Coordinator]]:
    """Every rank's restore plan; with ``hosts``, each rank asks as ``restore.protocol`` does, with
    its node and a host key (one host per node); with ``alone``, also with the saving ranks' parts
    it parsed, so it reads the chunks its own saving rank wrote without a coordinator."""
    coords, tiers, nodes = job(world, root)

    def one(c: Coordinator) -> Any:
        rank_job = Job(coord=c, nodes=nodes[c.rank], tier=tiers[c.rank])
        parts: dict[int, RankPart] = {}
        host = f"host{c.rank // PER_NODE}" if hosts else None
        st, manifest = yield from agreed_manifest(rank_job, parts, host)
        asked = ReadRequest(
            needs=needs[c.rank], records=manifest.arrays, read_once=False, host=host,
            parts=parts if alone else {},
        )  # fmt: skip
        plan = yield from plan_restore(rank_job, "r", st, asked)
        return manifest, plan

    return lockstep([one(c) for c in coords]), coords


@pytest.mark.parametrize(
    ("world", "tp", "hosts", "alone"),
    [(8, 2, False, False), (16, 4, False, False), (16, 2, True, False), (16, 2, True, True), (16, 0, True, True)],
)
def test_every_needed_chunk_is_read_or_received_exactly_as_planned(
    tmp_path: Path, world: int, tp: int, hosts: bool, alone: bool
) -> None:
    """``tp`` 0: the HSDP-like layout (replicas of FSDP pieces, each piece written by one of them)."""
    per_rank = save(world, tp, tmp_path, None if tp else hsdp_like(world, 8))
    needs = [[Need(d.path, d.offsets, d.shape) for d in leaves] for leaves in per_rank]
    results, _ = restore_plan(world, tmp_path, needs, hosts=hosts, alone=alone)
    whole = read_manifest(_merged(tmp_path, world), 1)
    sends: dict[tuple[int, int], tuple[int, int, str, tuple[int, ...]]] = {}
    for rank, (manifest, plan) in enumerate(results):
        assert manifest.tree(rank)["rank"] == rank  # its own saving rank's tree
        got = {(x.path, x.chunk.coords) for x in plan.reads}
        for x in plan.reads:  # read on the node holding the file, with the writer's checksum
            rec = plan.records[x.path]
            owner = whole.arrays[x.path].owner(x.chunk.key)
            assert owner // PER_NODE == rank // PER_NODE and rec.checksums[x.chunk.key] == owner
        for t in plan.transfers:
            if t.dst == rank:
                got.add((t.path, t.chunk.coords))
            # Through shared memory exactly between ranks of one host (here: of one node).
            assert t.shared == (hosts and t.src // PER_NODE == t.dst // PER_NODE), t
            key = (t.src, t.dst, t.path, t.chunk.coords)
            assert sends.setdefault((t.tag, t.dst), key) == key, "a tag and its receiver pair one send with one receive"
        wanted = {
            (n.path, c.coords)
            for n in needs[rank]
            for c in chunks_in_box(whole.arrays[n.path].shape, whole.arrays[n.path].chunks, n.offsets, n.shape)
        }
        assert got == wanted, rank
    for src, _, path, coords in sends.values():  # a sender reads what it sends
        assert (path, coords) in {(x.path, x.chunk.coords) for x in results[src][1].reads}
    reads = [(x.path, x.chunk.coords) for _, plan in results for x in plan.reads]
    assert len(reads) == len(set(reads)), "each chunk is on one node: read there once, by one rank"
    if alone:  # a writer reads its own chunks: an optimizer slice is read by the rank that wrote it
        for rank, (_, plan) in enumerate(results):
            for x in plan.reads:
                owner = whole.arrays[x.path].owner(x.chunk.key)
                assert owner == rank or not x.path.startswith("optim"), (rank, x)


def test_replicas_say_their_needs_once_and_hear_their_routes_once(tmp_path: Path, monkeypatch: Any) -> None:
    """Ranks needing the same boxes of a coordinator's arrays (data-parallel replicas) post them
    once and register themselves; the coordinator answers the group once, not each rank."""
    world = 16
    per_rank = save(world, 2, tmp_path)
    needs = [[Need(d.path, d.offsets, d.shape) for d in leaves] for leaves in per_rank]
    posted: list[str] = []
    values: list[str] = []
    told: list[str] = []
    post, multi_set = Coordinator.post, Coordinator.multi_set

    def counting_post(self: Coordinator, bucket: str, value: str | bytes) -> int:
        posted.append(bucket)
        values.append(str(value))
        return post(self, bucket, value)

    def counting_set(self: Coordinator, items: Any) -> None:
        told.extend(k for k in items if "/reads/route/" in k)
        multi_set(self, items)

    monkeypatch.setattr(Coordinator, "post", counting_post)
    monkeypatch.setattr(Coordinator, "multi_set", counting_set)
    _, coords = restore_plan(world, tmp_path, needs, hosts=True)
    groups: dict[tuple[int, str], set[int]] = {}
    for rank, rank_needs in enumerate(needs):
        by_coord: dict[int, list[Need]] = {}
        for n in rank_needs:
            by_coord.setdefault(shard_of(n.path, world), []).append(n)  # one coordinator per shard
        for c, ns in by_coord.items():
            groups.setdefault((c, repr(ns)), set()).add(rank)
    assert any("optim" in v for v in values)  # without their parts, ranks post their slices
    needs_posts = [b for b in posted if "/reads/needs/" in b]
    assert len(needs_posts) == len(told) == len(groups) < sum(map(len, groups.values()))
    assert max(map(len, groups.values())) == world  # the norm: every rank needs all of it, and says so once
    assert not any(coords[0].has(k) for k in told)  # each deleted once every rank has read it
    # Restoring the layout it saved, a rank reads the chunks its saving rank wrote alone: no
    # coordinator hears of a distributed optimizer's slices (each is its rank's alone).
    values.clear()
    restore_plan(world, tmp_path, needs, hosts=True, alone=True)
    assert any('"fc"' in v for v in values) and not any("optim" in v for v in values)


def test_a_writer_joins_its_replicas_group_rather_than_be_told_apart(tmp_path: Path, monkeypatch: Any) -> None:
    """Each FSDP piece is written by one of its two replicas. A writer reads its pieces alone only
    while no replica has asked for them (ranks 0-7 ask first here); one that finds its replicas'
    group posted joins it, and its coordinators need not tell it apart how to serve them."""
    world = 16
    per_rank = save(world, 0, tmp_path, hsdp_like(world, 8))
    arrays = read_manifest(_merged(tmp_path, world), 1).arrays
    written = {(p, key): o for p, rec in arrays.items() for key, o in rec.owners.items()}
    owners = set(written.values())
    assert any(o < 8 for o in owners) and any(o >= 8 for o in owners)  # both replicas write
    needs = [[Need(d.path, d.offsets, d.shape) for d in leaves] for leaves in per_rank]
    told: list[int] = []
    post = Coordinator.post

    def counting_post(self: Coordinator, bucket: str, value: str | bytes) -> int:
        if "/reads/work/" in bucket:
            told.append(int(bucket.rsplit("/", 1)[1]))
        return post(self, bucket, value)

    monkeypatch.setattr(Coordinator, "post", counting_post)
    results, _ = restore_plan(world, tmp_path, needs, hosts=True, alone=True)
    assert told and set(told) <= {o for o in owners if o < 8}  # the writers that asked first
    for rank, (_, plan) in enumerate(results):  # and every writer reads what it wrote, nothing else
        assert {(x.path, x.chunk.key) for x in plan.reads} == {k for k, o in written.items() if o == rank}


def test_a_rank_reads_only_the_manifest_it_needs(tmp_path: Path) -> None:
    """Restoring, a rank's store traffic follows what it holds, not the job's size."""
    per_rank_bytes = []
    for world in (8, 64):
        per_rank = save(world, 2, tmp_path / str(world))
        needs = [[Need(d.path, d.offsets, d.shape) for d in leaves] for leaves in per_rank]
        results, coords = restore_plan(world, tmp_path / str(world), needs)
        # Each rank holds its own arrays' records, without the other arrays of the shards it read.
        for rank, (manifest, _) in enumerate(results):
            assert set(manifest.arrays) == {d.path for d in per_rank[rank]}
            # and its own saving rank's tree: nothing per saving rank (a list of them was 1 MiB at 131,072)
            assert manifest.tree_of_rank == {rank: 0} and manifest.world_size == world
        per_rank_bytes.append(sum(c.store_bytes for c in coords) / world)
    assert per_rank_bytes[1] < 1.5 * per_rank_bytes[0], per_rank_bytes


def test_a_damaged_part_on_one_node_fails_every_rank_alike(tmp_path: Path) -> None:
    save(8, 2, tmp_path)
    part = tmp_path / "node1" / "step-00000001" / part_file(5)
    data = part.read_bytes()
    part.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # the checksum's last byte, changed whatever it was
    coords, tiers, nodes = job(8, tmp_path)
    protocols = [_restore_until_manifest(c, tiers[c.rank], nodes[c.rank]) for c in coords]
    outcomes = lockstep(protocols, capture=True)
    # Damage is a verdict every rank shares (as itself, not as "rank 5 failed"): they can then
    # agree to restore an older step together.
    for rank in range(8):
        assert isinstance(outcomes[rank], CorruptCheckpointError), outcomes[rank]
        assert str(outcomes[rank]) == str(outcomes[5]) and f"node1: step 1: {part_file(5)}" in str(outcomes[rank])


def _restore_until_manifest(c: Coordinator, tier: LocalTier, node: Any) -> Any:
    rank_job = Job(coord=c, nodes=node, tier=tier)
    choice = yield from agree_on_step(rank_job, "r/step", requested=None, remote_steps=list)
    here = choice.held.get(str(choice.step), [[], 0])[0]
    st = yield from find_holders(rank_job, "r", choice.step, here, from_remote=False)
    return (yield from manifest_for(rank_job, "r", st, {}, others=False))


def _merged(root: Path, world: int) -> LocalTier:
    """Every node's copy of step 1 in one directory, as the remote tier holds it."""
    import shutil

    merged = root / "merged"
    for k in range((world + PER_NODE - 1) // PER_NODE):
        shutil.copytree(root / f"node{k}" / "step-00000001", merged / "step-00000001", dirs_exist_ok=True)
    return LocalTier(merged)


def test_a_store_whose_host_is_gone_fails_with_the_librarys_error(tmp_path: Path) -> None:
    """The process hosting the job's store (rank 0 with a tcp:// init, or the launcher) is killed:
    every store call of the others is ``CoordinationError`` saying so, never torch's raw
    ``DistNetworkError``."""
    import signal
    import subprocess
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    from tests.servers import free_port
    from tiercheck.errors import CoordinationError

    port = free_port()
    ready = tmp_path / "ready"
    host = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, pathlib, datetime, torch.distributed as d; "
         f"s = d.TCPStore('127.0.0.1', {port}, 2, is_master=True, wait_for_workers=False, "
         "timeout=datetime.timedelta(seconds=30)); s.set('up', '1'); "
         f"pathlib.Path({str(ready)!r}).touch(); time.sleep(120)"]
    )  # fmt: skip
    try:
        client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))
        client.wait(["up"])
        coord = Coordinator(client, rank=1, world_size=2, namespace="t", timeout_s=2)
        coord.set("k", "v")
    finally:
        host.send_signal(signal.SIGKILL)
        host.wait()
    # decide first: it waits for an answer (a set alone is sent without one, and can seem to succeed).
    for call in (lambda: coord.decide("d", "go"), lambda: coord.add("n", 1), lambda: coord.append("a", "x"),
                 lambda: coord.multi_set({"m": "1"}), lambda: coord.set("k", "w")):  # fmt: skip
        with pytest.raises(CoordinationError, match="the job's store: the process hosting it"):
            call()
