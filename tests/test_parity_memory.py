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
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import assert_identical, seeded_tensors, tiercheck_said
from tests.distributed import run_ranks
from tests.shm import private_shm
from tests.test_memory_tier import _memory_dir
from tiercheck import Checkpointer, MemoryOptions, ParityOptions, ReplicationOptions, per_rank
from tiercheck.format.parity import PARITY_RECORD, parity_file
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
