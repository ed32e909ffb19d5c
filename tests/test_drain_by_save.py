"""A drain resumes by save, never by step number (invariant 11), on a real S3 server.

Step numbers repeat: after a rollback a job saves steps 2 and 3 again while the remote still holds
the abandoned run's steps 2 and 3. Those local steps are not drained until the remote holds their
own saves, whichever tool resumes the drain.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import tiercheck
from tests.cli import run, s3_args
from tests.conftest import assert_identical, seeded_tensors
from tests.servers import SeaweedS3
from tiercheck import Checkpointer, DrainOptions, RetentionOptions
from tiercheck.format.lineage import read_lineage, write_lineage
from tiercheck.format.paths import COMMIT_FILE, step_dir
from tiercheck.format.steps import read_marker
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.remote import open_tier


def state_of(seed: int) -> dict[str, Any]:
    return seeded_tensors(seed, {"w": (64, 33), "b": (33,)}) | {"seed": seed}


def set_to(state: dict[str, Any], seed: int) -> None:
    fresh = state_of(seed)
    state["w"].copy_(fresh["w"])
    state["b"].copy_(fresh["b"])
    state["seed"] = seed


def rolled_back(tmp_path: Path, url: str, options: dict[str, Any]) -> Path:
    """Job A saves and drains steps 1-3 (seeds 11-13); the operator rolls back to step 1 and job B
    saves steps 2 and 3 again (seeds 22, 23), killed before it drained either. Returns the local dir."""
    local = tmp_path / "local"
    state = state_of(0)
    with Checkpointer(state, local=local, remote=url, remote_options=options) as ck:
        for step in (1, 2, 3):
            set_to(state, 10 + step)
            ck.save(step)
        ck.drain()
    shutil.rmtree(local / step_dir(2))
    shutil.rmtree(local / step_dir(3))
    with Checkpointer(state, local=local) as ck:  # job B (its drains never ran)
        assert ck.restore() == 1
        for step in (2, 3):
            set_to(state, 20 + step)
            ck.save(step)
    return local


def test_a_job_drains_the_steps_whose_save_the_remote_lacks(tmp_path: Path, s3_server: SeaweedS3, s3_bucket: str) -> None:
    url, options = f"s3://{s3_bucket}/ckpt", s3_server.storage_options()
    local = rolled_back(tmp_path, url, options)
    b3 = read_marker(LocalTier(local), 3).save_id
    remote = open_tier(url, storage_options=options)
    assert read_marker(remote, 3).save_id != b3  # the remote still holds A's step 3
    state = state_of(0)
    with Checkpointer(state, local=local, remote=url, remote_options=options,
                      retention=RetentionOptions(keep_last=1)) as ck:  # fmt: skip  # job C
        assert ck.restore() == 3
        ck.drain()  # B's step 3 goes up though the remote "has" a step 3
        assert ck.steps() == [3]
    assert read_marker(remote, 3).save_id == b3
    assert_identical(tiercheck.load(url, storage_options=options), state_of(23))


def test_the_drain_command_drains_by_save(tmp_path: Path, s3_server: SeaweedS3, s3_bucket: str) -> None:
    url, options = f"s3://{s3_bucket}/ckpt", s3_server.storage_options()
    local = rolled_back(tmp_path, url, options)
    cli = [*s3_args(s3_server), "drain", str(local), "--to", url]
    run(*cli)
    for step, seed in ((2, 22), (3, 23)):
        assert_identical(tiercheck.load(url, step=step, storage_options=options), state_of(seed))
    again = run(*cli)
    assert "nothing to drain" in again.stdout, again.stdout + again.stderr


def test_a_drain_failing_on_a_file_remote_reports_the_librarys_error(tmp_path: Path) -> None:
    """A parallel-filesystem remote fails with the filesystem's own ``OSError`` (here a file where
    its directory should be): ``handle.drained`` gets ``RemoteStorageError`` naming the remote, the
    cause kept, and the local step stays."""
    blocked = tmp_path / "remote"
    blocked.write_bytes(b"not a directory")
    state = state_of(1)
    with Checkpointer(state, local=tmp_path / "local", remote=f"file://{blocked}") as ck:
        handle = ck.save(1)
        with pytest.raises(tiercheck.RemoteStorageError, match=f"{blocked}: draining step 1") as info:
            handle.drained.result(timeout=60)
        assert isinstance(info.value.__cause__, OSError)
        assert ck.steps() == [1]


def test_a_damaged_local_step_is_never_read_from_a_remote_holding_another_save(
    tmp_path: Path, s3_server: SeaweedS3, s3_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    """After the rollback, B's step 3 has a truncated rank part; the remote's step 3 is A's (the
    abandoned trajectory). The restore must not take A's step 3 for B's: it falls back to B's step 2.
    (B's directory remembers its rollback, so the restore would skip the remote's step 3 outright;
    forgotten here, as a directory written before rollbacks were recorded, the chunks' saves decide.)"""
    url, options = f"s3://{s3_bucket}/ckpt", s3_server.storage_options()
    local = rolled_back(tmp_path, url, options)
    mine = read_lineage(LocalTier(local))
    assert mine is not None and mine.rollback == 1
    write_lineage(LocalTier(local), replace(mine, rollback=None))
    part = local / step_dir(3) / "manifest" / "rank-000000.json"
    part.write_bytes(part.read_bytes()[:20])
    state = state_of(0)
    # every=1000: the job's resumed drain leaves steps 2 and 3 alone while it restores.
    with Checkpointer(state, local=local, remote=url, remote_options=options,
                      drain=DrainOptions(every=1000)) as ck:  # fmt: skip
        assert ck.restore() == 2
    assert_identical(state, state_of(22))
    assert any("holds another save of step 3" in r.getMessage() for r in caplog.records)


def test_a_planted_remote_step_of_another_save_is_set_aside_and_this_runs_step_drained(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 65 item 3. The prefix holds step 1 drained by this run and, planted, another run's
    committed step 2; this run's step 2 is undrained in its local directory. The next job
    (``keep_last=1``) restores 2: step 2 is this lineage's, so the remote's other save of it is set
    aside (kept, named in the log) and this run's step 2 drained, never left to the other run."""
    url, remote, local = f"file://{tmp_path / 'remote'}", tmp_path / "remote", tmp_path / "local"
    state = state_of(0)
    with Checkpointer(state, local=local, remote=url) as ck:
        set_to(state, 11)
        ck.save(1)
        ck.drain()
    with Checkpointer(state, local=local) as ck:  # the same run goes on without the remote: step 2 undrained
        set_to(state, 12)
        ck.save(2)
    theirs = state_of(0)
    with Checkpointer(theirs, local=tmp_path / "other", remote=f"file://{tmp_path / 'theirs'}") as ck:
        set_to(theirs, 92)
        ck.save(2)
        ck.drain()
    shutil.copytree(tmp_path / "theirs" / step_dir(2), remote / step_dir(2))  # planted
    planted = read_marker(open_tier(url), 2).save_id
    mine = read_marker(LocalTier(local), 2).save_id
    assert planted != mine

    caplog.clear()
    state = state_of(0)
    with Checkpointer(state, local=local, remote=url, retention=RetentionOptions(keep_last=1)) as ck:
        assert ck.restore() == 2
        status = ck.drain()
        assert status["failed"] == 0, status
    assert read_marker(open_tier(url), 2).save_id == mine
    assert_identical(tiercheck.load(url, step=2), state_of(12))
    (aside,) = [p for p in (remote / "set-aside").iterdir() if p.name.startswith(step_dir(2))]
    assert json.loads((aside / COMMIT_FILE).read_bytes())["save_id"] == planted  # kept whole
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and planted in r.getMessage()]
    assert any("set-aside" in m for m in said), said
