"""bench/memory_bench.py --quick: the memory tier's benchmark runs end to end with a tiny state, so it never rots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # eight fresh processes (torch imported in each): ~1.5 min on 2 busy cores
def test_memory_bench_quick(tmp_path: Path) -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm tmpfs on this machine")
    out = tmp_path / "memory.json"
    cmd = [sys.executable, str(REPO / "bench" / "memory_bench.py"), "--quick", "--gib", "0.01", "--steps", "2"]
    cmd += ["--dir", str(tmp_path), "--json", str(out), "--no-drop-caches"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["all_from_memory"] is True, report["restarts"]  # the restart read the memory tier
    assert summary["all_bit_identical"] is True, report["restarts"]
    (restart,) = report["restarts"]
    assert [restart[k]["tier"] for k in ("memory", "local", "dcp.load")] == ["memory", "local", "dcp"]
    assert summary["all_persisted"] is True, restart["memory"]  # the restart persisted its memory-only step
    assert restart["memory"]["restore_persist_s"] > 0
    for key in ("memory_vs_memcpy_crc", "local_cold_vs_memory", "memory_vs_local_cold", "memory_held_vs_shard"):
        assert summary[key] is not None and summary[key] > 0, key
    assert summary["memory_held_vs_shard"] == pytest.approx(2.0, rel=0.1)  # two slots, each about a snapshot
    for method in ("tiercheck.memory", "tiercheck.lazy", "dcp.async_save"):
        assert "added_per_step_s" in report["saves"][method], report["saves"][method]
    assert "| tiercheck.memory |" in proc.stdout and "restart from own memory" in proc.stdout
    assert not Path(report["shm_dir"]).exists(), "the private memory directory was left on the tmpfs"
    assert [p.name for p in tmp_path.iterdir()] == ["memory.json"], "the scratch directory was left behind"


def test_memory_bench_removes_its_memory_directory_when_it_fails(tmp_path: Path) -> None:
    """A run that fails (here: its first worker killed by the timeout) leaves no memory tier behind: RAM on a tmpfs."""
    shm = tmp_path / "shm"
    shm.mkdir()
    cmd = [sys.executable, str(REPO / "bench" / "memory_bench.py"), "--quick", "--worker-timeout", "0.01"]
    cmd += ["--dir", str(tmp_path), "--json", str(tmp_path / "never.json"), "--shm", str(shm)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "the saving process was not killed as planned" in proc.stderr, proc.stderr
    assert list(shm.iterdir()) == [], "the private memory directory was left behind"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shm"], "the scratch directory was left behind"
