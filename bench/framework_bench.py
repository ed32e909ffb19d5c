#!/usr/bin/env python
"""DeepSpeed and Megatron-core checkpointing, natively and through tiercheck's plugins, in one process
(one rank, gloo, CPU), against memcpy and fsync'd write measured in the same run.

Usage::

    .venv/bin/python bench/framework_bench.py            # ~1 GiB checkpoints, 3 repeats
    .venv/bin/python bench/framework_bench.py --quick    # ~0.25 GiB checkpoints
    .venv/bin/python bench/framework_bench.py --gib 2 --repeats 5 --frameworks megatron

DeepSpeed ZeRO-1: ``TorchCheckpointEngine`` (+ the benchmark's fsync) vs
``tiercheck.integrations.deepspeed.install``. Megatron-core ``dist_checkpointing``: ``torch_dist`` sync
and async vs tiercheck sync, async and async nofork. Method and columns: bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import harness as h
from harness import GiB

D, BATCH, SEED = 1024, 16, 1234  # every matrix 4D x D fp32 = 16 MiB; DeepSpeed micro batch
FRAMEWORKS = ("deepspeed", "megatron")
MG_METHODS = ("torch_dist sync", "torch_dist async", "tiercheck sync", "tiercheck async", "tiercheck async nofork")
MG_PARAMS = {
    "fc1.weight": (4 * D, D),
    "fc1.bias": (4 * D,),
    "fc2.weight": (D, 4 * D),
    "fc2.bias": (D,),
    "norm.weight": (D,),
}


def tables_stream() -> TextIO:
    """The real stdout; fd 1 then points at stderr, so DeepSpeed's and Megatron's output (their child
    processes' too) never mixes with the tables."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def cpu_only_cuda_shims() -> bool:
    """Without CUDA, no-op exactly torch.cuda.synchronize and current_device (Megatron's save calls
    both; a CPU build of torch raises in them), as examples/megatron_train.py does."""
    import torch

    if torch.cuda.is_available():
        return False
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    return True


def settle(args: argparse.Namespace) -> None:
    """Before a timed phase: flush dirty pages, let steal settle."""
    os.sync()
    h.settle(args.settle_max_s)


def measure_limits(root: Path, nbytes: int, args: argparse.Namespace) -> dict[str, Any]:
    h.log(f"limits: memcpy and fsync'd write of {nbytes / GiB:.2f} GiB")
    settle(args)
    gib_s = h.measure_memcpy(nbytes, max(3, args.repeats))
    memcpy = {k[len("reused_") : -len("_gib_s")]: nbytes / GiB / v for k, v in gib_s.items() if k.startswith("reused_")}
    gc.collect()
    disk = []
    for _ in range(args.repeats):
        settle(args)
        disk.append(h.measure_disk_write(root, nbytes)["durable_s"])
    s = statistics.median(disk)
    return {"bytes": nbytes, "memcpy_s": memcpy, "disk_s": s, "disk_gib_s": nbytes / GiB / s}


# ---------------------------------------------------------------------------------------------
# DeepSpeed


def ds_engine(n_blocks: int, writer: dict[str, Any] | None = None, width: int = D) -> Any:
    """ZeRO-1, fp32 AdamW (torch_adam) on MLP blocks Linear(w, 4w), GELU, Linear(4w, w)."""
    import deepspeed
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    with torch.device("meta"):  # materialised once below: nn.Linear's default init costs seconds
        blocks = [
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(n_blocks)
        ]
        model = nn.Sequential(*blocks)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1}
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}
    config |= {"zero_optimization": {"stage": 1}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if writer is not None:
        config["checkpoint"] = {"writer": writer}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def ds_step(engine: Any, step: int, width: int = D) -> float:
    import torch

    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(step))
    t0 = time.perf_counter()
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    return time.perf_counter() - t0


def run_deepspeed_method(method: str, root: Path, n_blocks: int, args: argparse.Namespace) -> dict[str, Any]:
    """Rounds of: a step, ``save_checkpoint`` (timed), the next step, one more step; then loads into a
    fresh engine from a dropped page cache. Round 0 is the warm-up."""
    import tiercheck.integrations.deepspeed as tiercheck_ds

    save_dir, local = root / f"ds-{method}", root / f"ds-{method}-local"
    res: dict[str, Any] = {"rounds": [], "baseline_s": [], "load_s": []}
    res["build_s"], engine = h.timed(lambda: ds_engine(n_blocks))
    handles: list[Any] = []
    committed_at: dict[int, float] = {}  # id(handle) -> when its step committed, while training goes on
    if method == "tiercheck":
        # The Checkpointer for save_dir is created here, as the first save_checkpoint would, and its
        # save() wrapped to record each SaveHandle. Nothing of the plugin is changed.
        ckpt = tiercheck_ds.install(engine, local=str(local)).checkpointer(str(save_dir))
        original_save = ckpt.save

        def recording_save(*a: Any, **k: Any) -> Any:
            hd = original_save(*a, **k)
            handles.append(hd)
            key = id(hd)
            hd.committed.add_done_callback(lambda _f: committed_at.setdefault(key, time.perf_counter()))
            return hd

        ckpt.save = recording_save  # type: ignore[method-assign]
    step = 0

    def next_step() -> float:
        nonlocal step
        step += 1
        return ds_step(engine, step - 1)

    for _ in range(2):  # warm-up: allocator, Adam state, DeepSpeed's buffers
        next_step()
    for r in range(args.repeats + 1):
        settle(args)
        res["baseline_s"].append(next_step())
        rnd: dict[str, Any] = {"global_steps": int(engine.global_steps)}
        t0 = time.perf_counter()
        engine.save_checkpoint(str(save_dir))
        rnd["save_s"] = time.perf_counter() - t0
        if method == "native":  # torch.save does not fsync: the benchmark does, before the next step
            h.fsync_tree(save_dir / f"global_step{rnd['global_steps']}")
            h.fsync_path(save_dir / "latest")
            h.fsync_dir(save_dir)
            rnd["durable_s"] = time.perf_counter() - t0
            rnd["next_step_s"] = next_step()
        else:
            rnd["next_step_s"] = next_step()
            engine.checkpoint_engine.flush()
            rnd["flush_s"] = time.perf_counter() - t0
            rnd["durable_s"] = committed_at[id(handles[-1])] - t0
            rnd["handle"] = {k: float(v) for k, v in dict(handles[-1].timings).items()}
        rnd["post_step_s"] = next_step()  # nothing in flight: A-B-A around the next step
        res["rounds"].append(rnd)
        h.log(
            f"  deepspeed {method} round {r}: save {rnd['save_s']:.2f}s, next step {rnd['next_step_s']:.2f}s "
            f"(before {res['baseline_s'][-1]:.2f}s, after {rnd['post_step_s']:.2f}s), durable {rnd['durable_s']:.2f}s"
        )
    last_step = res["rounds"][-1]["global_steps"]
    res["bytes"] = h.tree_bytes(save_dir / f"global_step{last_step}") if method == "native" else None
    engine.destroy()
    engine = None
    gc.collect()

    fresh = ds_engine(n_blocks)
    if method == "tiercheck":
        tiercheck_ds.install(fresh, local=str(local))
    dropped = []
    for _ in range(args.repeats):
        dropped.append(h.prepare(not args.no_drop_caches, args.settle_max_s))
        s, (path, _client) = h.timed(lambda: fresh.load_checkpoint(str(save_dir)))
        res["load_s"].append(s)
        if path is None or int(fresh.global_steps) != last_step:
            raise RuntimeError(f"load_checkpoint gave {path!r} at step {fresh.global_steps}, expected {last_step}")
        h.log(f"  deepspeed {method}: load {s:.2f}s")
    res["dropped_caches"] = all(dropped)
    fresh.destroy()
    fresh = None
    gc.collect()
    shutil.rmtree(save_dir, ignore_errors=True)
    shutil.rmtree(local, ignore_errors=True)
    os.sync()
    return res


def try_deepspeed_writers(root: Path) -> list[str]:
    """One line per DeepSpeed fast / decoupled writer: whether it saves a tiny model here."""
    lines = []
    for name, writer in (
        ("fast", {"type": "fast"}),
        ("decoupled (python writer)", {"type": "python", "decoupled": True}),
    ):
        engine, stage, notes = None, "deepspeed.initialize", ""
        try:
            try:
                engine = ds_engine(1, writer, width=64)
            except AttributeError as e:
                # DeepSpeed 0.19.8 without "data_parallel" and without an mpu reads a field
                # UniversalParallelInfo does not have; naming the unit gets past it.
                notes = f' (without "data_parallel" it fails earlier: {type(e).__name__}: {e}; retried with "replica")'
                writer = {**writer, "data_parallel": "replica"}
                engine = ds_engine(1, writer, width=64)
            ds_step(engine, 0, width=64)
            stage = "save_checkpoint"
            engine.save_checkpoint(str(root / f"ds-writer-{writer['type']}"))
            stage = "the step after save_checkpoint"
            ds_step(engine, 1, width=64)
            lines.append(f"DeepSpeed {name} checkpoint engine {writer}: saves on this machine (not benchmarked).")
        except Exception as e:  # report, never fail the run
            where = traceback.extract_tb(e.__traceback__)[-1]
            msg = (str(e).splitlines() or [""])[0].split(".  ")[0][:160]
            lines.append(
                f"DeepSpeed {name} checkpoint engine {writer} cannot run here: {stage} fails with {type(e).__name__}: "
                f"{msg} (in {Path(where.filename).name}:{where.lineno} {where.name}){notes}."
            )
        finally:
            if engine is not None:
                with contextlib.suppress(Exception):
                    engine.destroy()
            shutil.rmtree(root / f"ds-writer-{writer['type']}", ignore_errors=True)
    return lines


def run_deepspeed(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import deepspeed  # noqa: F401

        import tiercheck.integrations.deepspeed  # noqa: F401
    block_params = 8 * D * D + 5 * D
    n_blocks = max(1, round(args.gib * GiB / (16 * block_params)))  # checkpoint = 4 x fp32 parameter bytes
    out: dict[str, Any] = {"n_blocks": n_blocks, "params": n_blocks * block_params, "methods": {}}
    for method in ("native", "tiercheck"):
        h.log(f"deepspeed {method}: {n_blocks} blocks, {out['params'] / 1e6:.0f}M parameters")
        out["methods"][method] = _guard(
            f"deepspeed {method}", lambda m=method: run_deepspeed_method(m, root, n_blocks, args)
        )
    return out


# ---------------------------------------------------------------------------------------------
# Megatron-core dist_checkpointing


def mg_tensors(n_layers: int, *, random: bool) -> dict[str, list[Any]]:
    """Global key -> per-layer tensors: weights, Adam's exp_avg and exp_avg_sq."""
    import torch

    g = torch.Generator().manual_seed(SEED)
    prefixes = ("", "optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq.")
    return {
        f"{prefix}decoder.layers.{name}": [
            torch.randn(s, generator=g) if random else torch.zeros(s) for _ in range(n_layers)
        ]
        for name, s in MG_PARAMS.items()
        for prefix in prefixes
    }


def mg_state_dict(tensors: dict[str, list[Any]], iteration: int) -> dict[str, Any]:
    """Megatron's shape of a sharded state dict: layers stacked on a prepended axis, plus objects."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    sd: dict[str, Any] = {"model": {}, "optimizer": {"state": {}}}
    for key, layers in tensors.items():
        where = sd["optimizer"]["state"] if key.startswith("optimizer.") else sd["model"]
        for i, t in enumerate(layers):
            where[f"{key}.{i}"] = ShardedTensor.from_rank_offsets(
                key, t, (0, i, len(layers)), replica_id=0, prepend_axis_num=1
            )
    sd["optimizer"]["param_groups"] = [{"lr": 1e-4, "betas": (0.9, 0.999), "step": iteration}]
    sd["iteration"] = iteration
    sd["progress"] = ShardedObject("progress", {"iteration": iteration, "consumed_samples": 16 * iteration}, (1,), (0,))
    return sd


def _update(tensors: dict[str, list[Any]]) -> float:
    """Rewrite every tensor in place with the same values (an optimizer step's memory traffic)."""
    t0 = time.perf_counter()
    for layers in tensors.values():
        for t in layers:
            t.mul_(1.0)
    return time.perf_counter() - t0


def run_megatron_method(method: str, ctx: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Rounds of: the update with nothing in flight, save (timed), the update, finalize; then loads of
    the last checkpoint into zeros from a dropped page cache, checked bit for bit."""
    import torch
    from megatron.core import dist_checkpointing

    kind, mode, *how = method.split()
    fork = not how  # "nofork": the AsyncRequest runs with execute_sync() instead of the forking queue
    strategy = ("tiercheck", 1) if kind == "tiercheck" else None
    base, tensors, queue = ctx["root"] / f"mg-{'-'.join(method.split())}", ctx["tensors"], ctx["queue"]
    res: dict[str, Any] = {"rounds": [], "load_s": []}
    for r in range(args.repeats + 1):
        ctx["iteration"] += 1
        target = base / f"iter_{ctx['iteration']:07d}"
        target.mkdir(parents=True)
        sd = mg_state_dict(tensors, ctx["iteration"])
        settle(args)
        base_update = _update(tensors)
        t0 = time.perf_counter()
        request = dist_checkpointing.save(
            sd, str(target), sharded_strategy=strategy, async_sharded_save=mode == "async"
        )
        if request is not None and fork:
            queue.schedule_async_request(request)
        t1 = time.perf_counter()
        update = _update(tensors)
        if request is not None and not fork:
            request.execute_sync()  # waits for tiercheck's commit, then the finalize functions
        queue.maybe_finalize_async_calls(blocking=True)
        rnd = {
            "save_s": t1 - t0,
            "update_s": update,
            "update_base_s": base_update,
            "finalized_s": time.perf_counter() - t0,
        }
        res["rounds"].append(rnd)
        h.log(
            f"  megatron {method} round {r}: save {rnd['save_s']:.2f}s, update {update:.2f}s (before the save "
            f"{base_update:.2f}s), finalized {rnd['finalized_s']:.2f}s"
        )
    res["bytes_on_disk"] = h.tree_bytes(target if kind == "torch_dist" else ctx["local"])
    fresh = mg_tensors(len(next(iter(tensors.values()))), random=False)
    dropped = []
    for _ in range(args.repeats):
        for layers in fresh.values():
            for t in layers:
                t.zero_()
        sd = mg_state_dict(fresh, 0)
        dropped.append(h.prepare(not args.no_drop_caches, args.settle_max_s))
        s, loaded = h.timed(lambda: dist_checkpointing.load(sd, str(target)))  # noqa: B023
        res["load_s"].append(s)
        h.log(f"  megatron {method}: load {s:.2f}s")
    res["dropped_caches"] = all(dropped)
    same = all(torch.equal(a, b) for k in tensors for a, b in zip(tensors[k], fresh[k], strict=True))
    if not same or loaded["progress"]["iteration"] != ctx["iteration"]:
        raise RuntimeError("the loaded state differs from the saved one")
    return res


def run_megatron(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    shimmed = cpu_only_cuda_shims()
    from tiercheck.integrations import megatron as tc_megatron  # first: it imports megatron-core quietly

    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # isort: skip

    n_layers = max(1, round(args.gib * GiB / (12 * sum(math.prod(s) for s in MG_PARAMS.values()))))
    h.log(f"megatron: {n_layers} layers; generating the tensors")
    tensors = mg_tensors(n_layers, random=True)
    nbytes = sum(t.nbytes for layers in tensors.values() for t in layers)
    out: dict[str, Any] = {"n_layers": n_layers, "bytes": nbytes, "cuda_shims": shimmed, "methods": {}}
    local = root / "mg-tiercheck-local"
    backend = tc_megatron.install(local=str(local))
    ctx = {"root": root, "local": local, "tensors": tensors, "queue": AsyncCallsQueue(persistent=False), "iteration": 0}
    _update(tensors)  # warm
    try:
        for method in MG_METHODS:
            out["methods"][method] = _guard(f"megatron {method}", lambda m=method: run_megatron_method(m, ctx, args))
            with contextlib.suppress(Exception):
                ctx["queue"].maybe_finalize_async_calls(blocking=True)
            shutil.rmtree(root / f"mg-{'-'.join(method.split())}", ignore_errors=True)
            gc.collect()
            os.sync()
    finally:
        ctx["queue"].close()
        backend.close()
        shutil.rmtree(local, ignore_errors=True)
    return out


def _guard(name: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, or ``{"error": ...}`` when it raised (one method or framework failing still prints the rest)."""
    try:
        return fn()
    except Exception as e:
        h.log(f"{name} FAILED: {type(e).__name__}: {e}")
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}


# ---------------------------------------------------------------------------------------------
# Report


def summarize(res: dict[str, Any], framework: str) -> dict[str, Any] | None:
    """Medians over the rounds after the warm-up; "extra" = the next step / update over the same work
    with nothing in flight (DeepSpeed: the mean of the steps just before and after)."""
    if "error" in res or not res.get("rounds"):
        return None
    rounds = res["rounds"]
    if framework == "deepspeed":
        extra = [r["next_step_s"] - (b + r["post_step_s"]) / 2 for r, b in zip(rounds, res["baseline_s"], strict=True)]
        base = res["baseline_s"] + [r["post_step_s"] for r in rounds]
    else:
        extra = [r["update_s"] - r["update_base_s"] for r in rounds]
        base = [r["update_base_s"] for r in rounds]
    out = {k: h.median([r.get(k) for r in rounds[1:]]) for k in ("save_s", "durable_s", "finalized_s", "flush_s")}
    out |= {"extra_s": h.median(extra[1:]), "load_s": h.median(res["load_s"]), "base_s": statistics.median(base)}
    out |= {"base_range": (min(base), max(base)), "first_save_s": rounds[0]["save_s"]}
    out["stall_s"] = h.median([r["save_s"] + e for r, e in zip(rounds[1:], extra[1:], strict=True)])
    out["first_stall_s"] = rounds[0]["save_s"] + extra[0]
    hs = [r["handle"] for r in rounds[1:] if "handle" in r]
    for k in ("blocked_s", "persist_s", "durable_s"):
        out[f"handle_{k}"] = h.median([x[k] for x in hs])
    out["first_blocked_s"] = rounds[0].get("handle", {}).get("blocked_s")
    return out


DS_COLS = {"save_s": "save_checkpoint blocks", "extra_s": "next step +", "stall_s": "stall", "durable_s": "durable"}
DS_COLS |= {"load_s": "load", "first_stall_s": "first stall"}
MG_COLS = {"save_s": "save blocks", "extra_s": "next update +", "stall_s": "stall", "finalized_s": "finalized"}
MG_COLS |= {"load_s": "load", "first_save_s": "first save blocks"}
DS_LABELS = {"native": "native (torch.save)", "tiercheck": "tiercheck"}
MG_RATIOS = [("tiercheck sync", "torch_dist sync"), ("tiercheck async", "torch_dist async")]
MG_RATIOS.append(("tiercheck async nofork", "torch_dist async"))


def _method_table(
    methods: dict[str, Any], cols: dict[str, str], labels: dict[str, str], ratios: list[Any], fw: str
) -> tuple[str, dict[str, Any]]:
    s = {k: summarize(v, fw) for k, v in methods.items()}
    rows = []
    for name, label in labels.items():
        x = s.get(name)
        err = methods.get(name, {}).get("error", "not run")
        rows.append([label] + ([h.fmt(x[c]) for c in cols] if x else [f"FAILED: {err}"] + [""] * (len(cols) - 1)))
    for num, den in ratios:
        a, b = s.get(num), s.get(den)
        if a and b:
            rows.append([f"{num} / {den}"] + [h.fmt(h.ratio(a[c], b[c]), suffix="x") for c in cols])
    return h.table(["method", *(f"{c} (s)" for c in cols.values())], rows), s


def _limits_line(nbytes: int, limits: dict[str, Any] | None) -> str | None:
    if not limits:
        return None
    scale = nbytes / limits["bytes"]
    copies = ", ".join(f"{t} {s * scale:.2f}s" for t, s in limits["memcpy_s"].items())
    return f"For {nbytes / GiB:.2f} GiB this machine needs: memcpy {copies}; fsync'd write {limits['disk_s'] * scale:.2f}s."


def _dropped_line(methods: dict[str, Any]) -> str:
    ok = all(v.get("dropped_caches") for v in methods.values() if "error" not in v)
    return f"Page cache dropped before every load: {'yes' if ok else 'no (not root or --no-drop-caches)'}."


def render(report: dict[str, Any]) -> str:
    out = [f"{h.machine_line(report['machine'])}. Medians of {report['repeats']} repeats after one warm-up round."]
    lim = report.get("limits")
    lim = lim if lim and "error" not in lim else None
    if lim:
        gib = lim["bytes"] / GiB
        label = "memcpy into a preallocated buffer, {} thread(s)"
        rows = [[label.format(t[:-1]), f"{s:.3f}", f"{gib / s:.1f}"] for t, s in lim["memcpy_s"].items()]
        rows.append(["fsync'd sequential write", f"{lim['disk_s']:.2f}", f"{lim['disk_gib_s']:.2f}"])
        out += ["", f"### Machine limits ({gib:.2f} GiB)", "", h.table(["measurement", "time (s)", "GiB/s"], rows)]
    ds, mg = report.get("deepspeed"), report.get("megatron")
    if ds and "error" not in ds:
        nbytes = ds["methods"].get("native", {}).get("bytes") or 16 * ds["params"]
        table, s = _method_table(ds["methods"], DS_COLS, DS_LABELS, [("tiercheck", "native")], "deepspeed")
        title = f"DeepSpeed ZeRO-1, fp32 AdamW: {ds['n_blocks']} MLP blocks, {ds['params'] / 1e6:.0f}M parameters"
        out += ["", f"### {title}, {nbytes / GiB:.2f} GiB checkpoint", "", table, ""]
        bases = {k: x["base_s"] for k, x in s.items() if x}
        ranges = [x["base_range"] for x in s.values() if x]
        if ranges:
            steps = ", ".join(f"{k} {v:.2f}s" for k, v in bases.items())
            lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
            out.append(f"Steps without a checkpoint: median {steps}, range {lo:.2f}-{hi:.2f}s (spread = noise).")
        if (a := s.get("tiercheck")) and a.get("handle_blocked_s") is not None:
            out.append(
                f"tiercheck: Checkpointer.save() blocked {a['handle_blocked_s']:.2f}s (first round "
                f"{h.fmt(a['first_blocked_s'])}s), writes {h.fmt(a['handle_persist_s'])}s, save() to committed "
                f"{h.fmt(a['handle_durable_s'])}s; checkpoint_engine.flush() returned {h.fmt(a['flush_s'])}s after save."
            )
        out += [_limits_line(nbytes, lim), _dropped_line(ds["methods"])]
    out += report.get("deepspeed_writers") or []
    if mg and "error" not in mg:
        table, s = _method_table(mg["methods"], MG_COLS, {m: m for m in MG_METHODS}, MG_RATIOS, "megatron")
        title = f"Megatron-core {report.get('megatron_core', '')} dist_checkpointing: {mg['n_layers']} layers"
        out += ["", f"### {title}, {mg['bytes'] / GiB:.2f} GiB of ShardedTensors", "", table, ""]
        base = h.median([x["base_s"] for x in s.values() if x])
        out.append(f"Update of every tensor with nothing in flight: median {h.fmt(base)}s.")
        if mg.get("cuda_shims"):
            out.append("torch.cuda.synchronize and torch.cuda.current_device were no-ops (no CUDA here).")
        out += [_limits_line(mg["bytes"], lim), _dropped_line(mg["methods"])]
    share = 100 * report["foreign"]["foreign_cpu_share"]
    out += ["", *h.noise_warnings("the run", report["foreign"]), f"Other processes used {share:.0f}% of the CPUs."]
    return "\n".join(line for line in out if line is not None)


# ---------------------------------------------------------------------------------------------
# Main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--gib", type=float, default=None, help="checkpoint size in GiB per framework (default 1; quick 0.25)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of every measurement (default 3)")
    p.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS), help="default: both")
    h.common_args(p, settle_s=3.0, json_path=False)  # --dir default: under /tmp
    args = p.parse_args(argv)
    args.gib = args.gib or (0.25 if args.quick else 1.0)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t_start, out = time.perf_counter(), tables_stream()
    h.init_one_rank()
    report: dict[str, Any] = {"repeats": args.repeats}
    foreign = h.ForeignCpu()
    with h.scratch_dir(args.dir or tempfile.gettempdir(), "framework_bench-", args.keep) as root:
        report["machine"] = h.machine_info(root)
        h.log(f"checkpoints under {root}; {args.gib} GiB per framework, {args.repeats} repeats")
        report["limits"] = _guard("limits", lambda: measure_limits(root, int(args.gib * GiB), args))
        if "deepspeed" in args.frameworks:
            report["deepspeed"] = _guard("deepspeed", lambda: run_deepspeed(root, args))
        if "megatron" in args.frameworks:
            report["megatron"] = _guard("megatron", lambda: run_megatron(root, args))
            with contextlib.suppress(Exception):
                from megatron.core.package_info import __version__ as mc_version

                report["megatron_core"] = mc_version
        if "deepspeed" in args.frameworks:
            h.log("deepspeed: trying its fast and decoupled checkpoint engines on a tiny model")
            report["deepspeed_writers"] = _guard("deepspeed writers", lambda: try_deepspeed_writers(root))
            if isinstance(report["deepspeed_writers"], dict):
                report["deepspeed_writers"] = []
    report["foreign"] = foreign.stop()
    print(render(report), file=out)
    out.flush()
    h.log(f"done in {time.perf_counter() - t_start:.0f}s")
    ran = [report.get(fw) for fw in args.frameworks]
    failed = [m for r in ran if r and "error" not in r for m, v in r["methods"].items() if "error" in v]
    return 1 if failed or any(not r or "error" in r for r in ran) else 0


if __name__ == "__main__":
    sys.exit(main())
