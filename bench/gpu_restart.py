#!/usr/bin/env python
"""A job restart on one GPU, with room on it and as full as training leaves it (issue 43): tiercheck's
default restore (at a job start: streamed into the live tensors) and its all-or-nothing one
(``in_place=False``) against torch_checkpointing and ``dcp.load``, and the page-locked memory of
tiercheck's save pool against the snapshot's bytes.

Usage::

    python bench/gpu_restart.py --out "$OUT"          # ~3.75 GiB of fp32 state (MLP + AdamW) on the GPU
    python bench/gpu_restart.py --dry-run             # a few MiB on CPU: the CI smoke run

1. One process builds the state (``gpu_bench.build_state``), takes one step, and saves it with
   each library (tiercheck with its pool page-locked on CUDA; torch_checkpointing and ``dcp.save``
   synchronously), fingerprinting it; it reports tiercheck's ``pool_pinned_bytes`` against the
   snapshot's bytes, and what torch's caching host allocator would have locked (the next power of
   two of the pool's capacity).
2. Per round (``--rounds``): a cold read of tiercheck's files (the page cache dropped before it),
   then for each GPU fill (``room``; ``full``: a filler tensor leaves ``--free-gib`` of the GPU
   free, CUDA only) and each variant, a fresh process rebuilds the state with other weights,
   takes one step (the optimizer's state exists), fills the GPU, drops the page cache, restores,
   and checks every tensor bit for bit.

Writes ``<out>/gpu-restart-<device>.json`` (``-dry-run`` added for ``--dry-run``) after every
restore, and prints a markdown table at the end. Exits 1 unless every restore was bit-identical.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import os
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import gpu_bench as g
import harness as h
from harness import GiB

VARIANTS = ("tiercheck", "tiercheck.in_place=False", "torch_checkpointing", "dcp.load")
FILLS = ("room", "full")
STEP = 1
SAVED_AS = {"tiercheck": "tiercheck", "tiercheck.in_place=False": "tiercheck", "torch_checkpointing": "tckpt",
            "dcp.load": "dcp"}  # fmt: skip


# ------------------------------------------------------------------------------------------
# Workers (each in a fresh process through harness.run_worker)
# ------------------------------------------------------------------------------------------


def save_all(device: str, width: int, layers: int, batch: int, root: str, tckpt: bool) -> dict[str, Any]:
    """The state after one step, saved by every library under ``root``, and its fingerprint."""
    import torch
    import torch.distributed.checkpoint as dcp

    import tiercheck

    g.quiet_warnings()
    model, opt, step_fn = g.build_state(device, width, layers, batch, seed=0)
    step_fn()
    g.sync(device)
    out: dict[str, Any] = {"fingerprint": g.fingerprint(model, opt), "saves": {}}
    base = Path(root)
    cuda = device.startswith("cuda")
    t0 = time.perf_counter()
    with tiercheck.Checkpointer(
        {"model": model, "optim": opt},
        local=str(base / "tiercheck"),
        staging=tiercheck.StagingOptions(mode="eager", pin_memory=cuda),
        retention=tiercheck.RetentionOptions(keep_last=None),
    ) as ck:
        ck.save(STEP).wait()
        out["saves"]["tiercheck"] = {"s": time.perf_counter() - t0}
        stats = ck.stats()
    snapshot = sum(t.numel() * t.element_size() for t in g.named_tensors(model, opt).values())
    capacity = int(stats["pool_capacity_bytes"])
    out["pinned"] = {
        "snapshot_bytes": snapshot,
        "pool_capacity_bytes": capacity,
        "pool_pinned_bytes": int(stats["pool_pinned_bytes"]),
        "torch_pinned_would_be_bytes": 1 << max(capacity - 1, 0).bit_length() if cuda else 0,
        "pinned_over_capacity_bytes": int(stats["pool_pinned_bytes"]) - capacity if cuda else None,
        "pinned_per_snapshot_byte": int(stats["pool_pinned_bytes"]) / snapshot if cuda else None,
    }
    if tckpt:
        mgr = g.tc_manager(async_save=False, direct_io=True)
        t0 = time.perf_counter()
        try:
            mgr.save(str(base / "tckpt" / f"step-{STEP:08d}"), {"model": model.state_dict(), "optim": opt.state_dict()})
        except Exception as exc:  # O_DIRECT refused (ext4): buffered, as gpu_bench falls back
            out["saves"]["tckpt_direct_io_error"] = g.first_line(str(exc), 300)
            mgr.close()
            shutil.rmtree(base / "tckpt", ignore_errors=True)
            mgr = g.tc_manager(async_save=False, direct_io=False)
            t0 = time.perf_counter()
            mgr.save(str(base / "tckpt" / f"step-{STEP:08d}"), {"model": model.state_dict(), "optim": opt.state_dict()})
        finally:
            mgr.close()
        out["saves"]["torch_checkpointing"] = {"s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    dcp.save(h.dcp_state(model, opt), checkpoint_id=base / "dcp" / f"step-{STEP:08d}")
    out["saves"]["dcp"] = {"s": time.perf_counter() - t0}
    h.fsync_tree(base)
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return out


def fill_gpu(device: str, free_bytes: int) -> tuple[Any, dict[str, int]]:
    """A tensor that leaves ``free_bytes`` of the GPU free (torch's cache emptied first, so that
    the restore finds no cached blocks either), and the GPU's free bytes after it."""
    import torch

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    take = max(0, free - free_bytes)
    filler = torch.empty(take, dtype=torch.uint8, device=device) if take else None
    after, _ = torch.cuda.mem_get_info(device)
    return filler, {"gpu_total_bytes": total, "filler_bytes": take, "free_bytes_after_fill": after}


def restart(
    variant: str,
    fill: str,
    device: str,
    width: int,
    layers: int,
    batch: int,
    root: str,
    want: dict[str, list[int]],
    drop: bool,
    free_gib: float,
) -> dict[str, Any]:
    """A restarted job: the state rebuilt with other weights, one step taken, the GPU filled as
    ``fill`` says, the page cache dropped; then ``variant`` restores step ``STEP``, bit-checked."""
    g.quiet_warnings()
    model, opt, step_fn = g.build_state(device, width, layers, batch, seed=1)
    step_fn()
    g.sync(device)
    out: dict[str, Any] = {"variant": variant, "fill": fill}
    filler = None
    if fill == "full":
        filler, out["gpu"] = fill_gpu(device, int(free_gib * GiB))
    gc.collect()
    path = Path(root) / SAVED_AS[variant]
    out["cache"] = g.drop_page_cache(drop, [path])
    if variant.startswith("tiercheck"):
        out.update(_tiercheck_restore(model, opt, path, device, in_place=None if variant == "tiercheck" else False))
    else:
        out.update(g.restore_into(variant, model, opt, path, STEP, device))
    if device.startswith("cuda"):
        import torch

        out["gpu_free_bytes_after"] = torch.cuda.mem_get_info(device)[0]
    del filler
    out.update(g.compare(want, g.fingerprint(model, opt)))
    h.log(f"{variant} ({fill}): restore {out['restore_s']:.2f}s, bit-identical {out['bit_identical']}")
    return out


def _tiercheck_restore(model: Any, opt: Any, root: Path, device: str, *, in_place: bool | None) -> dict[str, Any]:
    import tiercheck

    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    ck = tiercheck.Checkpointer({"model": model, "optim": opt}, local=str(root),
                                retention=tiercheck.RetentionOptions(keep_last=None))  # fmt: skip
    out["construct_s"] = time.perf_counter() - t0
    try:
        got = ck.restore(STEP, in_place=in_place)
        g.sync(device)
        out["restore_s"] = time.perf_counter() - t0
        if got != STEP:
            raise AssertionError(f"restore() returned step {got}, expected {STEP}")
        out["tiercheck_stats"] = {k: v for k, v in ck.stats().items() if k.startswith("restore_")}
    finally:
        ck.close()
    return out


# ------------------------------------------------------------------------------------------
# Summary and table
# ------------------------------------------------------------------------------------------


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Per fill and variant: the median restore time, its bandwidth against the cold read's, and
    its ratio to torch_checkpointing's and dcp.load's; and the issue's targets."""
    state = report["config"]["state_bytes"]
    cold = h.median([r.get("cold_read", {}).get("gib_s") for r in report["rounds"]])
    rows: dict[str, dict[str, Any]] = {}
    for fill in FILLS:
        times = {v: [r[fill][v]["restore_s"] for r in report["rounds"] if "restore_s" in r.get(fill, {}).get(v, {})]
                 for v in VARIANTS}  # fmt: skip
        med = {v: statistics.median(ts) if ts else None for v, ts in times.items()}
        for v in VARIANTS:
            if med[v] is None:
                continue
            rows[f"{fill}/{v}"] = {
                "restore_s": med[v],
                "restore_s_all": times[v],
                "gib_s": state / GiB / med[v],
                "of_cold_read": h.ratio(state / GiB / med[v], cold),
                "vs_torch_checkpointing": h.ratio(med[v], med["torch_checkpointing"]),
                "vs_dcp_load": h.ratio(med[v], med["dcp.load"]),
            }
    pinned = report.get("pinned") or {}
    row = rows.get
    targets = {
        "full_default_of_cold_read>=0.9": (row("full/tiercheck") or {}).get("of_cold_read"),
        "full_default_vs_torch_checkpointing<=1.0": (row("full/tiercheck") or {}).get("vs_torch_checkpointing"),
        "full_in_place_false_vs_torch_checkpointing<=1.1": (row("full/tiercheck.in_place=False") or {}).get(
            "vs_torch_checkpointing"
        ),
        "room_default_of_cold_read>=0.9": (row("room/tiercheck") or {}).get("of_cold_read"),
        "pinned_over_capacity_bytes<=2MiB": pinned.get("pinned_over_capacity_bytes"),
    }
    return {"cold_read_gib_s": cold, "rows": rows, "targets": targets}


def render(report: dict[str, Any]) -> str:
    s = report.get("summary") or {}
    rows = []
    for key, r in (s.get("rows") or {}).items():
        fill, variant = key.split("/", 1)
        rows.append([fill, variant, h.fmt(r["restore_s"]), h.fmt(r["gib_s"]), h.fmt(r["of_cold_read"]),
                     h.fmt(r["vs_torch_checkpointing"]), h.fmt(r["vs_dcp_load"])])  # fmt: skip
    out = [
        f"GPU restart, {report['device']}: {h.fmt_bytes(report['config']['state_bytes'])} state, "
        f"cold read {h.fmt(s.get('cold_read_gib_s'))} GiB/s (median of {len(report['rounds'])} round(s))",
        "",
        h.table(["GPU", "restore", "s (median)", "GiB/s", "x cold read", "x torch_checkpointing", "x dcp.load"], rows),
    ]
    p = report.get("pinned") or {}
    if p.get("pinned_per_snapshot_byte") is not None:
        out += ["", h.table(
            ["snapshot", "pool capacity", "pool pinned", "pinned - capacity", "torch's pin_memory would lock"],
            [[h.fmt_bytes(p["snapshot_bytes"]), h.fmt_bytes(p["pool_capacity_bytes"]),
              h.fmt_bytes(p["pool_pinned_bytes"]), h.fmt_bytes(p["pinned_over_capacity_bytes"]),
              h.fmt_bytes(p["torch_pinned_would_be_bytes"])]],
        )]  # fmt: skip
    out += ["", "targets: " + ", ".join(f"{k} {h.fmt(v) if isinstance(v, float) else v}" for k, v in
                                        (s.get("targets") or {}).items())]  # fmt: skip
    return "\n".join(out)


# ------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny sizes (a few MiB), no cache drops: CI")
    p.add_argument("--out", default=str(h.RESULTS_DIR), help="directory of the JSON (default bench/results)")
    p.add_argument("--dir", help="parent of the scratch checkpoints, on the disk to measure (default bench/results)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda when available")
    p.add_argument("--size-gib", type=float, default=3.75, help="state size (parameters + AdamW moments)")
    p.add_argument("--width", type=int, default=0, help="Linear width (default 8192; dry run 256)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every restore (default 2)")
    p.add_argument("--free-gib", type=float, default=1.0, help="GPU memory left free by the 'full' fill (default 1)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), metavar="V",
                   help=f"subset of: {' '.join(VARIANTS)}")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=240, help="past this, remaining restores are skipped")
    p.add_argument("--no-drop-caches", action="store_true", help="never drop the page cache")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # the parent never creates a CUDA context
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available() and args.device != "cpu"
    device, dry = ("cuda" if cuda else "cpu"), args.dry_run
    width = args.width or (256 if dry else 8192)
    layers = 4 if dry else g.layers_for(args.size_gib, width)
    batch = 32 if dry else 2048
    drop = not (args.no_drop_caches or dry)
    budget = g.Budget(args.budget_s)
    name = g.device_name(device)
    tckpt = importlib.util.find_spec("torch_checkpointing") is not None
    variants = [v for v in args.variants if tckpt or v != "torch_checkpointing"]
    fills = [f for f in FILLS if cuda or f != "full"]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"gpu-restart-{g.slug(name)}{'-dry-run' if dry else ''}.json"
    report: dict[str, Any] = {
        "device": name,
        "status": "running",
        "config": {
            "dry_run": dry,
            "device": device,
            "width": width,
            "layers": layers,
            "batch": batch,
            "state_bytes": layers * (width * width + width) * 12,
            "rounds": args.rounds,
            "free_gib": args.free_gib,
            "variants": variants,
            "fills": fills,
            "drop_caches": drop,
            "argv": sys.argv[1:] if argv is None else list(argv),
        },
        "machine": {},
        "saves": {},
        "pinned": {},
        "rounds": [],
        "notes": [],
        "skipped": [],
    }
    if not tckpt:
        report["notes"].append("torch_checkpointing is not installed: its rows are skipped")
    if not cuda:
        report["notes"].append("no CUDA device: the 'full' GPU rows and the pinned bytes are skipped")
    scratch_parent = Path(args.dir) if args.dir else h.RESULTS_DIR
    scratch_parent.mkdir(parents=True, exist_ok=True)
    h.log(f"device {name} ({device}); JSON: {json_path}")
    with contextlib.suppress(Exception):
        report["machine"] = h.machine_info(scratch_parent)
    with h.scratch_dir(scratch_parent, "gpu_restart-", args.keep) as scratch:
        common = {"device": device, "width": width, "layers": layers, "batch": batch, "root": str(scratch)}
        saved = h.run_worker(__file__, "save_all", {**common, "tckpt": tckpt}, budget.timeout(cap=400))
        want = saved.pop("fingerprint", None)
        report["saves"], report["pinned"] = saved.get("saves", saved), saved.get("pinned", {})
        if want is None:
            h.log(f"saving FAILED: {saved.get('error')}\n{saved.get('traceback', '')}")
            report["status"] = "failed"
            h.write_json(json_path, report)
            return 1
        for n in range(args.rounds):
            report["rounds"].append(one_round(report, n, common, want, variants, fills, drop, args, budget))
            report["summary"] = summarize(report)
            h.write_json(json_path, report)
    report["status"] = "complete" if not report["skipped"] else "partial (budget)"
    report["summary"] = summarize(report)
    report["table"] = render(report)
    h.write_json(json_path, report)
    print(report["table"])
    bad = [f"{f}/{v} round {i}" for i, r in enumerate(report["rounds"]) for f in fills for v, x in r.get(f, {}).items()
           if x.get("error") or x.get("bit_identical") is False]  # fmt: skip
    if bad:
        h.log(f"FAILED: {', '.join(bad)}")
    return 1 if bad else 0


def one_round(
    report: dict[str, Any],
    n: int,
    common: dict[str, Any],
    want: dict[str, list[int]],
    variants: list[str],
    fills: list[str],
    drop: bool,
    args: argparse.Namespace,
    budget: g.Budget,
) -> dict[str, Any]:
    """A cold read of tiercheck's files, then every fill and variant's fresh-process restore."""
    files = sorted(str(p) for p in (Path(common["root"]) / "tiercheck").rglob("*") if p.is_file())
    out: dict[str, Any] = {"cold_read": h.measure_cold_read(files, drop=drop)}
    for fill in fills:
        out[fill] = {}
        for variant in variants:
            if budget.left() <= 0:
                report["skipped"].append(f"round {n} {fill}/{variant}: the {args.budget_s:.0f} s budget was spent")
                continue
            kw = {**common, "variant": variant, "fill": fill, "want": want, "drop": drop, "free_gib": args.free_gib}
            try:
                res = h.run_worker(__file__, "restart", kw, budget.timeout())
            except Exception as exc:  # the parent's own bookkeeping: recorded, the next restore still runs
                res = {"error": f"parent: {type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            if "error" in res:
                h.log(f"{fill}/{variant} FAILED: {res['error']}\n{res.get('traceback', '')}")
            out[fill][variant] = res
    return out


if __name__ == "__main__":
    sys.exit(main())
