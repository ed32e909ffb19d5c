"""A process SIGKILLed at any instant leaves the previous committed step intact and no
partial step visible (invariant 1)."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

import tiercheck
from tests._crash_child import content, save_forever
from tests.conftest import assert_identical
from tests.distributed import fork_server


def run_and_kill(directory: Path, mode: str, delay: float) -> int:
    """Start a saving process, kill it ``delay`` s after its first commit; return the last step
    it reported committed. It is forked from the fork server, with torch and tiercheck imported: a
    process of its own, killed as any is, without importing them for each of the test's 12 kills."""
    ctx = fork_server()
    announced, announce = ctx.Pipe(duplex=False)
    child = ctx.Process(target=save_forever, args=(str(directory), mode, announce), daemon=True)
    child.start()
    announce.close()  # the child's copy is the only one: its death ends the pipe
    committed: list[int] = []
    try:
        assert announced.poll(timeout=120), "the child never committed a step"
        committed.append(announced.recv())
        time.sleep(delay)  # the random moment of the crash, not synchronisation
        child.kill()  # SIGKILL
        child.join(timeout=60)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    while announced.poll(timeout=60):  # what it announced before it died, then the end of the pipe
        try:
            committed.append(announced.recv())
        except EOFError:
            break
    announced.close()
    assert child.exitcode == -signal.SIGKILL, child.exitcode
    return committed[-1]


def check_tier(directory: Path, announced: int) -> int:
    """Everything visible is a complete, correct step, and nothing announced was lost."""
    steps = [int(p.name.removeprefix("step-")) for p in directory.glob("step-*") if (p / "COMMIT").exists()]
    assert steps, "no committed step survived"
    newest = max(steps)
    assert newest >= announced, f"step {announced} was announced committed but the newest step is {newest}"
    for step in steps:
        loaded = tiercheck.load(directory, step=step)
        assert_identical(content(step), loaded["tensors"], f"step {step}")
        assert loaded["info"] == {"step": step}
    return newest


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_sigkill_at_random_moments_never_exposes_a_partial_step(tmp_path: Path, mode: str) -> None:
    rng = random.Random(int(os.environ.get("TIERCHECK_CRASH_SEED", "1234")))
    directory = tmp_path / "ckpt"
    previous = -1
    kills = 6
    for _ in range(kills):
        announced = run_and_kill(directory, mode, delay=rng.uniform(0.0, 0.4))
        newest = check_tier(directory, announced)
        assert newest > previous, "each restart resumed and committed something newer"
        previous = newest
        # A new Checkpointer cleans what the crash left and restores the newest step.
        state = {"tensors": content(0), "info": {"step": -1}}
        with tiercheck.Checkpointer(state, local=directory) as ck:
            assert ck.restore() == newest
            assert not [p for p in directory.glob("step-*") if not (p / "COMMIT").exists()]
        assert_identical(content(newest), state["tensors"])
        assert torch.equal(state["tensors"]["step"], torch.tensor(newest))
