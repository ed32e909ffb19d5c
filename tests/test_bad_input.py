"""Bad input gets a clear error naming what is wrong, and nothing committed is lost (invariant 5)."""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import subprocess
import sys
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import tiercheck
from tests.cli import run
from tests.conftest import assert_identical
from tests.ondisk import chunk_span, flip_chunk_byte, resign_index
from tiercheck import Checkpointer, WriteOptions
from tiercheck.cli import main
from tiercheck.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleStateError,
    TiercheckError,
    UnsupportedValueError,
)
from tiercheck.format.codec import STORAGE_DTYPES, checksum, seal, unseal
from tiercheck.format.layout import chunk_at
from tiercheck.format.paths import part_file, shard_file
from tiercheck.format.steps import read_manifest
from tiercheck.restore.read import read_chunk
from tiercheck.tiering.transfer import copy_step
from tiercheck.tiering.upload import upload_step
from tiercheck.tiers.local import LocalTier


def saved(ckpt_dir: Path, step: int = 3) -> dict[str, torch.Tensor]:
    state = {"model": {"w": torch.randn(64, 64), "b": torch.randn(64)}}
    with Checkpointer(state, local=ckpt_dir, write=WriteOptions(chunk_bytes=4096)) as ck:
        ck.save(step).wait()
    return state["model"]


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_byte_in_a_chunk_names_step_array_and_chunk(ckpt_dir: Path) -> None:
    saved(ckpt_dir)
    flip_chunk_byte(ckpt_dir / "step-00000003", "model/w", "c.2.0", 100)
    with pytest.raises(CorruptCheckpointError, match=r"step 3: array 'model/w' chunk c\.2\.0: checksum mismatch"):
        tiercheck.load(ckpt_dir)
    live = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}}
    with Checkpointer(live, local=ckpt_dir) as ck, pytest.raises(ValueError, match="checksum mismatch"):
        ck.restore()


def test_flipped_checksum_trailer_and_truncated_chunk_are_caught(ckpt_dir: Path) -> None:
    saved(ckpt_dir)
    flip_chunk_byte(ckpt_dir / "step-00000003", "model/b", "c.0", -1)
    with pytest.raises(CorruptCheckpointError, match="model/b.*checksum mismatch"):
        tiercheck.load(ckpt_dir)
    pack, offset, _ = chunk_span(ckpt_dir / "step-00000003", "model/b", "c.0")
    pack.write_bytes(pack.read_bytes()[: offset + 10])
    with pytest.raises(CorruptCheckpointError, match="model/b.*truncated"):
        tiercheck.load(ckpt_dir)
    pack.unlink()
    with pytest.raises(CorruptCheckpointError, match=r"step 3: array .* pack file is missing"):  # every chunk is in it
        tiercheck.load(ckpt_dir)


def test_a_flipped_byte_in_an_edge_chunks_padding_is_caught(ckpt_dir: Path) -> None:
    # 10 rows of 1024 fp32 in chunks of 4 rows: the last chunk holds 2 rows, then 2 rows of padding.
    # Restore reads the 2 rows straight into the tensor and checks the padding with the checksum.
    state = {"w": torch.randn(10, 1024)}
    with Checkpointer(state, local=ckpt_dir, write=WriteOptions(chunk_bytes=4 * 4096)) as ck:
        ck.save(1).wait()
    assert_identical(tiercheck.load(ckpt_dir), state)
    flip_chunk_byte(ckpt_dir / "step-00000001", "w", "c.2.0", 2 * 4096 + 5)
    live = {"w": torch.zeros(10, 1024)}
    with (
        Checkpointer(live, local=ckpt_dir) as ck,
        pytest.raises(CorruptCheckpointError, match=r"w.*c\.2\.0: checksum mismatch"),
    ):
        ck.restore()


def test_damaged_manifest_and_marker_are_reported_not_parsed(ckpt_dir: Path) -> None:
    saved(ckpt_dir)
    manifest = ckpt_dir / "step-00000003/manifest.json"
    original = manifest.read_bytes()
    flip_byte(manifest, 40)
    with pytest.raises(CorruptCheckpointError, match=r"step 3: manifest.json is damaged"):
        tiercheck.load(ckpt_dir)
    manifest.write_bytes(original)
    (ckpt_dir / "step-00000003/COMMIT").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match=r"step 3: commit marker is damaged"):
        tiercheck.load(ckpt_dir)


def test_an_index_without_its_world_size_is_reported_not_parsed(ckpt_dir: Path) -> None:
    saved(ckpt_dir)
    rewrite_manifest(ckpt_dir, 3, lambda doc: doc.pop("world_size"))
    with pytest.raises(CorruptCheckpointError, match=r"step 3: malformed manifest \(KeyError\('world_size'\)\)"):
        tiercheck.load(ckpt_dir)
    live = {"model": {}}
    with Checkpointer(live, local=ckpt_dir) as ck, pytest.raises(CorruptCheckpointError, match="malformed manifest"):
        ck.restore(strict=False)


def test_a_damaged_manifest_part_is_reported_not_parsed(ckpt_dir: Path) -> None:
    saved(ckpt_dir)
    for name in (part_file(0), shard_file(0)):
        part = ckpt_dir / "step-00000003" / name
        original = part.read_bytes()
        flip_byte(part, 10)
        with pytest.raises(CorruptCheckpointError, match=rf"step 3: {name}: checksum mismatch"):
            tiercheck.load(ckpt_dir)
        with Checkpointer({"model": {}}, local=ckpt_dir) as ck, pytest.raises(CorruptCheckpointError, match=name):
            ck.restore(strict=False)
        part.write_bytes(original[:2])
        with pytest.raises(CorruptCheckpointError, match=rf"{name}: truncated"):
            tiercheck.load(ckpt_dir)
        part.write_bytes(original)
    assert tiercheck.load(ckpt_dir)["model"]


def test_a_chunk_larger_than_its_array_is_refused_before_a_buffer_is_sized_from_it(ckpt_dir: Path) -> None:
    saved(ckpt_dir)
    shard = ckpt_dir / "step-00000003" / shard_file(0)
    doc = json.loads(unseal(shard.read_bytes(), where="test"))
    doc["arrays"]["model/b"]["chunks"] = [1 << 40]  # 4 TiB of float32 for a 64-element array
    shard.write_bytes(seal(json.dumps(doc).encode()))
    with pytest.raises(CorruptCheckpointError, match=r"array 'model/b': chunk \[1099511627776\] is larger than"):
        tiercheck.load(ckpt_dir)
    live = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}}
    with Checkpointer(live, local=ckpt_dir) as ck, pytest.raises(CorruptCheckpointError, match="larger than"):
        ck.restore()
    assert not live["model"]["b"].any() and not live["model"]["w"].any(), "the live state is untouched"


def test_missing_step_and_missing_directory(ckpt_dir: Path, tmp_path: Path) -> None:
    saved(ckpt_dir)
    with pytest.raises(CheckpointNotFoundError, match=r"step 7 is not committed .*committed: 3"):
        tiercheck.load(ckpt_dir, step=7)
    with Checkpointer({"x": torch.zeros(1)}, local=ckpt_dir) as ck, pytest.raises(FileNotFoundError, match="step 7"):
        ck.restore(7)
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint directory"):
        tiercheck.load(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointNotFoundError, match="holds no committed step"):
        tiercheck.load(empty)
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(NotADirectoryError):
        Checkpointer({}, local=afile)


@pytest.mark.parametrize(
    ("live", "message"),
    [
        ({"w": torch.zeros(64, 32), "b": torch.zeros(64)}, r"model/w: checkpoint has float32\[64, 64\], the state .* has float32\[64, 32\]"),
        ({"w": torch.zeros(64, 64, dtype=torch.float64), "b": torch.zeros(64)}, r"model/w: checkpoint has float32\[64, 64\], .* float64\[64, 64\]"),
    ],
)  # fmt: skip
def test_incompatible_shapes_or_dtypes_are_refused_before_anything_is_overwritten(
    ckpt_dir: Path, live: dict[str, torch.Tensor], message: str
) -> None:
    saved(ckpt_dir)
    before = {k: v.clone() for k, v in live.items()}
    with Checkpointer({"model": live}, local=ckpt_dir) as ck, pytest.raises(IncompatibleStateError, match=message):
        ck.restore()
    assert_identical(before, live)


@pytest.mark.parametrize(
    ("saved", "live", "message"),
    [
        (np.arange(100, dtype=np.int16), np.zeros(100, dtype=object), r"n/0: checkpoint has int16\[100\], .* numpy array of object\[100\]"),
        (np.arange(100, dtype=np.int16), np.zeros(100, dtype="U3"), r"n/0: checkpoint has int16\[100\], .* numpy array of <U3\[100\]"),
        (np.arange(100, dtype=np.int16), np.zeros(50, dtype=np.int16), r"n/0: checkpoint has int16\[100\], .* numpy array of int16\[50\]"),
        (np.arange(100, dtype=np.int16), np.zeros(100, dtype=np.int32), r"n/0: checkpoint has int16\[100\], .* numpy array of int32\[100\]"),
        (torch.arange(100, dtype=torch.int16), np.zeros(100, dtype=np.int32), r"n/0: checkpoint has int16\[100\], .* numpy array of int32\[100\]"),
        (np.arange(100, dtype=np.int16), torch.zeros(100, dtype=torch.int32), r"n/0: checkpoint has int16\[100\], the state to restore into has int32\[100\]"),
        (np.arange(100, dtype=np.int16), np.zeros(100, dtype=">i2"), r"n/0: checkpoint has int16\[100\], .* numpy array of >i2\[100\]"),
    ],
    ids=["object array", "str array", "shape", "dtype", "tensor saved", "array saved", "byte order"],
)  # fmt: skip
def test_a_numpy_array_or_tensor_that_does_not_fit_is_refused_before_anything_is_overwritten(
    ckpt_dir: Path, saved: Any, live: Any, message: str
) -> None:
    with Checkpointer({"w": torch.arange(8.0), "n": [saved]}, local=ckpt_dir) as ck:
        ck.save(1).wait()
    state: dict[str, Any] = {"w": torch.zeros(8), "n": [live]}
    before = live.copy() if isinstance(live, np.ndarray) else live.clone()
    with Checkpointer(state, local=ckpt_dir) as ck, pytest.raises(IncompatibleStateError, match=message):
        ck.restore()
    assert state["n"][0] is live and type(live) is type(before) and (live == before).all()
    assert torch.equal(state["w"], torch.zeros(8))


def test_a_numpy_array_of_the_other_byte_order_is_saved_by_its_values(ckpt_dir: Path) -> None:
    """Legal input, not a raw ValueError from torch: a big-endian array is stored as its values."""
    values = np.arange(-50, 50, dtype=">i2").reshape(10, 10)[:, ::2]  # not contiguous either
    with Checkpointer({"n": values}, local=ckpt_dir) as ck:
        ck.save(1).wait()
    loaded = tiercheck.load(ckpt_dir)["n"]
    assert isinstance(loaded, np.ndarray) and loaded.dtype == np.int16 and (loaded == values).all()


def test_missing_keys_and_tensors_are_named(ckpt_dir: Path) -> None:
    saved(ckpt_dir)
    with (
        Checkpointer({"model": {}, "optimizer": {}}, local=ckpt_dir) as ck,
        pytest.raises(IncompatibleStateError, match=r"no entry for 'optimizer' \(it holds: 'model'\)"),
    ):
        ck.restore()
    module = torch.nn.Linear(64, 64)  # has weight and bias; the checkpoint has w and b
    with (
        Checkpointer({"model": module}, local=ckpt_dir) as ck,
        pytest.raises(IncompatibleStateError, match="missing from the checkpoint: model/weight, model/bias"),
    ):
        ck.restore()
    with Checkpointer({"model": {"w": torch.zeros(64, 64)}}, local=ckpt_dir) as ck:
        ck.restore(strict=False)  # non-strict: what the checkpoint has is restored


def test_bad_arguments(ckpt_dir: Path) -> None:
    with Checkpointer({"x": torch.zeros(1)}, local=ckpt_dir) as ck:
        for bad in (-1, 1.5, True, "3"):
            with pytest.raises(ValueError, match="non-negative int"):
                ck.save(bad)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="closed"):
        ck.save(1)
    with pytest.raises(TypeError, match="mapping"):
        Checkpointer([torch.zeros(1)], local=ckpt_dir)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode"):
        tiercheck.StagingOptions(mode="fast")  # type: ignore[arg-type]


def test_a_manifest_from_a_newer_format_is_refused_clearly(ckpt_dir: Path) -> None:
    saved(ckpt_dir)
    rewrite_manifest(ckpt_dir, 3, lambda doc: doc.update(format_version=99))
    with pytest.raises(CorruptCheckpointError, match="format version 99 is newer"):
        tiercheck.load(ckpt_dir)
    assert issubclass(CorruptCheckpointError, TiercheckError)


def test_a_step_of_an_older_format_is_refused_by_every_reader_and_kept(ckpt_dir: Path, tmp_path: Path) -> None:
    """This library reads its own format only: a step whose index states an older one is refused
    by restore, load, verify, inspect, ls, a copy and a drain, each with the one error naming the
    step, the file, both formats and what to do; the failed restore leaves the live state as it
    was, and nothing (a Checkpointer's start, gc) deletes the step."""
    saved(ckpt_dir)
    step = ckpt_dir / "step-00000003"
    index = json.loads((step / "manifest.json").read_bytes())
    index["format_version"] = 4
    del index["save_id"]  # as format 4 wrote them: neither names a save
    marker = json.loads((step / "COMMIT").read_bytes())
    del marker["save_id"]
    (step / "COMMIT").write_text(json.dumps(marker))
    resign_index(step, json.dumps(index).encode())
    files = {p: p.read_bytes() for p in step.rglob("*") if p.is_file()}
    said = (
        f"{LocalTier(ckpt_dir).url}: step 3: manifest.json: manifest format version 4 is older than this tiercheck "
        f"reads (5 only; the step was written by tiercheck {tiercheck.__version__}): restore it with the tiercheck "
        "that wrote it and save it again, or delete the step"
    )
    exactly = f"^{re.escape(said)}$"
    with pytest.raises(CorruptCheckpointError, match=exactly):
        tiercheck.load(ckpt_dir)
    live = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}}
    with (
        Checkpointer(live, local=ckpt_dir) as ck,
        pytest.raises(CorruptCheckpointError, match=f"^{re.escape(said)} \\(no older committed step is whole"),
    ):
        ck.restore()
    assert not live["model"]["w"].any() and not live["model"]["b"].any()
    with pytest.raises(CorruptCheckpointError, match=exactly):
        copy_step(LocalTier(ckpt_dir), LocalTier(tmp_path / "copy"), 3)
    with ThreadPoolExecutor(1) as pool, pytest.raises(CorruptCheckpointError, match=exactly):
        upload_step(LocalTier(ckpt_dir), LocalTier(tmp_path / "remote"), 3, pool=pool)
    assert not (tmp_path / "remote" / "step-00000003").exists()
    runner = CliRunner()
    for command in ("verify", "inspect", "restore"):
        more = ["--to", str(tmp_path / "to")] if command == "restore" else []
        result = runner.invoke(main, [command, str(ckpt_dir), *more])
        assert result.exit_code == 1 and said.split(": ", 1)[1] in result.output, result.output
    listed = runner.invoke(main, ["ls", str(ckpt_dir), "--json"])
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.output)["steps"][0]["tiers"][str(ckpt_dir)] == {"status": "damaged", "error": said}
    kept = runner.invoke(main, ["gc", str(ckpt_dir), "--keep-last", "1", "--grace-hours", "0"])
    assert kept.exit_code == 0 and "kept committed step(s): 3" in kept.output, kept.output
    assert {p: p.read_bytes() for p in step.rglob("*") if p.is_file()} == files
def rewrite_manifest(ckpt_dir: Path, step: int, edit: object) -> None:
    """Edit a single-rank step's manifest and re-sign it, as an attacker with write access could.

    ``edit`` sees the step as one document (the index's fields, ``arrays`` with their checksums,
    ``trees``); it is written back as the index, rank part and arrays file, each re-sealed, and the
    commit marker re-signed."""
    d = ckpt_dir / f"step-{step:08d}"
    doc = json.loads((d / "manifest.json").read_bytes())
    part = json.loads(unseal((d / part_file(0)).read_bytes(), where="test"))
    shard = json.loads(unseal((d / shard_file(0)).read_bytes(), where="test"))["arrays"]
    for path, rec in shard.items():
        rec["crc32c"] = part["crc32c"].get(path, {})
    doc.update(arrays=shard, trees=[part["tree"]])
    edit(doc)  # type: ignore[operator]
    arrays, trees = doc.pop("arrays"), doc.pop("trees")
    crcs = {path: rec.pop("crc32c") for path, rec in arrays.items()}
    save = {"save_id": part["save_id"]}  # the save's own id, as every file of the step names it
    new_part = {**save, "tree": trees[0], "crc32c": crcs}
    offsets = part.get("offset") or {}
    if offsets and all(k in offsets.get(p, {}) for p, by_key in crcs.items() for k in by_key):  # the chunks stay
        new_part.update(offset={p: {k: offsets[p][k] for k in by_key} for p, by_key in crcs.items()})
        new_part.update(nbytes={p: part["nbytes"][p] for p in crcs})
    (d / part_file(0)).write_bytes(seal(json.dumps(new_part).encode()))
    (d / shard_file(0)).write_bytes(seal(json.dumps({**save, "arrays": arrays}).encode()))
    data = json.dumps(doc).encode()
    (d / "manifest.json").write_bytes(data)
    marker = {"format": "tiercheck", "step": step, "manifest_crc32c": checksum(data), "manifest_size": len(data), **save}
    (d / "COMMIT").write_text(json.dumps(marker))


def test_a_stray_file_named_like_a_step_does_not_stop_a_checkpointer(ckpt_dir: Path) -> None:
    model = saved(ckpt_dir)
    (ckpt_dir / "step-00000009").write_text("not a step")
    live = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}}
    with Checkpointer(live, local=ckpt_dir) as ck:  # the stray file is a partial step: removed
        assert ck.restore() == 3
        assert ck.steps() == [3]
    assert torch.equal(live["model"]["w"], model["w"])
    assert not (ckpt_dir / "step-00000009").exists()


def test_metadata_round_trips_nan_and_infinities(ckpt_dir: Path) -> None:
    import math

    from tiercheck.format.steps import read_manifest
    from tiercheck.tiers.local import LocalTier

    meta = {"loss": math.nan, "grad_norm": math.inf, "lows": [-math.inf, 1.5], "epoch": 3, "note": None}
    with Checkpointer({"w": torch.zeros(4)}, local=ckpt_dir) as ck:
        ck.save(1, metadata=meta).wait()  # a diverging loss does not stop the save
        ck.save(2, metadata={"loss": 0.5}).wait()
    got = read_manifest(LocalTier(ckpt_dir), 1).metadata
    assert isinstance(got, dict) and math.isnan(got["loss"])
    assert {k: v for k, v in got.items() if k != "loss"} == {k: v for k, v in meta.items() if k != "loss"}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"t": torch.zeros(1)}, r"metadata\['t'\]: a Tensor cannot be stored as metadata \(a tensor or numpy value"),
        ({"n": np.float32(1.5)}, r"metadata\['n'\]: a float32 cannot be stored as metadata \(a tensor or numpy"),
        ({"s": {1, 2}}, r"metadata\['s'\]: a set cannot be stored as metadata"),
        ({"b": b"x"}, r"metadata\['b'\]: a bytes cannot be stored as metadata"),
        ({"xs": [(1, 2)]}, r"metadata\['xs'\]\[0\]: a tuple cannot be stored .*pass a list"),
        ({1: "a"}, r"metadata: key 1 is not a string"),
        ({"$float": "nan"}, r"metadata: a dict whose only key is '\$float' is reserved"),
        ({"log": "x" * (16 << 20)}, r"metadata is 16,777,227 bytes as JSON; keep it under 16,777,216"),
        (json.loads('{"a":' * 70 + "1" + "}" * 70), r"metadata\['a'\].*: metadata nested deeper than 64 levels"),
    ],
)
def test_metadata_that_would_not_round_trip_is_refused_before_anything_is_written(
    ckpt_dir: Path, bad: dict[Any, Any], message: str
) -> None:
    with Checkpointer({"w": torch.zeros(4)}, local=ckpt_dir) as ck:
        with pytest.raises(tiercheck.UnsupportedValueError, match=message):
            ck.save(1, metadata=bad)
        assert list(ckpt_dir.glob("step-*")) == []
        ck.save(1, metadata={"ok": True}).wait()  # the refused save poisons nothing
        assert ck.steps() == [1]


def _edit_shard(ckpt_dir: Path, path: str, field: str, value: object) -> None:
    shard = ckpt_dir / "step-00000003" / shard_file(0)
    doc = json.loads(unseal(shard.read_bytes(), where="test"))
    doc["arrays"][path][field] = value
    shard.write_bytes(seal(json.dumps(doc).encode()))


def _agree_with_shard(ckpt_dir: Path, path: str) -> None:
    """Make the rest of step 3 say what its arrays file (edited by ``_edit_shard``) says of ``path``,
    as a forger re-sealing every file would: its writer's part sizes its chunks so (``nbytes``), and
    its reference map's ``zarr.json`` gives that dtype, shape and chunks. What is left to refuse the
    record is the bytes the packs hold."""
    step = ckpt_dir / "step-00000003"
    rec = json.loads(unseal((step / shard_file(0)).read_bytes(), where="test"))["arrays"][path]
    part = step / part_file(0)
    doc = json.loads(unseal(part.read_bytes(), where="test"))
    doc["nbytes"][path] = STORAGE_DTYPES[rec["dtype"]][1] * math.prod(rec["chunks"])
    part.write_bytes(seal(json.dumps(doc).encode()))
    refs = step / "refs" / "rank-000000.json"
    doc = json.loads(refs.read_bytes())
    array = json.loads(doc["refs"][f"{path}/zarr.json"])
    array.update(shape=rec["shape"], data_type=STORAGE_DTYPES[rec["dtype"]][0])
    array["chunk_grid"]["configuration"]["chunk_shape"] = rec["chunks"]
    array["attributes"]["tiercheck"]["dtype"] = rec["dtype"]
    doc["refs"][f"{path}/zarr.json"] = json.dumps(array)
    refs.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("chunks", [10**400], r"array 'model/b': chunk \[1000.*\] is larger than the array \[64\]"),
        ("shape", [10**13, 64], r"array 'model/w': shape \[10000000000000, 64\] is beyond any tensor"),
        ("shape", [2**63], r"array 'model/b': shape \[9223372036854775808\] is beyond any tensor"),
        ("shape", [2**40], r"array 'model/b': chunk \[64\] cuts the array \[1099511627776\] into 17,179,869,184"),
        ("chunks", [0], r"array 'model/b': chunk extents must be positive"),
        ("chunks", [100, 0], r"array 'model/w': chunk extents must be positive"),  # before "larger than"
    ],
)
def test_hostile_shapes_are_refused_with_integer_math_before_any_buffer(
    ckpt_dir: Path, field: str, value: object, message: str
) -> None:
    saved(ckpt_dir)
    path = "model/w" if isinstance(value, list) and len(value) == 2 else "model/b"
    _edit_shard(ckpt_dir, path, field, value)
    with pytest.raises(CorruptCheckpointError, match=message):
        tiercheck.load(ckpt_dir)
    live = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}}
    with Checkpointer(live, local=ckpt_dir) as ck, pytest.raises(CorruptCheckpointError, match=message):
        ck.restore(step=3)
    assert not live["model"]["w"].any()
    result = CliRunner().invoke(main, ["verify", str(ckpt_dir), "--step", "3"])  # it said "intact" for [10**400]
    assert result.exit_code == 1 and re.search(message, result.output), result.output


@pytest.mark.parametrize("crc", [1e400, -1, 2**32, "7", 1.5])
def test_a_crc_that_is_not_a_32_bit_integer_is_refused(ckpt_dir: Path, crc: object) -> None:
    saved(ckpt_dir)
    part = ckpt_dir / "step-00000003" / part_file(0)
    doc = json.loads(unseal(part.read_bytes(), where="test"))
    key = next(iter(doc["crc32c"]["model/b"]))
    doc["crc32c"]["model/b"][key] = crc
    part.write_bytes(seal(json.dumps(doc).encode()))  # 1e400 is written as Infinity
    with pytest.raises(CorruptCheckpointError, match="CRC32C"):
        tiercheck.load(ckpt_dir)


@pytest.mark.parametrize("name", ["manifest.json", "COMMIT", "manifest/rank-000000.json"])
def test_a_huge_sparse_manifest_file_is_refused_without_reading_it(ckpt_dir: Path, name: str) -> None:
    saved(ckpt_dir)
    with (ckpt_dir / "step-00000003" / name).open("r+b") as f:
        f.truncate(8 << 30)  # 8 GiB, sparse: no disk used, but a whole read would allocate it all
    with pytest.raises((CorruptCheckpointError, CheckpointNotFoundError), match=f"{name} is larger than 256 MiB"):
        tiercheck.load(ckpt_dir, 3)


def test_a_huge_sparse_refs_file_is_refused_by_a_copy_without_reading_it(ckpt_dir: Path, tmp_path: Path) -> None:
    """refs/ files are plain JSON for outside zarr readers; a copy read them whole, whatever their size."""
    saved(ckpt_dir)
    with (ckpt_dir / "step-00000003" / "refs" / "rank-000000.json").open("r+b") as f:
        f.truncate(8 << 30)  # 8 GiB, sparse
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match=r"refs/rank-000000.json is larger than 256 MiB"):
            copy_step(LocalTier(ckpt_dir), LocalTier(tmp_path / "copy"), 3)
        assert tracemalloc.get_traced_memory()[1] < 512 << 20
    finally:
        tracemalloc.stop()
    assert not (tmp_path / "copy" / "step-00000003" / "COMMIT").exists()


@pytest.mark.parametrize(
    "name", ["manifest.json", "COMMIT", "manifest/rank-000000.json", "manifest/arrays-000000.json"]
)
def test_json_nested_5000_deep_is_reported_not_a_recursion_error(ckpt_dir: Path, name: str) -> None:
    saved(ckpt_dir)
    step = ckpt_dir / "step-00000003"
    doc = ("[" * 5000 + "]" * 5000).encode()  # json.loads raises RecursionError on it
    if name == "manifest.json":  # re-signed, so that it is parsed
        resign_index(step, doc)
    else:
        (step / name).write_bytes(seal(doc) if name.startswith("manifest/") else doc)
    with pytest.raises((CorruptCheckpointError, CheckpointNotFoundError), match=r"step 3|step-00000003"):
        tiercheck.load(ckpt_dir, 3)
    live = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}}
    with Checkpointer(live, local=ckpt_dir) as ck, pytest.raises((CorruptCheckpointError, CheckpointNotFoundError)):
        ck.restore(step=3)
    result = CliRunner().invoke(main, ["verify", str(ckpt_dir), "--step", "3"])
    assert result.exit_code == 1 and not isinstance(result.exception, RecursionError), result.output


@pytest.mark.parametrize("field", ["offset", "nbytes"])
def test_a_chunk_offset_or_size_beyond_any_file_is_refused(ckpt_dir: Path, field: str) -> None:
    """2**70 reached os.lseek, which raised a raw ValueError ("cannot fit 'int' into an offset-sized integer")."""
    saved(ckpt_dir)
    part = ckpt_dir / "step-00000003" / part_file(0)
    doc = json.loads(unseal(part.read_bytes(), where="test"))
    if field == "offset":
        doc["offset"]["model/b"]["c.0"] = 2**70
    else:
        doc["nbytes"]["model/b"] = 2**70
    part.write_bytes(seal(json.dumps(doc).encode()))
    message = r"rank-000000.json: malformed manifest part .*below 2\*\*62, got 1180591620717411303424"
    with pytest.raises(CorruptCheckpointError, match=message):
        tiercheck.load(ckpt_dir, 3)
    live = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}}
    with Checkpointer(live, local=ckpt_dir) as ck, pytest.raises(CorruptCheckpointError, match=message):
        ck.restore(step=3)
    assert not live["model"]["w"].any()


def test_a_world_size_beyond_any_job_is_refused(ckpt_dir: Path) -> None:
    saved(ckpt_dir)
    marker = ckpt_dir / "step-00000003" / "COMMIT"
    doc = json.loads(marker.read_bytes())
    doc["world_size"] = 10**12  # set(range(world_size)) would never finish
    marker.write_bytes(json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpointError, match=r"commit marker is damaged .*world_size 1000000000000 is beyond"):
        tiercheck.load(ckpt_dir, 3)


def _swap_kind(path: Path) -> None:
    """A directory where a file should be, or a file where a directory should be."""
    if path.is_dir():
        for p in sorted(path.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        path.rmdir()
        path.write_bytes(b"{}")
    else:
        path.unlink()
        path.mkdir()


@pytest.mark.parametrize(
    "name", ["COMMIT", "manifest.json", "manifest", "manifest/rank-000000.json", "packs", "packs/rank-000000.bin"]
)
def test_a_directory_where_a_file_should_be_and_the_reverse_are_reported(
    ckpt_dir: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    older = saved(ckpt_dir, step=2)
    saved(ckpt_dir)
    _swap_kind(ckpt_dir / "step-00000003" / name)
    with pytest.raises((CorruptCheckpointError, CheckpointNotFoundError), match="step 3|step-00000003"):
        tiercheck.load(ckpt_dir, 3)
    live = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}}
    with Checkpointer(live, local=ckpt_dir) as ck:
        assert ck.restore() == 2  # the damaged newest step does not block the one before it
    assert_identical(live["model"], older)
    proc = run("verify", str(ckpt_dir), check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "step 3" in proc.stderr or "step-00000003" in proc.stderr, proc.stderr


def test_a_state_nested_beyond_the_depth_limit_is_refused_on_save_and_on_load(ckpt_dir: Path) -> None:
    deep: Any = {"x": torch.ones(2)}
    for _ in range(600):
        deep = {"a": deep}
    with (
        Checkpointer({"m": deep}, local=ckpt_dir) as ck,
        pytest.raises(UnsupportedValueError, match=r"m/a/a/.*: nested deeper than 100 levels"),
    ):
        ck.save(1)
    assert not list(ckpt_dir.glob("step-*"))  # refused before anything was written

    saved(ckpt_dir)  # the same depth, planted in a manifest (JSON itself parses 600 levels)
    part = ckpt_dir / "step-00000003" / part_file(0)
    doc = json.loads(unseal(part.read_bytes(), where="test"))
    doc["tree"]["model"]["deep"] = json.loads("[" * 600 + "]" * 600)
    part.write_bytes(seal(json.dumps(doc).encode()))
    with pytest.raises(CorruptCheckpointError, match="nested deeper than 100 levels"):
        tiercheck.load(ckpt_dir, 3)


@pytest.mark.parametrize(
    "deep",
    [
        "[" * 600 + "]" * 600,
        '{"a":' * 600 + "1" + "}" * 600,
        '{"$dict": [[1, ' * 200 + "2" + "]]}" * 200,  # 600 levels of JSON: 200 of the value
        '{"$tuple": [' * 300 + "]}" * 300,
    ],
    ids=["list", "dict", "$dict", "$tuple"],
)
def test_a_tree_value_nested_600_deep_is_reported_by_inspect_and_restore_naming_the_file(
    ckpt_dir: Path, deep: str
) -> None:
    """A plain value of the saved tree nested 600 deep (JSON parses it): ``tiercheck inspect`` and
    a restore refuse it with the library's error naming the step's file, not a RecursionError
    from walking it, and the state is as it was."""
    saved(ckpt_dir)
    part = ckpt_dir / "step-00000003" / part_file(0)
    doc = json.loads(unseal(part.read_bytes(), where="test"))
    doc["tree"]["model"]["deep"] = json.loads(deep)
    part.write_bytes(seal(json.dumps(doc).encode()))
    for args in (["inspect", str(ckpt_dir), "--step", "3"], ["inspect", str(ckpt_dir), "--step", "3", "--json"]):
        result = CliRunner().invoke(main, args)
        assert not isinstance(result.exception, RecursionError), result.exception
        assert result.exit_code == 1, result.output
        assert "nested deeper than 100 levels" in result.output and part_file(0) in result.output, result.output
    live = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}}
    with (
        Checkpointer(live, local=ckpt_dir) as ck,
        pytest.raises(CorruptCheckpointError, match="nested deeper than 100 levels"),
    ):
        ck.restore(step=3, strict=False)
    assert not live["model"]["w"].any()


def test_a_device_or_dtype_that_is_not_one_is_reported(ckpt_dir: Path) -> None:
    for tag, value in [("$device", "garbage"), ("$dtype", "garbage"), ("$npscalar", ["<x9", "AA=="])]:
        state = {"model": {"w": torch.ones(2)}, "extra": {"where": torch.device("cpu")}}
        with Checkpointer(state, local=ckpt_dir / tag) as ck:
            ck.save(1).wait()
        part = ckpt_dir / tag / "step-00000001" / part_file(0)
        doc = json.loads(unseal(part.read_bytes(), where="test"))
        doc["tree"]["extra"]["where"] = {tag: value}
        part.write_bytes(seal(json.dumps(doc).encode()))
        with pytest.raises(CorruptCheckpointError, match=rf"extra/where: cannot decode \{tag} value"):
            tiercheck.load(ckpt_dir / tag)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("shape+chunks", [600_000_000]),  # 2.4 GB of float32, allocated twice, beside a pack of 16 KiB
        ("shape+chunks", [2**47]),  # 512 TiB: within the format's bound
        ("dtype", "complex128"),  # four times the bytes of each chunk, at the same offsets
        ("shape+chunks", [4096]),  # a chunk of 16 KiB: each pack holds less after it
    ],
)
def test_sizes_in_the_arrays_file_are_bounded_by_the_packs_before_any_buffer(
    ckpt_dir: Path, field: str, value: object
) -> None:
    """Every size a fresh load allocates from comes from the arrays file: each is checked against the
    bytes the step's packs hold first, and refused naming the file, never a MemoryError or an allocation
    of what the file claims (before, ``load`` allocated the declared array, then read into it)."""
    saved(ckpt_dir)
    for f in field.split("+"):
        _edit_shard(ckpt_dir, "model/b", f, value)
    with pytest.raises(  # the arrays file alone: its writer's part sizes each chunk otherwise
        CorruptCheckpointError, match=r"step 3: manifest/rank-000000\.json: array 'model/b': rank 0's part gives chunks"
    ):
        tiercheck.load(ckpt_dir, 3)
    _agree_with_shard(ckpt_dir, "model/b")
    with pytest.raises(
        CorruptCheckpointError,
        match=r"step 3: array 'model/b' chunk c\.0: its [\d,]+ bytes at offset [\d,]+ \(the manifest's dtype, "
        r"chunks and offset\) run past the end of packs/rank-000000\.bin",
    ):
        tiercheck.load(ckpt_dir, 3)
    result = CliRunner().invoke(main, ["verify", str(ckpt_dir), "--step", "3"])  # what load refuses, verify does
    assert result.exit_code == 1, result.output


def test_a_chunk_larger_than_its_stored_file_allocates_only_what_is_stored(ckpt_dir: Path) -> None:
    """A record claiming a 256 MiB chunk in a pack of a few KiB: the read is sized by the file
    and fails as truncated; no buffer of the claimed size is made (it was, before any check)."""
    saved(ckpt_dir)
    _edit_shard(ckpt_dir, "model/b", "shape", [2**26])
    _edit_shard(ckpt_dir, "model/b", "chunks", [2**26])
    _agree_with_shard(ckpt_dir, "model/b")
    tier = LocalTier(ckpt_dir)
    rec = read_manifest(tier, 3).arrays["model/b"]
    tracemalloc.start()
    try:
        with pytest.raises(
            CorruptCheckpointError, match=r"'model/b' chunk c\.0: chunk has \d+ bytes, expected 268435460"
        ):
            read_chunk(tier, 3, rec, chunk_at(rec.shape, rec.chunks, (0,)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_a_chunk_grid_beyond_any_save_is_refused_and_verify_counts_the_chunks(ckpt_dir: Path) -> None:
    saved(ckpt_dir)
    _edit_shard(ckpt_dir, "model/b", "chunks", [1])  # 64 chunks, of which the manifest names 1
    _agree_with_shard(ckpt_dir, "model/b")
    proc = run("verify", str(ckpt_dir), check=False)
    assert proc.returncode == 1, proc.stdout
    assert "step 3: array 'model/b': the manifest names 1 chunks of its 64" in proc.stderr, proc.stderr
    with pytest.raises(CorruptCheckpointError, match=r"'model/b': the manifest names 1 chunks, not the 64 of its"):
        tiercheck.load(ckpt_dir, 3)
    _edit_shard(ckpt_dir, "model/b", "shape", [2**40])  # a grid of 2**40 chunks would never be walked
    with pytest.raises(
        CorruptCheckpointError, match=r"'model/b': chunk \[1\] cuts the array .* into 1,099,511,627,776"
    ):
        tiercheck.load(ckpt_dir, 3)
    result = CliRunner().invoke(main, ["verify", str(ckpt_dir), "--step", "3"])
    assert result.exit_code == 1 and "into 1,099,511,627,776" in result.output, result.output


def test_a_sharding_that_cuts_an_array_too_finely_is_refused_on_save() -> None:
    from tiercheck.cluster.assign import LeafDesc, chunk_array

    n = 8_388_617  # a prime: two shards split there leave a common grid of one element a chunk
    pieces = [
        (0, LeafDesc("w", "float32", "tensor", (2 * n,), (0,), (n,), False)),
        (1, LeafDesc("w", "float32", "tensor", (2 * n,), (n,), (n,), False)),
    ]
    with pytest.raises(UnsupportedValueError, match=r"'w'\[16777234\]: .* into 16,777,234 chunks"):
        chunk_array("w", pieces, 4096)


def _meet_permission_bits() -> None:
    """In the child: root reads anything, so drop the two capabilities that let it (from the
    bounding set, before exec) and the permission bits apply to it as to any user."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


_RESTORE_CHILD = """
import sys, torch, tiercheck
live = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}}
with tiercheck.Checkpointer(live, local=sys.argv[1]) as ck:
    step = ck.restore()
try:
    tiercheck.load(sys.argv[1], 3)  # the library's own error, not a raw PermissionError
except tiercheck.TiercheckError:
    pass
torch.save({"step": step, **live["model"]}, sys.argv[2])
"""


@pytest.mark.parametrize("target", ["step-00000003", "step-00000003/manifest", "step-00000003/packs/rank-000000.bin"])
def test_an_unreadable_step_does_not_block_restoring_an_older_one(ckpt_dir: Path, target: str) -> None:
    older = saved(ckpt_dir, step=2)
    saved(ckpt_dir)
    (ckpt_dir / target).chmod(0)
    out = ckpt_dir.parent / "restored.pt"
    # Each in a process of its own: as root, the child drops the capabilities that read past the
    # permission bits (``_meet_permission_bits``), which this process cannot drop and keep.
    try:
        child = subprocess.run(
            [sys.executable, "-c", _RESTORE_CHILD, str(ckpt_dir), str(out)],
            preexec_fn=_meet_permission_bits, capture_output=True, text=True, check=False,
        )  # fmt: skip
        verify = subprocess.run(
            [sys.executable, "-m", "tiercheck", "verify", str(ckpt_dir)],
            preexec_fn=_meet_permission_bits, capture_output=True, text=True, check=False,
        )  # fmt: skip
        copy = subprocess.run(
            [sys.executable, "-m", "tiercheck", "restore", str(ckpt_dir), "--to", str(out.parent / "copy"), "--step", "3"],
            preexec_fn=_meet_permission_bits, capture_output=True, text=True, check=False,
        )  # fmt: skip
    finally:
        (ckpt_dir / target).chmod(0o755)
    # restore --to an unreadable source: one line, and no copy committed
    assert copy.returncode == 1 and "Traceback" not in copy.stderr, copy.stderr
    assert copy.stderr.splitlines()[-1].startswith("tiercheck: error: "), copy.stderr
    assert not (out.parent / "copy" / "step-00000003" / "COMMIT").exists()
    assert child.returncode == 0, child.stderr
    said = "ignoring step-00000003" if target == "step-00000003" else "cannot restore step 3"
    assert said in child.stderr and "Permission denied" in child.stderr, child.stderr
    got = torch.load(out)
    assert got.pop("step") == 2
    assert_identical(got, older)
    assert (ckpt_dir / "step-00000003" / "COMMIT").exists()  # nothing committed was removed
    assert verify.returncode == 1 and "Traceback" not in verify.stderr, verify.stderr
    assert "step-00000003" in verify.stderr or "step 3" in verify.stderr, verify.stderr
    assert "Permission denied" in verify.stderr, verify.stderr


_RESTORE_WITH_REMOTE = """
import sys, torch, tiercheck
live = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}}
with tiercheck.Checkpointer(live, local=sys.argv[1], remote=sys.argv[3]) as ck:
    step = ck.restore()
torch.save({"step": step, **live["model"]}, sys.argv[2])
"""


@pytest.mark.parametrize("target", ["step-00000003", "step-00000003/packs/rank-000000.bin"])
def test_an_unreadable_local_step_is_restored_from_the_remote_tier(tmp_path: Path, target: str) -> None:
    local, remote = tmp_path / "local", (tmp_path / "remote").as_uri()
    state = {"model": {"w": torch.randn(64, 64), "b": torch.randn(64)}}
    with Checkpointer(state, local=local, remote=remote, write=WriteOptions(chunk_bytes=4096)) as ck:
        ck.save(3)
    (local / target).chmod(0)
    out = tmp_path / "restored.pt"
    try:
        child = subprocess.run(
            [sys.executable, "-c", _RESTORE_WITH_REMOTE, str(local), str(out), remote],
            preexec_fn=_meet_permission_bits, capture_output=True, text=True, check=False,
        )  # fmt: skip
    finally:
        (local / target).chmod(0o755)
    assert child.returncode == 0, child.stderr
    assert "Permission denied" in child.stderr, child.stderr
    got = torch.load(out)
    assert got.pop("step") == 3
    assert_identical(got, state["model"])


def test_verify_reports_what_load_refuses_a_marker_naming_no_rank_and_an_array_without_a_record(
    ckpt_dir: Path,
) -> None:
    saved(ckpt_dir)
    step = ckpt_dir / "step-00000003"
    shard = step / shard_file(0)
    doc = json.loads(unseal(shard.read_bytes(), where="test"))
    del doc["arrays"]["model/b"]  # re-sealed: only the record is gone, the chunks are still named
    shard.write_bytes(seal(json.dumps(doc).encode()))
    with pytest.raises(CorruptCheckpointError, match="model/b"):
        tiercheck.load(ckpt_dir, 3)
    result = CliRunner().invoke(main, ["verify", str(ckpt_dir), "--step", "3"])
    assert result.exit_code == 1, result.output  # it said "intact"
    assert "array 'model/b': rank 0 wrote chunks of it, the manifest has no record" in result.output

    marker = json.loads((step / "COMMIT").read_bytes())
    (step / "COMMIT").write_text(json.dumps({**marker, "ranks": []}))
    result = CliRunner().invoke(main, ["verify", str(ckpt_dir), "--step", "3"])
    assert result.exit_code == 1 and "the commit marker names no saving rank" in result.output, result.output


def _index_naming_step(step: Path, named: int) -> None:
    """Rewrite ``step``'s manifest.json to describe step ``named``, re-signed in its COMMIT (whose
    own step stays): an index copied in from another step, as a careless copy or a hostile one
    leaves it."""
    index = json.loads((step / "manifest.json").read_bytes())
    index["step"] = named
    resign_index(step, json.dumps(index).encode())


def test_a_step_whose_index_names_another_step_is_damaged_for_restore_as_for_load(ckpt_dir: Path) -> None:
    """restore() refuses a step whose manifest.json describes another step, as load() and verify
    do, and falls back to the newest older whole step."""
    states = [{"w": torch.full((64,), float(s))} for s in (1, 2)]
    with Checkpointer(states[0], local=ckpt_dir) as ck:
        ck.save(1).wait()
        ck.state = states[1]
        ck.save(2).wait()
    _index_naming_step(ckpt_dir / "step-00000002", 1)
    with pytest.raises(CorruptCheckpointError, match="manifest.json describes step 1, not this step"):
        tiercheck.load(ckpt_dir, step=2)
    live = {"w": torch.zeros(64)}
    with Checkpointer(live, local=ckpt_dir) as ck:
        with pytest.raises(CorruptCheckpointError, match="describes step 1, not this step"):
            ck.restore(2)
        assert ck.restore() == 1
    assert_identical(live, states[0])
    result = CliRunner().invoke(main, ["verify", str(ckpt_dir), "--step", "2"])
    assert result.exit_code == 1 and "describes step 1" in result.output, result.output


@pytest.mark.parametrize("text", ["\u0661\u0660", "1_0", "\uff11\uff10", "+10"])  # Arabic-Indic, fullwidth
def test_a_step_number_is_ascii_digits_only(ckpt_dir: Path, text: str) -> None:
    """int() reads other scripts' digits and underscores (Arabic-Indic 10 and '1_0' are 10): a step named so
    is refused, by the CLI and as a DCP checkpoint_id, never taken for another step."""
    from tiercheck.integrations.dcp.metadata import step_of

    with Checkpointer({"w": torch.zeros(4)}, local=ckpt_dir) as ck:
        ck.save(10).wait()
    result = CliRunner().invoke(main, ["verify", str(ckpt_dir), "--step", text])
    assert result.exit_code == 2 and "expected a step number or 'latest'" in result.output, result.output
    with pytest.raises(ValueError, match="is not a step"):
        step_of(text)


def test_ranks_are_ascii_digits_only(ckpt_dir: Path, tmp_path: Path) -> None:
    with Checkpointer({"w": torch.zeros(4)}, local=ckpt_dir) as ck:
        ck.save(1).wait()
    result = CliRunner().invoke(main, ["restore", str(ckpt_dir), "--to", str(tmp_path / "t"), "--ranks", "\u0660-\u0661"])
    assert result.exit_code == 2 and "expected ranks like 0-7" in result.output, result.output


def test_chunks_overlapping_in_a_pack_are_refused_by_load_and_verify(ckpt_dir: Path) -> None:
    """Two chunks of one pack at the same offset (each checksum matching what is there): load would
    size and fill two buffers from one stored chunk; both refuse the step, naming the pack."""
    saved(ckpt_dir)
    part = ckpt_dir / "step-00000003" / part_file(0)
    doc = json.loads(unseal(part.read_bytes(), where="test"))
    first, second = sorted(doc["offset"]["model/w"])[:2]
    doc["offset"]["model/w"][second] = doc["offset"]["model/w"][first]
    doc["crc32c"]["model/w"][second] = doc["crc32c"]["model/w"][first]
    part.write_bytes(seal(json.dumps(doc).encode()))
    message = r"packs/rank-000000\.bin: array 'model/w' chunk c\.[\d.]+ \(offset [\d,]+, [\d,]+ bytes\) overlaps"
    with pytest.raises(CorruptCheckpointError, match=message):
        tiercheck.load(ckpt_dir, 3)
    result = CliRunner().invoke(main, ["verify", str(ckpt_dir), "--step", "3"])
    assert result.exit_code == 1 and re.search(message, result.output), result.output
