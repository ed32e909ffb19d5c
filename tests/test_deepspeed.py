"""The DeepSpeed checkpoint engine, against the real ``deepspeed`` package on CPU (gloo, real processes).

Each test trains a small model, saves through tiercheck, keeps training (the uninterrupted run),
then builds a fresh engine from a different initialisation, loads, trains the same steps and
checks that parameters, optimizer state and DeepSpeed's counters equal the uninterrupted run's
bit for bit. With two ranks each rank is a node with its own local directory, unless a test says
they share one.
"""

from __future__ import annotations

import enum
import glob
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cli import run
from tests.conftest import keep_built_extensions
from tests.distributed import RankFailed, run_ranks
from tests.shm import private_shm

_BUILD_LIMIT_S = 900
_TEST_LIMIT_S = 300  # pytest-timeout's, per test call: above every launch's own timeout, which says more

# func_only: the op's build (a module fixture, with its own limit) is not charged to the first test.
pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(_TEST_LIMIT_S, func_only=True)]


@pytest.fixture(scope="module", autouse=True)
def _shm_op_built(request: pytest.FixtureRequest) -> None:
    """Compile DeepSpeed's shared-memory op (g++; ~30 s idle, minutes on a loaded machine) once,
    here, before the tests whose rank launches have timeouts: a compile killed by a launch
    timeout would fail the test for the wrong reason. It goes to this run's private
    TORCH_EXTENSIONS_DIR (conftest.py), which starts with the op an earlier run built: then
    ninja finds it up to date and nothing is compiled."""
    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    try:
        built = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=_BUILD_LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"compiling DeepSpeed's shared-memory op took over {_BUILD_LIMIT_S} s (is the machine overloaded?)")
    assert built.returncode == 0, (
        f"compiling DeepSpeed's shared-memory op failed (it needs g++):\n{built.stderr[-3000:]}"
    )
    keep_built_extensions(request.config)  # the next run copies it and compiles nothing (conftest.py)


def _launch(body: Callable[..., Any], world_size: int, *args: Any, timeout: float) -> list[Any]:
    """``run_ranks`` whose timeout says why: each rank prints its threads' stacks (to the test's
    captured stderr) 10 s before the limit, and a compile lock left in TORCH_EXTENSIONS_DIR is named."""
    try:
        return run_ranks(_watched, world_size, body, timeout - 10, *args, timeout=timeout)
    except RankFailed as e:
        if "timed out after" not in str(e):
            raise
        ext = os.environ.get("TORCH_EXTENSIONS_DIR", "")
        locks = glob.glob(os.path.join(ext, "**", "lock"), recursive=True) if ext else []
        why = (
            f"DeepSpeed waits forever on {locks} left by a killed compile of its op: delete it"
            if locks
            else "each rank's stacks, printed 10 s before the limit, are in the captured stderr"
        )
        raise RankFailed(f"{e}\n{why}") from None


def _watched(rank: int, world_size: int, body: Callable[..., Any], dump_after: float, *args: Any) -> Any:
    import faulthandler

    faulthandler.dump_traceback_later(dump_after)
    try:
        return body(rank, world_size, *args)
    finally:
        faulthandler.cancel_dump_traceback_later()


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
    if isinstance(obj, enum.Enum):  # ZeRO's stage: as it is, so that a snapshot pickles to another process
        return obj
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


def _save_train_restore(
    rank: int,
    world_size: int,
    stage: int,
    tmp: str,
    before_initialize: bool,
    one_node: bool = False,
    memory: str | None = None,
) -> list[str]:
    from tiercheck import MemoryOptions

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))
    save_dir = os.path.join(tmp, "checkpoints")
    local = os.path.join(tmp, "node" if one_node else f"node{rank}")  # by default each rank its own node
    options: dict[str, Any] = {"memory": MemoryOptions(path=memory, persist_every=1000, keep_at_close=True)} if memory else {}
    engine = _engine(stage, world_size, seed=0, local=local, before_initialize=before_initialize, **options)
    _train(engine, range(SAVE_AT), rank)
    engine.save_checkpoint(save_dir, client_state={"epoch": 7})
    _train(engine, range(SAVE_AT, STEPS), rank)
    uninterrupted = _snapshot(engine)
    engine.destroy()  # commits and waits
    tag = f"global_step{SAVE_AT}"
    if memory:  # the clean close persisted the step: gone from disk, memory alone holds it (as after a kill)
        shutil.rmtree(os.path.join(local, f"step-{SAVE_AT:08d}"))

    fresh = _engine(stage, world_size, seed=1, local=local, before_initialize=before_initialize, **options)
    before = fresh.module.state_dict()
    assert not all(torch.equal(before[k], v) for k, v in uninterrupted["module"].items())  # the load has work to do
    load_path, client_state = fresh.load_checkpoint(save_dir)
    model_file = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    assert load_path == os.path.join(save_dir, tag, model_file), load_path
    assert client_state["epoch"] == 7, client_state
    assert fresh.global_steps == SAVE_AT
    _train(fresh, range(SAVE_AT, STEPS), rank)
    _assert_identical(_snapshot(fresh), uninterrupted)
    fresh.destroy()
    return sorted(os.listdir(local))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_is_bit_identical(tmp_path: Path, stage: int, world_size: int) -> None:
    results = _launch(
        _save_train_restore, world_size, stage, str(tmp_path), world_size == 2 and stage == 1, timeout=120
    )
    for steps in results:  # every node's local directory has the committed step
        assert f"step-{SAVE_AT:08d}" in steps, steps
    save_dir = tmp_path / "checkpoints"
    assert (save_dir / "latest").read_text() == f"global_step{SAVE_AT}"
    # DeepSpeed's files in the tag directory are pointers to the tiercheck step, not torch.save files
    pointers = [json.loads(p.read_text()) for p in (save_dir / f"global_step{SAVE_AT}").glob("*.pt")]
    assert all(p["step"] == SAVE_AT for p in pointers), pointers
    expected = (
        {f"zero_pp_rank_{d}_mp_rank_00_model_states.pt" for d in range(world_size)}
        if stage == 3
        else {"mp_rank_00_model_states.pt"}
    )
    if stage > 0:
        expected |= {f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt" for d in range(world_size)}
    assert {p["file"] for p in pointers} == expected


def test_with_the_memory_tier_a_checkpoint_on_disk_nowhere_resumes_from_memory(tmp_path: Path) -> None:
    """install(engine, memory=MemoryOptions(...)): the step is committed in memory, and with its local copy gone
    load_checkpoint restores it from memory, bit-identical (then persists it to the local directory again)."""
    with private_shm() as shm:
        (steps,) = _launch(_save_train_restore, 1, 1, str(tmp_path), False, False, str(shm), timeout=120)
    assert f"step-{SAVE_AT:08d}" in steps, steps


class Payload:
    """Unpickling it creates ``marker``: proof that a pickle ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.marker),))


class Opaque:
    """A user's object in ``client_state``: not among the types allowed without pickle."""

    def __init__(self, value: int) -> None:
        self.value = value


def _switch_formats(rank: int, world_size: int, tmp: str) -> None:
    """DeepSpeed's own checkpoints load with tiercheck installed, and tiercheck's export back to them."""
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    import tiercheck.integrations.deepspeed as tiercheck_ds

    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    native, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(1, 1))
    _train(native, range(2), rank)
    native.save_checkpoint(os.path.join(tmp, "native"), tag="native")  # torch.save files, no tiercheck
    expected = _snapshot(native)

    # A planted pickle in DeepSpeed's own files does not run without the caller's opt-in.
    import shutil

    from tiercheck.errors import UnsafeCheckpointError

    planted, ran = os.path.join(tmp, "planted"), os.path.join(tmp, "payload-ran")
    shutil.copytree(os.path.join(tmp, "native"), planted)
    model_file = os.path.join(planted, "native", "mp_rank_00_model_states.pt")
    torch.save({**torch.load(model_file, weights_only=False), "extra": Payload(ran)}, model_file)
    engine = _engine(1, 1, seed=1, local=os.path.join(tmp, "node0"))
    with pytest.raises(
        UnsafeCheckpointError, match=r"mp_rank_00_model_states\.pt: the checkpoint holds an object of type getattr"
    ):
        engine.load_checkpoint(planted, tag="native")
    assert not os.path.exists(ran)

    engine.load_checkpoint(os.path.join(tmp, "native"), tag="native")
    _assert_identical(_snapshot(engine), expected)

    # through tiercheck, then exported back to DeepSpeed's own files
    _train(engine, range(2, 4), rank)
    engine.save_checkpoint(os.path.join(tmp, "tc"), tag="mine")
    engine.checkpoint_engine.flush()
    expected = _snapshot(engine)
    assert tiercheck_ds.export(os.path.join(tmp, "node0"), os.path.join(tmp, "exported")) == "mine"
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    plain, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(1, 1))
    plain.load_checkpoint(os.path.join(tmp, "exported"))  # DeepSpeed alone, reading `latest`
    _assert_identical(_snapshot(plain), expected)
    fp32 = get_fp32_state_dict_from_zero_checkpoint(os.path.join(tmp, "exported"))
    _assert_identical({k: v for k, v in fp32.items()}, expected["module"])


def test_switch_between_deepspeed_and_tiercheck_formats(tmp_path: Path) -> None:
    _launch(_switch_formats, 1, str(tmp_path), timeout=120)
    # the same export from the command line gives the same files
    done = run("export-deepspeed", str(tmp_path / "node0"), str(tmp_path / "cli"))
    assert "exported step 4 as DeepSpeed checkpoint 'mine'" in done.stdout
    assert (tmp_path / "cli" / "latest").read_text() == "mine"
    names = sorted(p.name for p in (tmp_path / "exported" / "mine").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "cli" / "mine").iterdir()) and len(names) == 2
    for name in names:  # files this test wrote itself: full unpickling is fine here
        a, b = (torch.load(tmp_path / d / "mine" / name, weights_only=False) for d in ("exported", "cli"))
        _assert_identical(_clone(a), _clone(b))
    missing = run("export-deepspeed", str(tmp_path / "nowhere"), "x", check=False)
    assert missing.returncode == 1 and missing.stderr.startswith("tiercheck: error: no such directory")


def _tags_latest_and_pickle(rank: int, world_size: int, tmp: str) -> None:
    import tiercheck.integrations.deepspeed as tiercheck_ds
    from tiercheck.errors import CheckpointNotFoundError, StepExistsError, UnsafeCheckpointError

    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    save_dir, local = os.path.join(tmp, "checkpoints"), os.path.join(tmp, "node0")
    engine = _engine(2, 1, seed=0, local=local)
    _train(engine, range(2), rank)
    engine.save_checkpoint(save_dir, tag="first", client_state={"obj": Opaque(3)})
    # save_checkpoint returns once the state is copied; `latest` appears only after the commit
    if os.path.exists(os.path.join(save_dir, "latest")):
        assert engine.checkpoint_engine.checkpointer(save_dir).steps() == [2]
    at_first = _snapshot(engine)
    _train(engine, range(2, 4), rank)
    engine.save_checkpoint(save_dir, tag="second")
    engine.checkpoint_engine.flush()
    assert Path(save_dir, "latest").read_text() == "second"
    with pytest.raises(StepExistsError, match="step 4 .* is already committed"):
        engine.save_checkpoint(save_dir, tag="again")  # same global step: never overwritten
    at_second = _snapshot(engine)
    engine.destroy()

    fresh = _engine(2, 1, seed=1, local=local)
    with pytest.raises(UnsafeCheckpointError, match=r"tests\.test_deepspeed\.Opaque"):
        fresh.load_checkpoint(save_dir, tag="first")
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint with tag 'third'"):
        fresh.load_checkpoint(save_dir, tag="third")
    fresh.load_checkpoint(save_dir)  # no tag: the newest
    _assert_identical(_snapshot(fresh), at_second)
    fresh.destroy()

    trusting = _engine(2, 1, seed=1, local=local, safe_globals=[Opaque])
    _, client_state = trusting.load_checkpoint(save_dir, tag="first")
    assert isinstance(client_state["obj"], Opaque) and client_state["obj"].value == 3
    _assert_identical(_snapshot(trusting), at_first)

    # DeepSpeed before 0.17.1 calls create(tag) and commit(tag), then writes `latest` itself:
    # commit must return only once the step is committed
    ce = trusting.checkpoint_engine
    assert isinstance(ce, tiercheck_ds.TiercheckCheckpointEngine) and ce.is_decoupled()
    trusting.global_steps = 9
    with ce.saving(save_dir):
        ce.create("legacy")
        ce.save(
            {"module": trusting.module.state_dict()}, os.path.join(save_dir, "legacy", "mp_rank_00_model_states.pt")
        )
        assert not ce.is_decoupled()
        ce.commit("legacy")
    assert ce.checkpointer(save_dir).steps()[-1] == 9
    got = ce.load(os.path.join(save_dir, "legacy", "mp_rank_00_model_states.pt"))  # read alone, by pointer
    _assert_identical(got["module"], {k: v for k, v in trusting.module.state_dict().items()})


def test_tags_latest_after_commit_and_no_unpickling(tmp_path: Path) -> None:
    _launch(_tags_latest_and_pickle, 1, str(tmp_path), timeout=120)


def _replaced_node(rank: int, world_size: int, tmp: str, remote: str, options: dict[str, Any]) -> None:
    import shutil

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))
    save_dir, local = os.path.join(tmp, "checkpoints"), os.path.join(tmp, f"node{rank}")
    engine = _engine(2, world_size, seed=0, local=local, remote=remote, remote_options=options)
    _train(engine, range(2), rank)
    engine.save_checkpoint(save_dir)
    _train(engine, range(2, 4), rank)
    expected = _snapshot(engine)
    engine.destroy()  # waits for the drain to the remote tier too
    if rank == 1:
        shutil.rmtree(local)  # node 1 is replaced: its local copy is gone
    torch.distributed.barrier()
    fresh = _engine(2, world_size, seed=1, local=local, remote=remote, remote_options=options)
    fresh.load_checkpoint(save_dir)
    _train(fresh, range(2, 4), rank)
    _assert_identical(_snapshot(fresh), expected)
    fresh.destroy()


def test_replaced_node_restores_from_the_remote_tier(tmp_path: Path, s3_server: Any, s3_bucket: str) -> None:
    _launch(_replaced_node, 2, str(tmp_path), f"s3://{s3_bucket}/ds", s3_server.storage_options(), timeout=180)


def _pipeline(rank: int, world_size: int, tmp: str) -> None:
    """DeepSpeed's pipeline engine: layer files per stage, and an optimizer step that skips the
    decoupled commit (so the state must be copied before save_checkpoint returns)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    import tiercheck.integrations.deepspeed as tiercheck_ds

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))
    deepspeed.init_distributed(dist_backend="gloo")

    def engine(seed: int) -> Any:
        torch.manual_seed(seed)
        layers = [
            torch.nn.Linear(8, 16),
            torch.nn.Tanh(),
            torch.nn.Linear(16, 16),
            torch.nn.Tanh(),
            torch.nn.Linear(16, 4),
        ]
        net = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
        config = {**_config(1, 1), "gradient_accumulation_steps": 2, "train_batch_size": 4}
        e, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
        tiercheck_ds.install(e, local=os.path.join(tmp, f"node{rank}"))
        return e

    def batches(i: int) -> Any:
        g = torch.Generator().manual_seed(i)
        while True:
            yield torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)

    first = engine(0)
    for i in range(2):
        first.train_batch(data_iter=batches(i))
    first.save_checkpoint(os.path.join(tmp, "checkpoints"))
    for i in range(2, 4):
        first.train_batch(data_iter=batches(i))
    expected = _snapshot(first)
    first.destroy()
    fresh = engine(1)
    fresh.load_checkpoint(os.path.join(tmp, "checkpoints"))
    for i in range(2, 4):
        fresh.train_batch(data_iter=batches(i))
    _assert_identical(_snapshot(fresh), expected)


def test_pipeline_engine_resumes_bit_identical(tmp_path: Path) -> None:
    _launch(_pipeline, 2, str(tmp_path), timeout=120)
