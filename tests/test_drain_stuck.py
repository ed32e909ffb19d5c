"""A drain that cannot finish never holds up ``close(drain=False)`` (invariant 11: a later job resumes it).

Real processes in a gloo group (``tests/distributed.py``): two ranks, each a node of its own directory,
and a ``file://`` remote. Both nodes save step 1 while no remote tier is set (it stays undrained), node 1's
directory is wiped, and both restart with the remote: node 0 resumes the drain of step 1 and uploads its
files; node 1's are nowhere. Node 0 gives up on the remote commit at once, naming the lost ranks; where it
does not know that (``unsupplied`` stubbed: as if node 1 were merely slow), it waits, and
``close(drain=False)`` stops that wait instead of sitting out the retry deadline (900 s).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

import tiercheck
from tiercheck.format.paths import COMMIT_FILE, drained_marker, step_dir

from .distributed import run_ranks
from .test_distributed import Layout, model_state, node_dir

PAIR = Layout(tp=2, pp=1, dp=1)  # two ranks, each a node of its own


def _save_undrained(rank: int, world: int, root: str) -> None:
    with tiercheck.Checkpointer(model_state(PAIR, rank, seed=2), local=node_dir(root, rank, 1)) as ck:
        ck.save(1)


def _restart(rank: int, world: int, root: str, remote: str, knows: bool) -> dict[str, Any]:
    if not knows:
        from tiercheck.tiering import drain

        drain.unsupplied = lambda *args: []  # type: ignore[assignment]  # as if node 1 would upload its files
    state = model_state(PAIR, rank, seed=2, fill=-1.0)
    ck = tiercheck.Checkpointer(state, local=node_dir(root, rank, 1), remote=remote)
    out: dict[str, Any] = {}
    try:
        out["restored"] = ck.restore()
    except tiercheck.TiercheckError as e:  # rank 1's files of step 1 are gone: no whole copy of step 1
        out["restored"] = type(e).__name__
    if rank == 0:
        try:
            ck.drain(timeout=15)
        except (TimeoutError, tiercheck.RemoteStorageError) as e:
            out["drain"] = f"{type(e).__name__}: {e}"
    out["undrained"] = ck.close(drain=False)
    out["kept"] = (Path(node_dir(root, rank, 1)) / step_dir(1) / COMMIT_FILE).exists()
    return out


@pytest.mark.parametrize("knows", [True, False], ids=["gives-up", "waits"])
def test_a_drain_waiting_for_a_wiped_nodes_files_gives_up_or_is_stopped_by_close(tmp_path: Path, knows: bool) -> None:
    root, remote = tmp_path / "job", tmp_path / "remote"
    run_ranks(_save_undrained, 2, str(root))
    shutil.rmtree(root / "node1")
    # Bounds the whole launch far below the 900 s retry deadline a stuck drain waited out in close().
    results = run_ranks(_restart, 2, str(root), remote.as_uri(), knows, timeout=150)
    up = remote / step_dir(1)
    assert (up / drained_marker(0)).exists()  # node 0's files went up: its drain reached the wait for node 1's
    assert not (up / COMMIT_FILE).exists()
    if knows:
        assert results[0]["drain"].startswith("RemoteStorageError"), results[0]
        assert "no node of this job holds the files of 1 saving rank(s), e.g. [1]" in results[0]["drain"]
    else:
        assert results[0]["drain"].startswith("TimeoutError"), results[0]
    assert results[0]["undrained"] == [1], results[0]
    assert results[0]["kept"]  # the committed local step is kept, for a later job to drain
    assert results[1]["undrained"] == [], results[1]
