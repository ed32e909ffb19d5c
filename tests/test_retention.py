"""Retention keeps the newest K (and every Mth) committed steps and cleans crash leftovers."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

import tiercheck
from tests.conftest import assert_identical
from tiercheck import Checkpointer, RetentionOptions
from tiercheck.format.paths import step_dir, step_of
from tiercheck.tiering.retention import LocalSteps, steps_to_delete
from tiercheck.tiers.local import LocalTier, PackWriter


def test_policy() -> None:
    assert steps_to_delete([1, 2, 3, 4, 5], RetentionOptions(keep_last=2)) == [1, 2, 3]
    assert steps_to_delete([1, 2, 3, 4, 5], RetentionOptions(keep_last=1, keep_every=2)) == [1, 3]
    assert steps_to_delete([7], RetentionOptions(keep_last=1)) == []
    assert steps_to_delete([], RetentionOptions(keep_last=1)) == []
    assert steps_to_delete([1, 2, 3], RetentionOptions(keep_last=None)) == []
    judged: list[int] = []

    def damage(step: int) -> str | None:
        judged.append(step)
        return "rotted" if step in (5, 3) else None

    # 5 and 3 do not count: 4 and 2 are the two kept, 5 and 3 kept beside them, 1 goes, unjudged
    assert steps_to_delete([1, 2, 3, 4, 5], RetentionOptions(keep_last=2), damage=damage) == [1]
    assert judged == [5, 4, 3, 2]


def test_keep_last_and_keep_every_on_disk(ckpt_dir: Path) -> None:
    with Checkpointer(
        {"x": torch.zeros(4)}, local=ckpt_dir, retention=RetentionOptions(keep_last=2, keep_every=3)
    ) as ck:
        for step in range(1, 8):
            ck.save(step).wait()
        ck.wait()  # a handle resolves once its step is durable; retention runs right after
        assert ck.steps() == [3, 6, 7]
    assert sorted(p.name for p in ckpt_dir.glob("step-*")) == ["step-00000003", "step-00000006", "step-00000007"]


def test_partial_steps_are_never_reported_and_are_cleaned_at_start(ckpt_dir: Path) -> None:
    with Checkpointer({"x": torch.ones(4)}, local=ckpt_dir) as ck:
        ck.save(1).wait()
    leftover = ckpt_dir / "step-00000002"
    (leftover / "x").mkdir(parents=True)
    (leftover / "x" / "c.0").write_bytes(b"half")
    assert tiercheck.load(ckpt_dir)["x"].sum() == 4  # the partial step 2 is invisible
    with Checkpointer({"x": torch.zeros(4)}, local=ckpt_dir) as ck:
        assert not leftover.exists()
        assert ck.steps() == [1] and ck.restore() == 1
        ck.save(2).wait()  # the number of a cleaned partial step can be saved normally
        assert ck.steps() == [1, 2]


def test_a_step_has_one_name() -> None:
    assert [step_of(step_dir(n)) for n in (0, 2, 99_999_999, 123_456_789)] == [0, 2, 99_999_999, 123_456_789]
    for alias in ("step-000000002", "step-2", "step-0123456789", "step-00000002\n", "step-0000000\u0662", "step-"):
        assert step_of(alias) is None, alias


def _warned(caplog: pytest.LogCaptureFixture, name: str) -> bool:
    return any(r.levelno == logging.WARNING and name in r.getMessage() for r in caplog.records)


def test_a_stray_alias_of_a_committed_step_is_never_cleaned_up_in_its_place(
    ckpt_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``step-000000002`` without a commit marker once read as "partial step 2", and start-up
    cleanup then deleted ``step-00000002``: the committed step."""
    g = torch.Generator().manual_seed(2)
    saved = {"w": torch.randn(1000, generator=g), "b": torch.randn(7, generator=g).half()}
    with Checkpointer({k: v.clone() for k, v in saved.items()}, local=ckpt_dir) as ck:
        ck.save(2).wait()
    alias = ckpt_dir / "step-000000002"
    alias.mkdir()
    (alias / "stray").write_bytes(b"not ours")
    state = {k: torch.zeros_like(v) for k, v in saved.items()}
    with Checkpointer(state, local=ckpt_dir) as ck:
        assert (ckpt_dir / step_dir(2) / "COMMIT").exists() and (alias / "stray").exists()
        assert ck.steps() == [2] and ck.restore() == 2
    assert_identical(state, saved)
    assert _warned(caplog, "step-000000002")


def test_keep_last_counts_only_steps_under_their_own_name(ckpt_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A committed copy under another name (step 9 by its spelling) once counted as the newest
    step, so keep_last=1 kept it and deleted every real step."""
    with Checkpointer({"x": torch.ones(4)}, local=ckpt_dir, retention=RetentionOptions(keep_last=None)) as ck:
        for step in (1, 2, 3):
            ck.save(step).wait()
    shutil.copytree(ckpt_dir / step_dir(3), ckpt_dir / "step-000000009")
    steps = LocalSteps(LocalTier(ckpt_dir), RetentionOptions(keep_last=1), leader=True)
    assert steps.sorted() == [1, 2, 3]
    steps.whole(3)  # the job committed (or restored) step 3: older steps may go
    steps.retain()
    assert steps.sorted() == [3]
    assert sorted(p.name for p in ckpt_dir.glob("step-*")) == ["step-000000009", "step-00000003"]
    assert _warned(caplog, "step-000000009")


class FullDiskTier(LocalTier):
    """A real local tier that runs out of space after a byte budget, like a filling NVMe."""

    def __init__(self, root: Path, budget: int) -> None:
        super().__init__(root)
        self.budget = budget

    def write(self, path: str, parts):  # type: ignore[no-untyped-def]
        size = sum(len(memoryview(p).cast("B")) for p in parts)
        if size > self.budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.root / path))
        self.budget -= size
        super().write(path, parts)

    def open_pack(self, path: str) -> PackWriter:
        pack = super().open_pack(path)
        write_at = pack.write_at

        def budgeted(offset: int, parts):  # type: ignore[no-untyped-def]
            size = sum(len(memoryview(p).cast("B")) for p in parts)
            if size > self.budget:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.root / path))
            self.budget -= size
            write_at(offset, parts)

        pack.write_at = budgeted  # type: ignore[method-assign]
        return pack


def test_full_disk_fails_the_save_with_its_error_and_keeps_the_committed_step(ckpt_dir: Path) -> None:
    state = {"w": torch.ones(64 << 10)}
    with Checkpointer(state, local=ckpt_dir) as ck:
        ck.save(1).wait()
        ck.tier = FullDiskTier(ckpt_dir, budget=100_000)
        ck._pipeline.tier = ck.tier  # type: ignore[union-attr]
        state["w"].fill_(2)
        handle = ck.save(2)
        with pytest.raises(OSError) as info:
            handle.wait()
        assert info.value.errno == errno.ENOSPC
        assert ck.stats()["failed"] == 1
        assert ck.steps() == [1]
        assert sorted(p.name for p in ckpt_dir.glob("step-*")) == ["step-00000001"], "the failed save's files are gone"
        state["w"].zero_()
        assert ck.restore() == 1  # the failed save does not stand in the way of restoring
        assert torch.equal(state["w"], torch.ones(64 << 10))
    assert torch.equal(tiercheck.load(ckpt_dir)["w"], torch.ones(64 << 10))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_full_real_tmpfs(tmp_path: Path) -> None:
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], check=False).returncode:
        pytest.skip("this sandbox does not allow mounting a tmpfs")
    try:
        state = {"w": torch.ones(256 << 10)}  # 1 MiB
        with Checkpointer(state, local=mnt, retention=RetentionOptions(keep_last=None)) as ck:
            ck.save(1).wait()
            ck.save(2).wait()
            with pytest.raises(OSError) as info:
                ck.save(3).wait()  # the third MiB does not fit next to two committed steps
            assert info.value.errno == errno.ENOSPC
            assert ck.steps() == [1, 2]
        assert torch.equal(tiercheck.load(mnt, step=2)["w"], torch.ones(256 << 10))
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


class _HeldDeletes(LocalTier):
    """A local tier whose step deletions wait until the test lets them go."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.deleting, self.release = threading.Event(), threading.Event()

    def delete_tree(self, path: str) -> None:
        self.deleting.set()
        assert self.release.wait(60), "the test never released the deletion"
        super().delete_tree(path)


def test_asking_whether_a_step_exists_does_not_wait_for_retention_to_delete(ckpt_dir: Path) -> None:
    """save() asks; retention deletes a step of many GiB in the background: the question must not
    wait for the disk (it held the training thread 0.8 s for a 1 GiB step)."""
    with Checkpointer({"w": torch.ones(4)}, local=ckpt_dir) as ck:
        for s in (1, 2, 3):
            ck.save(s).wait()
    tier = _HeldDeletes(ckpt_dir)
    steps = LocalSteps(tier, RetentionOptions(keep_last=1), leader=True)
    steps.whole(3)
    deleting = threading.Thread(target=steps.retain)
    deleting.start()
    try:
        assert tier.deleting.wait(60)
        answers: list[bool] = []
        asking = threading.Thread(target=lambda: answers.extend([3 in steps, 1 in steps]))
        asking.start()
        asking.join(30)
        assert answers == [True, False], "the question waited for the deletion"
    finally:
        tier.release.set()
        deleting.join()
    assert sorted(p.name for p in ckpt_dir.glob("step-*")) == ["step-00000003"]


def test_keep_last_counts_only_restorable_steps_and_keeps_a_damaged_one(
    ckpt_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 2's manifest part rotted: with keep_last=2 the save of step 3 once deleted step 1,
    leaving one restorable step where two were asked for."""
    state = {"x": torch.arange(64.0)}
    with Checkpointer(state, local=ckpt_dir, retention=RetentionOptions(keep_last=None)) as ck:
        ck.save(1).wait()
        state["x"] += 1
        ck.save(2).wait()
    part = ckpt_dir / step_dir(2) / "manifest" / "rank-000000.json"
    part.write_bytes(part.read_bytes()[:-9] + b"garbage!!")
    with Checkpointer(state, local=ckpt_dir, retention=RetentionOptions(keep_last=2)) as ck:
        state["x"] += 1
        ck.save(3).wait()
        ck.wait()
        assert ck.steps() == [1, 2, 3]
        ck.save(4).wait()
        ck.wait()
        assert ck.steps() == [3, 4]  # two whole steps newer than the damaged one: it goes as any older step
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "step 2 in" in r.getMessage()]
    assert len(warned) == 1 and "does not count toward keep_last" in warned[0] and "rank-000000.json" in warned[0]
    assert_identical(tiercheck.load(ckpt_dir, step=3), {"x": torch.arange(64.0) + 2})
