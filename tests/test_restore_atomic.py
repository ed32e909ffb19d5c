"""Restore is all or nothing: a damaged step leaves the live state exactly as it was, and without
a requested step the newest older whole step is restored instead, with a warning."""

from __future__ import annotations

import copy
import gc
import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tiercheck import (
    Checkpointer,
    CorruptCheckpointError,
    IncompatibleStateError,
    PartlyRestoredError,
    Shard,
    StepExistsError,
    WriteOptions,
)
from tiercheck.format.paths import part_file

from .conftest import assert_identical
from .distributed import run_ranks
from .ondisk import chunk_span, chunks_of, flip_chunk_byte, resign_index

CHUNK = 4096  # small chunks: one bad chunk among many good ones


def _trained(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()
    return {"model": model, "optimizer": optimizer, "progress": {"epoch": seed, "t": torch.arange(10.0) * seed}}


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": copy.deepcopy(state["model"].state_dict()),
        "optimizer": copy.deepcopy(state["optimizer"].state_dict()),
        "progress": copy.deepcopy(state["progress"]),
    }


def _save_two_steps(ckpt: Checkpointer, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Steps 1 and 2 of a run, a training step apart, and what each holds."""
    ckpt.save(1).wait()
    one = _snapshot(state)
    state["model"](torch.randn(4, 64)).sum().backward()
    state["optimizer"].step()
    state["progress"]["epoch"] = 2
    ckpt.save(2).wait()
    return one, _snapshot(state)


def _saved_steps(root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Steps 1 and 2 of a run, and what each holds."""
    state = _trained(1)
    with Checkpointer(state, local=root, write=WriteOptions(chunk_bytes=CHUNK)) as ckpt:
        return _save_two_steps(ckpt, state)


def _damage_last_chunk(step: Path) -> None:
    """A bad byte in the last chunk of the exp_avg_sq of the first parameter: every other chunk
    of the step is good, so a restore that copied as it read would overwrite most of the state."""
    array = "optimizer/state/0/exp_avg_sq"
    flip_chunk_byte(step, array, chunks_of(step, array)[-1], 5)


@pytest.mark.parametrize("damage", ["flipped byte", "truncated pack"])
def test_a_failed_restore_of_a_requested_step_leaves_the_state_untouched(ckpt_dir: Path, damage: str) -> None:
    _saved_steps(ckpt_dir)
    step2 = ckpt_dir / "step-00000002"
    if damage == "flipped byte":
        _damage_last_chunk(step2)
    else:
        pack, _, _ = chunk_span(step2, "model/weight", "c.0.0")
        with pack.open("r+b") as f:  # the pack's last chunk loses its tail; the others stay readable
            f.truncate(pack.stat().st_size - 100)
    live = _trained(7)
    before = _snapshot(live)
    with Checkpointer(live, local=ckpt_dir) as ckpt, pytest.raises(CorruptCheckpointError, match="step 2"):
        ckpt.restore(step=2, in_place=False)  # all or nothing (the default once the job holds progress)
    assert_identical(_snapshot(live), before)
    assert gc.isenabled(), "the failed restore turned the garbage collector back on"


def test_a_failed_restore_staged_in_the_save_pool_leaves_the_state_and_the_pool_whole(ckpt_dir: Path) -> None:
    """The same in a process that has saved, where the restore stages in the idle save pool: the
    live state is untouched, and the pool is given back (the next restore stages there, the next
    save goes through)."""
    state = _trained(1)
    with Checkpointer(state, local=ckpt_dir, write=WriteOptions(chunk_bytes=CHUNK)) as ckpt:
        one, _ = _save_two_steps(ckpt, state)
        _damage_last_chunk(ckpt_dir / "step-00000002")
        before = _snapshot(state)
        with pytest.raises(CorruptCheckpointError, match="step 2"):
            ckpt.restore(step=2)
        assert_identical(_snapshot(state), before)
        assert ckpt.restore(step=1) == 1
        assert ckpt.stats()["restore_staged_in_pool"] > 0
        assert_identical(_snapshot(state), one)
        ckpt.save(3).wait()
        assert ckpt.steps() == [1, 2, 3]


class _GcProbe:
    """A stateful entry that notes whether the cyclic garbage collector ran during its restore."""

    def __init__(self) -> None:
        self.during: list[bool] = []

    def state_dict(self) -> dict[str, Any]:
        return {"t": torch.arange(3.0)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.during.append(gc.isenabled())


def test_the_garbage_collector_is_paused_during_a_restore_and_left_as_it_was(ckpt_dir: Path) -> None:
    """Planning a restore of many arrays allocates enough objects to set off full collections
    over the whole training heap: the collector is off from the restore's start to its end, then
    as it was before (also when it was off already)."""
    probe = _GcProbe()
    with Checkpointer({"p": probe, "w": torch.ones(5)}, local=ckpt_dir) as ckpt:
        ckpt.save(1).wait()
        assert ckpt.restore() == 1
        assert probe.during == [False] and gc.isenabled()
        gc.disable()
        try:
            assert ckpt.restore() == 1
            assert probe.during == [False, False] and not gc.isenabled()
        finally:
            gc.enable()


class _SaveGcProbe:
    """A stateful entry that notes whether the collector ran while the main thread asked for its state."""

    def __init__(self) -> None:
        self.during: list[bool] = []

    def state_dict(self) -> dict[str, Any]:
        if threading.current_thread() is threading.main_thread():  # not the pool's pre-faulting
            self.during.append(gc.isenabled())
        return {"t": torch.arange(3.0)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_the_garbage_collector_is_paused_while_save_flattens_the_state(ckpt_dir: Path) -> None:
    """Flattening a state allocates objects per tensor, which set off full collections over the
    whole training heap on the training thread: the collector is off while ``save()`` runs, then
    as it was before (also when it was off already)."""
    probe = _SaveGcProbe()
    with Checkpointer({"p": probe, "w": torch.ones(5)}, local=ckpt_dir) as ckpt:
        ckpt.save(1).wait()
        assert probe.during == [False] and gc.isenabled()
        gc.disable()
        try:
            ckpt.save(2).wait()
            assert probe.during == [False, False] and not gc.isenabled()
        finally:
            gc.enable()


@pytest.mark.parametrize("in_place", [False, True], ids=["staged", "in-place"])
def test_without_a_requested_step_a_damaged_newest_step_falls_back_with_a_warning(
    ckpt_dir: Path, caplog: pytest.LogCaptureFixture, in_place: bool
) -> None:
    """In place too: the older whole step overwrites what was read of the damaged one, and no
    error is logged."""
    one, _ = _saved_steps(ckpt_dir)
    _damage_last_chunk(ckpt_dir / "step-00000002")
    live = _trained(7)
    with Checkpointer(live, local=ckpt_dir) as ckpt:
        assert ckpt.restore(in_place=in_place) == 1
    assert_identical(_snapshot(live), one)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "cannot restore step 2" in r.message]
    assert len(warned) == 1, [r.message for r in caplog.records]
    assert "exp_avg_sq" in warned[0].message  # names what is damaged


def test_when_every_step_is_damaged_restore_raises_and_the_state_is_untouched(ckpt_dir: Path) -> None:
    _saved_steps(ckpt_dir)
    for step in ("step-00000001", "step-00000002"):
        _damage_last_chunk(ckpt_dir / step)
    live = _trained(7)
    before = _snapshot(live)
    nothing_whole = pytest.raises(
        CorruptCheckpointError, match=r"step 2: .*no older committed step is whole to restore; step\(s\) 1 are damaged"
    )
    with Checkpointer(live, local=ckpt_dir) as ckpt, nothing_whole:
        ckpt.restore(in_place=False)  # all or nothing (a job start streams in: tests/test_restore_start.py)
    assert_identical(_snapshot(live), before)


def _two_node_state(rank: int, fill: float) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """A replicated tensor and this rank's half of a row-sharded one."""
    w, half = torch.full((64, 64), fill), torch.full((128, 64), fill)
    return {"w": w, "rows": Shard(half, global_shape=(256, 64), offsets=(128 * rank, 0))}, w, half


def _save_on_two_nodes(rank: int, world_size: int, roots: list[str]) -> None:
    state, w, half = _two_node_state(rank, 0.0)
    with Checkpointer(state, local=roots[rank], write=WriteOptions(chunk_bytes=CHUNK)) as ckpt:
        for step in (1, 2):
            w.fill_(step)
            half.fill_(10 * step + rank)
            ckpt.save(step).wait()


def _restore_on_two_nodes(rank: int, world_size: int, roots: list[str], step: int | None) -> Any:
    state, w, half = _two_node_state(rank, -1.0)
    with Checkpointer(state, local=roots[rank], write=WriteOptions(chunk_bytes=CHUNK)) as ckpt:
        try:
            got = ckpt.restore(step=step, in_place=False)  # all or nothing: a refusal leaves the state as it was
        except CorruptCheckpointError as e:
            return type(e).__name__, bool((w == -1).all() and (half == -1).all())
        return got, w.clone(), half.clone()


def _roll_back_in_process(rank: int, world_size: int, roots: list[str]) -> Any:
    half = torch.zeros(128, 64)
    state = {"rows": Shard(half, global_shape=(256, 64), offsets=(128 * rank, 0))}
    with Checkpointer(state, local=roots[rank], write=WriteOptions(chunk_bytes=CHUNK)) as ckpt:
        for step in (1, 2):
            half.fill_(10 * step + rank)
            ckpt.save(step).wait()
        ptr = half.data_ptr()
        assert ckpt.restore(step=1) == 1
        restored = half.clone()
        staged_in_pool = ckpt.stats()["restore_staged_in_pool"]
        half.fill_(30 + rank)
        ckpt.save(3).wait()
        return restored, staged_in_pool, half.data_ptr() == ptr, ckpt.steps()


def _memory(state: dict[str, Any]) -> list[int]:
    """Where each tensor of the model and the optimizer state lies in memory."""
    tensors = list(state["model"].parameters()) + [
        t for by_param in state["optimizer"].state.values() for t in by_param.values() if t.dim()
    ]
    return [t.data_ptr() for t in tensors]


def test_an_in_place_restore_reads_into_the_state_s_own_memory(ckpt_dir: Path) -> None:
    """``in_place=True``: the tensors keep their memory and get the step's bytes (an all-or-nothing
    restore hands them the memory it read into, so each moves)."""
    _, two = _saved_steps(ckpt_dir)
    live, other = _trained(7), _trained(8)
    where, elsewhere = _memory(live), _memory(other)
    with Checkpointer(live, local=ckpt_dir) as ckpt:
        assert ckpt.restore(in_place=True) == 2
    with Checkpointer(other, local=ckpt_dir) as ckpt:
        assert ckpt.restore(in_place=False) == 2
    assert_identical(_snapshot(live), two)
    assert_identical(_snapshot(other), two)
    assert _memory(live) == where
    assert not set(_memory(other)) & set(elsewhere)


def test_a_failed_in_place_restore_says_the_state_may_hold_parts_of_the_step(
    ckpt_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _saved_steps(ckpt_dir)
    _damage_last_chunk(ckpt_dir / "step-00000002")
    live = _trained(7)
    with Checkpointer(live, local=ckpt_dir) as ckpt, pytest.raises(PartlyRestoredError, match="step 2") as e:
        ckpt.restore(step=2, in_place=True)
    assert "the restore had already read parts of step(s) 2 into tensor(s)" in str(e.value)
    assert "optimizer/state/0/exp_avg_sq" in str(e.value)


def test_ranks_rolling_back_in_process_each_stage_in_their_own_save_pool(tmp_path: Path) -> None:
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    for rank, (restored, staged_in_pool, kept_memory, steps) in enumerate(
        run_ranks(_roll_back_in_process, 2, roots)
    ):
        assert torch.equal(restored, torch.full((128, 64), 10.0 + rank))
        assert staged_in_pool == 128 * 64 * 4 and kept_memory
        assert steps == [1, 2, 3]


def _refused_as_asked_then_fell_back_together(roots: list[str]) -> None:
    """Step 2 asked for: both ranks refuse, their state untouched; none asked for: both restore step 1."""
    refused = run_ranks(_restore_on_two_nodes, 2, roots, 2)
    assert refused == [("CorruptCheckpointError", True)] * 2, refused

    fell_back = run_ranks(_restore_on_two_nodes, 2, roots, None)
    for rank, (step, w, half) in enumerate(fell_back):
        assert step == 1
        assert torch.equal(w, torch.full((64, 64), 1.0))
        assert torch.equal(half, torch.full((128, 64), 10.0 + rank))


def test_two_ranks_agree_to_fall_back_when_one_ranks_chunk_is_damaged(tmp_path: Path) -> None:
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    run_ranks(_save_on_two_nodes, 2, roots)
    step2 = Path(roots[1]) / "step-00000002"  # only node 1's copy is bad, and only one of its chunks
    flip_chunk_byte(step2, "rows", chunks_of(step2, "rows")[-1], 3)

    _refused_as_asked_then_fell_back_together(roots)


def test_two_ranks_agree_to_fall_back_when_one_ranks_manifest_part_is_damaged(tmp_path: Path) -> None:
    """Damage found while the manifest is fetched (not while chunks are read) is the step's damage
    too: the rank reading the part and the rank waiting on it both fall back, to the same step."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    run_ranks(_save_on_two_nodes, 2, roots)
    part = Path(roots[1]) / "step-00000002" / part_file(1)
    part.write_bytes(part.read_bytes()[:-9] + b"garbage!!")

    _refused_as_asked_then_fell_back_together(roots)


@pytest.mark.parametrize("damage", ["flipped byte", "garbage COMMIT"])
def test_a_damaged_newest_step_is_set_aside_after_the_fallback_so_its_number_saves_again(
    ckpt_dir: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """The README's loop: save 1 and 2; step 2 rots; restore falls back to 1; the run goes on and
    saves 2 again. The damaged step 2 once still counted as committed, and that save raised
    ``StepExistsError``."""
    one, _ = _saved_steps(ckpt_dir)
    step2 = ckpt_dir / "step-00000002"
    if damage == "flipped byte":
        _damage_last_chunk(step2)
    else:
        (step2 / "COMMIT").write_bytes(b"\x00garbage")
    live = _trained(7)
    with Checkpointer(live, local=ckpt_dir) as ckpt:
        assert ckpt.restore() == 1
        assert_identical(_snapshot(live), one)
        assert step2.exists()  # left for verify to report until its number is saved again
        live["model"](torch.randn(4, 64)).sum().backward()
        live["optimizer"].step()
        ckpt.save(2).wait()
        again = _snapshot(live)
        assert ckpt.steps() == [1, 2]
    aside = sorted((ckpt_dir / "set-aside").iterdir())
    assert [p.name.split(".")[0] for p in aside] == ["step-00000002"]
    assert (aside[0] / "manifest.json").exists()  # set aside whole, not deleted
    moved = [r for r in caplog.records if r.levelno == logging.WARNING and "set step 2 aside" in r.message]
    assert len(moved) == 1 and str(aside[0].relative_to(ckpt_dir)) in moved[0].message
    fresh = _trained(8)
    with Checkpointer(fresh, local=ckpt_dir) as ckpt:
        assert ckpt.restore() == 2
    assert_identical(_snapshot(fresh), again)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("change", ["added parameter", "removed parameter"])
def test_a_module_that_would_refuse_the_saved_state_is_refused_before_anything_is_overwritten(
    ckpt_dir: Path, strict: bool, change: str
) -> None:
    """``strict=False`` with a module whose checkpoint lacks a parameter once raised torch's raw
    ``RuntimeError: Missing key(s)`` from ``load_state_dict``, after the other entries had been
    overwritten. The keys ``load_state_dict`` insists on are checked with the rest, first."""
    torch.manual_seed(0)
    with Checkpointer({"progress": torch.arange(8.0), "model": torch.nn.Linear(4, 4)}, local=ckpt_dir) as ckpt:
        ckpt.save(1).wait()
    model = torch.nn.Linear(4, 4)
    if change == "added parameter":
        model.register_parameter("scale", torch.nn.Parameter(torch.ones(4)))
        named = "missing from the checkpoint: 'scale'" if not strict else "missing from the checkpoint: model/scale"
    else:
        model.bias = None  # type: ignore[assignment]
        named = "in the checkpoint, not in the module: 'bias'"
    live = {"progress": torch.zeros(8), "model": model}
    before = copy.deepcopy(model.state_dict())
    with Checkpointer(live, local=ckpt_dir) as ckpt, pytest.raises(IncompatibleStateError) as e:
        ckpt.restore(step=1, strict=strict)
    assert "model" in str(e.value) and named in str(e.value), e.value
    assert torch.equal(live["progress"], torch.zeros(8))
    assert_identical(model.state_dict(), before)


def test_an_in_place_fallback_to_a_step_without_a_tensor_says_that_tensor_may_hold_the_damaged_step(
    ckpt_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 2 has a tensor step 1 lacks: read in place from step 2 before its damage showed, it
    keeps step 2's bytes after the fallback to step 1. Only the fallback WARNING was logged."""
    with Checkpointer({"a": torch.arange(4096.0)}, local=ckpt_dir, write=WriteOptions(chunk_bytes=CHUNK)) as ckpt:
        ckpt.save(1).wait()
    two = {"a": torch.arange(4096.0) + 1, "extra": torch.full((4096,), 2.0)}
    with Checkpointer(two, local=ckpt_dir, write=WriteOptions(chunk_bytes=CHUNK)) as ckpt:
        ckpt.save(2).wait()
    step2 = ckpt_dir / "step-00000002"
    flip_chunk_byte(step2, "a", chunks_of(step2, "a")[-1], 5)
    live = {"a": torch.zeros(4096), "extra": torch.zeros(4096)}
    with Checkpointer(live, local=ckpt_dir) as ckpt:
        assert ckpt.restore(in_place=True, strict=False) == 1
    assert torch.equal(live["a"], torch.arange(4096.0))
    errors = [r.message for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert "fell back to step 1" in errors[0] and "extra" in errors[0] and "parts of step(s) 2" in errors[0]
    assert "tensor(s) a," not in errors[0]  # step 1 overwrote all of "a"


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "all-or-nothing"])
def test_a_non_strict_restore_leaves_the_states_nested_entries_the_checkpoint_lacks_as_they_were(
    ckpt_dir: Path, in_place: bool
) -> None:
    """``strict=False``: a live tensor and a plain value inside a nested dict that the checkpoint
    does not name stay in the dict, the same objects with the same values; what it names is restored."""
    with Checkpointer({"model": {"w": torch.arange(64.0)}}, local=ckpt_dir) as ckpt:
        ckpt.save(1).wait()
    new, note = torch.full((8,), 7.0), ["keep", "me"]
    model = {"w": torch.zeros(64), "zz_new": new, "note": note}
    live = {"model": model}
    with Checkpointer(live, local=ckpt_dir) as ckpt:
        assert ckpt.restore(strict=False, in_place=in_place) == 1
    assert live["model"] is model and torch.equal(model["w"], torch.arange(64.0))
    assert model["zz_new"] is new and torch.equal(new, torch.full((8,), 7.0))
    assert model["note"] is note and note == ["keep", "me"]


def test_an_in_place_fallback_keeps_a_nested_tensor_the_older_step_lacks_and_names_it(
    ckpt_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 2 has a nested tensor step 1 lacks, read into in place before step 2's damage showed:
    after the fallback to step 1 it is still in the state (the log says it may hold parts of step
    2), not removed from its dict."""
    with Checkpointer({"m": {"a": torch.arange(4096.0)}}, local=ckpt_dir, write=WriteOptions(chunk_bytes=CHUNK)) as c:
        c.save(1).wait()
    two = {"m": {"a": torch.arange(4096.0) + 1, "extra": torch.full((4096,), 2.0)}}
    with Checkpointer(two, local=ckpt_dir, write=WriteOptions(chunk_bytes=CHUNK)) as c:
        c.save(2).wait()
    step2 = ckpt_dir / "step-00000002"
    flip_chunk_byte(step2, "m/a", chunks_of(step2, "m/a")[-1], 5)
    extra = torch.zeros(4096)
    live = {"m": {"a": torch.zeros(4096), "extra": extra}}
    with Checkpointer(live, local=ckpt_dir) as c:
        assert c.restore(in_place=True, strict=False) == 1
    assert torch.equal(live["m"]["a"], torch.arange(4096.0))
    assert live["m"]["extra"] is extra
    errors = [r.message for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "m/extra" in errors[0] and "parts of step(s) 2" in errors[0], errors


def _claim_world_size(step: Path, world_size: int) -> None:
    """Make ``step``'s manifest.json say it was saved by ``world_size`` ranks, signed in its COMMIT
    (whose own world size is left as saved)."""
    index = json.loads((step / "manifest.json").read_bytes())
    index["world_size"] = index["topology"]["world_size"] = world_size
    resign_index(step, json.dumps(index).encode())


def test_an_index_naming_another_world_size_is_refused_at_once_and_falls_back(
    ckpt_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A manifest.json saying 2 ranks saved the step, in a one-process job whose COMMIT says 1,
    once blocked in the store for its 300 s timeout (not DistributedOptions.timeout_s) and then
    raised torch's raw DistStoreError."""
    one, _ = _saved_steps(ckpt_dir)
    _claim_world_size(ckpt_dir / "step-00000002", 2)
    live = _trained(7)
    before = _snapshot(live)
    with Checkpointer(live, local=ckpt_dir) as ckpt:
        with pytest.raises(CorruptCheckpointError, match=r"saved by 2 rank\(s\), its commit marker by 1"):
            ckpt.restore(step=2)
        assert_identical(_snapshot(live), before)
        assert ckpt.restore() == 1
    assert_identical(_snapshot(live), one)
    assert any("cannot restore step 2" in r.message and "saved by 2 rank(s)" in r.message for r in caplog.records)


def test_a_set_aside_that_fails_says_why_the_save_is_refused(ckpt_dir: Path) -> None:
    """``set-aside`` is a file (an operator's mistake): the damaged step 2 cannot be moved out of
    the way, and the save of step 2 again is refused naming that cause, not as 'already committed'."""
    _saved_steps(ckpt_dir)
    _damage_last_chunk(ckpt_dir / "step-00000002")
    (ckpt_dir / "set-aside").write_bytes(b"not a directory")
    live = _trained(7)
    with Checkpointer(live, local=ckpt_dir) as ckpt:
        assert ckpt.restore() == 1
        with pytest.raises(StepExistsError, match="could not be set aside to be saved again: .*Error"):
            ckpt.save(2)
    assert (ckpt_dir / "step-00000002" / "COMMIT").exists()  # the damaged step is left as it was
