"""The remote tier behind a Checkpointer: drains, retention, resume, failures and restore from it.

Every test runs against each remote: a parallel-filesystem directory (file://), and the real S3
(SeaweedFS) and Azure Blob (Azurite) servers started by the session fixtures.
"""

from __future__ import annotations

import json
import shutil
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
import zarr
import zarr.core.sync

import tiercheck
import tiercheck.tiers.remote
from tests.conftest import assert_identical
from tests.ondisk import flip_chunk_byte
from tests.plainzarr import open_step
from tiercheck import Checkpointer
from tiercheck.errors import CorruptCheckpointError
from tiercheck.format.paths import copying_marker, pack_file, step_dir
from tiercheck.format.steps import list_steps, read_marker
from tiercheck.options import DrainOptions, RetentionOptions, RetryOptions, WriteOptions
from tiercheck.tiering.upload import upload_step
from tiercheck.tiers.base import Buffer, Tier
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.remote import open_tier

FAST_RETRY = RetryOptions(attempts=3, initial_backoff_s=0.05, max_backoff_s=0.2, deadline_s=20)


@dataclass
class Remote:
    url: str
    options: dict[str, Any]

    def tier(self) -> Tier:
        return open_tier(self.url, storage_options=self.options, retry=FAST_RETRY)


@pytest.fixture(params=["file", "s3", "azure"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Remote:
    name = f"t{abs(hash(request.node.nodeid)) % 10**10}"
    if request.param == "file":
        return Remote(f"file://{tmp_path / 'remote'}", {})
    if request.param == "s3":
        server = request.getfixturevalue("s3_server")
        server.make_bucket(name)
        return Remote(f"s3://{name}/ckpt", server.storage_options())
    server = request.getfixturevalue("azurite_server")
    server.make_container(name)
    return Remote(f"az://{name}/ckpt", server.storage_options())


def make_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 70, generator=g),
        "b": torch.randn(70, generator=g).to(torch.bfloat16),
        "meta": {"seed": seed, "name": "x"},
    }


def checkpointer(state: dict[str, Any], local: Path, remote: Remote | Tier, **kw: Any) -> Checkpointer:
    kw.setdefault("drain", DrainOptions(retry=FAST_RETRY))
    if isinstance(remote, Remote):
        return Checkpointer(state, local=local, remote=remote.url, remote_options=remote.options, **kw)
    return Checkpointer(state, local=local, remote=remote, **kw)


def set_values(state: dict[str, Any], seed: int) -> None:
    fresh = make_state(seed)
    state["w"].copy_(fresh["w"])
    state["b"].copy_(fresh["b"])
    state["meta"]["seed"] = seed


def test_committed_steps_drain_and_load_back_from_the_remote(tmp_path: Path, remote: Remote) -> None:
    state = make_state(1)
    with checkpointer(state, tmp_path / "local", remote, drain=DrainOptions(every=2, retry=FAST_RETRY)) as ck:
        handles = []
        for step in range(1, 6):
            set_values(state, step)
            handles.append(ck.save(step))
        assert [h.drained.result(timeout=60) for h in handles] == [False, True, False, True, False]
        status = ck.drain()
        assert (status["drained"], status["failed"], status["last_drained"]) == (2, 0, 4)
    assert list_steps(remote.tier()).committed == [2, 4]
    assert_identical(tiercheck.load(remote.url, storage_options=remote.options), make_state(4))
    assert_identical(tiercheck.load(remote.url, step=2, storage_options=remote.options), make_state(2))


def test_plain_zarr_reads_a_drained_step_through_its_reference_maps(tmp_path: Path, remote: Remote) -> None:
    state = make_state(6)
    with checkpointer(state, tmp_path / "local", remote, write=WriteOptions(chunk_bytes=16 << 10)) as ck:
        ck.save(1)
        ck.drain()
    fs, root = fsspec.core.url_to_fs(remote.url, **(remote.options or {}))
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    group = open_step(f"{root}/{step_dir(1)}", protocol, **(remote.options or {}))
    assert group["w"].nchunks > 1 and np.array_equal(group["w"][:], state["w"].numpy())
    assert np.array_equal(group["b"][:], state["b"].view(torch.uint16).numpy())  # bfloat16's bits
    # Close the asynchronous filesystem the reference fs opened for Azure, on zarr's loop where its client lives:
    # adlfs closes it in a finalizer that needs the filesystem's own loop (None when asynchronous=True), which
    # at interpreter exit printed a traceback ("RuntimeError: Loop is not running") after pytest's summary.
    opened = group.store.fs.fss[protocol]
    if hasattr(opened, "service_client"):
        zarr.core.sync.sync(opened.service_client.close())
        registry = weakref.finalize._registry  # type: ignore[attr-defined]
        finalizers = [f for f, info in list(registry.items()) if info.weakref() is opened]
        assert finalizers, "adlfs no longer closes its client in a finalizer"
        for finalizer in finalizers:
            finalizer.detach()


def test_remote_retention_is_its_own_policy(tmp_path: Path, remote: Remote) -> None:
    state = make_state(1)
    drain = DrainOptions(retention=RetentionOptions(keep_last=1, keep_every=3), retry=FAST_RETRY)
    with checkpointer(state, tmp_path / "local", remote, drain=drain, retention=RetentionOptions(keep_last=2)) as ck:
        for step in range(1, 6):
            ck.save(step).drained.result(timeout=60)
        assert ck.steps() == [4, 5]
    assert list_steps(remote.tier()).committed == [3, 5]


def test_remote_retention_counts_only_steps_whose_index_reads_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 2's remote commit marker is garbage: with keep_last=2 the drain of step 3 once deleted
    step 1, the only older step the remote could restore."""
    remote = Remote(f"file://{tmp_path / 'remote'}", {})
    state = make_state(1)
    every = DrainOptions(retention=RetentionOptions(keep_last=None), retry=FAST_RETRY)
    with checkpointer(state, tmp_path / "local", remote, drain=every) as ck:
        for step in (1, 2):
            set_values(state, step)
            ck.save(step).drained.result(timeout=60)
    (tmp_path / "remote" / step_dir(2) / "COMMIT").write_bytes(b"{garbage")
    # Nothing to repair it from: a drain resumes by save, and would upload the local step 2 again.
    shutil.rmtree(tmp_path / "local" / step_dir(2))
    two = DrainOptions(retention=RetentionOptions(keep_last=2), retry=FAST_RETRY)
    with checkpointer(state, tmp_path / "local", remote, drain=two) as ck:
        set_values(state, 3)
        assert ck.save(3).drained.result(timeout=60)
    assert list_steps(remote.tier()).committed == [1, 2, 3]
    assert any(
        r.levelname == "WARNING" and "step 2 on" in r.getMessage() and "does not count toward keep_last" in r.getMessage()
        for r in caplog.records
    )
    assert_identical(tiercheck.load(remote.url, step=1), make_state(1))


def test_a_fresh_node_restores_from_the_remote(tmp_path: Path, remote: Remote) -> None:
    state = make_state(7)
    with checkpointer(state, tmp_path / "old-node", remote) as ck:
        ck.save(10)
        ck.drain()
    fresh = make_state(0)
    with checkpointer(fresh, tmp_path / "new-node", remote) as ck:
        assert ck.restore(populate_local=True) == 10
        assert ck.stats()["restore_remote_reads"] > 0
    assert_identical(fresh, make_state(7))
    # The node copied the step for next time: the next restore reads nothing from the remote.
    again = make_state(0)
    with checkpointer(again, tmp_path / "new-node", remote) as ck:
        assert ck.steps() == [10]
        assert ck.restore() == 10
        assert ck.stats()["restore_remote_reads"] == 0
    assert_identical(again, make_state(7))


@pytest.mark.parametrize("damage", ["empty", "missing"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "all-or-nothing"])
def test_an_empty_or_missing_remote_pack_is_damage_and_a_fresh_node_falls_back(
    tmp_path: Path, remote: Remote, damage: str, in_place: bool
) -> None:
    """A pack on the remote replaced by a 0-byte object (a ranged GET of it is a 416 on S3) or gone
    altogether is the step's damage, as a truncated one is: a fresh node restores the older whole
    step, in either restore mode, never an outage's RemoteStorageError."""
    state = make_state(1)
    with checkpointer(state, tmp_path / "old-node", remote) as ck:
        ck.save(1)
        set_values(state, 2)
        ck.save(2)
        ck.drain()
    tier = remote.tier()
    pack = f"{step_dir(2)}/{pack_file(0)}"
    assert tier.exists(pack)
    if damage == "empty":
        tier.write(pack, [b""])
    else:
        tier.delete(pack)
    fresh = make_state(0)
    with checkpointer(fresh, tmp_path / "new-node", remote) as ck:
        assert ck.restore(in_place=in_place) == 1
    assert_identical(fresh, make_state(1))


def test_a_chunk_that_rotted_on_local_disk_is_never_uploaded_or_committed(tmp_path: Path, remote: Remote) -> None:
    state = make_state(4)
    with Checkpointer(state, local=tmp_path / "local") as ck:  # no remote yet: nothing drains
        ck.save(1).wait()
    flip_chunk_byte(tmp_path / "local" / step_dir(1), "w", "c.0.0", 7)
    local, dst = LocalTier(tmp_path / "local"), remote.tier()
    with (
        ThreadPoolExecutor(2) as pool,
        pytest.raises(CorruptCheckpointError, match=r"array 'w' chunk c\.0\.0: checksum"),
    ):
        upload_step(local, dst, 1, pool=pool)
    assert list_steps(dst).committed == []
    assert not [f for f in dst.sizes(step_dir(1)) if "packs/" in f], "the pack with the rotten chunk did not go up"


def test_a_corrupt_local_chunk_is_read_from_the_remote(tmp_path: Path, remote: Remote) -> None:
    state = make_state(3)
    with checkpointer(state, tmp_path / "local", remote) as ck:
        ck.save(1)
        ck.drain()
    flip_chunk_byte(tmp_path / "local" / step_dir(1), "w", "c.0.0", 5)
    fresh = make_state(0)
    with checkpointer(fresh, tmp_path / "local", remote) as ck:
        assert ck.restore() == 1
        assert ck.stats()["restore_fallbacks"] == 1
    assert_identical(fresh, make_state(3))


def test_an_interrupted_drain_resumes_without_sending_complete_files_again(tmp_path: Path, remote: Remote) -> None:
    state = {f"t{i}": torch.full((1000,), float(i)) for i in range(6)}
    local = tmp_path / "local"
    with Checkpointer(state, local=local) as ck:  # a run whose drain never happened
        ck.save(1)
        ck.save(2)
    # Half of step 2's files reached the remote before the job ended, under the marker naming their
    # save that a drain writes before its first file.
    tier = remote.tier()
    save_id = read_marker(LocalTier(local), 2).save_id
    tier.write(f"{step_dir(2)}/{copying_marker(0)}", [json.dumps({"save_id": save_id}).encode()])
    files = sorted(p for p in (local / step_dir(2)).rglob("*") if p.is_file() and p.name not in ("COMMIT",))
    data = [p for p in files if p.name != "manifest.json"]  # the pack, the manifest parts, the refs
    data.sort(key=lambda p: p.parent.name != "packs")  # the pack among the three that made it
    for p in data[:3]:
        tier.write(str(p.relative_to(local)), [p.read_bytes()])
    with checkpointer(dict(state), local, remote) as ck:
        status = ck.drain()
    assert status["last_drained"] == 2  # the newest; step 1 is older than what the remote will have
    # Only the pack counts, once its content checks out (never its size): read back on a directory;
    # an object store keeps no part checksums of a pack this small (one PUT), so it goes again.
    # The small files always go again. (test_parts: a large pack kept on S3 by its parts' CRC32Cs.)
    assert status["files_already_there"] == (1 if remote.url.startswith("file://") else 0)
    assert list_steps(remote.tier()).committed == [2]
    assert_identical(tiercheck.load(remote.url, storage_options=remote.options), state)


class GatedTier(Tier):
    """Wraps a tier; writes wait until the test opens the gate."""

    def __init__(self, inner: Tier) -> None:
        self.inner = inner
        self.url = inner.url
        self.gate = threading.Event()
        self.waiting = threading.Event()

    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        self.waiting.set()
        self.gate.wait()
        self.inner.write(path, parts)

    def read(self, path: str) -> bytes | bytearray:
        return self.inner.read(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def list_dir(self, path: str = "") -> list[str]:
        return self.inner.list_dir(path)

    def publish(self, path: str, data: bytes) -> None:
        self.write(path, [data])

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def delete_tree(self, path: str) -> None:
        self.inner.delete_tree(path)

    def sync_dirs(self, path: str) -> None:
        self.inner.sync_dirs(path)


def test_a_slow_drain_never_blocks_training_and_a_backlog_skips_to_the_newest(tmp_path: Path) -> None:
    gated = GatedTier(open_tier(str(tmp_path / "remote")))
    state = make_state(0)
    with checkpointer(state, tmp_path / "local", gated, retention=RetentionOptions(keep_last=1)) as ck:
        try:
            first, later = _save_while_the_remote_is_stuck(ck, gated, state)
        finally:
            gated.gate.set()  # else close() would wait for the stuck drain forever
        assert first.drained.result(timeout=60) is True
        assert [h.drained.result(timeout=60) for h in later] == [False, False, True]
        status = ck.drain()
        assert status["skipped"] == 2
        assert ck.steps() == [4]  # drained or skipped: retention lets them go
    assert list_steps(gated.inner).committed == [1, 4]
    assert_identical(tiercheck.load(tmp_path / "remote"), make_state(4))


def _save_while_the_remote_is_stuck(
    ck: Checkpointer, gated: GatedTier, state: dict[str, Any]
) -> tuple[tiercheck.SaveHandle, list[tiercheck.SaveHandle]]:
    first = ck.save(1)
    assert gated.waiting.wait(30)  # step 1 is being drained, and stuck
    later = []
    for step in (2, 3, 4):
        set_values(state, step)
        later.append(ck.save(step))
        later[-1].wait()  # committed locally while the remote is stuck
    assert ck.steps() == [1, 2, 3, 4], "steps waiting to be drained are kept, despite keep_last=1"
    assert ck.status()["remote"]["pending"] == [2, 3, 4]
    return first, later


@pytest.mark.parametrize("kind", ["s3", "azure"])
def test_a_missing_bucket_fails_the_drain_fast_and_keeps_training(
    tmp_path: Path, request: pytest.FixtureRequest, kind: str
) -> None:
    server = request.getfixturevalue("s3_server" if kind == "s3" else "azurite_server")
    wrong = Remote(f"{'s3' if kind == 's3' else 'az'}://no-such-bucket/ckpt", server.storage_options())
    state = make_state(2)
    retention = RetentionOptions(keep_last=1)
    with checkpointer(state, tmp_path / "local", wrong, retention=retention) as ck:
        for step in (1, 2):
            handle = ck.save(step)
            handle.wait()  # committed locally regardless, and training goes on
            with pytest.raises(tiercheck.RemoteStorageError, match="no such bucket or container"):
                handle.drained.result(timeout=60)
        status = ck.status()["remote"]
        assert status["failed"] == 2 and "no-such-bucket" in status["last_error"]
        assert status["retries"] == 0, "a missing bucket is not worth retrying"
        with pytest.raises(tiercheck.RemoteStorageError, match="no-such-bucket"):
            ck.drain()
        assert ck.steps() == [1, 2], "a step whose drain failed is the only copy: retention keeps it"
    assert_identical(tiercheck.load(tmp_path / "local"), make_state(2))


def test_load_from_an_empty_remote_says_so(remote: Remote) -> None:
    with pytest.raises(tiercheck.CheckpointNotFoundError, match="holds no committed step|no checkpoint directory"):
        tiercheck.load(remote.url, storage_options=remote.options)


def test_file_url_is_a_durable_local_directory(tmp_path: Path) -> None:
    tier = open_tier(f"file://{tmp_path}")
    assert isinstance(tier, LocalTier) and tier.durable and tier.root == tmp_path


def test_drain_options_set_the_multipart_part_size(tmp_path: Path) -> None:
    drain = DrainOptions(part_bytes=64 << 20)
    opts = {"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9"}  # never contacted
    with Checkpointer({"w": torch.zeros(2)}, local=tmp_path, remote="s3://b/p", remote_options=opts, drain=drain) as ck:
        assert isinstance(ck.remote, tiercheck.tiers.remote.RemoteTier)
        assert ck.remote.part_bytes == 64 << 20


@pytest.mark.parametrize("damage", ["flip", "unreadable", "missing"])
@pytest.mark.parametrize(
    "name",
    ["COMMIT", "manifest.json", "manifest/rank-000000.json", "manifest/arrays-000000.json", "manifest/owners-000000.json"],
)
def test_a_damaged_local_manifest_file_is_read_from_the_remote_not_an_older_step(
    tmp_path: Path, name: str, damage: str
) -> None:
    """Per-tier fallback covers the manifest files as it covers chunks: the newest step is intact on
    the remote tier, so it is restored from there, never the older step."""
    remote = Remote(f"file://{tmp_path / 'remote'}", {})
    state = make_state(1)
    with checkpointer(state, tmp_path / "local", remote) as ck:
        ck.save(1)
        set_values(state, 2)
        ck.save(2)
        assert ck.drain()["failed"] == 0
    f = tmp_path / "local" / step_dir(2) / name
    if damage == "flip":
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x20
        f.write_bytes(bytes(data))
    elif damage == "unreadable":  # no permission, EIO: a directory in its place reads as neither
        f.unlink()
        f.mkdir()
    else:
        f.unlink()
    fresh = make_state(0)
    with checkpointer(fresh, tmp_path / "local", remote) as ck:
        assert ck.restore() == 2
    expected = make_state(2)
    expected["meta"]["seed"] = 2
    assert_identical(fresh, expected)
    with checkpointer(make_state(0), tmp_path / "local", None) as ck:  # no other tier: the older step
        assert ck.restore() == 1
