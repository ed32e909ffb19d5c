"""The files of a step are checked against each other, not only against their own checksums: a step edited
by hand and re-sealed (every checksum the format keeps recomputed, as an attacker or a careless tool with
write access could) so that two of its records disagree is damaged to ``restore``, ``load`` and ``verify``
alike; each names the file and the field, and a restore passes it over for the newest older whole step as
it does a bad chunk."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import tiercheck
from tests.cli import run
from tests.conftest import assert_identical
from tests.ondisk import resign_index
from tiercheck import Checkpointer, WriteOptions
from tiercheck.errors import CorruptCheckpointError
from tiercheck.format.codec import seal, unseal
from tiercheck.format.paths import part_file, shard_file, step_dir


def save_steps_2_and_3(ckpt_dir: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Steps 2 and 3 of one rank, each of other values; ``w`` in 4 chunks of 4 KiB."""
    states = {s: {"w": torch.randn(64, 64), "b": torch.randn(64)} for s in (2, 3)}
    with Checkpointer(states[2], local=ckpt_dir, write=WriteOptions(chunk_bytes=4096)) as ck:
        ck.save(2).wait()
        ck.state = states[3]
        ck.save(3).wait()
    return states


def reseal(file: Path, edit: object) -> None:
    """Edit a sealed manifest file's document and seal it again."""
    doc = json.loads(unseal(file.read_bytes(), where=str(file)))
    edit(doc)  # type: ignore[operator]
    file.write_bytes(seal(json.dumps(doc).encode()))


def verify(ckpt_dir: Path, step: int) -> tuple[int, str]:
    done = run("verify", str(ckpt_dir), "--step", str(step), check=False)
    return done.returncode, done.stdout + done.stderr


def damage_seen_everywhere(
    ckpt_dir: Path, states: dict[int, dict[str, torch.Tensor]], message: str, caplog: pytest.LogCaptureFixture
) -> str:
    """Step 3 is refused with ``message`` by ``load``, ``verify`` and a restore of step 3; a restore
    of the newest whole step passes step 3 over for step 2, every tensor step 2's. Returns the
    warning that restore logged of step 3."""
    with pytest.raises(CorruptCheckpointError, match=message):
        tiercheck.load(ckpt_dir, 3)
    code, output = verify(ckpt_dir, 3)
    assert code == 1 and re.search(message, output), output
    live = {"w": torch.zeros(64, 64), "b": torch.zeros(64)}
    with Checkpointer(live, local=ckpt_dir) as ck:
        with pytest.raises(CorruptCheckpointError, match=message):
            ck.restore(3)
        assert ck.restore() == 2
    assert_identical(live, states[2])
    return next(r.getMessage() for r in caplog.records if "cannot restore step 3" in r.getMessage())


def test_a_part_whose_chunk_points_at_another_chunk_is_damage_to_restore_as_to_load_and_verify(
    ckpt_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank part whose chunk takes another chunk's offset and CRC32C. load and verify
    refused it (two chunks overlapping in the pack); restore read the other chunk's bytes, which
    check out, into the tensor: mixed tensors. Restore now runs the same extent check."""
    states = save_steps_2_and_3(ckpt_dir)

    def point_at_first(doc: dict[str, dict[str, dict[str, int]]]) -> None:
        first, second = sorted(doc["offset"]["w"])[:2]
        doc["offset"]["w"][second] = doc["offset"]["w"][first]
        doc["crc32c"]["w"][second] = doc["crc32c"]["w"][first]

    reseal(ckpt_dir / step_dir(3) / part_file(0), point_at_first)
    message = (
        r"packs/rank-000000\.bin: array 'w' chunk c\.[\d.]+ \(offset [\d,]+, [\d,]+ bytes\) overlaps "
        r"array 'w' chunk c\.[\d.]+ \(offset [\d,]+\)"
    )
    warning = damage_seen_everywhere(ckpt_dir, states, message, caplog)
    assert re.search(message + r" \(the offsets in manifest/rank-000000\.json\)", warning), warning


@pytest.mark.parametrize(
    ("dtype", "message"),
    [
        # as many bytes a chunk: only the array's zarr.json in its reference map still says float32
        (
            "int32",
            r"refs/rank-000000\.json: 'w/zarr\.json' gives data_type 'float32', attributes\.tiercheck\.dtype "
            r"'float32'; the record of manifest/arrays-000000\.json gives dtype 'int32'",
        ),
        # twice the bytes a chunk: the writer's part gives each chunk's size too
        (
            "float64",
            r"manifest/rank-000000\.json: array 'w': rank 0's part gives chunks of 4,096 bytes, "
            r"its record \(float64, chunks \[16, 64\]\) 8,192 \(the part's nbytes against the dtype",
        ),
    ],
)
def test_an_arrays_file_relabelling_a_dtype_is_damage_to_restore_load_and_verify(
    ckpt_dir: Path, caplog: pytest.LogCaptureFixture, dtype: str, message: str
) -> None:
    """An arrays file relabelling float32 as another dtype, re-sealed. restore refused the
    state as incompatible without trying the older step, load returned the relabelled tensor, and
    verify called the step intact (int32). Now each names the file and field that contradict the
    record, and restore falls back to step 2."""
    states = save_steps_2_and_3(ckpt_dir)
    reseal(ckpt_dir / step_dir(3) / shard_file(0), lambda doc: doc["arrays"]["w"].update(dtype=dtype))
    warning = damage_seen_everywhere(ckpt_dir, states, message, caplog)
    assert re.search(message, warning), warning


def test_a_step_renamed_with_its_index_rewritten_is_refused_by_verify_and_load(ckpt_dir: Path) -> None:
    """Step 3's directory renamed to step 5, its manifest.json and COMMIT rewritten to say 5
    (and re-signed). verify called it intact; its reference map still says step 3."""
    save_steps_2_and_3(ckpt_dir)
    renamed = ckpt_dir / step_dir(5)
    (ckpt_dir / step_dir(3)).rename(renamed)
    marker = json.loads((renamed / "COMMIT").read_bytes())
    (renamed / "COMMIT").write_text(json.dumps({**marker, "step": 5}))
    index = json.loads((renamed / "manifest.json").read_bytes())
    resign_index(renamed, json.dumps({**index, "step": 5}).encode())
    message = r"refs/rank-000000\.json: its tiercheck\.step is 3, not this step \(5\)"
    code, output = verify(ckpt_dir, 5)
    assert code == 1 and re.search(message, output), output
    with pytest.raises(CorruptCheckpointError, match=message):
        tiercheck.load(ckpt_dir, 5)
