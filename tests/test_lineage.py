"""A remote prefix and a local directory belong to one lineage (invariant 11).

Each job here is a new run: ``lineage.forget_all()`` drops what this process remembers of the
directories it used, as a new process starts with nothing. Job A saves and drains; job B, another
run, must not replace A's steps unless it restored from them (a rollback) or was told to take the
prefix over.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tests.cli import run, s3_args
from tests.conftest import assert_identical
from tests.distributed import run_ranks
from tests.servers import SeaweedS3
from tiercheck import Checkpointer, LineageError, RetentionOptions, Shard, WriteOptions
from tiercheck.format.lineage import read_lineage
from tiercheck.format.paths import LINEAGE_FILE
from tiercheck.format.steps import list_steps, read_marker
from tiercheck.tiering import lineage
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.remote import open_tier


def state_of(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(48, 17, generator=g), "seed": seed}


def set_to(state: dict[str, Any], seed: int) -> None:
    state["w"].copy_(state_of(seed)["w"])
    state["seed"] = seed


def job(
    local: Path, url: str, steps: tuple[int, ...], seed: int, *, restore: bool | int = False, **options: Any
) -> int | None:
    """A new run: restores (the newest step, or step ``restore``), saves ``steps`` (seeds
    ``seed + step``) and drains each; returns what it restored."""
    lineage.forget_all()
    state = state_of(0)
    with Checkpointer(state, local=local, remote=url, **options) as ck:
        got = None if restore is False else ck.restore(None if restore is True else restore)
        for step in steps:
            set_to(state, seed + step)
            ck.save(step)
            ck.drain()  # each step drained, none skipped as older
    return got


def test_a_second_run_on_a_shared_prefix_is_refused_and_loses_nothing(
    tmp_path: Path, s3_server: SeaweedS3, s3_bucket: str
) -> None:
    """Item 2's repro: job A (keep_last=1) drains steps 1-3; job B, another run with its own local
    directory that restored nothing, would have replaced A's steps 1 and 2. Its first save refuses,
    naming the prefix and both runs, and writes nothing."""
    url, options = f"s3://{s3_bucket}/shared", s3_server.storage_options()
    job(tmp_path / "a", url, (1, 2, 3), 10, remote_options=options, retention=RetentionOptions(keep_last=1))
    remote = open_tier(url, storage_options=options)
    a = read_lineage(remote)
    assert a is not None
    saves = {s: read_marker(remote, s).save_id for s in (1, 2, 3)}
    lineage.forget_all()
    with Checkpointer(state_of(0), local=tmp_path / "b", remote=url, remote_options=options) as ck:
        with pytest.raises(LineageError) as info:
            ck.save(1)
        assert ck.steps() == []
    message = str(info.value)
    assert url in message and a.run[:12] in message and "did not restore" in message
    assert "take_over=True" in message and "restore from this one" in message
    assert {s: read_marker(remote, s).save_id for s in (1, 2, 3)} == saves
    assert read_lineage(remote) == a
    for step in (1, 2, 3):
        assert_identical(tiercheck.load(url, step=step, storage_options=options), state_of(10 + step))


def test_a_run_that_restored_from_the_prefix_continues_its_lineage(tmp_path: Path) -> None:
    """Job B, on a new local directory, restores A's step 3 from the prefix: it continues A's
    lineage, and its local directory now names it."""
    url = f"file://{tmp_path / 'remote'}"
    job(tmp_path / "a", url, (1, 2, 3), 10)
    assert job(tmp_path / "b", url, (4,), 10, restore=True) == 3
    remote = LocalTier(tmp_path / "remote")
    assert list_steps(remote).committed == [1, 2, 3, 4]
    a, b = read_lineage(remote), read_lineage(LocalTier(tmp_path / "b"))
    assert a is not None and b is not None and a.id == b.id


def test_a_rollback_replaces_the_same_numbered_steps_of_its_own_lineage(tmp_path: Path) -> None:
    """A rollback continues the lineage: the run restored step 1 of this directory, and its steps
    2 and 3 replace the abandoned ones on the remote."""
    url, local = f"file://{tmp_path / 'remote'}", tmp_path / "local"
    job(local, url, (1, 2, 3), 10)
    for step in (2, 3):
        tiercheck.tiers.local.LocalTier(local).delete_tree(f"step-{step:08d}")
    assert job(local, url, (2, 3), 20, restore=1) == 1
    for step in (2, 3):
        assert_identical(tiercheck.load(url, step=step), state_of(20 + step))


def test_a_new_run_in_a_directory_holding_steps_is_refused_until_it_restores(tmp_path: Path) -> None:
    local = tmp_path / "local"
    lineage.forget_all()
    state = state_of(1)
    with Checkpointer(state, local=local) as ck:
        ck.save(5)
    lineage.forget_all()
    with Checkpointer(state_of(2), local=local) as ck:
        with pytest.raises(LineageError, match="the local directory .* holds step\\(s\\) 5 of lineage"):
            ck.save(6)
        assert ck.restore() == 5
        ck.save(6).wait()
        assert ck.steps() == [5, 6]


def test_take_over_is_explicit_and_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With WriteOptions(take_over=True) job B writes there: its steps replace A's of the same
    number, A's other steps stay, and the prefix names B's lineage and the one it replaced."""
    url = f"file://{tmp_path / 'remote'}"
    job(tmp_path / "a", url, (1, 2, 3), 10)
    remote = LocalTier(tmp_path / "remote")
    a = read_lineage(remote)
    job(tmp_path / "b", url, (1, 2), 20, write=WriteOptions(take_over=True))
    b = read_lineage(remote)
    assert a is not None and b is not None and b.id != a.id and b.previous == a.id
    assert any("taking over" in r.getMessage() for r in caplog.records)
    for step, seed in ((1, 21), (2, 22), (3, 13)):
        assert_identical(tiercheck.load(url, step=step), state_of(seed))


def test_the_drain_command_refuses_another_lineages_prefix(tmp_path: Path) -> None:
    """`tiercheck drain` of a directory of one lineage to a prefix holding another's steps: exit 1
    naming both; nothing replaced; --take-over drains it."""
    url = f"file://{tmp_path / 'remote'}"
    job(tmp_path / "a", url, (1, 2), 10)
    lineage.forget_all()
    with Checkpointer(state_of(30), local=tmp_path / "b") as ck:  # no remote: B's steps stay local
        ck.save(1)
    cli = ["drain", str(tmp_path / "b"), "--to", url]
    done = run(*cli, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "did not restore" in done.stderr and str(tmp_path / "remote") in done.stderr
    assert_identical(tiercheck.load(url, step=1), state_of(11))
    run(*cli, "--take-over")
    assert_identical(tiercheck.load(url, step=1), state_of(30))


def test_a_damaged_lineage_file_is_refused_by_name(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'remote'}"
    job(tmp_path / "a", url, (1,), 10)
    (tmp_path / "remote" / LINEAGE_FILE).write_text(json.dumps({"format": 1, "lineage": "../x"}))
    lineage.forget_all()
    refused = pytest.raises(LineageError, match=f"{LINEAGE_FILE}: unreadable")
    with Checkpointer(state_of(0), local=tmp_path / "b", remote=url) as ck, refused:
        ck.save(1)


@pytest.mark.parametrize("since", [1e300, float("nan"), float("inf"), -5.0, True], ids=str)
def test_a_lineage_file_whose_since_is_no_time_is_refused_by_name(tmp_path: Path, since: float) -> None:
    """Another lineage's file whose "since" no clock can show (1e300, NaN, a bool): the save is
    refused with the library's LineageError naming the file and the field, not a raw
    OverflowError or ValueError from formatting the time."""
    local = tmp_path / "a"
    with Checkpointer(state_of(1), local=local) as ck:
        ck.save(1).wait()
    doc = json.loads((local / LINEAGE_FILE).read_text())
    (local / LINEAGE_FILE).write_text(json.dumps(doc | {"lineage": "ab" * 8, "since": since}))
    with pytest.raises(tiercheck.CorruptCheckpointError, match=f"{LINEAGE_FILE}: unreadable.*since"):
        read_lineage(LocalTier(local))
    lineage.forget_all()
    refused = pytest.raises(LineageError, match=f"{LINEAGE_FILE}: unreadable.*since")
    with Checkpointer(state_of(0), local=local) as ck, refused:
        ck.save(2)
    assert list_steps(LocalTier(local)).committed == [1]


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "all-or-nothing"])
@pytest.mark.parametrize("kind", ["directory", "link outside"])
def test_a_lineage_file_a_restore_cannot_claim_stops_it_before_the_state_is_touched(
    tmp_path: Path, kind: str, in_place: bool
) -> None:
    """LINEAGE.json as a directory, or a link to a file outside the checkpoint: the restore, which
    would claim the directory for the restored lineage once done, refuses before a byte reaches
    the state, with the library's error naming the file; the state is as it was."""
    local = tmp_path / "a"
    with Checkpointer(state_of(1), local=local) as ck:
        ck.save(1).wait()
    path = local / LINEAGE_FILE
    outside = tmp_path / "outside.json"
    claim = path.read_bytes()
    outside.write_bytes(claim)
    path.unlink()
    if kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(outside)
    lineage.forget_all()
    state = state_of(0)
    before = state["w"].clone()
    refused = pytest.raises((LineageError, tiercheck.UnsafeCheckpointError), match=LINEAGE_FILE)
    with Checkpointer(state, local=local) as ck, refused:
        ck.restore(in_place=in_place)
    assert torch.equal(state["w"], before) and state["seed"] == 0
    assert outside.read_bytes() == claim


def _save_on_my_node(rank: int, world_size: int, roots: list[str]) -> None:
    state = {"w": Shard(torch.full((8, 4), 1.0 + rank), global_shape=(16, 4), offsets=(8 * rank, 0))}
    with Checkpointer(state, local=roots[rank]) as ck:
        ck.save(1).wait()


def _restore_on_my_node(rank: int, world_size: int, roots: list[str]) -> tuple[str, str, bool]:
    mine = torch.zeros(8, 4)
    state = {"w": Shard(mine, global_shape=(16, 4), offsets=(8 * rank, 0))}
    with Checkpointer(state, local=roots[rank]) as ck:
        try:
            ck.restore()  # at a job start: in place
        except tiercheck.TiercheckError as e:
            return type(e).__name__, str(e), bool((mine == 0).all())
    return "restored", "", bool((mine == 0).all())


def test_one_nodes_unclaimable_lineage_file_stops_every_ranks_restore_before_the_state_is_touched(
    tmp_path: Path,
) -> None:
    """Two nodes, node 1's LINEAGE.json a directory: node 1's first rank refuses it in the
    restore's step 2, and both ranks raise (rank 0 quoting rank 1) with their tensors untouched."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    run_ranks(_save_on_my_node, 2, roots)
    bad = Path(roots[1]) / LINEAGE_FILE
    bad.unlink()
    bad.mkdir()
    (zero, one) = run_ranks(_restore_on_my_node, 2, roots)
    assert one[0] == "LineageError" and str(bad) in one[1] and one[2], one
    assert zero[0] == "CoordinationError" and LINEAGE_FILE in zero[1] and zero[2], zero


def test_restore_to_carries_the_lineage(tmp_path: Path, s3_server: SeaweedS3, s3_bucket: str) -> None:
    """A step pre-staged with `tiercheck restore --to` belongs to the source's lineage: the job
    restoring it continues that lineage, and its drains to the prefix go through."""
    url, options = f"s3://{s3_bucket}/staged", s3_server.storage_options()
    job(tmp_path / "a", url, (1,), 10, remote_options=options)
    node = tmp_path / "node"
    run(*s3_args(s3_server), "restore", url, "--to", str(node))
    staged, source = read_lineage(LocalTier(node)), read_lineage(open_tier(url, storage_options=options))
    assert staged is not None and source is not None and staged.id == source.id
    assert job(node, url, (2,), 10, restore=True, remote_options=options) == 1
    assert_identical(tiercheck.load(url, step=2, storage_options=options), state_of(12))
