#!/usr/bin/env python
"""Multi-rank checkpoint benchmark: tiercheck against torch.distributed.checkpoint (DCP), CPU + gloo.

Usage::

    .venv/bin/python bench/dist_bench.py            # ~1 GiB of fp32 global tensors, 1/2/4 ranks (~7-9 min here)
    .venv/bin/python bench/dist_bench.py --quick    # ~0.27 GiB, one timed save/restore per case (~1.5-2.5 min)

One synthetic LLM-like model (column/row-parallel matrices, replicated norms, a vocab-parallel
embedding) is fixed by a seed and kept in a shared-memory file (/dev/shm) that every rank maps: a
rank clones the slice its layout holds, and after every restore the restored tensors are compared
bit for bit (``torch.equal``) with the same slices. Ranks are real processes joined by a gloo
process group (``tests/distributed.py``'s ``run_ranks``, forkserver); each returns its raw
measurements to this process, which prints markdown tables (stdout; progress on stderr) and writes
``bench/results/dist_bench.json``.

1. Save: aggregate throughput for 1, 2 and 4 ranks, data parallel (every rank holds the whole
   model) and tensor parallel (each rank holds 1/N), tiercheck vs ``dcp.save`` vs ``dcp.async_save``.
2. Restore: same-layout and resharding restores (TP=4 -> TP=2, TP=2 -> TP=4), tiercheck with
   ``read_once`` False and True vs ``dcp.load`` of the same tensors into the same layout.
3. The machine's limits in the same run: memcpy, fsync'd sequential write, gloo loopback send.

See bench/README.md ("Distributed benchmark").
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
for _p in (str(REPO), str(BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from save_bench import (  # noqa: E402  (bench/ on sys.path first; no torch import at module level)
    ForeignCpu,
    cpu_delta,
    cpu_times,
    drop_page_cache,
    fsync_dir,
    hwm_bytes,
    machine_info,
    measure_disk_write,
    measure_memcpy,
    settle,
    steal_share,
)

GiB = 1 << 30
MiB = 1 << 20

# Model shape: d=1024, MLP 4d, fused QKV; each layer is 12 d^2 fp32 (48 MiB), the 32k x 1024
# embedding 128 MiB. Every split dimension is divisible by 4, so TP=1/2/4 splits are even and a
# DTensor built with DTensor.from_local(..., [Shard(dim)]) has exactly the rank's slice.
D_MODEL = 1024
VOCAB = 32768
SEED = 1234
SAVE_METHODS = ("tiercheck", "dcp.save", "dcp.async_save")
RESTORE_METHODS = ("tiercheck", "tiercheck.read_once", "dcp.load")
RANKS = (1, 2, 4)


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# The model: global tensors, and which slice a rank holds under a layout
# --------------------------------------------------------------------------------------------


def model_specs(n_layers: int) -> list[dict[str, Any]]:
    """Global tensors as ``{"name", "shape", "split", "offset"}``; split = the TP-sharded dim or None
    (replicated over TP), offset = where the tensor starts in the shared source file (elements)."""
    d = D_MODEL
    specs: list[tuple[str, tuple[int, ...], int | None]] = [("embed.weight", (VOCAB, d), 0)]  # vocab parallel
    for i in range(n_layers):
        p = f"layers.{i}."
        specs += [
            (p + "ln1.weight", (d,), None),
            (p + "ln1.bias", (d,), None),
            (p + "attn.qkv.weight", (3 * d, d), 0),  # column parallel: output rows split
            (p + "attn.proj.weight", (d, d), 1),  # row parallel: input columns split
            (p + "ln2.weight", (d,), None),
            (p + "ln2.bias", (d,), None),
            (p + "mlp.fc1.weight", (4 * d, d), 0),
            (p + "mlp.fc2.weight", (d, 4 * d), 1),
        ]
    specs.append(("final_norm.weight", (d,), None))
    out, offset = [], 0
    for name, shape, split in specs:
        out.append({"name": name, "shape": shape, "split": split, "offset": offset})
        offset += math.prod(shape)
    return out


def n_layers_for(size_bytes: int) -> int:
    layer = 4 * (12 * D_MODEL * D_MODEL + 4 * D_MODEL)
    return max(1, round((size_bytes - 4 * VOCAB * D_MODEL) / layer))


def unique_bytes(specs: Sequence[dict[str, Any]]) -> int:
    return sum(4 * math.prod(s["shape"]) for s in specs)


def create_source(path: Path, specs: Sequence[dict[str, Any]], seed: int) -> None:
    """Random fp32 values for every global tensor, in one file every rank maps (tmpfs: no disk I/O,
    untouched by page-cache drops). Random, so nothing compresses or dedups below the real size."""
    import torch

    total = unique_bytes(specs) // 4
    with open(path, "wb") as f:
        f.truncate(total * 4)
    flat = torch.from_file(str(path), shared=True, size=total, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    for s in specs:
        flat[s["offset"] : s["offset"] + math.prod(s["shape"])].uniform_(-0.02, 0.02, generator=g)
    del flat


def open_source(path: str, specs: Sequence[dict[str, Any]]) -> Any:
    import torch

    return torch.from_file(path, shared=True, size=unique_bytes(specs) // 4, dtype=torch.float32)


def piece(spec: dict[str, Any], layout: str, world: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, shape) of the slice of ``spec``'s global tensor that ``rank`` holds under ``layout``:
    "dp" = every rank holds everything; "tp" = split tensors split evenly over the ranks (Megatron
    TP, rank i holds part i), replicated ones whole."""
    shape = tuple(spec["shape"])
    offs = [0] * len(shape)
    if layout == "dp" or spec["split"] is None or world == 1:
        return tuple(offs), shape
    dim = spec["split"]
    assert shape[dim] % world == 0, (spec["name"], shape, world)
    n = shape[dim] // world
    offs[dim] = rank * n
    return tuple(offs), tuple(n if i == dim else e for i, e in enumerate(shape))


def expected(src: Any, spec: dict[str, Any], offs: tuple[int, ...], shape: tuple[int, ...]) -> Any:
    full = src[spec["offset"] : spec["offset"] + math.prod(spec["shape"])].view(spec["shape"])
    for dim, (o, n) in enumerate(zip(offs, shape, strict=True)):
        full = full.narrow(dim, o, n)
    return full


def build_pieces(
    src: Any, specs: Sequence[dict[str, Any]], layout: str, world: int, rank: int, fill: float | None
) -> dict[str, tuple[Any, tuple[int, ...], dict[str, Any]]]:
    """name -> (this rank's own tensor, its offsets, spec). ``fill``: right shapes, junk values."""
    import torch

    out = {}
    for s in specs:
        offs, shape = piece(s, layout, world, rank)
        if fill is None:
            local = expected(src, s, offs, shape).clone(memory_format=torch.contiguous_format)
        else:
            local = torch.full(shape, fill, dtype=torch.float32)
        out[s["name"]] = (local, offs, s)
    return out


def refill(pieces: dict[str, tuple[Any, tuple[int, ...], dict[str, Any]]], value: float) -> None:
    for local, _, _ in pieces.values():
        local.fill_(value)


def verify(src: Any, pieces: dict[str, tuple[Any, tuple[int, ...], dict[str, Any]]], *, what: str, rank: int) -> int:
    """Every tensor equals its slice of the global tensors, bit for bit; raise otherwise."""
    import torch

    bad = []
    for name, (local, offs, s) in pieces.items():
        if not torch.equal(local, expected(src, s, offs, tuple(local.shape))):
            bad.append(name)
    if bad:
        raise AssertionError(
            f"rank {rank}: {what}: {len(bad)} of {len(pieces)} tensors differ from what was saved, e.g. {bad[:3]}"
        )
    return len(pieces)


def is_sharded(local: Any, spec: dict[str, Any]) -> bool:
    return tuple(local.shape) != tuple(spec["shape"])


def tiercheck_state(pieces: dict[str, Any]) -> dict[str, Any]:
    import tiercheck

    model: dict[str, Any] = {}
    for name, (local, offs, s) in pieces.items():
        sharded = is_sharded(local, s)
        model[name] = tiercheck.Shard(local, global_shape=s["shape"], offsets=offs) if sharded else local
    return {"model": model}


def dcp_state(pieces: dict[str, Any], world: int) -> dict[str, Any]:
    """The same tensors for DCP: each TP slice as a DTensor over a 1-D CPU mesh with Shard(dim) (it
    wraps the rank's own tensor, no copy), replicated tensors as plain tensors (DCP dedups them)."""
    model: dict[str, Any] = {}
    mesh = None
    for name, (local, _offs, s) in pieces.items():
        if is_sharded(local, s):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import DTensor
            from torch.distributed.tensor import Shard as DShard

            if mesh is None:
                mesh = init_device_mesh("cpu", (world,))
            model[name] = DTensor.from_local(local, mesh, [DShard(s["split"])], run_check=False)
        else:
            model[name] = local
    return {"model": model}


def dir_bytes(path: Path, pattern: str = "*") -> int:
    return sum(f.stat().st_size for f in path.rglob(pattern) if f.is_file())


# --------------------------------------------------------------------------------------------
# Rank side (runs in the processes of tests/distributed.py's run_ranks)
# --------------------------------------------------------------------------------------------


def _set_threads(world: int) -> None:
    import torch

    # The cores are shared by the ranks: 2 cores -> 2 threads for 1 rank, 1 each for 2 or 4 ranks.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def _prepare(cfg: dict[str, Any], rank: int) -> None:
    """Before each timed operation: all ranks idle, dirty pages flushed, page cache dropped (root
    only), hypervisor steal settled (see save_bench.settle), then everyone starts together."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        drop_page_cache(cfg["drop_caches"])
        settle(cfg["settle_max_s"])
    dist.barrier()


def rank_save(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Save the state of one layout with every method: a priming save each, then ``n`` rounds of
    timed saves (methods interleaved, so slow drift hits them alike). Before each timed save the
    method's earlier checkpoints are deleted; its last one stays for the restore part."""
    _set_threads(world)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import tiercheck

    specs, layout, root = cfg["specs"], cfg["layout"], Path(cfg["root"])
    src = open_source(cfg["source"], specs)
    pieces = build_pieces(src, specs, layout, world, rank, fill=None)
    out: dict[str, Any] = {
        "rank": rank,
        "state_bytes": sum(p[0].nbytes for p in pieces.values()),
        "first": {},
        "saves": {m: [] for m in cfg["methods"]},
        "errors": {},
    }
    tc_dir = root / "tiercheck" / f"node{rank}"  # one node (local directory) per rank
    dcp_dirs = {"dcp.save": root / "dcp.save", "dcp.async_save": root / "dcp.async_save"}
    sd_dcp = dcp_state(pieces, world)
    ck = tiercheck.Checkpointer(
        tiercheck_state(pieces),
        local=tc_dir,
        staging=tiercheck.StagingOptions(mode="eager"),
        retention=tiercheck.RetentionOptions(keep_last=None),  # deletions happen between timed saves
        distributed=tiercheck.DistributedOptions(timeout_s=cfg["pg_timeout"]),
    )

    def tc_save(step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        h = ck.save(step)
        t1 = time.perf_counter()
        h.wait()  # committed on every rank (and node)
        t2 = time.perf_counter()
        tm = {k: float(v) for k, v in dict(h.timings).items()}
        return {"t0": t0, "t1": t1, "t2": t2, "blocked_s": tm["blocked_s"], "durable_s": tm["durable_s"], "timings": tm}

    def dcp_fsync(path: Path) -> None:
        # FileSystemWriter(sync_files=True) fsyncs each data file and .metadata, not directories.
        if rank == 0:
            fsync_dir(path)
            fsync_dir(path.parent)

    def dcp_save(step: int) -> dict[str, Any]:
        path = dcp_dirs["dcp.save"] / f"step-{step:08d}"
        # DCP's defaults (FileSystemWriter: sync_files=True, thread_count=1) unless --dcp-threads.
        writer = None if cfg["dcp_threads"] == 1 else dcp.FileSystemWriter(path, thread_count=cfg["dcp_threads"])
        t0 = time.perf_counter()
        dcp.save(sd_dcp, checkpoint_id=path, storage_writer=writer)  # returns after rank 0 wrote .metadata
        t1 = time.perf_counter()
        dcp_fsync(path)
        t2 = time.perf_counter()
        return {"t0": t0, "t1": t1, "t2": t2, "blocked_s": t2 - t0, "durable_s": t2 - t0}

    def dcp_async_save(step: int) -> dict[str, Any]:
        path = dcp_dirs["dcp.async_save"] / f"step-{step:08d}"
        t0 = time.perf_counter()
        ret = dcp.async_save(sd_dcp, checkpoint_id=path)  # stages a full copy, then writes on a thread
        t1 = time.perf_counter()
        getattr(ret, "upload_completion", ret).result()
        dcp_fsync(path)
        t2 = time.perf_counter()
        return {"t0": t0, "t1": t1, "t2": t2, "blocked_s": t1 - t0, "durable_s": t2 - t0}

    savers: dict[str, Callable[[int], dict[str, Any]]] = {
        "tiercheck": tc_save,
        "dcp.save": dcp_save,
        "dcp.async_save": dcp_async_save,
    }

    def clean(method: str) -> None:
        if method == "tiercheck":
            for d in tc_dir.glob("step-*"):
                shutil.rmtree(d)
        elif rank == 0:
            shutil.rmtree(dcp_dirs[method], ignore_errors=True)

    def run(method: str, step: int) -> dict[str, Any] | None:
        if method in out["errors"]:
            return None
        try:
            return savers[method](step)
        except Exception as exc:  # e.g. dcp.async_save unsupported: report, go on with the others
            import traceback

            out["errors"][method] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            return None

    for method in cfg["methods"]:
        _prepare(cfg, rank)
        out["first"][method] = run(method, 0)
    for i in range(1, cfg["n"] + 1):
        for method in cfg["methods"]:
            clean(method)
            _prepare(cfg, rank)
            res = run(method, i)
            if res is not None:
                out["saves"][method].append(res)
        if rank == 0:
            _log(f"  save {layout.upper()} x{world}: round {i}/{cfg['n']} done")
    ck.close()
    stats = ck.stats()
    out["tiercheck_plan_bytes"] = int(stats["plan_bytes_per_save"])
    out["tiercheck_pool_bytes"] = int(stats["pool_capacity_bytes"])
    last = cfg["n"]
    out["tiercheck_disk_bytes"] = dir_bytes(tc_dir / f"step-{last:08d}")
    out["tiercheck_chunk_bytes"] = dir_bytes(tc_dir / f"step-{last:08d}", "c.*")
    out["hwm_bytes"] = hwm_bytes()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(dcp_dirs["dcp.async_save"], ignore_errors=True)
        d = dcp_dirs["dcp.save"] / f"step-{last:08d}"
        if d.exists():
            out["dcp_disk_bytes"] = dir_bytes(d)
            out["dcp_rank_bytes"] = [dir_bytes(d, f"__{r}_*.distcp") for r in range(world)]
    dist.barrier()
    return out


def rank_restore(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Restore every case with every method into this world's layouts, timed from a dropped page
    cache, and check the restored tensors bit for bit against the source."""
    _set_threads(world)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import tiercheck

    specs = cfg["specs"]
    src = open_source(cfg["source"], specs)
    out: dict[str, Any] = {"rank": rank, "cases": {}}
    if cfg.get("p2p_bytes") and world >= 2:
        out["p2p"] = _p2p(rank, cfg["p2p_bytes"])
    targets: dict[str, Any] = {}
    for case in cfg["cases"]:
        layout = case["layout"]
        if layout not in targets:
            targets.clear()
            gc.collect()
            targets[layout] = build_pieces(src, specs, layout, world, rank, fill=-1.0)
        pieces = targets[layout]
        res: dict[str, list[dict[str, Any]]] = {m: [] for m in case["methods"]}
        for _ in range(cfg["n"]):
            for method in case["methods"]:
                refill(pieces, -1.0)
                _prepare(cfg, rank)
                if method.startswith("tiercheck"):
                    node = Path(case["tc_root"]) / f"node{rank // case['per_node']}"
                    opts = tiercheck.DistributedOptions(
                        read_once=method.endswith("read_once"), timeout_s=cfg["pg_timeout"]
                    )
                    t0 = time.perf_counter()
                    ck = tiercheck.Checkpointer(tiercheck_state(pieces), local=node, distributed=opts)
                    t1 = time.perf_counter()
                    step = ck.restore()
                    t2 = time.perf_counter()
                    stats = ck.stats()
                    ck.close()
                    if step != case["step"]:
                        raise AssertionError(
                            f"rank {rank}: {case['name']}: restored step {step}, expected {case['step']}"
                        )
                    rec = {
                        "open_s": t1 - t0,
                        "restore_s": t2 - t1,
                        "bytes_read": int(stats.get("restore_bytes_read", 0)),
                        "chunks_received": int(stats.get("restore_chunks_received", 0)),
                    }
                else:
                    sd = dcp_state(pieces, world)
                    t1 = time.perf_counter()
                    dcp.load(sd, checkpoint_id=case["dcp_path"])
                    t2 = time.perf_counter()
                    rec = {"open_s": 0.0, "restore_s": t2 - t1}
                rec["verified_tensors"] = verify(src, pieces, what=f"{case['name']} {method}", rank=rank)
                res[method].append(rec)
            if rank == 0:
                _log(f"  restore x{world} {case['name']}: round done")
        out["cases"][case["name"]] = res
    out["hwm_bytes"] = hwm_bytes()
    dist.barrier()
    return out


def _p2p(rank: int, nbytes: int) -> dict[str, float]:
    """gloo send/recv bandwidth between ranks 0 and 1 over loopback (best of 3)."""
    import torch
    import torch.distributed as dist

    buf = torch.ones(nbytes, dtype=torch.uint8)
    best = math.inf
    for _ in range(4):  # the first is a warm-up (connection set-up, first touch)
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
        dist.barrier()
        best = min(best, time.perf_counter() - t0)
    return {"bytes": nbytes, "s": best, "gib_s": nbytes / GiB / best}


# --------------------------------------------------------------------------------------------
# Parent: orchestration
# --------------------------------------------------------------------------------------------


def launch(fn: Callable[..., Any], world: int, cfg: dict[str, Any], timeout: float) -> tuple[list[Any], dict[str, Any]]:
    """Run ``fn`` on ``world`` gloo ranks; return the per-rank results and the load while it ran."""
    from tests.distributed import run_ranks

    foreign = ForeignCpu()
    cpu0 = cpu_times()
    t0 = time.perf_counter()
    results = run_ranks(fn, world, cfg, timeout=timeout, pg_timeout=cfg["pg_timeout"], start_method="forkserver")
    load = foreign.stop()
    load["wall_s"] = time.perf_counter() - t0
    load["steal_share"] = steal_share(cpu_delta(cpu0, cpu_times()))
    return results, load


def merge_nodes(srcs: Sequence[Path], dst: Path) -> None:
    """Give one restoring node the files of several saving nodes: hard links, and commit markers
    that name the saving ranks of all of them (as a pre-staging copy of their files would)."""
    for src in srcs:
        for f in sorted(src.rglob("*")):
            if f.is_dir() or f.name == ".tiercheck-node":
                continue
            target = dst / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            if f.name == "COMMIT":
                marker = json.loads(f.read_text())
                if target.exists():
                    marker["ranks"] = sorted(set(marker["ranks"]) | set(json.loads(target.read_text())["ranks"]))
                target.write_text(json.dumps(marker))
            elif not target.exists():
                os.link(f, target)


def save_configs(ranks: Sequence[int]) -> list[tuple[int, str]]:
    out = []
    for n in ranks:
        out += [(1, "tp")] if n == 1 else [(n, "dp"), (n, "tp")]
    return out


def restore_cases(world: int, saved: dict[str, dict[str, Any]], root: Path, n_last: int) -> list[dict[str, Any]]:
    """The restore cases of a ``world``-rank job, given the kept checkpoints ``saved[key]``."""
    methods = list(RESTORE_METHODS) if world > 1 else ["tiercheck", "dcp.load"]
    cases: list[dict[str, Any]] = []

    def add(name: str, key: str, layout: str, tc_root: Path, per_node: int, nodes: str) -> None:
        if key not in saved:
            return
        cases.append(
            {
                "name": name,
                "layout": layout,
                "saved": key,
                "tc_root": str(tc_root),
                "per_node": per_node,
                "nodes": nodes,
                "dcp_path": saved[key]["dcp_path"],
                "step": n_last,
                "methods": methods,
            }
        )

    def same(key: str) -> Path:
        return Path(saved[key]["tc_root"]) if key in saved else root

    if world == 1:
        add("same: TP=1 -> TP=1", "tp1", "tp", same("tp1"), 1, "1 node (the saving one)")
        return cases
    add(f"same: TP={world} -> TP={world}", f"tp{world}", "tp", same(f"tp{world}"), 1, f"the {world} saving nodes")
    add(f"same: DP={world} -> DP={world}", f"dp{world}", "dp", same(f"dp{world}"), 1, f"the {world} saving nodes")
    if world == 2 and "tp4" in saved:
        # 2 nodes: node k holds what saving nodes 2k and 2k+1 wrote (hard links + merged COMMIT).
        merged = root / "restore-tp4-on-2"
        src = Path(saved["tp4"]["tc_root"])
        for k in range(2):
            merge_nodes([src / f"node{2 * k}", src / f"node{2 * k + 1}"], merged / f"node{k}")
        add("reshard: TP=4 -> TP=2", "tp4", "tp", merged, 1, "2 nodes, each = 2 saving nodes merged")
    if world == 4 and "tp2" in saved:
        # The same 2 nodes that saved, 2 restoring ranks on each: ranks 0-1 on node0, 2-3 on node1.
        add("reshard: TP=2 -> TP=4", "tp2", "tp", same("tp2"), 2, "the 2 saving nodes, 2 ranks each")
    return cases


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize_save(results: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Per method: per timed save, max over ranks of durable_s and blocked_s; median over saves."""
    out: dict[str, Any] = {}
    methods = list(results[0]["saves"])
    for m in methods:
        errors = [r["errors"][m] for r in results if m in r["errors"]]
        if errors:
            out[m] = {"error": errors[0]}
            continue
        per_save = [[r["saves"][m][i] for r in results] for i in range(n)]
        durable = [max(x["durable_s"] for x in s) for s in per_save]
        blocked = [max(x["blocked_s"] for x in s) for s in per_save]
        span = [max(x["t2"] for x in s) - min(x["t0"] for x in s) for s in per_save]
        first = [r["first"][m] for r in results]
        out[m] = {
            "durable_s": _median(durable),
            "blocked_s": _median(blocked),
            "span_s": _median(span),
            "durable_all_s": durable,
            "blocked_all_s": blocked,
            "first_durable_s": max(f["durable_s"] for f in first) if all(first) else None,
            "first_blocked_s": max(f["blocked_s"] for f in first) if all(first) else None,
        }
        if m == "tiercheck":
            out[m]["stage_s"] = _median([max(x["timings"].get("stage_s", 0) for x in s) for s in per_save])
            out[m]["persist_s"] = _median([max(x["timings"].get("persist_s", 0) for x in s) for s in per_save])
            out[m]["commit_s"] = _median([max(x["timings"].get("commit_s", 0) for x in s) for s in per_save])
    return out


def parent_main(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    size_mib = args.size_mib or (256 if args.quick else 1024)
    n = args.n or (1 if args.quick else 3)
    ranks = sorted(set(args.ranks))
    for r in ranks:
        if r not in RANKS:
            print(f"--ranks: choose from {RANKS}", file=sys.stderr)
            return 2
    specs = model_specs(n_layers_for(size_mib * MiB))
    unique = unique_bytes(specs)
    json_path = Path(args.json) if args.json else RESULTS_DIR / "dist_bench.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="dist_bench-", dir=Path(args.dir).resolve()))
    else:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="dist-", dir=RESULTS_DIR))
    shm = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else root
    source = shm / f"dist_bench-{os.getpid()}.f32"
    cfg_base: dict[str, Any] = {
        "specs": specs,
        "source": str(source),
        "drop_caches": not args.no_drop_caches,
        "settle_max_s": args.settle_max_s,
        "pg_timeout": args.pg_timeout,
        "n": n,
        "dcp_threads": args.dcp_threads,
    }
    report: dict[str, Any] = {}
    try:
        machine = machine_info(root)
        n_layers = (len(specs) - 2) // 8
        _log(f"dir {root}; {n_layers} layers, {unique / GiB:.2f} GiB of fp32 global tensors, n={n}, ranks {ranks}")
        t0 = time.perf_counter()
        create_source(source, specs, SEED)
        _log(f"source tensors in {source} ({time.perf_counter() - t0:.1f}s)")

        # Part 3 first: the machine's limits, before any checkpoint traffic.
        limits: dict[str, Any] = {"memcpy": measure_memcpy(256 * MiB)}
        gc.collect()
        dropped = drop_page_cache(not args.no_drop_caches)
        settle(args.settle_max_s)
        limits["disk"] = measure_disk_write(root, unique)
        _log(
            "memcpy "
            + ", ".join(f"{k} {v:.1f} GiB/s" for k, v in limits["memcpy"].items())
            + f"; fsync'd write {limits['disk']['gib_s']:.2f} GiB/s"
        )

        # Part 1: saves.
        saves: dict[str, Any] = {}
        kept: dict[str, dict[str, Any]] = {}
        for world, layout in save_configs(ranks):
            key = f"{layout}{world}"
            sdir = root / f"save-{key}"
            drop_page_cache(not args.no_drop_caches)
            _log(f"save {layout.upper()} on {world} rank(s)")
            cfg = {**cfg_base, "layout": layout, "root": str(sdir), "methods": list(SAVE_METHODS)}
            results, load = launch(rank_save, world, cfg, timeout=args.launch_timeout)
            summary = summarize_save(results, n)
            plan_total = sum(r["tiercheck_plan_bytes"] for r in results)
            saves[key] = {
                "world": world,
                "layout": layout,
                "unique_bytes": unique,
                "state_bytes_per_rank": results[0]["state_bytes"],
                "summary": summary,
                "load": load,
                "tiercheck_plan_bytes": [r["tiercheck_plan_bytes"] for r in results],
                "tiercheck_plan_total": plan_total,
                "tiercheck_chunk_bytes": sum(r["tiercheck_chunk_bytes"] for r in results),
                "tiercheck_disk_bytes": sum(r["tiercheck_disk_bytes"] for r in results),
                "tiercheck_pool_bytes": [r["tiercheck_pool_bytes"] for r in results],
                "dcp_disk_bytes": results[0].get("dcp_disk_bytes"),
                "dcp_rank_bytes": results[0].get("dcp_rank_bytes"),
                "hwm_bytes": [r["hwm_bytes"] for r in results],
                "ranks": results,
            }
            if plan_total != unique:
                _log(f"WARNING: tiercheck planned {plan_total} bytes for {unique} unique bytes")
            for m, s in summary.items():
                if "error" in s:
                    _log(f"  {m} FAILED: {s['error'].splitlines()[0]}")
                else:
                    _log(f"  {m}: durable {s['durable_s']:.2f}s, blocked {s['blocked_s']:.2f}s")
            if "error" not in summary.get("tiercheck", {}) and "error" not in summary.get("dcp.save", {}):
                kept[key] = {"tc_root": str(sdir / "tiercheck"), "dcp_path": str(sdir / "dcp.save" / f"step-{n:08d}")}

        # Part 2: restores, one job per world size, from the checkpoints kept by part 1.
        restores: dict[str, Any] = {}
        for world in ranks:
            cases = restore_cases(world, kept, root, n)
            if not cases:
                continue
            drop_page_cache(not args.no_drop_caches)
            _log(f"restore on {world} rank(s): {', '.join(c['name'] for c in cases)}")
            cfg = {**cfg_base, "cases": cases, "p2p_bytes": 256 * MiB if world == 2 else 0}
            results, load = launch(rank_restore, world, cfg, timeout=args.launch_timeout)
            if "p2p" in results[0]:
                limits["gloo_p2p"] = results[0]["p2p"]
            for case in cases:
                per_method: dict[str, Any] = {}
                for m in case["methods"]:
                    trials = [[r["cases"][case["name"]][m][i] for r in results] for i in range(n)]
                    times = [max(x["restore_s"] for x in t) for t in trials]
                    per_method[m] = {
                        "restore_s": _median(times),
                        "restore_all_s": times,
                        "open_s": _median([max(x["open_s"] for x in t) for t in trials]),
                        "bytes_read": sum(x.get("bytes_read", 0) for x in trials[-1]),
                        "chunks_received": sum(x.get("chunks_received", 0) for x in trials[-1]),
                        "verified_tensors": sum(x["verified_tensors"] for x in trials[-1]),
                    }
                    _log(f"  {case['name']} {m}: {per_method[m]['restore_s']:.2f}s")
                restores[f"{world}: {case['name']}"] = {
                    "world": world,
                    "case": {k: v for k, v in case.items() if k != "methods"},
                    "target_bytes_total": sum(
                        4 * math.prod(piece(sp, case["layout"], world, r)[1]) for sp in specs for r in range(world)
                    ),
                    "methods": per_method,
                    "load": load,
                }
            restores[f"{world}: hwm"] = {"hwm_bytes": [r["hwm_bytes"] for r in results]}

        report = {
            "machine": machine,
            "config": {
                "size_mib": size_mib,
                "quick": args.quick,
                "n": n,
                "ranks": ranks,
                "n_layers": n_layers,
                "n_tensors": len(specs),
                "unique_bytes": unique,
                "dir": str(root),
                "drop_caches": dropped,
                "source": str(source),
                "settle_max_s": args.settle_max_s,
                "dcp_threads": args.dcp_threads,
            },
            "limits": limits,
            "saves": saves,
            "restores": {k: v for k, v in restores.items() if not k.endswith(": hwm")},
            "restore_hwm": {k: v for k, v in restores.items() if k.endswith(": hwm")},
        }
        report["elapsed_s"] = time.perf_counter() - t_start
        tables = render(report)
        report["tables"] = tables
        json_path.write_text(json.dumps(report, indent=1, default=str))
        print(tables)
        print(f"\nJSON: {json_path}", file=sys.stderr)
    finally:
        with contextlib.suppress(OSError):
            source.unlink()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def _f(x: float | None, spec: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:{spec}}"


def _r(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _span(xs: Sequence[int]) -> str:
    if not xs:
        return "n/a"
    lo, hi = min(xs) / MiB, max(xs) / MiB
    return f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f}"


def _load_note(loads: dict[str, dict[str, Any]]) -> list[str]:
    busy = {k: v["foreign_cpu_share"] for k, v in loads.items() if v.get("foreign_cpu_share", 0) > 0.05}
    stolen = {k: v["steal_share"] for k, v in loads.items() if v.get("steal_share", 0) > 0.05}
    lines = []
    if busy:
        lines.append(
            "WARNING: other processes used CPU while these ran (share of all CPUs): "
            + ", ".join(f"{k} {100 * v:.0f}%" for k, v in busy.items())
            + "; their timings are inflated."
        )
    if stolen:
        lines.append(
            "NOTE: hypervisor steal above 5%: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in stolen.items()) + "."
        )
    return lines


def render(report: dict[str, Any]) -> str:
    m, cfg, lim = report["machine"], report["config"], report["limits"]
    unique = cfg["unique_bytes"]
    raw_gib_s = lim["disk"]["gib_s"]
    L: list[str] = []
    L.append(
        f"Machine: {m['cpu_count']} CPUs ({m['cpu_model']}), {m['ram_bytes'] / GiB:.1f} GiB RAM, torch {m['torch']}, "
        f"Python {m['python']}, tiercheck {m['tiercheck']}; checkpoint dir {cfg['dir']} on {m['checkpoint_fs']}"
    )
    L.append(
        f"State: {unique / GiB:.2f} GiB of fp32 global tensors ({cfg['n_tensors']} tensors: {cfg['n_layers']} layers of "
        f"QKV/fc1 column-parallel + proj/fc2 row-parallel d={D_MODEL}, replicated norms, {VOCAB}x{D_MODEL} "
        f"vocab-parallel embedding). Timed saves and restores per case: n={cfg['n']} (median; max over ranks each). "
        f"Page cache dropped before every timed operation: {cfg['drop_caches']}."
    )
    L.append("")
    L.append("Part 3 - machine limits (measured in this run, before the checkpoints):")
    L.append("")
    L.append("| limit | value |")
    L.append("|---|---|")
    for k, v in lim["memcpy"].items():
        L.append(f"| memcpy {k.replace('_gib_s', '')} | {v:.2f} GiB/s |")
    d = lim["disk"]
    L.append(
        f"| fsync'd sequential write, one stream | {d['gib_s']:.2f} GiB/s ({d['bytes'] / GiB:.2f} GiB in {d['durable_s']:.2f}s) |"
    )
    if "gloo_p2p" in lim:
        p = lim["gloo_p2p"]
        L.append(f"| gloo send/recv over loopback, 2 ranks | {p['gib_s']:.2f} GiB/s ({p['bytes'] / MiB:.0f} MiB) |")
    L.append("")

    # Part 1.
    L.append(
        'Part 1 - save. One local directory per rank ("one node per rank") for tiercheck, one shared directory '
        "for DCP. Durable = from the save call until committed on all ranks (tiercheck: max over ranks of "
        "handle.timings durable_s; DCP: until dcp.save / the async_save future returned on every rank plus "
        "rank 0's directory fsyncs). Blocked = how long the save call blocked (max over ranks). "
        "GiB/s = unique bytes / durable. Ratios < 1: tiercheck faster."
    )
    L.append("")
    hdr = (
        "| ranks | layout | state/rank GiB | written/rank MiB tc / dcp | tc blocked s | tc durable s | tc GiB/s | "
        "dcp.save s | dcp GiB/s | dcpA blocked s | dcpA durable s | dcpA GiB/s | tc/dcp | tc/dcpA | tc x raw | "
        "first save s tc/dcp/dcpA | other CPU % | steal % |"
    )
    L.append(hdr)
    L.append("|" + "---|" * (hdr.count("|") - 1))
    loads: dict[str, dict[str, Any]] = {}
    for key, s in report["saves"].items():
        sm = s["summary"]
        tc, dc, da = sm.get("tiercheck", {}), sm.get("dcp.save", {}), sm.get("dcp.async_save", {})
        loads[f"save {key}"] = s["load"]

        def gib_s(x: dict[str, Any]) -> float | None:
            return None if "error" in x or not x.get("durable_s") else unique / GiB / x["durable_s"]

        def cell(x: dict[str, Any], k: str) -> str:
            return "error" if "error" in x else _f(x.get(k))

        plan = s["tiercheck_plan_bytes"]
        layout = "TP=DP=1" if s["world"] == 1 else f"{s['layout'].upper()}={s['world']}"
        L.append(
            "| "
            + " | ".join(
                [
                    str(s["world"]),
                    layout,
                    f"{s['state_bytes_per_rank'] / GiB:.2f}",
                    f"{_span(plan)} / {_span(s.get('dcp_rank_bytes') or [])}",
                    cell(tc, "blocked_s"),
                    cell(tc, "durable_s"),
                    _f(gib_s(tc)),
                    cell(dc, "durable_s"),
                    _f(gib_s(dc)),
                    cell(da, "blocked_s"),
                    cell(da, "durable_s"),
                    _f(gib_s(da)),
                    _f(_r(tc.get("durable_s"), dc.get("durable_s"))),
                    _f(_r(tc.get("durable_s"), da.get("durable_s"))),
                    _f(_r(raw_gib_s, gib_s(tc))),
                    "/".join(_f(x.get("first_durable_s"), ".1f") for x in (tc, dc, da)),
                    _f(100 * s["load"]["foreign_cpu_share"], ".0f"),
                    _f(100 * s["load"]["steal_share"], ".0f"),
                ]
            )
            + " |"
        )
    for key, s in report["saves"].items():
        for meth, x in s["summary"].items():
            if "error" in x:
                L.append(f"- {key} {meth} failed: {x['error'].splitlines()[0]}")
        if s["tiercheck_plan_total"] != unique:
            L.append(f"- {key}: tiercheck planned {s['tiercheck_plan_total']} bytes for {unique} unique bytes")
    L.append(
        f"tc x raw = tiercheck durable time / a one-stream raw fsync'd write of the same bytes ({raw_gib_s:.2f} GiB/s). "
        "'written/rank' = bytes each rank wrote: tiercheck's plan, DCP's __<rank>_*.distcp files (both write "
        f"every replicated tensor once, spread over the replicas). dcp.save: FileSystemWriter thread_count="
        f"{cfg.get('dcp_threads', 1)} per rank (DCP's default: 1); tiercheck: io_threads=4 per rank (its default)."
    )
    L.append("")

    # Part 2.
    L.append(
        "Part 2 - restore, into tensors pre-filled with -1, page cache dropped before each; every restore "
        "checked bit for bit (torch.equal) against the saved tensors. Time = the restore call (tiercheck.restore(), "
        "dcp.load()), max over ranks. Checkpoints are the last ones saved in part 1 (tiercheck and dcp.save). "
        "read = bytes read from storage, all ranks; recv = chunks received over gloo, all ranks."
    )
    L.append("")
    hdr = (
        "| ranks | case | tiercheck node dirs | tc s (read_once=F) | read GiB / recv | tc s (read_once=T) | "
        "read GiB / recv | dcp.load s | tc/dcp (F) | tc/dcp (T) | verified tensors | other CPU % | steal % |"
    )
    L.append(hdr)
    L.append("|" + "---|" * (hdr.count("|") - 1))
    for r in report["restores"].values():
        mm = r["methods"]
        a, b, c = mm.get("tiercheck", {}), mm.get("tiercheck.read_once"), mm.get("dcp.load", {})
        loads[f"restore {r['world']}"] = r["load"]
        verified = sum(x.get("verified_tensors", 0) for x in mm.values())
        L.append(
            "| "
            + " | ".join(
                [
                    str(r["world"]),
                    r["case"]["name"],
                    r["case"]["nodes"],
                    _f(a.get("restore_s")),
                    f"{a.get('bytes_read', 0) / GiB:.2f} / {a.get('chunks_received', 0)}",
                    _f(b.get("restore_s")) if b else "(= F)",
                    f"{b.get('bytes_read', 0) / GiB:.2f} / {b.get('chunks_received', 0)}" if b else "-",
                    _f(c.get("restore_s")),
                    _f(_r(a.get("restore_s"), c.get("restore_s"))),
                    _f(_r(b.get("restore_s"), c.get("restore_s"))) if b else "-",
                    f"{verified} ok",
                    _f(100 * r["load"]["foreign_cpu_share"], ".0f"),
                    _f(100 * r["load"]["steal_share"], ".0f"),
                ]
            )
            + " |"
        )
    L.append("")
    L.extend(_load_note(loads))
    L.append(f"Run took {report['elapsed_s']:.0f}s.")
    return "\n".join(L)


# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mib", type=int, default=0, help="fp32 bytes of the global tensors (default 1024; quick 256)")
    p.add_argument("--quick", action="store_true", help="~256 MiB and n=1: smoke run")
    p.add_argument("--n", type=int, default=0, help="timed saves and restores per case (default 3; quick 1)")
    p.add_argument("--ranks", type=int, nargs="+", default=list(RANKS), help="world sizes (subset of 1 2 4)")
    p.add_argument("--dir", help="parent directory for checkpoints (default: bench/results/)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint directory")
    p.add_argument("--json", help="JSON output path (default bench/results/dist_bench.json)")
    p.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache (needs root anyway)")
    p.add_argument(
        "--settle-max-s", type=float, default=5.0, help="wait up to this long for steal < 5%% before each timed op"
    )
    p.add_argument("--pg-timeout", type=float, default=600.0, help="process group / tiercheck timeout (s)")
    p.add_argument("--launch-timeout", type=float, default=1200.0, help="seconds per multi-rank launch")
    p.add_argument(
        "--dcp-threads",
        type=int,
        default=1,
        help="FileSystemWriter thread_count for dcp.save (default 1, DCP's default; async_save keeps its defaults)",
    )
    p.add_argument("--from-json", metavar="PATH", help="only re-print the tables from a saved JSON")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        print(render(json.loads(Path(args.from_json).read_text())))
        return 0
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
