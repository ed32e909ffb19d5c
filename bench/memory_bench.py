#!/usr/bin/env python
"""Memory tier benchmark (issue 52): a checkpoint every step into memory that outlives the process, and a
restart after SIGKILL from it, against the node-local directory and DCP, in one run. bench/README.md
("Memory tier benchmark") has the details.

    .venv/bin/python bench/memory_bench.py            # 1.5 GiB of training state (MLP + AdamW), CPU
    .venv/bin/python bench/memory_bench.py --quick    # ~0.05 GiB: a smoke run of every phase

Phases, each method in a fresh process (``harness.run_worker``):

(a) save every step: ``--steps`` training steps with a save before each, against the same steps without (half
    before, half after): tiercheck with the memory tier (``MemoryOptions(persist_every=10**9)``: memory only),
    tiercheck's plain lazy save to the local directory, ``dcp.async_save`` (a new save waits for the previous
    one), torch_checkpointing where it is importable. Also the memory the tier holds against the shard bytes.
(b) restart after SIGKILL: a process saves one step (memory tier with ``persist_every=1``: in memory and in the
    local directory; ``dcp.save`` beside it), then SIGKILLs itself; fresh processes then restore it from
    memory (its local copy removed first: a step in memory only, as a crash between persists leaves it, which
    the restart persists beside training), from the local directory cold (the copy that persist made), and
    with ``dcp.load`` cold. Cold: the page cache dropped where
    allowed (``/proc/sys/vm/drop_caches``), else ``posix_fadvise(DONTNEED)`` on the files, and the table says
    which. Then a restart from a peer's memory (``memory_peer.py``): two ranks on two simulated nodes, one
    node's tmpfs emptied, every byte it restores read from the other node's memory and sent over loopback.
    Limits in the same run: memcpy + CRC32C of the same bytes (on one thread, and on the restore's 4 reader
    threads), the cold sequential read of the step, loopback TCP and gloo send/recv.

Memory tiers live in a private directory under ``--shm`` (default /dev/shm), removed at the end, on failure too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import harness as h
from limits import copy_crc_on
from memory_peer import peer_rows, peer_summary

GiB, MiB = h.GiB, h.MiB
SAVE_METHODS = ("tiercheck.memory", "tiercheck.lazy", "dcp.async_save", "torch_checkpointing")
RESTORES = ("memory", "local", "dcp.load")
NEVER = 10**9  # persist_every: no save of the loop goes to the local directory
READERS = 4  # the threads a restore reads on (WriteOptions.io_threads, its default): the limit's threads too


# ------------------------------------------------------------------------------------------
# Workers (fresh processes)
# ------------------------------------------------------------------------------------------


def build(gib: float) -> tuple[Any, Any]:
    """dcp_bench's MLP of ``gib`` GiB of fp32 state with AdamW (weights + 2 moments), after one step."""
    import torch
    from dcp_bench import build as mlp_with_adamw

    torch.set_num_threads(1)  # bit-identical steps in every process
    model, opt = mlp_with_adamw(gib)
    train_step(model, opt, 0)  # the moments exist from here on
    return model, opt


def train_step(model: Any, opt: Any, step: int) -> float:
    """dcp_bench's training step (its own batch per step), timed."""
    from dcp_bench import train_step as step_once

    return float(step_once(model, opt, step))


def leaves(model: Any, opt: Any) -> list[Any]:
    import torch

    out: list[Any] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(obj[k])
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v)

    walk([model.state_dict(), opt.state_dict()])
    return out


def digest(model: Any, opt: Any) -> list[int]:
    """CRC32C of every tensor of the state, in a fixed order: equal lists, bit-identical states."""
    import torch

    from tiercheck.format.codec import checksum

    return [checksum(t.detach().contiguous().view(-1).view(torch.uint8).numpy().data) for t in leaves(model, opt)]


def save_loop(method: str, gib: float, steps: int, root: str, shm: str) -> dict[str, Any]:
    """Phase (a): ``steps`` training steps with a save before each, between halves of steps without."""
    model, opt = build(gib)
    nbytes = sum(t.numel() * t.element_size() for t in leaves(model, opt))
    base = [train_step(model, opt, s) for s in range(1, 1 + max(2, steps // 2))]
    saver = Saver(method, model, opt, Path(root) / method, shm)
    first, _ = h.timed(lambda: saver.save(100, wait=True))  # one-time costs: pools, plans, threads
    blocked: list[float] = []
    t0 = time.perf_counter()
    for s in range(101, 101 + steps):
        train_step(model, opt, s)
        t1 = time.perf_counter()
        saver.save(s, wait=False)
        blocked.append(time.perf_counter() - t1)
    loop_s = time.perf_counter() - t0
    final_wait, _ = h.timed(saver.wait)
    held = saver.held()
    close_s, _ = h.timed(saver.close)
    base += [train_step(model, opt, s) for s in range(1000, 1000 + max(2, steps - steps // 2))]
    step_s = statistics.median(base)
    return {
        "method": method, "state_bytes": nbytes, "steps": steps, "step_s": step_s, "first_save_s": first,
        "loop_s": loop_s, "with_save_step_s": loop_s / steps, "added_per_step_s": loop_s / steps - step_s,
        "save_blocks_s": statistics.median(blocked), "final_wait_s": final_wait, "close_s": close_s,
        "memory_held_bytes": held,
    }  # fmt: skip


class Saver:
    """One way of saving every step, behind one interface for ``save_loop``."""

    def __init__(self, method: str, model: Any, opt: Any, directory: Path, shm: str) -> None:
        self.method, self.directory = method, directory
        self.pending: Any = None  # the newest save's handle (tiercheck) or future (DCP)
        directory.mkdir(parents=True)
        if method.startswith("tiercheck."):
            from tiercheck import Checkpointer, MemoryOptions, RetentionOptions, StagingOptions

            memory = MemoryOptions(path=shm, persist_every=NEVER) if method == "tiercheck.memory" else None
            self.ck = Checkpointer({"model": model, "optim": opt}, local=directory, memory=memory,
                                   staging=StagingOptions(mode="lazy"), retention=RetentionOptions(keep_last=1))  # fmt: skip
        elif method == "dcp.async_save":
            h.init_one_rank()
            self.state = h.dcp_state(model, opt)
        else:
            raise NotImplementedError(method)

    def save(self, step: int, *, wait: bool) -> None:
        if self.method.startswith("tiercheck."):
            self.pending = self.ck.save(step)
        else:
            import torch.distributed.checkpoint as dcp

            self.wait()  # as torchtitan does: one save in flight
            for old in self.directory.iterdir():
                shutil.rmtree(old)
            self.pending = dcp.async_save(self.state, checkpoint_id=str(self.directory / f"step-{step}"))
        if wait:
            self.wait()

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.wait() if self.method.startswith("tiercheck.") else self.pending.result()

    def held(self) -> int:
        return int(self.ck.stats()["memory_held_bytes"]) if self.method.startswith("tiercheck.") else 0

    def close(self) -> None:
        self.wait()
        if self.method.startswith("tiercheck."):
            self.ck.close()  # the memory tier's close persists its newest step: timed apart


def save_then_kill(gib: float, local: str, shm: str, dcp_dir: str, out: str) -> dict[str, Any]:
    """Phase (b)'s first process: one step in memory, in the local directory and in DCP, then SIGKILL."""
    from tiercheck import Checkpointer, MemoryOptions

    model, opt = build(gib)
    ck = Checkpointer({"model": model, "optim": opt}, local=local, memory=MemoryOptions(path=shm, persist_every=1))
    handle = ck.save(1)
    handle.wait()
    assert handle.persisted.result() is True
    h.init_one_rank()
    import torch.distributed.checkpoint as dcp

    dcp.save(h.dcp_state(model, opt), checkpoint_id=dcp_dir)
    h.fsync_tree(dcp_dir)
    h.write_json(out, {"digest": digest(model, opt), "state_bytes": sum(t.numel() * t.element_size()
                                                                         for t in leaves(model, opt))})  # fmt: skip
    os.kill(os.getpid(), signal.SIGKILL)  # as a crash: no close, no flush, the memory tier stays
    raise AssertionError("unreachable")


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(str(record.msg))


def restore_from(kind: str, gib: float, local: str, shm: str, dcp_dir: str, drop: bool) -> dict[str, Any]:
    """Phase (b): a fresh process restores the killed one's step; the time of the restore alone (the
    Checkpointer's start included), with the tier it came from and a digest of what it restored."""
    import torch

    model, opt = build(gib)
    for t in leaves(model, opt):
        t.zero_()
    said = _Said()
    logging.getLogger("tiercheck").addHandler(said)
    logging.getLogger("tiercheck").setLevel(logging.INFO)
    if kind == "memory":  # in memory only: the restart persists it (in the background), as after most crashes
        shutil.rmtree(Path(local) / "step-00000001")
    cache = h.drop_caches(drop and kind != "memory", [local if kind == "local" else dcp_dir])
    step: int | None
    if kind == "dcp.load":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        h.init_one_rank()
        state = h.dcp_state(model, opt)
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=dcp_dir)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        s, step, tier = time.perf_counter() - t0, 1, "dcp"
    else:
        from tiercheck import Checkpointer, MemoryOptions

        memory = MemoryOptions(path=shm, persist_every=1) if kind == "memory" else None
        t0 = time.perf_counter()
        ck = Checkpointer({"model": model, "optim": opt}, local=local, memory=memory)
        step = ck.restore()
        s = time.perf_counter() - t0
        tier = "memory" if any(m.startswith("restored step %d from memory") for m in said.messages) else "local"
        close_s, _ = h.timed(ck.close)  # waits for the persist of a step restored from memory
        stats = ck.stats()
    with torch.no_grad():
        dig = digest(model, opt)
    out = {"kind": kind, "s": s, "step": step, "tier": tier, "digest": dig, "cache": cache}
    if kind == "dcp.load":
        return out
    persisted = {k: stats.get(k) for k in ("memory_persist", "memory_persisted_step", "restore_persist_s")}
    return out | {"restore_bytes_read": stats["restore_bytes_read"], "close_s": close_s} | persisted


def limits(nbytes: int, files: list[str], drop: bool, repeats: int, threads: int) -> dict[str, Any]:
    """memcpy + CRC32C of ``nbytes``: on one thread, into a reused and into a fresh buffer, and on
    ``threads`` threads (the restore's readers, each a part: a copy, then its CRC32C) into a reused
    buffer; and the cold read."""
    import torch

    from tiercheck.format.codec import checksum

    torch.set_num_threads(1)  # one thread a copy: the threads below are the parallelism
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    out: dict[str, Any] = {"bytes": nbytes}
    for name, target in (("reused", lambda: dst), ("fresh", lambda: torch.empty_like(src))):
        best = {"memcpy_s": float("inf"), "crc_s": float("inf")}
        for _ in range(repeats):
            into = target()
            t0 = time.perf_counter()
            into.copy_(src)
            t1 = time.perf_counter()
            checksum(into.numpy().data)
            copy_s, crc_s = t1 - t0, time.perf_counter() - t1
            best = {"memcpy_s": min(best["memcpy_s"], copy_s), "crc_s": min(best["crc_s"], crc_s)}
        out[name] = best | {"s": best["memcpy_s"] + best["crc_s"]}
    out["threads"] = {"threads": threads, "s": min(copy_crc_on(threads, src, dst, checksum) for _ in range(repeats))}
    out["cold_read"] = h.measure_cold_read(files, drop=drop)
    return out


# ------------------------------------------------------------------------------------------
# The parent: phases, table, JSON
# ------------------------------------------------------------------------------------------


def importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def run(args: argparse.Namespace, root: Path, shm: Path) -> dict[str, Any]:
    me = Path(__file__)
    rep: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "func"}, "shm_dir": str(shm)}
    drop = not args.no_drop_caches
    restarts: list[dict[str, Any]] = []
    for r in range(args.repeats):
        local, dcp_dir, mem, out = root / f"r{r}-local", root / f"r{r}-dcp", shm / f"r{r}", root / f"r{r}.json"
        kw = {"gib": args.gib, "local": str(local), "shm": str(mem), "dcp_dir": str(dcp_dir)}
        h.log(f"restart round {r}: save one step, then SIGKILL")
        killed = h.run_worker(me, "save_then_kill", kw | {"out": str(out)}, timeout=args.worker_timeout)
        if killed.get("error") != f"worker exited with {-signal.SIGKILL}" or not out.exists():  # a timeout kills too
            raise RuntimeError(f"the saving process was not killed as planned: {killed}")
        saved = json.loads(out.read_text())
        rnd: dict[str, Any] = {"state_bytes": saved["state_bytes"]}
        for kind in RESTORES:
            got = h.run_worker(me, "restore_from", kw | {"kind": kind, "drop": drop}, timeout=args.worker_timeout)
            if "error" in got:
                raise RuntimeError(f"restore from {kind} failed: {got['error']}\n{got.get('traceback', '')}")
            got["bit_identical"] = got.pop("digest") == saved["digest"]
            rnd[kind] = got
            h.log(f"  {kind}: {got['s']:.3f}s from {got['tier']}, bit-identical {got['bit_identical']}")
        restarts.append(rnd)
        shutil.rmtree(mem, ignore_errors=True)  # its slots: RAM
    h.log("restart from a peer's memory: two ranks, two nodes, one node's tmpfs gone")
    rep["peer"] = h.run_worker(h.BENCH_DIR / "memory_peer.py", "peer_restart", {"gib": args.gib, "local": str(root / "peer"), "shm": str(shm / "peer"),
                                                    "timeout": args.worker_timeout}, timeout=args.worker_timeout)  # fmt: skip
    if "error" in rep["peer"]:
        raise RuntimeError(f"restart from a peer's memory failed: {rep['peer']['error']}\n{rep['peer'].get('traceback', '')}")
    for f in rep["peer"]["failures"]:
        h.log(f"  peer memory, attempt {f['attempt']}: restored steps {f['steps']}: {f['said']}")
    files = [str(p) for p in sorted((root / f"r{args.repeats - 1}-local").rglob("step-*/**/*")) if p.is_file()]
    rep["limits"] = h.run_worker(me, "limits", {"nbytes": restarts[0]["state_bytes"], "files": files, "drop": drop,
                                                "repeats": 3, "threads": READERS}, timeout=args.worker_timeout)  # fmt: skip
    rep["restarts"] = restarts
    rep["saves"] = {}
    for method in SAVE_METHODS:
        if method == "torch_checkpointing" and not importable("torch_checkpointing"):
            rep["saves"][method] = {"skipped": "torch_checkpointing is not installed"}
            continue
        h.log(f"save every step: {method}")
        kw = {"method": method, "gib": args.gib, "steps": args.steps, "root": str(root), "shm": str(shm / "loop")}
        rep["saves"][method] = h.run_worker(me, "save_loop", kw, timeout=args.worker_timeout)
        shutil.rmtree(shm / "loop", ignore_errors=True)
        if "error" in rep["saves"][method]:
            raise RuntimeError(f"{method}: {rep['saves'][method]['error']}\n{rep['saves'][method].get('traceback')}")
    rep["summary"] = summarise(rep)
    return rep


def summarise(rep: dict[str, Any]) -> dict[str, Any]:
    """The issue's target ratios, each from this run's numbers (medians over the restart rounds)."""
    med = {k: statistics.median(r[k]["s"] for r in rep["restarts"]) for k in RESTORES}
    lim, saves = rep["limits"], rep["saves"]
    added = {m: s["added_per_step_s"] for m, s in saves.items() if "added_per_step_s" in s}
    mem = saves["tiercheck.memory"]
    return {
        "restore_s": med,
        "memory_vs_memcpy_crc": h.ratio(med["memory"], lim["reused"]["s"]),
        # the restore reads on READERS threads: against the same bytes copied and checked on as many
        "memory_vs_memcpy_crc_threads": h.ratio(med["memory"], lim["threads"]["s"]) if "threads" in lim else None,
        # a restore from memory reads into new buffers (it overwrites nothing before every chunk is
        # verified): the limit of that is the copy into fresh memory, its pages faulted on first touch
        "memory_vs_memcpy_crc_fresh": h.ratio(med["memory"], lim["fresh"]["s"]),
        "local_cold_vs_memory": h.ratio(med["local"], med["memory"]),
        "memory_vs_local_cold": h.ratio(med["memory"], med["local"]),
        "memory_persist_s": statistics.median(r["memory"].get("restore_persist_s") or 0.0 for r in rep["restarts"]),
        "all_persisted": all(r["memory"].get("memory_persist") == "done" for r in rep["restarts"]),
        "dcp_load_vs_memory": h.ratio(med["dcp.load"], med["memory"]),
        "added_memory_vs_lazy": h.ratio(added.get("tiercheck.memory"), added.get("tiercheck.lazy"))
        if added.get("tiercheck.lazy", 0) > 0 else None,
        "added_memory_vs_dcp_async": h.ratio(added.get("tiercheck.memory"), added.get("dcp.async_save"))
        if added.get("dcp.async_save", 0) > 0 else None,
        "memory_held_vs_shard": h.ratio(mem["memory_held_bytes"], mem["state_bytes"]),
        **peer_summary(rep.get("peer")),
        "all_from_memory": all(r["memory"]["tier"] == "memory" for r in rep["restarts"]),
        "all_bit_identical": all(r[k]["bit_identical"] for r in rep["restarts"] for k in RESTORES),
    }  # fmt: skip


def render(rep: dict[str, Any]) -> str:
    s, lim, gib = rep["summary"], rep["limits"], rep["restarts"][0]["state_bytes"] / GiB
    caches = {r[k]["cache"] for r in rep["restarts"] for k in ("local", "dcp.load")} | {lim["cold_read"]["cache"]}
    cold = {"drop_caches": "page cache dropped (/proc/sys/vm/drop_caches)",
            "fadvise": "/proc/sys/vm/drop_caches not writable here: posix_fadvise(DONTNEED) on the files only",
            "": "page cache NOT dropped (--no-drop-caches)"}  # fmt: skip
    lines = [h.machine_line(rep["machine"]), f"State: MLP + AdamW, {gib:.2f} GiB of fp32 tensors, one rank, CPU.", ""]
    lines += ["(a) a save every step", ""]
    rows = []
    for m, r in rep["saves"].items():
        if "skipped" in r:
            rows.append([m, "-", "-", "-", "-", "-", r["skipped"]])
            continue
        rows.append([m, h.fmt(r["step_s"], ".3f"), h.fmt(r["with_save_step_s"], ".3f"), h.fmt(r["added_per_step_s"], ".3f"),
                     h.fmt(r["save_blocks_s"], ".4f"), h.fmt(r["final_wait_s"], ".3f"), h.fmt(r["close_s"], ".3f")])  # fmt: skip
    lines += [h.table(["method", "step alone (s)", "step + save (s)", "added per step (s)", "save() blocks (s)",
                       "final wait (s)", "close (s)"], rows), ""]  # fmt: skip
    lines += ["(b) restart after SIGKILL (fresh process; the restore alone, Checkpointer start included)", ""]
    rows = [[k, h.fmt(v, ".3f"), h.fmt(gib / v if v else None, ".2f"),
             ", ".join(sorted({r[k]["tier"] for r in rep["restarts"]})),
             all(r[k]["bit_identical"] for r in rep["restarts"])] for k, v in s["restore_s"].items()]  # fmt: skip
    peer_row, limit_rows = peer_rows(s, rep.get("peer") or {})
    rows.insert(1, peer_row)
    if not importable("torch_checkpointing"):
        rows.append(["torch_checkpointing", "-", "-", "not installed", "-"])
    rows.append(["limit: memcpy + CRC32C, 1 thread, reused buffer", h.fmt(lim["reused"]["s"], ".3f"),
                 h.fmt(gib / lim["reused"]["s"], ".2f"), "-", "-"])  # fmt: skip
    if "threads" in lim:
        k = lim["threads"]["threads"]
        rows.append([f"limit: memcpy + CRC32C, {k} threads (the restore's readers), reused buffer",
                     h.fmt(lim["threads"]["s"], ".3f"), h.fmt(gib / lim["threads"]["s"], ".2f"), "-", "-"])  # fmt: skip
    rows.append(["limit: memcpy + CRC32C, 1 thread, fresh memory", h.fmt(lim["fresh"]["s"], ".3f"),
                 h.fmt(gib / lim["fresh"]["s"], ".2f"), "-", "-"])  # fmt: skip
    rows.append(["limit: cold sequential read of the step", h.fmt(lim["cold_read"]["s"], ".3f"),
                 h.fmt(lim["cold_read"]["gib_s"], ".2f"), "-", "-"])  # fmt: skip
    rows += limit_rows
    lines += [h.table(["restore", "s", "GiB/s", "from tier", "bit-identical"], rows), ""]
    lines += [f"Cold reads: {'; '.join(cold.get(c, c) for c in sorted(caches))}.", ""]
    mem = rep["saves"]["tiercheck.memory"]
    threads, cpus = lim.get("threads", {}).get("threads", "-"), rep.get("machine", {}).get("cpu_count", "-")
    lines += [
        "(c) targets (issue 52), this run's numbers:",
        f"- restart from own memory / (memcpy + CRC32C, 1 thread): {h.fmt(s['memory_vs_memcpy_crc'])}x (target <= 1.25x); "
        f"/ (memcpy + CRC32C on the restore's {threads} reader threads, {cpus} CPUs): "
        f"{h.fmt(s.get('memory_vs_memcpy_crc_threads'))}x; / (memcpy into fresh memory + CRC32C, 1 thread): "
        f"{h.fmt(s['memory_vs_memcpy_crc_fresh'])}x. The restore's time includes the Checkpointer's start and the "
        "restore's agreement and plan; it reads the tmpfs into the live tensors and folds each chunk's CRC32C "
        "piece by piece as it lands (in the CPU's cache), where the limit copies, then checks",
        f"- restart from memory / cold local restart (both Checkpointer() + restore(), the step in memory only, "
        f"persisted beside training in {h.fmt(s.get('memory_persist_s'), '.3f')} s after restore() returned: "
        f"all persisted {s.get('all_persisted')}): {h.fmt(s.get('memory_vs_local_cold'))}x (target <= 0.5x, issue 64)",
        f"- cold local restore / restart from memory: {h.fmt(s['local_cold_vs_memory'])}x (target >= 5x); "
        f"dcp.load / memory: {h.fmt(s['dcp_load_vs_memory'])}x",
        f"- added per step, memory tier / plain lazy save: {h.fmt(s['added_memory_vs_lazy'])}x (target <= 1.05x); "
        f"/ dcp.async_save: {h.fmt(s['added_memory_vs_dcp_async'])}x",
        f"- restart from a peer's memory (attempts that failed: {s.get('peer_failures', '-')}) "
        f"{h.fmt(s.get('peer_gib_s'))} GiB/s / loopback TCP: "
        f"{h.fmt(s.get('peer_vs_tcp_loopback'))}x (target >= 0.8x); / gloo send/recv: {h.fmt(s.get('peer_vs_gloo'))}x",
        f"- memory held {h.fmt_bytes(mem['memory_held_bytes'])} / shard {h.fmt_bytes(mem['state_bytes'])}: "
        f"{h.fmt(s['memory_held_vs_shard'])}x (target <= 2x, no replicas)",
    ]
    loads = [("limits", lim.get("foreign_load"))] + [(f"save {m}", r.get("foreign_load")) for m, r in rep["saves"].items()]
    loads += [(f"restore {k} (round {i})", r[k].get("foreign_load")) for i, r in enumerate(rep["restarts"]) for k in RESTORES]
    warnings = [w for label, load in loads for w in h.noise_warnings(label, load)]
    restores = {k: [r[k]["s"] for r in rep["restarts"]] for k in RESTORES}
    warnings += [w for k, xs in restores.items() for w in h.noise_warnings(f"restore {k}", None, xs)]
    return "\n".join(lines + (["", *warnings] if warnings else []))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    h.common_args(p, settle_s=0.0)
    p.add_argument("--gib", type=float, default=None, help="training state GiB (default 1.5, --quick 0.05)")
    p.add_argument("--steps", type=int, default=None, help="steps with a save each, per method (default 8, quick 3)")
    p.add_argument("--repeats", type=int, default=None, help="kill-and-restart rounds (default 2, quick 1)")
    p.add_argument("--shm", default="/dev/shm", help="the tmpfs under which the private memory directory is made")
    p.add_argument("--worker-timeout", type=float, default=1800)
    p.add_argument("--from-json", metavar="PATH", help="no run: recompute the summary and the tables of a run's JSON")
    args = p.parse_args(argv)
    args.gib = args.gib or (0.05 if args.quick else 1.5)
    args.steps = args.steps or (3 if args.quick else 8)
    args.repeats = args.repeats or (1 if args.quick else 2)
    default = h.RESULTS_DIR / ("memory_bench-quick.json" if args.quick else "memory_bench.json")
    args.json = args.json or str(default)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        rep = json.loads(Path(args.from_json).read_text())
        rep["summary"] = summarise(rep)
        rep["table"] = render(rep)
        print(rep["table"], flush=True)
        h.write_json(args.from_json, rep)
        return 0
    t0 = time.perf_counter()
    with h.scratch_dir(args.dir or tempfile.gettempdir(), "memory_bench-", args.keep) as root:
        shm = Path(tempfile.mkdtemp(prefix="tiercheck-bench-", dir=args.shm))
        try:
            rep = run(args, root, shm)
        finally:
            shutil.rmtree(shm, ignore_errors=True)  # the memory tiers: RAM until removed
        rep["machine"] = h.machine_info(root)
    rep["wall_s"] = time.perf_counter() - t0
    rep["table"] = render(rep)
    print(rep["table"], flush=True)
    h.log(f"wrote {h.write_json(args.json, rep)} in {rep['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
