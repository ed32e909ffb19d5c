#!/usr/bin/env python
"""DCP benchmark: ``torch.distributed.checkpoint.async_save`` with its ``FileSystemWriter`` and with tiercheck's
``TiercheckWriter``, in one run, on a CPU training loop. bench/README.md ("DCP benchmark") has the details.

    .venv/bin/python bench/dcp_bench.py            # ~1 GiB of training state, 3 repeats
    .venv/bin/python bench/dcp_bench.py --quick    # ~0.25 GiB

One process, one rank (gloo, world size 1); the state is an MLP's and its AdamW's state dicts. Methods:
``FileSystemWriter`` on THREAD and PROCESS, one ``TiercheckWriter`` on THREAD (``checkpoint_id`` = step), rounds
alternating between them. A round: a step with nothing in flight, ``async_save`` ("blocks"), training steps
until the save is durable, one more step. "steps in flight +" is those steps' excess over the mean of the
steps around them; "stall" = blocks + that. "durable" ends when the future resolves (FileSystemWriter: plus
an fsync of the checkpoint directory and its parent, which it skips). Round 0 is reported apart ("first"),
medians of the rest. Restore: ``dcp.load`` into zeroed tensors, page cache dropped first (root only), checked
bit for bit against the state saved. Limits, same run: memcpy and fsync'd sequential write of the state's size.
Tables on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import harness as h
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from tiercheck.integrations.dcp import TiercheckReader, TiercheckWriter

GiB, MiB = h.GiB, h.MiB
D, BATCH, SEED, STEP0 = 1024, 16, 1234, 1000
METHODS = {  # name: (writer, executor, label)
    "fs-thread": ("fs", AsyncCheckpointerType.THREAD, "FileSystemWriter, THREAD"),
    "tiercheck-thread": ("tiercheck", AsyncCheckpointerType.THREAD, "TiercheckWriter, THREAD"),
    "fs-process": ("fs", AsyncCheckpointerType.PROCESS, "FileSystemWriter, PROCESS"),
}


def our_cpu_s() -> float:
    """CPU seconds of this process, its reaped children and its live ones (DCP's PROCESS daemon)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    live = 0
    for children in Path("/proc/self/task").glob("*/children"):
        for pid in children.read_text().split():
            with contextlib.suppress(OSError, ValueError):  # exited meanwhile: in RUSAGE_CHILDREN once reaped
                live += sum(int(x) for x in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13])
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + live / os.sysconf("SC_CLK_TCK")


def measure_limits(root: Path, nbytes: int, repeats: int) -> dict[str, Any]:
    gib_s = h.measure_memcpy(nbytes, max(3, repeats))
    memcpy = {int(k[7:-7]): nbytes / GiB / v for k, v in gib_s.items() if k.startswith("reused_")}
    disk = [h.measure_disk_write(root, nbytes)["durable_s"] for _ in range(repeats)]
    return {"bytes": nbytes, "memcpy_s": memcpy, "disk_s": statistics.median(disk)}


def build(gib: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    n_blocks = max(1, round(gib * GiB / (12 * (8 * D * D + 5 * D))))  # 4 bytes x (weight + 2 moments)
    torch.manual_seed(SEED)
    with torch.device("meta"):  # materialised below: nn.Linear's default init costs seconds
        layers = [nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)) for _ in range(n_blocks)]
        model = nn.Sequential(*layers)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    x = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(step))
    t0 = time.perf_counter()
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return time.perf_counter() - t0


def tree_map(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: tree_map(fn, v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(tree_map(fn, v) for v in obj)
    return obj


def leaves(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    tree_map(out.append, obj)
    return out


def assert_identical(got: Any, want: Any, where: str = "state") -> None:
    """Raise (even under ``python -O``) unless ``got`` is bit for bit ``want``."""
    if isinstance(want, torch.Tensor):
        same = isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        same = isinstance(got, dict) and got.keys() == want.keys()
        for k in want if same else ():
            assert_identical(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list | tuple):
        same = isinstance(got, list | tuple) and len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want, strict=True) if same else ()):
            assert_identical(a, b, f"{where}[{i}]")
    else:
        same = got == want
    if not same:
        raise AssertionError(f"restored {where} is not what was saved")


def save_round(m: dict[str, Any], r: int, model: nn.Module, opt: torch.optim.Optimizer, step: int, last: bool) -> int:
    """One checkpoint of method ``m`` amid training; returns the number of training steps taken."""
    kind, executor, _ = METHODS[m["name"]]
    ckpt_id = STEP0 + r
    path = m["dir"] / f"step-{ckpt_id}"
    if kind == "fs" and r > 0:
        shutil.rmtree(m["dir"] / f"step-{ckpt_id - 1}")  # the restore reads the last one only
    os.sync()
    before = train_step(model, opt, step)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    if last:  # into buffers allocated before round 0: a fresh allocation here would slow the staging copy
        buffers = iter(m["buffers"])
        m["saved"] = tree_map(lambda t: next(buffers).copy_(t), state)
    done: dict[str, Any] = {}
    event = threading.Event()

    def on_done(fut: Any) -> None:
        try:
            fut.result()
            if kind == "fs":  # FileSystemWriter fsyncs files, not directories
                h.fsync_dir(path)
                h.fsync_dir(m["dir"])
        except BaseException as e:
            done["error"] = e
        done["t"] = time.perf_counter()
        event.set()

    t0 = time.perf_counter()
    fut = dcp.async_save(
        state,
        storage_writer=m["writer"] or dcp.FileSystemWriter(path),
        checkpoint_id=str(ckpt_id) if m["writer"] else None,  # the step; an int works too (DCP types it str)
        async_checkpointer_type=executor,
    )
    blocks = time.perf_counter() - t0
    if isinstance(fut, AsyncSaveResponse):  # only with a stager that stages asynchronously, not these
        fut = fut.upload_completion
    fut.add_done_callback(on_done)
    inflight = [train_step(model, opt, step + 1)]
    while not event.is_set():  # train on while the save is in flight, as a training loop would
        inflight.append(train_step(model, opt, step + len(inflight) + 1))
    if "error" in done:
        raise done["error"]
    after = train_step(model, opt, step + len(inflight) + 1)
    rnd = {"blocks": blocks, "before": before, "inflight": inflight, "after": after, "durable": done["t"] - t0}
    rnd["steps+"] = sum(inflight) - len(inflight) * (before + after) / 2
    rnd["stall"] = blocks + rnd["steps+"]
    m["rounds"].append(rnd)
    h.log(
        f"  {m['name']} round {r}{' (warm-up)' if r == 0 else ''}: blocks {blocks:.2f}s, {len(inflight)} steps in "
        f"flight {sum(inflight):.2f}s (before {before:.2f}s, after {after:.2f}s), durable {rnd['durable']:.2f}s"
    )
    return len(inflight) + 2


def restore(m: dict[str, Any], last_id: int, target: Any, args: argparse.Namespace) -> None:
    """One ``dcp.load`` of the method's last checkpoint into zeroed tensors, page cache dropped first."""
    tree_map(lambda t: t.zero_(), target)
    m["dropped"].append(bool(h.drop_caches(not args.no_drop_caches)))
    fs = METHODS[m["name"]][0] == "fs"
    reader = dcp.FileSystemReader(m["dir"] / f"step-{last_id}") if fs else TiercheckReader(local=m["dir"])
    t = h.timed(lambda: dcp.load(target, storage_reader=reader, checkpoint_id=None if fs else str(last_id)))[0]
    assert_identical(target, m["saved"], f"{m['name']} state")
    m["restore"].append(t)
    h.log(f"  {m['name']} restore: {t:.2f}s, bit-identical")


def render(rep: dict[str, Any]) -> str:
    def med(m: dict[str, Any], key: str) -> float:
        return statistics.median(r[key] for r in m["rounds"][1:])

    lim, gb, lines = rep["limits"], rep["state_bytes"] / GiB, []
    lines += [
        f"{rep['machine']}; torch {torch.__version__}; other processes used {rep['foreign_cpu']:.0%} of the CPUs "
        f"(load average {rep['loadavg'][0]} at the start, {rep['loadavg'][1]} at the end).",
        f"State: {rep['blocks']} MLP blocks + AdamW, {rep['params'] / 1e6:.0f}M parameters, {gb:.2f} GiB of tensors; "
        f"training step {rep['step_s']:.2f} s (median). {rep['repeats']} repeats, medians after 1 warm-up round.",
        "",
        "| reference | time (s) | GiB/s |",
        "|---|---:|---:|",
    ]
    for threads, t in lim["memcpy_s"].items():
        lines.append(f"| memcpy into a preallocated buffer, {threads} thread(s) | {t:.3f} | {gb / t:.1f} |")
    lines += [f"| fsync'd sequential write | {lim['disk_s']:.2f} | {gb / lim['disk_s']:.2f} |", ""]
    cols = ["blocks", "steps+", "stall", "durable"]
    lines += [
        "| method | async_save blocks (s) | steps in flight + (s) | stall (s) | durable (s) | restore (s) | first stall (s) | first durable (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows: dict[str, list[float]] = {}
    for name, m in rep["methods"].items():
        rows[name] = [med(m, c) for c in cols] + [statistics.median(m["restore"])]
        rows[name] += [m["rounds"][0]["stall"], m["rounds"][0]["durable"]]
        lines.append(f"| {METHODS[name][2]} | " + " | ".join(f"{x:.2f}" for x in rows[name]) + " |")
    for base in ("fs-thread", "fs-process"):
        if "tiercheck-thread" in rows and base in rows:
            pairs = zip(rows["tiercheck-thread"], rows[base], strict=True)
            ratios = [a / b if a >= 0 and b > 0 else None for a, b in pairs]  # a stall below noise: no ratio
            cells = " | ".join("-" if x is None else f"{x:.2f}x" for x in ratios)
            lines.append(f"| TiercheckWriter / {METHODS[base][2]} | {cells} |")
    dropped = all(d for m in rep["methods"].values() for d in m["dropped"])
    lines += [
        "",
        f"FileSystemWriter's `sync_files` defaults to {rep['sync_files']} in this torch "
        f"({'every data file and `.metadata` fsync' if rep['sync_files'] else 'nothing fsync'}'d, no directory); "
        "the benchmark fsyncs the checkpoint directory and its parent in the future's callback, inside durable.",
        f"Page cache dropped before each restore: {'yes' if dropped else 'no (not root, or --no-drop-caches)'}. "
        "Every restore was checked bit-identical to the state saved.",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gib", type=float, default=None, help="training state GiB (default 1, --quick 0.25)")
    p.add_argument("--quick", action="store_true", help="~0.25 GiB")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds and restores per method (median)")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    p.add_argument("--dir", help="parent of the scratch directory, removed at the end (default: /tmp)")
    p.add_argument("--no-drop-caches", action="store_true")
    p.add_argument("--json", help="also write the raw measurements to this path")
    args = p.parse_args(argv)
    args.gib = args.gib or (0.25 if args.quick else 1.0)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t_start, cpu0, busy0 = time.perf_counter(), our_cpu_s(), h.busy_s(h.cpu_times())
    load0 = Path("/proc/loadavg").read_text().split()[0]
    h.init_one_rank()
    root = Path(tempfile.mkdtemp(prefix="dcp-bench-", dir=args.dir))
    try:
        model, opt = build(args.gib)
        warm = [train_step(model, opt, s) for s in range(2)]  # AdamW's moments exist from here on
        state = leaves([model.state_dict(), opt.state_dict()])
        state_bytes = sum(t.numel() * t.element_size() for t in state)
        h.log(f"{root}: {state_bytes / GiB:.2f} GiB of state, step {warm[-1]:.2f}s; limits")
        steps: list[float] = []
        rep: dict[str, Any] = {"state_bytes": state_bytes, "repeats": args.repeats, "methods": {}}
        rep["limits"] = measure_limits(root, state_bytes, args.repeats)
        for name in args.methods:
            (root / name).mkdir()
            writer = TiercheckWriter(local=root / name) if METHODS[name][0] == "tiercheck" else None
            rep["methods"][name] = {"name": name, "dir": root / name, "writer": writer}
            rep["methods"][name].update(rounds=[], restore=[], dropped=[], buffers=[torch.zeros_like(t) for t in state])
        step = 10
        for r in range(args.repeats + 1):
            for m in rep["methods"].values():
                step += save_round(m, r, model, opt, step, last=r == args.repeats)
                steps += [m["rounds"][-1]["before"], m["rounds"][-1]["after"]]
        for m in rep["methods"].values():
            if m["writer"] is not None:
                m["writer"].close()  # the restore opens the directory afresh, as after a restart
        target = tree_map(torch.zeros_like, m["saved"])  # one for all methods: the same state layout
        for _ in range(args.repeats):  # interleaved, as the saves: drift hits the methods alike
            for m in rep["methods"].values():
                restore(m, STEP0 + args.repeats, target, args)
        rep["blocks"], rep["params"] = len(list(model.children())), sum(p.numel() for p in model.parameters())
        rep["step_s"] = statistics.median(steps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    wall, ncpu = time.perf_counter() - t_start, os.cpu_count() or 1
    rep["foreign_cpu"] = max(0.0, (h.busy_s(h.cpu_times()) - busy0 - (our_cpu_s() - cpu0)) / (wall * ncpu))
    rep["loadavg"] = (load0, Path("/proc/loadavg").read_text().split()[0])
    rep["sync_files"] = inspect.signature(dcp.FileSystemWriter.__init__).parameters["sync_files"].default
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
    rep["machine"] = f"{ncpu} vCPUs ({cpu})"
    print(render(rep), flush=True)
    if args.json:
        for m in rep["methods"].values():
            m.update(dir=str(m["dir"]), writer=None, saved=None, buffers=None)
        Path(args.json).write_text(json.dumps(rep, indent=1, default=str))
    h.log(f"done in {wall:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
