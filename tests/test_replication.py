"""Peer replication (``ReplicationOptions``): a lost node restores from its peers' local copies.

Real processes in a gloo group (``tests/distributed.py``), 8 ranks as TP=2 x PP=2 x DP=2 on 4 simulated
nodes of 2 ranks (each its own directory), no remote tier unless a test says so. Node i's files go to nodes
i+1 .. i+replicas (jump 1): with ``replicas=1`` node 3's copy is on node 0, node 0's on node 1.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, cast

import pytest
from click.testing import CliRunner

import tiercheck
from tiercheck.cli import main
from tiercheck.format.paths import rank_files, step_dir
from tiercheck.format.replicas import placement
from tiercheck.restore.agree import held_steps
from tiercheck.tiers.local import LocalTier

from .distributed import run_ranks
from .ondisk import flip_chunk_byte, written_by
from .test_distributed import SAVED, Layout, check_model, global_tensors, model_state, node_dir

NODES, PER_NODE = 4, 2


def _save(rank: int, world: int, root: str, replicas: int, remote: str | None) -> dict[str, Any]:
    state = model_state(SAVED, rank, seed=2)
    options = tiercheck.ReplicationOptions(replicas=replicas, piece_bytes=1 << 16, timeout_s=60)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, PER_NODE), remote=remote, replication=options) as ck:
        handles = [ck.save(s) for s in (1, 2)]
        replicated = [h.replicated.result(timeout=90) for h in handles]
        status = ck.status()["replication"]
    return {"replicated": replicated, "status": status}


def _restore(rank: int, world: int, root: str, remote: str | None) -> dict[str, Any]:
    state = model_state(SAVED, rank, seed=2, fill=-1.0)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, PER_NODE), remote=remote) as ck:
        try:
            step = ck.restore()
        except tiercheck.CheckpointNotFoundError as e:
            return {"step": None, "error": str(e)}
        stats = ck.stats()
        return {
            "step": step,
            "tensors": check_model(state, 2),  # bit for bit against the saved global tensors
            "info": state["rank_info"],
            "read": stats["restore_bytes_read"],
            "received": stats["restore_chunks_received"],
            "copies": stats["restore_copies_passed_over"],
        }


def _saved(root: Path, replicas: int, remote: str | None = None) -> list[dict[str, Any]]:
    return run_ranks(_save, 8, str(root), replicas, remote, timeout=240)


@pytest.fixture(scope="module")
def replicated_1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 2 with one replica per node, drained to a file:// remote too (for the fallback test)."""
    root = tmp_path_factory.mktemp("replicas1")
    results = _saved(root, 1, (root / "remote").as_uri())
    for rank, r in enumerate(results):
        leader = rank % PER_NODE == 0
        assert r["replicated"] == [leader, leader], (rank, r)  # the other ranks' handles: False, as documented
        if leader:
            assert r["status"]["replicated"] == 2 and r["status"]["received"] == 2 and r["status"]["failed"] == 0
    return root


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("remote"))
    return dst


def _check_restored(results: list[dict[str, Any]], wiped: list[int], step: int = 2) -> None:
    for rank, r in enumerate(results):
        assert r["step"] == step, r
        assert r["tensors"] > 0 and r["info"] == {"rank": rank, "coords": list(SAVED.coords(rank))}
        if rank // PER_NODE in wiped:  # nothing of its own to read: every chunk came from a peer
            assert r["read"] == 0 and r["received"] > 0, (rank, r)


def test_each_node_holds_its_peers_replica_and_drains_only_its_own_files(replicated_1: Path) -> None:
    for i in range(NODES):
        tier = LocalTier(replicated_1 / f"node{i}")
        source = (i - 1) % NODES
        source_ranks = [source * PER_NODE + k for k in range(PER_NODE)]
        d = replicated_1 / f"node{i}" / step_dir(2)
        marker = json.loads((d / f"REPLICA-{source_ranks[0]:06d}.json").read_text())
        assert marker["ranks"] == source_ranks and marker["node"].endswith(f"node{source}")
        for name, (size, _) in marker["files"].items():  # byte for byte the source node's own files
            assert (d / name).read_bytes() == (replicated_1 / f"node{source}" / step_dir(2) / name).read_bytes()
            assert (d / name).stat().st_size == size
        assert set(marker["files"]) >= {rank_files(r)[-1] for r in source_ranks}  # the packs
        own = [i * PER_NODE + k for k in range(PER_NODE)]
        assert held_steps(tier)["2"] == [own + source_ranks, 8, own]
    # The remote holds each file once, uploaded by its own node, and no replica marker.
    remote = replicated_1 / "remote" / step_dir(2)
    assert not list(remote.glob("REPLICA-*")) and (remote / "COMMIT").exists()


def test_a_wiped_node_restores_from_its_peer_without_a_remote(replicated_1: Path, tmp_path: Path) -> None:
    root = _copy(replicated_1, tmp_path / "job")
    shutil.rmtree(root / "node1")  # replaced: an empty directory
    results = run_ranks(_restore, 8, str(root), None, timeout=240)
    _check_restored(results, wiped=[1])


def test_a_chunk_damaged_in_a_nodes_own_copy_is_read_from_its_peers_replica_not_an_older_step(
    replicated_1: Path, tmp_path: Path
) -> None:
    """No remote: a chunk rank 2 wrote is damaged on its node (node 1). That node passes over its copy of
    rank 2's files, and node 2's replica of them serves the step, bit-identical, instead of step 1."""
    root = _copy(replicated_1, tmp_path / "job")
    step = root / "node1" / step_dir(2)
    array, key = written_by(step, 2)[0]
    flip_chunk_byte(step, array, key, 5)
    results = run_ranks(_restore, 8, str(root), None, timeout=240)
    _check_restored(results, wiped=[])
    assert sum(r["copies"] for r in results) == 1, "one rank of node 1 found the copy damaged"
    assert all(r["copies"] == 0 for rank, r in enumerate(results) if rank // PER_NODE != 1)


def test_two_wiped_nodes_of_one_clique_fail_naming_the_lost_ranks_or_fall_back_to_the_remote(
    replicated_1: Path, tmp_path: Path
) -> None:
    root = _copy(replicated_1, tmp_path / "job")
    shutil.rmtree(root / "node1")
    shutil.rmtree(root / "node2")  # node 1's only copy was on node 2
    for r in run_ranks(_restore, 8, str(root), None, timeout=240):
        assert r["step"] is None
        assert "the files of saving rank(s) 2-3 are on no rank's local tier" in r["error"], r["error"]
    results = run_ranks(_restore, 8, str(root), (replicated_1 / "remote").as_uri())
    for rank, r in enumerate(results):
        assert r["step"] == 2 and r["tensors"] > 0 and r["info"]["rank"] == rank


def test_two_replicas_survive_two_lost_nodes(tmp_path: Path) -> None:
    root = tmp_path / "job"
    results = _saved(root, 2)
    assert all(r["replicated"] == [True, True] for r in results[::PER_NODE])
    assert placement(0, NODES, tiercheck.ReplicationOptions(replicas=2)) == ([1, 2], [3, 2])
    shutil.rmtree(root / "node0")
    shutil.rmtree(root / "node2")  # node 0's copies were on nodes 1 and 2; node 2's on 3 and 0
    _check_restored(run_ranks(_restore, 8, str(root), None, timeout=240), wiped=[0, 2])
    assert sum(t.nbytes for t in global_tensors(2).values()) > 0


def test_a_placement_that_would_land_on_its_own_node_is_refused() -> None:
    with pytest.raises(ValueError, match=r"replicas=2, jump=2\) on 4 node\(s\)"):
        placement(0, 4, tiercheck.ReplicationOptions(replicas=2, jump=2))
    assert placement(3, 4, tiercheck.ReplicationOptions(replicas=1, jump=2)) == ([1], [1])
    with pytest.raises(ValueError, match="replicas must be a positive integer"):
        tiercheck.ReplicationOptions(replicas=0)


def _save_and_die_receiving(rank: int, world: int, root: str) -> bool:
    """Node 1's leader (rank 2) dies while it writes node 0's pack: after the step committed everywhere."""
    if rank == 2:
        real = LocalTier.write_stream

        def die_in_a_pack(self: LocalTier, path: str, pieces: Any) -> None:
            if "/packs/" in path:
                it = iter(pieces())
                next(it)  # some bytes of the pack received and written...
                os._exit(17)  # ...and the node goes down
            real(self, path, pieces)

        LocalTier.write_stream = die_in_a_pack  # type: ignore[method-assign]
    state = model_state(SAVED, rank, seed=2)
    options = tiercheck.ReplicationOptions(replicas=1, piece_bytes=1 << 16, timeout_s=10)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, PER_NODE), replication=options) as ck:
        handle = ck.save(1)
        handle.wait()
        return handle.replicated.result(timeout=60)


def test_a_crash_while_receiving_leaves_no_replica_that_counts(tmp_path: Path) -> None:
    outcomes = run_ranks(_save_and_die_receiving, 8, str(tmp_path), check=False, timeout=120)
    assert outcomes[2].exitcode == 17
    assert outcomes[0].result is False  # node 0's copy never arrived whole: its sender says so
    node1 = LocalTier(tmp_path / "node1")
    assert not list((tmp_path / "node1" / step_dir(1)).glob("REPLICA-*"))
    assert held_steps(node1)["1"] == [[2, 3], 8, [2, 3]]  # only its own files count
    # Every node's own files are whole: the step restores bit for bit (node 1's half-received pack is ignored).
    _check_restored(run_ranks(_restore, 8, str(tmp_path), None, timeout=240), [], step=1)


def test_ls_shows_replica_coverage_and_verify_checks_replicas(replicated_1: Path, tmp_path: Path) -> None:
    node = _copy(replicated_1 / "node1", tmp_path / "node1")  # holds its ranks 2-3 and node 0's 0-1
    listing = CliRunner().invoke(main, ["ls", str(node), "--json"])
    assert listing.exit_code == 0, listing.output
    (row,) = [r for r in json.loads(listing.output)["steps"] if r["step"] == 2]
    (entry,) = row["tiers"].values()
    assert (entry["ranks"], entry["replica_ranks"]) == ([2, 3], [0, 1])
    assert entry["status"] == "committed (ranks 2-3) + replicas of ranks 0-1"
    ok = CliRunner().invoke(main, ["verify", str(node), "--all"])
    assert ok.exit_code == 0 and "steps 1, 2 intact" in ok.output, ok.output

    d = node / step_dir(2)
    pack = d / rank_files(0)[-1]  # node 0's rank 0 pack, as node 1 keeps it
    data = bytearray(pack.read_bytes())
    data[0] ^= 0x01
    pack.write_bytes(bytes(data))
    refs = d / rank_files(1)[3]
    refs.write_bytes(refs.read_bytes() + b" ")
    bad = CliRunner().invoke(main, ["verify", str(node), "--step", "2"])
    assert bad.exit_code == 1, bad.output
    assert f"step 2: replica file {rank_files(1)[3]}: size or CRC32C differs from its replica marker" in bad.output
    assert "damaged: step 2: array 'model/embed' chunk c.0.0: checksum mismatch" in bad.output  # rank 0's first chunk


def _save_two_trajectories(rank: int, world: int, root: str) -> bool:
    """Steps 1 and 2 of one job with different bits (seeds 3 then 2), each replicated to one peer node."""
    state = model_state(SAVED, rank, seed=3)
    options = tiercheck.ReplicationOptions(replicas=1, piece_bytes=1 << 16, timeout_s=60)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, PER_NODE), replication=options) as ck:
        first = ck.save(1)
        first.wait()
        ok = first.replicated.result(timeout=90)
        later = model_state(SAVED, rank, seed=2)
        for name, value in state["model"].items():  # the training moved on: new bits, same layout
            new = later["model"][name]
            (value.local if hasattr(value, "local") else value).copy_(new.local if hasattr(new, "local") else new)
        second = ck.save(2)
        return bool(ok and second.replicated.result(timeout=90)) or rank % PER_NODE != 0


def _restore_any(rank: int, world: int, root: str) -> dict[str, Any]:
    state = model_state(SAVED, rank, seed=2, fill=-1.0)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, PER_NODE)) as ck:
        step = ck.restore()
    return {"step": step, "tensors": check_model(state, {1: 3, 2: 2}[step])}


@pytest.mark.parametrize("swapped", ["all", "manifest"])
def test_a_replica_holding_an_earlier_steps_files_is_not_restored_as_the_newer_step(
    tmp_path: Path, swapped: str
) -> None:
    """A replica is used only when its files match its marker: node 2 keeps node 1's replica of steps 1
    and 2; its step-2 copy is replaced by the step-1 files (same names, same sizes). With node 1 wiped,
    no tier holds step 2 of ranks 2-3 whole: the restore falls back to step 1, and never returns step 1's
    bits as step 2. ``manifest``: only the parts/arrays/owners/refs swapped, the packs left as they were."""
    root = tmp_path / "job"
    assert all(run_ranks(_save_two_trajectories, 8, str(root), timeout=240))
    holder = root / "node2"
    stale, fresh = holder / step_dir(1), holder / step_dir(2)
    names = [n for r in (2, 3) for n in rank_files(r) if (stale / n).exists()]
    assert any(n.endswith(".bin") for n in names)
    for name in names:
        if swapped == "all" or not name.endswith(".bin"):
            shutil.copyfile(stale / name, fresh / name)
    shutil.rmtree(root / "node1")
    assert held_steps(LocalTier(holder))["2"] == [[4, 5], 8, [4, 5]]  # the replica of ranks 2-3 does not count
    listing = CliRunner().invoke(main, ["ls", str(holder), "--json"])
    (row,) = [r for r in json.loads(listing.stdout)["steps"] if r["step"] == 2]
    assert next(iter(row["tiers"].values()))["replica_ranks"] == []
    for r in run_ranks(_restore_any, 8, str(root), timeout=240):
        assert r["step"] == 1 and r["tensors"] > 0, r  # step 1, bit for bit (seed 3): not step 2


def test_a_copy_of_a_nodes_ranks_takes_a_replica_only_with_its_files_and_ls_counts_only_whole_ones(
    replicated_1: Path, tmp_path: Path
) -> None:
    """``restore --ranks`` of a node's own ranks leaves its peers' packs behind: it must leave their
    replica marker too (it did not, and its own --verify then failed); ``ls`` counts a replica only
    when its files are there."""
    node = replicated_1 / "node1"  # ranks 2-3, and node 0's 0-1 as a replica
    target = tmp_path / "copy"
    result = CliRunner().invoke(main, ["restore", str(node), "--to", str(target), "--ranks", "2-3", "--verify"])
    assert result.exit_code == 0, result.output
    assert not list((target / step_dir(2)).glob("REPLICA-*"))
    listing = CliRunner().invoke(main, ["ls", str(target), "--json"])
    (row,) = [r for r in json.loads(listing.stdout)["steps"] if r["step"] == 2]
    assert next(iter(row["tiers"].values()))["replica_ranks"] == []

    lost = _copy(node, tmp_path / "node1")
    (lost / step_dir(2) / rank_files(0)[-1]).unlink()  # the replica's pack of rank 0 is gone
    listing = CliRunner().invoke(main, ["ls", str(lost), "--json"])
    rows = {r["step"]: next(iter(r["tiers"].values())) for r in json.loads(listing.stdout)["steps"]}
    assert (rows[2]["replica_ranks"], rows[1]["replica_ranks"]) == ([], [0, 1])
    assert rows[2]["status"] == "committed (ranks 2-3)"


def test_a_received_piece_keeps_its_bytes_while_the_next_ones_arrive() -> None:
    """The file's writer (``LocalTier.write_stream``) writes up to two pieces while the next is received:
    a piece still held is never received into again (one buffer received into again damaged the replica
    under its write, after its CRC32C had been folded over the right bytes)."""
    import torch

    from tiercheck.tiering.replication import Replicator
    from tiercheck.tiering.transfer import _Ring

    class Sender:
        sent = 0

        def recv(self, t: torch.Tensor) -> None:
            self.sent += 1
            t.fill_(self.sent)

    counter = type("Counter", (), {"_count": lambda self, key, n: None})()
    held = list(Replicator._pieces(cast(Any, counter), cast(Any, Sender()), _Ring(1 << 16), 5 * (1 << 16) - 3))
    assert [len(p) for p in held] == [1 << 16] * 4 + [(1 << 16) - 3]
    assert [set(bytes(p)) for p in held] == [{1}, {2}, {3}, {4}, {5}]


PAIR = Layout(tp=2, pp=1, dp=1)  # two ranks, each a node of its own


def _save_pair(rank: int, world: int, root: str, seed: int) -> bool:
    """Step 2 alone, with ``seed``'s bits, each node's files replicated to the other node."""
    state = model_state(PAIR, rank, seed=seed)
    options = tiercheck.ReplicationOptions(replicas=1, piece_bytes=1 << 16, timeout_s=60)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 1), replication=options) as ck:
        return ck.save(2).replicated.result(timeout=90)


def _restore_pair(rank: int, world: int, root: str) -> dict[str, Any]:
    state = model_state(PAIR, rank, seed=2, fill=-1.0)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 1)) as ck:
        try:
            return {"step": ck.restore()}
        except tiercheck.TiercheckError as e:
            return {"step": None, "error": type(e).__name__, "message": str(e)}


def test_a_committed_step_with_no_whole_copy_of_a_writers_files_raises_never_a_fresh_start(tmp_path: Path) -> None:
    """Issue 65 item 1. Two ranks on two nodes, one replica each; node 0 is wiped and node 1's replica
    of rank 0's pack is another run's pack of equal size. Step 2 is committed but no tier holds rank 0's
    files whole: every rank raises, naming the step and the damaged file, and never returns None (a fresh
    start, as if no checkpoint existed)."""
    root, other = tmp_path / "job", tmp_path / "other"
    assert run_ranks(_save_pair, 2, str(root), 2) == [True, True]
    assert run_ranks(_save_pair, 2, str(other), 7) == [True, True]  # another run: same layout, other bits
    pack = rank_files(0)[-1]
    replica = root / "node1" / step_dir(2) / pack
    foreign = other / "node0" / step_dir(2) / pack
    assert replica.stat().st_size == foreign.stat().st_size
    shutil.copyfile(foreign, replica)
    shutil.rmtree(root / "node0")
    for r in run_ranks(_restore_pair, 2, str(root), timeout=120):
        assert r["step"] is None and r["error"] in ("CorruptCheckpointError", "PartlyRestoredError"), r
        assert f"{step_dir(2)}/{pack}" in r["message"], r["message"]  # the damaged file, by its name in the step
        assert "no other node holds a copy of saving rank(s) [0]' files" in r["message"], r["message"]


def _save_alone(rank: int, world: int, root: str) -> None:
    with tiercheck.Checkpointer(model_state(PAIR, rank, seed=2), local=node_dir(root, rank, 1)) as ck:
        ck.save(2)


def test_a_committed_step_whose_marker_no_node_can_read_raises_never_a_fresh_start(tmp_path: Path) -> None:
    """Issue 65 item 1, the mechanism: a restore that passes over every committed step (here step 2,
    its commit marker damaged on both nodes) raises on every rank, naming the step and its file, where
    it returned None as if no checkpoint existed."""
    run_ranks(_save_alone, 2, str(tmp_path))
    for node in ("node0", "node1"):
        (tmp_path / node / step_dir(2) / "COMMIT").write_bytes(b"\x00garbage")
    for r in run_ranks(_restore_pair, 2, str(tmp_path), timeout=120):
        assert r["step"] is None and r["error"] == "CorruptCheckpointError", r
        assert "step(s) 2 are committed" in r["message"] and "commit marker is damaged" in r["message"], r
