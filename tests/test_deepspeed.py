"""The DeepSpeed checkpoint engine, against the real ``deepspeed`` package on CPU (gloo, real processes).

Each test trains a small model, saves through tiercheck, keeps training (the uninterrupted run),
then builds a fresh engine from a different initialisation, loads, trains the same steps and
checks that parameters, optimizer state and DeepSpeed's counters equal the uninterrupted run's
bit for bit. With two ranks each rank is a node with its own local directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import run_ranks

pytestmark = pytest.mark.frameworks

STEPS, SAVE_AT = 6, 3


def _config(stage: int, world_size: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2 * world_size,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }


def _engine(stage: int, world_size: int, seed: int, **install_options: Any) -> Any:
    import deepspeed

    import tiercheck.integrations.deepspeed as tiercheck_ds

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    config = _config(stage, world_size)
    if install_options.pop("before_initialize", False):
        tiercheck_ds.install(config, **install_options)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        tiercheck_ds.install(engine, **install_options)
    return engine


def _train(engine: Any, steps: range, rank: int) -> None:
    for i in steps:
        g = torch.Generator().manual_seed(1000 * i + rank)
        x, y = torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()


def _snapshot(engine: Any) -> dict[str, Any]:
    """Everything that must match: module parameters, the optimizer's state (ZeRO's fp32
    partitions included) and DeepSpeed's step counters."""
    return {
        "module": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
        "optimizer": _clone(engine.optimizer.state_dict()),
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
    }


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clone(v) for v in obj]
    if hasattr(obj, "__dict__"):  # DeepSpeed's loss scaler
        return {"__class__": type(obj).__name__, **_clone(vars(obj))}
    return obj


def _assert_identical(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path  # bits, not values
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            _assert_identical(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _save_train_restore(rank: int, world_size: int, stage: int, tmp: str, before_initialize: bool) -> list[str]:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))
    save_dir = os.path.join(tmp, "checkpoints")
    local = os.path.join(tmp, f"node{rank}")  # each rank its own node
    engine = _engine(stage, world_size, seed=0, local=local, before_initialize=before_initialize)
    _train(engine, range(SAVE_AT), rank)
    engine.save_checkpoint(save_dir, client_state={"epoch": 7})
    _train(engine, range(SAVE_AT, STEPS), rank)
    uninterrupted = _snapshot(engine)
    engine.destroy()  # commits and waits
    tag = f"global_step{SAVE_AT}"

    fresh = _engine(stage, world_size, seed=1, local=local, before_initialize=before_initialize)
    assert not all(torch.equal(p, q) for p, q in zip(fresh.module.state_dict().values(), uninterrupted["module"].values()))
    load_path, client_state = fresh.load_checkpoint(save_dir)
    assert load_path == os.path.join(save_dir, tag, "mp_rank_00_model_states.pt"), load_path
    assert client_state["epoch"] == 7, client_state
    assert fresh.global_steps == SAVE_AT
    _train(fresh, range(SAVE_AT, STEPS), rank)
    _assert_identical(_snapshot(fresh), uninterrupted)
    fresh.destroy()
    return sorted(os.listdir(local))


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_is_bit_identical(tmp_path: Path, stage: int, world_size: int) -> None:
    results = run_ranks(
        _save_train_restore, world_size, stage, str(tmp_path), world_size == 2 and stage == 1, timeout=120
    )
    for steps in results:  # every node's local directory has the committed step
        assert f"step-{SAVE_AT:08d}" in steps, steps
    save_dir = tmp_path / "checkpoints"
    assert (save_dir / "latest").read_text() == f"global_step{SAVE_AT}"
    # DeepSpeed's files in the tag directory are pointers to the tiercheck step, not torch.save files
    pointers = [json.loads(p.read_text()) for p in (save_dir / f"global_step{SAVE_AT}").glob("*.pt")]
    assert all(p["step"] == SAVE_AT for p in pointers), pointers
    expected = {"mp_rank_00_model_states.pt"}
    if stage > 0:
        expected |= {f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt" for d in range(world_size)}
    assert {p["file"] for p in pointers} == expected
