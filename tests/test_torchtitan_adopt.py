"""Moving a torchtitan run over to ``TiercheckCheckpointManager`` mid-way, with the real torchtitan (2 gloo
ranks, FSDP2, driven as in ``test_torchtitan``): a run killed after torchtitan's own manager wrote ``step-5/``
continues from it under tiercheck and ends bit-identical to a whole run; ``initial_load_path`` at that DCP
checkpoint loads it through DCP, at a tiercheck step through tiercheck; ``async_with_pinned_mem`` without CUDA is refused when the manager is built."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import assert_identical
from tiercheck.errors import InvalidArgumentError
from tiercheck.format.paths import step_dir

from .distributed import run_ranks
from .test_dcp import _full
from .test_torchtitan import INTERVAL, TOTAL, _steps, training_parts

pytest.importorskip("torchtitan.components.checkpointer", reason="needs torchtitan 0.3 (scripts/test.sh installs it)")

pytestmark = [pytest.mark.filterwarnings("ignore:`synchronize_staging` is deprecated:FutureWarning")]


def _run(
    rank: int, world: int, root: str, own: bool, stop: int, initial: str | None = None, load_step: int = -1
) -> dict[str, Any]:
    """Load, train and save each step up to ``stop`` with torchtitan's own manager (``own``) or tiercheck's;
    between 0 and TOTAL the process dies once the last checkpoint is written (no close)."""
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    from tiercheck.integrations.torchtitan import TiercheckCheckpointManager

    warnings.simplefilter("ignore", FutureWarning)
    model, optimizers, schedulers, loader, state = training_parts(rank, world)
    cls = CheckpointManager if own else TiercheckCheckpointManager
    config = cls.Config(enable=True, folder="checkpoint", interval=INTERVAL, keep_latest_k=2,
                        last_save_model_only=False, initial_load_path=initial)  # fmt: skip
    manager = config.build(dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                           states={"train_state": state}, sd_adapter=None, base_folder=root)  # fmt: skip
    resumed = manager.load(step=load_step)
    start, loaded = state.step, _full(model.state_dict())
    batches = iter(loader)
    while state.step < stop:
        state.step += 1
        model(next(batches)).square().mean().backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        manager.save(state.step, last_step=state.step == TOTAL)
    if 0 < stop < TOTAL:
        manager.maybe_wait_for_saving()
        os._exit(0)
    manager.close()
    return {"resumed": resumed, "start": start, "loaded": loaded, "model": _full(model.state_dict()),
            "optim": _full(optimizers.state_dict()), "lr": schedulers.state_dict(), "next_batch": next(batches)}  # fmt: skip


def test_a_torchtitan_run_continues_under_tiercheck_from_its_own_newest_step(tmp_path: Path) -> None:
    whole = run_ranks(_run, 2, str(tmp_path / "whole"), False, TOTAL, timeout=150)
    # torchtitan's own manager, killed at step 7: its step-5/ is the run's progress
    run = tmp_path / "run"
    outcomes = run_ranks(_run, 2, str(run), True, 7, check=False, timeout=150)
    assert all(o.exitcode == 0 for o in outcomes), [o.error for o in outcomes]
    assert (run / "checkpoint" / "step-5" / ".metadata").is_file()
    moved = run_ranks(_run, 2, str(run), False, TOTAL, timeout=150)
    for rank in range(2):
        assert moved[rank]["resumed"] and moved[rank]["start"] == 5
        for key in ("model", "optim", "lr", "next_batch"):
            assert_identical(moved[rank][key], whole[rank][key], f"rank {rank} {key}", any_order=True)
    assert _steps(run / "checkpoint") == [10]  # the run goes on in tiercheck's steps
    # --checkpoint.load_step=5: torchtitan's own step, beside tiercheck's
    again = run_ranks(_run, 2, str(run), False, 0, load_step=5, timeout=150)
    for rank in range(2):
        assert again[rank]["resumed"] and again[rank]["start"] == 5
        assert_identical(again[rank]["loaded"], moved[rank]["loaded"], f"rank {rank} load_step=5", any_order=True)

    # initial_load_path at that DCP checkpoint (not a tiercheck step): loaded through DCP, the model only
    fresh = run_ranks(_run, 2, str(tmp_path / "fresh"), False, 0, initial=str(run / "checkpoint" / "step-5"),
                      timeout=150)  # fmt: skip
    for rank in range(2):
        assert fresh[rank]["resumed"] and fresh[rank]["start"] == 0  # model only: torchtitan's default
        assert_identical(fresh[rank]["loaded"], moved[rank]["loaded"], f"rank {rank} model from initial_load_path", any_order=True)
    # initial_load_path at a tiercheck step of another run's directory: restored by tiercheck
    other = run_ranks(_run, 2, str(tmp_path / "other"), False, 0, initial=str(run / "checkpoint" / step_dir(10)),
                      timeout=150)  # fmt: skip
    for rank in range(2):
        assert other[rank]["resumed"]
        assert_identical(other[rank]["loaded"], moved[rank]["model"], f"rank {rank} model from a tiercheck step", any_order=True)


def test_async_with_pinned_mem_without_cuda_is_refused_when_the_manager_is_built(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the mode is allowed")
    from tiercheck.integrations.torchtitan import TiercheckCheckpointManager

    config = TiercheckCheckpointManager.Config(enable=True, async_mode="async_with_pinned_mem")
    with pytest.raises(InvalidArgumentError, match="use async_mode='async'"):
        config.build(dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={},
                     sd_adapter=None, base_folder=str(tmp_path))  # fmt: skip
