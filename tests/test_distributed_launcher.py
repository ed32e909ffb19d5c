"""The multi-process test launcher itself (tests/distributed.py)."""

from __future__ import annotations

import os
import threading
from typing import Literal

import pytest
import torch
import torch.distributed as dist

from tests.distributed import RankFailed, RankOutcome, run_ranks


def _all_reduce(rank: int, world_size: int, base: int) -> tuple[int, int]:
    t = torch.tensor([base + rank])
    dist.all_reduce(t)
    return rank, int(t.item())


def _raise_on(rank: int, world_size: int, bad: int) -> int:
    if rank == bad:
        raise ValueError(f"boom on {rank}")
    dist.barrier()  # the good ranks would hang here if the launcher did not kill them
    return rank


def _exit_on(rank: int, world_size: int, bad: int) -> int:
    dist.barrier()
    if rank == bad:
        os._exit(3)
    return rank * 10


def _hang(rank: int, world_size: int) -> None:
    threading.Event().wait()


def _getenv(rank: int, world_size: int, name: str) -> str | None:
    return os.environ.get(name)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_results_in_rank_order(start_method: Literal["spawn", "forkserver"]) -> None:
    assert run_ranks(_all_reduce, 4, 100, start_method=start_method) == [(r, 4 * 100 + 6) for r in range(4)]


def test_raising_rank_is_named_with_its_traceback() -> None:
    with pytest.raises(RankFailed) as info:
        run_ranks(_raise_on, 3, 2, timeout=60)
    msg = str(info.value)
    assert "rank 2 of 3 failed first" in msg
    assert "ValueError: boom on 2" in msg and "_raise_on" in msg  # the child's own traceback


def test_dead_rank_reported_with_exit_code() -> None:
    outcomes = run_ranks(_exit_on, 4, 3, check=False)
    assert [o.result for o in outcomes[:3]] == [0, 10, 20] and all(o.ok and o.exitcode == 0 for o in outcomes[:3])
    assert outcomes[3] == RankOutcome(3, error="rank 3 died without a result (exit code 3)", exitcode=3)
    with pytest.raises(RankFailed, match=r"rank 3 died without a result \(exit code 3\)"):
        run_ranks(_exit_on, 4, 3)


def test_timeout_kills_all() -> None:
    with pytest.raises(RankFailed, match=r"timed out after 5s; ranks \[0, 1\] still running were killed"):
        run_ranks(_hang, 2, timeout=5, check=False)


def test_env_reaches_ranks_forked_from_a_fork_server_started_before_it() -> None:
    """Fork-server ranks inherit the server's environment, started at the first launch: ``env`` is how a
    variable set later reaches them."""
    run_ranks(_all_reduce, 2, 0)  # the fork server runs from here on
    assert run_ranks(_getenv, 2, "TIERCHECK_LAUNCHER_PROBE", env={"TIERCHECK_LAUNCHER_PROBE": "set"}) == ["set"] * 2
