"""Every file of a step is bound to that step and to the save that wrote it (format 5).

The faults here are of one class: consistent files of *another save* in a step's directory. They
pass every checksum of their own, so only the save id tells them apart:

- another step of the same run, another run's step of the same number (transplanted files);
- the same step number saved again on a new trajectory (after a rollback), then a copy or a
  drain of it that resumes where an earlier save's copy stopped.

A restore must fall back from such a step, ``load``, ``verify`` and ``restore --to`` must refuse
it naming the file, and a resumed copy or drain must replace the other save's files, never keep
them because they have the right size.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import tiercheck
from tests.cli import run
from tests.conftest import assert_identical, seeded_tensors
from tiercheck import Checkpointer
from tiercheck.errors import CorruptCheckpointError
from tiercheck.format.paths import (
    COMMIT_FILE,
    DRAINED_PREFIX,
    MANIFEST_FILE,
    owners_file,
    pack_file,
    part_file,
    refs_file,
    shard_file,
    step_dir,
)
from tiercheck.format.steps import list_steps, read_marker
from tiercheck.format.verify import verify_step
from tiercheck.tiering import transfer
from tiercheck.tiering.transfer import copy_step
from tiercheck.tiering.upload import upload_step
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.remote import open_tier


def make_state(seed: int) -> dict[str, Any]:
    """The same layout for every seed: packs and parts of two seeds have the same sizes."""
    return {"model": seeded_tensors(seed, {"w": (64, 32), "b": (32,)}), "seed": seed}


def save(local: Path, steps: dict[int, int]) -> None:
    """One run saving ``{step: seed}`` into ``local``."""
    state = make_state(0)
    with Checkpointer(state, local=local, retention=tiercheck.RetentionOptions(keep_last=None)) as ck:
        for step, seed in steps.items():
            state.update(make_state(seed))
            ck.save(step)


FILES = {
    "rank part and pack": [part_file(0), pack_file(0)],
    "arrays file": [shard_file(0)],
    "owners file": [owners_file(0)],
}


@pytest.mark.parametrize("files", list(FILES))
@pytest.mark.parametrize("donor", ["another step of the run", "another run's step"])
def test_files_of_another_save_are_refused_and_the_restore_falls_back(
    tmp_path: Path, donor: str, files: str, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = tmp_path / "ckpt"
    save(ckpt, {1: 1, 2: 2})
    if donor == "another step of the run":
        source = ckpt / step_dir(1)
    else:
        save(tmp_path / "other-run", {2: 7})
        source = tmp_path / "other-run" / step_dir(2)
    for f in FILES[files]:
        shutil.copyfile(source / f, ckpt / step_dir(2) / f)
    named = FILES[files][0]

    state = make_state(0)
    with Checkpointer(state, local=ckpt) as ck:
        assert ck.restore() == 1  # step 2 holds another save's files: not restored
    warning = next(r.getMessage() for r in caplog.records if "cannot restore step 2" in r.getMessage())
    assert f"{named}: written by save" in warning, warning
    assert_identical(state, make_state(1))
    with pytest.raises(CorruptCheckpointError, match=rf"{named}: written by save '[0-9a-f]{{32}}', not by this step's"):
        tiercheck.load(ckpt, step=2)
    problems = verify_step(LocalTier(ckpt), 2)
    assert problems and all("written by save" in p for p in problems), problems
    with pytest.raises(CorruptCheckpointError, match="written by save"):
        copy_step(LocalTier(ckpt), LocalTier(tmp_path / "copy"), 2)
    assert list_steps(LocalTier(tmp_path / "copy")).committed == []


def test_a_reference_map_of_another_save_is_refused_by_a_copy(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    save(ckpt, {1: 1, 2: 2})
    shutil.copyfile(ckpt / step_dir(1) / refs_file(0), ckpt / step_dir(2) / refs_file(0))
    with pytest.raises(CorruptCheckpointError, match=rf"{refs_file(0)}: written by save"):
        copy_step(LocalTier(ckpt), LocalTier(tmp_path / "copy"), 2)


def test_every_file_of_a_save_names_it_and_each_save_has_its_own(tmp_path: Path) -> None:
    save(tmp_path / "a", {1: 1, 2: 2})
    save(tmp_path / "b", {2: 2})  # the same step and bits, another run: another save
    ids = {
        (run, step): read_marker(LocalTier(tmp_path / run), step).save_id
        for run, step in [("a", 1), ("a", 2), ("b", 2)]
    }
    assert all(len(i or "") == 32 for i in ids.values()) and len(set(ids.values())) == 3, ids


def _interrupted_copy(monkeypatch: pytest.MonkeyPatch, src: LocalTier, dst: LocalTier, step: int) -> None:
    """A copy that put every file in place and died before its commit marker."""

    def die(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt("killed before the commit")

    with monkeypatch.context() as m:
        m.setattr(transfer, "commit_step", die)
        with pytest.raises(KeyboardInterrupt):
            copy_step(src, dst, step)
    assert list_steps(dst).partial == [step]


def test_a_resumed_copy_after_a_rollback_replaces_the_other_trajectorys_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = LocalTier(tmp_path / "target")
    save(tmp_path / "first", {2: 2})  # trajectory 1 saves step 2; its copy to the target is cut short
    _interrupted_copy(monkeypatch, LocalTier(tmp_path / "first"), target, 2)
    save(tmp_path / "second", {2: 9})  # rolled back: step 2 saved again, other bits, same sizes
    report = copy_step(LocalTier(tmp_path / "second"), target, 2)
    assert report.files_already_there == 0
    assert verify_step(target, 2) == []
    assert_identical(tiercheck.load(target.root, step=2), make_state(9))
    # Resumed with the same save, the pack it left is kept once read back and checked against the
    # manifest, not sent again; the small files are (nothing is trusted by its size).
    again = LocalTier(tmp_path / "again")
    _interrupted_copy(monkeypatch, LocalTier(tmp_path / "second"), again, 2)
    report = copy_step(LocalTier(tmp_path / "second"), again, 2)
    assert report.files_already_there == 1 and report.files_copied == 4
    assert_identical(tiercheck.load(again.root, step=2), make_state(9))


def _interrupted_drain(local: Path, remote: Path, step: int) -> None:
    """A drain whose files all reached the remote, cut short before the step was committed there."""
    with ThreadPoolExecutor(2) as pool:
        upload_step(LocalTier(local), open_tier(f"file://{remote}"), step, pool=pool)
    d = remote / step_dir(step)
    for name in [COMMIT_FILE, MANIFEST_FILE, *(p.name for p in d.glob(f"{DRAINED_PREFIX}*"))]:
        (d / name).unlink()


@pytest.mark.parametrize("cut", ["before the remote commit", "after the remote commit"])
def test_a_drain_after_a_rollback_replaces_the_other_trajectorys_step(tmp_path: Path, cut: str) -> None:
    remote = tmp_path / "remote"
    save(tmp_path / "first", {1: 1, 2: 2})
    with ThreadPoolExecutor(2) as pool:
        upload_step(LocalTier(tmp_path / "first"), open_tier(f"file://{remote}"), 1, pool=pool)
    if cut == "before the remote commit":
        _interrupted_drain(tmp_path / "first", remote, 2)
    else:
        with ThreadPoolExecutor(2) as pool:
            upload_step(LocalTier(tmp_path / "first"), open_tier(f"file://{remote}"), 2, pool=pool)
    state = make_state(0)  # trajectory 2, on a new node: rolls back to step 1 and saves step 2 again
    with Checkpointer(state, local=tmp_path / "second", remote=f"file://{remote}") as ck:
        assert ck.restore(step=1) == 1  # from the remote: the run continues its lineage
        state.update(make_state(9))
        handle = ck.save(2)
        assert handle.drained.result(timeout=60) is True
        status = ck.drain()
    assert status["files_already_there"] == 0 and status["failed"] == 0
    saved = read_marker(LocalTier(tmp_path / "second"), 2).save_id
    assert read_marker(open_tier(f"file://{remote}"), 2).save_id == saved
    assert verify_step(open_tier(f"file://{remote}"), 2) == []
    assert_identical(tiercheck.load(f"file://{remote}", step=2), make_state(9))


def test_a_drained_object_of_another_save_counts_for_nothing(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    save(tmp_path / "first", {2: 2})
    _interrupted_drain(tmp_path / "first", remote, 2)
    (remote / step_dir(2) / f"{DRAINED_PREFIX}000000.json").write_text(json.dumps({"ranks": [0], "save_id": "0" * 32}))
    save(tmp_path / "second", {2: 9})
    # Another run's partial step makes the prefix that run's (a second run racing there is refused):
    # the second run takes it over, and then no file the first drained counts for its save.
    with ThreadPoolExecutor(2) as pool:
        result = upload_step(LocalTier(tmp_path / "second"), open_tier(f"file://{remote}"), 2, pool=pool, take_over=True)
    assert result.committed and result.files_already_there == 0
    assert_identical(tiercheck.load(f"file://{remote}", step=2), make_state(9))


def test_restore_to_refuses_a_directory_holding_another_save_of_the_step(tmp_path: Path) -> None:
    save(tmp_path / "first", {2: 2})
    save(tmp_path / "second", {2: 9})
    proc = run("restore", str(tmp_path / "second"), "--to", str(tmp_path / "first"), "--step", "2", check=False)
    assert proc.returncode == 1, proc.stderr
    assert "holds another save of step 2" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert_identical(tiercheck.load(tmp_path / "first", step=2), make_state(2))  # untouched


def test_restore_to_takes_the_directorys_writer_lock(tmp_path: Path) -> None:
    save(tmp_path / "src", {2: 2})
    node = tmp_path / "node"
    with Checkpointer(make_state(0), local=node):
        proc = run("restore", str(tmp_path / "src"), "--to", str(node), check=False)
        assert proc.returncode == 1 and "in use by another tiercheck writer" in proc.stderr, proc.stderr
        assert not (node / step_dir(2)).exists()
    run("restore", str(tmp_path / "src"), "--to", str(node))
    assert_identical(tiercheck.load(node, step=2), make_state(2))


@pytest.mark.parametrize("lost", ["arrays file", "owners file"])
def test_restore_to_commits_no_copy_of_a_step_missing_a_manifest_file(tmp_path: Path, lost: str) -> None:
    save(tmp_path / "src", {2: 2})
    (tmp_path / "src" / step_dir(2) / FILES[lost][0]).unlink()
    proc = run("restore", str(tmp_path / "src"), "--to", str(tmp_path / "node"), check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert FILES[lost][0] in proc.stderr or "arrays-000000.json" in proc.stderr, proc.stderr
    assert list_steps(LocalTier(tmp_path / "node")).committed == []


def test_a_step_the_restore_passed_over_never_blocks_the_next_save_of_its_number(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 65 item 2. Step 3 is damaged, passed over, set aside and saved again; then an old backup
    of the first step 3's ``COMMIT`` and ``manifest.json`` is copied back over the new one. The restore
    passes over step 3 (its marker names another save than its files) and restores 2; the run that
    passed it over then saves 3 again: the step is set aside (kept, named in the log), never a
    ``StepExistsError``."""
    ckpt = tmp_path / "ckpt"
    save(ckpt, {1: 1, 2: 2, 3: 3})
    step3 = ckpt / step_dir(3)
    backup = tmp_path / "backup"
    backup.mkdir()
    for name in (COMMIT_FILE, MANIFEST_FILE):
        shutil.copyfile(step3 / name, backup / name)
    (step3 / pack_file(0)).write_bytes(b"\x00" * (step3 / pack_file(0)).stat().st_size)
    state = make_state(0)
    with Checkpointer(state, local=ckpt) as ck:
        assert ck.restore() == 2
        state.update(make_state(4))
        ck.save(3).wait()
    for name in (COMMIT_FILE, MANIFEST_FILE):
        shutil.copyfile(backup / name, step3 / name)

    state = make_state(0)
    with Checkpointer(state, local=ckpt) as ck:
        assert ck.restore() == 2  # step 3's marker and its files are of two saves: passed over
        assert_identical(state, make_state(2))
        state.update(make_state(5))
        ck.save(3).wait()
        assert ck.steps() == [1, 2, 3]
    assert_identical(tiercheck.load(ckpt, step=3), make_state(5))
    aside = sorted(p.name.split(".")[0] for p in (ckpt / "set-aside").iterdir())
    assert aside == [step_dir(3)] * 2, aside  # both earlier step 3s kept, none deleted
    assert sum("set step 3 aside" in r.getMessage() for r in caplog.records) == 2
