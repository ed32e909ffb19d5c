"""bench/replace_node.py at its smallest size: a replaced node's restart runs end to end (so it never rots), and
its timeline has every phase, for every rank, with the limits it is measured against."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PHASES = ("agree", "plan", "transfer", "verify", "place")


@pytest.mark.slow  # two jobs of 2 and 3 ranks, saved and restarted: ~1 min on 2 busy cores
def test_replace_node_bench_times_every_phase_of_a_replaced_nodes_restart(tmp_path: Path) -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm tmpfs on this machine")
    out = tmp_path / "replace.json"
    cmd = [sys.executable, str(REPO / "bench" / "replace_node.py"), "--mib", "1", "--dir", str(tmp_path)]
    cmd += ["--json", str(out), "--worker-timeout", "300"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    report = json.loads(out.read_text())
    assert [(j["nodes"], j["replicas"]) for j in report["jobs"]] == [(2, 1), (3, 2)]
    for run in report["jobs"]:
        assert run["bit_identical"] is True and run["summary"]["all_from_memory"] is True, run
        assert [r["rank"] for r in run["ranks"]] == list(range(run["nodes"]))
        for r in run["ranks"]:
            assert r["step"] == 1
            assert set(r["phases"]) == set(PHASES) and all(r["phases"][p] >= 0 for p in PHASES), r
            assert r["phases"]["transfer"] > 0 and r["restore_s"] >= sum(r["phases"].values()) * 0.999, r
            assert "rereplicate_s" in r  # None until the library reports it
        replaced = run["ranks"][1]
        assert replaced["bytes_read"] == 0 and replaced["chunks_received"] > 0  # every byte from its peers
        assert replaced["gloo"]["bytes"] == replaced["state_bytes"] and replaced["memcpy_crc"]["s"] > 0
        for key in ("transfer_vs_gloo", "restore_vs_gloo", "restore_vs_memcpy_crc"):
            assert run["summary"][key] > 0, key
    assert "| 3 nodes, replicas=2 | 1 | replaced |" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["replace.json"], "the scratch directory was left behind"
