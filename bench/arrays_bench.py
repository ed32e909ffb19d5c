#!/usr/bin/env python
"""Per-array costs: saving and restoring a state of many small tensors, where every second is
bookkeeping per array and none is bandwidth. bench/README.md ("Many small arrays") has the details.

    .venv/bin/python bench/arrays_bench.py            # 2,000 and 20,000 tensors
    .venv/bin/python bench/arrays_bench.py --quick    # 2,000 tensors, 2 repeats

The state: LayerNorm(256) modules in groups of 50 (a ModuleList of ModuleLists, as a model's
layers are) and their AdamW state: 8 tensors per LayerNorm (weight, bias, and for each its two
moments and step), 1 KiB each but the steps. Some MoE models hold tens of thousands of arrays per rank.

Methods, each in a fresh process: ``torch.save`` of both state dicts to one file (fsync'd, renamed,
directory fsync'd) and ``torch.load`` + ``load_state_dict``; ``dcp.save`` and ``dcp.load`` +
``set_state_dict``; tiercheck (lazy staging): ``save()`` (the time it holds the training thread)
and until durable, restore with a new ``Checkpointer`` (as a restarted job does). Each restore
follows an optimizer step, from a dropped page cache, and is checked bit for bit against the saved
state. Medians over the repeats. Tables on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import harness as h

METHODS = ("torch.save", "dcp", "tiercheck")
GROUP, WIDTH = 50, 256  # LayerNorms per group, and their width


def build(layer_norms: int) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    groups = -(-layer_norms // GROUP)
    model = torch.nn.ModuleList(
        torch.nn.ModuleList(torch.nn.LayerNorm(WIDTH) for _ in range(GROUP)) for _ in range(groups)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step(model, opt)
    return model, opt


def step(model: Any, opt: Any) -> None:
    import torch

    opt.zero_grad()
    x = torch.randn(WIDTH)
    sum(norm(x).sum() for group in model for norm in group).backward()
    opt.step()


def snapshot(model: Any, opt: Any) -> list[Any]:
    out = [t.detach().clone() for t in model.state_dict().values()]
    for state in opt.state.values():
        out += [v.clone() for v in state.values()]
    return out


def worker(method: str, layer_norms: int, root: str, repeats: int, drop: bool, settle_max_s: float) -> dict[str, Any]:
    """Save and restore ``repeats`` times with ``method``; medians, and how many tensors."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import tiercheck

    torch.set_num_threads(2)
    model, opt = build(layer_norms)
    tensors = len(snapshot(model, opt))
    path = Path(root)

    def dcp_state() -> dict[str, Any]:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    def checkpointer() -> Any:
        return tiercheck.Checkpointer(
            {"model": model, "optim": opt},
            local=str(path),
            staging=tiercheck.StagingOptions(mode="lazy"),
            retention=tiercheck.RetentionOptions(keep_last=None),
        )

    tc = checkpointer() if method == "tiercheck" else None
    blocks, durable, restore = [], [], []
    for i in range(repeats):
        step(model, opt)
        want = snapshot(model, opt)
        h.prepare(False, settle_max_s)
        t0 = time.perf_counter()
        if method == "torch.save":
            tmp, final = path / f"{i}.tmp", path / f"{i}.pt"
            with open(tmp, "wb") as f:
                torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            h.fsync_dir(path)
            blocks.append(time.perf_counter() - t0)
        elif method == "dcp":
            dcp.save(dcp_state(), checkpoint_id=path / str(i))
            h.fsync_dir(path / str(i))  # FileSystemWriter fsyncs files, not directories
            h.fsync_dir(path)
            blocks.append(time.perf_counter() - t0)
        else:
            handle = tc.save(i)
            blocks.append(time.perf_counter() - t0)
            handle.committed.result()
        durable.append(time.perf_counter() - t0)

        step(model, opt)  # the restore must bring the saved values back
        if tc is not None:
            tc.close()  # the restore is a restarted job's: a new Checkpointer
        h.prepare(drop, settle_max_s, [path])
        t0 = time.perf_counter()
        if method == "torch.save":
            sd = torch.load(path / f"{i}.pt", weights_only=True)
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])
        elif method == "dcp":
            state = dcp_state()
            dcp.load(state, checkpoint_id=path / str(i))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            tc = checkpointer()
            got = tc.restore()
            assert got == i, f"restore() returned step {got}, expected {i}"
        restore.append(time.perf_counter() - t0)
        if not all(torch.equal(a, b) for a, b in zip(snapshot(model, opt), want, strict=True)):
            raise AssertionError(f"{method}: the restored state differs from the saved one")
    if tc is not None:
        tc.close()
    return {
        "tensors": tensors,
        "blocks_s": statistics.median(blocks),
        "durable_s": statistics.median(durable),
        "restore_s": statistics.median(restore),
        "all_restore_s": restore,
    }


def render(report: dict[str, Any]) -> str:
    lines = [h.machine_line(report["machine"]), ""]
    for size in report["sizes"]:
        rows, ref = [], size["results"].get("torch.save", {})
        tensors = next((r["tensors"] for r in size["results"].values() if "tensors" in r), 0)
        lines.append(f"### {size['layer_norms']:,} LayerNorms: {tensors:,} tensors")
        lines.append("")
        for method, r in size["results"].items():
            if "error" in r:
                rows.append([method, r["error"][:80], "", "", "", "", ""])
                continue
            rows.append([
                method,
                h.fmt(r["blocks_s"], ".3f"),
                h.fmt(r["durable_s"], ".3f"),
                h.fmt(h.ratio(r["durable_s"], ref.get("durable_s"))),
                h.fmt(r["restore_s"], ".3f"),
                h.fmt(1e6 * r["restore_s"] / max(r["tensors"], 1), ".0f"),
                h.fmt(h.ratio(r["restore_s"], ref.get("restore_s"))),
            ])  # fmt: skip
        headers = ["method", "save blocks s", "durable s", "x torch.save", "restore s", "restore us/array", "x torch"]
        lines += [h.table(headers, rows), ""]
        for method, r in size["results"].items():
            lines += h.noise_warnings(f"{method} restore", r.get("foreign_load"), r.get("all_restore_s", ()))
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    h.common_args(p, settle_s=5.0)
    p.add_argument("--layer-norms", type=int, nargs="+", help="states to measure (default 250 2500; quick 250)")
    p.add_argument("--repeats", type=int, default=0, help="saves and restores per method (default 3; quick 2)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--from-json", metavar="PATH", help="only re-print the tables from a saved JSON")
    args = p.parse_args(argv)
    if args.from_json:
        print(render(json.loads(Path(args.from_json).read_text())))
        return 0
    sizes = args.layer_norms or ([250] if args.quick else [250, 2500])
    repeats = args.repeats or (2 if args.quick else 3)
    report: dict[str, Any] = {"machine": h.machine_info(args.dir or "."), "sizes": []}
    failed = False
    with h.scratch_dir(args.dir, "arrays-", keep=args.keep) as scratch:
        for n in sizes:
            results = {}
            for method in args.methods:
                h.log(f"{n} LayerNorms: {method}")
                root = scratch / f"{method}-{n}"
                root.mkdir()
                results[method] = h.run_worker(
                    __file__,
                    "worker",
                    {"method": method, "layer_norms": n, "root": str(root), "repeats": repeats,
                     "drop": not args.no_drop_caches, "settle_max_s": args.settle_max_s},
                )  # fmt: skip
                r = results[method]
                failed |= "error" in r
                h.log(
                    f"  {r['error']}"
                    if "error" in r
                    else f"  save blocks {r['blocks_s']:.3f} s, restore {r['restore_s']:.3f} s"
                )
            report["sizes"].append({"layer_norms": n, "results": results})
    if args.json:
        h.write_json(args.json, report)
    print(render(report))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
