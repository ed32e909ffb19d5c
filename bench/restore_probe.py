#!/usr/bin/env python
"""Where a fresh-process restore's time goes, and what the disk gives each way of reading it
(issue 33, item 1): a short run for a lent GPU machine, beside ``bench/gpu_bench.py``.

Usage::

    python bench/restore_probe.py --out "$OUT"               # ~4 GiB state on the GPU
    python bench/restore_probe.py --dry-run --device cpu     # a few MiB on CPU: the CI smoke run

1. Builds the benchmark's state (``gpu_bench.build_state``) and saves it once with tiercheck.
2. Reads the step's files from a dropped page cache each way in ``--disk`` (buffered or
   ``O_DIRECT``, threads, block size; into page-locked memory on CUDA): what the disk gives.
3. Restores the step in a fresh process per variant in ``--variants`` (``io_threads:run MiB``, and
   optionally ``:staged`` for an all-or-nothing restore (``in_place=False``) staged on the GPU,
   ``:host`` for one on a GPU without room to stage anything, or ``:pinned`` for that with the
   host staging memory page-locked, as restores did before; by default a job start's restore,
   streamed into the live tensors), each from a dropped cache, bit-checked, with the restore's phases timed by wrapping its
   functions: the time to the first read, the reads' busy time and overlap, what follows the last.

Writes ``<out>/restore-probe-<device>.json`` (``-dry-run`` added for ``--dry-run``) and logs a line per
read and per restore on stderr. Exits 1 unless every restore was bit-identical.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gpu_bench as g
import harness as h
from harness import MiB

DISK = ("buffered:1:64", "direct:1:64", "direct:4:64", "direct:8:16", "direct:8:64", "direct:16:8", "buffered:4:64")
VARIANTS = ("4:64", "8:64", "8:16")


def read_files(files: list[str], mode: str, threads: int, block: int, device: str) -> dict[str, Any]:
    """Every byte of ``files`` read in ``block`` pieces by ``threads`` threads, each into a buffer
    of its own (page-locked on CUDA, on a page either way)."""
    import torch

    jobs = [(f, off) for f in files for off in range(0, os.path.getsize(f), block)]
    pinned = device.startswith("cuda")
    local = threading.local()
    flags = os.O_RDONLY | (os.O_DIRECT if mode == "direct" else 0)

    def one(job: tuple[str, int]) -> int:
        if not hasattr(local, "buf"):
            raw = torch.empty(block + 4096, dtype=torch.uint8, pin_memory=pinned)
            skip = -raw.data_ptr() % 4096
            local.buf = raw[skip : skip + block].numpy().data
        fd = os.open(job[0], flags)
        try:
            return os.preadv(fd, [local.buf], job[1])
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(one, jobs))
    s = time.perf_counter() - t0
    return {"mode": mode, "threads": threads, "block_mib": block // MiB, "bytes": total, "s": s, "gb_s": total / s / 1e9}


class Trace:
    """Wraps functions (module attributes) to record (name, thread, start, end, bytes) per call."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, float, float, int]] = []
        self.lock = threading.Lock()

    def wrap(self, owner: Any, attr: str, nbytes: Any = None) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
            n = nbytes(out) if nbytes is not None else 0
            with self.lock:
                self.events.append((attr, threading.get_ident(), t0, t1, n))
            return out

        setattr(owner, attr, traced)

    def summary(self, t0: float, t1: float) -> dict[str, Any]:
        out: dict[str, Any] = {"restore_call_s": t1 - t0}
        by: dict[str, list[tuple[float, float, int]]] = {}
        for name, _tid, a, b, n in self.events:
            by.setdefault(name, []).append((a, b, n))
        for name, evs in by.items():
            out[name] = {
                "calls": len(evs),
                "sum_s": sum(b - a for a, b, _ in evs),
                "first_start_s": min(a for a, _, _ in evs) - t0,
                "last_end_s": max(b for _, b, _ in evs) - t0,
                "bytes": sum(n for _, _, n in evs),
            }
        reads = sorted((a, b) for a, b, _ in by.get("read_vectored", []))
        if reads:
            busy, end = 0.0, reads[0][0]
            for a, b in reads:
                busy += max(0.0, b - max(a, end))
                end = max(end, b)
            out["reads_busy_s"] = busy
            out["reads_mean_concurrency"] = sum(b - a for a, b in reads) / busy if busy else 0.0
        return out


def fresh_restore(device: str, width: int, layers: int, batch: int, root: str, step: int,
                  want: dict[str, list[int]], io_threads: int, run_mib: int, drop: bool, room: str = "gpu") -> dict[str, Any]:  # fmt: skip
    """A restarted job's restore of ``step``, its phases timed (see ``Trace``)."""
    g.quiet_warnings()
    model, opt, step_fn = g.build_state(device, width, layers, batch, seed=1)
    step_fn()
    g.sync(device)
    import torch

    import tiercheck
    import tiercheck.restore.protocol as protocol
    import tiercheck.restore.read as read
    import tiercheck.restore.stage as stage
    from tiercheck.tiers.local import LocalTier

    read.READ_RUN_BYTES = run_mib * MiB
    if room in ("host", "pinned"):  # no room on the GPU: everything staged in host memory
        stage.device_room = lambda items: {}
    if room == "pinned":
        stage.host_read_buffer = lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=True)
    trace = Trace()
    for attr in ("staged", "move_chunks", "copy_in", "fill_deferred"):
        trace.wrap(protocol, attr)
    trace.wrap(LocalTier, "read_vectored", nbytes=lambda r: r[0])
    trace.wrap(read, "verify_parts", nbytes=len)
    trace.wrap(read, "fill")
    trace.wrap(stage.Bounce, "__init__")
    trace.wrap(stage, "device_room")
    cache = g.drop_page_cache(drop, [root])
    t0 = time.perf_counter()
    ckpt = tiercheck.Checkpointer(
        {"model": model, "optim": opt},
        local=root,
        retention=tiercheck.RetentionOptions(keep_last=None),
        write=tiercheck.WriteOptions(io_threads=io_threads),
    )
    t1 = time.perf_counter()
    got = ckpt.restore(step, in_place=None if room == "gpu" else False)
    g.sync(device)
    t2 = time.perf_counter()
    stats = {k: v for k, v in ckpt.stats().items() if k.startswith("restore_") and isinstance(v, int)}
    ckpt.close()
    if got != step:
        raise AssertionError(f"restore() returned {got}, expected {step}")
    return {
        "io_threads": io_threads,
        "run_mib": run_mib,
        "room": room,
        "cache": cache,
        "construct_s": t1 - t0,
        "restore_s": t2 - t0,
        "phases": trace.summary(t1, t2),
        "stats": stats,
        **g.compare(want, g.fingerprint(model, opt)),
    }


def save_once(device: str, width: int, layers: int, batch: int, root: str) -> dict[str, Any]:
    g.quiet_warnings()
    model, opt, step_fn = g.build_state(device, width, layers, batch)
    step_fn()
    g.sync(device)
    import tiercheck

    with tiercheck.Checkpointer(
        {"model": model, "optim": opt}, local=root, retention=tiercheck.RetentionOptions(keep_last=None)
    ) as ckpt:
        t0 = time.perf_counter()
        ckpt.save(1).wait()
        s = time.perf_counter() - t0
    return {"save_s": s, "want": g.fingerprint(model, opt)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="a few MiB, no cache drops")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--size-gib", type=float, default=4.0)
    p.add_argument("--out", default=str(h.RESULTS_DIR))
    p.add_argument("--dir", default="", help="scratch parent (default bench/results: the repo's disk)")
    p.add_argument("--disk", nargs="*", default=list(DISK), help="mode:threads:block MiB reads of the step's files")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), help="io_threads:run MiB restores")
    args = p.parse_args(argv)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    width = 256 if args.dry_run else 8192
    layers = 4 if args.dry_run else g.layers_for(args.size_gib, width)
    batch = 32 if args.dry_run else 2048
    drop = not args.dry_run
    name = g.device_name(device)
    scratch = Path(args.dir or h.RESULTS_DIR) / f"probe-scratch-{os.getpid()}"
    root = scratch / "ckpt"
    report: dict[str, Any] = {"device": name, "width": width, "layers": layers}
    try:
        kw = {"device": device, "width": width, "layers": layers, "batch": batch, "root": str(root)}
        saved = h.run_worker(__file__, "save_once", kw)
        if "error" in saved:
            raise RuntimeError(saved.get("traceback") or saved["error"])
        report["save_s"] = saved["save_s"]
        files = sorted(str(f) for f in (root / "step-00000001").rglob("*") if f.is_file())
        report["disk"] = []
        for spec in args.disk:
            mode, threads, block = spec.split(":")
            cache = g.drop_page_cache(drop, [root])
            r = read_files(files, mode, int(threads), int(block) * MiB, device)
            report["disk"].append({**r, "cache": cache})
            h.log(f"disk {spec}: {r['gb_s']:.2f} GB/s ({r['s']:.2f} s)")
        report["restores"] = []
        for spec in args.variants:
            threads, run_mib, room = ([*spec.split(":"), "gpu"])[:3]
            r = h.run_worker(
                __file__, "fresh_restore",
                {**kw, "step": 1, "want": saved["want"], "io_threads": int(threads), "run_mib": int(run_mib),
                 "drop": drop, "room": room},
            )  # fmt: skip
            report["restores"].append(r)
            if "error" in r:
                h.log(f"restore {spec}: FAILED {r.get('traceback') or r['error']}")
                continue
            ph = r["phases"]
            h.log(
                f"restore {spec}: {r['restore_s']:.2f} s (construct {r['construct_s']:.2f}, call "
                f"{ph['restore_call_s']:.2f}; first read at {ph['read_vectored']['first_start_s']:.2f}, "
                f"reads busy {ph.get('reads_busy_s', 0):.2f} x{ph.get('reads_mean_concurrency', 0):.1f}, "
                f"last read end {ph['read_vectored']['last_end_s']:.2f}) bit-identical {r['bit_identical']}"
            )
    finally:
        h.write_json(Path(args.out) / f"restore-probe-{g.slug(name)}{'-dry-run' if args.dry_run else ''}.json", report)
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    ok = all(r.get("bit_identical") for r in report.get("restores", []))
    return 0 if ok and report.get("restores") else 1


if __name__ == "__main__":
    sys.exit(main())
