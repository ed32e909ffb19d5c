"""torchtitan's ``CheckpointManager`` through tiercheck: ``TiercheckCheckpointManager`` with the real torchtitan.

The manager is driven as torchtitan's ``Trainer.train`` drives it (``load()`` first, ``save(step, last_step=)``
after every step, ``close()`` at the end), on 2 gloo ranks with an FSDP2 model, torchtitan's own
``OptimizersContainer`` (AdamW), ``LRSchedulersContainer`` (warmup + decay) and ``ParallelAwareDataloader``, and a
train state. A run killed after its step-5 checkpoint resumes from it and ends bit-identical to an uninterrupted
run; two new nodes with empty directories resume from the remote tier alone, bit-identical too. (A full torchtitan
training loop on CPU needs shims for FlexAttention's backward, gloo's missing PREMUL_SUM and triton: the manager is
what tiercheck replaces, so it is what is driven.)
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import assert_identical
from tiercheck.format.paths import step_dir

from .distributed import run_ranks
from .ondisk import chunks_of, flip_chunk_byte, step_parts
from .shm import private_shm
from .test_dcp import _full

pytest.importorskip("torchtitan.components.checkpointer", reason="needs torchtitan 0.3 (scripts/test.sh installs it)")

pytestmark = [
    pytest.mark.filterwarnings("ignore:`synchronize_staging` is deprecated:FutureWarning"),
]

TOTAL = 10  # steps of a whole run; a checkpoint every INTERVAL
INTERVAL = 5


class _Numbers(torch.utils.data.IterableDataset):
    """Sample i of rank r is a function of (r, i), and the dataset is Stateful (as torchtitan's are): a resumed
    loader must continue exactly where it stopped. (Without a state, torchdata's loader fast-forwards, and a
    second resume counts the first one's fast-forward twice.)"""

    def __init__(self, rank: int) -> None:
        self.rank, self.i = rank, 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        while True:
            g = torch.Generator().manual_seed(1000 * self.rank + self.i)
            self.i += 1
            yield torch.randn(6, generator=g)

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.i = sd["i"]


class _TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def training_parts(rank: int, world: int) -> tuple[Any, ...]:
    """The run's model (FSDP2 over ``world`` CPU ranks), optimizers, schedulers, data loader and
    train state, as torchtitan's Trainer builds them, before any checkpoint manager."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=TOTAL)
    loader = ParallelAwareDataloader(_Numbers(rank), dp_rank=rank, dp_world_size=world, batch_size=3)
    state = _TrainState()
    return model, optimizers, schedulers, loader, state


def _build(
    rank: int, world: int, root: str, remote: str, local: str, async_mode: str, memory: str | None = None
) -> tuple[Any, ...]:
    from tiercheck import MemoryOptions
    from tiercheck.integrations.torchtitan import TiercheckCheckpointManager

    model, optimizers, schedulers, loader, state = training_parts(rank, world)
    config = TiercheckCheckpointManager.Config(
        enable=True,
        folder="checkpoint",
        interval=INTERVAL,
        async_mode=async_mode,
        keep_latest_k=2,
        last_save_model_only=False,
        local=local.format(rank=rank),  # "{rank}" in it: each rank a node of its own
        remote=remote,
        memory=None if memory is None else MemoryOptions(path=memory, persist_every=1000, keep_at_close=True),  # memory only
    )
    manager = config.build(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder=root,
    )
    return model, optimizers, schedulers, loader, state, manager


def _train(
    rank: int, world: int, root: str, remote: str, local: str, async_mode: str, stop: int, memory: str | None = None
) -> dict[str, Any]:
    """torchtitan's Trainer.train, in short: load, then train and save each step; at ``stop`` < TOTAL the
    process dies (``os._exit``) once the last checkpoint is committed, without closing anything."""
    warnings.simplefilter("ignore", FutureWarning)
    said = _Said()
    logging.getLogger("tiercheck").addHandler(said)
    logging.getLogger("tiercheck").setLevel(logging.INFO)
    model, optimizers, schedulers, loader, state, manager = _build(rank, world, root, remote, local, async_mode,
                                                                   memory)  # fmt: skip
    resumed = manager.load(step=-1)
    start = state.step
    batches = iter(loader)
    while state.step < stop:
        state.step += 1
        loss = model(next(batches)).square().mean()
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        manager.save(state.step, last_step=state.step == TOTAL)
    if stop < TOTAL:
        manager.maybe_wait_for_saving()
        os._exit(0)  # killed: no close, no drain
    manager.close()
    return {
        "resumed": resumed,
        "start": start,
        "model": _full(model.state_dict()),
        "optim": _full(optimizers.state_dict()),
        "lr": schedulers.state_dict(),
        "next_batch": next(batches),
        "log": said.lines,
    }


class _Said(logging.Handler):
    """tiercheck's log lines of a rank's run, as its user reads them."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _restore_only(rank: int, world: int, root: str, remote: str, local: str) -> dict[str, Any]:
    warnings.simplefilter("ignore", FutureWarning)
    model, optimizers, schedulers, loader, state, manager = _build(rank, world, root, remote, local, "disabled")
    assert manager.load(step=-1)
    out = {"step": state.step, "model": _full(model.state_dict()), "optim": _full(optimizers.state_dict())}
    out["lr"], out["next_batch"] = schedulers.state_dict(), next(iter(loader))
    manager.close()
    return out


def _steps(path: Path) -> list[int]:
    from tiercheck.format.steps import list_steps
    from tiercheck.tiers.local import LocalTier

    return list_steps(LocalTier(path)).committed


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_killed_run_resumes_bit_identical_from_local_then_remote_alone(tmp_path: Path, async_mode: str) -> None:
    remote_dir = tmp_path / "remote"
    remote = remote_dir.as_uri()
    whole = run_ranks(_train, 2, str(tmp_path / "a"), (tmp_path / "ra").as_uri(), str(tmp_path / "a" / "ckpt"),
                      async_mode, TOTAL, timeout=150)  # fmt: skip
    assert [w["resumed"] for w in whole] == [False, False]

    run, local = tmp_path / "b", tmp_path / "b" / "ckpt"
    # Killed at step 7: step 5 is committed locally; step 10 never happened.
    outcomes = run_ranks(_train, 2, str(run), remote, str(local), async_mode, 7,
                         check=False, timeout=150)  # fmt: skip
    assert all(o.exitcode == 0 for o in outcomes), [o.error for o in outcomes]
    assert _steps(local) == [5]
    resumed = run_ranks(_train, 2, str(run), remote, str(local), async_mode, TOTAL,
                        timeout=150)  # fmt: skip
    for rank in range(2):
        assert resumed[rank]["resumed"] and resumed[rank]["start"] == 5
        for key in ("model", "optim", "lr", "next_batch"):
            assert_identical(resumed[rank][key], whole[rank][key], f"rank {rank} {key}", any_order=True)
        said = resumed[rank]["log"]  # the start says there is no memory tier, and the restore the tier it read
        assert any(line.endswith(", no memory tier") for line in said), said
        assert any(line.startswith("restored step 5 from the local directory through tiercheck in ") for line in said)
    assert _steps(local) == [5, 10]  # keep_latest_k=2: tiercheck's retention, torchtitan's purge never ran
    assert _steps(remote_dir) == [5, 10]  # close() drained both

    # Two new nodes: empty local directories, the remote tier alone.
    shutil.rmtree(local)
    fresh = run_ranks(_restore_only, 2, str(tmp_path / "c"), remote, str(tmp_path / "c" / "ckpt"),
                      timeout=150)  # fmt: skip
    for rank in range(2):
        assert fresh[rank]["step"] == TOTAL
        for key in ("model", "optim", "lr", "next_batch"):
            assert_identical(fresh[rank][key], whole[rank][key], f"rank {rank} {key} (from the remote)", any_order=True)


def test_a_killed_run_resumes_from_the_memory_tier_bit_identical(tmp_path: Path) -> None:
    """``Config(memory=MemoryOptions(...))``: with ``persist_every`` naming no save, step 5 of a run killed at step
    7 is in memory only (nothing on the local directory), and the restarted run resumes from it and ends
    bit-identical to an uninterrupted run."""
    whole = run_ranks(_train, 2, str(tmp_path / "a"), None, str(tmp_path / "a" / "ckpt"), "disabled", TOTAL,
                      timeout=150)  # fmt: skip
    run, local = tmp_path / "b", str(tmp_path / "b" / "node{rank}")  # each rank a node, as on a cluster
    with private_shm() as shm:
        outcomes = run_ranks(_train, 2, str(run), None, local, "disabled", 7, str(shm),
                             check=False, timeout=150)  # fmt: skip
        assert all(o.exitcode == 0 for o in outcomes), [o.error for o in outcomes]
        assert [_steps(Path(local.format(rank=r))) for r in range(2)] == [[], []]  # killed: step 5 in memory only
        resumed = run_ranks(_train, 2, str(run), None, local, "disabled", TOTAL, str(shm), timeout=150)
    for rank in range(2):
        assert resumed[rank]["resumed"] and resumed[rank]["start"] == 5
        for key in ("model", "optim", "lr", "next_batch"):
            assert_identical(resumed[rank][key], whole[rank][key], f"rank {rank} {key}", any_order=True)
        said = resumed[rank]["log"]  # the start names the memory tier, and the restore the tier it read
        assert any(f"memory tier under {shm} (every checkpoint; those of a step divisible by 1000" in line
                   for line in said), said  # fmt: skip
        assert any(line.startswith("restored step 5 from memory through tiercheck in ") for line in said), said
        assert _steps(Path(local.format(rank=rank))) == [5, 10]  # the restored memory step persisted, the newest at close


def test_load_newest_falls_back_to_the_older_whole_step_when_the_newest_is_damaged(tmp_path: Path) -> None:
    """``load(step=-1)`` with step 10 damaged on every tier restores step 5, as documented; DCP's
    ``CheckpointException`` wrapping the damage does not escape."""
    local = tmp_path / "a" / "ckpt"
    run_ranks(_train, 2, str(tmp_path / "a"), None, str(local), "disabled", TOTAL, timeout=150)
    assert _steps(local) == [5, 10]
    newest = local / step_dir(10)
    array = sorted(a for part in step_parts(newest) for a in part.offsets)[0]
    flip_chunk_byte(newest, array, chunks_of(newest, array)[0], 5)
    fresh = run_ranks(_restore_only, 2, str(tmp_path / "a"), None, str(local), timeout=150)
    assert [f["step"] for f in fresh] == [INTERVAL, INTERVAL]


def test_torchtitans_command_line_sets_the_memory_tiers_path() -> None:
    """torchtitan 0.3 parses its command line with tyro (``ConfigManager``, its registry): with the manager's
    config in a ``checkpoint`` section, as ``Trainer.Config`` holds it, ``--checkpoint.memory.path`` sets
    ``MemoryOptions.path`` (a ``str | os.PathLike`` annotation was "fixed" to its default, refusing any value)."""
    from dataclasses import field, make_dataclass

    import tyro
    from torchtitan.components.checkpointer import BaseCheckpointManager
    from torchtitan.config.manager import ConfigManager, custom_registry

    from tiercheck import MemoryOptions
    from tiercheck.integrations.torchtitan import TiercheckCheckpointManager

    ConfigManager()  # registers torchtitan's own tyro rules, as its parse_args does

    # Trainer.Config's checkpoint field (the Trainer itself imports triton); made, not written as a class: this
    # module's annotations are strings, which tyro could not resolve in a function's scope
    Job = make_dataclass(
        "Job",
        [("checkpoint", BaseCheckpointManager.Config, field(default_factory=BaseCheckpointManager.Config))],
        kw_only=True,
        slots=True,
    )
    default = Job(checkpoint=TiercheckCheckpointManager.Config(enable=True, interval=1))
    args = ["checkpoint.memory:memory-options", "--checkpoint.memory.path", "/dev/shm/run-7",
            "--checkpoint.memory.persist-every", "5"]  # fmt: skip
    parsed = tyro.cli(Job, args=args, default=default, registry=custom_registry)
    assert isinstance(parsed.checkpoint, TiercheckCheckpointManager.Config)
    assert parsed.checkpoint.memory == MemoryOptions(path="/dev/shm/run-7", persist_every=5)
    assert tyro.cli(Job, args=[], default=default, registry=custom_registry).checkpoint.memory is None
