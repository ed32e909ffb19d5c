#!/usr/bin/env python
"""Multi-rank checkpointing: tiercheck against torch.distributed.checkpoint (DCP) on 1, 2 and 4 gloo
ranks (CPU), launched with tests/distributed.py's ``run_ranks``.

Usage::

    .venv/bin/python bench/dist_bench.py            # ~1 GiB of fp32 global tensors, 3 timed runs per case
    .venv/bin/python bench/dist_bench.py --quick    # ~0.27 GiB, 1 timed run per case
    .venv/bin/python bench/dist_bench.py --size-mib 512 --ranks 2 4 --n 3

1. Save: data and tensor parallel layouts, tiercheck vs ``dcp.save`` vs ``dcp.async_save``.
2. Restore: same layout and resharding (TP=4 -> TP=2, TP=2 -> TP=4), tiercheck (its defaults: each
   node reads a chunk once, ranks of one host pass chunks through shared memory), with
   ``read_once=True``, with ``share_memory=False`` (every chunk over gloo), and with
   ``restore(in_place=False)`` (all or nothing: staged, verified, then copied in; the default
   reads a job start's restore straight into the live tensors, as ``dcp.load`` does) vs
   ``dcp.load``; every restore checked bit for bit.
3. Limits: memcpy, fsync'd sequential write, gloo send/recv over loopback.

Method and columns: bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import harness as h
from harness import GiB, MiB

# d=1024, MLP 4d, fused QKV: 12 d^2 fp32 a layer (48 MiB), a 32k x d embedding (128 MiB). Every split
# dimension divides by 4, so DTensor.from_local(..., [Shard(dim)]) holds exactly the rank's slice.
D_MODEL, VOCAB, SEED = 1024, 32768, 1234
SAVE_METHODS = ("tiercheck", "dcp.save", "dcp.async_save")
RESTORE_METHODS = ("tiercheck", "tiercheck.read_once", "tiercheck.gloo", "tiercheck.staged", "dcp.load")
RANKS = (1, 2, 4)
Pieces = dict[str, tuple[Any, tuple[int, ...], dict[str, Any]]]  # name -> (local tensor, offsets, spec)


# ---------------------------------------------------------------------------------------------
# The model: global tensors in one /dev/shm file, and the slice a rank holds under a layout


def model_specs(n_layers: int) -> list[dict[str, Any]]:
    """``{"name", "shape", "split" (TP-sharded dim or None), "offset" (in the source file)}`` per tensor."""
    d = D_MODEL
    layer = [("ln1.weight", (d,), None), ("ln1.bias", (d,), None), ("attn.qkv.weight", (3 * d, d), 0)]
    layer += [("attn.proj.weight", (d, d), 1), ("ln2.weight", (d,), None), ("ln2.bias", (d,), None)]
    layer += [("mlp.fc1.weight", (4 * d, d), 0), ("mlp.fc2.weight", (d, 4 * d), 1)]  # column / row parallel
    specs = [("embed.weight", (VOCAB, d), 0)] + [
        (f"layers.{i}.{n}", s, x) for i in range(n_layers) for n, s, x in layer
    ]
    specs.append(("final_norm.weight", (d,), None))
    out, offset = [], 0
    for name, shape, split in specs:
        out.append({"name": name, "shape": shape, "split": split, "offset": offset})
        offset += math.prod(shape)
    return out


def n_layers_for(size_bytes: int) -> int:
    return max(1, round((size_bytes - 4 * VOCAB * D_MODEL) / (4 * (12 * D_MODEL * D_MODEL + 4 * D_MODEL))))


def unique_bytes(specs: Sequence[dict[str, Any]]) -> int:
    return sum(4 * math.prod(s["shape"]) for s in specs)


def open_source(path: str, specs: Sequence[dict[str, Any]], seed: int | None = None) -> Any:
    """The global tensors in one shared file every rank maps; with ``seed``, create it with random
    values (tmpfs: no disk I/O, untouched by page-cache drops; random, so nothing compresses)."""
    import torch

    total = unique_bytes(specs) // 4
    if seed is not None:
        with open(path, "wb") as f:
            f.truncate(total * 4)
    flat = torch.from_file(path, shared=True, size=total, dtype=torch.float32)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for s in specs:
            flat[s["offset"] : s["offset"] + math.prod(s["shape"])].uniform_(-0.02, 0.02, generator=g)
    return flat


def piece(spec: dict[str, Any], layout: str, world: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, shape) of what ``rank`` holds: "dp" everything; "tp" part ``rank`` of split tensors."""
    shape, offs = tuple(spec["shape"]), [0] * len(spec["shape"])
    if layout == "dp" or spec["split"] is None or world == 1:
        return tuple(offs), shape
    dim = spec["split"]
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
) -> Pieces:
    """This rank's own tensors: clones of its slices, or (``fill``) the right shapes filled with junk."""
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


def verify(src: Any, pieces: Pieces, what: str, rank: int) -> int:
    import torch

    bad = [n for n, (t, offs, s) in pieces.items() if not torch.equal(t, expected(src, s, offs, tuple(t.shape)))]
    if bad:
        raise AssertionError(f"rank {rank}: {what}: {len(bad)} of {len(pieces)} tensors differ, e.g. {bad[:3]}")
    return len(pieces)


def tiercheck_state(pieces: Pieces) -> dict[str, Any]:
    import tiercheck

    return {
        "model": {
            n: tiercheck.Shard(t, global_shape=s["shape"], offsets=o) if tuple(t.shape) != tuple(s["shape"]) else t
            for n, (t, o, s) in pieces.items()
        }
    }


def dcp_state(pieces: Pieces, world: int) -> dict[str, Any]:
    """TP slices as DTensors over a 1-D CPU mesh (wrapping the rank's tensor, no copy), the rest plain."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as DShard

    model: dict[str, Any] = {}
    mesh = None
    for name, (t, _o, s) in pieces.items():
        if tuple(t.shape) != tuple(s["shape"]):
            mesh = init_device_mesh("cpu", (world,)) if mesh is None else mesh
            t = DTensor.from_local(t, mesh, [DShard(s["split"])], run_check=False)
        model[name] = t
    return {"model": model}


def dir_bytes(path: Path, pattern: str = "*") -> int:
    return sum(f.stat().st_size for f in path.rglob(pattern) if f.is_file())


# ---------------------------------------------------------------------------------------------
# Rank side


def _rank_setup(world: int) -> None:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the cores


def _prepare(cfg: dict[str, Any], rank: int) -> None:
    """All ranks idle, page cache dropped (root), steal settled, then everyone starts together."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        h.prepare(cfg["drop_caches"], cfg["settle_max_s"])
    dist.barrier()


def rank_save(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """A priming save per method, then ``n`` rounds of timed saves, methods interleaved; before each
    timed save the method's earlier checkpoints are deleted (its last one stays for the restores)."""
    _rank_setup(world)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import tiercheck

    specs, root = cfg["specs"], Path(cfg["root"])
    src = open_source(cfg["source"], specs)
    pieces = build_pieces(src, specs, cfg["layout"], world, rank, fill=None)
    out: dict[str, Any] = {"rank": rank, "state_bytes": sum(p[0].nbytes for p in pieces.values())}
    out |= {"first": {}, "saves": {m: [] for m in SAVE_METHODS}, "errors": {}}
    tc_dir = root / "tiercheck" / f"node{rank}"  # one node (local directory) per rank
    sd_dcp = dcp_state(pieces, world)
    ck = tiercheck.Checkpointer(
        tiercheck_state(pieces),
        local=tc_dir,
        staging=tiercheck.StagingOptions(mode="eager"),
        retention=tiercheck.RetentionOptions(keep_last=None),  # deletions happen between timed saves
        distributed=tiercheck.DistributedOptions(timeout_s=cfg["pg_timeout"]),
    )

    def save(method: str, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        if method == "tiercheck":
            hd = ck.save(step)
            t1 = time.perf_counter()
            hd.wait()  # committed on every rank
            tm = {k: float(v) for k, v in dict(hd.timings).items()}
            return {"t0": t0, "t1": t1, "t2": time.perf_counter(), **tm, "timings": tm}
        path = root / method / f"step-{step:08d}"
        if method == "dcp.save":  # DCP's defaults (sync_files=True, thread_count=1) unless --dcp-threads
            n = cfg["dcp_threads"]
            writer = dcp.FileSystemWriter(path, thread_count=n) if n > 1 else None
            dcp.save(sd_dcp, checkpoint_id=path, storage_writer=writer)
            t1 = time.perf_counter()
        else:
            ret = dcp.async_save(sd_dcp, checkpoint_id=path)  # stages a full copy, then writes on a thread
            t1 = time.perf_counter()
            getattr(ret, "upload_completion", ret).result()
        if rank == 0:  # FileSystemWriter fsyncs data files and .metadata, not directories
            h.fsync_dir(path)
            h.fsync_dir(path.parent)
        t2 = time.perf_counter()
        blocked = (t2 if method == "dcp.save" else t1) - t0
        return {"t0": t0, "t1": t1, "t2": t2, "blocked_s": blocked, "durable_s": t2 - t0}

    def run(method: str, step: int) -> dict[str, Any] | None:
        if method in out["errors"]:
            return None
        try:
            return save(method, step)
        except Exception as exc:  # e.g. dcp.async_save unsupported: report, go on with the others
            out["errors"][method] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            return None

    for method in SAVE_METHODS:
        _prepare(cfg, rank)
        out["first"][method] = run(method, 0)
    for i in range(1, cfg["n"] + 1):
        for method in SAVE_METHODS:
            if method == "tiercheck":
                for d in tc_dir.glob("step-*"):
                    shutil.rmtree(d)
            elif rank == 0:
                shutil.rmtree(root / method, ignore_errors=True)
            _prepare(cfg, rank)
            if (res := run(method, i)) is not None:
                out["saves"][method].append(res)
        if rank == 0:
            h.log(f"  save {cfg['layout'].upper()} x{world}: round {i}/{cfg['n']} done")
    ck.close()
    stats, last = ck.stats(), tc_dir / f"step-{cfg['n']:08d}"
    out["tiercheck_plan_bytes"] = int(stats["plan_bytes_per_save"])
    out["tiercheck_pool_bytes"] = int(stats["pool_capacity_bytes"])
    out["tiercheck_disk_bytes"], out["tiercheck_chunk_bytes"] = dir_bytes(last), dir_bytes(last, "c.*")
    out["hwm_bytes"] = h.hwm_bytes()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root / "dcp.async_save", ignore_errors=True)
        d = root / "dcp.save" / f"step-{cfg['n']:08d}"
        if d.exists():
            out["dcp_disk_bytes"] = dir_bytes(d)
            out["dcp_rank_bytes"] = [dir_bytes(d, f"__{r}_*.distcp") for r in range(world)]
    dist.barrier()
    return out


def rank_restore(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Every case with every method, from a dropped page cache, checked bit for bit against the source."""
    _rank_setup(world)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import tiercheck

    specs = cfg["specs"]
    src = open_source(cfg["source"], specs)
    out: dict[str, Any] = {"rank": rank, "cases": {}}
    phases = install_phases() if cfg.get("phases") else None
    if cfg.get("p2p_bytes") and world >= 2:
        out["p2p"] = _p2p(rank, cfg["p2p_bytes"])

    def restore_one(case: dict[str, Any], method: str, pieces: Pieces) -> dict[str, Any]:
        if not method.startswith("tiercheck"):
            sd = dcp_state(pieces, world)
            t0 = time.perf_counter()
            dcp.load(sd, checkpoint_id=case["dcp_path"])
            return {"open_s": 0.0, "restore_s": time.perf_counter() - t0}
        t0 = time.perf_counter()
        node = Path(case["tc_root"]) / f"node{rank // case['per_node']}"
        opts = tiercheck.DistributedOptions(
            read_once=method.endswith("read_once"), share_memory=not method.endswith("gloo"), timeout_s=cfg["pg_timeout"]
        )
        ck = tiercheck.Checkpointer(tiercheck_state(pieces), local=node, distributed=opts)
        t1 = time.perf_counter()
        step = ck.restore(in_place=False if method.endswith("staged") else None)  # None: a job start's default
        t2 = time.perf_counter()
        stats = ck.stats()
        ck.close()
        if step != case["step"]:
            raise AssertionError(f"rank {rank}: {case['name']}: restored step {step}, expected {case['step']}")
        rec = {"open_s": t1 - t0, "restore_s": t2 - t1, "bytes_read": int(stats.get("restore_bytes_read", 0))}
        received, shared = (int(stats.get(f"restore_chunks_{k}", 0)) for k in ("received", "shared"))
        unstaged = int(stats.get("restore_unstaged_bytes", 0))
        return rec | {"chunks_received": received, "chunks_shared": shared, "unstaged_bytes": unstaged}

    pieces, layout = None, None
    for case in cfg["cases"]:
        if case["layout"] != layout:
            pieces, layout = None, case["layout"]
            gc.collect()
            pieces = build_pieces(src, specs, layout, world, rank, fill=-1.0)
        assert pieces is not None
        res: dict[str, list[dict[str, Any]]] = {m: [] for m in case["methods"]}
        for _ in range(cfg["n"]):
            for method in case["methods"]:
                for t, _o, _s in pieces.values():
                    t.fill_(-1.0)
                _prepare(cfg, rank)
                if phases is not None:
                    phases.take()  # nothing of the verification or the barriers before
                rec = restore_one(case, method, pieces)
                if phases is not None:
                    rec["phases"] = phases.take()
                rec["verified_tensors"] = verify(src, pieces, f"{case['name']} {method}", rank)
                res[method].append(rec)
            if rank == 0:
                h.log(f"  restore x{world} {case['name']}: round done")
        out["cases"][case["name"]] = res
    out["hwm_bytes"] = h.hwm_bytes()
    dist.barrier()
    return out


# ---------------------------------------------------------------------------------------------
# The restore by phase (--phases; issue 65: a small job's restore behind dcp.load)
#
# In each rank's process the phases of tiercheck.restore.protocol.Restore are timed (its call order:
# agree on the step through the node leaders; prepare: the holders' claims, the manifest parts and the
# match against the state; plan who reads and sends which chunk; read: the reads, checks and transfers
# with their verdict round), the lineage round after a restore (Owner.restored), and DCP's reader
# (read_metadata, read_data). What is left is "rest": apply and the bookkeeping around the phases for
# tiercheck; for dcp.load its planning (local plans gathered at rank 0, the global plan scattered).

TC_PHASES = ("agree", "prepare", "plan", "read", "lineage")


def install_phases() -> h.MethodTimers:
    """Time the phases of every restore and ``dcp.load`` in this process from now on."""
    from torch.distributed.checkpoint import FileSystemReader

    from tiercheck.restore.protocol import Restore
    from tiercheck.tiering.lineage import Owner

    timers = h.MethodTimers()
    for attr in ("agree", "prepare", "plan", "read"):
        timers.wrap(Restore, attr, attr)
    timers.wrap(Owner, "restored", "lineage")
    timers.wrap(FileSystemReader, "read_metadata", "dcp.metadata")
    timers.wrap(FileSystemReader, "read_data", "dcp.read")
    return timers


def summarize_phases(trials: Sequence[Sequence[dict[str, Any]]]) -> dict[str, float]:
    """Per phase the median over trials of the slowest rank's time; ``rest``: the restore's time less
    its phases, of the slowest rank."""
    names = sorted({k for t in trials for r in t for k in r.get("phases", {})})
    out = {k: h.median([max(r.get("phases", {}).get(k, 0.0) for r in t) for t in trials]) for k in names}
    out["rest"] = h.median([max(r["restore_s"] - sum(r.get("phases", {}).values()) for r in t) for t in trials])
    return out


def _phase_table(restores: dict[str, Any]) -> list[str]:
    """Part 2b: each case's tiercheck restore (a job start's default) by phase against ``dcp.load``."""
    rows = []
    for key, r in restores.items():
        tc, dcp = r["methods"].get("tiercheck", {}), r["methods"].get("dcp.load", {})
        a, b = tc.get("phases"), dcp.get("phases")
        if not a or not b:
            continue
        fixed = sum(a.get(p, 0.0) for p in ("agree", "prepare", "plan", "lineage", "rest"))
        row = [key, h.fmt(tc.get("restore_s"), ".3f"), *(h.fmt(a.get(p, 0.0), ".3f") for p in (*TC_PHASES, "rest"))]
        row.append(h.fmt(fixed, ".3f"))
        row += [h.fmt(dcp.get("restore_s"), ".3f"), h.fmt(b.get("dcp.read", 0.0), ".3f")]
        row += [h.fmt(b.get("rest", 0.0) + b.get("dcp.metadata", 0.0), ".3f")]
        rows.append([*row, h.fmt(h.ratio(tc.get("restore_s"), dcp.get("restore_s")))])
    if not rows:
        return []
    head = ["case", "tc s", *TC_PHASES, "rest", "tc fixed", "dcp.load s", "dcp read", "dcp plan+meta", "tc/dcp"]
    return ["Part 2b - restore by phase (s; slowest rank, median); tiercheck's fixed cost: all but 'read'", "",
            h.table(head, rows), ""]  # fmt: skip


def _p2p(rank: int, nbytes: int) -> dict[str, float]:
    """gloo send/recv between ranks 0 and 1 over loopback (best of 3 after a warm-up)."""
    import torch
    import torch.distributed as dist

    buf, best = torch.ones(nbytes, dtype=torch.uint8), math.inf
    for _ in range(4):
        dist.barrier()
        t0 = time.perf_counter()
        if rank < 2:
            (dist.send if rank == 0 else dist.recv)(buf, 1 - rank)
        dist.barrier()
        best = min(best, time.perf_counter() - t0)
    return {"bytes": nbytes, "s": best, "gib_s": nbytes / GiB / best}


# ---------------------------------------------------------------------------------------------
# Parent


def launch(fn: Callable[..., Any], world: int, cfg: dict[str, Any], timeout: float) -> tuple[list[Any], dict[str, Any]]:
    from tests.distributed import run_ranks

    foreign = h.ForeignCpu()
    results = run_ranks(fn, world, cfg, timeout=timeout, pg_timeout=cfg["pg_timeout"], start_method="forkserver")
    return results, foreign.stop()


def merge_nodes(srcs: Sequence[Path], dst: Path) -> None:
    """One restoring node gets several saving nodes' files: hard links, and COMMIT markers naming the
    saving ranks of all of them (what a pre-staging copy would produce)."""
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


def restore_cases(world: int, saved: dict[str, dict[str, Any]], root: Path, step: int) -> list[dict[str, Any]]:
    """The restore cases of a ``world``-rank job from the checkpoints part 1 kept (``saved[key]``)."""
    methods = list(RESTORE_METHODS) if world > 1 else ["tiercheck", "tiercheck.staged", "dcp.load"]
    same = f"the {world} saving nodes"
    # (name, saved key, layout, node directories, ranks per node, description)
    plan: list[tuple[str, str, str, Path | None, int, str]] = [
        ("same: TP=1 -> TP=1", "tp1", "tp", None, 1, "1 node (the saving one)")
    ]
    if world > 1:
        plan = [(f"same: TP={world} -> TP={world}", f"tp{world}", "tp", None, 1, same)]
        plan.append((f"same: DP={world} -> DP={world}", f"dp{world}", "dp", None, 1, same))
    if world == 2 and "tp4" in saved:  # 2 nodes: node k holds what saving nodes 2k and 2k+1 wrote
        merged, src = root / "restore-tp4-on-2", Path(saved["tp4"]["tc_root"])
        for k in range(2):
            merge_nodes([src / f"node{2 * k}", src / f"node{2 * k + 1}"], merged / f"node{k}")
        plan.append(("reshard: TP=4 -> TP=2", "tp4", "tp", merged, 1, "2 nodes, each = 2 saving nodes merged"))
    if world == 4:  # the 2 nodes that saved, 2 restoring ranks on each
        plan.append(("reshard: TP=2 -> TP=4", "tp2", "tp", None, 2, "the 2 saving nodes, 2 ranks each"))
    keys = ("name", "saved", "layout", "tc_root", "per_node", "nodes")
    cases = [dict(zip(keys, c, strict=True)) for c in plan if c[1] in saved]
    for c in cases:
        c.update(tc_root=str(c["tc_root"] or saved[c["saved"]]["tc_root"]), dcp_path=saved[c["saved"]]["dcp_path"])
        c.update(step=step, methods=methods)
    return cases


def summarize_save(results: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Per method: max over ranks per timed save, median over saves."""
    out: dict[str, Any] = {}
    for m in SAVE_METHODS:
        errors = [r["errors"][m] for r in results if m in r["errors"]]
        if errors:
            out[m] = {"error": errors[0]}
            continue
        per_save = [[r["saves"][m][i] for r in results] for i in range(n)]
        first = [r["first"][m] for r in results]
        out[m] = {"span_s": h.median([max(x["t2"] for x in s) - min(x["t0"] for x in s) for s in per_save])}
        for k in ("durable_s", "blocked_s"):
            out[m][k.replace("_s", "_all_s")] = [max(x[k] for x in s) for s in per_save]
            out[m][k] = h.median(out[m][k.replace("_s", "_all_s")])
            out[m]["first_" + k] = max(f[k] for f in first) if all(first) else None
        if m == "tiercheck":
            for k in ("stage_s", "persist_s", "commit_s"):
                out[m][k] = h.median([max(x["timings"].get(k, 0) for x in s) for s in per_save])
    return out


def run_saves(ranks: list[int], cfg_base: dict[str, Any], root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: per rank count and layout, one launch of ``rank_save``."""
    n, unique, saves = cfg_base["n"], unique_bytes(cfg_base["specs"]), {}
    for world, layout in [(1, "tp")] * (1 in ranks) + [(w, lay) for w in ranks if w > 1 for lay in ("dp", "tp")]:
        key, sdir = f"{layout}{world}", root / f"save-{layout}{world}"
        h.drop_caches(not args.no_drop_caches)
        h.log(f"save {layout.upper()} on {world} rank(s)")
        rs, load = launch(rank_save, world, {**cfg_base, "layout": layout, "root": str(sdir)}, args.launch_timeout)
        summary = summarize_save(rs, n)
        s = saves[key] = {"world": world, "layout": layout, "unique_bytes": unique, "summary": summary}
        s |= {"load": load, "state_bytes_per_rank": rs[0]["state_bytes"], "ranks": rs}
        for k in ("tiercheck_plan_bytes", "tiercheck_pool_bytes", "hwm_bytes"):
            s[k] = [r[k] for r in rs]
        for k in ("tiercheck_chunk_bytes", "tiercheck_disk_bytes"):
            s[k] = sum(r[k] for r in rs)
        s["tiercheck_plan_total"] = sum(s["tiercheck_plan_bytes"])
        s["dcp_disk_bytes"], s["dcp_rank_bytes"] = rs[0].get("dcp_disk_bytes"), rs[0].get("dcp_rank_bytes")
        for m, x in summary.items():
            h.log(f"  {m}: " + (f"FAILED {x['error'][:200]}" if "error" in x else f"durable {x['durable_s']:.2f}s"))
        if "error" not in summary["tiercheck"] and "error" not in summary["dcp.save"]:
            s["kept"] = {"tc_root": str(sdir / "tiercheck"), "dcp_path": str(sdir / "dcp.save" / f"step-{n:08d}")}
    return saves


def run_restores(ranks: list[int], cfg_base: dict[str, Any], root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Part 2: per rank count, one launch of ``rank_restore`` over its cases."""
    n, specs, out = cfg_base["n"], cfg_base["specs"], {"restores": {}, "restore_hwm": {}}
    kept = {k: s["kept"] for k, s in cfg_base["saves"].items() if "kept" in s}
    for world in ranks:
        if not (cases := restore_cases(world, kept, root, n)):
            continue
        h.drop_caches(not args.no_drop_caches)
        h.log(f"restore on {world} rank(s): {', '.join(c['name'] for c in cases)}")
        cfg = {**cfg_base, "saves": None, "cases": cases, "p2p_bytes": 256 * MiB if world == 2 else 0}
        rs, load = launch(rank_restore, world, cfg, args.launch_timeout)
        if "p2p" in rs[0]:
            out["gloo_p2p"] = rs[0]["p2p"]
        for case in cases:
            per_method: dict[str, Any] = {}
            for m in case["methods"]:
                trials = [[r["cases"][case["name"]][m][i] for r in rs] for i in range(n)]
                times = [max(x["restore_s"] for x in t) for t in trials]
                pm = per_method[m] = {"restore_s": h.median(times), "restore_all_s": times}
                pm["open_s"] = h.median([max(x["open_s"] for x in t) for t in trials])
                if cfg.get("phases"):
                    pm["phases"] = summarize_phases(trials)
                for k in ("bytes_read", "chunks_received", "chunks_shared", "unstaged_bytes", "verified_tensors"):
                    pm[k] = sum(x.get(k, 0) for x in trials[-1])
                h.log(f"  {case['name']} {m}: {pm['restore_s']:.2f}s")
            target = sum(4 * math.prod(piece(sp, case["layout"], world, r)[1]) for sp in specs for r in range(world))
            out["restores"][f"{world}: {case['name']}"] = {
                "world": world,
                "case": {k: v for k, v in case.items() if k != "methods"},
                "target_bytes_total": target,
                "methods": per_method,
                "load": load,
            }
        out["restore_hwm"][f"{world}: hwm"] = {"hwm_bytes": [r["hwm_bytes"] for r in rs]}
    return out


def parent_main(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    size_mib, n, ranks = args.size_mib or (256 if args.quick else 1024), args.n or (1 if args.quick else 3), args.ranks
    specs = model_specs(n_layers_for(size_mib * MiB))
    unique, n_layers = unique_bytes(specs), (len(specs) - 2) // 8
    shm = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(args.dir or h.RESULTS_DIR)
    source = shm / f"dist_bench-{os.getpid()}.f32"
    cfg = {"specs": specs, "source": str(source), "drop_caches": not args.no_drop_caches, "n": n}
    cfg |= {"settle_max_s": args.settle_max_s, "pg_timeout": args.pg_timeout, "dcp_threads": args.dcp_threads}
    cfg |= {"phases": args.phases}
    with h.scratch_dir(args.dir, "dist_bench-", args.keep) as root:
        try:
            machine = h.machine_info(root)
            h.log(f"dir {root}; {n_layers} layers, {unique / GiB:.2f} GiB of fp32 global tensors, n={n}, ranks {ranks}")
            open_source(str(source), specs, SEED)  # creates the file
            # Part 3 first: the machine's limits, before any checkpoint traffic.
            limits: dict[str, Any] = {"memcpy": h.measure_memcpy(256 * MiB)}
            gc.collect()
            dropped = h.prepare(not args.no_drop_caches, args.settle_max_s)
            limits["disk"] = h.measure_disk_write(root, unique)
            h.log(f"memcpy {limits['memcpy']}; fsync'd write {limits['disk']['gib_s']:.2f} GiB/s")
            saves = run_saves(ranks, cfg, root, args)
            restores = run_restores(ranks, {**cfg, "saves": saves}, root, args)
        finally:
            with contextlib.suppress(OSError):
                source.unlink()
    if "gloo_p2p" in restores:
        limits["gloo_p2p"] = restores.pop("gloo_p2p")
    config = {"size_mib": size_mib, "quick": args.quick, "n": n, "ranks": ranks, "n_layers": n_layers}
    config |= {"n_tensors": len(specs), "unique_bytes": unique, "dir": str(root), "drop_caches": dropped}
    config |= {"source": str(source), "settle_max_s": args.settle_max_s, "dcp_threads": args.dcp_threads}
    report = {"machine": machine, "config": config, "limits": limits, "saves": saves, **restores}
    report["elapsed_s"] = time.perf_counter() - t_start
    report["tables"] = render(report)
    path = h.write_json(args.json or h.RESULTS_DIR / "dist_bench.json", report)
    print(report["tables"])
    h.log(f"JSON: {path}")
    return 0


# ---------------------------------------------------------------------------------------------
# Tables


def _span(xs: Sequence[int]) -> str:
    if not xs:
        return "n/a"
    lo, hi = min(xs) / MiB, max(xs) / MiB
    return f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f}"


def _cols(spec: str) -> list[str]:
    return spec.split("|")


LOAD_HEAD = _cols("other CPU %|steal %")
SAVE_HEAD = (
    _cols(
        "ranks|layout|state/rank GiB|written/rank MiB tc / dcp|tc blocked s|tc durable s|tc GiB/s|dcp.save s|dcp GiB/s|"
        "dcpA blocked s|dcpA durable s|dcpA GiB/s|tc/dcp|tc/dcpA|tc x raw|first save s tc/dcp/dcpA"
    )
    + LOAD_HEAD
)
RESTORE_HEAD = (
    _cols(
        "ranks|case|tiercheck node dirs|tc s|read GiB / recv (shm)|unstaged GiB|tc read_once s|read GiB / recv (shm)|"
        "tc gloo s|tc staged s|dcp.load s|tc/dcp|tc read_once/dcp|tc gloo/dcp|tc staged/dcp|verified tensors"
    )
    + LOAD_HEAD
)


def _load_cols(load: dict[str, Any]) -> list[str]:
    return [h.fmt(100 * load["foreign_cpu_share"], ".0f"), h.fmt(100 * load["steal_share"], ".0f")]


def _save_row(s: dict[str, Any], unique: int, raw_gib_s: float) -> list[Any]:
    tc, dc, da = (s["summary"].get(k, {}) for k in SAVE_METHODS)

    def gib_s(x: dict[str, Any]) -> float | None:
        return None if "error" in x or not x.get("durable_s") else unique / GiB / x["durable_s"]

    def cell(x: dict[str, Any], k: str) -> str:
        return "error" if "error" in x else h.fmt(x.get(k))

    written = f"{_span(s['tiercheck_plan_bytes'])} / {_span(s.get('dcp_rank_bytes') or [])}"
    row = [s["world"], "TP=DP=1" if s["world"] == 1 else f"{s['layout'].upper()}={s['world']}"]
    row += [f"{s['state_bytes_per_rank'] / GiB:.2f}", written, cell(tc, "blocked_s"), cell(tc, "durable_s")]
    row += [h.fmt(gib_s(tc)), cell(dc, "durable_s"), h.fmt(gib_s(dc)), cell(da, "blocked_s"), cell(da, "durable_s")]
    row += [h.fmt(gib_s(da)), *(h.fmt(h.ratio(tc.get("durable_s"), x.get("durable_s"))) for x in (dc, da))]
    row += [
        h.fmt(h.ratio(raw_gib_s, gib_s(tc))),
        "/".join(h.fmt(x.get("first_durable_s"), ".1f") for x in (tc, dc, da)),
    ]
    return row + _load_cols(s["load"])


def _restore_row(r: dict[str, Any]) -> list[Any]:
    mm = r["methods"]
    a, b, c = mm.get("tiercheck", {}), mm.get("tiercheck.read_once"), mm.get("dcp.load", {})
    g, p = mm.get("tiercheck.gloo"), mm.get("tiercheck.staged")

    def moved(x: dict[str, Any]) -> str:
        shm = f" ({x['chunks_shared']})" if x.get("chunks_shared") else ""
        return f"{x.get('bytes_read', 0) / GiB:.2f} / {x.get('chunks_received', 0)}{shm}"

    row = [r["world"], r["case"]["name"], r["case"]["nodes"], h.fmt(a.get("restore_s")), moved(a)]
    row.append(f"{a.get('unstaged_bytes', 0) / GiB:.2f}")
    row += [h.fmt(b.get("restore_s")), moved(b)] if b else ["-", "-"]
    row += [h.fmt(x.get("restore_s")) if x else "-" for x in (g, p)] + [h.fmt(c.get("restore_s"))]
    row += [h.fmt(h.ratio(x.get("restore_s"), c.get("restore_s"))) if x else "-" for x in (a, b, g, p)]
    row.append(f"{sum(x.get('verified_tensors', 0) for x in mm.values())} ok")
    return row + _load_cols(r["load"])


def render(report: dict[str, Any]) -> str:
    m, cfg, lim = report["machine"], report["config"], report["limits"]
    unique, d = cfg["unique_bytes"], lim["disk"]
    rows = [[f"memcpy {k.replace('_gib_s', '')}", f"{v:.2f} GiB/s"] for k, v in lim["memcpy"].items()]
    rows.append(["fsync'd sequential write, one stream", f"{d['gib_s']:.2f} GiB/s ({d['bytes'] / GiB:.2f} GiB)"])
    if p := lim.get("gloo_p2p"):
        rows.append(["gloo send/recv over loopback, 2 ranks", f"{p['gib_s']:.2f} GiB/s ({p['bytes'] / MiB:.0f} MiB)"])
    saves, restores = report["saves"], report["restores"]
    notes = [
        f"- {k} {meth} failed: {x['error'].splitlines()[0]}"
        for k, s in saves.items()
        for meth, x in s["summary"].items()
        if "error" in x
    ]
    notes += [
        f"- {k}: tiercheck planned {s['tiercheck_plan_total']} bytes for {unique} unique bytes"
        for k, s in saves.items()
        if s["tiercheck_plan_total"] != unique
    ]
    L = [
        f"{h.machine_line(m)}; checkpoint dir {cfg['dir']}",
        f"State: {unique / GiB:.2f} GiB of fp32 global tensors, {cfg['n_tensors']} tensors ({cfg['n_layers']} layers, "
        f"d={D_MODEL}). n={cfg['n']} timed runs per case (median; max over ranks each). Page cache dropped before "
        f"every timed operation: {cfg['drop_caches'] or 'no'}. dcp.save thread_count={cfg.get('dcp_threads', 1)}.",
        "",
        "Part 3 - machine limits (measured in this run, before the checkpoints):",
        "",
        h.table(["limit", "value"], rows, right=False),
        "",
        "Part 1 - save (durable: save call until committed on all ranks; ratios < 1: tiercheck faster)",
        "",
        h.table(SAVE_HEAD, [_save_row(s, unique, d["gib_s"]) for s in saves.values()]),
        *notes,
        "",
        "Part 2 - restore (into tensors pre-filled with -1, page cache dropped, every restore checked bit for bit)",
        "",
        h.table(RESTORE_HEAD, [_restore_row(r) for r in restores.values()]),
        "",
        *_phase_table(restores),
    ]
    for k, s in saves.items():
        L += h.noise_warnings(f"save {k}", s["load"])
    for r in restores.values():
        L += h.noise_warnings(f"restore {r['world']}: {r['case']['name']}", r["load"])
    L.append(f"Run took {report['elapsed_s']:.0f}s.")
    return "\n".join(L)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mib", type=int, default=0, help="fp32 bytes of the global tensors (default 1024; quick 256)")
    p.add_argument("--n", type=int, default=0, help="timed saves and restores per case (default 3; quick 1)")
    p.add_argument("--ranks", type=int, nargs="+", choices=RANKS, default=list(RANKS), help="world sizes")
    h.common_args(p, settle_s=5.0)  # --quick: ~256 MiB, n=1
    p.add_argument("--pg-timeout", type=float, default=600.0, help="process group / tiercheck timeout (s)")
    p.add_argument("--launch-timeout", type=float, default=1200.0, help="seconds per multi-rank launch")
    p.add_argument(
        "--dcp-threads", type=int, default=1, help="FileSystemWriter thread_count for dcp.save (default 1, DCP's)"
    )
    p.add_argument("--phases", action="store_true", help="time the restore by phase against dcp.load (Part 2b)")
    p.add_argument("--from-json", metavar="PATH", help="only re-print the tables from a saved JSON")
    args = p.parse_args(argv)
    args.ranks = sorted(set(args.ranks))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        print(render(json.loads(Path(args.from_json).read_text())))
        return 0
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
