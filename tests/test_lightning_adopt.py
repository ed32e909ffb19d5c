"""A Lightning run moved over to ``TiercheckCheckpointIO`` mid-way: Lightning's own ``last.ckpt`` (written by
Lightning's ``torch.save``, no plugin) resumes under the plugin and ends bit-identical to a whole tiercheck run;
``tiercheck import`` of that ``.ckpt`` restores it bit-identical."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import assert_identical

pytest.importorskip("lightning.pytorch", reason="needs Lightning (the test extra installs it)")

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

import tiercheck
from tiercheck.integrations.importer import import_checkpoint
from tiercheck.integrations.lightning import TiercheckCheckpointIO

from .test_lightning import EPOCHS, _data, _fit, _state, _Tiny

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated:FutureWarning"),
]


def _fit_with(root: Path, epochs: int, *, plugin: bool, ckpt_path: str | None) -> _Tiny:
    pl.seed_everything(0, verbose=False)
    plugins = [TiercheckCheckpointIO(root / "local")] if plugin else []
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, plugins=plugins,
                         callbacks=[ModelCheckpoint(dirpath=root / "ckpts", save_last=True)], logger=False,
                         enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    model = _Tiny()
    trainer.fit(model, _data(), _data(), ckpt_path=ckpt_path)
    return model


def test_lightnings_own_last_ckpt_resumes_under_the_plugin_bit_identical(tmp_path: Path) -> None:
    whole = _state(_fit(str(tmp_path / "whole"), resume=False))
    run = tmp_path / "run"
    _fit_with(run, 2, plugin=False, ckpt_path=None)  # Lightning alone: its own torch.save files
    last = run / "ckpts" / "last.ckpt"
    assert last.read_bytes()[:4] == b"PK\x03\x04"
    own = tmp_path / "own-last.ckpt"  # the plugin's first save replaces last.ckpt with its pointer
    shutil.copy(last, own)
    moved = _state(_fit_with(run, EPOCHS, plugin=True, ckpt_path=str(last)))
    assert_identical(moved, whole, "moved", any_order=True)

    # the same .ckpt imported: restore() gives back every tensor and value Lightning saved
    done = import_checkpoint(own, tmp_path / "imported", step=10)
    saved = torch.load(own, weights_only=True)
    empty: dict[str, Any] = {k: v for k, v in saved.items()}
    empty["state_dict"] = {k: torch.zeros_like(v) for k, v in saved["state_dict"].items()}
    with tiercheck.Checkpointer(empty, local=tmp_path / "imported") as ck:
        assert ck.restore() == done.step == 10
    assert_identical(empty["state_dict"], saved["state_dict"], "imported", any_order=True)
