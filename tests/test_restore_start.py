"""A restore at a job start streams into the live tensors; once the job holds progress, restores
are all or nothing (invariant 7 of docs/design.md; issue 43 item 1).

Before a Checkpointer has saved or restored, its state is what the job just built: a restore reads
the CPU tensors straight into their own memory, verifying each chunk as it lands, with no second
copy. A damaged newest step still falls back to an older whole one, which overwrites every tensor;
where no step is whole, the error names the tensors already overwritten. Data-parallel replicas
fill from the reader's shared memory as each chunk is verified. (GPU tensors: tests/test_cuda.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

import tiercheck
from tiercheck import Checkpointer, CorruptCheckpointError, PartlyRestoredError, Shard
from tiercheck.format.codec import unseal
from tiercheck.format.manifest import parse_rank_part
from tiercheck.format.paths import part_file

from .conftest import assert_identical
from .distributed import run_ranks
from .ondisk import flip_chunk_byte
from .test_distributed import LAYERS, Layout, check_model, model_state, node_dir
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


DP2 = Layout(tp=1, pp=1, dp=2)  # 2 replicas, a node each, on one host: chunks pass through shared memory


def _save_seeds(rank: int, world: int, layout: Layout, root: str) -> None:
    """Step 1 of seed 1's tensors, then step 2 of seed 2's, by one job."""
    state = model_state(layout, rank, seed=1)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 1)) as ck:
        ck.save(1).wait()
        later = model_state(layout, rank, seed=2)["model"]
        for name, value in state["model"].items():
            (value.local if isinstance(value, Shard) else value).copy_(
                later[name].local if isinstance(later[name], Shard) else later[name]
            )
        ck.save(2).wait()


def _restore_at_job_start(rank: int, world: int, layout: Layout, root: str) -> tuple[int | None, int, int, int]:
    state = model_state(layout, rank, seed=1, fill=-1.0)
    with tiercheck.Checkpointer(state, local=node_dir(root, rank, 1)) as ck:
        step = ck.restore()  # a job start: in place
        stats = ck.stats()
    return step, check_model(state, 1), stats["restore_in_place_bytes"], stats["restore_chunks_shared"]


def test_a_job_start_restore_through_shared_memory_falls_back_bit_identically(tmp_path: Path) -> None:
    """Issue 43: in place, data-parallel replicas fill their live tensors from the reader's shared
    memory as each chunk is verified. A damaged chunk of step 2, written and read by rank 1, stops
    both ranks after some of step 2 reached their tensors; both fall back to step 1, which
    overwrites every tensor bit for bit."""
    run_ranks(_save_seeds, 2, DP2, str(tmp_path))
    raw = (tmp_path / "node1" / "step-00000002" / part_file(1)).read_bytes()
    written = parse_rank_part(unseal(raw, where="test"), where="test", save=None).checksums
    path, key = sorted((p, k) for p, crcs in written.items() for k in crcs)[-1]
    flip_chunk_byte(tmp_path / "node1" / "step-00000002", path, key, 0)
    results = run_ranks(_restore_at_job_start, 2, DP2, str(tmp_path), timeout=60)
    for step, checked, in_place, _ in results:
        assert step == 1 and checked == 1 + 3 * LAYERS
        assert in_place > 0
    assert sum(shared for *_, shared in results) > 0  # the replicas' chunks passed through shared memory
