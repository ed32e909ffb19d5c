"""bench/gpu_bench.py --dry-run: the GPU benchmark runs end to end on CPU with tiny sizes, so it never rots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HEADLINE = (
    "staging_fraction_of_pinned_copy",
    "lazy_added_fraction_of_step",
    "added_vs_dcp_async",
    "restore_fraction_of_raw_read",
    "restore_vs_torch_checkpointing",
)


def test_gpu_bench_dry_run(tmp_path: Path) -> None:
    script = REPO / "bench" / "gpu_bench.py"
    # One fresh-process restore (tiercheck's): every method's restore code runs in process too.
    cmd = [
        sys.executable,
        str(script),
        "--dry-run",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
        "--fresh",
        "tiercheck.lazy",
        "--dir",
        str(tmp_path / "scratch"),
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    (path,) = tmp_path.glob("gpu-*.json")
    report = json.loads(path.read_text())
    for key in (*HEADLINE, "device", "limits", "methods", "fresh_restores", "table"):
        assert key in report, key
    assert report["device"] == "cpu"
    assert report["status"] == "complete"
    # The numbers that need no CUDA and no torch_checkpointing exist on CPU too.
    assert report["lazy_added_fraction_of_step"] is not None
    assert (
        report["added_vs_dcp_async"] is not None
        or report["methods"]["dcp.async_save"]["summary"]["added_per_ckpt_s"] <= 0
    )
    assert report["restore_fraction_of_raw_read"] is not None
    for method in ("tiercheck.lazy", "tiercheck.eager", "dcp.async_save"):
        res = report["methods"][method]
        assert "error" not in res, (method, res.get("traceback", res.get("error")))
        assert res["restore"]["bit_identical"], (method, res["restore"])
        assert res["summary"]["n_saves"] == 2
    assert report["fresh_restores"]["tiercheck.lazy"]["bit_identical"] is True
    assert report["tiercheck_restores_bit_identical"] is True
    assert report["methods"]["dcp.async_save+pinned"]["skipped"]  # needs CUDA
    assert "tiercheck.lazy" in report["table"]
    assert "| tiercheck.lazy | ok |" in proc.stdout


def test_restore_probe_dry_run(tmp_path: Path) -> None:
    """bench/restore_probe.py times a fresh-process restore's phases; on CPU with tiny sizes too."""
    cmd = [sys.executable, str(REPO / "bench" / "restore_probe.py"), "--dry-run", "--device", "cpu"]
    cmd += ["--out", str(tmp_path), "--dir", str(tmp_path), "--disk", "buffered:2:1", "--variants", "2:64"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    report = json.loads((tmp_path / "restore-probe-cpu-dry-run.json").read_text())
    (disk,) = report["disk"]
    assert disk["bytes"] > 0 and disk["threads"] == 2
    (restore,) = report["restores"]
    assert restore["bit_identical"] is True
    phases = restore["phases"]
    assert phases["read_vectored"]["bytes"] >= restore["stats"]["restore_bytes_read"] > 0
    assert phases["move_chunks"]["calls"] == phases["copy_in"]["calls"] == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("probe-scratch")] == []


def test_gpu_restart_dry_run(tmp_path: Path) -> None:
    """bench/gpu_restart.py (issue 43): a fresh-process restore per variant, on CPU with tiny sizes;
    the GPU-full rows and the pinned bytes need CUDA, and say so."""
    cmd = [sys.executable, str(REPO / "bench" / "gpu_restart.py"), "--dry-run", "--device", "cpu", "--rounds", "1"]
    cmd += ["--out", str(tmp_path), "--dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    report = json.loads((tmp_path / "gpu-restart-cpu-dry-run.json").read_text())
    assert report["status"] == "complete" and report["config"]["fills"] == ["room"]
    (only,) = report["rounds"]
    for variant in ("tiercheck", "tiercheck.in_place=False", "dcp.load"):
        assert only["room"][variant]["bit_identical"] is True, only["room"][variant]
    stats = only["room"]["tiercheck"]["tiercheck_stats"]
    assert stats["restore_in_place_bytes"] > 0  # the default at a job start: read into the state itself
    assert only["room"]["tiercheck.in_place=False"]["tiercheck_stats"]["restore_in_place_bytes"] == 0
    assert "room/tiercheck" in report["summary"]["rows"]
    assert "| room | tiercheck |" in proc.stdout
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("gpu_restart-")] == []
