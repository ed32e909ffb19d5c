"""``tiercheck import`` of a DCP checkpoint (issue 55): its time and its memory, against reading it whole.

A checkpoint ``dcp.save`` wrote from one process (every tensor in one piece) is imported with a staging pool
of ``--pool-mib``; each run is a fresh process with the page cache dropped first. Reported per run: seconds,
GB/s of the checkpoint, the staging pool's peak, and the process's anonymous memory at its peak (sampled every
5 ms, above what it held before: mapped file pages the kernel may drop are not counted). The baseline reads the
same checkpoint whole with ``dcp.load`` into fresh tensors (what the import did before it streamed), and
the disk's cold sequential read rate bounds both.

    python bench/import_bench.py --quick          # 256 MiB
    python bench/import_bench.py --gib 2 --json bench/results/import_bench.json
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as h

MiB = 1 << 20


def _anon_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


class _AnonPeak:
    """The process's anonymous memory at its peak while in the block, above its level on entry."""

    def __enter__(self) -> _AnonPeak:
        self.base = self.peak = _anon_kib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _anon_kib())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _anon_kib())

    @property
    def above_bytes(self) -> int:
        return (self.peak - self.base) * 1024


def make(path: str, nbytes: int) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    n = nbytes // 4 // 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({f"layer{i}.w": torch.randn(n, generator=g) for i in range(8)}, checkpoint_id=path, no_dist=True)
    h.fsync_tree(path)
    return {}


def _preload() -> None:
    """What every run imports on its way, imported before the clock starts (the same for each)."""
    import torch.distributed.checkpoint  # noqa: F401
    import zarr  # noqa: F401

    import tiercheck  # noqa: F401


def run_import(src: str, to: str, pool: int) -> dict[str, Any]:
    from tiercheck.integrations.importer import import_checkpoint

    _preload()

    with _AnonPeak() as mem:
        seconds, done = h.timed(lambda: import_checkpoint(src, to, step=1, max_host_bytes=pool))
    return {"seconds": seconds, "anon_peak_bytes": mem.above_bytes, "pool_peak_bytes": done.staged_peak_bytes}


def run_read_whole(src: str, to: str | None = None, pool: int = 0) -> dict[str, Any]:
    """``dcp.load`` of the whole checkpoint into fresh tensors; with ``to``, then saved there as a step through a
    pool of ``pool`` bytes (what the import did before it streamed)."""
    import torch
    import torch.distributed.checkpoint as dcp

    import tiercheck

    _preload()
    with warnings.catch_warnings(), _AnonPeak() as mem:
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        md = dcp.FileSystemReader(src).read_metadata()
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
        dcp.load(state, checkpoint_id=src, no_dist=True)
        if to is not None:
            staging = tiercheck.StagingOptions(mode="eager", max_host_bytes=pool)
            with tiercheck.Checkpointer(state, local=to, staging=staging) as ck:
                ck.save(1).wait()
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "anon_peak_bytes": mem.above_bytes, "pool_peak_bytes": None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="the checkpoint's size")
    p.add_argument("--pool-mib", type=int, default=256, help="the import's staging pool (max_host_bytes)")
    h.common_args(p)
    args = p.parse_args()
    nbytes = (256 * MiB) if args.quick else int(args.gib * (1 << 30))
    pool = min(args.pool_mib, 64 if args.quick else args.pool_mib) * MiB
    script = Path(__file__).resolve()
    with h.scratch_dir(args.dir, "import-bench-", keep=args.keep) as root:
        src = root / "step-1"
        h.run_worker(script, "make", {"path": str(src), "nbytes": nbytes})
        files = sorted(str(f) for f in src.iterdir())
        cold = h.measure_cold_read(files, drop=not args.no_drop_caches)
        rows, results = [], {}
        for name, func, kwargs in (
            ("dcp.load, whole (reading only)", "run_read_whole", {"src": str(src)}),
            ("read whole, then save (the import before)", "run_read_whole",
             {"src": str(src), "to": str(root / "before"), "pool": pool}),
            ("tiercheck import (streaming)", "run_import", {"src": str(src), "to": str(root / "ck"), "pool": pool}),
        ):  # fmt: skip
            h.prepare(not args.no_drop_caches, args.settle_max_s, files)
            r = h.run_worker(script, func, kwargs)
            results[name] = r
            rows.append([name, h.fmt(r["seconds"]), h.fmt(nbytes / r["seconds"] / 1e9),
                         h.fmt_bytes(r["anon_peak_bytes"]),
                         "-" if r["pool_peak_bytes"] is None else h.fmt_bytes(r["pool_peak_bytes"])])  # fmt: skip
        write = h.measure_disk_write(root, nbytes)
    h.log(h.machine_line(h.machine_info(args.dir or ".")))
    for name, s in (("cold read of its files", cold["s"]), ("fsync'd write of as many bytes", write["durable_s"])):
        rows.append([f"{name} (the disk's limit)", h.fmt(s), h.fmt(nbytes / s / 1e9), "-", "-"])
    print(f"DCP checkpoint of {h.fmt_bytes(nbytes)} (8 tensors, one process's), import pool {h.fmt_bytes(pool)}, "
          f"page cache dropped: {cold['cache'] or 'no'}")  # fmt: skip
    print(h.table(["run", "s", "GB/s", "anonymous memory peak", "pool peak"], rows))
    if args.json:
        h.write_json(args.json, {"nbytes": nbytes, "pool": pool, "cold_read": cold, "write": write, "runs": results})


if __name__ == "__main__":
    main()
