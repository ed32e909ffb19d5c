"""bench/scale_sim.py at a small size: it runs end to end (so it never rots), and what it reports of
the hierarchy holds: the job's store hears four requests per node for a save that reuses its plan."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


@functools.cache
def _rows() -> list[dict[str, Any]]:
    cmd = [sys.executable, str(REPO / "bench" / "scale_sim.py"), "--layout", "gpt3", "--ranks", "1024", "--json"]
    cmd += ["--replace", "2"]  # and again with node 1 replaced, its files in nodes 2 and 3's memory
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow  # a simulation of 1,024 ranks: ~30 s on 2 busy cores
def test_the_simulated_job_store_hears_four_requests_per_node_for_a_save_that_reuses_its_plan() -> None:
    (row,) = _rows()
    assert row["world_size"] == 1024 and row["nodes"] == 128
    assert row["simulated_plan_ranks"] < 1024  # one pipeline stage and its coordinators' nodes
    # Four per leader; rank 0's metadata, the previous vote's five keys deleted, two decisions, a read.
    assert row["store_ops_server_per_save"] <= 4 * row["nodes"] + 9, row
    assert row["second_save_store_bytes"] < 0.1 * row["first_save_store_bytes"], row
    assert 0 < row["commit_s"] < 1 and 0 < row["find_latest_s"] < 1, row


@pytest.mark.slow  # the same run as above
def test_a_replaced_nodes_chunks_come_from_its_peer_and_no_other_node_reads_more() -> None:
    """Node 1 of 128 replaced (its memory gone), its files held by nodes 2 and 3: its ranks read nothing and receive
    all they need; the peers read its chunks (each holder part, and each the chunks its own ranks need) and their
    busiest rank at most twice what it read without; every other rank reads and sends what it did without."""
    (row,) = _rows()
    got = row["replace"]
    assert (got["replicas"], got["replaced_node"], got["peer_nodes"]) == (2, 1, [2, 3])
    replaced, peers, without = got["replaced"], got["peers"], got["peers_without"]
    assert replaced["ranks"] == 8 and replaced["chunk_read_bytes_max"] == 0 and replaced["chunks_received_max"] > 0
    # what the replaced node read without the replacement, now read on its peers: once, or once on each of the
    # two holding nodes that needs the chunk itself (it reads its own copy instead of receiving it), never more
    extra = peers["chunk_read_bytes_sum"] - without["chunk_read_bytes_sum"]
    assert got["replaced_without"]["chunk_read_bytes_sum"] <= extra <= 2 * got["replaced_without"]["chunk_read_bytes_sum"]
    assert peers["chunk_read_bytes_max"] <= 2 * without["chunk_read_bytes_max"], got
    assert got["others_reading_more"] == got["others_sending_more"] == got["others_extra_read_bytes"] == 0
    assert got["others"]["chunk_read_bytes_sum"] == got["others_without"]["chunk_read_bytes_sum"]


def test_the_llama405_layout_covers_its_arrays_and_its_vocabulary_cuts_them_into_rows() -> None:
    """The 405B layout (TP 8 x PP 16 x HSDP over 64) holds every array whole; Llama's vocabulary, cut over TP
    and then over 64 FSDP ranks, leaves no chunk extent but one row; padded to a multiple of 512, a chunk a piece."""
    sys.path.insert(0, str(REPO / "bench"))
    from scale_layouts import llama405b_hsdp

    from tiercheck.cluster.assign import chunk_array
    from tiercheck.format.layout import grid_size

    for pad, extent, count in ((False, 1, 128256), (True, 251, 512)):  # padded: a chunk per piece, 128512 / 512
        layout = llama405b_hsdp(8192, 0, pad_vocab=pad)  # stage 0: TP 8 x shard 64, one replica
        assert sum(bool(r) for r in layout) == 512
        pieces = [(r, d) for r, descs in enumerate(layout) for d in descs if d.path == "model/tok_embeddings.weight"]
        rec, chunks = chunk_array("model/tok_embeddings.weight", pieces, 64 << 20)  # no hole, no disagreement
        assert len(chunks) == grid_size(rec.shape, rec.chunks)
        assert (rec.chunks[0], len(chunks)) == (extent, count), rec.chunks
