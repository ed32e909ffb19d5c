#!/usr/bin/env python
"""Save and restore on one training state: torch.save, DCP (sync and async), torch_checkpointing
and tiercheck (eager and lazy staging), in one run, on two state shapes.

Usage::

    .venv/bin/python bench/save_bench.py              # 0.5 GiB fp32 params (1.5 GiB state), both shapes
    .venv/bin/python bench/save_bench.py --quick      # 0.2 GiB params, both shapes: a smoke run
    .venv/bin/python bench/save_bench.py --repeat 3 --shape transformer --methods dcp.async_save tiercheck.eager

Per method, each in a fresh subprocess on an identical, freshly built model: the time a checkpoint
adds to a training loop (A-B-A: loop without checkpoints, loop with, loop without), one isolated
save from the call until durable against a raw fsync'd write of the same bytes, a restore into the
live model and optimizer from a dropped page cache against a raw cold sequential read of the same
bytes, and peak RSS. The raw write and read run in the method's own process, right before its
isolated save. Method and columns: bench/README.md.
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
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import harness as h
from harness import GiB, MiB

METHODS = ("torch.save", "dcp.save", "dcp.async_save", "torch_checkpointing", "tiercheck.eager", "tiercheck.lazy")
REFS = {"dcpA": "dcp.async_save", "tckpt": "torch_checkpointing"}  # the stall ratios' denominators
SHAPES = ("mlp", "transformer")
NO_FSYNC = ("torch_checkpointing",)  # its writer process never fsyncs (files, directories)
VOCAB = 32768
TOKENS = 16  # tiny batch: a real forward/backward/step, dominated by touching every parameter
QUICK_K = 3
ISOLATED = 10_000  # the isolated save's step, which the restore must come back with
READS = 3  # cold reads of each kind, and restores, per method: the median is reported


# ------------------------------------------------------------------------------------------
# The training state: two shapes
# ------------------------------------------------------------------------------------------
# mlp: d=1024 keeps every big tensor at 16 MiB, below glibc's mmap threshold, so per-step
# temporaries are recycled instead of page-faulted; ~6 small tensors per block.
# transformer: d=512 GPT blocks (ln, fused qkv, proj, ln, fc1, fc2, each with bias): 12 arrays a
# layer, 8 of them biases and norm weights, hundreds of layers' worth of small tensors.
D = {"mlp": 1024, "transformer": 512}
PER_LAYER = {"mlp": 8 * 1024**2 + 7 * 1024, "transformer": 12 * 512**2 + 13 * 512}


def n_layers(shape: str, size_gib: float) -> int:
    """Layers so that fp32 parameters are at least ``size_gib``."""
    return max(1, math.ceil((size_gib * GiB / 4 - VOCAB * D[shape]) / PER_LAYER[shape]))


def build_model(shape: str, layers: int, device: str = "cpu") -> Any:
    import torch
    from torch import nn
    from torch.nn import functional as F

    d = D[shape]

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(F.gelu(self.up(self.ln(x))))

    class Gpt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(self.ln1(x)).view(len(x), 3, 8, d // 8).permute(1, 2, 0, 3)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(len(x), d)
            x = x + self.proj(a)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Lm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, d)
            self.blocks = nn.ModuleList((Mlp if shape == "mlp" else Gpt)() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)

        def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = self.emb(tokens)
            for block in self.blocks:
                x = block(x)
            return F.cross_entropy(self.ln_f(x) @ self.emb.weight.T, targets)  # tied output head

    with torch.device("meta"):
        model = Lm()
    if device != "meta":
        model.to_empty(device=device)
    return model


def expected_state(shape: str, layers: int) -> tuple[int, int]:
    """(bytes, tensors) of the parameters + AdamW's two moments and fp32 ``step`` per parameter."""
    params = list(build_model(shape, layers, "meta").parameters())
    return sum(12 * p.numel() + 4 for p in params), 4 * len(params)


def build_state(shape: str, layers: int, seed: int = 0) -> tuple[Any, Any, Callable[..., None]]:
    """(model, optimizer, step) with AdamW state allocated; weights random (incompressible)."""
    import torch

    torch.manual_seed(seed)
    model = build_model(shape, layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "ln" in name and name.endswith("weight") else p.uniform_(-0.02, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator().manual_seed(seed)
    tokens, targets = (torch.randint(0, VOCAB, (TOKENS,), generator=gen) for _ in range(2))

    def step(guard: Callable[[], Any] = contextlib.nullcontext) -> None:
        # Gradients stay allocated across steps (persistent buckets), so steps do not page-fault.
        opt.zero_grad(set_to_none=False)
        model(tokens, targets).backward()
        with guard():  # torch_checkpointing's lock: no update while its async staging reads
            opt.step()

    return model, opt, step


def live_tensors(model: Any, opt: Any) -> list[Any]:
    import torch

    out = list(model.state_dict().values())
    for st in opt.state.values():
        out += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def fingerprint(model: Any, opt: Any) -> float:
    """A float64 sum over every tensor: the restore must bring back exactly this."""
    import torch

    return sum(float(t.sum(dtype=torch.float64)) for t in live_tensors(model, opt))


# ------------------------------------------------------------------------------------------
# Methods: save (returns a future of the perf_counter() time it became durable) and restore
# ------------------------------------------------------------------------------------------


def _done_at_now() -> Future[float]:
    fut: Future[float] = Future()
    fut.set_result(time.perf_counter())
    return fut




class Method:
    """One checkpointing library on the live model and optimizer, in ``root``."""

    def __init__(self, name: str, model: Any, opt: Any, root: Path) -> None:
        self.name, self.model, self.opt, self.root = name, model, opt, root
        root.mkdir(parents=True, exist_ok=True)
        self.pending: list[Future[float]] = []
        self.guard: Callable[[], Any] = contextlib.nullcontext
        self.tc: Any = None
        if name.startswith("tiercheck."):
            self.tc = self._tiercheck()
        elif name == "torch_checkpointing":
            self.mgr = self._manager(async_save=True)
            self.guard = self.mgr.lock

    def _tiercheck(self) -> Any:
        import tiercheck

        # keep_last=None: no method deletes checkpoints during the run.
        return tiercheck.Checkpointer(
            {"model": self.model, "optim": self.opt},
            local=str(self.root),
            staging=tiercheck.StagingOptions(mode=self.name.split(".", 1)[1]),  # type: ignore[arg-type]
            retention=tiercheck.RetentionOptions(keep_last=None),
        )

    def _manager(self, async_save: bool) -> Any:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        # Its O_DIRECT writes fail with EINVAL on this ext4 (unaligned tails): buffered I/O.
        cfg = CheckpointManager.Config.with_async_save() if async_save else CheckpointManager.Config.with_sync_save()
        cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
        return CheckpointManager(cfg)

    def save(self, step: int) -> tuple[Future[float], dict[str, Any]]:
        import torch
        import torch.distributed.checkpoint as dcp

        extra: dict[str, Any] = {}
        path = self.root / f"step-{step:08d}"
        if self.name in ("dcp.async_save", "torch_checkpointing") and self.pending:
            # Neither queues saves: like torchtitan, a new one waits for the previous one.
            extra["wait_prev_s"] = h.timed(self.pending[-1].result)[0]
        if self.name == "torch.save":
            tmp = path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                torch.save({"model": self.model.state_dict(), "optim": self.opt.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            h.fsync_dir(self.root)
            fut = _done_at_now()
        elif self.name == "dcp.save":
            dcp.save(h.dcp_state(self.model, self.opt), checkpoint_id=path)
            h.fsync_dir(path)  # FileSystemWriter fsyncs files, not directories
            h.fsync_dir(self.root)
            fut = _done_at_now()
        elif self.name == "dcp.async_save":
            inner = dcp.async_save(h.dcp_state(self.model, self.opt), checkpoint_id=path)
            assert isinstance(inner, Future), type(inner)  # the default stager: a plain Future
            fut = h.when_done(inner, lambda: (h.fsync_dir(path), h.fsync_dir(self.root)))
        elif self.name == "torch_checkpointing":
            inner = self.mgr.save(str(path), {"model": self.model.state_dict(), "optim": self.opt.state_dict()})
            fut = h.when_done(inner)  # its files written, not fsync'd
        else:
            handle = self.tc.save(step)
            fut = h.when_done(handle.committed)
            extra["timings"] = {k: float(v) for k, v in dict(handle.timings).items()}
        self.pending.append(fut)
        return fut, extra

    def wait_all(self) -> None:
        if self.tc is not None:
            self.tc.wait()
        for fut in self.pending:
            fut.result()
        self.pending.clear()

    def close(self) -> None:
        self.wait_all()
        if self.tc is not None:
            self.tc.close()
        if self.name == "torch_checkpointing":
            self.mgr.close()

    def restore(self, step: int, *, in_place: bool = False) -> None:
        """Load checkpoint ``step`` back into the live model and optimizer, as a restarted job
        does: each library's own entry point, with a fresh object where it has one (tiercheck:
        all or nothing, or ``in_place``)."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path = self.root / f"step-{step:08d}"
        if self.name == "torch.save":
            sd = torch.load(path, weights_only=True)
            self.model.load_state_dict(sd["model"])
            self.opt.load_state_dict(sd["optim"])
        elif self.name.startswith("dcp."):
            state = h.dcp_state(self.model, self.opt)
            dcp.load(state, checkpoint_id=path)
            set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        elif self.name == "torch_checkpointing":
            mgr = self._manager(async_save=False)
            out = mgr.load(str(path), into={"model": self.model.state_dict(), "optim": self.opt.state_dict()})
            self.model.load_state_dict(out["model"])
            self.opt.load_state_dict(out["optim"])
            mgr.close()
        else:
            tc = self._tiercheck()
            got = tc.restore(in_place=in_place)
            tc.close()
            assert got == step, f"restore() returned step {got}, expected {step}"


# ------------------------------------------------------------------------------------------
# Workers (each in a fresh process through harness.run_worker)
# ------------------------------------------------------------------------------------------


def calibrate(shape: str, layers: int, steps: int, warmup: int) -> dict[str, Any]:
    _model, _opt, step = build_state(shape, layers)
    for _ in range(warmup):
        step()
    return {"step_s": [h.timed(step)[0] for _ in range(steps)]}


def run_loop(step: Callable[..., None], n_steps: int, k: int, m: Method | None, label: int) -> dict[str, Any]:
    """``n_steps`` training steps; with a method, a save before steps 0, k, 2k, ...; the final
    wait for the last checkpoint is timed apart."""
    step_s: list[float] = []
    saves: list[tuple[Future[float], float, float, dict[str, Any]]] = []
    cpu0, t_loop = h.cpu_times(), time.perf_counter()
    for i in range(n_steps):
        if m is not None and i % k == 0:
            t0 = time.perf_counter()
            fut, extra = m.save(label + i)
            saves.append((fut, t0, time.perf_counter() - t0, extra))
        step_s.append(h.timed(lambda: step(m.guard if m else contextlib.nullcontext))[0])
    loop_s, cpu = time.perf_counter() - t_loop, h.cpu_delta(cpu0, h.cpu_times())
    final_wait_s = h.timed(m.wait_all)[0] if m is not None else 0.0
    return {
        "loop_s": loop_s,
        "final_wait_s": final_wait_s,
        "step_s": step_s,
        "cpu": cpu,
        "saves": [{"call_s": c, "durable_s": f.result() - t0, **x} for f, t0, c, x in saves],
    }


def run_pairs(step: Callable[..., None], pairs: int, k: int, m: Method, label: int) -> list[float]:
    """Stall per checkpoint from alternating intervals: a save, then training steps until both k
    steps are done and the save is durable; then k steps without one. Each pair gives the with-save
    interval minus as many steps at the pace of the interval after it, so drift between them
    cancels pair by pair (the A-B-A loops compare loops run a minute apart)."""
    out: list[float] = []
    for p in range(pairs):
        t0 = time.perf_counter()
        fut, _ = m.save(label + p)
        steps = 0
        while steps < k or not fut.done():
            step(m.guard)
            steps += 1
        with_s = time.perf_counter() - t0
        m.wait_all()
        t0 = time.perf_counter()
        for _ in range(k):
            step(m.guard)
        out.append(with_s - steps * (time.perf_counter() - t0) / k)
    return out


def run_method(
    method: str,
    shape: str,
    layers: int,
    k: int,
    n: int,
    root: str,
    warmup: int,
    drop: bool,
    settle_max_s: float,
    pairs: int = 0,
) -> dict[str, Any]:
    """One method, one shape: the A-B-A loops, the isolated save against the paired raw write,
    the restore against the paired raw cold read, and peak RSS."""
    import warnings

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    model, opt, step = build_state(shape, layers)
    for _ in range(warmup):
        step()
    gc.collect()
    wdir = Path(root)
    out: dict[str, Any] = {"state_bytes": sum(t.numel() * t.element_size() for t in live_tensors(model, opt))}
    out["n_tensors"] = len(live_tensors(model, opt))

    def prepare() -> None:
        h.prepare(drop, settle_max_s)

    half_a = (k * n + 1) // 2  # A-B-A: slow drift cancels instead of being charged to checkpoints
    prepare()
    out["hwm_reset_ok"] = h.reset_hwm()
    base_a = run_loop(step, half_a, k, None, 0)
    out["hwm_no_ckpt"] = h.hwm_bytes()

    h.drop_caches(drop)
    h.reset_hwm()
    m = Method(method, model, opt, wdir / "ckpt")
    t0 = time.perf_counter()
    fut, extra = m.save(1)  # the priming save: one-time costs (pools, spawns) reported apart
    out["first_save"] = {"call_s": time.perf_counter() - t0, "durable_s": fut.result() - t0, **extra}
    m.wait_all()
    prepare()
    out["with_ckpt"] = run_loop(step, k * n, k, m, 1000)
    out["hwm_ckpt_loop"] = h.hwm_bytes()
    prepare()
    base_b = run_loop(step, k * n - half_a, k, None, 0)
    out["no_ckpt"] = {
        "loop_s": base_a["loop_s"] + base_b["loop_s"],
        "step_s": base_a["step_s"] + base_b["step_s"],
        "cpu": {key: base_a["cpu"][key] + base_b["cpu"][key] for key in base_a["cpu"]},
    }

    prepare()
    out["paired"] = run_pairs(step, pairs, k, m, 2000)

    # The paired raw write and cold read of the same bytes, under the conditions of the save.
    gc.collect()
    prepare()
    out["raw_write"] = h.measure_disk_write(wdir, out["state_bytes"], keep=True)
    # Cold reads and restores vary 2x from one to the next on a shared disk: the median of several.
    for key, new_memory in (("raw_read", False), ("raw_read_new", True)):
        reads = [h.measure_cold_read([out["raw_write"]["path"]], drop, new_memory=new_memory) for _ in range(READS)]
        out[key] = {**sorted(reads, key=lambda r: r["s"])[len(reads) // 2], "all_s": [r["s"] for r in reads]}
    os.unlink(out["raw_write"]["path"])
    prepare()
    h.reset_hwm()
    t0 = time.perf_counter()
    fut, extra = m.save(ISOLATED)
    out["isolated"] = {"call_s": time.perf_counter() - t0, "durable_s": fut.result() - t0, **extra}
    m.close()
    out["hwm_isolated"] = h.hwm_bytes()
    if m.tc is not None:
        out["tiercheck_stats"] = {a: b for a, b in dict(m.tc.stats()).items() if isinstance(b, (int, float, str))}

    # Restore: the live state moves on one step, then the isolated checkpoint must bring it back;
    # tiercheck's both ways (all or nothing, the default, and in place).
    want = fingerprint(model, opt)
    for key, in_place in (("restore", False), ("restore_inplace", True))[: 2 if m.tc is not None else 1]:
        times, extra_rss = [], []
        for _ in range(READS):
            step()
            gc.collect()
            out["restore_cache"] = h.prepare(drop, settle_max_s, [wdir])
            rss0 = h.rss_bytes()
            h.reset_hwm()
            times.append(h.timed(lambda in_place=in_place: m.restore(ISOLATED, in_place=in_place))[0])
            extra_rss.append(h.hwm_bytes() - rss0)
            got = fingerprint(model, opt)
            out["restore_ok"] = got == want
            if got != want:
                raise AssertionError(f"{method}: restored state differs (fingerprint {got!r}, saved {want!r})")
        out[f"{key}_s"], out[f"{key}_all_s"] = statistics.median(times), times
        out[f"{key}_extra_rss"] = max(extra_rss)
    h.log(f"{method} {shape}: durable {out['isolated']['durable_s']:.2f}s, restore {out['restore_s']:.2f}s")
    return out


# ------------------------------------------------------------------------------------------
# Parent: summary, tables
# ------------------------------------------------------------------------------------------


def summarize(res: dict[str, Any], n: int) -> dict[str, Any]:
    if "error" in res or "with_ckpt" not in res:
        return {}
    base, wc = res["no_ckpt"], res["with_ckpt"]
    steps, calls = base["step_s"], [s["call_s"] for s in wc["saves"]]
    sd = statistics.stdev(steps) if len(steps) > 1 else 0.0
    k = len(wc["step_s"]) // n
    intervals = [calls[i] + sum(wc["step_s"][i * k : (i + 1) * k]) for i in range(n)]
    in_loop = [s["durable_s"] for s in wc["saves"]]
    peak = max(res["hwm_ckpt_loop"], res["hwm_isolated"]) - res["hwm_no_ckpt"] if res["hwm_reset_ok"] else None
    return {
        "stall_s": (wc["loop_s"] - base["loop_s"]) / n,
        "paired_stall_s": statistics.median(res["paired"]) if res.get("paired") else None,
        "noise_s": math.sqrt(2 * len(steps)) * sd / n,  # sd of a difference of two N-step loops, per ckpt
        "call_s": statistics.mean(calls),
        "first_call_s": res["first_save"]["call_s"],
        "slowdown_s": (sum(wc["step_s"]) - sum(steps)) / n,
        "durable_s": res["isolated"]["durable_s"],
        "in_loop_s": statistics.median(in_loop),
        "fits": all(d <= iv for d, iv in zip(in_loop, intervals, strict=True)),
        "final_wait_s": wc["final_wait_s"],
        "raw_write_s": res["raw_write"]["durable_s"],
        "restore_s": res["restore_s"],
        "raw_read_s": res["raw_read"]["s"],
        "raw_read_new_s": res.get("raw_read_new", {}).get("s"),  # absent from runs before it was measured
        "peak_save_bytes": None if peak is None else max(0, peak),
        "peak_restore_bytes": max(0, res["restore_extra_rss"]),
        "restore_inplace_s": res.get("restore_inplace_s"),  # tiercheck's restore(in_place=True)
        "peak_restore_inplace_bytes": max(0, res.get("restore_inplace_extra_rss", 0)),
        "steal": h.steal_share(wc["cpu"]),
        "other": res["foreign_load"]["foreign_cpu_share"],
        "step_s": statistics.median(steps),
    }


def add_ratios(summary: dict[str, dict[str, Any]]) -> None:
    """Ratios within one repeat: against the references' stall, and against the paired raw I/O."""
    for s in summary.values():
        if not s:
            continue
        for tag, ref in REFS.items():
            for key, out in (("stall_s", f"stall_x_{tag}"), ("paired_stall_s", f"paired_x_{tag}")):
                ref_stall = (summary.get(ref) or {}).get(key)  # <= 0: within the noise, no ratio
                s[out] = h.ratio(s[key], ref_stall) if ref_stall and ref_stall > 0 else None
        s["durable_x_raw"] = h.ratio(s["durable_s"], s["raw_write_s"])
        s["restore_x_raw"] = h.ratio(s["restore_s"], s["raw_read_s"])
        s["restore_x_new"] = h.ratio(s["restore_s"], s["raw_read_new_s"])
        s["inplace_x_raw"] = h.ratio(s.get("restore_inplace_s"), s["raw_read_s"])
        s["inplace_x_new"] = h.ratio(s.get("restore_inplace_s"), s["raw_read_new_s"])
        s["restore_x_tckpt"] = h.ratio(s["restore_s"], (summary.get(REFS["tckpt"]) or {}).get("restore_s"))


# (ratio, as said, bound): issue 19's targets, checked on the median over repeats
TARGETS = (
    ("stall_x_tckpt", "stall x torch_checkpointing", 1.0),
    ("stall_x_dcpA", "stall x dcp.async_save", 0.1),
    ("paired_x_tckpt", "paired-interval stall x torch_checkpointing", 1.0),
    ("paired_x_dcpA", "paired-interval stall x dcp.async_save", 0.1),
    ("durable_x_raw", "durable x raw fsync'd write", 1.0),
    ("restore_x_raw", "restore x raw cold read", 1.25),  # >= 0.8x the raw read's bandwidth
    ("restore_x_tckpt", "restore x torch_checkpointing's", 1.0),
)


def _having(reps: list[dict[str, dict[str, Any]]], shape: str, method: str, key: str) -> list[dict[str, Any]]:
    """``method``'s summaries of ``shape`` over the repeats, those that have ``key``."""
    return [s for s in (r.get(shape, {}).get(method) or {} for r in reps) if s.get(key) is not None]


def render_shape(
    shape: str, cfg: dict[str, Any], reps: list[dict[str, dict[str, Any]]], results: list[dict[str, Any]]
) -> str:
    sc = cfg["shapes"][shape]
    lines = [
        f"### {shape}: {sc['state_bytes'] / GiB:.2f} GiB of state in {sc['n_tensors']} tensors "
        f"({sc['layers']} layers, d={D[shape]}); k={sc['k']} ({sc['k_reason']}), n={cfg['n']}, {len(reps)} repeat(s)",
        "",
    ]
    headers = ["method", "stall/ckpt s (±noise)", "x dcpA", "x tckpt", "in save() s (first)", "step slowdown s",
               "durable s", "x raw write", "durable in loop s", "restore s", "x raw read", "x new-mem read", "x tckpt",
               "peak extra RSS save / restore GiB", "other CPU %", "steal %"]  # fmt: skip
    rows = []
    for method in cfg["methods"]:
        ss = [r.get(shape, {}).get(method) or {} for r in reps]
        ok = [s for s in ss if s]
        if not ok:
            err = next(
                (res[shape][method].get("error", "") for res in results if method in res.get(shape, {})), "not run"
            )
            rows.append(
                [method, "error: " + err.splitlines()[0][:100] if err else "not run"] + [""] * (len(headers) - 2)
            )
            continue

        def med(key: str, ok: list[dict[str, Any]] = ok) -> float | None:
            return h.median([s[key] for s in ok])

        def rat(key: str, ss: list[dict[str, Any]] = ok) -> str:
            return h.fmt_spread(h.spread([s.get(key) for s in ss]))

        rows.append([
            method + (" (no fsync)" if method in NO_FSYNC else ""),
            f"{h.fmt(med('stall_s'))} (±{h.fmt(med('noise_s'))})", rat("stall_x_dcpA"), rat("stall_x_tckpt"),
            f"{h.fmt(med('call_s'))} ({h.fmt(med('first_call_s'))})", h.fmt(med("slowdown_s")),
            h.fmt(med("durable_s")), rat("durable_x_raw"),
            h.fmt(med("in_loop_s")) + ("" if all(s["fits"] for s in ok) else " (!)"),
            h.fmt(med("restore_s")), rat("restore_x_raw"), rat("restore_x_new"), rat("restore_x_tckpt"),
            f"{h.fmt((med('peak_save_bytes') or 0) / GiB)} / {h.fmt((med('peak_restore_bytes') or 0) / GiB)}",
            h.fmt(100 * (med("other") or 0), ".0f"), h.fmt(100 * (med("steal") or 0), ".0f"),
        ])  # fmt: skip
    every = [s for r in reps for s in r.get(shape, {}).values() if s]
    raw_w, raw_r = h.median([s["raw_write_s"] for s in every]), h.median([s["raw_read_s"] for s in every])
    raw_new = h.median([s["raw_read_new_s"] for s in every])
    rows.append(
        ["raw fsync'd write / cold read / cold read into new memory (same bytes)"]
        + [""] * 5
        + [h.fmt(raw_w), "1.00"]
        + [""] * 1
        + [f"{h.fmt(raw_r)} / {h.fmt(raw_new)}", "1.00", "1.00", "", "", "", ""]
    )
    lines.append(h.table(headers, rows))
    paired = []
    for method in cfg["methods"]:
        if ok := _having(reps, shape, method, "paired_stall_s"):
            paired.append([
                method, h.fmt(h.median([s["paired_stall_s"] for s in ok])),
                *(h.fmt_spread(h.spread([s.get(f"paired_x_{tag}") for s in ok])) for tag in REFS),
            ])  # fmt: skip
    if paired:
        lines += [
            "",
            f"Paired intervals ({cfg.get('pairs')} per method and repeat: a save and the steps until it is durable, "
            "then as many steps without one; median over the pairs):",
            "",
            h.table(["method", "stall/ckpt s", "x dcpA", "x tckpt"], paired),
            "",
        ]
    in_place = []
    for method in cfg["methods"]:
        if ok := _having(reps, shape, method, "restore_inplace_s"):
            in_place.append([
                method, h.fmt(h.median([s["restore_inplace_s"] for s in ok])),
                *(h.fmt_spread(h.spread([s.get(key) for s in ok])) for key in ("inplace_x_raw", "inplace_x_new")),
                h.fmt((h.median([s["peak_restore_inplace_bytes"] for s in ok]) or 0) / GiB),
            ])  # fmt: skip
    if in_place:
        lines += [
            "`restore(in_place=True)` (the state's CPU tensors read into as they are: not all or nothing):",
            "",
            h.table(["method", "restore s", "x raw read", "x new-mem read", "peak extra RSS GiB"], in_place),
            "",
        ]
    for tag in ("tiercheck.eager", "tiercheck.lazy"):
        got = [r.get(shape, {}).get(tag) or {} for r in reps]
        checks = []
        for key, what, bound in TARGETS:
            spread = h.spread([x.get(key) for x in got])
            if spread:
                verdict = "met" if spread["median"] <= bound else "NOT met"
                checks.append(f"{what} {h.fmt(spread['median'])} (<= {bound}: {verdict})")
        if checks:
            lines.append(f"Targets (issue 19), {tag}: " + "; ".join(checks))
    for res in results:
        for method, r in res.get(shape, {}).items():
            lines += h.noise_warnings(f"{shape} {method}", r.get("foreign_load"))
    for method in cfg["methods"]:
        lines += h.noise_warnings(
            f"{shape} {method} stall", repeats=[(r.get(shape, {}).get(method) or {}).get("stall_s") for r in reps]
        )
    return "\n".join(lines)


def render(report: dict[str, Any]) -> str:
    cfg = report["config"]
    reps = [
        {sh: {m: summarize(res.get(sh, {}).get(m, {}), cfg["n"]) for m in cfg["methods"]} for sh in cfg["shape_list"]}
        for res in report["results"]
    ]
    for rep in reps:
        for summary in rep.values():
            add_ratios(summary)
    lim = report["limits"]
    lines = [
        f"Machine: {h.machine_line(report['machine'])}",
        "Limits in this run: memcpy "
        + ", ".join(f"{k.replace('_gib_s', '')} {v:.1f} GiB/s" for k, v in lim["memcpy"].items()),
        f"Page cache before each phase: {cfg['cache'] or 'NOT dropped'}; peak RSS via VmHWM reset.",
        "Ratios are within one repeat, shown as median (min-max) over repeats; seconds are medians. "
        "x dcpA / x tckpt: stall / dcp.async_save's and torch_checkpointing's. x raw write / x raw read: "
        "against the paired raw fsync'd write and cold read of the same bytes in the method's process; x new-mem read: "
        "against the same cold read into new memory (every page faulted once, as for any restore into memory it did not hold). "
        "(no fsync): torch_checkpointing never fsyncs, so its 'durable' is 'written to the page cache'. "
        "(!): a save was not durable before the next was due.",
        "",
    ]
    for shape in cfg["shape_list"]:
        lines += [render_shape(shape, cfg, reps, report["results"]), ""]
    lines.append(f"Run took {report['elapsed_s']:.0f}s.")
    return "\n".join(lines)


def choose_k(step_s: float | None, raw_s: float, args: argparse.Namespace) -> tuple[int, str]:
    if args.k:
        return args.k, "--k"
    if step_s is None:
        return QUICK_K, "fixed for --quick"
    want = math.ceil(args.headroom * raw_s / max(step_s, 1e-3))  # room for the background write
    k = min(max(2, want), args.max_k)
    return k, f"ceil({args.headroom} x raw write {raw_s:.2f}s / step {step_s:.2f}s)" + (
        f" = {want}, clamped" if k != want else ""
    )


def parent_main(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    size = args.size_gib or (0.2 if args.quick else 0.5)
    n = args.n or (2 if args.quick else 3)
    pairs = args.pairs if args.pairs is not None else (2 if args.quick else 4)
    methods = list(args.methods or METHODS)
    shapes = list(SHAPES) if args.shape == "both" else [args.shape]
    drop = not args.no_drop_caches
    json_path = Path(args.json or h.RESULTS_DIR / "save_bench.json")
    with h.scratch_dir(args.dir, "save_bench-", args.keep) as root:
        cfg: dict[str, Any] = {
            "size_gib": size,
            "n": n,
            "pairs": pairs,
            "methods": methods,
            "shape_list": shapes,
            "shapes": {},
            "repeat": args.repeat,
        }
        cfg["cache"] = h.drop_caches(drop, [root])
        limits = {"memcpy": h.measure_memcpy((128 if args.quick else 512) * MiB)}
        gc.collect()
        for shape in shapes:  # k from a calibration worker and this shape's raw write
            layers = n_layers(shape, size)
            nbytes, ntensors = expected_state(shape, layers)
            h.prepare(drop, args.settle_max_s)
            raw = h.measure_disk_write(root, nbytes)
            step_s = None
            if not args.k and not args.quick:
                cal = h.run_worker(
                    __file__, "calibrate", {"shape": shape, "layers": layers, "steps": 4, "warmup": args.warmup}, 600
                )
                if "error" in cal:
                    print(cal.get("traceback", cal["error"]), file=sys.stderr)
                    return 1
                step_s = min(cal["step_s"])  # the fastest: slow ones measure other load
            k, why = choose_k(step_s, raw["durable_s"], args)
            cfg["shapes"][shape] = {
                "layers": layers,
                "state_bytes": nbytes,
                "n_tensors": ntensors,
                "k": k,
                "k_reason": why,
                "raw_write": raw,
            }
            h.log(
                f"{shape}: {layers} layers, {nbytes / GiB:.2f} GiB in {ntensors} tensors, raw write {raw['durable_s']:.2f}s, k={k}"
            )
        results: list[dict[str, Any]] = []
        for rep in range(args.repeat):
            res: dict[str, Any] = {}
            for shape in shapes:
                res[shape] = {}
                for method in methods:
                    h.log(f"repeat {rep + 1}/{args.repeat}: {shape} {method}")
                    wdir = root / f"{shape}-{method}"
                    h.drop_caches(drop)
                    kw = {"method": method, "shape": shape, "layers": cfg["shapes"][shape]["layers"], "k": cfg["shapes"][shape]["k"], "n": n,
                          "root": str(wdir), "warmup": args.warmup, "drop": drop, "settle_max_s": args.settle_max_s, "pairs": pairs}  # fmt: skip
                    r = res[shape][method] = h.run_worker(__file__, "run_method", kw, args.worker_timeout)
                    if "error" in r:
                        h.log(f"{method} FAILED: {r['error']}\n{r.get('traceback', '')}")
                    shutil.rmtree(wdir, ignore_errors=True)
                    os.sync()
            results.append(res)
        report = {"machine": h.machine_info(root), "config": cfg, "limits": limits, "results": results}
        report["elapsed_s"] = time.perf_counter() - t_start
        table = render(report)
        h.write_json(json_path, {**report, "table": table})
        print(table)
        h.log(f"JSON: {json_path}")
    return 1 if any("error" in r for res in results for sh in res.values() for r in sh.values()) else 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    h.common_args(p)
    p.add_argument(
        "--size-gib",
        type=float,
        default=0,
        help="fp32 parameter GiB per shape; the state is ~3x (default 0.5; quick 0.2)",
    )
    p.add_argument(
        "--shape",
        choices=(*SHAPES, "both"),
        default="both",
        help="mlp: few big tensors; transformer: hundreds of small ones",
    )
    p.add_argument("--methods", nargs="+", choices=METHODS, metavar="M", help=f"subset of: {' '.join(METHODS)}")
    p.add_argument("--repeat", type=int, default=1, help="run the whole comparison N times; ratios as min/median/max")
    p.add_argument("--k", type=int, default=0, help="steps between checkpoints (default: calibrated; quick 3)")
    p.add_argument("--n", type=int, default=0, help="checkpoints per loop (default 3; quick 2)")
    p.add_argument(
        "--pairs",
        type=int,
        default=None,
        help="paired intervals with and without a save per method (default 4; quick 2)",
    )
    p.add_argument("--headroom", type=float, default=1.5, help="calibrated k: k x step >= headroom x raw write")
    p.add_argument("--max-k", type=int, default=5, help="upper bound of the calibrated k")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after building")
    p.add_argument("--worker-timeout", type=float, default=900, help="seconds per method")
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
