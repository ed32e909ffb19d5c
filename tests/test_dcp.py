"""``torch.distributed.checkpoint`` (DCP) through tiercheck: ``TiercheckWriter`` / ``TiercheckReader``.

Every test compares bit for bit. The multi-rank ones run real gloo processes on CPU: an FSDP2 model saved by
2 ranks (``dcp.save`` and ``dcp.async_save``) is loaded by 1 rank (a plain model) and by 4 ranks (FSDP2 again),
DCP resharding as it does with its own storage.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import tiercheck
from tiercheck.format.paths import step_dir
from tiercheck.format.steps import list_steps, read_index
from tiercheck.integrations.dcp import TiercheckReader, TiercheckWriter
from tiercheck.tiers.local import LocalTier

from .conftest import assert_identical
from .distributed import run_ranks
from .ondisk import chunks_of, evict_packs, flip_chunk_byte
from .shm import private_shm

pytestmark = [
    # DCP's own notices: no process group in one process, its deprecated synchronize_staging in async_save
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:torch.distributed is unavailable:UserWarning"),
    pytest.mark.filterwarnings("ignore:`synchronize_staging` is deprecated:FutureWarning"),
]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 4))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(5, 6, generator=g)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _full(value: Any) -> Any:
    """Whole CPU tensors (DTensors gathered) of a nested state dict, cloned."""
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_full(v) for v in value]
    if hasattr(value, "full_tensor"):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


# ------------------------------------------------------------------------------- one process


def _state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model = _model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01 * (seed + 1))
    _train(model, optimizer, seed)
    msd, osd = get_state_dict(model, optimizer)
    return model, optimizer, {"model": msd, "optim": osd, "train": {"step": seed, "tokens": [seed, 2 * seed]}}


def test_save_load_one_process_steps_and_newest(tmp_path: Path) -> None:
    """checkpoint_id is the step (int or decimal string), None loads the newest; the step is a normal
    tiercheck step; a reader of the directory the writer holds shares its Checkpointer (no lock conflict)."""
    root = tmp_path / "ckpt"
    _, _, first = _state(1)
    _, _, second = _state(2)
    saved = {100: _full(first), 101: _full(second)}
    with TiercheckWriter(local=root) as writer:
        dcp.save(first, storage_writer=writer, checkpoint_id=100)
        dcp.save(second, storage_writer=writer, checkpoint_id="101")
        assert writer.checkpointer is not None and writer.checkpointer.steps() == [100, 101]
        with pytest.raises(CheckpointException, match="needs the step as checkpoint_id"):
            dcp.save(second, storage_writer=writer)  # DCP calls no reset() without one
        _, _, into = _state(7)
        dcp.load(into, storage_reader=TiercheckReader(local=root), checkpoint_id=100)  # while the writer is open
        assert_identical(saved[100], _full(into))
    for checkpoint_id, step in ((None, 101), ("100", 100), (101, 101)):
        model, optimizer, into = _state(9)
        dcp.load(into, storage_reader=TiercheckReader(local=root), checkpoint_id=checkpoint_id)
        assert_identical(saved[step], _full(into), f"step {step}")
        set_state_dict(model, optimizer, model_state_dict=into["model"], optim_state_dict=into["optim"])
        assert_identical(saved[step]["model"], _full(model.state_dict()))
    with pytest.raises(CheckpointException, match="step 99 is not committed"):
        dcp.load(into, storage_reader=TiercheckReader(local=root), checkpoint_id=99)
    # A plain tiercheck step: tiercheck.load (and so `tiercheck ls/verify/restore`) reads it.
    plain = tiercheck.load(root, 101)
    assert_identical(saved[101]["model"], {k[len("model.") :]: v for k, v in plain.items() if k.startswith("model.")})
    assert torch.load(io.BytesIO(plain["train.step"]), weights_only=True) == 2


def test_with_the_memory_tier_a_fresh_reader_loads_a_memory_only_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """memory=MemoryOptions(...) reaches the writers' and readers' Checkpointer: saves of steps persist_every does
    not name are committed in memory only, and a fresh reader loads such a step from memory, bit-identical."""
    root = tmp_path / "ckpt"
    _, _, first = _state(1)
    _, _, second = _state(2)
    saved = {1: _full(first), 2: _full(second)}
    with private_shm() as shm:
        memory = tiercheck.MemoryOptions(path=shm, persist_every=1000, keep_at_close=True)
        with TiercheckWriter(local=root, memory=memory) as writer:
            dcp.save(first, storage_writer=writer, checkpoint_id=1)
            dcp.save(second, storage_writer=writer, checkpoint_id=2)
            assert writer.checkpointer is not None and writer.checkpointer.steps() == []  # memory only
        assert list_steps(LocalTier(root)).committed == [2]  # a clean close persists the newest memory step
        _, _, into = _state(9)
        with pytest.raises(CheckpointException, match="step 1 is not committed"):  # a reader without memory
            dcp.load(into, storage_reader=TiercheckReader(local=root), checkpoint_id=1)
        with caplog.at_level(logging.INFO, logger="tiercheck"):
            dcp.load(into, storage_reader=TiercheckReader(local=root, memory=memory), checkpoint_id=1)
        assert "restored step 1 from memory (" in caplog.text
        assert_identical(saved[1], _full(into))
        assert list_steps(LocalTier(root)).committed == [1, 2]  # the restored memory step is persisted too


def test_a_state_of_many_tensors_fits_the_commit_metadata(tmp_path: Path) -> None:
    """DCP's per-tensor metadata for 5,000 deeply named tensors (1.2 MiB of JSON, as an MoE model's
    experts make with shorter names by the ten thousand) is kept with the step; the commit metadata
    was bounded at 1 MiB, and every save of such a state was refused."""
    names = [f"model.{'decoder.block.' * 10}{i // 64}.mlp.experts.{i % 64}.w1.weight" for i in range(5_000)]
    sd = {name: torch.full((1,), float(i)) for i, name in enumerate(names)}
    with TiercheckWriter(local=tmp_path) as writer:
        dcp.save(sd, storage_writer=writer, checkpoint_id=1)
    _, index, _ = read_index(LocalTier(tmp_path), 1)
    assert len(json.dumps(index["metadata"]["dcp"])) > 1 << 20
    into = {name: torch.zeros(1) for name in names}
    dcp.load(into, storage_reader=TiercheckReader(local=tmp_path), checkpoint_id=1)
    assert all(torch.equal(into[n], sd[n]) for n in names)


def test_drained_to_remote_and_loaded_from_there(tmp_path: Path) -> None:
    """The drain takes a DCP step to the remote tier; a node whose local directory is empty loads from there."""
    remote = (tmp_path / "remote").as_uri()
    _, _, sd = _state(3)
    saved = _full(sd)
    writer = TiercheckWriter(local=tmp_path / "node-a", remote=remote)
    dcp.save(sd, storage_writer=writer, checkpoint_id=40)
    assert writer.close() == []  # waited for the drain
    _, _, into = _state(6)
    dcp.load(into, storage_reader=TiercheckReader(local=tmp_path / "node-b", remote=remote))
    assert_identical(saved, _full(into))


def test_reader_refuses_pickles_and_process_mode_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with TiercheckWriter(local=root) as writer:
        dcp.save({"w": torch.arange(4.0), "cfg": _Config(3)}, storage_writer=writer, checkpoint_id=5)
        with pytest.raises(TypeError, match="AsyncCheckpointerType.THREAD"):
            pickle.dumps(writer)
    into: dict[str, Any] = {"w": torch.zeros(4), "cfg": None}
    with pytest.raises(CheckpointException, match="UnsafeCheckpointError"):
        dcp.load(into, storage_reader=TiercheckReader(local=root))
    dcp.load(into, storage_reader=TiercheckReader(local=root, safe_globals=[_Config]))
    assert into["cfg"] == _Config(3) and torch.equal(into["w"], torch.arange(4.0))


class _Config:
    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Config) and other.n == self.n


def test_corrupt_chunk_fails_load(tmp_path: Path) -> None:
    """A damaged chunk fails the load with every target tensor as it was: the good chunks, read first or
    concurrently (several chunks of several tensors), reach none of them."""
    root = tmp_path / "ckpt"
    saved = {"a": torch.arange(4096.0).reshape(64, 64), "w": torch.arange(64.0).reshape(8, 8)}
    with TiercheckWriter(local=root, write=tiercheck.WriteOptions(chunk_bytes=4096)) as writer:
        dcp.save(saved, storage_writer=writer, checkpoint_id=3)
    step = root / step_dir(3)
    assert len(chunks_of(step, "a")) == 4
    flip_chunk_byte(step, "a", chunks_of(step, "a")[-1], 5)
    into = {"a": torch.full((64, 64), -1.0), "w": torch.full((8, 8), -1.0)}
    with pytest.raises(CheckpointException) as info:
        dcp.load(into, storage_reader=TiercheckReader(local=root))
    errors = [exc for exc, _ in info.value.failures.values()]
    assert any(isinstance(e, tiercheck.CorruptCheckpointError) for e in errors), errors
    assert "CorruptCheckpointError" in str(info.value)
    for name, t in into.items():  # nothing reached the state
        assert torch.equal(t, torch.full_like(t, -1.0)), name


class _Materialize(DefaultLoadPlanner):
    """A planner that loads into tensors of its own and hands them to the state in ``commit_tensor``
    (``LoadPlanner``'s documented alternative to aliasing the state dict)."""

    def __init__(self, *, scratch: bool = False) -> None:
        super().__init__()
        self.scratch = torch.empty(8192) if scratch else None  # one buffer for every tensor, as FileSystemReader allows
        self.made: dict[str, torch.Tensor] = {}
        self.committed: dict[str, torch.Tensor] = {}

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        like = super().resolve_tensor(read_item)
        made = torch.empty_like(like) if self.scratch is None else self.scratch[: like.numel()].view(like.shape)
        self.made[read_item.dest_index.fqn] = made
        return made

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        assert tensor is self.made[read_item.dest_index.fqn]
        self.committed[read_item.dest_index.fqn] = tensor
        self.state_dict[read_item.dest_index.fqn].copy_(tensor)


def test_load_reads_into_fresh_memory_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader's buffers, and the tensors a planner makes for the load, are read into straight (restore
    stages no copy of them); DCP's tensors that alias the state are copied into once every chunk is verified,
    and a damaged chunk leaves a planner's made tensors uncommitted."""
    import tiercheck.integrations.dcp.reader as dcp_reader
    import tiercheck.restore.protocol

    copies: list[int] = []
    own: list[bool] = []
    staged, own_target = tiercheck.restore.protocol.staged, dcp_reader.own_target

    def counting_staged(items: Any, arena: Any = None) -> Any:
        reads, pairs = staged(items, arena)
        copies.append(len(pairs))
        return reads, pairs

    def recording_own_target(*args: Any) -> bool:
        own.append(own_target(*args))
        return own[-1]

    monkeypatch.setattr(tiercheck.restore.protocol, "staged", counting_staged)
    monkeypatch.setattr(dcp_reader, "own_target", recording_own_target)
    root = tmp_path / "ckpt"
    saved = {"a": torch.arange(4096.0).reshape(64, 64), "b": torch.arange(7.0), "cfg": {"lr": 0.5}}
    with TiercheckWriter(local=root, write=tiercheck.WriteOptions(chunk_bytes=4096)) as writer:
        dcp.save(saved, storage_writer=writer, checkpoint_id=1)
    into: dict[str, Any] = {"a": torch.zeros(64, 64), "b": torch.zeros(7), "cfg": {"lr": 0.0}}
    dcp.load(into, storage_reader=TiercheckReader(local=root))
    assert_identical(saved, into)
    assert copies == [0] and own == [False, False]  # in place: DCP's tensors are the state's

    for scratch, direct in ((False, [True, True]), (True, [True, False])):  # a shared scratch is read into once
        copies.clear()
        own.clear()
        into = {"a": torch.zeros(64, 64), "b": torch.zeros(7), "cfg": {"lr": 0.0}}
        planner = _Materialize(scratch=scratch)
        dcp.load(into, storage_reader=TiercheckReader(local=root), planner=planner)
        assert_identical(saved, into)
        assert copies == [0] and own == direct and set(planner.committed) == {"a", "b"}

    flip_chunk_byte(root / step_dir(1), "a", chunks_of(root / step_dir(1), "a")[-1], 5)
    into = {"a": torch.zeros(64, 64), "b": torch.zeros(7), "cfg": {"lr": 0.0}}
    planner = _Materialize()
    with pytest.raises(CheckpointException, match="CorruptCheckpointError"):
        dcp.load(into, storage_reader=TiercheckReader(local=root), planner=planner)
    assert planner.committed == {} and not into["a"].any() and not into["b"].any()


def test_a_cold_load_reads_big_tensors_around_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dcp.load`` into the state's own tensors reads into new buffers, copied in once every chunk is
    verified; a big buffer starts on a page, so a cold load reads its chunks with O_DIRECT (no copy out of
    the page cache), as ``Checkpointer.restore`` does."""
    direct_bytes: list[int] = []
    read_vectored = LocalTier.read_vectored

    def recording(self: LocalTier, path: str, offset: int, views: Any, *, direct: bool = False, each: Any = None) -> tuple[int, bool]:
        n, went_direct = read_vectored(self, path, offset, views, direct=direct, each=each)
        direct_bytes.append(n if went_direct else 0)
        return n, went_direct

    monkeypatch.setattr(LocalTier, "read_vectored", recording)
    root = tmp_path / "ckpt"
    g = torch.Generator().manual_seed(0)
    saved = {"big": torch.randn(1024, 1024, generator=g), "small": torch.randn(10, generator=g)}
    with TiercheckWriter(local=root) as writer:
        dcp.save(saved, storage_writer=writer, checkpoint_id=1)
    evict_packs(root / step_dir(1))
    into = {"big": torch.zeros(1024, 1024), "small": torch.zeros(10)}
    dcp.load(into, storage_reader=TiercheckReader(local=root))
    assert_identical(saved, into)
    assert sum(direct_bytes) >= saved["big"].numel() * 4


def test_async_save_thread(tmp_path: Path) -> None:
    """async_save (THREAD) resolves once the step is committed; changes after it returned are not saved."""
    root = tmp_path / "ckpt"
    model, _, sd = _state(4)
    saved = _full(sd)
    with TiercheckWriter(local=root) as writer:
        fut = dcp.async_save(
            sd, storage_writer=writer, checkpoint_id=7, async_checkpointer_type=AsyncCheckpointerType.THREAD
        )
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # training goes on: in place, as optimizer.step() does
        assert not isinstance(fut, dcp.state_dict_saver.AsyncSaveResponse)
        fut.result(timeout=60)
        assert writer.checkpointer is not None and writer.checkpointer.steps() == [7]
    _, _, into = _state(8)
    dcp.load(into, storage_reader=TiercheckReader(local=root))
    assert_identical(saved, _full(into))


# ------------------------------------------------------------------------------- several ranks (gloo, CPU)


def _fsdp(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp_state(seed: int, *, shard: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model = _model(seed)
    if shard:
        model = _fsdp(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, optimizer, seed)
    msd, osd = get_state_dict(model, optimizer)
    extra = {"rng": torch.Generator().manual_seed(seed).get_state(), "step": seed}  # replicated: one rank writes
    return model, optimizer, {"model": msd, "optim": osd, "extra": extra}


def _save_fsdp(rank: int, world: int, root: str) -> dict[int, Any]:
    """Saves step 100 with dcp.save and, after training on, step 200 with dcp.async_save; returns what was saved."""
    warnings.simplefilter("ignore", FutureWarning)
    ckpt_group = torch.distributed.new_group(backend="gloo")
    model, optimizer, sd = _fsdp_state(0, shard=True)
    out = {100: _full(sd)}
    with TiercheckWriter(local=root) as writer:
        dcp.save(sd, storage_writer=writer, checkpoint_id=100)
        _train(model, optimizer, 1)
        msd, osd = get_state_dict(model, optimizer)
        sd = {"model": msd, "optim": osd, "extra": {**sd["extra"], "step": 1}}
        out[200] = _full(sd)
        # DCP's thread runs collectives while training runs its own: on a group of their own (as torchtitan does)
        fut = dcp.async_save(sd, storage_writer=writer, checkpoint_id="200", process_group=ckpt_group)
        _train(model, optimizer, 2)  # training goes on while the save runs
        fut.result(timeout=60)
        assert writer.checkpointer is not None and writer.checkpointer.steps() == [100, 200]
    return out


def _load_fsdp(rank: int, world: int, root: str, shard: bool) -> dict[int, Any]:
    """Loads step 100 and the newest (200) into a fresh model: FSDP2 over ``world`` ranks, or plain."""
    out = {}
    for checkpoint_id in (100, None):  # None: the newest, 200
        model, optimizer, sd = _fsdp_state(5, shard=shard)
        reader = TiercheckReader(local=root)
        dcp.load(sd, storage_reader=reader, checkpoint_id=checkpoint_id)
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        out[100 if checkpoint_id else 200] = (_full(sd), _full(model.state_dict()))
    return out


def test_fsdp2_save_on_2_ranks_load_on_1_and_4(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")  # one node: every rank shares the directory
    saved = run_ranks(_save_fsdp, 2, root)
    assert_identical(saved[0], saved[1])  # the gathered full state is the same on both ranks
    for world, shard in ((1, False), (4, True)):
        loaded = run_ranks(_load_fsdp, world, root, shard)
        for rank, got in enumerate(loaded):
            for step in (100, 200):
                state, live_model = got[step]
                assert_identical(saved[0][step], state, f"{world} ranks, rank {rank}, step {step}")
                assert_identical(saved[0][step]["model"], live_model, f"{world} ranks, rank {rank}, step {step}, model")
    assert not torch.equal(saved[0][100]["model"]["0.weight"], saved[0][200]["model"]["0.weight"])


def _layout_changes(rank: int, world: int, root: str) -> list[bool]:
    """A replicated tensor grows between saves: DCP gives it to one rank, the only one whose tiercheck leaves
    change; every rank must still re-plan together (tiercheck plans collectively)."""
    opts = {"distributed": tiercheck.DistributedOptions(timeout_s=30)}
    saved = {}
    with TiercheckWriter(local=root, **opts) as writer:
        for step, n in ((1, 3), (2, 5), (3, 5)):
            sd = {"w": torch.arange(16.0) + step, "hist": torch.arange(float(n)), "step": step}
            saved[step] = _full(sd)
            dcp.save(sd, storage_writer=writer, checkpoint_id=step)
    same = []
    for step, n in ((1, 3), (2, 5), (3, 5)):
        into = {"w": torch.zeros(16), "hist": torch.zeros(n), "step": -1}
        dcp.load(into, storage_reader=TiercheckReader(local=root, **opts), checkpoint_id=step)
        assert_identical(saved[step], _full(into), f"step {step}")
        same.append(True)
    return same


def test_layout_change_on_one_rank_replans_every_rank(tmp_path: Path) -> None:
    assert run_ranks(_layout_changes, 2, str(tmp_path / "ckpt")) == [[True] * 3] * 2


# ------------------------------------------------------------------------------- a writer per call, and exit


def _save_writer_per_call(rank: int, world: int, root: str, remote: str) -> dict[str, Any]:
    """DCP's idiom: a new TiercheckWriter in every call (``dcp.save`` step 100, ``dcp.async_save`` 200 and 300),
    none closed: exit closes their Checkpointer, draining to the remote tier."""
    warnings.simplefilter("ignore", FutureWarning)
    ckpt_group = torch.distributed.new_group(backend="gloo")
    opts = {"remote": remote, "distributed": tiercheck.DistributedOptions(timeout_s=30)}
    model, optimizer, sd = _fsdp_state(0, shard=True)
    out: dict[Any, Any] = {100: _full(sd)}
    writers = [TiercheckWriter(local=root, **opts)]
    dcp.save(sd, storage_writer=writers[0], checkpoint_id=100)
    for step in (200, 300):
        _train(model, optimizer, step)
        msd, osd = get_state_dict(model, optimizer)
        sd = {"model": msd, "optim": osd, "extra": {**sd["extra"], "step": step}}
        out[step] = _full(sd)
        writers.append(TiercheckWriter(local=root, **opts))
        dcp.async_save(sd, storage_writer=writers[-1], checkpoint_id=step, process_group=ckpt_group).result(60)
    with pytest.raises(tiercheck.DirectoryInUseError, match="same ones"):  # it would not save where it asks
        TiercheckWriter(local=root, remote=None)._checkpointer()
    ckpt = writers[0].checkpointer
    # One Checkpointer, planned once, as one long-lived writer would: the same host pool and directory lock.
    out["shared"] = ckpt is not None and all(w.checkpointer is ckpt for w in writers)
    out["plans_made"] = ckpt._planner.made if ckpt is not None else None
    return out


def test_a_writer_per_call_shares_one_checkpointer_and_exit_drains(tmp_path: Path) -> None:
    """A new writer per ``dcp.save`` / ``dcp.async_save`` on 2 ranks saves as one writer does (it was refused with
    DirectoryInUseError); with no writer closed, interpreter exit drains every step to the remote tier."""
    root, remote = str(tmp_path / "ckpt"), (tmp_path / "remote").as_uri()
    saved = run_ranks(_save_writer_per_call, 2, root, remote)
    for out in saved:
        assert out["shared"] and out["plans_made"] == 1
    for step in (100, 200, 300):
        assert LocalTier(tmp_path / "remote").exists(f"{step_dir(step)}/COMMIT"), step
        _, _, into = _fsdp_state(5, shard=False)
        dcp.load(into, storage_reader=TiercheckReader(local=tmp_path / "empty", remote=remote), checkpoint_id=step)
        assert_identical(saved[0][step], _full(into), f"step {step}")


_UNAWAITED = """
import sys, torch, torch.distributed.checkpoint as dcp
from tiercheck.integrations.dcp import TiercheckWriter
sd = {"w": torch.arange(1 << 20, dtype=torch.float32)}
dcp.save(sd, storage_writer=TiercheckWriter(local=sys.argv[1]), checkpoint_id=1)
dcp.async_save(sd, storage_writer=TiercheckWriter(local=sys.argv[1]), checkpoint_id=2)  # nobody awaits it
"""


def test_exit_lets_an_unawaited_async_save_commit(tmp_path: Path) -> None:
    """A script that ends right after ``dcp.async_save`` with a writer per call: exit waits for the save on
    DCP's thread to reach the shared Checkpointer, and for its commit, before closing it."""
    done = subprocess.run([sys.executable, "-c", _UNAWAITED, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert list_steps(LocalTier(tmp_path)).committed == [1, 2], done.stderr


def _raise_on_one_rank(rank: int, world: int, root: str, logs: str) -> None:
    """Rank 1 raises after the first save; rank 0 goes on saving (each commit waits for rank 1) and returns
    without closing its Checkpointer, noting when it reached exit."""
    import logging

    logging.basicConfig(filename=f"{logs}/rank{rank}.log", level=logging.WARNING, format="%(levelname)s %(message)s")
    state = {"w": torch.arange(1024.0)}
    ckpt = tiercheck.Checkpointer(state, local=root, distributed=tiercheck.DistributedOptions(timeout_s=10))
    ckpt.save(1).wait()
    if rank == 1:
        raise RuntimeError("training failed on rank 1")
    for step in (2, 3, 4, 5, 6):
        state["w"].add_(1.0)
        ckpt.save(step)
    Path(logs, "exit").write_text(str(time.time()))


def test_exit_after_an_error_on_one_rank_waits_at_most_timeout_s(tmp_path: Path) -> None:
    """Nothing is killed: one rank raises, the other leaves five saves in flight and never closes. Both
    processes exit, the one left within DistributedOptions.timeout_s (10 s) of reaching exit, and it says what it
    abandoned; its queued commits each waited 10 s for the failed rank (50 s) before."""
    root = tmp_path / "ckpt"
    outcomes = run_ranks(_raise_on_one_rank, 2, str(root), str(tmp_path), check=False, timeout=150)
    exited = time.time() - float((tmp_path / "exit").read_text())
    assert [o.exitcode for o in outcomes] == [0, 1], outcomes
    assert "training failed on rank 1" in (outcomes[1].error or "")
    assert exited < 10 + 15, f"rank 0 took {exited:.0f} s to exit"
    log = (tmp_path / "rank0.log").read_text()
    assert re.search(r"WARNING exiting: abandoned the save of step\(s\) [\d, ]*6 to ", log), log
    assert LocalTier(root).exists(f"{step_dir(1)}/COMMIT")
    assert not LocalTier(root).exists(f"{step_dir(6)}/COMMIT")
