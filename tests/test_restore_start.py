"""A restore at a job start streams into the live tensors; once the job holds progress, restores
are all or nothing (DESIGN invariant 7; issue 43 item 1).

Before a Checkpointer has saved or restored, its state is what the job just built: a restore reads
the CPU tensors straight into their own memory, verifying each chunk as it lands, with no second
copy. A damaged newest step still falls back to an older whole one, which overwrites every tensor;
where no step is whole, the error names the tensors already overwritten.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tiercheck import Checkpointer, CorruptCheckpointError, PartlyRestoredError

from .conftest import assert_identical
from .test_restore_atomic import _damage_last_chunk, _memory, _saved_steps, _snapshot, _trained


def _cpu_bytes(state: dict) -> int:
    tensors = list(state["model"].parameters()) + [
        t for by_param in state["optimizer"].state.values() for t in by_param.values() if t.dim()
    ]
    return sum(t.numel() * t.element_size() for t in tensors) + state["progress"]["t"].nbytes


def test_a_job_start_restore_reads_into_the_state_s_own_memory(ckpt_dir: Path) -> None:
    _, two = _saved_steps(ckpt_dir)
    live = _trained(7)
    where = _memory(live)
    with Checkpointer(live, local=ckpt_dir) as ckpt:
        assert ckpt.restore() == 2
        streamed = ckpt.stats()["restore_in_place_bytes"]
    assert_identical(_snapshot(live), two)
    assert _memory(live) == where
    assert streamed >= _cpu_bytes(live) - 64  # every tensor (0-d step counters aside) read in place


def test_once_the_job_holds_progress_a_failed_restore_leaves_the_state_untouched(ckpt_dir: Path) -> None:
    """After a save (or an earlier restore) the default is all or nothing again."""
    state = _trained(1)
    _saved_steps(ckpt_dir)
    _damage_last_chunk(ckpt_dir / "step-00000002")
    with Checkpointer(state, local=ckpt_dir) as ckpt:
        assert ckpt.restore(step=1) == 1  # progress: from here on, all or nothing
        before = _snapshot(state)
        with pytest.raises(CorruptCheckpointError, match="step 2") as info:
            ckpt.restore(step=2)
        assert not isinstance(info.value, PartlyRestoredError)
    assert_identical(_snapshot(state), before)


def test_in_place_false_keeps_a_job_start_restore_all_or_nothing(ckpt_dir: Path) -> None:
    _saved_steps(ckpt_dir)
    _damage_last_chunk(ckpt_dir / "step-00000002")
    live = _trained(7)
    before = _snapshot(live)
    with Checkpointer(live, local=ckpt_dir) as ckpt, pytest.raises(CorruptCheckpointError, match="step 2"):
        ckpt.restore(step=2, in_place=False)
    assert_identical(_snapshot(live), before)


def test_a_job_start_restore_with_no_whole_step_names_the_tensors_it_overwrote(ckpt_dir: Path) -> None:
    """Never "nothing restored" after touching the state: every step is damaged (in its last
    chunk, after the others were read in), and the error says which tensors now hold parts of them."""
    _saved_steps(ckpt_dir)
    for step in ("step-00000001", "step-00000002"):
        _damage_last_chunk(ckpt_dir / step)
    live = _trained(7)
    with Checkpointer(live, local=ckpt_dir) as ckpt, pytest.raises(PartlyRestoredError) as info:
        ckpt.restore()
    message = str(info.value)
    assert "no older committed step is whole to restore" in message
    assert "parts of step(s) 1, 2 into tensor(s)" in message and "model/weight" in message
    assert isinstance(info.value, CorruptCheckpointError)
