"""Adopting a run that already has checkpoints of another framework: a restore that finds no tiercheck
step but finds those never starts from scratch; it stops and names the ``tiercheck import`` command.
The checkpoints are made by the real libraries (``dcp.save``, ``torch.save``, Lightning's own writer)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tiercheck
from tests.conftest import seeded_tensors
from tiercheck.errors import ForeignCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def make_state(seed: int) -> dict[str, Any]:
    return {"model": seeded_tensors(seed, {"w": (16, 8), "b": (8,)}), "step": seed}


def restore_fresh(local: Path) -> int | None:
    with tiercheck.Checkpointer(make_state(99), local=local) as ck:
        return ck.restore()


def test_torchtitan_step_folders_stop_the_restore_with_the_import_command(tmp_path: Path) -> None:
    for step in (5, 10):
        dcp.save(make_state(step), checkpoint_id=tmp_path / f"step-{step}", no_dist=True)
    with pytest.raises(ForeignCheckpointError) as e:
        restore_fresh(tmp_path)
    msg = str(e.value)
    assert "step-5, step-10" in msg and "a DCP checkpoint" in msg
    assert f"`tiercheck import {tmp_path}/step-10 --to {tmp_path} --step 10`" in msg


def test_a_dcp_checkpoint_directory_itself_stops_the_restore(tmp_path: Path) -> None:
    dcp.save(make_state(3), checkpoint_id=tmp_path, no_dist=True)
    with pytest.raises(ForeignCheckpointError, match=rf"`tiercheck import {tmp_path} --to {tmp_path}`"):
        restore_fresh(tmp_path)


def test_torch_save_files_stop_the_restore(tmp_path: Path) -> None:
    torch.save(make_state(1), tmp_path / "model_1.pt")
    torch.save(make_state(2), tmp_path / "model_2.pt", _use_new_zipfile_serialization=False)  # a pickle
    with pytest.raises(ForeignCheckpointError, match=r"model_1\.pt, model_2\.pt.*--step 2`"):
        restore_fresh(tmp_path)


def test_a_lightning_ckpt_stops_the_restore(tmp_path: Path) -> None:
    TorchCheckpointIO = pytest.importorskip("lightning.pytorch.plugins.io").TorchCheckpointIO

    TorchCheckpointIO().save_checkpoint({"state_dict": make_state(4)["model"]}, tmp_path / "epoch=0-step=400.ckpt")
    with pytest.raises(ForeignCheckpointError, match=r"epoch=0-step=400\.ckpt.*--step 400`"):
        restore_fresh(tmp_path)


def test_deepspeed_tags_stop_the_restore_naming_deepspeeds_load_and_the_pickle_opt_in(tmp_path: Path) -> None:
    # DeepSpeed's layout (its engine's files are torch.save pickles, which need the opt-in to import)
    (tmp_path / "global_step7").mkdir()
    torch.save({"module": make_state(7)["model"]}, tmp_path / "global_step7" / "mp_rank_00_model_states.pt")
    (tmp_path / "latest").write_text("global_step7")
    with pytest.raises(ForeignCheckpointError, match=r"allow_pickle=True.*engine\.load_checkpoint\(.*tag='global_step7'\)"):
        restore_fresh(tmp_path)


def test_an_empty_or_unrelated_directory_is_still_a_fresh_start(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "last.ckpt").write_text(json.dumps({"format": "tiercheck-lightning"}))  # a pointer of ours
    (tmp_path / "broken.pt").write_bytes(b"not a torch file")
    assert restore_fresh(tmp_path) is None


def test_a_tiercheck_step_beside_foreign_ones_restores(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dcp.save(make_state(5), checkpoint_id=tmp_path / "step-5", no_dist=True)
    state = make_state(6)
    with tiercheck.Checkpointer(state, local=tmp_path) as ck:
        ck.save(6).wait()
    with caplog.at_level(logging.WARNING, logger="tiercheck"):
        assert restore_fresh(tmp_path) == 6
    # the warning about the foreign name gives tiercheck's own name of that very step
    assert "tiercheck's step 5 is step-00000005" in caplog.text


def test_the_deepspeed_plugins_own_tags_are_not_foreign(tmp_path: Path) -> None:
    # tiercheck's DeepSpeed plugin leaves JSON pointers named like DeepSpeed's files in its tags
    (tmp_path / "global_step7").mkdir()
    (tmp_path / "global_step7" / "mp_rank_00_model_states.pt").write_text('{"format": "tiercheck-deepspeed-pointer"}')
    (tmp_path / "latest").write_text("global_step7")
    assert restore_fresh(tmp_path) is None


def _restore_on_node(rank: int, world: int, root: str) -> str:
    with tiercheck.Checkpointer(make_state(rank), local=Path(root) / f"node{rank}") as ck:
        try:
            ck.restore()
        except ForeignCheckpointError as e:
            return str(e)
    return "fresh start"


def test_one_nodes_foreign_checkpoints_stop_every_rank_at_once(tmp_path: Path) -> None:
    from .distributed import run_ranks

    (tmp_path / "node0").mkdir()
    torch.save(make_state(3), tmp_path / "node0" / "model_3.pt")  # node 1's directory is empty
    said = run_ranks(_restore_on_node, 2, str(tmp_path), timeout=120)
    assert all(f"{tmp_path}/node0 holds no tiercheck step" in s for s in said), said
