#!/usr/bin/env python
"""Side-by-side checkpoint-save benchmark: torch.save, DCP (sync and async) and tiercheck.

Usage::

    .venv/bin/python bench/save_bench.py            # ~2 GiB fp32 weights + AdamW moments (~6 GiB state)
    .venv/bin/python bench/save_bench.py --quick    # ~0.25 GiB weights, smoke run (~2 min)

Every method runs in its own subprocess (``--_worker``) on an identical, freshly built model, so
peak-RSS numbers are per method and no method inherits another's allocator or page-cache state.
The parent process measures the machine's limits (memcpy and fsync'd sequential write
bandwidth), picks the checkpoint interval, runs the workers one at a time, and prints a
markdown table plus JSON (``bench/results/save_bench.json``). See ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GiB = 1 << 30
MiB = 1 << 20
BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"

METHODS: tuple[str, ...] = (
    "torch.save",
    "dcp.save",
    "dcp.async_save",
    "tiercheck.eager",
    "tiercheck.lazy",
)
REFERENCE = "dcp.async_save"  # the method the stall ratios are taken against
TIERCHECK_METHODS = ("tiercheck.eager", "tiercheck.lazy")

# Model shape. d=1024 keeps every big tensor at 16 MiB (4d x d fp32): below glibc's maximum
# mmap threshold (32 MiB), so per-step temporaries (autograd's fresh gradient before it is
# accumulated into .grad) are recycled from the heap instead of page-faulting fresh memory
# every step, which made step times on this VM noisy. The tied 32k x 1024 embedding adds one
# larger tensor and ~6 small tensors per block (LayerNorm, biases) give an LLM-like mix.
D_MODEL = 1024
VOCAB = 32768
QUICK_K = 5  # checkpoint interval (steps) for --quick, which skips the calibration worker
TOKENS = 16  # tiny batch: a real forward/backward/step, dominated by touching every parameter


# --------------------------------------------------------------------------------------------
# Small system helpers (no torch import: the parent stays small while workers run)
# --------------------------------------------------------------------------------------------


def _proc_status_kib(field_name: str) -> int:
    """One ``kB`` field of /proc/self/status (VmRSS, VmHWM), in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def rss_bytes() -> int:
    return _proc_status_kib("VmRSS") * 1024


def hwm_bytes() -> int:
    return _proc_status_kib("VmHWM") * 1024


def reset_hwm() -> bool:
    """Reset VmHWM (peak RSS) to the current RSS; Linux >= 4.0 via clear_refs value 5."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def drop_page_cache(enabled: bool) -> bool:
    """Flush dirty pages and drop the page cache so each phase starts from a cold cache.

    Only root can do this; elsewhere it is a no-op (reported in the output) and later
    methods may see a warmer or dirtier cache than earlier ones.
    """
    os.sync()
    if not enabled or os.geteuid() != 0:
        return False
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fsync_dir(path: Path) -> None:
    """fsync a directory so the entries created in it (files, renames) are durable too."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tree_pids(root: int) -> set[int]:
    """``root`` and all its descendants, from /proc/*/stat parent links."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(children.get(pid, []))
    return out


def _cpu_ticks_by_pid() -> dict[int, int]:
    """utime+stime+cutime+cstime of every user-space process (kernel threads excluded)."""
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # rest[1] is ppid; kernel threads are pid 2 and its children.
        if entry == "2" or rest[1] == "2":
            continue
        ticks[int(entry)] = sum(int(x) for x in rest[11:15])
    return ticks


def _system_busy_ticks() -> int:
    """Busy CPU ticks of the whole machine (user+nice+system+irq+softirq), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return user + nice + system + irq + softirq


def cpu_times() -> dict[str, float]:
    """Whole-machine CPU seconds by state from /proc/stat (user, system, idle, iowait, steal)."""
    hz = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return {
        "user": (v[0] + v[1]) / hz,
        "system": (v[2] + v[5] + v[6]) / hz,
        "idle": v[3] / hz,
        "iowait": v[4] / hz,
        "steal": v[7] / hz,
    }


def cpu_delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a[k] for k in a}


def steal_share(delta: dict[str, float]) -> float:
    """Share of all vCPU time the hypervisor gave to someone else."""
    total = sum(delta.values())
    return delta["steal"] / total if total > 0 else 0.0


def settle(max_wait_s: float, threshold: float = 0.05, window_s: float = 0.5) -> float:
    """Wait (up to ``max_wait_s``) until the hypervisor stops stealing our vCPUs.

    On this VM, gigabytes of fsync'd writes are followed by seconds of heavy steal time
    (the host is still flushing the virtual disk): training steps in that window run up to
    2-3x slower although nothing in our process is busy. Whatever phase came next would be
    charged for the previous phase's writes, so timed phases start only once a half-second
    window shows less than ``threshold`` steal. Returns the seconds waited.
    """
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait_s:
        a = cpu_times()
        time.sleep(window_s)
        if steal_share(cpu_delta(a, cpu_times())) < threshold:
            break
    return time.perf_counter() - t0


class ForeignCpu:
    """CPU seconds used by processes outside this benchmark while a phase ran.

    This machine is small and may be shared (tests, builds); any foreign CPU time during a
    timed phase inflates step times and write times, so it is measured and reported rather
    than silently folded into the results.

    Per process we take the growth of utime+stime+cutime+cstime. A child that exits during
    the phase adds its whole lifetime to its parent's cutime, so the ticks it had already
    used at the start are subtracted again. The sum is capped by the machine's busy ticks
    minus our own, so it can never exceed what the CPUs actually did.
    """

    def __init__(self) -> None:
        self._hz = os.sysconf("SC_CLK_TCK")
        self._me = os.getpid()
        self._start = _cpu_ticks_by_pid()
        self._busy0 = _system_busy_ticks()
        self._t0 = time.monotonic()

    def stop(self) -> dict[str, float]:
        end = _cpu_ticks_by_pid()
        busy = _system_busy_ticks() - self._busy0
        wall = time.monotonic() - self._t0
        ours = _tree_pids(self._me)
        # Our workers have been reaped by now, so their time is in our cutime/cstime.
        our_ticks = end.get(self._me, 0) - self._start.get(self._me, 0)
        grown = sum(t - self._start.get(pid, 0) for pid, t in end.items() if pid not in ours)
        exited = sum(t for pid, t in self._start.items() if pid not in end and pid not in ours)
        foreign_ticks = min(max(0, grown - exited), max(0, busy - our_ticks))
        foreign_s = foreign_ticks / self._hz
        ncpu = os.cpu_count() or 1
        return {
            "wall_s": wall,
            "foreign_cpu_s": foreign_s,
            "foreign_cpu_share": foreign_s / (wall * ncpu) if wall > 0 else 0.0,
            "machine_busy_share": busy / self._hz / (wall * ncpu) if wall > 0 else 0.0,
        }


def machine_info(ckpt_dir: Path) -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_total = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
    fs_type = "unknown"
    # Longest mount point that is a prefix of the checkpoint directory.
    best = ""
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            under = str(ckpt_dir).startswith(mnt.rstrip("/") + "/") or str(ckpt_dir) == mnt
            if under and len(mnt) >= len(best):
                best, fs_type = mnt, f"{parts[2]} ({parts[0]} on {mnt})"
    import torch

    tc_version = None
    try:
        import tiercheck

        tc_version = getattr(tiercheck, "__version__", "unknown")
    except Exception as exc:
        tc_version = f"not importable: {type(exc).__name__}: {exc}"
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "ram_bytes": mem_total,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "tiercheck": tc_version,
        "checkpoint_fs": fs_type,
        "root": os.geteuid() == 0,
    }


# --------------------------------------------------------------------------------------------
# Machine limits: memcpy and fsync'd sequential write
# --------------------------------------------------------------------------------------------


def measure_memcpy(nbytes: int, repeats: int = 3) -> dict[str, float]:
    """torch copy_ bandwidth in GiB/s (best of ``repeats``).

    "reused": into a pre-allocated, already-faulted buffer (what a staging pool does);
    "fresh": into newly allocated memory, which pays first-touch page faults (what a stager
    that allocates a new copy per checkpoint pays).
    """
    import torch

    threads_before = torch.get_num_threads()
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the destination in once
    out: dict[str, float] = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            best = math.inf
            for _ in range(repeats):
                t0 = time.perf_counter()
                dst.copy_(src)
                best = min(best, time.perf_counter() - t0)
            out[f"reused_{threads}t_gib_s"] = nbytes / GiB / best
        torch.set_num_threads(threads_before)
        del dst
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            fresh = torch.empty_like(src)
            fresh.copy_(src)
            best = min(best, time.perf_counter() - t0)
            del fresh
        out[f"fresh_{threads_before}t_gib_s"] = nbytes / GiB / best
    finally:
        torch.set_num_threads(threads_before)
    return out


def measure_disk_write(directory: Path, nbytes: int, block: int = 64 * MiB) -> dict[str, float]:
    """Raw fsync'd sequential write of ``nbytes``: os.write in ``block`` pieces, fsync, dir fsync.

    This is the floor for "time until durable" of any checkpoint of the same size written to
    the same directory. Each block gets a distinct header so no layer below can deduplicate.
    """
    buf = bytearray(os.urandom(block))
    view = memoryview(buf)
    path = directory / "raw-write.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        written = 0
        while written < nbytes:
            n = min(block, nbytes - written)
            buf[:8] = written.to_bytes(8, "little")
            off = 0
            while off < n:
                off += os.write(fd, view[off:n])
            written += n
        t_write = time.perf_counter() - t0
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(directory)
    total = time.perf_counter() - t0
    path.unlink()
    return {
        "bytes": nbytes,
        "write_s": t_write,
        "durable_s": total,
        "gib_s": nbytes / GiB / total,
    }


# --------------------------------------------------------------------------------------------
# The synthetic LLM-like training state (worker side)
# --------------------------------------------------------------------------------------------


def model_shape(size_gib: float) -> int:
    """Number of MLP blocks so fp32 parameters total about ``size_gib``."""
    block_params = 2 * D_MODEL * 4 * D_MODEL + 4 * D_MODEL + D_MODEL + 2 * D_MODEL
    emb_params = VOCAB * D_MODEL
    target = size_gib * GiB / 4
    return max(1, round((target - emb_params) / block_params))


def build_state(n_blocks: int, seed: int = 0) -> tuple[Any, Any, Any]:
    """(model, optimizer, step_fn) with AdamW state already allocated."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(D_MODEL)
            self.up = nn.Linear(D_MODEL, 4 * D_MODEL)
            self.down = nn.Linear(4 * D_MODEL, D_MODEL)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(F.gelu(self.up(self.ln(x))))

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, D_MODEL)
            self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
            self.ln_f = nn.LayerNorm(D_MODEL)

        def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = self.emb(tokens)
            for block in self.blocks:
                x = block(x)
            logits = self.ln_f(x) @ self.emb.weight.T  # tied output head
            return F.cross_entropy(logits, targets)

    torch.manual_seed(seed)
    # Build on the meta device and materialise once: nn.Linear's default init on ~0.5 G
    # parameters costs seconds and we overwrite it anyway.
    with torch.device("meta"):
        model = TinyLM()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ln.weight") or name.endswith("ln_f.weight"):
                p.fill_(1.0)
            else:
                # Random values: incompressible like real weights, so a compressing writer
                # gains nothing it would not gain in practice.
                p.uniform_(-0.02, 0.02)
    # fused AdamW has a CPU kernel (one pass over p, grad, m, v): the step is what a real
    # trainer would use, and it keeps step time (and its noise) down.
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=gen)

    def step() -> None:
        # set_to_none=False keeps gradient buffers allocated across steps, as trainers with
        # persistent gradient buckets do; re-faulting ~size_gib of fresh gradient memory
        # each step would add noisy page-fault time unrelated to checkpointing.
        opt.zero_grad(set_to_none=False)
        loss = model(tokens, targets)
        loss.backward()
        opt.step()

    return model, opt, step


def state_bytes_of(model: Any, opt: Any) -> tuple[int, int]:
    """(bytes, tensor count) of everything a checkpoint holds: parameters, buffers, AdamW state."""
    import torch

    tensors: list[torch.Tensor] = list(model.state_dict().values())
    for st in opt.state.values():
        tensors.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return sum(t.numel() * t.element_size() for t in tensors), len(tensors)


# --------------------------------------------------------------------------------------------
# Savers: one object per method with the same three operations
# --------------------------------------------------------------------------------------------


@dataclass
class Pending:
    """One checkpoint in flight. ``durable`` resolves to the perf_counter() time it became
    durable (all data and directory entries fsync'd, checkpoint committed)."""

    step: int
    durable: Future[float]
    extra: dict[str, Any] = field(default_factory=dict)


def _done(t: float) -> Future[float]:
    fut: Future[float] = Future()
    fut.set_result(t)
    return fut


class Saver:
    name = "base"

    def __init__(self, model: Any, opt: Any, root: Path) -> None:
        self.model, self.opt, self.root = model, opt, root
        root.mkdir(parents=True, exist_ok=True)
        self.pending: list[Pending] = []

    def save(self, step: int) -> Pending:
        raise NotImplementedError

    def wait_all(self) -> None:
        for p in self.pending:
            p.durable.result()

    def close(self) -> None:
        self.wait_all()

    def details(self, p: Pending) -> dict[str, Any]:
        return dict(p.extra)


class TorchSave(Saver):
    """torch.save to a temp file, fsync, atomic rename, fsync the directory: the usual
    'durable single-file checkpoint' recipe, so its durability matches the others."""

    name = "torch.save"

    def save(self, step: int) -> Pending:
        import torch

        final = self.root / f"step-{step:08d}.pt"
        tmp = final.with_suffix(".pt.tmp")
        sd = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
        with open(tmp, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(self.root)
        p = Pending(step, _done(time.perf_counter()))
        self.pending.append(p)
        return p


def _dcp_state(model: Any, opt: Any) -> dict[str, Any]:
    # get_state_dict gives FQN-keyed optimizer state: the documented DCP input.
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


class DcpSave(Saver):
    """torch.distributed.checkpoint.save, single process (no process group needed; DCP
    falls back to no_dist). FileSystemWriter defaults: sync_files=True fsyncs every data file
    and the metadata file, but not the directories; we fsync the checkpoint directory and
    its parent afterwards (a few ms) so durability is comparable."""

    name = "dcp.save"

    def save(self, step: int) -> Pending:
        import torch.distributed.checkpoint as dcp

        path = self.root / f"step-{step:08d}"
        dcp.save(_dcp_state(self.model, self.opt), checkpoint_id=path)
        fsync_dir(path)
        fsync_dir(self.root)
        p = Pending(step, _done(time.perf_counter()))
        self.pending.append(p)
        return p


class DcpAsyncSave(Saver):
    """torch.distributed.checkpoint.async_save with its defaults (thread executor; the
    default stager copies the whole state into freshly allocated CPU memory before
    async_save returns). Like torchtitan, a new save first waits for the previous one to be
    durable (DCP does not queue); that wait is part of what the training loop feels."""

    name = "dcp.async_save"

    def save(self, step: int) -> Pending:
        import torch.distributed.checkpoint as dcp

        extra: dict[str, Any] = {}
        if self.pending:
            t0 = time.perf_counter()
            self.pending[-1].durable.result()
            extra["wait_prev_s"] = time.perf_counter() - t0
        path = self.root / f"step-{step:08d}"
        t0 = time.perf_counter()
        inner = dcp.async_save(_dcp_state(self.model, self.opt), checkpoint_id=path)
        # With the default (synchronous) stager async_save returns a plain Future; the
        # AsyncSaveResponse variant only appears with an asynchronous stager.
        assert isinstance(inner, Future), type(inner)
        extra["async_save_call_s"] = time.perf_counter() - t0
        durable: Future[float] = Future()
        root = self.root

        def on_done(f: Future[Any]) -> None:
            # Runs on DCP's writer thread right after its files (and .metadata) are fsync'd;
            # add the directory fsyncs there so "durable" means the same as for the others.
            try:
                f.result()
                fsync_dir(path)
                fsync_dir(root)
                durable.set_result(time.perf_counter())
            except BaseException as exc:
                durable.set_exception(exc)

        inner.add_done_callback(on_done)
        p = Pending(step, durable, extra)
        self.pending.append(p)
        return p


class TiercheckSaver(Saver):
    """tiercheck.Checkpointer with default write options (fsync=True) and the given staging
    mode. Retention keeps every step (keep_last=None): the baselines delete nothing during a
    run either, so no method pays for deletions the others skip."""

    def __init__(self, model: Any, opt: Any, root: Path, mode: str) -> None:
        super().__init__(model, opt, root)
        import tiercheck

        self.name = f"tiercheck.{mode}"
        t0 = time.perf_counter()
        self.ckpt = tiercheck.Checkpointer(
            {"model": model, "optim": opt},
            local=str(root),
            staging=tiercheck.StagingOptions(mode=mode),  # type: ignore[arg-type]
            write=tiercheck.WriteOptions(),
            retention=tiercheck.RetentionOptions(keep_last=None),
        )
        self.construct_s = time.perf_counter() - t0
        self.handles: dict[int, Any] = {}

    def save(self, step: int) -> Pending:
        h = self.ckpt.save(step)
        self.handles[step] = h
        durable: Future[float] = Future()

        def on_done(f: Future[Any]) -> None:
            try:
                f.result()
                durable.set_result(time.perf_counter())
            except BaseException as exc:
                durable.set_exception(exc)

        h.committed.add_done_callback(on_done)
        p = Pending(step, durable, {"skipped": bool(h.skipped), "nbytes": int(h.nbytes)})
        self.pending.append(p)
        return p

    def wait_all(self) -> None:
        self.ckpt.wait()
        super().wait_all()

    def close(self) -> None:
        self.ckpt.close()
        super().wait_all()

    def details(self, p: Pending) -> dict[str, Any]:
        out = dict(p.extra)
        h = self.handles.get(p.step)
        if h is not None:
            out["timings"] = {k: float(v) for k, v in dict(h.timings).items()}
        return out

    def stats(self) -> dict[str, Any]:
        return {k: v for k, v in dict(self.ckpt.stats()).items() if _jsonable(v)}


def _jsonable(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool, type(None)))


def make_saver(method: str, model: Any, opt: Any, root: Path) -> Saver:
    if method == "torch.save":
        return TorchSave(model, opt, root)
    if method == "dcp.save":
        return DcpSave(model, opt, root)
    if method == "dcp.async_save":
        return DcpAsyncSave(model, opt, root)
    if method in TIERCHECK_METHODS:
        return TiercheckSaver(model, opt, root, method.split(".", 1)[1])
    raise ValueError(f"unknown method {method!r}")


# --------------------------------------------------------------------------------------------
# Worker: one method, one process
# --------------------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_loop(
    step_fn: Callable[[], None],
    n_steps: int,
    save_every: int,
    saver: Saver | None,
    first_label: int,
) -> dict[str, Any]:
    """Train ``n_steps`` steps; with a saver, save before steps 0, k, 2k, ... so that every
    checkpoint is followed by k training steps in which its background work can run.

    Returns the loop wall time (excluding the final wait for outstanding checkpoints, which
    is timed separately), per-step times, per-save call times and per-save durable times.
    """
    step_s: list[float] = []
    saves: list[dict[str, Any]] = []
    pendings: list[tuple[Pending, float, float]] = []
    cpu0 = cpu_times()
    t_loop = time.perf_counter()
    for i in range(n_steps):
        if saver is not None and i % save_every == 0:
            t0 = time.perf_counter()
            p = saver.save(first_label + i)
            pendings.append((p, t0, time.perf_counter() - t0))
        t0 = time.perf_counter()
        step_fn()
        step_s.append(time.perf_counter() - t0)
    loop_s = time.perf_counter() - t_loop
    cpu = cpu_delta(cpu0, cpu_times())
    final_wait_s = 0.0
    if saver is not None:
        t0 = time.perf_counter()
        saver.wait_all()
        final_wait_s = time.perf_counter() - t0
        for p, t_call, call_s in pendings:
            saves.append(
                {
                    "step": p.step,
                    "call_s": call_s,
                    "durable_s": p.durable.result() - t_call,
                    **saver.details(p),
                }
            )
    return {
        "loop_s": loop_s,
        "final_wait_s": final_wait_s,
        "step_s": step_s,
        "saves": saves,
        "machine_cpu_s": cpu,  # whole machine, during the loop (final wait excluded)
    }


def worker_main(args: argparse.Namespace) -> None:
    import torch

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    method: str = args._worker
    out: dict[str, Any] = {"method": method, "pid": os.getpid()}
    result_path = Path(args._worker_out)

    def dump() -> None:
        result_path.write_text(json.dumps(out, indent=1))

    try:
        t0 = time.perf_counter()
        model, opt, step_fn = build_state(args._blocks)
        for _ in range(args.warmup):  # allocates grads and AdamW moments, warms allocator
            step_fn()
        gc.collect()
        out["build_s"] = time.perf_counter() - t0
        out["state_bytes"], out["n_tensors"] = state_bytes_of(model, opt)
        out["torch_threads"] = torch.get_num_threads()

        if method == "calibrate":
            times = []
            for _ in range(args._calib_steps):
                t1 = time.perf_counter()
                step_fn()
                times.append(time.perf_counter() - t1)
            out["step_s"] = times
            out["rss_bytes"] = rss_bytes()
            dump()
            return

        k, n = args._k, args._n
        root = Path(args._worker_dir)
        drop = not args.no_drop_caches
        n_steps = k * n
        # The no-checkpoint loop is split in two halves run before and after the checkpoint
        # loop (A-B-A), so a slow drift in step time (allocator settling, other load, CPU
        # clocks) cancels instead of being charged to, or credited against, checkpointing.
        half_a = (n_steps + 1) // 2

        # Every timed phase starts from a dropped page cache (so no phase inherits another's
        # dirty or cached pages; dropping does not slow the next step, checked here) and
        # after the hypervisor's steal time has died down (see settle()).
        settled: dict[str, float] = {}
        out["settle_s"] = settled

        def prepare(phase: str) -> None:
            drop_page_cache(drop)
            settled[phase] = settle(args.settle_max_s)

        # Phase 1a: first half of the loop without checkpoints. Its peak RSS is the memory
        # baseline (training alone, before any checkpoint machinery exists).
        prepare("no_ckpt_a")
        out["hwm_reset_ok"] = reset_hwm()
        base_a = run_loop(step_fn, half_a, k, None, 0)
        out["hwm_no_ckpt_bytes"] = hwm_bytes()
        out["rss_no_ckpt_bytes"] = rss_bytes()

        # Phase 2: the loop with a checkpoint every k steps, after one untimed priming save.
        # The priming save takes one-time costs (allocating and first-touching a staging
        # pool, imports, planning caches) out of the per-checkpoint stall; they are reported
        # separately as "first save". A real run amortises them over all its checkpoints.
        drop_page_cache(drop)
        reset_hwm()
        t0 = time.perf_counter()
        saver = make_saver(method, model, opt, root)
        out["saver_construct_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        prime = saver.save(1)
        prime_call = time.perf_counter() - t0
        out["first_save"] = {
            "call_s": prime_call,
            "durable_s": prime.durable.result() - t0,
            **saver.details(prime),
        }
        saver.wait_all()
        saver.pending.clear()
        prepare("with_ckpt")
        with_ckpt = run_loop(step_fn, n_steps, k, saver, 1000)
        out["with_ckpt"] = with_ckpt
        out["hwm_loop_ckpt_bytes"] = hwm_bytes()
        _log(
            f"{method}: checkpoint loop {with_ckpt['loop_s']:.2f}s ({n_steps} steps), "
            f"final wait {with_ckpt['final_wait_s']:.2f}s"
        )

        # Phase 1b: second half of the loop without checkpoints (nothing in flight now).
        prepare("no_ckpt_b")
        base_b = run_loop(step_fn, n_steps - half_a, k, None, 0)
        out["no_ckpt"] = {
            "loop_s": base_a["loop_s"] + base_b["loop_s"],
            "final_wait_s": 0.0,
            "step_s": base_a["step_s"] + base_b["step_s"],
            "halves_s": [base_a["loop_s"], base_b["loop_s"]],
            "saves": [],
            "machine_cpu_s": {
                key: base_a["machine_cpu_s"][key] + base_b["machine_cpu_s"][key] for key in base_a["machine_cpu_s"]
            },
        }
        _log(
            f"{method}: no-checkpoint loop {out['no_ckpt']['loop_s']:.2f}s "
            f"({n_steps} steps, halves {base_a['loop_s']:.2f}s + {base_b['loop_s']:.2f}s)"
        )

        # Phase 3: one isolated checkpoint with no training running: time until durable.
        # Saves are no longer a first save (pools allocated, code paths warm), so this is the
        # steady-state figure to compare with the raw disk write of the same bytes, which is
        # also measured right after a cache drop.
        # Paired raw write of the same bytes, right before the isolated save and under the
        # same conditions (same process, same disk state): the "x raw" ratios use it, so a
        # disk or host that is faster or slower at this moment cancels out.
        gc.collect()
        prepare("raw")
        out["raw_paired"] = measure_disk_write(root.parent, out["state_bytes"])
        prepare("isolated")
        rss_before = rss_bytes()
        reset_hwm()
        t0 = time.perf_counter()
        p = saver.save(10_000)
        call_s = time.perf_counter() - t0
        durable_t = p.durable.result()
        saver.wait_all()
        out["isolated"] = {
            "call_s": call_s,
            "durable_s": durable_t - t0,
            "rss_before_bytes": rss_before,
            **saver.details(p),
        }
        out["hwm_ckpt_bytes"] = hwm_bytes()
        if isinstance(saver, TiercheckSaver):
            out["tiercheck_stats"] = saver.stats()
        t0 = time.perf_counter()
        saver.close()
        out["close_s"] = time.perf_counter() - t0
        gc.collect()
        out["rss_after_bytes"] = rss_bytes()
        _log(f"{method}: isolated save durable after {out['isolated']['durable_s']:.2f}s")
    except BaseException as exc:
        import traceback

        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
        dump()
        raise
    dump()


# --------------------------------------------------------------------------------------------
# Parent: orchestration, summary, table
# --------------------------------------------------------------------------------------------


def spawn_worker(method: str, args: argparse.Namespace, extra: Sequence[str], timeout: float) -> dict[str, Any]:
    """Run one worker subprocess; return its JSON plus wall time and foreign CPU load."""
    with tempfile.NamedTemporaryFile("r", suffix=".json", dir=args._scratch, delete=False) as tmp:
        out_path = Path(tmp.name)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--_worker",
        method,
        "--_worker-out",
        str(out_path),
        "--warmup",
        str(args.warmup),
        "--settle-max-s",
        str(args.settle_max_s),
        *(["--no-drop-caches"] if args.no_drop_caches else []),
        *extra,
    ]
    foreign = ForeignCpu()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=sys.stderr)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = -9
    wall = time.perf_counter() - t0
    load = foreign.stop()
    try:
        res: dict[str, Any] = json.loads(out_path.read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        res = {}
    out_path.unlink(missing_ok=True)
    res.setdefault("method", method)
    if rc != 0 and "error" not in res:
        res["error"] = f"worker exited with {rc}" + (" (timeout)" if rc == -9 else "")
    res["worker_wall_s"] = wall
    res["foreign_load"] = load
    return res


def summarize(res: dict[str, Any], n: int) -> dict[str, Any]:
    """Derive the reported metrics from one worker's raw measurements."""
    if "error" in res or "with_ckpt" not in res:
        return {}
    base, wc = res["no_ckpt"], res["with_ckpt"]
    stall = (wc["loop_s"] - base["loop_s"]) / n
    calls = [s["call_s"] for s in wc["saves"]]
    # Noise floor: the loop times are sums of N step times; if steps are independent with
    # the no-checkpoint loop's spread, the difference of two loops has sd sqrt(2N)*sd(step).
    steps = base["step_s"]
    sd = statistics.stdev(steps) if len(steps) > 1 else 0.0
    noise = math.sqrt(2 * len(steps)) * sd / n
    extra_step = (sum(wc["step_s"]) - sum(base["step_s"])) / n
    # Did the background work fit in the interval? Compare each save's in-loop durable time
    # with the time until the next save was due: its own save() call plus the k training
    # steps after it, as they actually ran (slowed or not).
    k = len(wc["step_s"]) // n
    intervals = [calls[i] + sum(wc["step_s"][i * k : (i + 1) * k]) for i in range(n)]
    durable_loop = [s["durable_s"] for s in wc["saves"]]
    peak_extra = None
    if res.get("hwm_reset_ok"):
        peak = max(res["hwm_loop_ckpt_bytes"], res["hwm_ckpt_bytes"])
        peak_extra = peak - res["hwm_no_ckpt_bytes"]
    return {
        "stall_s": stall,
        "stall_noise_s": noise,
        "save_call_s": statistics.mean(calls),
        # The untimed priming save (first save of the process: one-time costs included).
        "save_call_first_s": res["first_save"]["call_s"],
        "durable_first_s": res["first_save"]["durable_s"],
        "save_call_max_s": max(calls),
        "step_slowdown_s": extra_step,  # stall not spent inside save(): contention, lazy waits
        "final_wait_s": wc["final_wait_s"],
        "durable_isolated_s": res["isolated"]["durable_s"],
        "durable_in_loop_s": statistics.median(durable_loop),
        "interval_s": statistics.mean(intervals),
        "fits": all(d <= iv for d, iv in zip(durable_loop, intervals, strict=True)),
        "peak_extra_bytes": peak_extra,
        "retained_bytes": res["rss_after_bytes"] - res["rss_no_ckpt_bytes"],
        "step_no_ckpt_s": statistics.median(steps),
        "raw_paired_s": res["raw_paired"]["durable_s"],
        # Whole-machine CPU seconds (user+system) the checkpoint loop used beyond the loop
        # without checkpoints, per checkpoint: copies, checksums, the kernel's page-cache
        # copies and fsync work, plus any CPU the training itself lost to contention. On 2
        # cores this, more than anything, sets the "step slowdown".
        "cpu_per_ckpt_s": (_busy(wc["machine_cpu_s"]) - _busy(base["machine_cpu_s"])) / n,
        # Hypervisor steal during the timed loops: CPU our VM was owed but did not get.
        "steal_no_ckpt": steal_share(base["machine_cpu_s"]),
        "steal_ckpt": steal_share(wc["machine_cpu_s"]),
        "settle_s": sum(res.get("settle_s", {}).values()),
    }


def _busy(cpu: dict[str, float]) -> float:
    return cpu["user"] + cpu["system"]


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:{spec}}{suffix}"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    cfg = report["config"]
    lim = report["limits"]
    raw_s = report["raw_durable_s"]
    lines: list[str] = []
    lines.append(
        f"Machine: {m['cpu_count']} CPUs ({m['cpu_model']}), "
        f"{m['ram_bytes'] / GiB:.1f} GiB RAM, torch {m['torch']} ({m['torch_threads']} threads), "
        f"Python {m['python']}, tiercheck {m['tiercheck']}"
    )
    lines.append(f"Checkpoint dir: {cfg['dir']} on {m['checkpoint_fs']}")
    lines.append(
        f"State: {cfg['state_bytes'] / GiB:.2f} GiB in {cfg['n_tensors']} tensors "
        f"({cfg['param_bytes'] / GiB:.2f} GiB fp32 params + AdamW exp_avg/exp_avg_sq; "
        f"{cfg['n_blocks']} MLP blocks d={D_MODEL} + {VOCAB}x{D_MODEL} tied embedding)"
    )
    lines.append(
        f"Loop: checkpoint every k={cfg['k']} steps, n={cfg['n']} checkpoints, "
        f"{cfg['k'] * cfg['n']} steps per loop; step ~{cfg['step_s']:.2f}s "
        f"(k*step ~{cfg['k'] * cfg['step_s']:.1f}s vs raw durable write {raw_s:.1f}s); "
        f"{cfg['k_reason']}"
    )
    lines.append(
        f"Page cache dropped between phases: {cfg['drop_caches']}; peak-RSS via VmHWM reset: {cfg['hwm_reset_ok']}"
    )
    lines.append("")
    lines.append("Machine limits (measured in this run):")
    lines.append("")
    lines.append("| limit | value |")
    lines.append("|---|---|")
    for key, val in lim["memcpy"].items():
        lines.append(f"| memcpy {key.replace('_gib_s', '')} | {val:.2f} GiB/s |")
    for d in lim["disk"]:
        lines.append(
            f"| fsync'd seq. write (before methods, sets k) | {d['gib_s']:.2f} GiB/s "
            f"({d['bytes'] / GiB:.2f} GiB in {d['durable_s']:.2f}s) |"
        )
    paired = {m: s["raw_paired_s"] for m, s in report["summary"].items() if s}
    if paired:
        lines.append(
            f"| fsync'd seq. write (paired, in each method's process) | "
            f"{cfg['state_bytes'] / GiB / max(paired.values()):.2f} to "
            f"{cfg['state_bytes'] / GiB / min(paired.values()):.2f} GiB/s "
            f"({min(paired.values()):.2f} to {max(paired.values()):.2f}s) |"
        )
    lines.append("")
    lines.append(
        f"Reference: raw fsync'd write of the same bytes = {raw_s:.2f}s (median of the paired "
        "writes). Each method's 'x raw' uses its own paired write, done right before its isolated "
        f"save under the same conditions; ratios 'x dcpA' are against {REFERENCE}."
    )
    lines.append("")
    hdr = (
        "| method | stall/ckpt s (±noise) | x dcpA | x raw | in save() s (first) | "
        "step slowdown s | durable s | x raw | x dcpA | durable in loop s | final wait s | "
        "peak extra RSS GiB | x state | CPU s/ckpt | other CPU % | steal % no-ckpt/ckpt |"
    )
    lines.append(hdr)
    lines.append("|" + "---|" * (hdr.count("|") - 1))
    ref = report["summary"].get(REFERENCE, {})
    state = cfg["state_bytes"]
    for method in cfg["methods"]:
        s = report["summary"].get(method) or {}
        res = report["results"].get(method, {})
        load = res.get("foreign_load", {}).get("foreign_cpu_share")
        if not s:
            err = res.get("error", "not run")
            lines.append(f"| {method} | error: {err.splitlines()[0][:90]} |" + " |" * 14)
            continue
        pe = s["peak_extra_bytes"]
        lines.append(
            "| "
            + " | ".join(
                [
                    method,
                    f"{s['stall_s']:.2f} (±{s['stall_noise_s']:.2f})",
                    _fmt(_ratio(s["stall_s"], ref.get("stall_s"))),
                    _fmt(_ratio(s["stall_s"], s["raw_paired_s"])),
                    f"{s['save_call_s']:.2f} ({s['save_call_first_s']:.2f})",
                    _fmt(s["step_slowdown_s"]),
                    _fmt(s["durable_isolated_s"]),
                    _fmt(_ratio(s["durable_isolated_s"], s["raw_paired_s"])),
                    _fmt(_ratio(s["durable_isolated_s"], ref.get("durable_isolated_s"))),
                    _fmt(s["durable_in_loop_s"]) + ("" if s["fits"] else " (!)"),
                    _fmt(s["final_wait_s"]),
                    # Tiny negative values are measurement noise (allocator slack): show 0.
                    _fmt(None if pe is None else max(0, pe) / GiB),
                    _fmt(_ratio(None if pe is None else max(0, pe), state)),
                    _fmt(s["cpu_per_ckpt_s"], ".1f"),
                    _fmt(None if load is None else 100 * load, ".0f"),
                    f"{100 * s['steal_no_ckpt']:.0f}/{100 * s['steal_ckpt']:.0f}",
                ]
            )
            + " |"
        )
    lines.append(
        f"| raw write (same bytes) | - | - | - | - | - | {raw_s:.2f} | 1.00 | "
        f"{_fmt(_ratio(raw_s, ref.get('durable_isolated_s')))} | - | - | - | - | - | - | - |"
    )
    lines.append("")
    for method in TIERCHECK_METHODS:
        s = report["summary"].get(method)
        if not s or not ref:
            continue
        r_stall = _ratio(s["stall_s"], ref.get("stall_s"))
        r_dur = _ratio(s["durable_isolated_s"], s["raw_paired_s"])
        ok1 = r_stall is not None and r_stall <= 0.25
        ok2 = r_dur is not None and r_dur <= 1.3
        lines.append(
            f"Target {method}: stall x dcpA = {_fmt(r_stall)} (<= 0.25: "
            f"{'met' if ok1 else 'NOT met'}); durable x raw = {_fmt(r_dur)} (<= 1.3: "
            f"{'met' if ok2 else 'NOT met'})"
        )
    busy = [
        (meth, r["foreign_load"]["foreign_cpu_share"])
        for meth, r in report["results"].items()
        if r.get("foreign_load", {}).get("foreign_cpu_share", 0) > 0.05
    ]
    stolen = [
        (meth, s["steal_no_ckpt"], s["steal_ckpt"])
        for meth, s in report["summary"].items()
        if s and max(s["steal_no_ckpt"], s["steal_ckpt"]) > 0.05
    ]
    if stolen:
        lines.append(
            "NOTE: the hypervisor stole CPU during timed loops (no-ckpt/ckpt): "
            + ", ".join(f"{meth} {100 * a:.0f}%/{100 * b:.0f}%" for meth, a, b in stolen)
            + ". Steal during the checkpoint loop is caused partly by our own writes on this VM;"
            " steal during the no-checkpoint loop inflates the baseline and shrinks the stall."
        )
    if busy:
        lines.append(
            "WARNING: other processes used CPU while these methods ran (share of all CPUs): "
            + ", ".join(f"{meth} {100 * x:.0f}%" for meth, x in busy)
            + " - their timings are inflated; rerun on an idle machine."
        )
    lines.append(
        f"Run took {report['elapsed_s']:.0f}s. Stall = (loop with checkpoints - loop without) / n, "
        "± = noise floor from the spread of step times; 'in save()' = mean time the save call "
        "blocked in the loop (in brackets: the process's first save, with one-time costs, which "
        "is primed before the loop and not in the stall); 'step slowdown' = the rest of the stall (training steps slowed by "
        "background work or, in lazy mode, waiting in optimizer.step). The final wait for the "
        "last checkpoint is not in the stall. 'durable' = one isolated save, save() call to "
        "fsync'd+committed; 'durable in loop' = median over the loop's saves (training running); "
        "(!) = some save was not durable before the next one was due, so the stall includes "
        "waiting for it."
    )
    return "\n".join(lines)


def maybe_plot(report: dict[str, Any], path: Path) -> Path | None:
    """Bar plot of stall and durable time, only if matplotlib happens to be installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    methods = [m for m in report["config"]["methods"] if report["summary"].get(m)]
    if not methods:
        return None
    stall = [report["summary"][m]["stall_s"] for m in methods]
    durable = [report["summary"][m]["durable_isolated_s"] for m in methods]
    fig, ax = plt.subplots(figsize=(9, 4))
    xs = range(len(methods))
    ax.bar([x - 0.2 for x in xs], stall, width=0.4, label="stall per checkpoint (s)")
    ax.bar([x + 0.2 for x in xs], durable, width=0.4, label="time until durable (s)")
    ax.axhline(report["raw_durable_s"], color="k", ls="--", lw=1, label="raw fsync'd write")
    ax.set_xticks(list(xs), methods, rotation=15)
    ax.legend()
    ax.set_title(f"Checkpoint of {report['config']['state_bytes'] / GiB:.2f} GiB")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


@contextlib.contextmanager
def bench_dir(requested: str | None, keep: bool) -> Iterator[Path]:
    if requested:
        base = Path(requested).resolve()
        base.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix="save_bench-", dir=base))
    else:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix="ckpt-", dir=RESULTS_DIR))
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


def choose_k(step_s: float | None, est_durable_s: float, args: argparse.Namespace) -> tuple[int, str]:
    if args.k:
        return args.k, "k set by --k"
    if step_s is None:
        # --quick skips calibration; its ~0.4 s steps x 5 leave ~2x the raw write time.
        return QUICK_K, f"k fixed at {QUICK_K} for --quick"
    # The background write must have room to finish before the next save, else every
    # async method degenerates into "wait for the previous checkpoint" and the comparison
    # measures the disk, not the overlap. The writer shares 2 cores and the memory bus with
    # training, so it runs slower than the raw write: give it --headroom times the raw time.
    want = math.ceil(args.headroom * est_durable_s / max(step_s, 1e-3))
    k = min(max(2, want), args.max_k)
    why = f"k = ceil({args.headroom} x raw write / calibrated step {step_s:.2f}s)"
    if k != want:
        why += f", clamped to [2, {args.max_k}] from {want}"
    return k, why


def parent_main(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    size = 0.25 if args.quick else args.size_gib
    n = args.n or (2 if args.quick else 3)
    methods = list(args.methods) if args.methods else list(METHODS)
    for mth in methods:
        if mth not in METHODS:
            print(f"unknown method {mth!r}; choose from {', '.join(METHODS)}", file=sys.stderr)
            return 2
    n_blocks = model_shape(size)
    json_path = Path(args.json) if args.json else RESULTS_DIR / "save_bench.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)

    with bench_dir(args.dir, args.keep) as root:
        args._scratch = str(root)
        machine = machine_info(root)
        _log(f"checkpoint dir {root}; {n_blocks} blocks (~{size} GiB fp32 params)")

        state_bytes, n_tensors = expected_state(n_blocks)
        results: dict[str, Any] = {}

        # Machine limits: memcpy, then the fsync'd write of exactly the checkpoint's bytes.
        limits: dict[str, Any] = {
            "memcpy": measure_memcpy((256 if args.quick else 1024) * MiB),
            "disk": [],
        }
        gc.collect()  # the parent's copy buffers are freed before any worker starts
        drop_page_cache(not args.no_drop_caches)
        settle(args.settle_max_s)
        limits["disk"].append(measure_disk_write(root, state_bytes))
        est_durable = limits["disk"][0]["durable_s"]

        # The checkpoint interval k. A calibration worker measures the step time; skipped
        # when k is fixed (--k, or --quick, where it costs more than the steps it would save).
        calib_step_s: float | None = None
        if not args.k and not args.quick:
            calib = spawn_worker(
                "calibrate",
                args,
                ["--_blocks", str(n_blocks), "--_calib-steps", str(args.calib_steps)],
                timeout=600,
            )
            results["calibrate"] = calib
            if "error" in calib:
                print(f"calibration failed: {calib['error']}", file=sys.stderr)
                print(calib.get("traceback", ""), file=sys.stderr)
                return 1
            # The fastest step: on a shared machine the slow ones measure the other load,
            # and a k computed from them would be too small once the machine is quiet.
            calib_step_s = min(calib["step_s"])
        k, k_reason = choose_k(calib_step_s, est_durable, args)
        _log(
            f"state {state_bytes / GiB:.2f} GiB; memcpy "
            + ", ".join(f"{key} {v:.1f} GiB/s" for key, v in limits["memcpy"].items())
            + f"; disk {limits['disk'][0]['gib_s']:.2f} GiB/s; "
            + (f"step {calib_step_s:.2f}s; " if calib_step_s else "")
            + f"k={k} n={n}"
        )

        for method in methods:
            wdir = root / method
            # Every method starts from the same cold page cache (costs the worker ~1 s of
            # colder torch import, outside every timed phase).
            drop_page_cache(not args.no_drop_caches)
            _log(f"running {method}")
            res = spawn_worker(
                method,
                args,
                [
                    "--_blocks",
                    str(n_blocks),
                    "--_k",
                    str(k),
                    "--_n",
                    str(n),
                    "--_worker-dir",
                    str(wdir),
                ],
                timeout=args.worker_timeout,
            )
            if "error" in res:
                _log(f"{method} FAILED: {res['error']}")
                if res.get("traceback"):
                    print(res["traceback"], file=sys.stderr)
            results[method] = res
            # Free the disk (and the dirty-page backlog) before the next method.
            shutil.rmtree(wdir, ignore_errors=True)
            os.sync()

        summary = {m: summarize(results[m], n) for m in methods}
        # The reference raw write: the median of the per-method paired writes (the parent's
        # own write, before any method, only sets k).
        paired = [summary[m]["raw_paired_s"] for m in methods if summary[m]]
        raw_durable = statistics.median(paired) if paired else limits["disk"][0]["durable_s"]
        for m in methods:  # the analytic size must be what the workers actually hold
            got = results[m].get("state_bytes")
            if got is not None and got != state_bytes:
                _log(f"WARNING: {m} holds {got} state bytes, expected {state_bytes}")
        loop_steps = [t for m in methods if summary[m] for t in results[m]["no_ckpt"]["step_s"]]
        step_s = statistics.median(loop_steps) if loop_steps else float("nan")
        report: dict[str, Any] = {
            "machine": machine,
            "config": {
                "size_gib": size,
                "quick": args.quick,
                "methods": methods,
                "n_blocks": n_blocks,
                "param_bytes": _param_bytes(n_blocks),
                "state_bytes": state_bytes,
                "n_tensors": n_tensors,
                "k": k,
                "k_reason": k_reason,
                "n": n,
                "step_s": step_s,  # median no-checkpoint step over all methods
                "calibration_step_s": calib_step_s,
                "warmup_steps": args.warmup,
                "dir": str(root),
                "drop_caches": drop_page_cache(not args.no_drop_caches),
                "hwm_reset_ok": all(results[m].get("hwm_reset_ok", False) for m in methods if summary[m]),
            },
            "limits": limits,
            "raw_durable_s": raw_durable,
            "summary": summary,
            "results": results,
        }
        report["elapsed_s"] = time.perf_counter() - t_start
        table = render(report)
        report["table"] = table
        json_path.write_text(json.dumps(report, indent=1, default=str))
        png = maybe_plot(report, json_path.with_suffix(".png"))
        print(table)
        print(f"\nJSON: {json_path}" + (f"  plot: {png}" if png else ""), file=sys.stderr)
    failed = [m for m in methods if not summary.get(m)]
    return 1 if failed else 0


def _param_bytes(n_blocks: int) -> int:
    block_params = 2 * D_MODEL * 4 * D_MODEL + 4 * D_MODEL + D_MODEL + 2 * D_MODEL
    return 4 * (n_blocks * block_params + VOCAB * D_MODEL + 2 * D_MODEL)


def expected_state(n_blocks: int) -> tuple[int, int]:
    """(bytes, tensors) of model.state_dict() + AdamW state, without building the model.

    AdamW keeps exp_avg and exp_avg_sq (same shape as the parameter) and a float32 scalar
    ``step`` tensor per parameter; the model has no buffers.
    """
    n_params = 1 + 6 * n_blocks + 2
    return 3 * _param_bytes(n_blocks) + 4 * n_params, 4 * n_params


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--size-gib",
        type=float,
        default=2.0,
        help="fp32 parameter bytes (GiB); the checkpointed state is ~3x this (AdamW moments). Default 2.",
    )
    p.add_argument("--quick", action="store_true", help="~0.25 GiB params, n=2: smoke run")
    p.add_argument("--methods", nargs="+", metavar="M", help=f"subset of: {' '.join(METHODS)}")
    p.add_argument("--dir", help="parent directory for checkpoints (default: bench/results/)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint directory")
    p.add_argument("--json", help="JSON output path (default bench/results/save_bench.json)")
    p.add_argument("--k", type=int, default=0, help="steps between checkpoints (default: auto)")
    p.add_argument("--n", type=int, default=0, help="checkpoints per loop (default 3; quick 2)")
    p.add_argument(
        "--headroom",
        type=float,
        default=1.5,
        help="auto k: k*step >= headroom * raw write time (default 1.5)",
    )
    p.add_argument("--max-k", type=int, default=5, help="upper bound for auto k (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after building (default 2)")
    p.add_argument("--calib-steps", type=int, default=4, help="timed steps for calibration")
    p.add_argument("--worker-timeout", type=float, default=900, help="seconds per method")
    p.add_argument(
        "--settle-max-s",
        type=float,
        default=10.0,
        help="before each timed phase wait up to this long for hypervisor steal < 5%% (default 10)",
    )
    p.add_argument(
        "--no-drop-caches",
        action="store_true",
        help="do not drop the page cache between phases (it needs root anyway)",
    )
    p.add_argument("--from-json", metavar="PATH", help="only re-print the table from a saved JSON")
    # Internal: worker mode.
    p.add_argument("--_worker", help=argparse.SUPPRESS)
    p.add_argument("--_worker-out", help=argparse.SUPPRESS)
    p.add_argument("--_worker-dir", help=argparse.SUPPRESS)
    p.add_argument("--_blocks", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_k", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_calib-steps", type=int, default=3, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def rerender(path: Path) -> int:
    """Recompute the summary and print the table from a saved JSON (no benchmark run)."""
    report = json.loads(path.read_text())
    n = report["config"]["n"]
    report["summary"] = {m: summarize(report["results"].get(m, {}), n) for m in report["config"]["methods"]}
    print(render(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        return rerender(Path(args.from_json))
    if args._worker:
        worker_main(args)
        return 0
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
