#!/usr/bin/env python
"""Remote-tier benchmark: tiercheck's drain and remote restore against the plain fsspec client.

Usage::

    .venv/bin/python bench/remote_bench.py            # 512 MiB of fp32 tensors, 2 rounds (~6 min here)
    .venv/bin/python bench/remote_bench.py --quick    # 128 MiB, one round (~2 min)
    .venv/bin/python bench/remote_bench.py --size-mib 256 --remotes s3 file

For each remote (S3 through SeaweedFS, Azure Blob through Azurite, both real servers started on
loopback from ``tests/servers.py``, and a ``file://`` directory standing in for a parallel
filesystem) on one synthetic LLM-like state (64 MiB matrices and many small vectors):

1. Upload. ``Checkpointer(state, local=, remote=, drain=DrainOptions(concurrency=c))``: time from
   ``handle.wait()`` (committed locally) to ``handle.drained.result()`` (committed remotely), for
   c = 8 (the default), 4 and 1, against the same client (s3fs / adlfs / fsspec's local filesystem)
   uploading the same step directory with ``fs.put(..., recursive=True)`` (concurrent) and with a
   sequential ``fs.pipe_file`` loop, and against the limits measured in the same run (one big
   ``pipe_file``, TCP loopback, the local disk).
2. Restore. A fresh ``Checkpointer`` on the same local directory (reads local), one on an empty
   local directory with the same remote (reads the remote), ``tiercheck.load(URL)``, against
   ``fs.get`` of the step prefix (to disk) and ``fs.cat`` of its files (into memory). Each is timed
   with a fresh client, as a restarting job has (the Checkpointer's construction included), after
   dropping the page cache (root only). Every result is compared bit for bit with the state.

Markdown tables on stdout (progress on stderr), raw data in ``bench/results/remote_bench.json``.
See bench/README.md ("Remote-tier benchmark").
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
for _p in (str(REPO), str(BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from save_bench import (  # noqa: E402  (bench/ on sys.path first)
    ForeignCpu,
    _tree_pids,
    cpu_delta,
    cpu_times,
    drop_page_cache,
    fsync_dir,
    machine_info,
    measure_disk_write,
    settle,
    steal_share,
)

GiB = 1 << 30
MiB = 1 << 20
REMOTES = ("s3", "azure", "file")
REMOTE_NAMES = {"s3": "S3 (SeaweedFS)", "azure": "Azure (Azurite)", "file": "file:// (same disk)"}
BUCKET = "bench"
STEP = 1000
D = 4096  # matrices are D x D fp32 = 64 MiB, exactly one chunk at the default WriteOptions(chunk_bytes)
SMALL_PER_LAYER = ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "attn.bias", "mlp.bias")


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------------


def build_state(size_mib: float, seed: int = 0) -> dict[str, Any]:
    """``{"model": {...}, "progress": {...}}``: 64 MiB fp32 matrices (the last one shorter to hit
    the size) with six D-sized fp32 vectors and an int64 counter each, plus plain values."""
    import torch

    g = torch.Generator().manual_seed(seed)
    model: dict[str, Any] = {}
    left = int(size_mib * MiB) // 4  # fp32 elements still to place
    i = 0
    while left > 0:
        rows = max(1, min(D, left // D))
        model[f"layers.{i}.mlp.weight"] = torch.rand(rows, D, generator=g)
        for name in SMALL_PER_LAYER:
            model[f"layers.{i}.{name}"] = torch.rand(D, generator=g)
        model[f"layers.{i}.tokens_seen"] = torch.randint(0, 2**40, (1,), generator=g)
        left -= rows * D + len(SMALL_PER_LAYER) * D
        i += 1
    model["final_norm.weight"] = torch.rand(D, generator=g)
    return {"model": model, "progress": {"step": STEP, "samples_seen": 123456789, "lr": 3e-4}}


def zeros_like_state(state: Any) -> Any:
    import torch

    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    return 0 if isinstance(state, int) else 0.0 if isinstance(state, float) else state


def state_bytes(state: Any) -> tuple[int, int]:
    import torch

    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size(), 1
    if isinstance(state, dict):
        b = n = 0
        for v in state.values():
            bb, nn = state_bytes(v)
            b, n = b + bb, n + nn
        return b, n
    return 0, 0


class Mismatch(AssertionError):
    pass


def verify(expected: Any, got: Any, where: str, path: str = "") -> int:
    """Compare bit for bit (``torch.equal`` on tensors, ``==`` on plain values); returns the tensor
    count. Raises ``Mismatch`` naming the first difference."""
    import torch

    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != expected.dtype or not torch.equal(expected, got):
            raise Mismatch(f"{where}: {path} differs from the saved tensor")
        return 1
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(got) != set(expected):
            raise Mismatch(f"{where}: {path or '/'} keys differ: {sorted(set(expected) ^ set(got or {}))[:5]}")
        return sum(verify(v, got[k], where, f"{path}/{k}") for k, v in expected.items())
    if expected != got:
        raise Mismatch(f"{where}: {path} is {got!r}, saved {expected!r}")
    return 0


# --------------------------------------------------------------------------------------------
# Measuring helpers
# --------------------------------------------------------------------------------------------


def _tree_cpu_s(root: int | None) -> float:
    """CPU seconds (user + system, reaped children included) of ``root`` and its descendants."""
    if root is None:
        return 0.0
    hz = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in _tree_pids(root):
        with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in rest[11:15])
    return total / hz


def _proc_ticks() -> dict[int, tuple[int, str]]:
    """CPU ticks and a short command line of every user-space process."""
    out: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{entry}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
            if entry == "2" or rest[1] == "2":
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            cmd = " ".join(os.path.basename(a.decode(errors="replace")) for a in argv[:4] if a)[:70]
            out[int(entry)] = (sum(int(x) for x in rest[11:15]), cmd)
    return out


def top_foreign(before: dict[int, tuple[int, str]], n: int = 3) -> list[tuple[str, float]]:
    """The processes outside this benchmark that used the most CPU since ``before`` (seconds)."""
    hz = os.sysconf("SC_CLK_TCK")
    ours = _tree_pids(os.getpid())
    grown = [
        (cmd, (t - before.get(pid, (0, ""))[0]) / hz) for pid, (t, cmd) in _proc_ticks().items() if pid not in ours
    ]
    return sorted((g for g in grown if g[1] >= 0.5), key=lambda g: -g[1])[:n]


class Meter:
    """Wall time, this process's CPU, the server's CPU and other processes' CPU over one operation."""

    def __init__(self, server_pid: int | None) -> None:
        self.server_pid = server_pid

    def __enter__(self) -> Meter:
        self._t0 = time.perf_counter()  # first: a drain is already running when the meter starts
        self._me0 = sum(os.times()[:2])
        self._cpu0 = cpu_times()
        self._srv0 = _tree_cpu_s(self.server_pid)
        self._foreign = ForeignCpu()  # everything outside this process's tree (the servers are in it)
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._t0
        self.client_cpu_s = sum(os.times()[:2]) - self._me0
        self.server_cpu_s = _tree_cpu_s(self.server_pid) - self._srv0 if self.server_pid else None
        self.steal = steal_share(cpu_delta(self._cpu0, cpu_times()))
        self.other_cpu_share = self._foreign.stop()["foreign_cpu_share"]

    def record(self, nbytes: int, **extra: Any) -> dict[str, Any]:
        return {
            "s": self.wall_s,
            "bytes": nbytes,
            "mib_s": nbytes / MiB / self.wall_s if self.wall_s > 0 else None,
            "client_cpu_s": self.client_cpu_s,
            "server_cpu_s": self.server_cpu_s,
            "steal": self.steal,
            "other_cpu_share": self.other_cpu_share,
            **extra,
        }


class LogTap(logging.Handler):
    """Keeps tiercheck's log records (time, message) to split a drain into its phases."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[float, str, tuple[Any, ...]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.created, str(record.msg), tuple(record.args or ())))

    def since(self, t: float) -> list[tuple[float, str, tuple[Any, ...]]]:
        return [r for r in self.records if r[0] >= t]


def cold(args: argparse.Namespace) -> bool:
    """Flush dirty pages, drop the page cache (root only) and wait for steal to settle."""
    dropped = drop_page_cache(not args.no_drop_caches)
    settle(args.settle_max_s)
    return dropped


def local_files(step_root: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for dirpath, _, names in os.walk(step_root):
        for n in names:
            full = os.path.join(dirpath, n)
            out[os.path.relpath(full, step_root)] = os.path.getsize(full)
    return out


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (fsspec's local filesystem does neither)."""
    for dirpath, _, names in os.walk(root):
        for n in names:
            fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))
    fsync_dir(root.parent)


def measure_tcp_loopback(nbytes: int, block: int = 4 * MiB) -> dict[str, float]:
    """sendall over a 127.0.0.1 TCP connection to a thread that recv_into's a buffer: the ceiling
    for any client-server transfer on this machine (both ends share its cores)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    got = [0]

    def sink() -> None:
        conn, _ = srv.accept()
        buf = bytearray(block)
        with conn:
            while True:
                n = conn.recv_into(buf)
                if not n:
                    break
                got[0] += n

    t = threading.Thread(target=sink)
    t.start()
    data = os.urandom(block)
    with socket.create_connection(srv.getsockname()) as c:
        t0 = time.perf_counter()
        sent = 0
        while sent < nbytes:
            c.sendall(data)
            sent += block
        c.shutdown(socket.SHUT_WR)
        t.join()
        dt = time.perf_counter() - t0
    srv.close()
    return {"bytes": got[0], "s": dt, "mib_s": got[0] / MiB / dt}


def measure_cold_read(files: list[Path], args: argparse.Namespace) -> dict[str, Any]:
    """Read the step's files once, sequentially, from a dropped page cache."""
    dropped = cold(args)
    n = 0
    t0 = time.perf_counter()
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(8 * MiB):
                n += len(chunk)
    dt = time.perf_counter() - t0
    return {"bytes": n, "s": dt, "mib_s": n / MiB / dt, "cache_dropped": dropped}


# --------------------------------------------------------------------------------------------
# Remotes
# --------------------------------------------------------------------------------------------


class Remote:
    """One remote: its server (if any), a plain fsspec client, and path/URL helpers."""

    def __init__(self, kind: str, scratch: Path) -> None:
        self.kind = kind
        self.dir = scratch / kind
        self.dir.mkdir(parents=True, exist_ok=True)
        self.server: Any = None
        self.options: dict[str, Any] | None = None
        self.fs: Any = None
        self._close: Callable[[], object] = lambda: None

    def start(self) -> None:
        from tests.servers import Azurite, SeaweedS3, open_adlfs, open_s3fs

        if self.kind == "file":
            import fsspec

            (self.dir / "pfs").mkdir(exist_ok=True)
            self.fs = fsspec.filesystem("file")
            return
        self.server = SeaweedS3(self.dir / "server") if self.kind == "s3" else Azurite(self.dir / "server")
        self.server.start(timeout=120)
        _log(f"{self.kind}: server up in {self.server.start_seconds:.1f} s (pid {self.server.pid})")
        if self.kind == "s3":
            self.server.make_bucket(BUCKET)
        else:
            self.server.make_container(BUCKET)
        self.options = self.server.storage_options()
        cm = (open_s3fs if self.kind == "s3" else open_adlfs)(**self.options)
        self.fs = cm.__enter__()
        self._close = lambda: cm.__exit__(None, None, None)

    def stop(self) -> None:
        try:
            with contextlib.suppress(Exception):
                self._close()
        finally:
            if self.server is not None:
                self.server.stop()
                self.server = None

    @property
    def server_pid(self) -> int | None:
        return self.server.pid if self.server is not None else None

    def path(self, prefix: str) -> str:
        """fsspec path of ``prefix`` for the plain client."""
        return f"{self.dir / 'pfs'}/{prefix}" if self.kind == "file" else f"{BUCKET}/{prefix}"

    def url(self, prefix: str) -> str:
        scheme = {"s3": "s3://", "azure": "az://", "file": "file://"}[self.kind]
        return scheme + self.path(prefix)

    def sizes(self, path: str) -> dict[str, int]:
        """Files under ``path`` with their sizes, relative to it (directory markers left out)."""
        self.fs.invalidate_cache()
        found = self.fs.find(path, detail=True)
        base = path.rstrip("/") + "/"
        out: dict[str, int] = {}
        for k, v in found.items():
            if k.startswith(base) and v.get("type") != "directory":
                out[k[len(base) :]] = int(v.get("size") or 0)
        return out

    @contextlib.contextmanager
    def fresh_fs(self) -> Iterator[Any]:
        """A new client (no cached connections or listings), closed afterwards."""
        from tests.servers import open_adlfs, open_s3fs

        if self.kind == "file":
            import fsspec

            yield fsspec.filesystem("file", skip_instance_cache=True)
            return
        with (open_s3fs if self.kind == "s3" else open_adlfs)(**(self.options or {})) as fs:
            yield fs

    def close_tier_fs(self, tier: Any) -> None:
        """Close the aiohttp session of a tiercheck RemoteTier's filesystem (no noise at exit)."""
        from tests.servers import close_adlfs, close_s3fs

        fs = getattr(tier, "fs", None)
        if fs is None or self.kind == "file":
            return
        with contextlib.suppress(Exception):
            (close_s3fs if self.kind == "s3" else close_adlfs)(fs)


@contextlib.contextmanager
def started(remote: Remote) -> Iterator[Remote]:
    try:
        remote.start()
        yield remote
    finally:
        remote.stop()


# --------------------------------------------------------------------------------------------
# Part 1: uploads
# --------------------------------------------------------------------------------------------


def run_drain(
    remote: Remote,
    state: dict[str, Any],
    local: Path,
    prefix: str,
    concurrency: int,
    args: argparse.Namespace,
    tap: LogTap,
) -> dict[str, Any]:
    """One save drained to ``prefix``; timed from ``handle.wait()`` to ``handle.drained.result()``."""
    import tiercheck

    ck = tiercheck.Checkpointer(
        state,
        local=local,
        remote=remote.url(prefix),
        remote_options=remote.options,
        drain=tiercheck.DrainOptions(concurrency=concurrency),
    )
    try:
        dropped = cold(args)
        h = ck.save(STEP)
        h.wait()
        wall0 = time.time()
        with Meter(remote.server_pid) as m:
            drained = h.drained.result(timeout=args.op_timeout)
        wall1 = time.time()
        if drained is not True:
            raise RuntimeError(f"{remote.kind}: step {STEP} was not drained ({drained!r}): {ck.status()['remote']}")
        st = ck.status()["remote"]
        rec = m.record(
            st["bytes_uploaded"],
            concurrency=concurrency,
            files=st["files_uploaded"],
            files_already_there=st["files_already_there"],
            requests=st.get("requests"),
            retries=st.get("retries"),
            last_drain_s=st.get("last_drain_s"),
            save_durable_s=h.timings.get("durable_s"),
            cache_dropped=dropped,
            phases=drain_phases(tap.since(wall0 - 1.0), wall0, wall1),
        )
    finally:
        ck.close()
        remote.close_tier_fs(ck.remote)
    return rec


def drain_phases(records: list[tuple[float, str, tuple[Any, ...]]], t_wait: float, t_drained: float) -> dict[str, Any]:
    """Split a drain into: before the uploads (COMMIT check, local walk, remote listing), the
    uploads, after them (__drained marker, listing, manifest, COMMIT) and retention, from the
    drainer's own log lines (tiercheck/drain.py)."""
    up_end = up_s = commit_t = None
    for t, msg, a in records:
        if msg.startswith("drain: step %d: %d files") and len(a) >= 5:
            up_end, up_s = t, float(a[4])
        elif msg.startswith("drain: step %d committed"):
            commit_t = t
    if up_end is None or up_s is None or commit_t is None:
        return {}
    return {
        "before_upload_s": max(0.0, up_end - up_s - t_wait),
        "upload_s": up_s,
        "marker_and_commit_s": commit_t - up_end,
        "after_commit_s": t_drained - commit_t,
    }


def run_put(remote: Remote, step_root: Path, prefix: str, args: argparse.Namespace) -> dict[str, Any]:
    """``fs.put(step dir, prefix, recursive=True)``: the client's own concurrent upload."""
    files = local_files(step_root)
    target = remote.path(prefix)
    dropped = cold(args)
    with Meter(remote.server_pid) as m:
        remote.fs.put(str(step_root) + "/", target + "/", recursive=True)
        if remote.kind == "file":
            fsync_tree(Path(target))
    check_uploaded(remote, files, target, "fs.put")
    return m.record(sum(files.values()), files=len(files), cache_dropped=dropped)


def run_pipe_loop(remote: Remote, step_root: Path, prefix: str, args: argparse.Namespace) -> dict[str, Any]:
    """Read each file and ``fs.pipe_file`` it, one after the other (client defaults)."""
    files = local_files(step_root)
    target = remote.path(prefix)
    dropped = cold(args)
    with Meter(remote.server_pid) as m:
        for rel in sorted(files):
            data = (step_root / rel).read_bytes()
            if remote.kind == "file":
                os.makedirs(os.path.dirname(f"{target}/{rel}"), exist_ok=True)
            remote.fs.pipe_file(f"{target}/{rel}", data)
        if remote.kind == "file":
            fsync_tree(Path(target))
    check_uploaded(remote, files, target, "pipe_file loop")
    return m.record(sum(files.values()), files=len(files), cache_dropped=dropped)


def check_uploaded(remote: Remote, files: dict[str, int], target: str, what: str) -> None:
    there = remote.sizes(target)
    wrong = {f: (n, there.get(f)) for f, n in files.items() if there.get(f) != n}
    if wrong:
        raise Mismatch(f"{remote.kind}: {what} left {len(wrong)} files missing or of the wrong size: {list(wrong)[:3]}")


def measure_remote_limits(remote: Remote, nbytes: int, args: argparse.Namespace) -> dict[str, Any]:
    """One big object up (``pipe_file``, client defaults) and down (``cat_file``), and the latency
    of small requests through tiercheck's own RemoteTier (what each per-file round trip costs)."""
    out: dict[str, Any] = {}
    path = remote.path("limit/big.bin")
    data = os.urandom(nbytes)
    if remote.kind == "file":
        out["put_big"] = measure_disk_write(remote.dir / "pfs", nbytes) | {"what": "fsync'd write, 64 MiB blocks"}
        out["put_big"]["mib_s"] = nbytes / MiB / out["put_big"]["durable_s"]
        out["put_big"]["s"] = out["put_big"]["durable_s"]
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
    else:
        cold(args)
        with Meter(remote.server_pid) as m:
            remote.fs.pipe_file(path, data)
        out["put_big"] = m.record(nbytes, what="one pipe_file, client defaults")
    del data
    cold(args)
    with Meter(remote.server_pid) as m:
        got = remote.fs.cat_file(path)
    out["get_big"] = m.record(len(got), what="one cat_file")
    del got
    out["requests"] = small_request_latency(remote)
    if remote.kind != "file":
        out["one_chunk"] = one_chunk_file(remote, args)
    return out


def one_chunk_file(remote: Remote, args: argparse.Namespace, rounds: int = 2) -> dict[str, Any]:
    """One chunk file (64 MiB + its 4-byte CRC), uploaded as the drain does it (``RemoteTier.write``:
    parts of 16 MiB, 4 at a time, so 4 parts + a 4-byte one on S3; 4 MiB blocks 4 at a time on
    Azure) and with one ``pipe_file`` with the client's defaults (S3: one PUT below 100 MiB)."""
    from tiercheck.tiers.remote import open_tier

    data = os.urandom(D * D * 4 + 4)
    tier = open_tier(remote.url("chunk"), storage_options=remote.options)
    out: dict[str, list[dict[str, Any]]] = {"tiercheck_write": [], "pipe_file": []}
    try:
        tier.list_dir("")  # the client's first request (~0.3 s on S3 here) is not part of an upload
        for r in range(rounds):
            for what in ("tiercheck_write", "pipe_file"):
                settle(args.settle_max_s)
                with Meter(remote.server_pid) as m:
                    if what == "pipe_file":
                        remote.fs.pipe_file(remote.path(f"chunk/p{r}"), data)
                    else:
                        tier.write(f"t{r}", [data])
                out[what].append(m.record(len(data)))
    finally:
        remote.close_tier_fs(tier)
    return {k: {"s": statistics.median(x["s"] for x in v), "runs": v} for k, v in out.items()}


def small_request_latency(remote: Remote, n: int = 20) -> dict[str, float]:
    """Median ms of small requests through tiercheck's RemoteTier / LocalTier, as the drain makes them."""
    from tiercheck.tiers.local import LocalTier
    from tiercheck.tiers.remote import open_tier

    tier = open_tier(remote.url("latency"), storage_options=remote.options)
    if isinstance(tier, LocalTier):
        tier.create()
    out: dict[str, float] = {}
    try:
        timings: dict[str, list[float]] = {"put_1k": [], "get_1k": [], "exists": [], "list_dir": [], "sizes_40": []}
        payload = os.urandom(1024)
        for i in range(40):  # 40 objects so that listings return something
            tier.write(f"d/o{i:03d}", [payload])
        for i in range(n):
            for what, fn in (
                ("put_1k", lambda i=i: tier.write(f"x/o{i:03d}", [payload])),
                ("get_1k", lambda i=i: tier.read(f"d/o{i:03d}")),
                ("exists", lambda i=i: tier.exists(f"d/o{i:03d}")),
                ("list_dir", lambda: tier.list_dir("d")),
                ("sizes_40", lambda: tier.sizes("d")),
            ):
                t0 = time.perf_counter()
                fn()
                timings[what].append(time.perf_counter() - t0)
        out = {k: 1000 * statistics.median(v) for k, v in timings.items()}
    finally:
        remote.close_tier_fs(tier)
    return out


# --------------------------------------------------------------------------------------------
# Part 2: restores
# --------------------------------------------------------------------------------------------


def run_restores(
    remote: Remote, state: dict[str, Any], local: Path, scratch: Path, prefix: str, args: argparse.Namespace
) -> dict[str, list[dict[str, Any]]]:
    """Each read method ``args.n`` times, the order reversed every other round; every result is
    compared bit for bit with ``state`` (tensors) or with the local step's files (bytes)."""
    import tiercheck

    nbytes, _ = state_bytes(state)
    target = zeros_like_state(state)
    url = remote.url(prefix)
    step_rel = f"step-{STEP:08d}"
    src = remote.path(f"{prefix}/{step_rel}")
    want = local_files(local / step_rel)
    paths = [f"{src}/{rel}" for rel in sorted(remote.sizes(src))]
    counter = [0]

    def restore_into(where: Path, label: str) -> dict[str, Any]:
        for t in target["model"].values():
            t.zero_()
        target["progress"] = zeros_like_state(state["progress"])
        ck: Any = None
        dropped = cold(args)
        try:
            # what a restarting job pays: the Checkpointer (and its fresh client) and restore()
            with Meter(remote.server_pid) as m:
                ck = tiercheck.Checkpointer(target, local=where, remote=url, remote_options=remote.options)
                open_s = time.perf_counter() - m._t0
                got = ck.restore()
            stats = ck.stats()
        finally:
            if ck is not None:
                ck.close()
                remote.close_tier_fs(ck.remote)
        if got != STEP:
            raise Mismatch(f"{remote.kind}: {label} restored step {got}, expected {STEP}")
        n = verify(state, target, f"{remote.kind}: {label}")
        return m.record(
            stats.get("restore_bytes_read", nbytes),
            open_s=open_s,
            remote_reads=stats.get("restore_remote_reads"),
            fallbacks=stats.get("restore_fallbacks"),
            verified_tensors=n,
            cache_dropped=dropped,
        )

    def restore_local() -> dict[str, Any]:
        rec = restore_into(local, "restore (local dir)")
        if rec["remote_reads"]:
            raise Mismatch(f"{remote.kind}: restore from a full local dir read {rec['remote_reads']} remote chunks")
        return rec

    def restore_remote() -> dict[str, Any]:
        counter[0] += 1
        empty = scratch / f"empty-local-{counter[0]}"
        rec = restore_into(empty, "restore (empty local dir)")
        if not rec["remote_reads"]:
            raise Mismatch(f"{remote.kind}: restore with an empty local dir read nothing from the remote")
        rec["local_files_after"] = len(local_files(empty)) if empty.exists() else 0
        return rec

    def load() -> dict[str, Any]:
        dropped = cold(args)
        with Meter(remote.server_pid) as m:
            loaded = tiercheck.load(url, storage_options=remote.options)
        n = verify(state, loaded, f"{remote.kind}: tiercheck.load")
        del loaded
        gc.collect()
        return m.record(nbytes, verified_tensors=n, cache_dropped=dropped)

    def fs_get() -> dict[str, Any]:
        counter[0] += 1
        dst = scratch / f"fs-get-{counter[0]}"
        dropped = cold(args)
        with remote.fresh_fs() as fs, Meter(remote.server_pid) as m:  # a fresh client, as load() and restore() get
            fs.get(src + "/", str(dst) + "/", recursive=True)
        got = compare_files(local / step_rel, dst, want, f"{remote.kind}: fs.get")
        return m.record(got, files=len(want), cache_dropped=dropped)

    def fs_cat() -> dict[str, Any]:
        dropped = cold(args)
        with remote.fresh_fs() as fs, Meter(remote.server_pid) as m:
            blobs = fs.cat(paths)
        total = 0
        for rel in sorted(want):
            data = blobs.get(f"{src}/{rel}")
            if data is None or data != (local / step_rel / rel).read_bytes():
                raise Mismatch(f"{remote.kind}: fs.cat: {rel} differs from the local file")
            total += len(data)
        return m.record(total, files=len(paths), cache_dropped=dropped)

    methods: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("restore_local", restore_local),
        ("restore_remote", restore_remote),
        ("load", load),
        ("fs_get", fs_get),
        ("fs_cat", fs_cat),
    ]
    # One untimed read of everything first: a server's first reads after a burst of uploads cost it
    # more (Azurite), and that should not be charged to whichever method comes first.
    with remote.fresh_fs() as fs:
        fs.cat(paths)
    out: dict[str, list[dict[str, Any]]] = {k: [] for k, _ in methods}
    for r in range(args.n):
        for key, fn in methods if r % 2 == 0 else methods[::-1]:
            _log(f"{remote.kind}: {key}")
            out[key].append(fn())
            _log(f"{remote.kind}: {key}: {out[key][-1]['s']:.2f} s")
    return out


def compare_files(src: Path, dst: Path, want: dict[str, int], where: str) -> int:
    total = 0
    for rel in want:
        a, b = src / rel, dst / rel
        if not b.is_file() or a.read_bytes() != b.read_bytes():
            raise Mismatch(f"{where}: {rel} is missing or differs")
        total += b.stat().st_size
    return total


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def run_remote(
    kind: str, state: dict[str, Any], scratch: Path, args: argparse.Namespace, tap: LogTap
) -> dict[str, Any]:
    remote = Remote(kind, scratch)
    res: dict[str, Any] = {"name": REMOTE_NAMES[kind]}
    load = ForeignCpu()
    procs0 = _proc_ticks()
    with started(remote):
        res["server_start_s"] = remote.server.start_seconds if remote.server is not None else None
        _log(f"{kind}: limits")
        res["limits"] = measure_remote_limits(remote, args.limit_mib * MiB, args)
        lim = res["limits"]
        _log(
            f"{kind}: big put {lim['put_big']['mib_s']:.0f} MiB/s, get {lim['get_big']['mib_s']:.0f} MiB/s; "
            + ", ".join(f"{k} {v:.1f} ms" for k, v in lim["requests"].items())
        )
        uploads: dict[str, list[dict[str, Any]]] = {}
        keep_local: Path | None = None
        keep_prefix = ""
        # The default drain and the two plain uploads alternate (--n rounds); then the other concurrencies.
        plan: list[tuple[str, int]] = []
        for r in range(args.n):
            plan += [("drain", 8), ("put", r), ("pipe", r)]
        plan += [("drain", c) for c in args.concurrency if c != 8]
        for i, (what, c) in enumerate(plan):
            prefix = f"{what}-{i}"
            if what == "drain":
                local = scratch / kind / f"local-{i}"
                _log(f"{kind}: drain, concurrency {c}")
                rec = run_drain(remote, state, local, prefix, c, args, tap)
                uploads.setdefault(f"drain c={c}", []).append(rec)
                if keep_local is None:
                    keep_local, keep_prefix = local, prefix
                    continue  # kept for the plain uploads and the restores
            else:
                assert keep_local is not None
                step_root = keep_local / f"step-{STEP:08d}"
                _log(f"{kind}: {'fs.put' if what == 'put' else 'pipe_file loop'}")
                fn = run_put if what == "put" else run_pipe_loop
                uploads.setdefault(what, []).append(fn(remote, step_root, prefix, args))
            _log(f"{kind}: {_last(uploads, what, c)}")
        res["uploads"] = uploads
        assert keep_local is not None
        res["step_files"] = len(local_files(keep_local / f"step-{STEP:08d}"))
        res["step_bytes"] = sum(local_files(keep_local / f"step-{STEP:08d}").values())
        res["restores"] = run_restores(remote, state, keep_local, scratch / kind, keep_prefix, args)
    res["foreign_load"] = load.stop()
    res["foreign_top"] = top_foreign(procs0)
    # Nothing is deleted while timing: deletions make servers collect garbage in the background
    # (Azurite's extent GC) and, on this discard-mounted disk, make the host steal CPU.
    shutil.rmtree(scratch / kind, ignore_errors=True)
    os.sync()
    settle(10.0)
    return res


def _last(uploads: dict[str, list[dict[str, Any]]], what: str, c: int) -> str:
    key = f"drain c={c}" if what == "drain" else what
    r = uploads[key][-1]
    return f"{key}: {r['s']:.2f} s, {r['mib_s']:.0f} MiB/s"


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str = ".2f") -> str:
    if x is None:
        return "-"
    return f"{x:{spec}}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _med(recs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in recs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _cpu_cols(recs: list[dict[str, Any]], s: float | None, ncpu: int) -> list[str]:
    """client CPU s, server CPU s, CPU ms/MiB (client + server per MiB moved: what other processes'
    load changes least), ours % (client + server, share of all CPUs), other processes %."""
    cli, srv = _med(recs, "client_cpu_s"), _med(recs, "server_cpu_s")
    ours = ((cli or 0) + (srv or 0)) / (s * ncpu) if s and cli is not None else None
    per_mib = [
        1000 * (r["client_cpu_s"] + (r.get("server_cpu_s") or 0)) / (r["bytes"] / MiB)
        for r in recs
        if r.get("client_cpu_s") is not None and r.get("bytes")
    ]
    other = _med(recs, "other_cpu_share")
    return [
        _fmt(cli, ".1f"),
        _fmt(srv, ".1f"),
        _fmt(statistics.median(per_mib) if per_mib else None, ".1f"),
        _fmt(100 * ours if ours is not None else None, ".0f"),
        _fmt(100 * other if other is not None else None, ".0f"),
    ]


CPU_HEADERS = ["client CPU s", "server CPU s", "CPU ms/MiB", "ours %", "other %"]


def render(report: dict[str, Any]) -> str:
    cfg, m, lim = report["config"], report["machine"], report["limits"]
    ncpu = m["cpu_count"] or 1
    out: list[str] = []
    out.append(
        f"State: {cfg['state_bytes'] / MiB:.0f} MiB in {cfg['n_tensors']} tensors ({cfg['big_tensors']} of <= 64 MiB, "
        f"the rest 16 KiB vectors and scalars); {cfg['n']} round(s) of drain c=8 / fs.put / pipe_file loop, median "
        f"shown. Machine: {ncpu} CPUs ({m['cpu_model']}), {m['ram_bytes'] / GiB:.1f} GiB RAM, {m['checkpoint_fs']}; "
        f"torch {m['torch']}. Page cache dropped before each timed read: "
        f"{'yes' if cfg['drop_caches'] else 'NO (not root)'}."
    )
    out.append(
        f"Machine limits: TCP loopback {lim['tcp_loopback']['mib_s']:.0f} MiB/s, cold sequential read of the "
        f"step {lim['cold_read']['mib_s']:.0f} MiB/s, fsync'd write {lim['disk_write']['gib_s'] * 1024:.0f} MiB/s."
    )
    out += [
        "",
        "**Upload** (drain: `handle.wait()` -> `handle.drained.result()`; x put, x big object: time ratios at the "
        "same bytes, > 1 slower)",
        "",
    ]
    rows = []
    for kind, res in report["remotes"].items():
        if "error" in res:
            rows.append([res.get("name", kind), "FAILED: " + res["error"][:100]] + ["-"] * 9)
            continue
        ups = res["uploads"]
        put_s = _med(ups.get("put", []), "s")
        limit = res["limits"]["put_big"]["mib_s"]
        order = [k for k in ("drain c=8", "drain c=4", "drain c=1", "put", "pipe") if k in ups]
        order += [k for k in ups if k not in order]
        for key in order:
            recs = ups[key]
            s, nbytes = _med(recs, "s"), _med(recs, "bytes")
            label = {"put": "fs.put (recursive)", "pipe": "pipe_file loop (sequential)"}.get(key, f"tiercheck {key}")
            if key == "drain c=8":
                label += " (default)"
            limit_s = nbytes / MiB / limit if nbytes and limit else None
            rows.append(
                [
                    res["name"],
                    label,
                    f"{nbytes / MiB:.0f}" if nbytes else "-",
                    _fmt(s),
                    _fmt(_med(recs, "mib_s"), ".0f"),
                    _fmt(_ratio(s, put_s)),
                    _fmt(_ratio(s, limit_s)),
                    *_cpu_cols(recs, s, ncpu),
                    str(len(recs)),
                ]
            )
        big = res["limits"]["put_big"]
        rows.append(
            [
                res["name"],
                f"one big pipe_file ({big['bytes'] / MiB:.0f} MiB)" if kind != "file" else "fsync'd write, one file",
                f"{big['bytes'] / MiB:.0f}",
                _fmt(big["s"]),
                _fmt(limit, ".0f"),
                "-",
                "1.00",
                *_cpu_cols([big], big["s"], ncpu),
                "1",
            ]
        )
    head = ["remote", "method", "MiB", "s", "MiB/s", "x put", "x big object", *CPU_HEADERS, "runs"]
    out.append(_table(head, rows))
    out += [
        "",
        "**Where the default drain's time goes** (drainer's log lines; requests = RemoteTier calls; "
        "small requests through RemoteTier, median ms; one chunk file of 64 MiB + 4 B uploaded by "
        "`RemoteTier.write` vs one `pipe_file` with the client's defaults)",
        "",
    ]
    rows = []
    for res in report["remotes"].values():
        if "error" in res:
            continue
        d = res["uploads"].get("drain c=8", [])
        ph = [r["phases"] for r in d if r.get("phases")]
        req = res["limits"]["requests"]
        one = res["limits"].get("one_chunk")

        def p(key: str, ph: list[dict[str, Any]] = ph) -> str:
            return _fmt(statistics.median([x[key] for x in ph]), ".2f") if ph else "-"

        rows.append(
            [
                res["name"],
                _fmt(_med(d, "s")),
                p("before_upload_s"),
                p("upload_s"),
                p("marker_and_commit_s"),
                p("after_commit_s"),
                str(res["step_files"]),
                _fmt(_med(d, "requests"), ".0f"),
                f"{req['put_1k']:.1f} / {req['get_1k']:.1f} / {req['exists']:.1f} / {req['sizes_40']:.1f}",
                f"{one['tiercheck_write']['s']:.2f} / {one['pipe_file']['s']:.2f}" if one else "-",
            ]
        )
    head = ["remote", "drain s", "before uploads s", "uploads s", "marker + COMMIT s", "retention s", "files"]
    head += ["requests", "small put / get / exists / listing ms", "one chunk: RemoteTier.write / pipe_file s"]
    out.append(_table(head, rows))
    out += [
        "",
        "**Restore** (page cache dropped before each; a fresh client each time; every result compared bit for bit)",
        "",
    ]
    rows = []
    for res in report["remotes"].values():
        if "error" in res:
            continue
        rs = res["restores"]
        get_s, cat_s = _med(rs["fs_get"], "s"), _med(rs["fs_cat"], "s")
        for key, label in (
            ("restore_local", "Checkpointer + restore(), local dir"),
            ("restore_remote", "Checkpointer + restore(), empty local dir"),
            ("load", "tiercheck.load(URL)"),
            ("fs_get", "fs.get (to disk)"),
            ("fs_cat", "fs.cat (into memory)"),
        ):
            recs = rs[key]
            s_ = _med(recs, "s")
            rows.append(
                [
                    res["name"],
                    label,
                    _fmt(s_),
                    _fmt(_med(recs, "mib_s"), ".0f"),
                    _fmt(_ratio(s_, get_s)),
                    _fmt(_ratio(s_, cat_s)),
                    str(recs[0].get("remote_reads", "-")),
                    *_cpu_cols(recs, s_, ncpu),
                    str(recs[0].get("verified_tensors", "bytes")),
                    str(len(recs)),
                ]
            )
        g = res["limits"]["get_big"]
        rows.append(
            [
                res["name"],
                "one big cat_file",
                _fmt(g["s"]),
                _fmt(g["mib_s"], ".0f"),
                "-",
                "-",
                "-",
                *_cpu_cols([g], g["s"], ncpu),
                "-",
                "1",
            ]
        )
    head = ["remote", "method", "s", "MiB/s", "x fs.get", "x fs.cat", "remote chunk reads", *CPU_HEADERS]
    out.append(_table([*head, "verified", "runs"], rows))
    out.append("")
    loads = [
        f"{res['name']} {100 * res['foreign_load']['foreign_cpu_share']:.0f}%"
        for res in report["remotes"].values()
        if "foreign_load" in res
    ]
    out.append(
        f"Run took {report['elapsed_s']:.0f} s; load average at start {report['loadavg_start']}, at end "
        f"{report['loadavg_end']}; CPU used by other processes (share of all CPUs) per remote: {', '.join(loads)}. "
        "ours % = (client + server CPU) / (wall x CPUs); other % = processes outside this benchmark."
    )
    tops = [
        f"{res['name']}: " + "; ".join(f"`{cmd}` {sec:.0f} s" for cmd, sec in res["foreign_top"])
        for res in report["remotes"].values()
        if res.get("foreign_top")
    ]
    if tops:
        out.append("Busiest other processes: " + " | ".join(tops) + ".")
    busy = [x for x in report["remotes"].values() if x.get("foreign_load", {}).get("foreign_cpu_share", 0) > 0.05]
    if busy:
        out.append(
            "WARNING: other processes used more than 5% of the CPUs; timings are inflated, rerun on an idle machine."
        )
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mib", type=float, default=None, help="fp32 MiB of the state (default 512; quick 128)")
    p.add_argument("--quick", action="store_true", help="~128 MiB, one round, smaller limit probes")
    p.add_argument("--remotes", nargs="+", choices=REMOTES, default=list(REMOTES))
    p.add_argument("--n", type=int, default=0, help="rounds of drain / fs.put / pipe loop (default 2; quick 1)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 4, 1], help="DrainOptions(concurrency=) values")
    p.add_argument("--limit-mib", type=int, default=0, help="size of the big-object probe (default 256; quick 128)")
    p.add_argument("--dir", help="parent of the scratch directory (default bench/results/)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--json", help="JSON output path (default bench/results/remote_bench.json)")
    p.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache (needs root anyway)")
    p.add_argument("--settle-max-s", type=float, default=3.0, help="wait up to this long for steal < 5%% (default 3)")
    p.add_argument("--op-timeout", type=float, default=300.0, help="seconds any one drain may take")
    p.add_argument("--from-json", metavar="PATH", help="only re-print the tables from a saved JSON")
    args = p.parse_args(argv)
    if args.size_mib is None:
        args.size_mib = 128.0 if args.quick else 512.0
    args.n = args.n or (1 if args.quick else 2)
    args.limit_mib = args.limit_mib or (128 if args.quick else 256)
    if 8 not in args.concurrency:
        args.concurrency = [8, *args.concurrency]
    return args


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        print(render(json.loads(Path(args.from_json).read_text())))
        return 0
    t_start = time.perf_counter()
    loadavg_start = _loadavg()
    json_path = Path(args.json) if args.json else RESULTS_DIR / "remote_bench.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    base = Path(args.dir).resolve() if args.dir else RESULTS_DIR
    base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="remote-", dir=base))

    tap = LogTap()
    tc_log = logging.getLogger("tiercheck")
    tc_log.setLevel(logging.INFO)
    tc_log.addHandler(tap)
    loud = logging.StreamHandler(sys.stderr)
    loud.setLevel(logging.WARNING)
    tc_log.addHandler(loud)
    tc_log.propagate = False

    failed = False
    try:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        state = build_state(args.size_mib)
        nbytes, ntensors = state_bytes(state)
        big = sum(1 for k in state["model"] if k.endswith("mlp.weight"))
        machine = machine_info(scratch)
        _log(f"state {nbytes / MiB:.0f} MiB, {ntensors} tensors; scratch {scratch}")
        limits: dict[str, Any] = {"tcp_loopback": measure_tcp_loopback((512 if args.quick else 1024) * MiB)}
        cold(args)
        limits["disk_write"] = measure_disk_write(scratch, args.limit_mib * MiB)
        # the local tier's cold read of a step: save one without a remote, read its files
        import tiercheck

        probe = scratch / "probe"
        with tiercheck.Checkpointer(state, local=probe) as ck:
            ck.save(STEP).wait()
        files = sorted(p for p in (probe / f"step-{STEP:08d}").rglob("*") if p.is_file())
        limits["cold_read"] = measure_cold_read(files, args)
        shutil.rmtree(probe, ignore_errors=True)
        _log(
            f"limits: TCP loopback {limits['tcp_loopback']['mib_s']:.0f} MiB/s, disk write "
            f"{limits['disk_write']['gib_s'] * 1024:.0f} MiB/s, cold read {limits['cold_read']['mib_s']:.0f} MiB/s"
        )
        remotes: dict[str, Any] = {}
        for kind in args.remotes:
            try:
                remotes[kind] = run_remote(kind, state, scratch, args, tap)
            except Mismatch:
                raise
            except Exception as e:
                import traceback

                failed = True
                _log(f"{kind} FAILED: {type(e).__name__}: {e}")
                traceback.print_exc()
                remotes[kind] = {"name": REMOTE_NAMES[kind], "error": f"{type(e).__name__}: {e}"}
        report: dict[str, Any] = {
            "machine": machine,
            "config": {
                "size_mib": args.size_mib,
                "quick": args.quick,
                "n": args.n,
                "concurrency": args.concurrency,
                "limit_mib": args.limit_mib,
                "state_bytes": nbytes,
                "n_tensors": ntensors,
                "big_tensors": big,
                "drop_caches": drop_page_cache(not args.no_drop_caches),
                "settle_max_s": args.settle_max_s,
            },
            "limits": limits,
            "remotes": remotes,
            "loadavg_start": loadavg_start,
            "loadavg_end": _loadavg(),
            "elapsed_s": time.perf_counter() - t_start,
        }
        table = render(report)
        report["table"] = table
        json_path.write_text(json.dumps(report, indent=1, default=str))
        print(table)
        _log(f"JSON: {json_path}")
    except Mismatch as e:
        _log(f"VERIFICATION FAILED: {e}")
        return 3
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
