"""Objects moved in parts, many in flight (invariant 12), against the real servers.

A pack goes up as a multipart upload (SeaweedFS) or staged blocks and a block list (Azurite), its
chunks checked piece by piece on the way; a part that fails is sent again alone; a failure aborts
the upload and a crash's leftovers are dropped when the copy resumes, so no parts stay behind.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import tiercheck
from tests.cli import run
from tests.conftest import assert_identical
from tests.faultproxy import FaultProxy
from tests.ondisk import step_parts
from tests.servers import Azurite, SeaweedS3
from tiercheck import Checkpointer, DrainOptions, RetryOptions
from tiercheck.errors import CorruptCheckpointError
from tiercheck.format.paths import copying_marker, pack_file, step_dir
from tiercheck.format.steps import list_steps, read_marker
from tiercheck.tiering.transfer import pack_pieces
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.parts import part_upload, unfinished
from tiercheck.tiers.remote import RemoteTier

MiB = 1 << 20
PATIENT = RetryOptions(attempts=60, initial_backoff_s=0.02, max_backoff_s=0.2, deadline_s=120)
# Small parts, few in flight: a 36 MiB pack is eight parts, more than the slots, so the reader waits.
SMALL_PARTS = DrainOptions(part_bytes=5 * MiB, part_concurrency=3, retry=PATIENT)


def big_state(seed: int) -> dict[str, Any]:
    """36 MiB: six 4 MiB chunks, one of 12 MiB (read back as ranged GETs in parts), a small one."""
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(6)} | {
        "big": torch.randn(3 * MiB, generator=g),
        "b": torch.randn(77, generator=g),
    }


def parts_of_pack(local: Path, step: int = 1) -> int:
    """How many 5 MiB parts the pack of rank 0 goes up in."""
    return -(-(local / step_dir(step) / pack_file(0)).stat().st_size // (5 * MiB))


class Store:
    """A bucket or container on a real server, and what an operator would ask of it."""

    def __init__(self, kind: str, server: SeaweedS3 | Azurite, name: str, endpoint: str | None = None) -> None:
        self.kind = kind
        self.server = server
        self.name = name
        self.url = f"{'s3' if kind == 's3' else 'az'}://{name}/ckpt"
        self.options = server.storage_options(endpoint) if endpoint else server.storage_options()
        self.fs, _ = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **server.storage_options())

    def unfinished(self) -> list[str]:
        """Every upload under the prefix started and never completed, by key."""
        return sorted(u.key if hasattr(u, "key") else u.blob for u in unfinished(self.fs, f"{self.name}/ckpt", None))

    def tier(self, **kwargs: Any) -> RemoteTier:
        return RemoteTier(self.url, storage_options=self.options, retry=PATIENT, **kwargs)


@pytest.fixture(params=["s3", "azure"])
def store(request: pytest.FixtureRequest) -> Store:
    if request.param == "s3":
        server = request.getfixturevalue("s3_server")
        return Store("s3", server, request.getfixturevalue("s3_bucket"))
    server = request.getfixturevalue("azurite_server")
    return Store("azure", server, request.getfixturevalue("azure_container"))


def saved_locally(tmp_path: Path, state: dict[str, Any], step: int = 1) -> Path:
    local = tmp_path / "local"
    with Checkpointer(state, local=local) as ck:
        ck.save(step).wait()
    return local


def test_a_pack_goes_up_in_parts_and_comes_back_bit_identical(tmp_path: Path, store: Store) -> None:
    state = big_state(1)
    with Checkpointer(state, local=tmp_path / "local", remote=store.url, remote_options=store.options,
                      drain=SMALL_PARTS) as ck:  # fmt: skip
        ck.save(1)
        ck.drain()
        stats = ck.stats()
        counters = dict(ck.remote.counters)  # type: ignore[union-attr]
    assert stats["drain_part_buffer_bytes"] == 3 * 5 * MiB
    assert 0 < stats["drain_part_bytes_peak"] <= stats["drain_part_buffer_bytes"]
    assert counters["parts"] == parts_of_pack(tmp_path / "local") == 8
    assert store.unfinished() == []
    if store.kind == "s3":  # each part carried its CRC32C, which the store checked and kept
        bucket_key = f"{store.name}/ckpt/{step_dir(1)}/{pack_file(0)}"
        head = store.fs.call_s3("head_object", Bucket=store.name, Key=bucket_key.split("/", 1)[1], ChecksumMode="ENABLED")
        assert head["ChecksumCRC32C"].endswith("-8"), head
    # From the remote alone: each chunk as concurrent ranged GETs into the restore's buffers.
    fresh = big_state(2)
    with Checkpointer(fresh, local=tmp_path / "empty", remote=store.url, remote_options=store.options,
                      drain=SMALL_PARTS) as ck:  # fmt: skip
        assert ck.restore() == 1
        assert_identical(ck.state, state)
    assert_identical(tiercheck.load(store.url, storage_options=store.options), state)


def test_ranged_reads_in_parts_return_what_is_stored_and_no_more(store: Store) -> None:
    tier = store.tier(part_bytes=5 * MiB, part_concurrency=4)
    data = os.urandom(17 * MiB + 123)
    tier.write("x/blob.bin", [data])
    out = bytearray(12 * MiB)
    n, rest = tier.read_into("x/blob.bin", memoryview(out), offset=1000, length=12 * MiB + 4)
    assert (n, bytes(out), rest) == (12 * MiB, data[1000 : 1000 + 12 * MiB], data[1000 + 12 * MiB : 1004 + 12 * MiB])
    out = bytearray(12 * MiB)  # the object ends before the range does: fewer bytes, as a file ends early
    n, rest = tier.read_into("x/blob.bin", memoryview(out), offset=6 * MiB, length=20 * MiB)
    assert (n, bytes(out[:n]), rest) == (11 * MiB + 123, data[6 * MiB :], b"")
    assert bytes(tier.read_range("x/blob.bin", 7, 2**40)) == data[7:]  # a hostile length, bounded by the object


def test_a_part_that_fails_is_sent_again_alone(tmp_path: Path, s3_server: SeaweedS3, s3_bucket: str) -> None:
    local = saved_locally(tmp_path, big_state(3))
    with FaultProxy(s3_server.endpoint_url, throttle=0.2, reset=0.1, methods=("PUT",), seed=5) as proxy:
        store = Store("s3", s3_server, s3_bucket, endpoint=proxy.url)
        with Checkpointer(big_state(0), local=local, remote=store.url, remote_options=store.options,
                          drain=SMALL_PARTS) as ck:  # fmt: skip
            ck.drain()
        history = list(proxy.history)
    parts = [r for r in history if "partNumber=" in r.target]
    sent = Counter(urllib.parse.parse_qs(urllib.parse.urlsplit(r.target).query)["partNumber"][0]
                   for r in parts if r.outcome == "forwarded")  # fmt: skip
    failed = [r for r in parts if r.outcome in ("throttled", "reset")]
    assert failed, "the proxy failed no part: the test proves nothing"
    # Every part went through once: no upload started over.
    assert sent == {str(i): 1 for i in range(1, parts_of_pack(local) + 1)}
    assert sum(1 for r in history if r.method == "POST" and r.target.endswith("?uploads")) == 1
    direct = Store("s3", s3_server, s3_bucket)
    assert direct.unfinished() == []
    assert list_steps(direct.tier()).committed == [1]
    assert_identical(tiercheck.load(direct.url, storage_options=direct.options), big_state(3))


def test_a_rotten_chunk_aborts_the_upload_and_leaves_no_parts(tmp_path: Path, store: Store) -> None:
    local = saved_locally(tmp_path, big_state(4))
    spans = step_parts(local / step_dir(1))[0].spans()
    offset, nbytes, *_ = spans[-1]  # the last chunk: its parts before it are up when it is read
    pack = local / step_dir(1) / pack_file(0)
    raw = bytearray(pack.read_bytes())
    raw[offset + nbytes - 1] ^= 0x01
    pack.write_bytes(bytes(raw))
    with Checkpointer(big_state(0), local=local, remote=store.url, remote_options=store.options,
                      drain=SMALL_PARTS) as ck:  # fmt: skip
        with pytest.raises(tiercheck.RemoteStorageError):
            ck.drain()
        assert "checksum mismatch" in ck.status()["remote"]["last_error"]
        assert ck.steps() == [1]  # the local copy is kept
    assert store.unfinished() == []
    assert not store.tier().exists(f"{step_dir(1)}/{pack_file(0)}")


def test_a_crash_mid_upload_leaves_nothing_once_the_drain_resumes(tmp_path: Path, store: Store) -> None:
    local = saved_locally(tmp_path, big_state(5))
    # What a drain killed mid-upload leaves on the server: an upload begun, parts sent, never completed.
    crashed = part_upload(store.fs, f"{store.name}/ckpt/{step_dir(1)}/{pack_file(0)}")
    assert crashed is not None
    crashed.start()
    crashed.put(1, os.urandom(5 * MiB))
    assert len(store.unfinished()) == 1
    with Checkpointer(big_state(0), local=local, remote=store.url, remote_options=store.options,
                      drain=SMALL_PARTS) as ck:  # fmt: skip
        ck.drain()  # the drain the crash cut short resumes
    assert store.unfinished() == []
    assert list_steps(store.tier()).committed == [1]
    assert_identical(tiercheck.load(store.url, storage_options=store.options), big_state(5))


def test_deleting_a_step_drops_the_uploads_it_cut_short(store: Store) -> None:
    tier = store.tier()
    for name in ("a.bin", "b/c.bin"):
        up = part_upload(store.fs, f"{store.name}/ckpt/{step_dir(7)}/{name}")
        assert up is not None
        up.start()
        up.put(1, os.urandom(5 * MiB))
    other = part_upload(store.fs, f"{store.name}/ckpt/{step_dir(8)}/a.bin")
    assert other is not None
    other.start()
    other.put(1, b"x" * (5 * MiB))
    assert len(store.unfinished()) == 3
    tier.delete_tree(step_dir(7))
    assert store.unfinished() == [f"ckpt/{step_dir(8)}/a.bin"]
    other.abort()


@pytest.mark.parametrize("piece", [4096, 5000, 3 * MiB])
def test_a_pack_read_in_pieces_checks_every_chunk(tmp_path: Path, piece: int) -> None:
    """``pack_pieces`` in pieces that cut chunks anywhere: the bytes are the pack's, a flipped bit
    in any chunk stops it naming the chunk, and a pack cut short says so."""
    state = {f"v{i}": torch.randn(1000 + 37 * i) for i in range(20)} | big_state(6)
    local = saved_locally(tmp_path, state)
    tier = LocalTier(local)
    spans = step_parts(local / step_dir(1))[0].spans()
    end = spans[-1][0] + spans[-1][1] + 4
    path = f"{step_dir(1)}/{pack_file(0)}"
    whole = (local / path).read_bytes()
    got = b"".join(bytes(p) for p in pack_pieces(tier, path, spans, end, piece, "here"))
    assert got == whole[:end]
    offset, nbytes, array, key, _ = spans[7]
    rotten = bytearray(whole)
    rotten[offset + nbytes // 2] ^= 0x10
    (local / path).write_bytes(bytes(rotten))
    with pytest.raises(CorruptCheckpointError, match=f"array {array!r} chunk {key}: checksum mismatch"):
        list(pack_pieces(tier, path, spans, end, piece, "here"))
    (local / path).write_bytes(whole[: end - 10])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        list(pack_pieces(tier, path, spans, end, piece, "here"))


def test_part_concurrency_must_be_positive() -> None:
    with pytest.raises(ValueError, match="part_concurrency must be at least 1"):
        DrainOptions(part_concurrency=0)


def small_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {f"v{i}": torch.randn(500 + i, generator=g) for i in range(40)} | {"big": torch.randn(3 * MiB, generator=g)}


def test_small_chunks_come_from_the_remote_in_runs_and_a_rotten_one_falls_back(
    tmp_path: Path, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A restore from the remote alone reads the small chunks that lie together in a pack with a few
    ranged GETs (not one each), straight into their tensors; a damaged chunk among them is read again
    alone, which finds it damaged, and the restore takes the older step, whole."""
    state = small_state(1)
    with Checkpointer(state, local=tmp_path / "local", remote=store.url, remote_options=store.options,
                      drain=SMALL_PARTS) as ck:  # fmt: skip
        ck.save(1)
        for name, t in small_state(2).items():
            state[name].copy_(t)
        ck.save(2)
        ck.drain()
    fresh = small_state(0)
    with Checkpointer(fresh, local=tmp_path / "empty", remote=store.url, remote_options=store.options,
                      drain=SMALL_PARTS) as ck:  # fmt: skip
        before = ck.remote.counters["requests"]  # type: ignore[union-attr]
        assert ck.restore() == 2
        requests = ck.remote.counters["requests"] - before  # type: ignore[union-attr]
        assert ck.stats()["restore_remote_reads"] == 41
    assert_identical(fresh, small_state(2))
    assert requests < 30, requests  # 41 chunks, the manifest's files and the 12 MiB one in parts
    spans = step_parts(tmp_path / "local" / step_dir(2))[0].spans()
    offset, nbytes, array, key, _ = spans[len(spans) // 2]
    path = f"{store.name}/ckpt/{step_dir(2)}/{pack_file(0)}"
    raw = bytearray(store.fs.cat_file(path))
    raw[offset + nbytes // 2] ^= 0x01
    store.fs.pipe_file(path, bytes(raw))
    fresh = small_state(0)
    with Checkpointer(fresh, local=tmp_path / "empty2", remote=store.url, remote_options=store.options) as ck:
        assert ck.restore() == 1
    assert_identical(fresh, small_state(1))
    assert any(f"array {array!r} chunk {key}: checksum mismatch" in r.getMessage() for r in caplog.records)


def test_a_missing_bucket_is_named_and_a_failing_source_is_raised_as_it_is(store: Store) -> None:
    pieces = [os.urandom(5 * MiB) for _ in range(3)]
    gone = RemoteTier(store.url.replace(store.name, f"{store.name}-nope"), storage_options=store.options, retry=PATIENT)
    with pytest.raises(tiercheck.RemoteStorageError, match="no such bucket or container"):
        gone.write_stream("s/pack.bin", lambda: iter(pieces), size=15 * MiB)

    def vanishes() -> Any:
        yield pieces[0]
        raise FileNotFoundError("the local pack went away")

    tier = store.tier(part_bytes=5 * MiB)
    with pytest.raises(FileNotFoundError, match="the local pack went away"):
        tier.write_stream("s/pack.bin", vanishes, size=15 * MiB)
    assert not tier.exists("s/pack.bin")
    assert store.unfinished() == []


def test_a_killed_copys_temporaries_are_dropped_and_never_copied(tmp_path: Path) -> None:
    """``restore --to`` killed mid-pack leaves ``packs/.rank-000000.bin.tmp-PID-TID`` behind: the
    copy run again removes it, and a temporary in the source is no part of the step it copies."""
    from tiercheck.tiering.transfer import copy_step

    local = saved_locally(tmp_path, big_state(7))
    stray = local / step_dir(1) / "packs" / ".rank-000000.bin.tmp-1-2"
    stray.write_bytes(b"half a pack")
    dst = tmp_path / "node"
    left = dst / step_dir(1) / "packs" / ".rank-000000.bin.tmp-3-4"
    left.parent.mkdir(parents=True)
    left.write_bytes(b"what a killed copy wrote")
    copy_step(LocalTier(local), LocalTier(dst), 1)
    assert sorted(p.name for p in (dst / step_dir(1) / "packs").iterdir()) == ["rank-000000.bin"]
    restored = big_state(0)
    with Checkpointer(restored, local=dst) as ck:
        assert ck.restore() == 1
    assert_identical(restored, big_state(7))


def test_a_resumed_drain_keeps_a_pack_only_when_its_parts_checksums_match(
    tmp_path: Path, s3_server: SeaweedS3, s3_bucket: str
) -> None:
    """A drain cut short after the pack was up resumes without sending it again: S3 kept its
    parts' CRC32Cs, and they match the local pack's. Another pack of the same size there (another
    run's, copied in by hand) does not: it is sent again, never committed by its size."""
    store = Store("s3", s3_server, s3_bucket)
    local = saved_locally(tmp_path, big_state(8))
    remote = store.tier(part_bytes=5 * MiB)
    pack = f"{step_dir(1)}/{pack_file(0)}"

    def cut_short() -> None:
        """What a drain killed after the pack's upload leaves: its files, no drained marker, no COMMIT."""
        for name in remote.list_dir(step_dir(1)):
            if name.startswith("__drained") or name in ("COMMIT", "manifest.json"):
                remote.delete(f"{step_dir(1)}/{name}")

    with Checkpointer(big_state(0), local=local, remote=store.url, remote_options=store.options,
                      drain=SMALL_PARTS) as ck:  # fmt: skip
        ck.drain()
    cut_short()
    save_id = read_marker(LocalTier(local), 1).save_id
    remote.write(f"{step_dir(1)}/{copying_marker(0)}", [json.dumps({"save_id": save_id}).encode()])
    with Checkpointer(big_state(0), local=local, remote=store.url, remote_options=store.options,
                      drain=SMALL_PARTS) as ck:  # fmt: skip
        assert ck.drain()["files_already_there"] == 1  # the pack, by its parts' checksums
    cut_short()
    remote.write(f"{step_dir(1)}/{copying_marker(0)}", [json.dumps({"save_id": save_id}).encode()])
    size = (local / pack).stat().st_size
    other = os.urandom(size)
    remote.write_stream(pack, lambda: iter([other[i : i + 5 * MiB] for i in range(0, size, 5 * MiB)]), size=size)
    with Checkpointer(big_state(0), local=local, remote=store.url, remote_options=store.options,
                      drain=SMALL_PARTS) as ck:  # fmt: skip
        assert ck.drain()["files_already_there"] == 0  # same size, other bytes: sent again
    assert_identical(tiercheck.load(store.url, storage_options=store.options), big_state(8))


def test_a_resumed_copy_into_a_directory_reads_back_what_it_keeps(tmp_path: Path) -> None:
    """``restore --to`` run again after a cut: the pack left there is read back and checked against
    the manifest; one with a flipped bit (same size) is copied again, never committed."""
    from tiercheck.format.paths import COMMIT_FILE
    from tiercheck.tiering.transfer import copy_step

    local = saved_locally(tmp_path, big_state(9))
    save_id = read_marker(LocalTier(local), 1).save_id
    dst = tmp_path / "node"

    def cut_short() -> None:
        (dst / step_dir(1) / COMMIT_FILE).unlink()
        (dst / step_dir(1) / copying_marker(0)).write_text(json.dumps({"save_id": save_id}))

    copy_step(LocalTier(local), LocalTier(dst), 1)
    cut_short()
    assert copy_step(LocalTier(local), LocalTier(dst), 1).files_already_there == 1  # the pack, checked
    cut_short()
    spans = step_parts(local / step_dir(1))[0].spans()
    raw = bytearray((dst / step_dir(1) / pack_file(0)).read_bytes())
    raw[spans[3][0] + 5] ^= 0x04
    (dst / step_dir(1) / pack_file(0)).write_bytes(bytes(raw))
    assert copy_step(LocalTier(local), LocalTier(dst), 1).files_already_there == 0  # sent again
    restored = big_state(0)
    with Checkpointer(restored, local=dst) as ck:
        assert ck.restore() == 1
    assert_identical(restored, big_state(9))


def test_restore_to_with_verify_replaces_a_damaged_committed_copy(tmp_path: Path) -> None:
    local = saved_locally(tmp_path, big_state(10))
    dst = tmp_path / "node"
    cli = ["restore", str(local), "--to", str(dst), "--verify"]
    run(*cli)
    spans = step_parts(local / step_dir(1))[0].spans()
    raw = bytearray((dst / step_dir(1) / pack_file(0)).read_bytes())
    raw[spans[2][0] + 9] ^= 0x20
    (dst / step_dir(1) / pack_file(0)).write_bytes(bytes(raw))
    again = run(*cli)
    assert "damaged" in again.stderr and "copying it again" in " ".join(again.stderr.split())
    assert f"ok: step 1 intact in {dst}" in " ".join(again.stdout.split())
    assert_identical(tiercheck.load(str(dst)), big_state(10))


def test_restore_to_of_a_damaged_newest_step_names_the_step_restore_would_use(tmp_path: Path) -> None:
    local = tmp_path / "local"
    state = big_state(11)
    with Checkpointer(state, local=local) as ck:
        ck.save(1)
        ck.save(2)
    pack = local / step_dir(2) / pack_file(0)
    pack.write_bytes(pack.read_bytes()[: 5 * MiB])  # cut short
    cli = ["restore", str(local), "--to", str(tmp_path / "node")]
    done = run(*cli, check=False)
    said = " ".join(done.stderr.split())  # as one line, however the console wrapped it
    assert done.returncode == 1
    assert "restore() would fall back to step 1" in said and "--step 1" in said, said
    run(*cli, "--step", "1")
    assert_identical(tiercheck.load(str(tmp_path / "node"), step=1), big_state(11))


def test_a_big_write_and_a_big_piece_go_in_parts_of_the_part_size(store: Store) -> None:
    """``write`` of an object of several parts, and a stream whose one piece is several parts, are
    cut into ``part_bytes`` parts (S3 takes none over 5 GiB), and read back whole."""
    tier = store.tier(part_bytes=5 * MiB)
    data = os.urandom(13 * MiB + 7)
    tier.write("w/one.bin", [data])
    tier.write_stream("w/two.bin", lambda: iter([data[: 11 * MiB], data[11 * MiB :]]), size=len(data))
    assert tier.read_bytes("w/one.bin") == data == tier.read_bytes("w/two.bin")
    assert tier.counters["parts"] == 6  # 5 + 5 + 3 MiB each
    if store.kind == "s3":
        head = store.fs.call_s3("head_object", Bucket=store.name, Key="ckpt/w/one.bin", ChecksumMode="ENABLED")
        assert head["ChecksumCRC32C"].endswith("-3"), head
