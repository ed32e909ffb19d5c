#!/usr/bin/env python
"""What lazy staging's safety net costs: each lazily staged tensor's version counter recorded in
``save()`` and compared around its copy (a tensor changed in between fails the save). Many small
tensors are its worst case: a few integer reads per tensor against a copy of 1 KiB.
bench/README.md ("Lazy staging's version checks") has the details.

    .venv/bin/python bench/lazy_check_bench.py            # 2,000 and 20,000 tensors, 40 saves each
    .venv/bin/python bench/lazy_check_bench.py --quick    # 2,000 tensors, 12 saves

The state is arrays_bench's: LayerNorm(256) modules and their AdamW state, 8 tensors a LayerNorm.
One worker (a fresh process) per state runs a training step, then a lazy ``save()``, over and over,
with the checks on and off in turn (A B B A ...: off is ``PendingSave`` recording nothing and comparing
nothing, so drift on a shared host cancels), after 4 untimed saves. Each save is committed before
the next step, outside the timing. Per arm, medians of: ``save()``'s time on the training thread
(where the counters are recorded) and the staging time from the call until the last copy (where
they are compared: what the next ``optimizer.step()`` may wait for). With the checks on, the worker
also times the recording and the comparisons themselves by wrapping ``PendingSave.__post_init__`` and
``PendingSave.changed``. Tables on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import harness as h

GROUP, WIDTH = 50, 256  # LayerNorms per group, and their width
WARMUP = 4


def worker(layer_norms: int, root: str, saves: int) -> dict[str, Any]:
    import torch

    import tiercheck
    from tiercheck.save.handle import PendingSave

    torch.set_num_threads(2)
    torch.manual_seed(0)
    groups = -(-layer_norms // GROUP)
    model = torch.nn.ModuleList(
        torch.nn.ModuleList(torch.nn.LayerNorm(WIDTH) for _ in range(GROUP)) for _ in range(groups)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(WIDTH)

    def train_step() -> None:
        opt.zero_grad()
        sum(norm(x).sum() for group in model for norm in group).backward()
        opt.step()

    spent = {"record": 0.0, "compare": 0.0}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0

        return wrapper

    def record_nothing(job: Any) -> None:
        job.versions = [None] * len(job.leaves)

    on = (timed("record", PendingSave.__post_init__), timed("compare", PendingSave.changed))
    off = (record_nothing, lambda job, tasks, *, copying: None)
    train_step()
    ck = tiercheck.Checkpointer(
        {"model": model, "optim": opt},
        local=root,
        staging=tiercheck.StagingOptions(mode="lazy"),
        retention=tiercheck.RetentionOptions(keep_last=2),
    )
    arms: dict[str, dict[str, list[float]]] = {
        arm: {"held_s": [], "stage_s": [], "record_s": [], "compare_s": []} for arm in ("on", "off")
    }
    for i in range(saves + WARMUP):
        arm = "on" if i % 4 in (0, 3) else "off"
        PendingSave.__post_init__, PendingSave.changed = on if arm == "on" else off  # type: ignore[method-assign, assignment]
        train_step()
        before = dict(spent)
        t0 = time.perf_counter()
        handle = ck.save(i)
        blocked = time.perf_counter() - t0
        handle.staged.result()
        handle.wait()
        if i >= WARMUP:
            got = arms[arm]
            got["held_s"].append(blocked)
            got["stage_s"].append(handle.timings["stage_s"])
            got["record_s"].append(spent["record"] - before["record"])
            got["compare_s"].append(spent["compare"] - before["compare"])
    failed = ck.stats()["failed"]
    ck.close()
    return {
        "tensors": len(model.state_dict()) + sum(len(s) for s in opt.state.values()),
        "failed": failed,
        "saves": saves,
        "arms": {arm: {k: statistics.median(v) for k, v in got.items()} for arm, got in arms.items()},
    }


def render(report: dict[str, Any]) -> str:
    lines = [h.machine_line(report["machine"]), ""]
    rows = []
    for size in report["sizes"]:
        r = size["result"]
        if "error" in r:
            rows.append([str(size["layer_norms"]), r["error"][:80]] + [""] * 8)
            continue
        on, off = r["arms"]["on"], r["arms"]["off"]
        rows.append([
            f"{r['tensors']:,}",
            h.fmt(1e3 * on["record_s"], ".1f"),
            h.fmt(1e3 * on["compare_s"], ".1f"),
            h.fmt(1e9 * (on["record_s"] + on["compare_s"]) / r["tensors"], ".0f"),
            h.fmt(on["held_s"], ".3f"), h.fmt(off["held_s"], ".3f"), h.fmt(h.ratio(on["held_s"], off["held_s"])),
            h.fmt(on["stage_s"], ".3f"), h.fmt(off["stage_s"], ".3f"), h.fmt(h.ratio(on["stage_s"], off["stage_s"])),
        ])  # fmt: skip
    headers = [
        "tensors", "record ms", "compare ms", "ns/tensor",
        "save() s", "save() s off", "ratio", "stage s", "stage s off", "ratio",
    ]  # fmt: skip
    lines += [h.table(headers, rows), ""]
    for size in report["sizes"]:
        lines += h.noise_warnings(f"{size['layer_norms']} LayerNorms", size["result"].get("foreign_load"), ())
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    h.common_args(p, settle_s=5.0)
    p.add_argument("--layer-norms", type=int, nargs="+", help="states to measure (default 250 2500; quick 250)")
    p.add_argument("--saves", type=int, default=0, help="timed saves per state, half with the checks (default 40)")
    p.add_argument("--from-json", metavar="PATH", help="only re-print the table from a saved JSON")
    args = p.parse_args(argv)
    if args.from_json:
        print(render(json.loads(Path(args.from_json).read_text())))
        return 0
    sizes = args.layer_norms or ([250] if args.quick else [250, 2500])
    saves = args.saves or (12 if args.quick else 40)
    report: dict[str, Any] = {"machine": h.machine_info(args.dir or "."), "sizes": []}
    failed = False
    with h.scratch_dir(args.dir, "lazycheck-", keep=args.keep) as scratch:
        for n in sizes:
            root = scratch / f"ckpt-{n}"
            root.mkdir()
            h.prepare(False, args.settle_max_s)
            res = h.run_worker(__file__, "worker", {"layer_norms": n, "root": str(root), "saves": saves})
            failed |= "error" in res or bool(res.get("failed"))
            h.log(f"{n} LayerNorms: " + json.dumps(res)[:400])
            report["sizes"].append({"layer_norms": n, "result": res})
    if args.json:
        h.write_json(args.json, report)
    print(render(report))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
