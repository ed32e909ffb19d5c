"""What ``hf.export`` and ``hf.load_pretrained`` meet from outside: a target that is a symbolic link, a FIFO or a
link where a file should be (the Hugging Face hub cache links every file of a snapshot to a blob), headers whose
``data_offsets`` safetensors refuses, a tensor named like the header's metadata, and what a killed export left."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import pytest
import torch

import tiercheck
from tiercheck.errors import CorruptCheckpointError, IncompatibleStateError, TiercheckError
from tiercheck.integrations import hf

safetensors_torch = pytest.importorskip("safetensors.torch")
safetensors = pytest.importorskip("safetensors")


def _checkpoint(root: Path, model: dict[str, torch.Tensor]) -> Path:
    with tiercheck.Checkpointer({"model": model}, local=root) as ck:
        ck.save(1).wait()
    return root


def _file(doc: dict[str, object], data: bytes) -> bytes:
    header = json.dumps(doc).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def test_export_to_a_symbolic_link_is_refused_naming_it(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path / "ck", {"w": torch.ones(4)})
    (tmp_path / "real").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "real")
    with pytest.raises(TiercheckError, match=r"out.*symbolic link"):
        hf.export(ck, tmp_path / "out")
    assert os.listdir(tmp_path / "real") == []
    assert sorted(os.listdir(tmp_path)) == ["ck", "out", "real"]  # no hidden directory left either


def test_load_pretrained_refuses_a_fifo_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            hf.load_pretrained(tmp_path, {"w": torch.zeros(4)})
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():  # blocked opening the FIFO: a writer's open lets it go, then the test fails
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(30)
        pytest.fail("load_pretrained blocked on a FIFO named model.safetensors")
    assert isinstance(outcome[0], CorruptCheckpointError) and "not a regular file" in str(outcome[0])


@pytest.mark.parametrize(
    ("offsets", "length"),
    [([[0, 16], [0, 16]], 32), ([[0, 16], [0, 16]], 16), ([[0, 16], [32, 48]], 48), ([[4, 20], [20, 36]], 36)],
    ids=["overlapping", "overlapping-short", "gapped", "leading-gap"],
)
def test_data_offsets_safetensors_refuses_are_refused(tmp_path: Path, offsets: list[list[int]], length: int) -> None:
    doc = {name: {"dtype": "F32", "shape": [4], "data_offsets": o} for name, o in zip("ab", offsets, strict=True)}
    (tmp_path / "model.safetensors").write_bytes(_file(doc, bytes(range(length))))
    with pytest.raises(safetensors.SafetensorError):
        safetensors_torch.load_file(tmp_path / "model.safetensors")
    state = {"a": torch.zeros(4), "b": torch.zeros(4)}
    with pytest.raises(CorruptCheckpointError, match="data_offsets"):
        hf.load_pretrained(tmp_path, state)
    assert not state["a"].any() and not state["b"].any()


def test_bytes_after_the_last_tensor_are_refused(tmp_path: Path) -> None:
    doc = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    (tmp_path / "model.safetensors").write_bytes(_file(doc, bytes(20)))
    with pytest.raises(safetensors.SafetensorError):
        safetensors_torch.load_file(tmp_path / "model.safetensors")
    with pytest.raises(CorruptCheckpointError, match="no tensor covers"):
        hf.load_pretrained(tmp_path, {"a": torch.zeros(4)})


def test_a_tensor_named_like_the_header_metadata_is_refused_at_export(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path / "ck", {"__metadata__": torch.ones(4), "w": torch.ones(2)})
    with pytest.raises(IncompatibleStateError, match="__metadata__"):
        hf.export(ck, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_a_killed_exports_hidden_directory_goes_with_a_successful_rerun(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path / "ck", {"w": torch.ones(4)})
    left = tmp_path / ".out.tiercheck-0a1b2c3d"  # as an export killed before its rename leaves it
    left.mkdir()
    (left / "model.safetensors.partial").write_bytes(b"half")
    (tmp_path / ".out.tiercheck-notes").write_text("not an export's")  # not one of its names: kept
    hf.export(ck, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == [".out.tiercheck-notes", "ck", "out"]


def test_load_pretrained_follows_links_to_files_as_the_hub_cache_lays_them_out(tmp_path: Path) -> None:
    """``snapshots/<rev>/model.safetensors -> ../../blobs/<hash>``, the index too; a link to a directory or to
    nothing is still refused."""
    g = torch.Generator().manual_seed(7)
    full = {"a": torch.randn(8, 4, generator=g), "b": torch.randn(3, generator=g)}
    published = tmp_path / "published"
    published.mkdir()
    safetensors_torch.save_file({"a": full["a"]}, published / "model-00001-of-00002.safetensors")
    safetensors_torch.save_file({"b": full["b"]}, published / "model-00002-of-00002.safetensors")
    index = {"metadata": {"total_size": 44}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                             "b": "model-00002-of-00002.safetensors"}}  # fmt: skip
    (published / "model.safetensors.index.json").write_text(json.dumps(index))
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(published.iterdir())):
        os.replace(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(f"../../blobs/blob{i}")
    state = {"a": torch.zeros(8, 4), "b": torch.zeros(3)}
    assert sorted(hf.load_pretrained(snapshot, state)) == ["a", "b"]
    assert all(torch.equal(state[k], v) for k, v in full.items())
    shard = snapshot / "model-00002-of-00002.safetensors"
    shard.unlink()
    shard.symlink_to(tmp_path / "hub")  # a directory
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        hf.load_pretrained(snapshot, {"a": torch.zeros(8, 4), "b": torch.zeros(3)})
