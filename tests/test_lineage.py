"""A remote prefix and a local directory belong to one lineage (invariant 11).

Each job here is a new run: ``lineage.forget_all()`` drops what this process remembers of the
directories it used, as a new process starts with nothing. Job A saves and drains; job B, another
run, must not replace A's steps unless it restored from them (a rollback) or was told to take the
prefix over.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tests.cli import run, s3_args
from tests.conftest import assert_identical, seeded_tensors
from tests.distributed import run_ranks
from tests.servers import SeaweedS3
from tiercheck import Checkpointer, DrainOptions, LineageError, RetentionOptions, Shard, WriteOptions
from tiercheck.format.lineage import read_lineage
from tiercheck.format.paths import LINEAGE_FILE
from tiercheck.format.steps import list_steps, read_marker
from tiercheck.tiering import lineage, upload
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.parts import S3Upload
from tiercheck.tiers.remote import open_tier


def state_of(seed: int) -> dict[str, Any]:
    return seeded_tensors(seed, {"w": (48, 17)}) | {"seed": seed}


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


def test_restore_to_another_lineages_directory_is_refused(tmp_path: Path) -> None:
    """`tiercheck restore RA --to <B's node directory>` would make B's directory A's lineage, and
    B's next job would drain B's steps into A's prefix: refused (exit 1, naming the directory and
    both lineages), B's directory unchanged; --take-over copies and makes it A's."""
    url = f"file://{tmp_path / 'remote'}"
    job(tmp_path / "a", url, (1,), 10)
    b = tmp_path / "b"
    lineage.forget_all()
    with Checkpointer(state_of(30), local=b) as ck:
        ck.save(2)
    mine = read_lineage(LocalTier(b))
    cli = ["restore", url, "--to", str(b)]
    done = run(*cli, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert str(b) in done.stderr and "--take-over" in done.stderr
    assert read_lineage(LocalTier(b)) == mine and list_steps(LocalTier(b)).committed == [2]
    run(*cli, "--take-over")
    taken, a = read_lineage(LocalTier(b)), read_lineage(LocalTier(tmp_path / "remote"))
    assert taken is not None and a is not None and taken.id == a.id
    assert list_steps(LocalTier(b)).committed == [1, 2]


def test_restore_to_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    """A non-empty directory holding no checkpoint (notes, an export): no files are added beside
    the foreign ones unless told."""
    url = f"file://{tmp_path / 'remote'}"
    job(tmp_path / "a", url, (1,), 10)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    done = run("restore", url, "--to", str(notes), check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "not a checkpoint directory" in done.stderr and "notes.txt" in done.stderr
    assert sorted(p.name for p in notes.iterdir()) == ["notes.txt"]
    run("restore", url, "--to", str(notes), "--take-over")
    assert list_steps(LocalTier(notes)).committed == [1]


@pytest.mark.parametrize("node", ["same", "fresh"])
def test_a_rollback_abandons_the_newer_steps_even_when_the_run_crashes(tmp_path: Path, node: str) -> None:
    """A drained 1-3; the operator deletes local 2-3; the next job restores step 1, saves and
    drains a new step 2, and crashes. The job after (on the same node, or a fresh one) restores
    the new step 2, never the abandoned step 3 still on the remote. The remote retention of the
    rollback's job (keep_last=1) counts the new step 2, not the abandoned 3, and keeps it."""
    url, local = f"file://{tmp_path / 'remote'}", tmp_path / "local"
    job(local, url, (1, 2, 3), 10)
    for step in (2, 3):
        LocalTier(local).delete_tree(f"step-{step:08d}")
    keep_one = DrainOptions(retention=RetentionOptions(keep_last=1))
    assert job(local, url, (2,), 20, restore=1, drain=keep_one) == 1
    assert list_steps(LocalTier(tmp_path / "remote")).committed == [2, 3]
    lineage.forget_all()
    state = state_of(0)
    with Checkpointer(state, local=local if node == "same" else tmp_path / "fresh", remote=url) as ck:
        assert ck.restore() == 2
    assert_identical(state, state_of(22))


def test_a_rollback_the_remote_did_not_hear_of_is_recorded_by_the_next_drain(tmp_path: Path) -> None:
    """The rollback's job had no remote (or could not reach it): its directory remembers the
    rollback; a restore there skips the abandoned remote steps, and the next drain records them
    on the remote before its step lands, so a fresh node restores the new branch too."""
    url, local = f"file://{tmp_path / 'remote'}", tmp_path / "local"
    job(local, url, (1, 2, 3), 10)
    for step in (2, 3):
        LocalTier(local).delete_tree(f"step-{step:08d}")
    lineage.forget_all()
    state = state_of(0)
    with Checkpointer(state, local=local) as ck:  # no remote configured: it cannot record the rollback there
        assert ck.restore() == 1
        set_to(state, 22)
        ck.save(2).wait()
    mine = read_lineage(LocalTier(local))
    assert mine is not None and mine.rollback == 1
    lineage.forget_all()
    with Checkpointer(state, local=local, remote=url) as ck:
        assert ck.restore() == 2
        ck.drain()
    assert_identical(state, state_of(22))
    after = read_lineage(LocalTier(local))
    assert after is not None and after.rollback is None
    lineage.forget_all()
    with Checkpointer(fresh := state_of(0), local=tmp_path / "fresh", remote=url) as ck:
        assert ck.restore() == 2
    assert_identical(fresh, state_of(22))


def test_a_take_over_disowns_the_old_lineages_steps(tmp_path: Path) -> None:
    """`tiercheck drain LB --to RA --take-over` (B's steps 1-2 into the prefix holding A's 1-3):
    A's step 3 stays (for an operator to delete) but is no step of B's lineage: a fresh node of
    B restores B's step 2, and the remote retention of B counts B's steps only."""
    url = f"file://{tmp_path / 'remote'}"
    job(tmp_path / "a", url, (1, 2, 3), 10)
    lineage.forget_all()
    state = state_of(0)
    with Checkpointer(state, local=tmp_path / "b") as ck:
        for step in (1, 2):
            set_to(state, 30 + step)
            ck.save(step)
    run("drain", str(tmp_path / "b"), "--to", url, "--take-over")
    assert list_steps(LocalTier(tmp_path / "remote")).committed == [1, 2, 3]
    lineage.forget_all()
    fresh = state_of(0)
    with Checkpointer(fresh, local=tmp_path / "fresh", remote=url) as ck:
        assert ck.restore() == 2
    assert_identical(fresh, state_of(32))


def test_a_lineage_file_copied_from_another_run_replaces_none_of_its_steps(tmp_path: Path) -> None:
    """Run B's LINEAGE.json copied into run A's directory, A drained to B's prefix: the claim says
    A is B's lineage, but B's step 3 is no step B's lineage abandoned, so A's step 3 (another save)
    is refused there, naming the step; B's steps are intact."""
    ra, rb = f"file://{tmp_path / 'ra'}", f"file://{tmp_path / 'rb'}"
    job(tmp_path / "a", ra, (1, 2, 3), 10)
    job(tmp_path / "b", rb, (1, 2, 3), 40)
    (tmp_path / "a" / LINEAGE_FILE).write_bytes((tmp_path / "b" / LINEAGE_FILE).read_bytes())
    done = run("drain", str(tmp_path / "a"), "--to", rb, "--step", "3", check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "step 3" in done.stderr and "not abandoned" in done.stderr
    for step in (1, 2, 3):
        assert_identical(tiercheck.load(rb, step=step), state_of(40 + step))


def _a_drained_step_1_and_b_saved_step_1(tmp_path: Path) -> str:
    """Run A saved steps 1 and 2 (state 11, 12) in ``a`` and drained step 1 to a ``file://`` prefix;
    run B, another lineage, saved step 1 (state 31) in ``b``. Returns the prefix's URL."""
    url = f"file://{tmp_path / 'remote'}"
    lineage.forget_all()
    state = state_of(0)
    with Checkpointer(state, local=tmp_path / "a") as ck:
        for step in (1, 2):
            set_to(state, 10 + step)
            ck.save(step)
    run("drain", str(tmp_path / "a"), "--to", url, "--step", "1")
    lineage.forget_all()
    with Checkpointer(state, local=tmp_path / "b") as ck:
        set_to(state, 31)
        ck.save(1)
    return url


def test_a_commit_that_lands_after_a_take_over_is_withdrawn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run A's drain of step 2 is in flight when run B takes the prefix over; A's commit lands
    after B's claim. A checks the prefix's lineage again once its commit is written, finds B's,
    and withdraws it: the drain fails naming the take-over, and a fresh node of B restores B's
    step 1, never A's step 2."""
    url = _a_drained_step_1_and_b_saved_step_1(tmp_path)
    real = upload.commit_step
    pending = [True]

    def take_over_first(*args: Any, **kwargs: Any) -> None:
        if pending:  # A's commit of step 2: B takes the prefix over just before it lands
            pending.clear()
            run("drain", str(tmp_path / "b"), "--to", url, "--take-over")
        real(*args, **kwargs)

    monkeypatch.setattr(upload, "commit_step", take_over_first)
    done = run("drain", str(tmp_path / "a"), "--to", url, "--step", "2", check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "taken over" in done.stderr
    assert list_steps(LocalTier(tmp_path / "remote")).committed == [1]
    lineage.forget_all()
    fresh = state_of(0)
    with Checkpointer(fresh, local=tmp_path / "fresh", remote=url) as ck:
        assert ck.restore() == 1
    assert_identical(fresh, state_of(31))


def test_a_commit_that_lands_during_a_take_over_is_disowned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other order: A's commit of step 2 lands after B's take-over listed the prefix's steps
    but before its claim was written. A saw its own lineage and keeps its commit; B's second look
    after its claim disowns it: a fresh node of B restores B's step 1."""
    url = _a_drained_step_1_and_b_saved_step_1(tmp_path)
    real = lineage.write_lineage
    pending = [True]

    def drain_a_first(*args: Any, **kwargs: Any) -> None:
        if pending:  # B's claim: A's drain of step 2 commits just before it is written
            pending.clear()
            run("drain", str(tmp_path / "a"), "--to", url, "--step", "2")
        real(*args, **kwargs)

    monkeypatch.setattr(lineage, "write_lineage", drain_a_first)
    run("drain", str(tmp_path / "b"), "--to", url, "--take-over")
    assert list_steps(LocalTier(tmp_path / "remote")).committed == [1, 2]
    lineage.forget_all()
    fresh = state_of(0)
    with Checkpointer(fresh, local=tmp_path / "fresh", remote=url) as ck:
        assert ck.restore() == 1
    assert_identical(fresh, state_of(31))


def test_a_second_run_never_aborts_a_first_runs_upload_to_an_empty_prefix(
    tmp_path: Path, s3_server: SeaweedS3, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs race on an empty prefix: A's first drain has a multipart upload in flight when B's
    drain starts. The prefix holds no committed step yet, but A's step in flight: B is refused
    (LineageError naming the prefix and A's step) and aborts nothing; A's step commits whole."""
    url, options = f"s3://{s3_bucket}/race", s3_server.storage_options()
    lineage.forget_all()
    big = {"w": torch.randn(3 << 20, generator=torch.Generator().manual_seed(1))}  # 12 MiB: a multipart pack
    with Checkpointer(big, local=tmp_path / "a") as ck:
        ck.save(1)
    lineage.forget_all()
    with Checkpointer(state_of(2), local=tmp_path / "b") as ck:
        ck.save(1)
    refused: list[BaseException] = []
    real = S3Upload.put

    def b_drains_meanwhile(self: S3Upload, number: int, data: Any) -> Any:
        if number == 1 and not refused:
            with ThreadPoolExecutor(2) as pool:
                try:
                    upload.upload_step(LocalTier(tmp_path / "b"), open_tier(url, storage_options=options), 1, pool=pool)
                    refused.append(AssertionError("B drained"))
                except LineageError as e:
                    refused.append(e)
        return real(self, number, data)

    monkeypatch.setattr(S3Upload, "put", b_drains_meanwhile)
    with ThreadPoolExecutor(2) as pool:
        remote = open_tier(url, storage_options=options, part_bytes=5 << 20)
        assert upload.upload_step(LocalTier(tmp_path / "a"), remote, 1, pool=pool).committed
    assert isinstance(refused[0], LineageError), refused
    assert "being written" in str(refused[0]) and url in str(refused[0])
    assert_identical(tiercheck.load(url, step=1, storage_options=options)["w"], big["w"])


def test_an_upload_aborted_by_another_client_is_named_as_such(
    tmp_path: Path, s3_server: SeaweedS3, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where another client aborts a multipart upload in flight (another run's drain, a lifecycle
    rule), the writer says so, never "no such bucket" of a bucket that exists."""
    remote = open_tier(f"s3://{s3_bucket}/aborted", storage_options=s3_server.storage_options(), part_bytes=5 << 20)
    real = S3Upload.put

    def aborted_first(self: S3Upload, number: int, data: Any) -> Any:
        if number == 1:
            self.abort()
        return real(self, number, data)

    monkeypatch.setattr(S3Upload, "put", aborted_first)
    with pytest.raises(tiercheck.RemoteStorageError, match="aborted by another client") as info:
        remote.write("big.bin", [bytes(12 << 20)])
    assert "no such bucket" not in str(info.value)


def test_local_retention_does_not_count_a_step_a_rollback_abandoned(tmp_path: Path) -> None:
    """A saved steps 1 and 5; the next job restores step 1 and saves 2, 3, 4 with keep_last=2.
    Step 5 is the abandoned branch: kept (it is newer than any step of the job), but it does not
    count toward keep_last, so steps 3 and 4 are the two kept."""
    local = tmp_path / "local"
    lineage.forget_all()
    state = state_of(0)
    with Checkpointer(state, local=local) as ck:
        for step in (1, 5):
            ck.save(step)
    lineage.forget_all()
    with Checkpointer(state, local=local, retention=RetentionOptions(keep_last=2)) as ck:
        assert ck.restore(1) == 1
        for step in (2, 3, 4):
            ck.save(step).wait()
    assert list_steps(LocalTier(local)).committed == [3, 4, 5]
