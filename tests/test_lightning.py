"""Lightning's ``Trainer`` through tiercheck: ``TiercheckCheckpointIO`` with the real Lightning, on CPU.

A tiny ``LightningModule`` trains 4 epochs with ``ModelCheckpoint(save_top_k=2, save_last=True)``; a run killed
after epoch 2 resumes with ``ckpt_path="last"`` and ends bit-identical (weights, optimizer state, scheduler) to an
uninterrupted run. tiercheck's retention (``keep_last=1``) keeps every step a pointer still names, and the steps
of pointers ``save_top_k`` removed go.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import assert_identical

pytest.importorskip("lightning.pytorch", reason="needs Lightning (the test extra installs it)")

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from tiercheck import MemoryOptions
from tiercheck.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StepExistsError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from tiercheck.format.paths import step_dir
from tiercheck.integrations.lightning import TiercheckCheckpointIO
from tiercheck.options import RetentionOptions

from .distributed import fork_server
from .shm import private_shm

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # Lightning's advice (workers, logging, no last checkpoint)
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated:FutureWarning"),  # Lightning on torch 2.13
]

EPOCHS = 4


class _Tiny(pl.LightningModule):
    def __init__(self, note: Any = "plain") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, _: int) -> None:
        x, y = batch
        # a loss that goes down, then up: save_top_k keeps two early epochs while last.ckpt moves on
        self.log("val_loss", (torch.nn.functional.mse_loss(self.net(x), y) - 0.01 * self.current_epoch) ** 2)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 6, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


class _Die(pl.Callback):
    """Kills the process at the start of epoch ``at``, once the saves so far are committed (SIGKILL-like)."""

    def __init__(self, at: int, io: TiercheckCheckpointIO) -> None:
        self.at, self.io = at, io

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.at:
            self.io.wait()
            os._exit(0)


def _fit(root: str, resume: bool, die_at: int | None = None) -> _Tiny:
    pl.seed_everything(0, verbose=False)
    io = TiercheckCheckpointIO(Path(root) / "local", remote=(Path(root) / "remote").as_uri(),
                               retention=RetentionOptions(keep_last=1))  # fmt: skip
    callbacks: list[pl.Callback] = [
        ModelCheckpoint(dirpath=Path(root) / "ckpts", monitor="val_loss", save_top_k=2, save_last=True)
    ]
    if die_at is not None:
        callbacks.append(_Die(die_at, io))
    trainer = pl.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=1, plugins=[io], callbacks=callbacks,
                         logger=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    model = _Tiny()
    trainer.fit(model, _data(), _data(), ckpt_path="last" if resume else None)
    return model


def _state(model: _Tiny) -> dict[str, Any]:
    trainer = model.trainer
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optim": trainer.optimizers[0].state_dict(),
        "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "step": trainer.global_step,
    }


def _pointers(d: Path) -> dict[str, int]:
    return {p.name: json.loads(p.read_text())["step"] for p in sorted(d.glob("*.ckpt"))}


def _steps(d: Path) -> list[int]:
    from tiercheck.format.steps import list_steps
    from tiercheck.tiers.local import LocalTier

    return list_steps(LocalTier(d)).committed


def test_killed_fit_resumes_from_last_bit_identical_and_retention_keeps_named_steps(tmp_path: Path) -> None:
    whole = _state(_fit(str(tmp_path / "a"), resume=True))  # an empty directory: a fresh start

    run = tmp_path / "b"
    killed = fork_server().Process(target=_fit, args=(str(run), False, 2))  # torch imported: it imports Lightning only
    killed.start()
    killed.join(120)
    assert killed.exitcode == 0
    assert _pointers(run / "ckpts")["last.ckpt"] == 10  # 2 epochs of 5 batches
    resumed = _state(_fit(str(run), resume=True))
    for key in ("model", "optim", "sched", "step"):
        assert_identical(resumed[key], whole[key], key, any_order=True)

    named = _pointers(run / "ckpts")
    assert len(named) == 3 and named["last.ckpt"] == 20  # top 2 + last
    # keep_last=1, but every step a pointer names stays; the steps of removed top-k files are gone
    assert _steps(run / "local") == sorted(set(named.values()))
    assert set(named.values()) <= set(_steps(run / "remote"))


def test_values_needing_pickle_are_refused_unless_allowed(tmp_path: Path) -> None:
    io = TiercheckCheckpointIO(tmp_path / "local")
    checkpoint = {"global_step": 3, "state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"f": object()}}
    with pytest.raises(UnsupportedValueError, match="allow_pickle=True"):
        io.save_checkpoint(checkpoint, tmp_path / "x.ckpt")
    io.teardown()
    io = TiercheckCheckpointIO(tmp_path / "local", allow_pickle=True)
    checkpoint["hyper_parameters"] = {"f": frozenset({1})}
    io.save_checkpoint(checkpoint, tmp_path / "x.ckpt")
    io.teardown()
    refusing = TiercheckCheckpointIO(tmp_path / "local")
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle=True"):
        refusing.load_checkpoint(tmp_path / "x.ckpt")
    refusing.teardown()  # Lightning's, at the end of fit: gives the directory back
    back = TiercheckCheckpointIO(tmp_path / "local", allow_pickle=True).load_checkpoint(tmp_path / "x.ckpt")
    assert back["hyper_parameters"] == {"f": frozenset({1})} and torch.equal(back["state_dict"]["w"], torch.ones(2))


def _ckpt(step: int, w: float, score: float) -> dict[str, Any]:
    return {"global_step": step, "state_dict": {"w": torch.full((64, 64), w)},
            "callbacks": {"ModelCheckpoint": {"best_model_score": torch.tensor(score)}}}  # fmt: skip


def _loaded(io: TiercheckCheckpointIO, path: Path) -> tuple[float, float]:
    back = io.load_checkpoint(path)
    return float(back["state_dict"]["w"][0, 0]), float(back["callbacks"]["ModelCheckpoint"]["best_model_score"])


def test_pointer_to_a_step_saved_again_after_a_rollback_is_refused(tmp_path: Path) -> None:
    """Step 3 saved; the operator rolls back (deletes local step 3), the next job loads step 1 and saves step 3
    again: the old step-3 pointer names a save that is gone and is refused, not loaded as the new weights with
    its old score; the new pointer loads."""
    io = TiercheckCheckpointIO(tmp_path / "local")
    io.save_checkpoint(_ckpt(1, 1.0, 0.1), tmp_path / "one.ckpt")
    io.save_checkpoint(_ckpt(3, 3.0, 0.3), tmp_path / "three.ckpt")
    io.teardown()
    shutil.rmtree(tmp_path / "local" / step_dir(3))
    io = TiercheckCheckpointIO(tmp_path / "local")
    assert _loaded(io, tmp_path / "one.ckpt") == (1.0, pytest.approx(0.1))
    io.save_checkpoint(_ckpt(3, 33.0, 0.33), tmp_path / "three-again.ckpt")
    io.teardown()
    reader = TiercheckCheckpointIO(tmp_path / "local")
    assert _loaded(reader, tmp_path / "three-again.ckpt") == (33.0, pytest.approx(0.33))
    with pytest.raises(CorruptCheckpointError, match=r"three\.ckpt.*save"):
        reader.load_checkpoint(tmp_path / "three.ckpt")
    reader.teardown()


def test_with_the_memory_tier_a_pointer_to_a_memory_only_step_loads_from_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """memory=MemoryOptions(...) reaches the plugin's Checkpointer: saves persist_every does not name are committed
    in memory only, their pointers are written all the same, and a fresh plugin loads one from memory."""
    with private_shm() as shm:
        memory = MemoryOptions(path=shm, persist_every=1000, keep_at_close=True)
        io = TiercheckCheckpointIO(tmp_path / "local", memory=memory)
        io.save_checkpoint(_ckpt(1, 1.0, 0.1), tmp_path / "one.ckpt")
        io.save_checkpoint(_ckpt(2, 2.0, 0.2), tmp_path / "two.ckpt")
        io.wait()
        assert _pointers(tmp_path) == {"one.ckpt": 1, "two.ckpt": 2} and _steps(tmp_path / "local") == []
        io.teardown()  # a clean close persists the newest memory step, step 2
        without = TiercheckCheckpointIO(tmp_path / "local")
        with pytest.raises(CheckpointNotFoundError):
            without.load_checkpoint(tmp_path / "one.ckpt")
        without.teardown()
        reader = TiercheckCheckpointIO(tmp_path / "local", memory=memory)
        with caplog.at_level(logging.INFO, logger="tiercheck"):
            back = reader.load_checkpoint(tmp_path / "one.ckpt")
        assert "restored step 1 from memory (" in caplog.text
        assert_identical(back["state_dict"], _ckpt(1, 1.0, 0.1)["state_dict"], any_order=True)
        reader.teardown()


def test_saving_a_step_again_after_loading_an_older_pointer_is_not_the_earlier_save(tmp_path: Path) -> None:
    """One plugin saves steps 1 and 3, loads step 1's pointer, and saves step 3 again with other weights: that
    save is a new one (refused here, as step 3 is committed), never a pointer naming the earlier step-3 save
    with the new save's bookkeeping."""
    io = TiercheckCheckpointIO(tmp_path / "local")
    io.save_checkpoint(_ckpt(1, 1.0, 0.1), tmp_path / "one.ckpt")
    io.save_checkpoint(_ckpt(3, 3.0, 0.3), tmp_path / "three.ckpt")
    io.wait()
    assert _loaded(io, tmp_path / "one.ckpt") == (1.0, pytest.approx(0.1))
    with pytest.raises(StepExistsError):
        io.save_checkpoint(_ckpt(3, 33.0, 0.33), tmp_path / "three-again.ckpt")
    io.teardown()
    assert not (tmp_path / "three-again.ckpt").exists()


def test_pointer_with_a_forged_step_is_refused(tmp_path: Path) -> None:
    """A pointer whose "step" was edited to another step's number is refused, never loaded as that step's
    weights with this pointer's bookkeeping."""
    io = TiercheckCheckpointIO(tmp_path / "local")
    io.save_checkpoint(_ckpt(1, 1.0, 0.1), tmp_path / "one.ckpt")
    io.save_checkpoint(_ckpt(3, 3.0, 0.3), tmp_path / "three.ckpt")
    io.teardown()
    forged = tmp_path / "three.ckpt"
    forged.write_text(forged.read_text().replace('"step":3', '"step":1', 1))
    reader = TiercheckCheckpointIO(tmp_path / "local")
    with pytest.raises(CorruptCheckpointError, match=r"three\.ckpt"):
        reader.load_checkpoint(forged)
    assert _loaded(reader, tmp_path / "one.ckpt") == (1.0, pytest.approx(0.1))
    reader.teardown()
