"""One writer per node-local directory: a second job (or a second open Checkpointer) is refused
with an error naming the holder, a dead holder's lock is recovered, and a committed step on disk
is never overwritten by a save."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tiercheck
from tiercheck import Checkpointer, DirectoryInUseError, StepExistsError
from tiercheck.tiering.transfer import copy_step
from tiercheck.tiers.local import LocalTier

from .distributed import run_ranks

REPO = Path(__file__).resolve().parents[1]


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}


def _files(step_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(step_dir)): p.read_bytes() for p in sorted(step_dir.rglob("*")) if p.is_file()}


def test_a_second_checkpointer_on_an_open_directory_is_refused_naming_the_holder(tmp_path: Path) -> None:
    first = Checkpointer({"m": _state()}, local=tmp_path)
    first.save(1).wait()
    with pytest.raises(DirectoryInUseError) as e:
        Checkpointer({"m": _state(1)}, local=tmp_path)
    message = str(e.value)
    assert f"pid {os.getpid()}" in message
    assert repr(socket.gethostname()) in message
    assert str(tmp_path) in message
    # The refused one removed nothing: the first writer's step is intact and it goes on saving.
    first.save(2).wait()
    assert first.steps() == [1, 2]
    first.close()
    with Checkpointer({"m": _state(1)}, local=tmp_path) as second:  # free once the holder closes
        assert second.steps() == [1, 2]


_HOLDER = textwrap.dedent(
    """
    import sys, torch, tiercheck
    ckpt = tiercheck.Checkpointer({"w": torch.zeros(4)}, local=sys.argv[1])
    print("ready", flush=True)
    sys.stdin.readline()  # hold the directory until the test kills us
    """
)


def test_another_process_is_refused_and_its_lock_is_recovered_once_it_is_killed(tmp_path: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    ) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
            with pytest.raises(DirectoryInUseError, match=f"pid {holder.pid} on host"):
                Checkpointer({"m": _state()}, local=tmp_path)
        finally:
            holder.send_signal(signal.SIGKILL)  # no chance to clean up: the kernel drops its flock
            holder.wait()
    with Checkpointer({"m": _state()}, local=tmp_path) as ckpt:
        ckpt.save(3).wait()
        assert ckpt.steps() == [3]


def test_a_step_committed_on_disk_behind_the_writers_back_is_not_overwritten(tmp_path: Path) -> None:
    other = tmp_path / "other"
    with Checkpointer({"m": _state(7)}, local=other) as elsewhere:
        elsewhere.save(7).wait()
    mine = tmp_path / "mine"
    with Checkpointer({"m": _state()}, local=mine) as ckpt:
        ckpt.save(1).wait()  # the run has claimed the directory (a step appearing before that: test_lineage)
        copy_step(LocalTier(other), ckpt.tier, 7)  # e.g. pre-staged while this writer runs
        before = _files(mine / "step-00000007")
        with pytest.raises(StepExistsError, match="step 7 is already committed"):
            ckpt.save(7).wait()
        assert _files(mine / "step-00000007") == before
        ckpt.save(8).wait()  # the refused save poisons nothing
    loaded = tiercheck.load(mine, 7)
    assert all(torch.equal(loaded["m"][k], _state(7)[k]) for k in ("w", "b"))


def _open_node(rank: int, world_size: int, roots: list[str]) -> str:
    try:
        Checkpointer({"w": torch.zeros(4)}, local=roots[rank])
    except DirectoryInUseError as e:
        return str(e)
    return "opened"


def test_when_one_nodes_directory_is_taken_every_rank_of_the_job_is_refused(tmp_path: Path) -> None:
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    with Checkpointer({"w": torch.zeros(4)}, local=roots[1]):  # another job on node 1
        results = run_ranks(_open_node, 2, roots)
    assert results[0] == results[1]
    assert f"pid {os.getpid()}" in results[0] and roots[1] in results[0]
