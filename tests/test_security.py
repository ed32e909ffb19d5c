"""Restoring never runs code from a checkpoint and never leaves its root (invariant 6)."""

from __future__ import annotations

import base64
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tests.test_bad_input import rewrite_manifest, saved
from tiercheck import Checkpointer
from tiercheck.errors import UnsafeCheckpointError, UnsupportedValueError


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


def test_a_tree_referring_to_an_unlisted_array_is_refused(ckpt_dir: Path) -> None:
    saved(ckpt_dir)
    rewrite_manifest(ckpt_dir, 3, lambda doc: doc["trees"][0]["model"].update(x={"$tensor": "../secret"}))
    with pytest.raises(tiercheck.CorruptCheckpointError, match="manifest lacks"):
        tiercheck.load(ckpt_dir)
