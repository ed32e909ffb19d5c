#!/usr/bin/env python
"""Replication benchmark, one run: restoring a wiped node from its peer's copy vs from S3 (SeaweedFS on
loopback), and the training stall that ``replication=`` adds. bench/README.md ("Replication benchmark").

    .venv/bin/python bench/replication_bench.py            # ~0.5 GiB states, 3 repeats
    .venv/bin/python bench/replication_bench.py --quick    # ~0.1 GiB, 1 repeat, about a minute

1. Restore: 8 ranks on 4 simulated nodes save ``--gib`` with ``ReplicationOptions(replicas=1)`` and
   ``remote=`` S3, until replicated and drained; node 1 is wiped, and each repeat restores (a) with node 1's
   copy on node 2, (b) with every replica moved aside (node 1's shards from S3), (c) as (a) without ``remote=``.
2. Training: 4 ranks, 1 per node, MLP + AdamW each, saving to a local tier with and without ``replication=``.
3. References: memcpy, fsync'd write, gloo send/recv on loopback, SeaweedFS put/get.
Markdown tables on stdout, progress on stderr; medians over repeats; every restore checked bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness as h
import torch
import torch.distributed as dist
from torch import nn

import tiercheck
from tests.distributed import run_ranks
from tests.servers import SeaweedS3, open_s3fs

GiB, MiB = h.GiB, h.MiB
NODES, PER_NODE, WIPED = 4, 2, 1
RF1 = tiercheck.ReplicationOptions(replicas=1)
TENSORS, COLS, D, BATCH = 8, 1024, 512, 32
VARIANTS = {  # where the wiped node's shards come from
    "peer": "(a) peer's copy (node 2), remote= set",
    "s3": "(b) S3 (SeaweedFS), replicas moved aside",
    "peer-alone": "(c) peer's copy, no remote= (as the tests)",
}
LIMITS = {
    "memcpy into a preallocated buffer": "memcpy",
    "fsync'd sequential write": "disk",
    "gloo send/recv, loopback, 2 ranks": "gloo",
    "SeaweedFS put, one object (s3fs)": "s3_put",
    "SeaweedFS get, one object (s3fs, page cache dropped)": "s3_get",
}


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def cpu_s() -> tuple[float, float]:
    """CPU seconds so far: the machine's busy time (/proc/stat), and this process tree's (itself, its reaped
    children, and each live child with its own reaped children: the fork server's ranks)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    ours = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    for children in Path("/proc/self/task").glob("*/children"):
        for pid in children.read_text().split():
            with contextlib.suppress(OSError, ValueError):
                ours += sum(int(x) for x in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11:15]) / hz
    return (sum(f) - f[3] - f[4] - f[7]) / hz, ours


def shard_state(rank: int, world: int, per_rank: int, fill: bool = False) -> dict[str, Any]:
    """This rank's rows of ``TENSORS`` global fp32 tensors; random (seeded by tensor and rank) or zeros."""
    rows = max(1, per_rank // (TENSORS * COLS * 4))
    model = {}
    for i in range(TENSORS):
        g = torch.Generator().manual_seed(1000 * i + rank)
        local = torch.zeros(rows, COLS) if fill else torch.randn(rows, COLS, generator=g)
        model[f"w{i}"] = tiercheck.Shard(local, global_shape=(world * rows, COLS), offsets=(rank * rows, 0))
    return {"model": model}


def _save_ranks(rank: int, world: int, root: str, per_rank: int, url: str, opts: dict[str, Any]) -> dict[str, Any]:
    state, local, replication = shard_state(rank, world, per_rank), f"{root}/node{rank // PER_NODE}", RF1
    with tiercheck.Checkpointer(state, local=local, remote=url, remote_options=opts, replication=replication) as ck:
        t0, handle = time.perf_counter(), ck.save(1)
        out: dict[str, Any] = {"replicated": handle.replicated.result(600), "drained": handle.drained.result(600)}
        status = ck.status()["replication"]
        out.update(durable_s=handle.timings["durable_s"], drained_s=time.perf_counter() - t0)
        return {**out, "replication_s": status["last_replication_s"], "sent": status["bytes_sent"]}


def _restore_ranks(rank: int, world: int, root: str, per_rank: int, url: str, opts: dict[str, Any]) -> dict[str, Any]:
    state = shard_state(rank, world, per_rank, fill=True)
    with tiercheck.Checkpointer(state, local=f"{root}/node{rank // PER_NODE}", remote=url, remote_options=opts) as ck:
        dist.barrier()
        t0, step = time.perf_counter(), ck.restore()
        took, stats = time.perf_counter() - t0, ck.stats()
    want = shard_state(rank, world, per_rank)["model"]
    for k, shard in state["model"].items():
        if not torch.equal(shard.local, want[k].local):
            raise AssertionError(f"rank {rank}: restored {k} is not what was saved")
    keys = ("restore_bytes_read", "restore_chunks_received", "restore_remote_reads")
    return {"step": step, "s": took, **{k: stats.get(k, 0) for k in keys}}


def move_replicas(root: Path, stash: Path, back: bool) -> int:
    """Move every node's replicas (marker first, then the copied files) to ``stash``, or back (marker last)."""
    moved = 0
    for marker in sorted((stash if back else root).glob("node*/step-*/REPLICA-*.json")):
        rel = marker.relative_to(stash if back else root)
        names = [*json.loads(marker.read_text())["files"], marker.name]
        for name in names if back else reversed(names):
            src, dst = (stash, root) if back else (root, stash)
            (dst / rel.parent / name).parent.mkdir(parents=True, exist_ok=True)
            (src / rel.parent / name).rename(dst / rel.parent / name)
            moved += 1
    return moved


def part_restore(args: argparse.Namespace, scratch: Path, server: SeaweedS3, rep: dict[str, Any]) -> None:
    world = NODES * PER_NODE
    per_rank = int(args.gib * GiB) // world
    root, stash, url, opts = scratch / "job", scratch / "stash", "s3://bench/run", server.storage_options()
    h.log(f"part 1: {world} ranks save {per_rank * world / GiB:.2f} GiB, replicas=1, drained to {url}")
    saved = run_ranks(_save_ranks, world, str(root), per_rank, url, opts, start_method="forkserver", timeout=900)
    if not all(r["replicated"] and r["drained"] for r in saved[::PER_NODE]):
        raise RuntimeError(f"a node did not replicate or drain: {saved}")
    rep["save"] = saved
    variants = list(VARIANTS)
    rep["restores"] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            if v == "s3":
                h.log(f"  moved {move_replicas(root, stash, back=False)} replica files aside")
            shutil.rmtree(root / f"node{WIPED}", ignore_errors=True)  # what a restore left there: nothing to count
            dropped = bool(h.drop_caches(not args.no_drop_caches))
            where = (url, opts) if v != "peer-alone" else (None, None)
            res = run_ranks(_restore_ranks, world, str(root), per_rank, *where, start_method="forkserver", timeout=900)
            if v == "s3":
                move_replicas(root, stash, back=True)
            wiped = res[WIPED * PER_NODE : (WIPED + 1) * PER_NODE]
            remote = sum(x["restore_remote_reads"] for x in res)
            if any(x["step"] != 1 for x in res) or (v == "s3") != (remote > 0):
                raise AssertionError(f"{v} restore: steps {[x['step'] for x in res]}, {remote} remote reads")
            if v != "s3" and any(x["restore_bytes_read"] or not x["restore_chunks_received"] for x in wiped):
                raise AssertionError(f"the wiped node's ranks did not get every chunk from a peer: {wiped}")
            rep["restores"][v].append({"ranks": res, "dropped": dropped})
            h.log(f"  restore, {v}: {max(x['s'] for x in res):.2f}s (max over ranks), bit-identical")
        variants.reverse()  # alternate the order: drift hits the variants alike


def _train_ranks(rank: int, world: int, root: str, per_rank: int, every: Any, saves: int, replicate: bool) -> Any:
    blocks = max(1, round(per_rank / (12 * (8 * D * D + 5 * D))))  # 4 bytes x (weight + 2 AdamW moments)
    with torch.device("meta"):  # materialised below: nn.Linear's default init is slow
        model = nn.Sequential(
            *[nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)) for _ in range(blocks)]
        )
    model.to_empty(device="cpu")
    with torch.no_grad():
        g = torch.Generator().manual_seed(rank)
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, sync = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(rank)), torch.zeros(1)

    def step() -> float:
        t0 = time.perf_counter()
        model(x).pow(2).mean().backward()
        dist.all_reduce(sync)  # in step with the others, as data parallel's gradient all-reduce keeps ranks
        opt.step()
        opt.zero_grad(set_to_none=False)
        return time.perf_counter() - t0

    step(), step()  # AdamW's moments exist from here on
    if isinstance(every, float):  # seconds between saves: in steps, the same on every rank
        slowest = torch.tensor([_med([step() for _ in range(3)])])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        every = max(4, math.ceil(every / slowest.item()))
    state = {f"model{rank}": model, f"optim{rank}": opt}  # every byte this rank's own (PP-like)
    replication = RF1 if replicate else None
    out: dict[str, Any] = {"steps": [], "blocks": [], "durable": [], "repl_s": [], "overlapped": 0, "every": every}
    with tiercheck.Checkpointer(state, local=f"{root}/node{rank}", replication=replication) as ck:
        handles: list[tiercheck.SaveHandle] = []

        def busy() -> bool:
            return any(not (h.committed.done() and h.replicated.done()) for h in handles)

        dist.barrier()
        t_loop = time.perf_counter()
        for i in range(every * saves + every):
            if i % every == 0 and len(handles) < saves:
                out["overlapped"] += busy()
                t0 = time.perf_counter()
                handles.append(ck.save(len(handles) + 1))
                out["blocks"].append(time.perf_counter() - t0)
                if replicate:  # the future resolves after last_replication_s is set for its step
                    handles[-1].replicated.add_done_callback(
                        lambda f: out["repl_s"].append(ck.status()["replication"]["last_replication_s"])
                    )
            inflight = busy()
            out["steps"].append((step(), inflight))
        out["loop_s"] = time.perf_counter() - t_loop
        for h in handles:
            h.wait()
            h.replicated.result(timeout=600)
            out["durable"].append(h.timings["durable_s"])
        status = ck.status()["replication"]
        out["sent_per_save"] = status["bytes_sent"] / saves if status else 0
    return out


def part_train(args: argparse.Namespace, scratch: Path, rep: dict[str, Any]) -> None:
    per_rank = int(args.train_gib * GiB) // NODES
    rep["train"] = {"none": [], "replicas=1": []}
    # Room for a save and its copy (twice the state through the one disk of all 4 "nodes"), 4x over; in
    # steps, as the first launch's ranks time them, for every launch.
    every: float | int = args.every or max(2.0, 4 * 2 * per_rank * NODES / rep["limits"]["disk"])
    what = f"{every} steps" if args.every else f"~{every:.1f} s"
    h.log(f"part 2: {NODES} ranks train, {per_rank * NODES / GiB:.2f} GiB of state, a save every {what}")
    for r in range(args.repeats):
        for name in ("none", "replicas=1") if r % 2 == 0 else ("replicas=1", "none"):
            root = scratch / f"train-{r}-{name}"
            res = run_ranks(
                _train_ranks, NODES, str(root), per_rank, every, args.saves, name != "none",
                start_method="forkserver", timeout=900,
            )  # fmt: skip
            shutil.rmtree(root)
            every = res[0]["every"]
            rep["train"][name].append(res)
            flight = _med([s for x in res for s, f in x["steps"] if f])
            h.log(f"  {name}: step with saves in flight {flight:.3f}s, loop {max(x['loop_s'] for x in res):.1f}s")


def _gloo_pair(rank: int, world: int, nbytes: int, repeats: int) -> list[float]:
    buf, times = torch.ones(nbytes, dtype=torch.uint8), []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return times


def part_limits(args: argparse.Namespace, scratch: Path, server: SeaweedS3, rep: dict[str, Any]) -> None:
    n = min(int(args.gib * GiB), 256 * MiB)
    h.log(f"part 3: references on {n / MiB:.0f} MiB")
    memcpy = [n / GiB / h.measure_memcpy(n, max(3, args.repeats))["reused_1t_gib_s"]]
    disk = [h.measure_disk_write(scratch, n, keep=True)["durable_s"] for _ in range(args.repeats)]
    gloo = run_ranks(_gloo_pair, 2, n // 4, max(3, args.repeats), start_method="forkserver")[1]
    put, get, data = [], [], (scratch / "raw-write.bin").read_bytes()
    with open_s3fs(**server.storage_options()) as fs:
        for i in range(args.repeats):
            put.append(h.timed(lambda: fs.pipe(f"bench/ref/blob{i}", data))[0])  # noqa: B023 (called at once)
            h.drop_caches(not args.no_drop_caches)
            got: list[bytes] = []
            get.append(h.timed(lambda: got.append(fs.cat_file(f"bench/ref/blob{i}")))[0])  # noqa: B023
            if got[0] != data:
                raise AssertionError("SeaweedFS returned other bytes")
    rep["limits"] = {
        "memcpy": n / _med(memcpy), "disk": n / _med(disk), "gloo": n / 4 / _med(gloo),
        "s3_put": n / _med(put), "s3_get": n / _med(get),
    }  # fmt: skip


def _row(*cells: Any) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def render(rep: dict[str, Any]) -> str:
    lim, world, saved, leaders = rep["limits"], NODES * PER_NODE, rep["save"], rep["save"][::PER_NODE]
    out = [
        f"{os.cpu_count()} vCPUs; torch {torch.__version__}; {rep['repeats']} repeat(s), medians; other processes "
        f"used {rep['foreign']:.0%} of the CPUs (load average {rep['load'][0]} at the start, {rep['load'][1]} at the end).",
        "",
        "| reference | GiB/s |",
        "|---|---:|",
        *(_row(k, f"{lim[v] / GiB:.2f}") for k, v in LIMITS.items()),
        "",
        f"Restore: {world} ranks on {NODES} nodes, {rep['gib']:.2f} GiB saved (fp32 row shards), node {WIPED} (ranks "
        f"{WIPED * PER_NODE}-{WIPED * PER_NODE + PER_NODE - 1}) wiped. The save: durable "
        f"{_med([r['durable_s'] for r in saved]):.2f} s, replication {_med([r['replication_s'] for r in leaders]):.2f} s "
        f"per node ({_med([r['sent'] for r in leaders]) / MiB:.0f} MiB sent), drained to S3 after "
        f"{max(r['drained_s'] for r in saved):.2f} s.",
        "",
        "| wiped node's shards from | restore s (max over ranks) | wiped ranks' restore s | chunks read from S3 | GiB/s |",
        "|---|---:|---:|---:|---:|",
    ]
    wall = {}
    for v, label in VARIANTS.items():
        runs = [r["ranks"] for r in rep["restores"][v]]
        wall[v] = _med([max(x["s"] for x in r) for r in runs])
        wiped = _med([max(x["s"] for x in r[WIPED * PER_NODE : (WIPED + 1) * PER_NODE]) for r in runs])
        remote = _med([sum(x["restore_remote_reads"] for x in r) for r in runs])
        out.append(_row(label, f"{wall[v]:.2f}", f"{wiped:.2f}", f"{remote:.0f}", f"{rep['gib'] / wall[v]:.2f}"))
    out += [_row("(a) / (b): peer / S3", f"{wall['peer'] / wall['s3']:.2f}x", "", "", "")]
    out += [_row("(c) / (b)", f"{wall['peer-alone'] / wall['s3']:.2f}x", "", "", ""), ""]
    out += [
        "| rank | node | (a) MiB read | (a) chunks received | (b) MiB read | (b) chunks received | (b) chunks from S3 |"
    ]
    out += ["|---:|---:|---:|---:|---:|---:|---:|"]
    a, b = (rep["restores"][v][-1]["ranks"] for v in ("peer", "s3"))
    for r in range(world):
        cells = [f"{x['restore_bytes_read'] / MiB:.0f} | {x['restore_chunks_received']}" for x in (a[r], b[r])]
        out.append(_row(r, r // PER_NODE, *cells, b[r]["restore_remote_reads"]))
    dropped = all(r["dropped"] for v in rep["restores"].values() for r in v)
    every = sorted({r[0]["every"] for runs in rep["train"].values() for r in runs})
    out += [
        "",
        f"Every restore bit-identical; page cache dropped before each: {'yes' if dropped else 'no'}.",
        "",
        f"Training: {NODES} ranks, 1 per node, each its own MLP + AdamW ({rep['train_gib']:.2f} GiB of state in all), "
        f"a save every {'/'.join(map(str, every))} steps, {rep['saves']} saves per launch, local tier only.",
        "",
        "| replication | save() blocks s | step s, saves in flight | step s, none in flight | in flight / none "
        "| loop s/step | durable s | replication s | MiB sent/save/node | saves due with one in flight |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = {}
    for name, runs in rep["train"].items():
        ranks = [x for r in runs for x in r]
        repl = [s for x in ranks for s in x["repl_s"] if s is not None]

        def steps(xs: list[dict[str, Any]], busy: bool) -> float:
            return _med([s for x in xs for s, f in x["steps"] if f == busy])

        rows[name] = [
            _med([b for x in ranks for b in x["blocks"]]),
            steps(ranks, True),
            steps(ranks, False),
            _med([steps(r, True) / steps(r, False) for r in runs]),  # within a launch: drift cancels
            _med([max(x["loop_s"] / len(x["steps"]) for x in r) for r in runs]),
            _med([d for x in ranks for d in x["durable"]]),
        ]
        more = [f"{_med(repl):.2f}" if repl else "-", f"{_med([x['sent_per_save'] for x in ranks]) / MiB:.0f}"]
        out.append(_row(name, *(f"{v:.3f}" for v in rows[name]), *more, sum(x["overlapped"] for x in ranks)))
    ratios = [f"{a / b:.2f}x" if b > 0 else "-" for a, b in zip(rows["replicas=1"], rows["none"], strict=True)]
    out.append(_row("replicas=1 / none", *ratios, "", "", ""))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="~0.1 GiB states, 1 repeat")
    p.add_argument("--gib", type=float, help="restore part: GiB saved by all ranks (default 0.5, --quick 0.1)")
    p.add_argument("--train-gib", type=float, help="training part: GiB of state, all ranks (default 0.5, --quick 0.1)")
    p.add_argument(
        "--repeats", type=int, help="restores per variant, training launches per variant (default 3, --quick 1)"
    )
    p.add_argument("--every", type=int, help="training steps between saves (default: 4x a save's disk time)")
    p.add_argument("--saves", type=int, default=3, help="saves per training launch")
    p.add_argument("--dir", help="parent of the scratch directory, removed at the end (default: /tmp)")
    p.add_argument("--no-drop-caches", action="store_true")
    p.add_argument("--json", help="also write the raw measurements to this path")
    args = p.parse_args(argv)
    args.gib = args.gib or (0.1 if args.quick else 0.5)
    args.train_gib = args.train_gib or (0.1 if args.quick else 0.5)
    args.repeats = args.repeats or (1 if args.quick else 3)
    t_start, cpu0, load0 = time.perf_counter(), cpu_s(), os.getloadavg()[0]
    rep: dict[str, Any] = {"gib": args.gib, "train_gib": args.train_gib, "repeats": args.repeats, "saves": args.saves}
    scratch = Path(tempfile.mkdtemp(prefix="replication-bench-", dir=args.dir))
    server = SeaweedS3(scratch / "seaweedfs")
    try:
        server.start(timeout=120)
        server.make_bucket("bench")
        h.log(f"{scratch}: SeaweedFS up in {server.start_seconds:.1f}s at {server.endpoint_url}")
        part_limits(args, scratch, server, rep)
        part_restore(args, scratch, server, rep)
        part_train(args, scratch, rep)
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    wall = time.perf_counter() - t_start
    cpu1 = cpu_s()
    rep["foreign"] = max(0.0, (cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])) / (wall * (os.cpu_count() or 1))
    rep["load"] = (f"{load0:.1f}", f"{os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1, default=str))
    print(render(rep), flush=True)
    h.log(f"done in {wall:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
