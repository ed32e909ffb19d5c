"""Restoring never runs code from a checkpoint and never leaves its root (invariant 6)."""

from __future__ import annotations

import base64
import json
import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tests.ondisk import flip_chunk_byte
from tests.test_bad_input import rewrite_manifest, saved
from tiercheck import Checkpointer, DistributedOptions
from tiercheck.errors import UnsafeCheckpointError, UnsupportedValueError
from tiercheck.format.codec import seal, unseal
from tiercheck.format.paths import owners_file
from tiercheck.tiering.transfer import copy_step
from tiercheck.tiers.local import LocalTier


class Opaque:
    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.value == self.value


def test_unpicklable_values_are_refused_at_save_unless_allowed(ckpt_dir: Path) -> None:
    state = {"extra": {"counter": Opaque(4)}}
    with (
        Checkpointer(state, local=ckpt_dir) as ck,
        pytest.raises(UnsupportedValueError, match=r"extra/counter: .*Opaque cannot be stored without pickle"),
    ):
        ck.save(1)
    with Checkpointer(state, local=ckpt_dir, allow_pickle=True) as ck:
        ck.save(1).wait()
    with pytest.raises(UnsafeCheckpointError, match=r"extra/counter: this value was stored with pickle"):
        tiercheck.load(ckpt_dir)
    assert tiercheck.load(ckpt_dir, allow_pickle=True)["extra"]["counter"] == Opaque(4)
    restored: dict[str, Any] = {"extra": {}}
    with Checkpointer(restored, local=ckpt_dir) as ck, pytest.raises(PermissionError, match="pickle"):
        ck.restore()
    with Checkpointer(restored, local=ckpt_dir) as ck:
        ck.restore(allow_pickle=True)
    assert restored["extra"]["counter"] == Opaque(4)


class Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, ("raise SystemExit('code from the checkpoint ran')",))


def test_a_planted_pickle_is_not_executed(ckpt_dir: Path) -> None:
    saved(ckpt_dir)
    payload = base64.b64encode(pickle.dumps(Boom())).decode()
    rewrite_manifest(ckpt_dir, 3, lambda doc: doc["trees"][0]["model"].update(evil={"$pickle": payload}))
    with pytest.raises(UnsafeCheckpointError, match="model/evil: this value was stored with pickle"):
        tiercheck.load(ckpt_dir)


@pytest.mark.parametrize("bad", ["../../outside", "/etc/passwd", "model/../../x", "a//b", "model/c/0", "__x"])
def test_manifest_paths_cannot_escape_the_step(ckpt_dir: Path, bad: str) -> None:
    saved(ckpt_dir)

    def retarget(doc: dict[str, Any]) -> None:
        doc["arrays"][bad] = doc["arrays"].pop("model/w")
        doc["trees"][0]["model"]["w"] = {"$tensor": bad}

    rewrite_manifest(ckpt_dir, 3, retarget)
    with pytest.raises(UnsafeCheckpointError, match="array path"):
        tiercheck.load(ckpt_dir)
    live = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}}
    with Checkpointer(live, local=ckpt_dir) as ck, pytest.raises(PermissionError):
        ck.restore()


def test_only_paths_that_passed_the_check_are_remembered_as_safe() -> None:
    from tiercheck.format.values import _SAFE_PATHS, check_array_path

    class Sneaky(str):  # claims to equal every string, a remembered one too: checked all the same
        def __hash__(self) -> int:
            return hash("model/w")

        def __eq__(self, other: object) -> bool:
            return True

    assert check_array_path("model/w", where="test") == "model/w"
    assert "model/w" in _SAFE_PATHS
    for _ in range(2):
        with pytest.raises(UnsafeCheckpointError, match="not a plain relative path"):
            check_array_path("model/../w", where="test")
    assert "model/../w" not in _SAFE_PATHS
    with pytest.raises(UnsafeCheckpointError, match="not a plain relative path"):
        check_array_path(Sneaky("model/../w"), where="test")


def test_a_tree_referring_to_an_unlisted_array_is_refused(ckpt_dir: Path) -> None:
    saved(ckpt_dir)
    rewrite_manifest(ckpt_dir, 3, lambda doc: doc["trees"][0]["model"].update(x={"$tensor": "../secret"}))
    with pytest.raises(tiercheck.CorruptCheckpointError, match="manifest lacks"):
        tiercheck.load(ckpt_dir)


# ---------------------------------------------------------------------------- symbolic links


def _outside_copy(src: Path, outside: Path) -> Path:
    """A byte-identical copy of ``src`` outside the checkpoint: a link to it would verify."""
    import shutil

    (shutil.copytree if src.is_dir() else shutil.copy2)(src, outside)
    return outside


def _refused_everywhere(ckpt_dir: Path, message: str) -> None:
    from click.testing import CliRunner

    from tiercheck.cli import main

    with pytest.raises(UnsafeCheckpointError, match=message):
        tiercheck.load(ckpt_dir, 3)
    live = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}}
    with Checkpointer(live, local=ckpt_dir) as ck, pytest.raises(UnsafeCheckpointError, match=message):
        ck.restore(step=3)
    assert not live["model"]["w"].any()
    result = CliRunner().invoke(main, ["verify", str(ckpt_dir), "--step", "3"])
    assert result.exit_code != 0 and "symbolic link" in result.output, result.output


@pytest.mark.parametrize("link", ["pack", "packs directory"])
def test_a_symlink_inside_a_step_is_never_followed(ckpt_dir: Path, tmp_path: Path, link: str) -> None:
    saved(ckpt_dir)
    step = ckpt_dir / "step-00000003"
    inside = step / "packs" / "rank-000000.bin" if link == "pack" else step / "packs"
    target = _outside_copy(inside, tmp_path / "outside")
    import shutil

    (shutil.rmtree if inside.is_dir() else Path.unlink)(inside)
    inside.symlink_to(target)
    _refused_everywhere(ckpt_dir, f"{inside} is a symbolic link")


def test_a_symlinked_step_directory_is_ignored_with_a_warning(
    ckpt_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = saved(ckpt_dir, step=2)
    with Checkpointer({"model": model}, local=ckpt_dir) as ck:  # a whole step 3 elsewhere, linked in
        ck.save(3).wait()
    step3 = ckpt_dir / "step-00000003"
    target = _outside_copy(step3, tmp_path / "elsewhere")
    import shutil

    shutil.rmtree(step3)
    step3.symlink_to(target, target_is_directory=True)
    live = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}}
    with Checkpointer(live, local=ckpt_dir) as ck:  # starts, and restores the real step
        assert ck.steps() == [2]
        assert ck.restore() == 2
    assert torch.equal(live["model"]["w"], model["w"])
    assert any("step-00000003" in r.message and "symbolic link" in r.message for r in caplog.records)
    assert (target / "COMMIT").exists(), "the link's target is left alone"


def test_restore_to_never_writes_through_a_symlinked_target_step(ckpt_dir: Path, tmp_path: Path) -> None:
    from tiercheck.tiering.transfer import copy_step
    from tiercheck.tiers.local import LocalTier

    saved(ckpt_dir)
    target, elsewhere = tmp_path / "target", tmp_path / "elsewhere"
    target.mkdir()
    elsewhere.mkdir()
    (target / "step-00000003").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UnsafeCheckpointError, match="is a symbolic link"):
        copy_step(LocalTier(ckpt_dir), LocalTier(target), 3)
    assert list(elsewhere.iterdir()) == []


# ------------------------------------------------------------------ copies commit only whole steps


def test_a_chunk_owner_outside_the_world_is_refused(ckpt_dir: Path, tmp_path: Path) -> None:
    values = saved(ckpt_dir)
    owners = ckpt_dir / "step-00000003" / owners_file(0)
    doc = json.loads(unseal(owners.read_bytes(), where="test"))
    doc["owner"]["model/w"]["c.0.0"] = 5
    owners.write_bytes(seal(json.dumps(doc).encode()))
    with pytest.raises(tiercheck.CorruptCheckpointError, match=r"array 'model/w' chunk c.0.0: owner 5 is not a rank"):
        tiercheck.load(ckpt_dir)
    with pytest.raises(tiercheck.CorruptCheckpointError, match="owner 5 is not a rank"):
        copy_step(LocalTier(ckpt_dir), LocalTier(tmp_path / "target"), 3)
    assert not (tmp_path / "target" / "step-00000003" / "COMMIT").exists()
    # A read plan waited on the store for a holder of rank 5's files: 300 s, then torch's DistStoreError.
    # Planned by a coordinator (read_once: one rank reads each chunk, whoever wrote it), it is refused.
    live = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}}
    with (
        Checkpointer(live, local=ckpt_dir, distributed=DistributedOptions(read_once=True)) as ck,
        pytest.raises(
            tiercheck.CorruptCheckpointError, match=r"owners-000000.json: array 'model/w' chunk c.0.0: owner 5"
        ),
    ):
        ck.restore(step=3)
    assert not live["model"]["w"].any()
    # Restoring the layout it saved, the rank reads the chunks it wrote by its own part (each checked
    # against the checksum there) and no coordinator reads the owners file: the values come back whole.
    with Checkpointer(live, local=ckpt_dir) as ck:
        assert ck.restore(step=3) == 3
    assert torch.equal(live["model"]["w"], values["w"]) and torch.equal(live["model"]["b"], values["b"])


@pytest.mark.parametrize("ref", [["model/w"], {"p": "model/w"}])
def test_an_array_referred_to_by_other_than_a_path_is_refused(ckpt_dir: Path, ref: object) -> None:
    saved(ckpt_dir)
    rewrite_manifest(ckpt_dir, 3, lambda doc: doc["trees"][0]["model"].update(w={"$tensor": ref}))
    with pytest.raises(tiercheck.CorruptCheckpointError, match="manifest lacks"):
        tiercheck.load(ckpt_dir)
    live = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}}
    with (
        Checkpointer(live, local=ckpt_dir) as ck,
        pytest.raises(tiercheck.CorruptCheckpointError, match=r"model: an array is referred to by a (list|dict), not"),
    ):
        ck.restore(step=3)  # was a raw TypeError (unhashable type)
    assert not live["model"]["w"].any()


@pytest.mark.parametrize("damage", ["chunk", "arrays shard", "owners file"])
def test_a_rotted_local_step_fails_the_background_and_the_cli_drain_loudly(
    ckpt_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """Nothing rotted on the local disk is committed on the remote: not a chunk, not a file of the
    manifest (the drain copied those unchecked, and committed the step)."""
    from click.testing import CliRunner

    from tiercheck.cli import main
    from tiercheck.format.paths import shard_file
    from tiercheck.format.steps import list_steps

    saved(ckpt_dir)  # no remote yet: nothing drained
    step = ckpt_dir / "step-00000003"
    if damage == "chunk":
        flip_chunk_byte(step, "model/w", "c.1.0", 7)
    else:
        damaged = step / (shard_file(0) if damage == "arrays shard" else owners_file(0))
        data = bytearray(damaged.read_bytes())
        data[20] ^= 0x01
        damaged.write_bytes(bytes(data))
    remote = (tmp_path / "remote").as_uri()
    with Checkpointer({"model": {}}, local=ckpt_dir, remote=remote) as ck:  # resumes the drain of step 3
        assert ck.close() == [3]
    failed = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("drain of step 3" in m and "checksum mismatch" in m for m in failed), failed
    result = CliRunner().invoke(main, ["drain", str(ckpt_dir), "--to", remote])
    assert result.exit_code == 1 and "checksum mismatch" in result.output, result.output
    assert list_steps(LocalTier(tmp_path / "remote")).committed == []


def _verify(ckpt_dir: Path) -> tuple[int, str]:
    from click.testing import CliRunner

    from tiercheck.cli import main

    result = CliRunner().invoke(main, ["verify", str(ckpt_dir), "--step", "3"])
    return result.exit_code, result.output


def _edit_part(ckpt_dir: Path, edit: Any) -> None:
    part = ckpt_dir / "step-00000003" / "manifest" / "rank-000000.json"
    doc = json.loads(unseal(part.read_bytes(), where="test"))
    edit(doc)
    part.write_bytes(seal(json.dumps(doc).encode()))


@pytest.mark.parametrize("key", ["../../outside/c.0", "c.1", "c.00", "c.0.0", "c.\u0660"])
def test_verify_refuses_a_chunk_key_that_load_refuses(ckpt_dir: Path, key: str) -> None:
    """A rank part naming a chunk that is not one of its array's grid (a path out of the step, a key
    beyond the grid, another spelling, another rank count): load refuses the step, so verify does."""
    saved(ckpt_dir)

    def rename(doc: dict[str, Any]) -> None:
        for field in ("crc32c", "offset"):
            if doc.get(field):
                doc[field]["model/b"][key] = doc[field]["model/b"].pop("c.0")

    _edit_part(ckpt_dir, rename)
    with pytest.raises(tiercheck.CorruptCheckpointError, match="model/b"):
        tiercheck.load(ckpt_dir)
    code, output = _verify(ckpt_dir)
    assert code == 1 and f"rank 0's part names {key!r}, not its chunk" in output, output


def test_verify_refuses_a_part_whose_chunk_sizes_disagree_with_the_arrays_file(ckpt_dir: Path) -> None:
    saved(ckpt_dir)
    _edit_part(ckpt_dir, lambda doc: doc["nbytes"].update({"model/b": doc["nbytes"]["model/b"] * 2}))
    code, output = _verify(ckpt_dir)
    assert code == 1 and "array 'model/b': rank 0's part gives chunks of 512 bytes, its record (float32" in output


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda ref, o, n: ["/etc/passwd", 0, n], "points at ['/etc/passwd'"),
        (lambda ref, o, n: ["{{u}}/../../outside.bin", o, n], "points at ['{{u}}/../../outside.bin'"),
        (lambda ref, o, n: ["{{u}}/packs/rank-000001.bin", o, n], "not at that chunk in packs/rank-000000.bin"),
        (lambda ref, o, n: [ref[0], o + 10**9, n], "not at that chunk"),
        (lambda ref, o, n: [ref[0], o, n + 4], "not at that chunk"),
        (lambda ref, o, n: "inline bytes", "is inline data, and not a zarr.json document"),
    ],
)
def test_verify_checks_reference_maps_point_only_at_their_ranks_chunks(
    ckpt_dir: Path, edit: Any, message: str
) -> None:
    """Plain zarr reads a step through its reference maps, which tiercheck itself never reads: verify
    checks every entry is one of the rank's chunks in its own pack, in range, or a zarr.json document."""
    saved(ckpt_dir)
    refs = ckpt_dir / "step-00000003" / "refs" / "rank-000000.json"
    doc = json.loads(refs.read_bytes())
    ref = doc["refs"]["model/b/c.0"]
    doc["refs"]["model/b/c.0"] = edit(ref, ref[1], ref[2])
    refs.write_text(json.dumps(doc))
    code, output = _verify(ckpt_dir)
    assert code == 1 and "refs/rank-000000.json" in output and message in output, output


def test_the_readme_recipe_refuses_a_reference_out_of_the_step(ckpt_dir: Path) -> None:
    from tests.plainzarr import open_step

    saved(ckpt_dir)
    step = ckpt_dir / "step-00000003"
    assert open_step(str(step))["model/b"].shape == (64,)
    refs = step / "refs" / "rank-000000.json"
    doc = json.loads(refs.read_bytes())
    doc["refs"]["model/b/c.0"][0] = "/etc/hostname"
    refs.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"model/b/c\.0 points outside the step"):
        open_step(str(step))
