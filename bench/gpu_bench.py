#!/usr/bin/env python
"""Checkpointing a CUDA training state on one GPU: tiercheck (eager and lazy staging) against
dcp.async_save (plain, and with DCP's pinned DefaultStager) and torch_checkpointing, in one
command sized to finish within five minutes (issue 33).

Usage::

    python bench/gpu_bench.py                     # ~4 GiB of fp32 state (5 x Linear(8192, 8192) + AdamW)
    python bench/gpu_bench.py --out "$OUT"        # write gpu-<device>.json there
    python bench/gpu_bench.py --dry-run           # a few MiB on CPU: the CI smoke run

Measured, in this order (each method in a fresh subprocess; a method that fails is recorded as
failed with its error, and the rest still run; past ``--budget-s`` the remaining phases are
skipped and the JSON says which):

1. The machine's limits: pinned D2H and H2D ``copy_`` bandwidth, pageable D2H (CUDA only), the
   step time of the model, an fsync'd sequential write of the state's bytes and a cold sequential
   read of it (page cache dropped before, as root).
2. Per method: a training loop with a per-step host sync (``loss.item()``) without checkpoints
   (k steps before and k after: A-B-A) and with one every k steps (n checkpoints), after one
   priming save; the time each checkpoint adds to the loop, how long ``save()`` blocks, the time
   from the call to durable; then a restore in the saving process from a dropped page cache,
   checked bit for bit against a fingerprint of the state taken at the priming save.
3. A restore of the same checkpoint in a fresh process (the model rebuilt on the GPU with its
   optimizer state allocated by one step), from a dropped page cache, bit-checked, against the
   cold raw read of the same bytes; and a cold read of the checkpoint's own files.

Writes ``<out>/gpu-<device>.json`` (``gpu-<device>-dry-run.json`` for ``--dry-run``) after every
phase, prints a markdown table on stdout at the end, and progress on stderr. Method and fields:
bench/README.md, "GPU benchmark".
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import harness as h
from harness import GiB, MiB

METHODS = ("tiercheck.lazy", "tiercheck.eager", "dcp.async_save", "torch_checkpointing", "dcp.async_save+pinned")
FRESH = ("tiercheck.lazy", "dcp.async_save", "torch_checkpointing")  # fresh-process restores by default
EXPECTED_TO_FAIL = ("dcp.async_save+pinned",)  # torch 2.11: a reused DefaultStager raises KeyError
NO_FSYNC = ("torch_checkpointing",)  # its writer never fsyncs: its "durable" is "written"
PRIME = 1  # the priming save's step: fingerprinted, restored in process and in a fresh process
LOOP0 = 1000  # steps of the saves in the timed loop start here
HEADLINE = (
    "staging_fraction_of_pinned_copy",
    "lazy_added_fraction_of_step",
    "added_vs_dcp_async",
    "restore_fraction_of_raw_read",
    "restore_vs_torch_checkpointing",
)
DEFINITIONS = {
    "staging_fraction_of_pinned_copy": "(state bytes / pinned D2H copy_ bandwidth) / median time save() blocks in "
    "tiercheck.eager (the loop's saves): 1.0 = staging as fast as one pinned copy of the state",
    "lazy_added_fraction_of_step": "time a tiercheck.lazy checkpoint adds to the training loop / one training step",
    "added_vs_dcp_async": "time a tiercheck.lazy checkpoint adds to the loop / the time a dcp.async_save one adds",
    "restore_fraction_of_raw_read": "cold sequential read of a file of the state's bytes / tiercheck's restore in a "
    "fresh process (both from a dropped page cache): 1.0 = as fast as the disk",
    "restore_vs_torch_checkpointing": "tiercheck's fresh-process restore time / torch_checkpointing's",
}


# ------------------------------------------------------------------------------------------
# Small helpers (also used inside the workers, which load this file)
# ------------------------------------------------------------------------------------------


def drop_page_cache(enabled: bool, paths: Sequence[Path | str] = ()) -> str:
    """Flush dirty pages, then drop the clean ones: ``echo 1 > /proc/sys/vm/drop_caches`` as root,
    else harness.drop_caches (posix_fadvise on ``paths``). Returns how ("" = not dropped)."""
    if not enabled:
        return ""
    os.sync()
    if os.geteuid() == 0:
        with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
            return "drop_caches=1"
    return h.drop_caches(True, paths)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def device_name(device: str) -> str:
    if device == "cpu":
        return "cpu"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    import torch

    return torch.cuda.get_device_name(0)


def layers_for(size_gib: float, width: int) -> int:
    """Linear layers so that parameters + AdamW's two moments come to about ``size_gib``."""
    return max(1, round(size_gib * GiB / (12 * (width * width + width))))


def first_line(err: str | None, limit: int = 160) -> str:
    """The gist of an error message: its first line, or the first ``SomethingError: ...`` line in it
    when it carries a traceback (torch_checkpointing forwards its writer process's as the message)."""
    lines = [ln.strip() for ln in (err or "").strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    named = [ln for ln in lines[1:] if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
    return (lines[0] if "Traceback" not in lines[0] or not named else f"{lines[0]} {named[0]}")[:limit]


# ------------------------------------------------------------------------------------------
# The training state: an fp32 MLP of square Linear layers, fused AdamW, a per-step host sync
# ------------------------------------------------------------------------------------------


def build_state(device: str, width: int, layers: int, batch: int, seed: int = 0) -> tuple[Any, Any, Callable[..., Any]]:
    import torch

    torch.manual_seed(seed)
    mods: list[Any] = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width, device=device))
        if i < layers - 1:
            mods.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*mods)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    x = torch.randn(batch, width, device=device)

    def step(guard: Callable[[], Any] = contextlib.nullcontext) -> float:
        opt.zero_grad(set_to_none=False)
        loss = model(x).square().mean()
        loss.backward()
        with guard():  # torch_checkpointing's lock, DCP's pinned staging: no update while they read
            opt.step()
        return float(loss.item())  # the per-step host sync: the host never runs ahead of the GPU

    return model, opt, step


def named_tensors(model: Any, opt: Any) -> dict[str, Any]:
    import torch

    out = dict(model.state_dict())
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{i}.{k}"] = v
    return out


def fingerprint(model: Any, opt: Any) -> dict[str, list[int]]:
    """Per tensor, two integer sums of its bits (plain and position-weighted, wrapping int64):
    exact, independent of reduction order, comparable across processes."""
    import torch

    views = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    out: dict[str, list[int]] = {}
    with torch.no_grad():
        for name, t in named_tensors(model, opt).items():
            bits = t.detach().reshape(-1).view(views[t.element_size()]).to(torch.int64)
            weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
            out[name] = [int(bits.sum()), int((bits * weights).sum())]
            del bits, weights
    return out


def compare(want: dict[str, list[int]], got: dict[str, list[int]]) -> dict[str, Any]:
    bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    return {"bit_identical": not bad, "tensors": len(want), "mismatched": bad[:5], "n_mismatched": len(bad)}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def quiet_warnings() -> None:
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
    warnings.filterwarnings("ignore", category=FutureWarning)


# ------------------------------------------------------------------------------------------
# Methods: save() returns a future of the perf_counter() time the checkpoint became durable
# ------------------------------------------------------------------------------------------




def tc_manager(async_save: bool, direct_io: bool) -> Any:
    """torch_checkpointing's CheckpointManager with its defaults (pinned, shared, non-blocking
    staging on CUDA; a spawned writer process), or buffered writes (``direct_io=False``)."""
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    cfg = CheckpointManager.Config.with_async_save() if async_save else CheckpointManager.Config.with_sync_save()
    if not direct_io:
        cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return CheckpointManager(cfg)


class Method:
    """One checkpointing library on the live model and optimizer, writing under ``root``."""

    def __init__(
        self, name: str, model: Any, opt: Any, root: Path, notes: list[str], tc_direct_io: bool = True
    ) -> None:
        self.name, self.model, self.opt, self.root, self.notes = name, model, opt, root, notes
        root.mkdir(parents=True, exist_ok=True)
        self.pending: list[Future[float]] = []
        self.handles: list[Any] = []
        self.tc: Any = None
        self.mgr: Any = None
        self.stager: Any = None
        self.staging: Future[Any] | None = None
        self.direct_io = tc_direct_io  # torch_checkpointing's default: True
        if name.startswith("tiercheck."):
            import tiercheck

            self.tc = tiercheck.Checkpointer(
                {"model": model, "optim": opt},
                local=str(root),
                staging=tiercheck.StagingOptions(mode=name.split(".", 1)[1]),  # type: ignore[arg-type]
                retention=tiercheck.RetentionOptions(keep_last=None),
            )
        elif name == "torch_checkpointing":
            self.mgr = tc_manager(async_save=True, direct_io=tc_direct_io)
            if not tc_direct_io:
                notes.append("torch_checkpointing: use_direct_io=False from the start (--tckpt-direct-io off)")
        elif name == "dcp.async_save+pinned":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # One stager reused across saves, as its pinned pool is meant to be (torchtitan does).
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=True, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=True
                )
            )

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    @contextlib.contextmanager
    def guard(self) -> Any:
        """Around optimizer.step(): the libraries that stage in the background must finish reading."""
        if self.mgr is not None:
            with self.mgr.lock():
                yield
            return
        if self.staging is not None:
            self.staging.result()
            self.staging = None
        yield

    def save(self, step: int) -> tuple[Future[float], dict[str, Any]]:
        import torch.distributed.checkpoint as dcp

        extra: dict[str, Any] = {}
        path = self.path(step)
        if self.tc is None and self.pending:
            # Neither DCP nor torch_checkpointing queues saves: like torchtitan, wait for the previous one.
            extra["wait_prev_s"] = h.timed(self.pending[-1].result)[0]
        if self.name == "dcp.async_save":
            inner = dcp.async_save(h.dcp_state(self.model, self.opt), checkpoint_id=path)
            fut = h.when_done(inner, lambda: (h.fsync_dir(path), h.fsync_dir(self.root)))  # files: sync_files
        elif self.name == "dcp.async_save+pinned":
            resp = dcp.async_save(h.dcp_state(self.model, self.opt), checkpoint_id=path, async_stager=self.stager)
            if isinstance(resp, Future):
                inner = resp
            else:  # AsyncSaveResponse: staging and upload futures
                self.staging, inner = resp.staging_completion, resp.upload_completion
            fut = h.when_done(inner, lambda: (h.fsync_dir(path), h.fsync_dir(self.root)))
        elif self.name == "torch_checkpointing":
            inner = self.mgr.save(str(path), {"model": self.model.state_dict(), "optim": self.opt.state_dict()})
            fut = h.when_done(inner)  # written, not fsync'd
        else:
            handle = self.tc.save(step)
            self.handles.append(handle)
            fut = h.when_done(handle.committed)
        self.pending.append(fut)
        return fut, extra

    def wait_all(self, timeout: float | None = None) -> None:
        if self.tc is not None:
            self.tc.wait(timeout)
        for fut in self.pending:
            fut.result(timeout)
        self.pending.clear()
        if self.staging is not None:
            self.staging.result(timeout)
            self.staging = None

    def fall_back_to_buffered(self, err: BaseException) -> None:
        """torch_checkpointing's O_DIRECT writer failed (EINVAL on ext4): a new manager with
        ``use_direct_io=False``, and the partial checkpoint removed."""
        self.notes.append(
            f"torch_checkpointing's default O_DIRECT writer failed ({type(err).__name__}: {first_line(str(err), 300)}); "
            "fell back to LocalFileSystemStorageConfig(use_direct_io=False)"
        )
        self.pending.clear()
        with contextlib.suppress(BaseException):
            self.mgr.close()
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True)
        self.direct_io = False
        self.mgr = tc_manager(async_save=True, direct_io=False)

    def close(self) -> None:
        try:
            self.wait_all(timeout=120)
        finally:
            if self.tc is not None:
                self.tc.close()
            if self.mgr is not None:
                self.mgr.close()
            if self.stager is not None:
                self.stager.close()

    def timings(self) -> list[dict[str, float]]:
        return [{k: float(v) for k, v in dict(hd.timings).items()} for hd in self.handles]


def restore_into(
    name: str, model: Any, opt: Any, root: Path, step: int, device: str, *, tc: Any = None, direct_io: bool = True
) -> dict[str, Any]:
    """Load checkpoint ``step`` back into the live model and optimizer with each library's own entry
    point. ``restore_s``: from constructing a fresh reader (where the library has one) until the
    state is on the device; closing the reader afterwards is not timed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = root / f"step-{step:08d}"
    out: dict[str, Any] = {}
    closer: Callable[[], Any] = lambda: None  # noqa: E731
    t0 = time.perf_counter()
    try:
        if name.startswith("dcp."):
            state = h.dcp_state(model, opt)
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            sync(device)
            out["restore_s"] = time.perf_counter() - t0
        elif name == "torch_checkpointing":
            mgr = tc_manager(async_save=False, direct_io=direct_io)
            closer = mgr.close
            got = mgr.load(str(path), into={"model": model.state_dict(), "optim": opt.state_dict()})
            model.load_state_dict(got["model"])
            opt.load_state_dict(got["optim"])
            sync(device)
            out["restore_s"] = time.perf_counter() - t0
        else:
            import tiercheck

            if tc is None:
                tc = tiercheck.Checkpointer(
                    {"model": model, "optim": opt},
                    local=str(root),
                    retention=tiercheck.RetentionOptions(keep_last=None),
                )
                closer = tc.close
            out["construct_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            got = tc.restore(step)
            sync(device)
            out["restore_s"] = time.perf_counter() - t0
            out["restore_call_s"] = time.perf_counter() - t1
            if got != step:
                raise AssertionError(f"restore() returned step {got}, expected {step}")
            stats = dict(tc.stats())
            out["tiercheck_stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool))}
    finally:
        t1 = time.perf_counter()
        closer()
        out["close_s"] = time.perf_counter() - t1
    return out


# ------------------------------------------------------------------------------------------
# Workers (each in a fresh process through harness.run_worker)
# ------------------------------------------------------------------------------------------


def measure_limits(device: str, width: int, layers: int, batch: int, copy_mib: int, steps: int) -> dict[str, Any]:
    """Pinned D2H / H2D and pageable D2H ``copy_`` bandwidth (CUDA), and the step time."""
    import torch

    out: dict[str, Any] = {"device": device, "torch": torch.__version__}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        out["gpu"] = {
            "name": props.name,
            "memory_bytes": props.total_memory,
            "capability": list(torch.cuda.get_device_capability(0)),
        }
        out["cuda"] = torch.version.cuda
        n = copy_mib * MiB
        gpu = torch.empty(n, dtype=torch.uint8, device=device).random_()
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(n, dtype=torch.uint8)
        pageable.fill_(1)  # faulted in: the copy measures the copy, not first-touch faults

        def best(copy: Callable[[], Any], repeats: int = 3) -> dict[str, float]:
            copy()
            torch.cuda.synchronize()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                copy()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            s = min(times)
            return {"bytes": n, "s": s, "gb_s": n / s / 1e9, "gib_s": n / s / GiB}

        out["pinned_d2h"] = best(lambda: pinned.copy_(gpu, non_blocking=True))
        out["pinned_h2d"] = best(lambda: gpu.copy_(pinned, non_blocking=True))
        out["pageable_d2h"] = best(lambda: pageable.copy_(gpu))
        del gpu, pinned, pageable
        torch.cuda.empty_cache()
    _model, _opt, step = build_state(device, width, layers, batch)
    for _ in range(3):
        step()
    out["step_s"] = [h.timed(step)[0] for _ in range(steps)]
    return out


def run_method(
    method: str,
    device: str,
    width: int,
    layers: int,
    batch: int,
    k: int,
    n: int,
    root: str,
    drop: bool,
    tc_direct_io: bool = True,
) -> dict[str, Any]:
    """One method: the A-B-A loops around a loop with n checkpoints every k steps, the priming
    save, and a restore of it in this process, bit-checked. Whatever fails is returned in
    "error" with the measurements so far."""
    import torch

    quiet_warnings()
    out: dict[str, Any] = {"method": method, "notes": []}
    m: Method | None = None
    try:
        model, opt, step = build_state(device, width, layers, batch)
        for _ in range(3):
            step()
        sync(device)
        tensors = named_tensors(model, opt)
        out["state_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
        out["n_tensors"] = len(tensors)
        del tensors
        gc.collect()

        def loop(steps: int, saver: Method | None, label: int) -> dict[str, Any]:
            step_s: list[float] = []
            saves: list[tuple[Future[float], float, float, dict[str, Any]]] = []
            t_loop = time.perf_counter()
            for i in range(steps):
                if saver is not None and i % k == 0:
                    t0 = time.perf_counter()
                    fut, extra = saver.save(label + i)
                    saves.append((fut, t0, time.perf_counter() - t0, extra))
                step_s.append(h.timed(lambda: step(saver.guard if saver else contextlib.nullcontext))[0])
            loop_s = time.perf_counter() - t_loop
            res: dict[str, Any] = {"loop_s": loop_s, "steps": steps, "step_s": step_s}
            if saver is not None:
                res["final_wait_s"] = h.timed(lambda: saver.wait_all(timeout=300))[0]
                res["saves"] = [{"call_s": c, "durable_s": f.result() - t0, **x} for f, t0, c, x in saves]
            return res

        half = (k + 1) // 2  # A-B-A: k steps without checkpoints, half before and half after
        out["base_a"] = loop(half, None, 0)
        m = Method(method, model, opt, Path(root), out["notes"], tc_direct_io)
        out["fingerprint"] = want = fingerprint(model, opt)
        sync(device)
        t0 = time.perf_counter()
        try:
            fut, extra = m.save(PRIME)  # the priming save: pools, spawned writers, plans; reported apart
            call_s = time.perf_counter() - t0
            durable = fut.result(timeout=120) - t0
        except Exception as exc:  # not a timeout: a hung writer is not an O_DIRECT refusal
            if method != "torch_checkpointing" or not m.direct_io or isinstance(exc, FutureTimeout):
                raise
            m.fall_back_to_buffered(exc)
            t0 = time.perf_counter()
            fut, extra = m.save(PRIME)
            call_s = time.perf_counter() - t0
            durable = fut.result(timeout=300) - t0
        m.wait_all(timeout=300)
        out["first_save"] = {"call_s": call_s, "durable_s": durable, **extra}
        out["torch_checkpointing_direct_io"] = m.direct_io if method == "torch_checkpointing" else None
        out["with_ckpt"] = loop(k * n, m, LOOP0)
        out["base_b"] = loop(half, None, 0)
        if m.tc is not None:
            out["save_timings"] = m.timings()

        # The restore in the saving process: the state moves on one step, the priming save must bring it back.
        step()
        sync(device)
        gc.collect()
        out["restore_cache"] = drop_page_cache(drop, [root])
        r = restore_into(method, model, opt, Path(root), PRIME, device, tc=m.tc, direct_io=m.direct_io)
        out["restore"] = {**r, **compare(want, fingerprint(model, opt))}
        if device.startswith("cuda"):
            out["gpu_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        h.log(
            f"{method}: first save {out['first_save']['durable_s']:.2f}s to durable, in-process restore "
            f"{r['restore_s']:.2f}s, bit-identical {out['restore']['bit_identical']}"
        )
    except BaseException as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
        h.log(f"{method} FAILED: {out['error']}\n{out['traceback']}")
    finally:
        if m is not None:
            try:
                m.close()
            except BaseException as exc:
                out.setdefault("error", f"close: {type(exc).__name__}: {exc}")
    return out


def fresh_restore(
    method: str,
    device: str,
    width: int,
    layers: int,
    batch: int,
    root: str,
    step: int,
    want: dict[str, list[int]],
    drop: bool,
    direct_io: bool = True,
) -> dict[str, Any]:
    """A restarted job: build the model on the device, allocate the optimizer's state (one step),
    drop the page cache, restore ``step`` and check every tensor bit for bit."""
    quiet_warnings()
    t0 = time.perf_counter()
    model, opt, step_fn = build_state(device, width, layers, batch, seed=1)  # other weights than saved
    step_fn()
    sync(device)
    out: dict[str, Any] = {"method": method, "build_s": time.perf_counter() - t0}
    gc.collect()
    out["cache"] = drop_page_cache(drop, [root])
    out.update(restore_into(method, model, opt, Path(root), step, device, direct_io=direct_io))
    out.update(compare(want, fingerprint(model, opt)))
    h.log(f"{method}: fresh-process restore {out['restore_s']:.2f}s, bit-identical {out['bit_identical']}")
    return out


# ------------------------------------------------------------------------------------------
# Summary
# ------------------------------------------------------------------------------------------


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Per method: the added time per checkpoint, save() blocking, durable, in-process restore."""
    s: dict[str, Any] = {}
    loops = [res[key] for key in ("base_a", "base_b") if key in res]
    base = [x for lp in loops for x in lp["step_s"]]
    if base:
        s["step_s"] = statistics.median(base)
        s["step_loop_s"] = sum(lp["loop_s"] for lp in loops) / len(base)  # per step, as the loop with saves counts
    if "first_save" in res:
        s["first_call_s"] = res["first_save"]["call_s"]
        s["first_durable_s"] = res["first_save"]["durable_s"]
    wc = res.get("with_ckpt")
    if wc and base:
        saves = wc["saves"]
        s["n_saves"] = len(saves)
        s["added_per_ckpt_s"] = (wc["loop_s"] - wc["steps"] * s["step_loop_s"]) / len(saves)
        s["added_fraction_of_step"] = h.ratio(s["added_per_ckpt_s"], s["step_s"])
        s["save_blocks_s"] = statistics.median([x["call_s"] for x in saves])
        s["durable_s"] = statistics.median([x["durable_s"] for x in saves])
        s["final_wait_s"] = wc["final_wait_s"]
        interval = wc["loop_s"] / len(saves)
        s["durable_within_interval"] = all(x["durable_s"] <= interval for x in saves)
    if "restore" in res:
        s["restore_s"] = res["restore"]["restore_s"]
        s["restore_bit_identical"] = res["restore"]["bit_identical"]
    return s


def status_of(res: dict[str, Any] | None) -> str:
    if res is None:
        return "not run"
    if res.get("skipped"):
        return f"skipped: {res['skipped']}"
    if res.get("error"):
        return f"failed: {first_line(res['error'])}"
    return "ok"


def headline(report: dict[str, Any]) -> dict[str, Any]:
    meth, fresh, lim = report["methods"], report["fresh_restores"], report["limits"]
    lazy, eager, dcpa = (
        meth.get(k, {}).get("summary", {}) for k in ("tiercheck.lazy", "tiercheck.eager", "dcp.async_save")
    )
    out: dict[str, Any] = dict.fromkeys(HEADLINE)
    state = report["config"].get("state_bytes")
    d2h = (lim.get("copy") or {}).get("pinned_d2h")
    if d2h and state and eager.get("save_blocks_s"):
        out["staging_fraction_of_pinned_copy"] = h.ratio(state / (d2h["gb_s"] * 1e9), eager["save_blocks_s"])
    out["lazy_added_fraction_of_step"] = lazy.get("added_fraction_of_step")
    if lazy.get("added_per_ckpt_s") is not None and (dcpa.get("added_per_ckpt_s") or 0) > 0:
        out["added_vs_dcp_async"] = h.ratio(lazy["added_per_ckpt_s"], dcpa["added_per_ckpt_s"])
    tc_fresh = next(
        (fresh[k] for k in ("tiercheck.lazy", "tiercheck.eager") if fresh.get(k, {}).get("restore_s")), None
    )
    raw_read = (lim.get("disk") or {}).get("cold_read")
    if tc_fresh and raw_read:
        out["restore_fraction_of_raw_read"] = h.ratio(raw_read["s"], tc_fresh["restore_s"])
    tck = fresh.get("torch_checkpointing", {})
    if tc_fresh and tck.get("restore_s") and not tck.get("error"):
        out["restore_vs_torch_checkpointing"] = h.ratio(tc_fresh["restore_s"], tck["restore_s"])
    return out


def render(report: dict[str, Any]) -> str:
    cfg, lim = report["config"], report["limits"]
    lines = [
        f"GPU benchmark on {report['device']}{' (dry run)' if cfg.get('dry_run') else ''}: "
        f"{(cfg.get('state_bytes') or 0) / GiB:.2f} GiB of fp32 state ({cfg.get('layers')} x Linear({cfg.get('width')}, "
        f"{cfg.get('width')}) + AdamW), batch {cfg.get('batch')}, k={cfg.get('k')} ({cfg.get('k_reason')}), "
        f"n={cfg.get('n')} checkpoints per loop; page cache: {cfg.get('cache') or 'NOT dropped'}",
        "",
    ]
    copy = lim.get("copy") or {}
    disk = lim.get("disk") or {}
    lim_rows = []
    for key, what in (
        ("pinned_d2h", "pinned D2H copy_"),
        ("pinned_h2d", "pinned H2D copy_"),
        ("pageable_d2h", "pageable D2H copy_"),
    ):
        lim_rows.append([what, h.fmt(copy[key]["gb_s"], ".1f", " GB/s") if key in copy else copy.get("skipped", "-")])
    if "write" in disk:
        lim_rows.append(
            [
                "fsync'd sequential write",
                f"{h.fmt(h.ratio(disk['write']['bytes'] / 1e9, disk['write']['durable_s']))} GB/s ({disk['write']['durable_s']:.2f} s)",
            ]
        )
    if "cold_read" in disk:
        cr = disk["cold_read"]
        lim_rows.append(
            [
                "cold sequential read",
                f"{h.fmt(h.ratio(cr['bytes'] / 1e9, cr['s']))} GB/s ({cr['s']:.2f} s; cache {cr['cache'] or 'NOT dropped'})",
            ]
        )
    if lim.get("step_s"):
        lim_rows.append(["training step (median)", h.fmt(statistics.median(lim["step_s"]), ".4f", " s")])
    lines += [h.table(["limit", "value"], lim_rows), ""]
    headers = ["method", "status", "step s", "added/ckpt s", "x step", "save() blocks s (first)", "durable s (first)",
               "restore in process s", "fresh restore s", "raw read / fresh restore", "bit-identical"]  # fmt: skip
    rows = []
    raw = (disk.get("cold_read") or {}).get("s")
    for name in cfg["methods"]:
        res = report["methods"].get(name)
        s = (res or {}).get("summary", {})
        fr = report["fresh_restores"].get(name) or {}
        ident = [x for x in (s.get("restore_bit_identical"), fr.get("bit_identical")) if x is not None]
        rows.append([
            name + (" (no fsync)" if name in NO_FSYNC else ""),
            status_of(res),
            h.fmt(s.get("step_s"), ".4f"),
            h.fmt(s.get("added_per_ckpt_s"), ".3f"),
            h.fmt(s.get("added_fraction_of_step"), ".2f"),
            f"{h.fmt(s.get('save_blocks_s'), '.3f')} ({h.fmt(s.get('first_call_s'), '.2f')})",
            f"{h.fmt(s.get('durable_s'))} ({h.fmt(s.get('first_durable_s'))})" + ("" if s.get("durable_within_interval", True) else " (!)"),
            h.fmt(s.get("restore_s")),
            h.fmt(fr.get("restore_s")) if fr.get("restore_s") else (status_of(fr) if fr else "-"),
            h.fmt(h.ratio(raw, fr.get("restore_s")) if fr.get("restore_s") else None),
            "-" if not ident else ("yes" if all(ident) else "NO"),
        ])  # fmt: skip
    lines += [h.table(headers, rows), ""]
    reads = [[name, h.fmt(r["s"]), h.fmt(r["bytes"] / 1e9 / r["s"] if r["s"] else None, ".2f", " GB/s"), fmt_b(r["bytes"])]
             for name, fr in report["fresh_restores"].items() if (r := fr.get("ckpt_cold_read"))]  # fmt: skip
    if reads:
        lines += [
            "Cold read of each restored checkpoint's own files:",
            "",
            h.table(["method", "s", "rate", "bytes"], reads),
            "",
        ]
    hl = report["headline"]
    lines.append("Headline: " + "; ".join(f"{k} = {h.fmt(hl.get(k), '.3f')}" for k in HEADLINE))
    lines += [f"- {k}: {v}" for k, v in DEFINITIONS.items()]
    if report.get("notes"):
        lines += ["", "Notes:"] + [f"- {x}" for x in report["notes"]]
    if report.get("skipped"):
        lines += ["", "Skipped:"] + [f"- {x}" for x in report["skipped"]]
    lines += ["", f"Run took {report.get('elapsed_s', 0):.0f} s (budget {cfg.get('budget_s')} s)."]
    return "\n".join(lines)


def fmt_b(n: float) -> str:
    return h.fmt_bytes(n)


# ------------------------------------------------------------------------------------------
# Parent
# ------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny sizes (a few MiB), fixed k, no cache drops: CI")
    p.add_argument("--out", default=str(h.RESULTS_DIR), help="directory of gpu-<device>.json (default bench/results)")
    p.add_argument(
        "--dir", help="parent of the scratch checkpoint directory, on the disk to measure (default bench/results)"
    )
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda when available")
    p.add_argument("--size-gib", type=float, default=4.0, help="state size (parameters + AdamW moments), default 4")
    p.add_argument("--width", type=int, default=0, help="Linear width (default 8192; dry run 256)")
    p.add_argument("--layers", type=int, default=0, help="Linear layers (default: from --size-gib)")
    p.add_argument("--batch", type=int, default=0, help="rows per step (default 2048; dry run 32)")
    p.add_argument("--k", type=int, default=0, help="steps between checkpoints (default: calibrated; dry run 3)")
    p.add_argument("--n", type=int, default=2, help="checkpoints in the timed loop (default 2)")
    p.add_argument("--headroom", type=float, default=1.5, help="calibrated k: k steps >= headroom x raw write")
    p.add_argument("--max-k", type=int, default=400, help="upper bound of the calibrated k")
    p.add_argument("--copy-mib", type=int, default=1024, help="bytes of each copy_ bandwidth measurement")
    p.add_argument("--methods", nargs="+", choices=METHODS, metavar="M", help=f"subset of: {' '.join(METHODS)}")
    p.add_argument(
        "--fresh", nargs="*", choices=METHODS, metavar="M", help=f"fresh-process restores (default: {' '.join(FRESH)})"
    )
    p.add_argument("--budget-s", type=float, default=280, help="past this, remaining phases are skipped (default 280)")
    p.add_argument(
        "--tckpt-direct-io",
        choices=("try", "off"),
        default="try",
        help="torch_checkpointing: try its default O_DIRECT writer and fall back to buffered on failure (EINVAL "
        "on ext4), or go buffered from the start",
    )
    p.add_argument("--no-drop-caches", action="store_true", help="never drop the page cache")
    p.add_argument("--drop-caches", action="store_true", help="drop the page cache in --dry-run too")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    return p.parse_args(argv)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.seconds, self.t0 = seconds, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def timeout(self, floor: float = 60, cap: float = 240) -> float:
        """A worker's timeout: what the budget leaves plus a margin, within [floor, cap]."""
        return min(cap, max(floor, self.left() + 60))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # the parent never creates a CUDA context
    import torch

    budget = Budget(args.budget_s)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    dry = args.dry_run
    width = args.width or (256 if dry else 8192)
    layers = args.layers or (4 if dry else layers_for(args.size_gib, width))
    batch = args.batch or (32 if dry else 2048)
    drop = not args.no_drop_caches and (not dry or args.drop_caches)
    methods = list(args.methods or METHODS)
    fresh_methods = [x for x in (FRESH if args.fresh is None else args.fresh) if x in methods]
    name = device_name(device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch_parent = Path(args.dir) if args.dir else h.RESULTS_DIR  # the repo's disk, not wherever --out is
    scratch_parent.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"gpu-{slug(name)}{'-dry-run' if dry else ''}.json"
    report: dict[str, Any] = {
        "device": name,
        "status": "running",
        **dict.fromkeys(HEADLINE),
        "tiercheck_restores_bit_identical": None,
        "headline": {},
        "definitions": DEFINITIONS,
        "config": {
            "dry_run": dry,
            "device": device,
            "width": width,
            "layers": layers,
            "batch": batch,
            "n": args.n,
            "methods": methods,
            "fresh": fresh_methods,
            "budget_s": args.budget_s,
            "drop_caches": drop,
            "argv": sys.argv[1:] if argv is None else list(argv),
        },
        "machine": {},
        "limits": {},
        "methods": {},
        "fresh_restores": {},
        "notes": [],
        "skipped": [],
    }

    def save_report(final: bool = False) -> None:
        report["elapsed_s"] = budget.elapsed()
        report["headline"] = headline(report)
        report.update(report["headline"])
        tc_ident = [
            r["summary"].get("restore_bit_identical")
            for k, r in report["methods"].items()
            if k.startswith("tiercheck.") and "summary" in r
        ]
        tc_ident += [r.get("bit_identical") for k, r in report["fresh_restores"].items() if k.startswith("tiercheck.")]
        tc_ident = [x for x in tc_ident if x is not None]
        report["tiercheck_restores_bit_identical"] = all(tc_ident) if tc_ident else None
        if final:
            report["status"] = "complete" if not report["skipped"] else "partial (budget)"
        h.write_json(json_path, report)

    def skip(what: str) -> bool:
        if budget.left() > 0:
            return False
        report["skipped"].append(f"{what}: the {args.budget_s:.0f} s budget was spent ({budget.elapsed():.0f} s)")
        h.log(report["skipped"][-1])
        return True

    h.log(f"device {name} ({device}); JSON: {json_path}")
    try:
        report["machine"] = h.machine_info(scratch_parent)
        report["machine"]["dev_shm_bytes"] = shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else None
    except Exception as exc:
        report["notes"].append(f"machine info failed: {type(exc).__name__}: {exc}")
    if not cuda:
        report["notes"].append("no CUDA device: the pinned/pageable copy_ limits and DCP's pinned stager are skipped")
    if not drop:
        report["notes"].append("page cache NOT dropped (dry run, or --no-drop-caches): restores and reads may be warm")
    elif os.geteuid() != 0:
        report["notes"].append("not root: the page cache is dropped per file with posix_fadvise, which may leave pages")
    have_tckpt = importlib.util.find_spec("torch_checkpointing") is not None

    with h.scratch_dir(scratch_parent, "gpu_bench-", args.keep) as scratch:
        # 1. Limits: copy bandwidths and step time (with CUDA in a worker: the parent holds no CUDA context).
        h.log("limits: copy_ bandwidths and step time")
        lkw = {"device": device, "width": width, "layers": layers, "batch": batch, "copy_mib": args.copy_mib, "steps": 3 if dry else 5}  # fmt: skip
        if cuda:
            lim = h.run_worker(__file__, "measure_limits", lkw, budget.timeout())
        else:
            try:
                lim = measure_limits(**lkw)
            except Exception as exc:
                lim = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        if "error" in lim:
            report["limits"]["error"] = lim["error"]
            report["limits"]["traceback"] = lim.get("traceback")
            h.log(f"limits FAILED: {lim['error']}\n{lim.get('traceback', '')}")
        report["limits"]["copy"] = {k: lim[k] for k in ("pinned_d2h", "pinned_h2d", "pageable_d2h") if k in lim}
        if not cuda:
            report["limits"]["copy"]["skipped"] = "no CUDA device"
        for key in ("gpu", "cuda", "torch", "step_s"):
            if key in lim:
                report["limits"][key] = lim[key]
        save_report()

        # Disk: fsync'd write and cold read of the state's bytes.
        state_bytes = layers * (width * width + width) * 12 + layers * 2 * 4  # + AdamW's step scalars
        report["config"]["state_bytes"] = state_bytes
        disk: dict[str, Any] = {}
        try:
            disk["write"] = h.measure_disk_write(scratch, state_bytes, keep=True)
            how = drop_page_cache(drop, [disk["write"]["path"]])
            disk["cold_read"] = {**h.measure_cold_read([disk["write"]["path"]], drop=False), "cache": how}
        except Exception as exc:
            disk["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            with contextlib.suppress(OSError):
                os.unlink(scratch / "raw-write.bin")
        report["limits"]["disk"] = disk
        report["config"]["cache"] = disk.get("cold_read", {}).get("cache", "")
        h.log(
            f"state {state_bytes / GiB:.2f} GiB: raw write {disk.get('write', {}).get('durable_s', math.nan):.2f}s, "
            f"cold read {disk.get('cold_read', {}).get('s', math.nan):.2f}s"
        )
        step_s = min(lim["step_s"]) if lim.get("step_s") else None
        if args.k or dry:
            k, why = args.k or 3, "--k" if args.k else "fixed for --dry-run"
        elif step_s and "write" in disk:
            want = math.ceil(args.headroom * disk["write"]["durable_s"] / max(step_s, 1e-4))
            k = min(max(2, want), args.max_k)
            why = f"ceil({args.headroom} x raw write {disk['write']['durable_s']:.2f}s / step {step_s:.4f}s)" + (
                f" = {want}, clamped" if k != want else ""
            )
        else:
            k, why = 20, "fixed: no step time or raw write measured"
        report["config"]["k"], report["config"]["k_reason"] = k, why
        save_report()

        # 2-3. Methods, each followed by its fresh-process restore.
        for method in methods:
            root = scratch / slug(method)
            try:
                if skip(method):
                    continue
                if method == "torch_checkpointing" and not have_tckpt:
                    if dry or not cuda:
                        report["methods"][method] = {"skipped": "not installed"}
                        report["notes"].append("torch_checkpointing is not installed: skipped")
                    else:
                        report["methods"][method] = {"error": "torch_checkpointing is not installed"}
                    save_report()
                    continue
                if method == "dcp.async_save+pinned" and not cuda:
                    report["methods"][method] = {"skipped": "needs CUDA (pinned memory)"}
                    save_report()
                    continue
                h.log(f"{method}: k={k}, n={args.n}")
                kw = {"method": method, "device": device, "width": width, "layers": layers, "batch": batch, "k": k, "n": args.n, "root": str(root), "drop": drop, "tc_direct_io": args.tckpt_direct_io == "try"}  # fmt: skip
                res = h.run_worker(__file__, "run_method", kw, budget.timeout())
                if "error" in res and "method" not in res:  # the worker died (signal, timeout)
                    h.log(f"{method} FAILED: {res['error']}")
                res["summary"] = summarize(res)
                want = res.pop("fingerprint", None)
                report["methods"][method] = res
                if method in EXPECTED_TO_FAIL and res.get("error"):
                    report["notes"].append(
                        f"{method} failed as expected on torch 2.11 (pytorch#183413): {first_line(res['error'])}"
                    )
                save_report()
                if method in fresh_methods:
                    if not want or "first_save" not in res:
                        report["fresh_restores"][method] = {"skipped": "no checkpoint was saved"}
                    elif not skip(f"{method} fresh-process restore"):
                        h.log(f"{method}: fresh-process restore")
                        fkw = {"method": method, "device": device, "width": width, "layers": layers, "batch": batch,
                               "root": str(root), "step": PRIME, "want": want, "drop": drop,
                               "direct_io": res.get("torch_checkpointing_direct_io") is not False}  # fmt: skip
                        fr = h.run_worker(__file__, "fresh_restore", fkw, budget.timeout())
                        if "error" in fr:
                            h.log(f"{method} fresh restore FAILED: {fr['error']}\n{fr.get('traceback', '')}")
                        step_dir = root / f"step-{PRIME:08d}"
                        files = sorted(str(p) for p in step_dir.rglob("*") if p.is_file()) if step_dir.is_dir() else []
                        if files and not skip(f"{method} checkpoint cold read"):
                            how = drop_page_cache(drop, files)
                            fr["ckpt_cold_read"] = {
                                **h.measure_cold_read(files, drop=False),
                                "cache": how,
                                "files": len(files),
                            }
                        report["fresh_restores"][method] = fr
                        save_report()
            except Exception as exc:  # the parent's own bookkeeping: recorded, the next method still runs
                report["methods"].setdefault(method, {})["error"] = f"parent: {type(exc).__name__}: {exc}"
                report["methods"][method]["traceback"] = traceback.format_exc()
                h.log(f"{method}: parent FAILED: {traceback.format_exc()}")
                save_report()
            finally:  # one method's checkpoints at a time on the disk
                shutil.rmtree(root, ignore_errors=True)
                if drop:
                    os.sync()
        for method in methods:
            report["methods"].setdefault(method, {"skipped": "budget"})
        save_report(final=True)
    try:
        table = render(report)
    except Exception:  # the numbers are in the JSON either way
        table = f"(the table could not be rendered: {traceback.format_exc()})"
    report["table"] = table
    h.write_json(json_path, report)
    print(table)
    h.log(f"JSON: {json_path}")
    failed = [m for m, r in report["methods"].items() if r.get("error") and m not in EXPECTED_TO_FAIL]
    failed += [f"{m} (fresh restore)" for m, r in report["fresh_restores"].items() if r.get("error")]
    failed += [
        f"{m} (not bit-identical)" for m, r in report["fresh_restores"].items() if r.get("bit_identical") is False
    ]
    failed += [
        f"{m} (not bit-identical)"
        for m, r in report["methods"].items()
        if r.get("summary", {}).get("restore_bit_identical") is False
    ]
    if failed:
        h.log(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
