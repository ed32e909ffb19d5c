"""The memory tier protected by parity (``ReplicationOptions(parity=ParityOptions(...))``): a group of
nodes loses any ``m`` of them and every node restores its newest protected step from memory,
bit-identical, the lost ones rebuilding their files from the others' data and parity. Each rank is a
node of its own (real gloo processes, their own tmpfs and local directories), restarted with the
options it saved with."""

from __future__ import annotations

import itertools
import logging
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import assert_identical, seeded_tensors, tiercheck_said
from tests.distributed import run_ranks
from tests.shm import private_shm
from tests.test_memory_tier import _memory_dir
from tiercheck import Checkpointer, MemoryOptions, ParityOptions, ReplicationOptions, per_rank
from tiercheck.format.codec import checksum
from tiercheck.format.parity import PARITY_RECORD, ParityRecord, parity_file
from tiercheck.format.paths import step_dir
from tiercheck.format.steps import list_steps, read_marker
from tiercheck.format.verify import verify_step
from tiercheck.tiers.local import LocalTier

_SHAPES = {"w": (96, 1000), "b": (3001,)}


def _state(step: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s own shard at ``step``: each node's files hold values of their own."""
    return seeded_tensors(100 * step + rank, _SHAPES)


def _options(data: int, parity: int) -> ReplicationOptions:
    return ReplicationOptions(parity=ParityOptions(data=data, parity=parity), piece_bytes=1 << 16, timeout_s=60)


def _node(rank: int, world: int, root: str, phase: str, data: int, parity: int, steps: int = 3) -> dict[str, Any]:
    """One rank, a node of its own: ``save`` saves steps 1 to ``steps`` to memory; ``restore``
    restores, checks the state against the step it got, waits for the background work and returns
    the step, its stats and the tiercheck lines it logged."""
    live = _state(0, rank)
    state = {k: per_rank(v) for k, v in live.items()}
    memory = MemoryOptions(path=Path(root) / f"shm{rank}", persist_every=100, keep_at_close=True)
    with tiercheck_said(logging.INFO) as said, Checkpointer(state, local=Path(root) / f"node{rank}", memory=memory,
                      replication=_options(data, parity)) as ck:  # fmt: skip
        if phase == "save":
            for step in range(1, steps + 1):
                for k, v in _state(step, rank).items():
                    live[k].copy_(v)
                ck.save(step).wait()
            ck.wait()
            return {"stats": ck.stats()}
        step = ck.restore()
        if step is not None:
            assert_identical(live, _state(step, rank))
        ck.wait()
        stats = dict(ck.stats())
    torch.distributed.barrier()
    return {"step": step, "stats": stats, "said": said}


def _memory(root: Path, rank: int) -> Path:
    return _memory_dir(root / f"shm{rank}", root / f"node{rank}")


def _lose(root: Path, *nodes: int, step: int = 3) -> None:
    """``nodes`` replaced (tmpfs and local directory empty); the others lose their local copies of
    ``step``, so memory alone holds it."""
    for rank in nodes:
        shutil.rmtree(root / f"shm{rank}")
        shutil.rmtree(root / f"node{rank}")
    for d in root.glob(f"node*/{step_dir(step)}"):
        shutil.rmtree(d)


def _restored(root: Path, world: int, lost: tuple[int, ...], got: list[dict[str, Any]], step: int = 3) -> None:
    """Every node restored ``step`` from memory; each lost node holds its files of it again (memory
    and local directory, the same save, checked chunk by chunk) and its parity."""
    assert [out["step"] for out in got] == [step] * world
    for rank, out in enumerate(got):
        stats = out["stats"]
        assert stats["restore_from_memory"] == 1, (rank, stats)
        assert stats["memory_rebuilt_step"] == (step if rank in lost else None), (rank, stats)
        assert stats["memory_protected_step"] == step, (rank, stats)  # its group whole again: parity included
        assert any(f"parity: step {step} is protected again" in m for m in out["said"]), out["said"]
    save = read_marker(LocalTier(_memory(root, next(r for r in range(world) if r not in lost))), step).save_id
    for rank in lost:
        assert any(f"parity: step {step} rebuilt in this node's memory" in m for m in got[rank]["said"])
        memory, local = LocalTier(_memory(root, rank)), LocalTier(root / f"node{rank}")
        for tier in (memory, local):
            assert step in list_steps(tier).committed, tier.url
            assert read_marker(tier, step).ranks == (rank,)
            assert read_marker(tier, step).save_id == save
            assert verify_step(tier, step) == [], tier.url
        assert (memory.local_path / step_dir(step) / PARITY_RECORD).exists()
        assert got[rank]["stats"]["memory_parity_held_bytes"] > 0


@pytest.fixture(scope="module")
def four_nodes() -> Iterator[Path]:
    """Four nodes, parity 2+2, steps 1 to 3 saved and protected; kept aside, copied back per case."""
    with private_shm() as root:
        (root / "job").mkdir(parents=True)
        run_ranks(_node, 4, str(root / "job"), "save", 2, 2)
        shutil.copytree(root / "job", root / "saved", symlinks=True)
        yield root


@pytest.mark.parametrize("lost", list(itertools.combinations(range(4), 2)), ids=lambda p: f"lost{p[0]}{p[1]}")
def test_any_two_of_four_nodes_lost_restore_bit_identically(four_nodes: Path, lost: tuple[int, int]) -> None:
    job = four_nodes / "job"
    shutil.rmtree(job)
    shutil.copytree(four_nodes / "saved", job, symlinks=True)
    _lose(job, *lost)
    got = run_ranks(_node, 4, str(job), "restore", 2, 2, timeout=240)
    _restored(job, 4, lost, got)


def _fresh(four_nodes: Path) -> Path:
    job = four_nodes / "job"
    shutil.rmtree(job)
    shutil.copytree(four_nodes / "saved", job, symlinks=True)
    return job


def test_a_third_loss_is_said_and_the_restore_falls_back_to_the_local_directory(four_nodes: Path) -> None:
    """Three of four nodes lose their memory (their local directories, where the clean close
    persisted step 3, stay): no rebuild can be, each lost node says why, and every node restores
    step 3 from its local directory, bit-identical."""
    job = _fresh(four_nodes)
    for rank in (0, 1, 2):
        shutil.rmtree(job / f"shm{rank}")
    got = run_ranks(_node, 4, str(job), "restore", 2, 2, timeout=240)
    assert [out["step"] for out in got] == [3] * 4
    assert [out["stats"]["restore_from_memory"] for out in got] == [0] * 4
    assert [out["stats"]["memory_rebuilt_step"] for out in got] == [None] * 4
    for rank in (0, 1, 2):
        assert any("parity: step 3 cannot be rebuilt on this node: 1 of its group's nodes hold it checked, 2 are "
                   "needed" in m for m in got[rank]["said"]), got[rank]["said"]  # fmt: skip


def test_too_few_whole_copies_left_is_said_and_the_restore_falls_back_to_the_local_directory(four_nodes: Path) -> None:
    """Node 0 loses its memory (its local directory, where the clean close persisted step 3, stays);
    nodes 1 and 2 hold damaged parity that node 0's rebuild takes (stripes 3 and 0). The first rounds
    give node 0 files unlike the record; the group's check then finds one whole copy where two are
    needed: node 0 says so, keeps nothing rebuilt, and every node restores step 3 bit-identically,
    node 0 from its local directory."""
    job = _fresh(four_nodes)
    shutil.rmtree(job / "shm0")
    for rank, stripe in ((1, 3), (2, 0)):
        damaged = _memory(job, rank) / step_dir(3) / parity_file(stripe)
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0xFF
        damaged.write_bytes(bytes(data))
    got = run_ranks(_node, 4, str(job), "restore", 2, 2, timeout=240)
    assert [out["step"] for out in got] == [3] * 4
    assert [out["stats"]["memory_rebuilt_step"] for out in got] == [None] * 4
    said = got[0]["said"]
    assert any("its group checks its copies, and it is rebuilt again from the whole ones" in m for m in said), said
    assert any("parity: step 3 cannot be rebuilt on this node: 1 of its group's nodes hold it checked, 2 are needed"
               in m for m in said), said  # fmt: skip
    assert 3 not in list_steps(LocalTier(_memory(job, 0))).committed


@pytest.mark.parametrize(("stripe", "how"), [(3, "flipped"), (2, "flipped"), (3, "deleted")],
                         ids=["used-by-the-rebuild", "not-used-by-the-rebuild", "unreadable"])  # fmt: skip
def test_damaged_parity_is_passed_over_and_rebuilt(four_nodes: Path, stripe: int, how: str) -> None:
    """Node 0 lost; node 1's parity piece of ``stripe`` of step 3 damaged (a byte flipped, or the file
    deleted: node 1 sends zeros in its place and says so). Node 0's rebuild takes that piece for its
    stripe 3 (the first rounds then give files unlike the record, the group checks its copies and node
    0 is rebuilt again from the whole ones), not for stripe 2 (the group's check after the restore
    finds it). Either way node 1 says so, every node restores bit-identically, and node 1's parity is
    rebuilt: each piece matches the record again."""
    job = _fresh(four_nodes)
    _lose(job, 0)
    steps = _memory(job, 1) / step_dir(3)
    damaged = steps / parity_file(stripe)
    if how == "deleted":
        damaged.unlink()
    else:
        with damaged.open("r+b") as f:
            f.seek(damaged.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    got = run_ranks(_node, 4, str(job), "restore", 2, 2, timeout=240)
    _restored(job, 4, (0,), got)
    said = [m for m in got[1]["said"] if "this node's copy of step 3 is damaged" in m]
    assert len(said) == 1 and parity_file(stripe) in said[0] and "its parity is rebuilt from its group" in said[0]
    retried = [m for m in got[0]["said"] if "its group checks its copies, and it is rebuilt again" in m]
    assert len(retried) == (1 if stripe == 3 else 0), got[0]["said"]
    unread = [m for m in got[1]["said"] if f"shard of stripe {stripe} cannot be read, zeros are sent" in m]
    assert len(unread) == (1 if how == "deleted" else 0), got[1]["said"]
    record = ParityRecord.from_bytes((steps / PARITY_RECORD).read_bytes(), where="test")
    assert [(s, checksum((steps / parity_file(s)).read_bytes())) for s, _ in record.members[1].parity] == list(
        record.members[1].parity
    )


def _save_and_die_while_coding(rank: int, world: int, root: str) -> dict[str, Any]:
    """Steps 1 to 3 saved and protected; step 4 committed in memory, and node 3 killed while its
    parity is coded (as a node is lost). The others wait for their coding (it fails, said) and
    then end without closing, as the job is torn down."""
    import os

    from tiercheck.tiering import parity

    coded = parity.ParityGroup._rounds

    def dying(self: parity.ParityGroup, region: Any, d: str, piece: int) -> dict[int, int]:
        if d.endswith(step_dir(4)):
            os._exit(9)
        return coded(self, region, d, piece)

    if rank == 3:
        parity.ParityGroup._rounds = dying  # type: ignore[method-assign]
    live = _state(0, rank)
    state = {k: per_rank(v) for k, v in live.items()}
    memory = MemoryOptions(path=Path(root) / f"shm{rank}", persist_every=100, keep_at_close=True)
    ck = Checkpointer(state, local=Path(root) / f"node{rank}", memory=memory,
                      replication=replace(_options(2, 2), timeout_s=20))  # fmt: skip
    with tiercheck_said() as said:
        for step in (1, 2, 3, 4):
            for k, v in _state(step, rank).items():
                live[k].copy_(v)
            ck.save(step).wait()
        ck.wait()
    return {"said": said}


def test_a_node_killed_while_coding_leaves_the_last_protected_step_whole(shm: Path) -> None:
    """Node 3 dies while step 4's parity is coded; then nodes 0 and 3 are lost. Step 4 is in no
    group's parity, step 3 still is: every node restores step 3 (the lost ones rebuild it), and the
    rebuild never takes step 4's half-coded parity."""
    shm.mkdir()
    got = run_ranks(_save_and_die_while_coding, 4, str(shm), timeout=180, pg_timeout=60, check=False)
    assert got[3].exitcode == 9 and all(out.ok for out in got[:3]), [out.error for out in got]
    for out in got[:3]:
        assert any("failed while coding step 4" in m for m in out.result["said"]), out.result["said"]
    assert 4 in list_steps(LocalTier(_memory(shm, 1))).committed
    assert not (_memory(shm, 1) / step_dir(4) / PARITY_RECORD).exists()
    _lose(shm, 0, 3)
    got = run_ranks(_node, 4, str(shm), "restore", 2, 2, timeout=240)
    _restored(shm, 4, (0, 3), got)


def test_a_node_holds_the_parity_of_its_newest_protected_step_only(four_nodes: Path) -> None:
    """After steps 1 to 3: each node's memory holds parity of step 3 alone, ``m`` pieces of the
    record's piece size (``m / d`` of its snapshot, rounded up), each matching the record's CRC32C."""
    from tiercheck.format.codec import checksum
    from tiercheck.format.parity import ParityRecord

    saved = four_nodes / "saved"
    for rank in range(4):
        (memory,) = [p.parent for p in (saved / f"shm{rank}").glob("*/OWNER")]  # named by the job's local directory
        files = sorted(p.relative_to(memory) for p in memory.glob("step-*/parity-*.bin"))
        record = ParityRecord.from_bytes((memory / step_dir(3) / PARITY_RECORD).read_bytes(), where="test")
        me = record.members[record.index(rank)]
        assert files == sorted(Path(step_dir(3)) / parity_file(s) for s, _ in me.parity)
        assert record.piece == -(-max(m.region for m in record.members) // 2)
        for stripe, crc in me.parity:
            data = (memory / step_dir(3) / parity_file(stripe)).read_bytes()
            assert len(data) == record.piece and checksum(data) == crc
        assert not list(memory.glob(f"step-*/{PARITY_RECORD}"))[1:], "one record: step 3's"


def test_parity_without_the_memory_tier_is_said_to_do_nothing(tmp_path: Path) -> None:
    """Parity protects the memory tier's steps: a Checkpointer without ``memory=`` says so at start."""
    state = {"w": torch.zeros(4)}
    with tiercheck_said() as said, Checkpointer(state, local=tmp_path / "ck", replication=_options(4, 2)):
        pass
    assert said[1:] == ["ReplicationOptions.parity protects the memory tier's steps; without memory= it does "
                        "nothing (the local tier keeps 1 whole copies)"]  # fmt: skip
    assert said[0] == "replication is off: it needs two nodes or more, and this job has one"


def test_nodes_that_lost_only_their_memory_rebuild_it_and_restore_from_memory(four_nodes: Path) -> None:
    """Nodes 1 and 2 lose their tmpfs (a reboot) but keep their local directories, whose lineage the
    rebuilt step must match: they rebuild step 3 from the others and every node restores it from
    memory, bit-identical."""
    job = _fresh(four_nodes)
    for rank in (1, 2):
        shutil.rmtree(job / f"shm{rank}")
    got = run_ranks(_node, 4, str(job), "restore", 2, 2, timeout=240)
    _restored(job, 4, (1, 2), got)
