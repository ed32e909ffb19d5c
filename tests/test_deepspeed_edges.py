"""The DeepSpeed checkpoint engine at its edges, against the real ``deepspeed`` package on CPU (gloo, real
processes): a failed write, DeepSpeed's own writer settings, model states on every data-parallel replica, a
universal checkpoint from an exported step, and a tag that leaves the directory. The helpers and the
shared-memory op's build are ``test_deepspeed``'s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cli import run
from tests.test_deepspeed import (
    _TEST_LIMIT_S,
    SAVE_AT,
    _assert_identical,
    _config,
    _engine,
    _launch,
    _save_train_restore,
    _shm_op_built,  # noqa: F401 - the module fixture that compiles DeepSpeed's op once, before any launch
    _snapshot,
    _train,
)

pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(_TEST_LIMIT_S, func_only=True)]


def _full_disk(rank: int, world_size: int, tmp: str) -> None:
    import errno

    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    save_dir, local = os.path.join(tmp, "checkpoints"), os.path.join(tmp, "node0")
    engine = _engine(1, 1, seed=0, local=local)
    _train(engine, range(2), rank)
    engine.save_checkpoint(save_dir)
    engine.checkpoint_engine.flush()
    expected = _snapshot(engine)
    tier = engine.checkpoint_engine.checkpointer(save_dir).tier

    def full(path: str, parts: Any) -> None:  # the node's disk fills up
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    tier.write = full
    _train(engine, range(2, 4), rank)
    engine.save_checkpoint(save_dir)  # returns: the copy to host memory worked
    with pytest.raises(OSError) as info:
        engine.checkpoint_engine.flush()  # the write did not
    assert info.value.errno == errno.ENOSPC
    assert Path(save_dir, "latest").read_text() == "global_step2"  # never names the failed step
    assert not os.listdir(os.path.join(save_dir, "global_step4"))  # and it has no pointer files
    engine.destroy()

    fresh = _engine(1, 1, seed=1, local=local)
    path, _ = fresh.load_checkpoint(save_dir)
    assert path is not None and "global_step2" in path
    _assert_identical(_snapshot(fresh), expected)


def test_a_failed_write_raises_and_the_previous_checkpoint_restores(tmp_path: Path) -> None:
    _launch(_full_disk, 1, str(tmp_path), timeout=120)


def _writer_settings(rank: int, world_size: int, tmp: str) -> list[str]:
    """A config with DeepSpeed's own writer settings: tiercheck builds no DeepSpeed writer (on CPU
    FastPersist's parallel-writer setup fails, and DataStates is not installed), warns once naming
    each setting it replaces, and resumes. install(engine) after initialize names them too."""
    import warnings

    import deepspeed

    import tiercheck.integrations.deepspeed as tiercheck_ds

    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    writer = {"type": "fast", "decoupled": True, "io_buffer_size": 1 << 20}

    def engine(seed: int) -> tuple[Any, list[str]]:
        config = {
            **_config(2, 1),
            "checkpoint": {"writer": dict(writer), "checkpoint_serialization": False},
            "datastates_ckpt": {"host_cache_size": 1},
        }
        tiercheck_ds.install(config, local=os.path.join(tmp, "node0"))
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            built, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        return built, [str(w.message) for w in caught if "have no effect" in str(w.message)]

    first, messages = engine(0)
    _train(first, range(2), rank)
    first.save_checkpoint(os.path.join(tmp, "ckpt"), tag="t")
    expected = _snapshot(first)
    first.destroy()
    fresh, _ = engine(1)
    fresh.load_checkpoint(os.path.join(tmp, "ckpt"))
    _assert_identical(_snapshot(fresh), expected)
    fresh.destroy()

    # install(engine) after DeepSpeed built its own (torch.save) engine from a setting tiercheck ignores
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    config = {**_config(2, 1), "checkpoint": {"checkpoint_serialization": False}}
    late, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiercheck_ds.install(late, local=os.path.join(tmp, "node1"))
    late.destroy()
    return messages + [str(w.message) for w in caught if "have no effect" in str(w.message)]


def test_deepspeed_writer_settings_are_named_as_ignored_and_do_not_break_the_engine(tmp_path: Path) -> None:
    [messages] = _launch(_writer_settings, 1, str(tmp_path), timeout=120)
    assert len(messages) == 2, messages
    assert (
        "settings have no effect: checkpoint.writer.type, checkpoint.writer.decoupled, "
        "checkpoint.writer.io_buffer_size, checkpoint.checkpoint_serialization, datastates_ckpt (" in messages[0]
    )
    assert "settings have no effect: checkpoint.checkpoint_serialization (" in messages[1]


def test_model_states_are_written_by_every_data_parallel_replica(tmp_path: Path) -> None:
    """ZeRO-2 on two data-parallel ranks of one node: both hand DeepSpeed's model-state file to
    tiercheck (DeepSpeed's own engine: rank 0 alone), both write some of it, and the run resumes."""
    from tiercheck.format.steps import read_manifest
    from tiercheck.tiers.local import LocalTier

    _launch(_save_train_restore, 2, 2, str(tmp_path), False, True, timeout=120)
    arrays = read_manifest(LocalTier(tmp_path / "node"), SAVE_AT).arrays
    model = {p: rec for p, rec in arrays.items() if p.startswith("mp_rank_00_model_states.pt/module/")}
    assert len(model) == 4, sorted(arrays)  # two weights, two biases: one array each, written once
    writers = {path: set(rec.owners.values()) for path, rec in model.items()}
    assert set().union(*writers.values()) == {0, 1}, writers  # the writing is spread over both replicas
    folder = tmp_path / "checkpoints" / f"global_step{SAVE_AT}"  # both wrote the pointer file: one whole file
    assert sorted(p.name for p in folder.iterdir()) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert json.loads((folder / "mp_rank_00_model_states.pt").read_text())["step"] == SAVE_AT


def _universal(rank: int, world_size: int, tmp: str) -> None:
    """The route to a universal checkpoint: export, DeepSpeed's ds_to_universal, load_universal."""
    import deepspeed

    import tiercheck.integrations.deepspeed as tiercheck_ds
    from tiercheck.errors import CheckpointNotFoundError

    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    save_dir, local, exported = (os.path.join(tmp, d) for d in ("checkpoints", "node0", "exported"))
    engine = _engine(1, 1, seed=0, local=local)
    _train(engine, range(2), rank)
    engine.save_checkpoint(save_dir)
    expected = _snapshot(engine)
    engine.destroy()
    tag = tiercheck_ds.export(local, exported)
    convert = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--inject_missing_state"]
    convert += ["--input_folder", os.path.join(exported, tag), "--output_folder", os.path.join(exported, "universal")]
    convert += ["--num_extract_workers", "1", "--num_merge_workers", "1"]
    done = subprocess.run(convert, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    Path(exported, "latest_universal").write_text("universal")

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    config = {**_config(1, 1), "checkpoint": {"load_universal": True}}
    fresh, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    tiercheck_ds.install(fresh, local=local)
    with pytest.raises(
        CheckpointNotFoundError, match=r"not a universal checkpoint: .*-m deepspeed\.checkpoint\.ds_to_universal"
    ):
        fresh.load_checkpoint(save_dir, tag=tag)  # a tiercheck step, not converted
    path, _ = fresh.load_checkpoint(exported)  # no tag: DeepSpeed's latest_universal, not tiercheck's newest step
    assert path == os.path.join(exported, "universal", "mp_rank_00_model_states.pt"), path
    _assert_identical(_snapshot(fresh), expected)
    fresh.destroy()


def test_universal_checkpoint_from_an_exported_step(tmp_path: Path) -> None:
    _launch(_universal, 1, str(tmp_path), timeout=180)


def _escaping_tag(rank: int, world_size: int, tmp: str) -> None:
    import tiercheck
    import tiercheck.integrations.deepspeed as tiercheck_ds
    from tiercheck.errors import UnsafeCheckpointError

    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    local = os.path.join(tmp, "node0")
    for step, tag in ((1, "../escaped"), (2, "/tmp/absolute")):  # a hand-made step, as a hostile one would be
        state = {
            "tiercheck.deepspeed": {"tag": tag, "files": ["mp_rank_00_model_states.pt"]},
            "mp_rank_00_model_states.pt": {"module": {"w": torch.zeros(2)}},
        }
        with tiercheck.Checkpointer(state, local=local) as ckpt:
            ckpt.save(step, metadata={"deepspeed": {"tag": tag}}).wait()
        with pytest.raises(UnsafeCheckpointError, match=f"the DeepSpeed tag {tag!r} is not a plain directory name"):
            tiercheck_ds.export(local, os.path.join(tmp, "exported"), step=step)
    engine = _engine(0, 1, seed=0, local=local)
    with pytest.raises(UnsafeCheckpointError, match="'/tmp/absolute' is not a plain directory name"):
        engine.load_checkpoint(os.path.join(tmp, "checkpoints"))  # the newest step
    engine.destroy()


def test_a_tag_that_leaves_the_directory_is_refused(tmp_path: Path) -> None:
    _launch(_escaping_tag, 1, str(tmp_path / "run"), timeout=120)
    done = run("export-deepspeed", str(tmp_path / "run" / "node0"), str(tmp_path / "x"), check=False)
    assert done.returncode != 0
    assert "'/tmp/absolute' is not a plain directory name" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written beside it
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["node0"]
    assert not Path("/tmp/absolute").exists()
