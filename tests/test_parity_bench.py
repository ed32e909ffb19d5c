"""bench/parity_codec.py at its smallest size (k=2, m=2, 256 KiB pieces): it runs end to end, so it never rots,
and every codec it measures gives back bit-identically the pieces it lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_parity_codec_bench_measures_zfec_against_memcpy_and_crc32c_and_its_decodes_are_bit_identical(
    tmp_path: Path,
) -> None:
    out = tmp_path / "parity.json"
    cmd = [sys.executable, str(REPO / "bench" / "parity_codec.py"), "--quick", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    doc = json.loads(out.read_text())
    [row] = doc["rows"]
    assert (row["k"], row["m"], row["piece"], row["stripes"], row["data_bytes"]) == (2, 2, 256 << 10, 8, 4 << 20)
    assert row["zfec_bit_identical"] is True
    assert all(v is True for key, v in row.items() if key.endswith("_bit_identical"))
    for name in ("memcpy", "crc32c", "zfec encode", "zfec decode", "numpy table encode"):
        assert row["gib_s"][name] > 0 and row["vs_memcpy"][name] == row["gib_s"][name] / row["gib_s"]["memcpy"]
    assert row["vs_memcpy"]["memcpy"] == 1.0
    assert "| 2+2 | 256 KiB |" in proc.stdout and doc["versions"]["zfec"]
