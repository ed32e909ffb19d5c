#!/usr/bin/env python
"""Framework benchmark: DeepSpeed and Megatron-core checkpointing, natively and through tiercheck's plugins.

Usage::

    .venv/bin/python bench/framework_bench.py            # ~1 GiB checkpoints, 3 repeats (~4 min here)
    .venv/bin/python bench/framework_bench.py --quick    # ~0.25 GiB checkpoints (~1.5-2 min)
    .venv/bin/python bench/framework_bench.py --gib 2 --repeats 5 --frameworks megatron

Everything runs in this one process as one rank (world size 1): the gloo process group is
initialised from ``MASTER_ADDR``/``MASTER_PORT`` (a free loopback port), ``RANK=0``,
``WORLD_SIZE=1``, ``LOCAL_RANK=0``. Markdown tables go to stdout, progress to stderr (anything
DeepSpeed or Megatron print goes to stderr too). Checkpoints are written under ``--dir`` (default: a
fresh directory under /tmp), which is removed at the end unless ``--keep``. Every measurement is
repeated ``--repeats`` times (default 3) and the median is reported, with ratios tiercheck/native.

1. DeepSpeed (ZeRO stage 1, fp32, ``AdamW`` with ``torch_adam``) on a stack of MLP blocks
   (Linear(1024, 4096), GELU, Linear(4096, 1024)) sized so the checkpoint (fp32 weights + ZeRO's fp32
   partition + Adam's two moments, 4x the parameter bytes) is about ``--gib`` GiB. Two methods, each on a
   freshly built engine from the same seed:

   - ``native``: DeepSpeed's default ``TorchCheckpointEngine`` (one ``torch.save`` per file);
   - ``tiercheck``: ``tiercheck.integrations.deepspeed.install(engine, local=...)``.

   Each round is: one training step without a checkpoint, ``engine.save_checkpoint(dir)`` (timed:
   "save blocks"; tiercheck's plugin copies the state into its host staging pool before it returns),
   the next training step, then one more step with nothing in flight. "next step +" is the next step's
   excess over the mean of the steps before and after (tiercheck's background writer shares the CPUs
   with it; with a plugin that stages at DeepSpeed's decoupled commit the copy lands here too).
   "stall" = save blocks + next step +. "durable": native's ``torch.save`` does not fsync, so when
   ``save_checkpoint`` returns its bytes are only in the page cache; the benchmark then fsyncs every
   file it wrote and the directories, and "durable" is the time from the save call until that fsync
   returned (before the next step). For tiercheck, "durable" is the time from the save call until the
   step committed (every chunk, the manifest and ``COMMIT`` fsync'd; the callback of the
   ``SaveHandle``, recorded by wrapping the Checkpointer's ``save``), while the next step runs;
   ``engine.checkpoint_engine.flush()`` is called after that step (it also waits for ``latest``) and
   is reported too. The first round of each method is a warm-up reported separately ("first
   stall": tiercheck allocates its host staging pool and plans then). Loading: one fresh engine per
   method (tiercheck installed on it with the same ``local``), then ``engine.load_checkpoint(dir)``
   ``--repeats`` times, each after dropping the page cache (root only; both methods or neither, the
   tables say which), checking that the engine's ``global_steps`` is the last save's.

   DeepSpeed's own fast/decoupled checkpoint engine (config ``"checkpoint": {"writer": {...}}``) is
   tried on a tiny model at the end: ``{"type": "fast"}`` and ``{"type": "python", "decoupled":
   true}``. Where one cannot run on this CPU machine, one line says so and why.

2. Megatron-core ``dist_checkpointing`` on a sharded state dict built by hand (as
   examples/megatron_train.py does): per layer an MLP (fc1 4096x1024 + bias, fc2 1024x4096 + bias, a
   norm weight) as ``ShardedTensor``s stacked over the layers (``prepend_axis_num=1``, as Megatron
   keys layers), the same for Adam's ``exp_avg`` and ``exp_avg_sq``, a ``ShardedObject`` and a few
   common values (``common.pt``); about ``--gib`` GiB of tensors. The methods: the default
   ``torch_dist`` strategy sync and async, and tiercheck (``install(local=...)``,
   ``sharded_strategy=("tiercheck", 1)``) sync and async. Async saves go through
   ``AsyncCallsQueue(persistent=False)`` (the forking caller, as the example uses); a fifth method,
   "tiercheck async nofork", runs the same AsyncRequest with ``request.execute_sync()`` after the
   update instead, to separate the cost of Megatron's fork from tiercheck's. Each round:
   ``dist_checkpointing.save`` (+ ``schedule_async_request``) is timed ("save blocks"); then every
   tensor is rewritten in place with the same values (``mul_(1.0)``, the memory traffic of an
   optimizer step; "next update +" is its excess over the same update just before the save: on
   CPU, torch_dist's async save makes no host copy and relies on the fork's copy-on-write snapshot,
   whose page copies this update pays for); then ``maybe_finalize_async_calls(blocking=True)``.
   "finalized" is the time from the save call until the save returned (sync) or was finalized
   (async: ``metadata.json`` written), including the update. torch_dist fsyncs its data files
   (Megatron's writer uses ``use_fsync=True``). Loading: ``dist_checkpointing.load`` of each method's
   last checkpoint into preallocated zero tensors, ``--repeats`` times after dropping the page
   cache, checked bit for bit against the saved tensors. On a CPU build of torch, Megatron's save path
   calls ``torch.cuda.synchronize()`` and ``torch.cuda.current_device()``, which raise there; when
   CUDA is unavailable exactly these two are replaced with no-ops (``current_device`` returning
   ``"cpu"``), as examples/megatron_train.py does. Nothing else of torch or Megatron is changed.

3. The machine's limits, in the same run: memcpy (``copy_`` of a tensor of the checkpoint's size
   into a preallocated, already faulted buffer; 1 thread and torch's default thread count) and the
   fsync'd sequential write of the checkpoint's size into the benchmark directory (``os.write`` in
   64 MiB blocks, ``fsync``, directory ``fsync``), so stalls can be read against memcpy time and
   "durable" against disk time.

Before each timed save, load and limit measurement the script waits (up to ``--settle-max-s``) for
the hypervisor to stop stealing CPU (see save_bench.settle), and it reports the CPU other processes
used during the run: on 2 shared cores every number moves with other load. See bench/README.md
("Framework benchmark").
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
for _p in (str(REPO), str(BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from save_bench import (  # noqa: E402  (bench/ on sys.path first)
    ForeignCpu,
    drop_page_cache,
    fsync_dir,
    machine_info,
    measure_disk_write,
    settle,
)

GiB = 1 << 30
MiB = 1 << 20
D = 1024  # model width: every matrix is 4D x D fp32 = 16 MiB
BATCH = 16  # DeepSpeed micro batch: a real forward/backward/step that touches every parameter
SEED = 1234
FRAMEWORKS = ("deepspeed", "megatron")
MEGATRON_METHODS = (
    "torch_dist sync",
    "torch_dist async",
    "tiercheck sync",
    "tiercheck async",
    "tiercheck async nofork",
)


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None and a >= 0 and b > 0 else None


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


# --------------------------------------------------------------------------------------------
# Process setup: one rank, gloo, stdout kept for the tables
# --------------------------------------------------------------------------------------------


def tables_stream() -> TextIO:
    """A stream to the real stdout; file descriptor 1 then points at stderr, so that DeepSpeed's
    logger, Megatron's warnings and prints of their child processes never mix with the tables."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def init_one_rank() -> None:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    # DeepSpeed's checkpoint writers read the launcher's node count and index.
    os.environ.setdefault("CROSS_RANK", "0")
    os.environ.setdefault("CROSS_SIZE", "1")
    dist.init_process_group("gloo")


def cpu_only_cuda_shims() -> bool:
    """No-op exactly torch.cuda.synchronize and torch.cuda.current_device when CUDA is unavailable
    (Megatron's save path calls both; a CPU build of torch raises in them)."""
    import torch

    if torch.cuda.is_available():
        return False
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    return True


def prepare(args: argparse.Namespace) -> None:
    """Before a timed phase: flush dirty pages, let the hypervisor's steal settle."""
    os.sync()
    settle(args.settle_max_s)


def cold(args: argparse.Namespace) -> bool:
    """Before a timed load: drop the page cache (root only, unless --no-drop-caches)."""
    dropped = drop_page_cache(not args.no_drop_caches)
    settle(args.settle_max_s)
    return dropped


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path``; tiercheck's retention may be removing an old step meanwhile."""
    total = 0
    for top, _dirs, files in os.walk(path):  # os.walk skips a directory that vanished
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(top, name)).st_size
    return total


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and every directory, bottom up (what native torch.save skips)."""
    for dirpath, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            fsync_file(Path(dirpath) / name)
        fsync_dir(Path(dirpath))


# --------------------------------------------------------------------------------------------
# Machine limits
# --------------------------------------------------------------------------------------------


def measure_memcpy(nbytes: int, repeats: int) -> dict[str, float]:
    """Median seconds of ``dst.copy_(src)`` for ``nbytes`` into a preallocated, faulted buffer."""
    import torch

    default = torch.get_num_threads()
    src = torch.empty(nbytes // 4).fill_(1.5)
    dst = torch.empty_like(src)
    dst.copy_(src)
    out: dict[str, float] = {}
    try:
        for threads in sorted({1, default}):
            torch.set_num_threads(threads)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                dst.copy_(src)
                times.append(time.perf_counter() - t0)
            out[f"{threads}t"] = statistics.median(times)
    finally:
        torch.set_num_threads(default)
    return out


def measure_limits(root: Path, nbytes: int, args: argparse.Namespace) -> dict[str, Any]:
    _log(f"limits: memcpy and fsync'd write of {nbytes / GiB:.2f} GiB")
    prepare(args)
    memcpy = measure_memcpy(nbytes, max(3, args.repeats))
    gc.collect()
    disk = []
    for _ in range(args.repeats):
        prepare(args)
        disk.append(measure_disk_write(root, nbytes))
    durable = statistics.median(d["durable_s"] for d in disk)
    return {"bytes": nbytes, "memcpy_s": memcpy, "disk_s": durable, "disk_gib_s": nbytes / GiB / durable}


# --------------------------------------------------------------------------------------------
# DeepSpeed
# --------------------------------------------------------------------------------------------


def ds_blocks(gib: float) -> int:
    """MLP blocks so the ZeRO-1 checkpoint (4 x fp32 parameter bytes) is about ``gib``."""
    block_params = 8 * D * D + 5 * D
    return max(1, round(gib * GiB / (16 * block_params)))


def ds_config(writer: dict[str, Any] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if writer is not None:
        config["checkpoint"] = {"writer": writer}
    return config


def ds_engine(n_blocks: int, writer: dict[str, Any] | None = None, width: int = D) -> Any:
    import deepspeed
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    with torch.device("meta"):  # materialised once below: nn.Linear's default init costs seconds
        model = nn.Sequential(
            *(
                nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                for _ in range(n_blocks)
            )
        )
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(writer))
    return engine


def ds_step(engine: Any, step: int, width: int = D) -> float:
    import torch

    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(step))
    t0 = time.perf_counter()
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - t0


def run_deepspeed_method(method: str, root: Path, n_blocks: int, args: argparse.Namespace) -> dict[str, Any]:
    import tiercheck.integrations.deepspeed as tiercheck_ds

    save_dir = root / f"ds-{method}"
    local = root / f"ds-{method}-local"
    res: dict[str, Any] = {"rounds": [], "baseline_s": [], "load_s": []}
    t_build = time.perf_counter()
    engine = ds_engine(n_blocks)
    res["build_s"] = time.perf_counter() - t_build
    handles: list[Any] = []
    committed_at: dict[int, float] = {}  # id(handle) -> when its step became durable (committed)
    if method == "tiercheck":
        ours = tiercheck_ds.install(engine, local=str(local))
        # Record each SaveHandle (its timings, and when it commits while training goes on): the
        # Checkpointer for save_dir is created here, as the first save_checkpoint would, and its
        # save() is wrapped. Nothing of the plugin is changed.
        ckpt = ours.checkpointer(str(save_dir))
        original_save = ckpt.save

        def recording_save(*a: Any, **k: Any) -> Any:
            h = original_save(*a, **k)
            handles.append(h)
            key = id(h)
            h.committed.add_done_callback(lambda _f: committed_at.setdefault(key, time.perf_counter()))
            return h

        ckpt.save = recording_save  # type: ignore[method-assign]
    step = 0
    for _ in range(2):  # warm-up: allocator, Adam state, DeepSpeed's buffers
        ds_step(engine, step)
        step += 1
    for r in range(args.repeats + 1):
        prepare(args)
        res["baseline_s"].append(ds_step(engine, step))
        step += 1
        rnd: dict[str, Any] = {"global_steps": int(engine.global_steps)}
        t0 = time.perf_counter()
        engine.save_checkpoint(str(save_dir))
        t1 = time.perf_counter()
        rnd["save_s"] = t1 - t0
        if method == "native":
            fsync_tree(save_dir / f"global_step{rnd['global_steps']}")
            fsync_file(save_dir / "latest")
            fsync_dir(save_dir)
            rnd["durable_s"] = time.perf_counter() - t0
            rnd["next_step_s"] = ds_step(engine, step)
            step += 1
        else:
            rnd["next_step_s"] = ds_step(engine, step)
            step += 1
            engine.checkpoint_engine.flush()
            rnd["flush_s"] = time.perf_counter() - t0
            h = handles[-1]
            rnd["durable_s"] = committed_at[id(h)] - t0
            rnd["handle"] = {k: float(v) for k, v in dict(h.timings).items()}
        # The step after, with nothing in flight: the next step is compared with the mean of the
        # steps before and after (A-B-A cancels slow drift of the machine's other load).
        rnd["post_step_s"] = ds_step(engine, step)
        step += 1
        res["rounds"].append(rnd)
        _log(
            f"  deepspeed {method} round {r}{' (warm-up)' if r == 0 else ''}: save {rnd['save_s']:.2f}s, "
            f"next step {rnd['next_step_s']:.2f}s (before {res['baseline_s'][-1]:.2f}s, after "
            f"{rnd['post_step_s']:.2f}s), durable {rnd['durable_s']:.2f}s"
        )
    last_step = res["rounds"][-1]["global_steps"]
    tag_dir = save_dir / f"global_step{last_step}"
    res["bytes"] = tree_bytes(tag_dir) if method == "native" else None
    engine.destroy()
    del engine
    gc.collect()

    _log(f"  deepspeed {method}: loading into a fresh engine")
    fresh = ds_engine(n_blocks)
    if method == "tiercheck":
        tiercheck_ds.install(fresh, local=str(local))
    dropped = []
    for _ in range(args.repeats):
        dropped.append(cold(args))
        t0 = time.perf_counter()
        path, _client = fresh.load_checkpoint(str(save_dir))
        res["load_s"].append(time.perf_counter() - t0)
        if path is None or int(fresh.global_steps) != last_step:
            raise RuntimeError(
                f"load_checkpoint gave {path!r} at global_steps {fresh.global_steps}, expected {last_step}"
            )
        _log(f"  deepspeed {method}: load {res['load_s'][-1]:.2f}s")
    res["dropped_caches"] = all(dropped)
    fresh.destroy()
    del fresh
    gc.collect()
    shutil.rmtree(save_dir, ignore_errors=True)
    shutil.rmtree(local, ignore_errors=True)
    os.sync()
    return res


def try_deepspeed_writers(root: Path) -> list[str]:
    """One line per DeepSpeed fast/decoupled writer configuration: whether it saves a tiny model here."""
    lines = []
    for name, writer in (
        ("fast", {"type": "fast"}),
        ("decoupled (python writer)", {"type": "python", "decoupled": True}),
    ):
        engine = None
        stage, notes = "deepspeed.initialize", ""
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
            msg = str(e).splitlines()[0] if str(e) else ""
            msg = msg.split(".  ")[0][:160]
            lines.append(
                f"DeepSpeed {name} checkpoint engine {writer} cannot run here: {stage} fails with "
                f"{type(e).__name__}: {msg} (in {Path(where.filename).name}:{where.lineno} {where.name}){notes}."
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
    n_blocks = ds_blocks(args.gib)
    out: dict[str, Any] = {"n_blocks": n_blocks, "params": n_blocks * (8 * D * D + 5 * D), "methods": {}}
    for method in ("native", "tiercheck"):
        _log(f"deepspeed {method}: {n_blocks} blocks, {out['params'] / 1e6:.0f}M parameters")
        try:
            out["methods"][method] = run_deepspeed_method(method, root, n_blocks, args)
        except Exception as e:
            _log(f"deepspeed {method} FAILED: {type(e).__name__}: {e}")
            traceback.print_exc()
            out["methods"][method] = {"error": f"{type(e).__name__}: {e}"}
    return out


# --------------------------------------------------------------------------------------------
# Megatron-core dist_checkpointing
# --------------------------------------------------------------------------------------------

MG_PARAMS = {
    "fc1.weight": (4 * D, D),
    "fc1.bias": (4 * D,),
    "fc2.weight": (D, 4 * D),
    "fc2.bias": (D,),
    "norm.weight": (D,),
}


def mg_layers(gib: float) -> int:
    layer_params = sum(int(_prod(s)) for s in MG_PARAMS.values())
    return max(1, round(gib * GiB / (12 * layer_params)))


def _prod(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def mg_tensors(n_layers: int, *, random: bool) -> dict[str, list[Any]]:
    """Global key -> per-layer tensors: weights, Adam's exp_avg and exp_avg_sq."""
    import torch

    g = torch.Generator().manual_seed(SEED)
    out: dict[str, list[Any]] = {}
    for name, shape in MG_PARAMS.items():
        for prefix in ("", "optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq."):
            key = f"{prefix}decoder.layers.{name}"
            out[key] = [torch.randn(shape, generator=g) if random else torch.zeros(shape) for _ in range(n_layers)]
    return out


def mg_state_dict(tensors: dict[str, list[Any]], iteration: int) -> dict[str, Any]:
    """Megatron's shape of a sharded state dict: layers stacked on a prepended axis, plus objects."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    sd: dict[str, Any] = {"model": {}, "optimizer": {"state": {}}}
    for key, layers in tensors.items():
        n = len(layers)
        for i, t in enumerate(layers):
            st = ShardedTensor.from_rank_offsets(key, t, (0, i, n), replica_id=0, prepend_axis_num=1)
            where = sd["optimizer"]["state"] if key.startswith("optimizer.") else sd["model"]
            where[f"{key}.{i}"] = st
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


def run_megatron(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    shimmed = cpu_only_cuda_shims()
    from tiercheck.integrations import megatron as tc_megatron  # first: it imports megatron-core quietly

    from megatron.core import dist_checkpointing  # isort: skip
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # isort: skip

    n_layers = mg_layers(args.gib)
    _log(f"megatron: {n_layers} layers; generating the tensors")
    tensors = mg_tensors(n_layers, random=True)
    nbytes = sum(t.nbytes for layers in tensors.values() for t in layers)
    out: dict[str, Any] = {"n_layers": n_layers, "bytes": nbytes, "cuda_shims": shimmed, "methods": {}}
    local = root / "mg-tiercheck-local"
    backend = tc_megatron.install(local=str(local))
    queue = AsyncCallsQueue(persistent=False)
    _update(tensors)  # warm
    iteration = 0
    try:
        for method in MEGATRON_METHODS:
            kind, mode, *how = method.split()
            fork = not how  # "nofork": the AsyncRequest is run with execute_sync() instead of the queue
            strategy = ("tiercheck", 1) if kind == "tiercheck" else None
            base = root / f"mg-{'-'.join(method.split())}"
            res: dict[str, Any] = {"rounds": [], "load_s": []}
            out["methods"][method] = res
            try:
                last = None
                for r in range(args.repeats + 1):
                    iteration += 1
                    target = base / f"iter_{iteration:07d}"
                    target.mkdir(parents=True)
                    sd = mg_state_dict(tensors, iteration)
                    prepare(args)
                    base_update = _update(tensors)  # the same update with nothing in flight, just before
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
                    t2 = time.perf_counter()
                    rnd = {"save_s": t1 - t0, "update_s": update, "update_base_s": base_update, "finalized_s": t2 - t0}
                    res["rounds"].append(rnd)
                    last = target
                    _log(
                        f"  megatron {method} round {r}{' (warm-up)' if r == 0 else ''}: save {rnd['save_s']:.2f}s, "
                        f"update {update:.2f}s (before the save {base_update:.2f}s), "
                        f"finalized {rnd['finalized_s']:.2f}s"
                    )
                assert last is not None
                res["bytes_on_disk"] = tree_bytes(last) if kind == "torch_dist" else tree_bytes(local)
                fresh = mg_tensors(n_layers, random=False)
                dropped = []
                for _ in range(args.repeats):
                    for layers in fresh.values():
                        for t in layers:
                            t.zero_()
                    sd = mg_state_dict(fresh, 0)
                    dropped.append(cold(args))
                    t0 = time.perf_counter()
                    loaded = dist_checkpointing.load(sd, str(last))
                    res["load_s"].append(time.perf_counter() - t0)
                    _log(f"  megatron {method}: load {res['load_s'][-1]:.2f}s")
                res["dropped_caches"] = all(dropped)
                same = all(torch.equal(a, b) for k in tensors for a, b in zip(tensors[k], fresh[k], strict=True))
                if not same or loaded["progress"]["iteration"] != iteration:
                    raise RuntimeError("the loaded state differs from the saved one")
                del fresh, loaded, sd
            except Exception as e:
                _log(f"megatron {method} FAILED: {type(e).__name__}: {e}")
                traceback.print_exc()
                res["error"] = f"{type(e).__name__}: {e}"
                with contextlib.suppress(Exception):
                    queue.maybe_finalize_async_calls(blocking=True)
            shutil.rmtree(base, ignore_errors=True)
            gc.collect()
            os.sync()
    finally:
        queue.close()
        backend.close()
        shutil.rmtree(local, ignore_errors=True)
    return out


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _rounds(res: dict[str, Any], key: str) -> list[float]:
    return [r[key] for r in res.get("rounds", [])[1:] if key in r]


def summarize_ds(res: dict[str, Any]) -> dict[str, Any] | None:
    if "error" in res or not res.get("rounds"):
        return None
    # Each round's next step against the step just before its save (pairs cancel slow drift).
    extra_all = [
        r["next_step_s"] - (b + r["post_step_s"]) / 2 for r, b in zip(res["rounds"], res["baseline_s"], strict=True)
    ]
    rounds, extra = res["rounds"][1:], extra_all[1:]
    first = res["rounds"][0]
    return {
        "baseline_s": statistics.median(res["baseline_s"] + [r["post_step_s"] for r in res["rounds"]]),
        "baseline_range": (
            min(res["baseline_s"] + [r["post_step_s"] for r in res["rounds"]]),
            max(res["baseline_s"] + [r["post_step_s"] for r in res["rounds"]]),
        ),
        "flush_s": _median(_rounds(res, "flush_s")),
        "save_s": _median(_rounds(res, "save_s")),
        "extra_s": _median(extra),
        "stall_s": _median([r["save_s"] + e for r, e in zip(rounds, extra, strict=True)]),
        "durable_s": _median(_rounds(res, "durable_s")),
        "load_s": _median(res["load_s"]),
        "first_stall_s": first["save_s"] + extra_all[0],
        "blocked_s": _median([r["handle"]["blocked_s"] for r in rounds if "handle" in r]),
        "first_blocked_s": first.get("handle", {}).get("blocked_s"),
        "persist_s": _median([r["handle"]["persist_s"] for r in rounds if "handle" in r]),
        "handle_durable_s": _median([r["handle"]["durable_s"] for r in rounds if "handle" in r]),
    }


def summarize_mg(res: dict[str, Any]) -> dict[str, Any] | None:
    if "error" in res or not res.get("rounds"):
        return None
    rounds = res["rounds"][1:]
    extra = [r["update_s"] - r["update_base_s"] for r in rounds]
    return {
        "update_base_s": statistics.median(r["update_base_s"] for r in res["rounds"]),
        "save_s": _median(_rounds(res, "save_s")),
        "extra_s": _median(extra),
        "stall_s": _median([r["save_s"] + e for r, e in zip(rounds, extra, strict=True)]),
        "finalized_s": _median(_rounds(res, "finalized_s")),
        "load_s": _median(res["load_s"]),
        "first_save_s": res["rounds"][0]["save_s"],
    }


def _limits_line(nbytes: int, limits: dict[str, Any] | None) -> str:
    if not limits:
        return ""
    scale = nbytes / limits["bytes"]
    copies = ", ".join(f"{t} {s * scale:.2f}s" for t, s in limits["memcpy_s"].items())
    return f"For {nbytes / GiB:.2f} GiB this machine needs: memcpy {copies}; fsync'd write {limits['disk_s'] * scale:.2f}s."


def render(report: dict[str, Any]) -> str:
    lines: list[str] = []
    m = report["machine"]
    lines.append(
        f"Machine: {m['cpu_count']} CPUs ({m['cpu_model']}), {m['ram_bytes'] / GiB:.0f} GiB RAM, "
        f"torch {m['torch']} ({m['torch_threads']} threads), tiercheck {m['tiercheck']}, "
        f"checkpoints on {m['checkpoint_fs']}. Medians of {report['repeats']} repeats (after one warm-up round)."
    )
    limits = report.get("limits")
    if limits:
        lines += [
            "",
            f"### Machine limits ({limits['bytes'] / GiB:.2f} GiB)",
            "",
            "| measurement | time (s) | GiB/s |",
            "|---|---:|---:|",
        ]
        for t, s in limits["memcpy_s"].items():
            lines.append(
                f"| memcpy into a preallocated buffer, {t.replace('t', ' thread(s)')} | {s:.3f} | {limits['bytes'] / GiB / s:.1f} |"
            )
        lines.append(f"| fsync'd sequential write | {limits['disk_s']:.2f} | {limits['disk_gib_s']:.2f} |")

    ds = report.get("deepspeed")
    if ds:
        nat = ds["methods"].get("native", {})
        nbytes = nat.get("bytes") or 16 * ds["params"]
        s = {k: summarize_ds(v) for k, v in ds["methods"].items()}
        dropped = all(v.get("dropped_caches", False) for v in ds["methods"].values() if "error" not in v)
        lines += [
            "",
            f"### DeepSpeed ZeRO-1, fp32 AdamW: {ds['n_blocks']} MLP blocks, {ds['params'] / 1e6:.0f}M parameters, "
            f"{nbytes / GiB:.2f} GiB checkpoint",
            "",
            "| method | save_checkpoint blocks (s) | next step + (s) | stall (s) | durable (s) | load (s) | first stall (s) |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, label in (("native", "native (torch.save)"), ("tiercheck", "tiercheck")):
            x = s.get(name)
            if x is None:
                lines.append(f"| {label} | FAILED: {ds['methods'].get(name, {}).get('error', 'not run')} ||||||")
                continue
            lines.append(
                f"| {label} | {_f(x['save_s'])} | {_f(x['extra_s'])} | {_f(x['stall_s'])} | {_f(x['durable_s'])} | "
                f"{_f(x['load_s'])} | {_f(x['first_stall_s'])} |"
            )
        a, b = s.get("tiercheck"), s.get("native")
        if a and b:
            cols = ("save_s", "extra_s", "stall_s", "durable_s", "load_s", "first_stall_s")
            lines.append("| tiercheck / native | " + " | ".join(_r(_ratio(a[c], b[c])) for c in cols) + " |")
        lines.append("")
        if b:
            lo, hi = b["baseline_range"]
            if a:
                lo, hi = min(lo, a["baseline_range"][0]), max(hi, a["baseline_range"][1])
            lines.append(
                "'next step +' = the step after save_checkpoint minus the mean of the steps just before and after "
                f"it (nothing in flight). Steps without a checkpoint: median native run {b['baseline_s']:.2f}s"
                + (f", tiercheck run {a['baseline_s']:.2f}s" if a else "")
                + f", range {lo:.2f}-{hi:.2f}s over both runs (differences well inside that spread are noise). "
                "native's durable = save_checkpoint + fsync of its files and directories, before the next step "
                "(torch.save does not fsync: when save_checkpoint returns the bytes are only in the page cache); "
                "tiercheck's durable = save call until the step committed (its files and COMMIT fsync'd), while "
                "the next step runs."
            )
        if a and a.get("blocked_s") is not None:
            lines.append(
                f"tiercheck: its Checkpointer.save() (plan + host copy into the reused staging pool) blocked "
                f"{a['blocked_s']:.2f}s of the stall (first round {_f(a['first_blocked_s'])}s, which allocates "
                f"the pool); the rest of 'next step +' is the background writer competing with training for the "
                f"CPUs. Its writes took {_f(a['persist_s'])}s, Checkpointer.save() to committed "
                f"{_f(a['handle_durable_s'])}s; checkpoint_engine.flush() after the next step returned "
                f"{_f(a['flush_s'])}s after the save call."
            )
        lines.append(_limits_line(nbytes, limits))
        lines.append(
            f"Page cache dropped before every load: {'yes' if dropped else 'no (not root or --no-drop-caches)'}."
        )
    for line in report.get("deepspeed_writers", []):
        lines.append(line)

    mg = report.get("megatron")
    if mg:
        s = {k: summarize_mg(v) for k, v in mg["methods"].items()}
        bases = [x["update_base_s"] for x in s.values() if x]
        base = statistics.median(bases) if bases else float("nan")
        dropped = all(v.get("dropped_caches", False) for v in mg["methods"].values() if "error" not in v)
        lines += [
            "",
            f"### Megatron-core {report.get('megatron_core', '')} dist_checkpointing: {mg['n_layers']} layers, "
            f"{mg['bytes'] / GiB:.2f} GiB of ShardedTensors",
            "",
            "| method | save blocks (s) | next update + (s) | stall (s) | finalized (s) | load (s) | first save blocks (s) |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name in MEGATRON_METHODS:
            x = s.get(name)
            if x is None:
                lines.append(f"| {name} | FAILED: {mg['methods'].get(name, {}).get('error', 'not run')} ||||||")
                continue
            lines.append(
                f"| {name} | {_f(x['save_s'])} | {_f(x['extra_s'])} | {_f(x['stall_s'])} | {_f(x['finalized_s'])} | "
                f"{_f(x['load_s'])} | {_f(x['first_save_s'])} |"
            )
        cols = ("save_s", "extra_s", "stall_s", "finalized_s", "load_s", "first_save_s")
        for num, den in (
            ("tiercheck sync", "torch_dist sync"),
            ("tiercheck async", "torch_dist async"),
            ("tiercheck async nofork", "torch_dist async"),
        ):
            a, b = s.get(num), s.get(den)
            if a and b:
                lines.append(f"| {num} / {den} | " + " | ".join(_r(_ratio(a[c], b[c])) for c in cols) + " |")
        lines.append("")
        lines.append(
            f"'next update +' = excess of rewriting every tensor in place right after the save returned over the "
            f"same update just before the save, with nothing in flight (median {base:.2f}s); torch_dist async makes no host copy on CPU (the "
            "forked writer reads a copy-on-write snapshot), so its copying shows up there. 'finalized' = save call "
            "to returned (sync) or to maybe_finalize_async_calls(blocking=True) (async), including the update. "
            "'tiercheck async' is scheduled on AsyncCallsQueue(persistent=False), which forks a child that only "
            "waits for tiercheck's commit: while it lives, every page the trainer writes is copied (copy on "
            "write), and after it exits the first write to each page faults once more (tiercheck's staging pool "
            "included, at the next save). 'tiercheck async nofork' is the same save with the AsyncRequest run "
            "by request.execute_sync() after the update instead (no fork)."
        )
        if mg.get("cuda_shims"):
            lines.append("torch.cuda.synchronize and torch.cuda.current_device were no-ops (no CUDA here).")
        lines.append(_limits_line(mg["bytes"], limits))
        lines.append(
            f"Page cache dropped before every load: {'yes' if dropped else 'no (not root or --no-drop-caches)'}."
        )
    foreign = report.get("foreign")
    if foreign:
        lines.append("")
        lines.append(
            f"Other processes used {100 * foreign['foreign_cpu_share']:.0f}% of the machine's CPU time during the "
            f"run ({foreign['foreign_cpu_s']:.0f} CPU-s over {foreign['wall_s']:.0f}s)"
            + (": the timings are inflated accordingly." if foreign["foreign_cpu_share"] > 0.05 else ".")
        )
    return "\n".join(line for line in lines if line is not None)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def bench_dir(requested: str | None, keep: bool) -> Iterator[Path]:
    base = Path(requested).resolve() if requested else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="framework_bench-", dir=base))
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


def _section(name: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # one framework failing (not installed, say) still prints the others
        _log(f"{name} FAILED: {type(e).__name__}: {e}")
        traceback.print_exc()
        return None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--gib", type=float, default=None, help="checkpoint size in GiB per framework (default 1; --quick 0.25)"
    )
    p.add_argument("--quick", action="store_true", help="~0.25 GiB checkpoints: a smoke run")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of every measurement (default 3)")
    p.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS), help="default: both")
    p.add_argument("--dir", help="parent directory for checkpoints (default: a temp directory under /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint directory")
    p.add_argument(
        "--settle-max-s",
        type=float,
        default=3.0,
        help="before each timed phase wait up to this long for hypervisor steal < 5%% (default 3)",
    )
    p.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache before loads")
    args = p.parse_args(argv)
    if args.gib is None:
        args.gib = 0.25 if args.quick else 1.0
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    out = tables_stream()
    init_one_rank()
    report: dict[str, Any] = {"repeats": args.repeats}
    foreign = ForeignCpu()
    with bench_dir(args.dir, args.keep) as root:
        report["machine"] = machine_info(root)
        _log(f"checkpoints under {root}; {args.gib} GiB per framework, {args.repeats} repeats")
        report["limits"] = _section("limits", lambda: measure_limits(root, int(args.gib * GiB), args))
        if "deepspeed" in args.frameworks:
            report["deepspeed"] = _section("deepspeed", lambda: run_deepspeed(root, args))
        if "megatron" in args.frameworks:
            report["megatron"] = _section("megatron", lambda: run_megatron(root, args))
            with contextlib.suppress(Exception):
                from megatron.core.package_info import __version__ as mc_version

                report["megatron_core"] = mc_version
        if "deepspeed" in args.frameworks:
            _log("deepspeed: trying its fast and decoupled checkpoint engines on a tiny model")
            report["deepspeed_writers"] = _section("deepspeed writers", lambda: try_deepspeed_writers(root)) or []
    report["foreign"] = foreign.stop()
    print(render(report), file=out)
    out.flush()
    _log(f"done in {time.perf_counter() - t_start:.0f}s")
    failed = [
        f"{fw} {m}"
        for fw in FRAMEWORKS
        if report.get(fw) is not None
        for m, v in report[fw]["methods"].items()
        if "error" in v
    ]
    missing = [fw for fw in args.frameworks if report.get(fw) is None]
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
