"""bench/parity_bench.py at its smallest size (1 MiB a node, 2 saves): both jobs of 6 nodes run end to end, so it
never rots; every node's restore is bit-identical (the bench checks each against the digest it saved), the lost
nodes rebuild from parity or restore from a peer's copy, and the memory each node holds is what its scheme keeps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # ~45 s on 2 cores: 4 launches of 6 nodes, ~30 s of it their Checkpointers' start (TCPStore connects)
def test_parity_bench_on_nodes_restores_bit_identically_and_reports_every_ratio(tmp_path: Path) -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm tmpfs on this machine")
    out = tmp_path / "parity_nodes.json"
    cmd = [sys.executable, str(REPO / "bench" / "parity_bench.py"), "--mib", "1", "--steps", "2"]
    cmd += ["--dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    doc = json.loads(out.read_text())
    assert (doc["nodes"], doc["code"], doc["replicas"], doc["slots"], doc["steps"]) == (6, [4, 2], 2, 2, 2)
    assert sorted(doc["jobs"]) == ["parity", "replicas"]
    for kind, lost in (("parity", [0, 1]), ("replicas", [1])):
        job = doc["jobs"][kind]
        assert job["lost"] == lost and "error" not in job, job.get("traceback")
        assert [r["rank"] for r in job["restored"]] == list(range(6))
        assert [r["step"] for r in job["restored"]] == [2] * 6  # the newest step, from memory alone
        assert all(r["bit_identical"] is True and r["from_memory"] == 1 for r in job["restored"])
        assert [len(s["saves"]) for s in job["saved"]] == [2] * 6
        s = job["summary"]
        assert s["all_bit_identical"] is True and s["all_from_memory"] is True and s["restored_newest"] is True
        assert s["state_bytes"] == 1 << 20
        for key in ("protect_s", "memcpy_crc_alone_s", "memcpy_crc_together_s", "gloo_s", "lost_restore_s"):
            assert s[key] > 0, key
        assert s["protect_vs_memcpy_crc_alone"] == s["protect_s"] / s["memcpy_crc_alone_s"]
    parity, copies = doc["jobs"]["parity"], doc["jobs"]["replicas"]
    assert [r["rebuilt_step"] for r in parity["restored"]] == [2, 2, None, None, None, None]
    assert parity["summary"]["lost_rebuild_s"] > 0 and parity["summary"]["rebuilt_as_expected"] is True
    for key in ("encode_alone_s", "encode_together_s", "decode_alone_s", "rebuild_floor_s"):
        assert parity["summary"][key] > 0, key
    assert "encode_alone_s" not in copies["summary"]
    # Each node: its 2 slots (a snapshot each, and a page of header), half a snapshot of parity (4+2) and a
    # few pages of manifests and markers; with copies, its 2 slots and both memory steps of 2 peers.
    p, c = parity["summary"], copies["summary"]
    assert 2.0 < p["slots_vs_snapshot"] < 2.05 and p["parity_vs_snapshot"] == pytest.approx(0.5, abs=0.02)
    assert c["parity_vs_snapshot"] == 0 and c["other_vs_snapshot"] == pytest.approx(4.0, abs=0.2)
    compare = doc["compare"]
    assert compare["all_bit_identical"] is True and compare["held_bound"] == 2.5
    for key in ("protect_parity_vs_replicas", "rebuild_vs_replica_restore"):
        assert compare[key] > 0, key
    assert "| parity 4+2, lost [0, 1] |" in proc.stdout and "| replicas=2, lost [1] |" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["parity_nodes.json"], "the scratch directory was left"
