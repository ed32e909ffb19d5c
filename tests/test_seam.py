"""``tiercheck.seam``, the internal interface the bundled integrations build on: how a framework's
restore maps the saved tree onto its state (``restore_tree``), and reading regions of a step's
arrays outside a restore (``read_regions``). ``Checkpointer.restore`` keeps only what users pass."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tests.ondisk import flip_chunk_byte
from tests.shm import private_shm
from tiercheck import Checkpointer
from tiercheck.seam import LocalTier, memory_steps, open_step, read_regions, restore_tree, step_tiers


def test_restore_adds_saved_entries_unless_told_not_to_and_others_are_picked_by_name(ckpt_dir: Path) -> None:
    saved = {"m": {"a": torch.arange(4.0), "b": torch.arange(1000.0), "c": 3}, "top": torch.ones(2)}
    with Checkpointer(saved, local=ckpt_dir) as ck:
        ck.save(1).wait()
    exact: dict[str, Any] = {"m": {"a": torch.zeros(4)}}
    with Checkpointer(exact, local=ckpt_dir) as ck:
        assert restore_tree(ck, 1, extra=False) == 1
        assert set(exact) == {"m"} and set(exact["m"]) == {"a"} and torch.equal(exact["m"]["a"], saved["m"]["a"])
        assert ck.stats()["restore_bytes_read"] == 16  # m/b was not read
    grown: dict[str, Any] = {"m": {"a": torch.zeros(4)}}
    with Checkpointer(grown, local=ckpt_dir) as ck:
        assert ck.restore(1) == 1  # as a fresh optimizer gets its saved state
        assert (
            set(grown) == {"m"} and set(grown["m"]) == {"a", "b", "c"} and torch.equal(grown["m"]["b"], saved["m"]["b"])
        )
    picked: dict[str, Any] = {}
    with Checkpointer(picked, local=ckpt_dir) as ck:
        assert restore_tree(ck, 1, others=lambda names: [n for n in names if n != "m"]) == 1
        assert set(picked) == {"top"} and torch.equal(picked["top"], saved["top"])


def test_checkpointer_restore_takes_and_documents_only_what_users_pass() -> None:
    params = [p for p in inspect.signature(Checkpointer.restore).parameters if p != "self"]
    assert params == ["step", "strict", "allow_pickle", "populate_local", "in_place"]
    doc = inspect.getdoc(Checkpointer.restore) or ""
    args = doc.split("Args:", 1)[1].split("Returns:", 1)[0]
    assert all(f"\n    {p}: " in f"\n{args}" for p in params), args
    assert "Raises:" in doc


def test_read_regions_reads_rows_of_an_array_verified(ckpt_dir: Path) -> None:
    w = torch.arange(256 * 64, dtype=torch.float32).reshape(256, 64)
    write = tiercheck.WriteOptions(chunk_bytes=4096)  # many chunks: rows 10-30 cross two
    with Checkpointer({"w": w}, local=ckpt_dir, write=write) as ck:
        ck.save(1).wait()
    tier, step, manifest, marker = open_step(ckpt_dir, None)
    record = manifest.arrays["w"]
    rows = torch.empty(20, 64)
    read = read_regions(tier, step, [(record, rows, (10, 0))], holders=frozenset(marker.ranks), io_threads=2)
    assert torch.equal(rows, w[10:30]) and read >= rows.numel() * 4

    flip_chunk_byte(ckpt_dir / "step-00000001", "w", next(iter(record.checksums)), 0)
    with pytest.raises(tiercheck.CorruptCheckpointError):
        read_regions(tier, step, [(record, torch.empty(256, 64), (0, 0))], holders=frozenset(marker.ranks), io_threads=2)


def test_memory_steps_are_the_directorys_lineages_only(tmp_path: Path) -> None:
    """``memory_steps``: the memory tier's committed steps where they are the local directory's lineage; none
    where the memory is another lineage's (a restore never reads those), none without memory. ``step_tiers``
    puts the memory tier first only where it holds the step as such a one."""
    local = tmp_path / "ckpt"
    with private_shm() as shm:
        memory = tiercheck.MemoryOptions(path=shm, persist_every=1000, keep_at_close=True)
        assert memory_steps(memory, local)[1] == []  # nothing made yet
        with Checkpointer({"w": torch.arange(8.0)}, local=local, memory=memory) as ck:
            ck.save(1).wait()
            ck.save(2).wait()
            tier, steps = memory_steps(memory, local)
            assert steps == [1, 2] and tier is not None and ck.steps() == []  # in memory only
        assert tier is not None
        remote = LocalTier(tmp_path / "remote")
        assert [t.url for t in step_tiers(2, local, memory=memory, remote=remote)] == [tier.url, str(local), remote.url]
        assert [t.url for t in step_tiers(3, local, memory=memory)] == [str(local)]  # not in memory
        (tier.root / "OWNER").write_text("f" * 32)  # the memory names another lineage as its owner
        assert memory_steps(memory, local)[1] == []
        assert [t.url for t in step_tiers(2, local, memory=memory)] == [str(local)]  # never another lineage's
        assert memory_steps(None, local) == (None, [])
