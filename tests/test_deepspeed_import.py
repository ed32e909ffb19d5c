"""``tiercheck import`` of checkpoints DeepSpeed wrote itself (its engine's ``torch.save`` files, ZeRO-2 on CPU,
gloo, real processes): the step restores through the DeepSpeed plugin into a fresh engine bit-identical (parameters,
ZeRO's optimizer partitions, DeepSpeed's counters, the ``client_state``) and the run continues as the
uninterrupted one; a tag whose files need pickle is refused without the opt-in, naming the file."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cli import run
from tests.test_deepspeed import (
    _TEST_LIMIT_S,
    _assert_identical,
    _config,
    _engine,
    _launch,
    _shm_op_built,  # noqa: F401 - the module fixture that compiles DeepSpeed's op once, before any launch
    _snapshot,
    _train,
)

pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(_TEST_LIMIT_S, func_only=True)]

STAGE, SAVE_AT, STEPS = 2, 4, 6  # STAGE: where a test does not say


class Opaque:
    """A user's object in ``client_state``: not among the types allowed without pickle."""

    def __init__(self, value: int) -> None:
        self.value = value


def _native(stage: int, world_size: int, seed: int) -> Any:
    """An engine with DeepSpeed's own checkpoint engine: its saves are ``torch.save`` files, no tiercheck."""
    import deepspeed

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    config = _config(stage, world_size)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _save_natively(rank: int, world_size: int, tmp: str, stage: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """DeepSpeed's own save of tag ``global_stepN``, then a later tag whose ``client_state`` holds a class of the
    user's (``latest`` names it); returns this rank's state at the save and after the uninterrupted run."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))
    native_dir = os.path.join(tmp, "native")
    native = _native(stage, world_size, seed=0)
    _train(native, range(SAVE_AT), rank)
    native.save_checkpoint(native_dir, tag=f"global_step{SAVE_AT}", client_state={"epoch": 7})
    at_save = _snapshot(native)
    _train(native, range(SAVE_AT, STEPS), rank)
    native.save_checkpoint(native_dir, tag="opaque", client_state={"obj": Opaque(3)})
    uninterrupted = _snapshot(native)
    native.destroy()
    return at_save, uninterrupted


def _resume(
    rank: int, world_size: int, tmp: str, stage: int, expected: list[tuple[dict[str, Any], dict[str, Any]]]
) -> None:
    """A fresh engine with the plugin, its local directory the imported step's: restores it, then trains on."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))
    at_save, uninterrupted = expected[rank]
    resumed = os.path.join(tmp, "resumed")  # a save_dir of its own: the pointers go there
    fresh = _engine(stage, world_size, seed=1, local=os.path.join(tmp, "ck"))
    before = fresh.module.state_dict()
    assert not all(torch.equal(before[k], v) for k, v in at_save["module"].items())  # the load has work to do
    load_path, client_state = fresh.load_checkpoint(resumed)  # no tag: the newest tiercheck step
    model_file = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    assert load_path == os.path.join(resumed, f"global_step{SAVE_AT}", model_file), load_path
    assert client_state["epoch"] == 7, client_state
    _assert_identical(_snapshot(fresh), at_save)
    _train(fresh, range(SAVE_AT, STEPS), rank)
    _assert_identical(_snapshot(fresh), uninterrupted)
    fresh.destroy()


@pytest.mark.parametrize(("stage", "world_size"), [(2, 1), (2, 2), (3, 2)])
def test_a_deepspeed_checkpoint_imports_and_resumes_bit_identical(tmp_path: Path, stage: int, world_size: int) -> None:
    """ZeRO-2 on 1 and 2 ranks, ZeRO-3 on 2 (each rank its own model states too): the files one process imports
    (every rank's partition) go back to their ranks, through the plugin's load_checkpoint."""
    from tiercheck.errors import UnsafeCheckpointError
    from tiercheck.format.steps import read_manifest
    from tiercheck.integrations.importer import import_checkpoint
    from tiercheck.tiers.local import LocalTier

    expected = _launch(_save_natively, world_size, str(tmp_path), stage, timeout=180)
    native_dir = tmp_path / "native"
    model_file = native_dir / "opaque" / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else
                                          "mp_rank_00_model_states.pt")
    with pytest.raises(UnsafeCheckpointError, match=rf"{re.escape(str(model_file))} needs unpickling .*--allow-pickle"):
        import_checkpoint(native_dir, tmp_path / "refused")  # the tag `latest` names
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())
    trusted = import_checkpoint(native_dir, tmp_path / "trusted", allow_pickle=True)
    assert (trusted.step, trusted.tag) == (STEPS, "opaque")  # numbered by its global_steps

    ck = tmp_path / "ck"
    done = run("import", str(native_dir), "--tag", f"global_step{SAVE_AT}", "--to", str(ck))
    assert f"(DeepSpeed checkpoint 'global_step{SAVE_AT}') as step {SAVE_AT} of {ck}" in done.stdout
    manifest = read_manifest(LocalTier(ck), SAVE_AT)
    assert manifest.metadata == {"deepspeed": {"tag": f"global_step{SAVE_AT}"}}
    files = {path.split("/")[0] for path in manifest.arrays}
    kinds = ["optim_states", "model_states"] if stage == 3 else ["optim_states"]
    partitions = {f"zero_pp_rank_{r}_mp_rank_00_{kind}.pt" for r in range(world_size) for kind in kinds}
    assert files == (partitions if stage == 3 else {"mp_rank_00_model_states.pt", *partitions}), files

    shutil.rmtree(native_dir)  # the resumed run reads the imported step alone
    _launch(_resume, world_size, str(tmp_path), stage, expected, timeout=180)


def test_import_refuses_a_source_that_is_not_one_deepspeed_tag(tmp_path: Path) -> None:
    """Told before anything is written: a missing tag, --tag for another format, a --step that is not the
    checkpoint's own, the plugin's pointer files (already a tiercheck step)."""
    tag = tmp_path / "ds" / "global_step3"
    tag.mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(2)}, "global_steps": 3}, tag / "mp_rank_00_model_states.pt")
    (tmp_path / "ds" / "latest").write_text("global_step3")
    missing = run("import", str(tmp_path / "ds"), "--tag", "global_step9", "--to", str(tmp_path / "ck"), check=False)
    assert missing.returncode == 1 and "global_step9: no such DeepSpeed tag folder" in missing.stderr
    wrong = run("import", str(tmp_path / "ds"), "--step", "5", "--to", str(tmp_path / "ck"), check=False)
    assert wrong.returncode == 1 and "--step 5:" in wrong.stderr and "global_steps=3" in wrong.stderr
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    other = run("import", str(tmp_path / "a.pt"), "--tag", "x", "--to", str(tmp_path / "ck"), check=False)
    assert other.returncode == 1 and "not a DeepSpeed checkpoint" in other.stderr
    (tag / "mp_rank_00_model_states.pt").write_text('{"format": "tiercheck-deepspeed-pointer", "step": 3}')
    ours = run("import", str(tag), "--to", str(tmp_path / "ck"), check=False)
    assert ours.returncode == 1 and "is a tiercheck step already" in ours.stderr
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("tag", ["global_step7", "mytag"])
def test_the_command_the_foreign_checkpoint_error_names_for_a_deepspeed_tag_imports_it(tmp_path: Path, tag: str) -> None:
    """A Checkpointer pointed at DeepSpeed's save_dir stops, naming `tiercheck import` for the newest tag (a
    `global_stepN/` one, or whatever `latest` names); that command writes the tag as a step, and then the same
    restore finds it instead of stopping."""
    import tiercheck
    from tiercheck.errors import ForeignCheckpointError

    (tmp_path / tag).mkdir()
    saved = {"module": {"w": torch.arange(6.0)}, "global_steps": 7, "epoch": 2}
    torch.save(saved, tmp_path / tag / "mp_rank_00_model_states.pt")
    (tmp_path / "latest").write_text(tag)
    state: dict[str, Any] = {"mp_rank_00_model_states.pt": {"module": {"w": torch.zeros(6)}, "global_steps": 0,
                                                            "epoch": 0}}  # fmt: skip
    with pytest.raises(ForeignCheckpointError) as e, tiercheck.Checkpointer(state, local=tmp_path) as ck:
        ck.restore()
    assert "engine.load_checkpoint(" in str(e.value)
    command = str(e.value).split("`")[1].split()
    assert command == ["tiercheck", "import", str(tmp_path), "--tag", tag, "--to", str(tmp_path)]
    run(*command[1:])
    with tiercheck.Checkpointer(state, local=tmp_path) as ck:
        assert ck.restore() == 7
    assert torch.equal(state["mp_rank_00_model_states.pt"]["module"]["w"], saved["module"]["w"])
    assert state["mp_rank_00_model_states.pt"]["epoch"] == 2


def _plugin_in_deepspeeds_own_directory(rank: int, world_size: int, tmp: str) -> None:
    """install(engine, local=save_dir), save_dir holding DeepSpeed's own tags: load_checkpoint continues from the
    tag `latest` names (DeepSpeed's files read with weights_only), not a fresh start and not an error; the next
    save is a tiercheck step in that directory, which the next load restores."""
    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    save_dir = os.path.join(tmp, "checkpoints")
    native = _native(STAGE, 1, seed=0)
    _train(native, range(SAVE_AT), rank)
    native.save_checkpoint(save_dir)
    at_save = _snapshot(native)
    native.destroy()

    adopted = _engine(STAGE, 1, seed=1, local=save_dir)
    load_path, _ = adopted.load_checkpoint(save_dir)
    assert load_path == os.path.join(save_dir, f"global_step{SAVE_AT}", "mp_rank_00_model_states.pt"), load_path
    _assert_identical(_snapshot(adopted), at_save)
    _train(adopted, range(SAVE_AT, STEPS), rank)
    adopted.save_checkpoint(save_dir)
    at_next = _snapshot(adopted)
    adopted.destroy()
    assert os.path.isdir(os.path.join(save_dir, f"step-{STEPS:08d}"))

    fresh = _engine(STAGE, 1, seed=2, local=save_dir)
    fresh.load_checkpoint(save_dir)
    _assert_identical(_snapshot(fresh), at_next)
    fresh.destroy()


def test_the_plugin_pointed_at_deepspeeds_own_directory_continues_from_its_newest_tag(tmp_path: Path) -> None:
    _launch(_plugin_in_deepspeeds_own_directory, 1, str(tmp_path), timeout=180)
