"""One contract, every tier: a local directory, a file:// URL, S3 (SeaweedFS) and Azure (Azurite)."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import pytest

from tiercheck.errors import UnsafeCheckpointError
from tiercheck.format.codec import seal
from tiercheck.format.commit import commit_step, withdraw_step
from tiercheck.format.manifest import ManifestIndex, RankPart
from tiercheck.format.paths import part_file
from tiercheck.format.saveid import new_save_id
from tiercheck.format.steps import list_steps, read_manifest
from tiercheck.options import RetryOptions
from tiercheck.tiers.base import Tier
from tiercheck.tiers.local import PIECE_BYTES, LocalTier
from tiercheck.tiers.remote import RemoteTier, open_tier


@pytest.fixture(params=["local", "file", "s3", "azure"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    # The contract is what a tier does, not how it retries: ride out a loaded server's passing
    # InternalError (SeaweedFS answers one now and then on 2 busy cores) as a real job would.
    retry = RetryOptions(attempts=10, initial_backoff_s=0.05, max_backoff_s=1.0, deadline_s=20)
    if request.param == "local":
        t = LocalTier(tmp_path / "tier", fsync=True)
        t.create()
        return t
    if request.param == "file":
        return open_tier(f"file://{tmp_path / 'tier'}")
    if request.param == "s3":
        server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        return RemoteTier(f"s3://{bucket}/p", storage_options=server.storage_options(), retry=retry, part_bytes=5 << 20)
    server = request.getfixturevalue("azurite_server")
    container = request.getfixturevalue("azure_container")
    return RemoteTier(f"az://{container}/p", storage_options=server.storage_options(), retry=retry, part_bytes=5 << 20)


def test_write_then_read_back_concatenated_parts(tier: Tier) -> None:
    tier.write("a/b/c.0", [b"hello ", bytearray(b"wide "), memoryview(b"world")])
    assert bytes(tier.read("a/b/c.0")) == b"hello wide world"
    assert tier.read_bytes("a/b/c.0") == b"hello wide world"
    tier.write("a/b/c.0", [b"replaced"])
    assert bytes(tier.read("a/b/c.0")) == b"replaced"
    # copies between tiers move files as read_bytes gives them: immutable bytes, written as they are
    data = tier.read_bytes("a/b/c.0")
    assert type(data) is bytes and data == b"replaced"
    tier.write("a/copy", [data])
    assert tier.read_bytes("a/copy") == b"replaced"


def test_large_objects_go_up_in_parts_and_come_back_whole(tier: Tier) -> None:
    data = os.urandom(11 << 20)  # over two 5 MiB parts on the remote tiers: a multipart upload
    tier.write("big/c.0", [memoryview(data)[:100], memoryview(data)[100:]])
    assert bytes(tier.read("big/c.0")) == data
    assert tier.read_bytes("big/c.0") == data
    tier.write("big/c.1", [data])  # one bytes part, in parts on the remote tiers
    assert tier.read_bytes("big/c.1") == data
    assert tier.sizes("big") == {"c.0": len(data), "c.1": len(data)}


def test_byte_ranges_read_back_exactly_and_stop_at_the_end(tier: Tier) -> None:
    data = os.urandom(3000)
    tier.write("packs/rank-000000.bin", [data])
    assert bytes(tier.read_range("packs/rank-000000.bin", 100, 50)) == data[100:150]
    assert bytes(tier.read_range("packs/rank-000000.bin", 2990, 50)) == data[2990:]  # short at the end
    out = bytearray(40)
    n, rest = tier.read_into("packs/rank-000000.bin", memoryview(out), offset=1000, length=44)
    assert (n, bytes(out), rest) == (40, data[1000:1040], data[1040:1044])
    n, rest = tier.read_into("packs/rank-000000.bin", memoryview(out), offset=2980, length=44)
    assert (n, bytes(out[:n]), rest) == (20, data[2980:], b"")  # a truncated file: fewer bytes, no error
    with pytest.raises(FileNotFoundError):
        tier.read_range("packs/nope.bin", 0, 1)


def test_a_vectored_read_passes_every_byte_it_read_to_each_in_file_order(tier: Tier) -> None:
    data = os.urandom(3000)
    tier.write("packs/rank-000000.bin", [data])
    views = [memoryview(bytearray(n)) for n in (1000, 0, 1500, 1000)]  # the last runs past the end
    pieces: list[bytes] = []
    n, _ = tier.read_vectored("packs/rank-000000.bin", 100, views, each=lambda p: pieces.append(bytes(p)))
    assert n == 2900
    assert b"".join(bytes(v) for v in views)[:n] == data[100:]
    assert b"".join(pieces) == data[100:], "each byte read once, in order, and no byte past the end"


def test_a_local_vectored_read_checked_as_it_lands_reads_in_pieces_of_piece_bytes(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path / "tier")
    data = os.urandom(3 * PIECE_BYTES + 5)
    tier.write("p.bin", [data])
    views = [memoryview(bytearray(PIECE_BYTES // 2)), memoryview(bytearray(len(data) - PIECE_BYTES // 2))]
    pieces: list[bytes] = []
    assert tier.read_vectored("p.bin", 0, views, each=lambda p: pieces.append(bytes(p)))[0] == len(data)
    assert b"".join(pieces) == data
    assert max(len(p) for p in pieces) <= PIECE_BYTES and len(pieces) >= 4


@pytest.mark.parametrize("offset", [0, 2990, 10**9])
def test_a_length_far_beyond_the_file_allocates_only_what_is_stored(tier: Tier, offset: int) -> None:
    """A length from a hostile manifest (a chunk of 2**40 bytes in a pack of 3000): what comes back,
    and every buffer made on the way, is sized by the file, never by the length asked for."""
    data = os.urandom(3000)
    tier.write("packs/rank-000000.bin", [data])
    out = bytearray(4096)
    tracemalloc.start()
    try:
        n, rest = tier.read_into("packs/rank-000000.bin", memoryview(out), offset=offset, length=2**40)
        short = tier.read_range("packs/rank-000000.bin", offset, 2**40)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (bytes(out[:n]), rest, bytes(short)) == (data[offset:], b"", data[offset:])
    assert peak < 1 << 20, peak


def test_a_stream_is_written_whole_or_not_at_all(tier: Tier) -> None:
    pieces = [os.urandom(3 << 20) for _ in range(4)]  # 12 MiB: more than two 5 MiB parts on the remote tiers
    tier.write_stream("s/pack.bin", lambda: iter(pieces))
    assert tier.read_bytes("s/pack.bin") == b"".join(pieces)

    class Rotten(Exception):
        pass

    def fails_half_way() -> object:
        yield pieces[0]
        yield pieces[1]
        raise Rotten("a chunk failed its checksum")

    with pytest.raises(Rotten):
        tier.write_stream("s/other.bin", fails_half_way)  # type: ignore[arg-type]
    assert not tier.exists("s/other.bin")  # the upload was abandoned, the temporary file removed
    assert tier.list_dir("s") == ["pack.bin"]


def test_missing_files_and_directories(tier: Tier) -> None:
    with pytest.raises(FileNotFoundError):
        tier.read("nope/c.0")
    with pytest.raises(FileNotFoundError):
        tier.read_bytes("nope/c.0")
    assert not tier.exists("nope/c.0")
    assert tier.list_dir("nope") == []
    assert tier.sizes("nope") == {}
    tier.delete("nope/c.0")  # no error when already gone
    tier.delete_tree("nope")


def test_listing_names_direct_children_only(tier: Tier) -> None:
    for path in ("s/x/c.0", "s/x/c.1", "s/y/zarr.json", "s/top"):
        tier.write(path, [b"1"])
    assert tier.list_dir("s") == ["top", "x", "y"]
    assert tier.list_dir("s/x") == ["c.0", "c.1"]
    assert tier.sizes("s") == {"x/c.0": 1, "x/c.1": 1, "y/zarr.json": 1, "top": 1}


def test_publish_delete_and_delete_tree(tier: Tier) -> None:
    tier.write("d/data", [b"x" * 10])
    tier.publish("d/MARK", b"marker")
    assert tier.exists("d/MARK") and bytes(tier.read("d/MARK")) == b"marker"
    tier.delete("d/MARK")
    assert not tier.exists("d/MARK") and tier.exists("d/data")
    tier.delete_tree("d")
    assert tier.list_dir("d") == [] and not tier.exists("d/data")


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../../x", "a\\b"])
def test_paths_cannot_leave_the_root(tier: Tier, path: str) -> None:
    with pytest.raises(UnsafeCheckpointError):
        tier.write(path, [b"x"])
    with pytest.raises(UnsafeCheckpointError):
        tier.read(path)
    with pytest.raises(UnsafeCheckpointError):
        tier.read_bytes(path)


def test_the_commit_protocol_works_on_every_tier(tier: Tier) -> None:
    save = new_save_id("run", 7, 0)
    manifest = ManifestIndex(
        step=7, library_version="t", created_unix=0.0, world_size=1, nodes=1, save_id=save
    ).to_bytes()
    tier.write(f"step-00000007/{part_file(0)}", [seal(RankPart({}, {}, {}, {}, save).to_bytes())])
    tier.write("step-00000008/zarr.json", [b"{}"])  # never committed
    commit_step(tier, 7, manifest, save_id=save)
    listing = list_steps(tier)
    assert (listing.committed, listing.partial) == ([7], [8])
    assert read_manifest(tier, 7).step == 7
    withdraw_step(tier, 7)
    assert list_steps(tier).committed == []
