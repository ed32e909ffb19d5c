#!/usr/bin/env python
"""Remote tier: tiercheck's drain and remote restore against the plain fsspec client, on S3
(SeaweedFS), Azure Blob (Azurite) and a ``file://`` directory, all on loopback.

Usage::

    .venv/bin/python bench/remote_bench.py            # 512 MiB of fp32 tensors, 2 rounds
    .venv/bin/python bench/remote_bench.py --quick    # 128 MiB, one round
    .venv/bin/python bench/remote_bench.py --size-mib 256 --remotes s3 file
    .venv/bin/python bench/remote_bench.py --peers only --remotes s3 azure   # tiercheck vs the peers only

Upload: drain (``handle.wait()`` -> ``handle.drained.result()``) at several
``DrainOptions(concurrency=)`` vs ``fs.put`` recursive, a sequential ``pipe_file`` loop and one big
object. Restore (page cache dropped, fresh client, checked bit for bit): local dir, empty local dir,
``tiercheck.load(URL)`` vs ``fs.get`` and ``fs.cat``. Peers, in the same rounds (``--peers``,
bench/remote_peers.py): on S3 awscrt's S3Client (the raw limit) and s3torchconnector's DCP writer and
reader, on Azure one blob by adlfs with ``max_concurrency``. Method and columns: bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import harness as h
import limits
from harness import GiB, MiB
from remote_peers import Peers, failure
from remote_tables import UPLOAD_LABELS, render

REMOTES = ("s3", "azure", "file")
REMOTE_NAMES = {"s3": "S3 (SeaweedFS)", "azure": "Azure (Azurite)", "file": "file:// (same disk)"}
BUCKET, STEP = "bench", 1000
STEP_REL = f"step-{STEP:08d}"
D = 4096  # D x D fp32 = 64 MiB: one chunk at the default WriteOptions(chunk_bytes)
SMALL_PER_LAYER = ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "attn.bias", "mlp.bias")


class Mismatch(AssertionError):
    pass


# ---------------------------------------------------------------------------------------------
# State


def build_state(size_mib: float, seed: int = 0) -> dict[str, Any]:
    """64 MiB fp32 matrices (the last one shorter) with six D-sized vectors and an int64 counter each."""
    import torch

    g = torch.Generator().manual_seed(seed)
    model: dict[str, Any] = {}
    left, i = int(size_mib * MiB) // 4, 0
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


def tensors(state: Any) -> list[Any]:
    import torch

    if isinstance(state, torch.Tensor):
        return [state]
    return [t for v in state.values() for t in tensors(v)] if isinstance(state, dict) else []


def verify(expected: Any, got: Any, where: str, path: str = "") -> int:
    """``torch.equal`` on tensors, ``==`` on plain values; the tensor count, or ``Mismatch``."""
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


def local_files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


# ---------------------------------------------------------------------------------------------
# Measuring


class Meter:
    """Wall time, this process's CPU, the server's CPU and other processes' CPU over one operation."""

    def __init__(self, server_pid: int | None) -> None:
        self.pid = server_pid

    def __enter__(self) -> Meter:
        self.t0 = time.perf_counter()  # first: a drain is already running when the meter starts
        self._me0, self._cpu0 = sum(os.times()[:2]), h.cpu_times()
        self._srv0 = h.tree_cpu_s(self.pid) if self.pid else 0.0
        self._foreign = h.ForeignCpu()
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self.t0
        self.rec = {"s": self.s, "client_cpu_s": sum(os.times()[:2]) - self._me0}
        self.rec["server_cpu_s"] = h.tree_cpu_s(self.pid) - self._srv0 if self.pid else None
        self.rec["steal"] = h.steal_share(h.cpu_delta(self._cpu0, h.cpu_times()))
        self.rec["other_cpu_share"] = self._foreign.stop()["foreign_cpu_share"]

    def record(self, nbytes: int, **extra: Any) -> dict[str, Any]:
        per_gib = self.rec["client_cpu_s"] / (nbytes / GiB) if nbytes else None
        out = {"bytes": nbytes, "mib_s": nbytes / MiB / self.s if self.s > 0 else None}
        return self.rec | out | {"client_cpu_s_per_gib": per_gib, **extra}


class LogTap(logging.Handler):
    """Keeps tiercheck's log records (time, message, args) to split a drain into its phases."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[float, str, tuple[Any, ...]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.created, str(record.msg), tuple(record.args or ())))


def drain_phases(tap: LogTap, t_wait: float, t_drained: float) -> dict[str, Any]:
    """Before the uploads, the uploads, marker + COMMIT, retention: from tiercheck/drain.py's log lines."""
    up_end = up_s = commit_t = None
    for t, msg, a in tap.records:
        if t < t_wait - 1.0:
            continue
        if msg.startswith("drain: step %d: %d files") and len(a) >= 5:
            up_end, up_s = t, float(a[4])
        elif msg.startswith("drain: step %d committed"):
            commit_t = t
    if up_end is None or up_s is None or commit_t is None:
        return {}
    out = {"before_upload_s": max(0.0, up_end - up_s - t_wait), "upload_s": up_s}
    return out | {"marker_and_commit_s": commit_t - up_end, "after_commit_s": t_drained - commit_t}


def measure_tcp_loopback(nbytes: int, block: int = 4 * MiB) -> dict[str, float]:
    """sendall over 127.0.0.1 to a thread that recv_into's a buffer: the ceiling of any transfer here."""
    return limits.tcp_loopback(nbytes, block)


# ---------------------------------------------------------------------------------------------
# Remotes


class Remote:
    """One remote: its server (if any), a plain fsspec client, paths and URLs."""

    def __init__(self, kind: str, scratch: Path, args: argparse.Namespace) -> None:
        self.kind, self.args, self.dir = kind, args, scratch / kind
        self.dir.mkdir(parents=True, exist_ok=True)
        self.server: Any = None
        self.options: dict[str, Any] | None = None
        self._cm: Any = None

    def start(self) -> None:
        from tests.servers import Azurite, SeaweedS3

        if self.kind == "file":
            (self.dir / "pfs").mkdir(exist_ok=True)
        else:
            self.server = (SeaweedS3 if self.kind == "s3" else Azurite)(self.dir / "server")
            self.server.start(timeout=120)
            h.log(f"{self.kind}: server up in {self.server.start_seconds:.1f} s (pid {self.server.pid})")
            (self.server.make_bucket if self.kind == "s3" else self.server.make_container)(BUCKET)
            self.options = self.server.storage_options()
        self._cm = self.fresh_fs()
        self.fs = self._cm.__enter__()

    def stop(self) -> None:
        try:
            with contextlib.suppress(Exception):
                if self._cm is not None:
                    self._cm.__exit__(None, None, None)
        finally:
            if self.server is not None:
                self.server.stop()
                self.server = None

    @property
    def pid(self) -> int | None:
        return self.server.pid if self.server is not None else None

    def meter(self) -> Meter:
        return Meter(self.pid)

    def prepare(self) -> str:
        return h.prepare(not self.args.no_drop_caches, self.args.settle_max_s)

    def path(self, prefix: str) -> str:
        return f"{self.dir / 'pfs'}/{prefix}" if self.kind == "file" else f"{BUCKET}/{prefix}"

    def url(self, prefix: str) -> str:
        return {"s3": "s3://", "azure": "az://", "file": "file://"}[self.kind] + self.path(prefix)

    def sizes(self, path: str) -> dict[str, int]:
        """Files under ``path`` with their sizes, relative to it."""
        self.fs.invalidate_cache()
        base = path.rstrip("/") + "/"
        found = self.fs.find(path, detail=True).items()
        return {
            k[len(base) :]: int(v.get("size") or 0)
            for k, v in found
            if k.startswith(base) and v.get("type") != "directory"
        }

    @contextlib.contextmanager
    def fresh_fs(self) -> Iterator[Any]:
        """A new client (no cached connections or listings), closed afterwards."""
        from tests.servers import open_adlfs, open_s3fs

        if self.kind == "file":
            import fsspec

            yield fsspec.filesystem("file", skip_instance_cache=True)
        else:
            with (open_s3fs if self.kind == "s3" else open_adlfs)(**(self.options or {})) as fs:
                yield fs

    def close_tier(self, tier: Any) -> None:
        """Close the aiohttp session of a RemoteTier's filesystem (no noise at exit)."""
        from tests.servers import close_adlfs, close_s3fs

        if getattr(tier, "fs", None) is not None and self.kind != "file":
            with contextlib.suppress(Exception):
                (close_s3fs if self.kind == "s3" else close_adlfs)(tier.fs)

    def tier(self, prefix: str) -> Any:
        from tiercheck.tiers.local import LocalTier
        from tiercheck.tiers.remote import open_tier

        tier = open_tier(self.url(prefix), storage_options=self.options)
        if isinstance(tier, LocalTier):
            tier.create()
        return tier


# ---------------------------------------------------------------------------------------------
# Uploads


def drain_options(c: int = 8, pc: int | None = None) -> Any:
    """``DrainOptions`` with ``concurrency=c`` and ``part_concurrency=pc`` (None: the library's default)."""
    import tiercheck

    return tiercheck.DrainOptions(concurrency=c, **({} if pc is None else {"part_concurrency": pc}))


def run_drain(
    rm: Remote, state: dict[str, Any], local: Path, prefix: str, c: int, tap: LogTap, pc: int | None = None
) -> dict[str, Any]:
    """One save drained to ``prefix``, timed from ``handle.wait()`` to ``handle.drained.result()``."""
    import tiercheck

    ck = tiercheck.Checkpointer(
        state, local=local, remote=rm.url(prefix), remote_options=rm.options, drain=drain_options(c, pc)
    )
    try:
        dropped = rm.prepare()
        hd = ck.save(STEP)
        hd.wait()
        wall0 = time.time()
        with rm.meter() as m:
            drained = hd.drained.result(timeout=rm.args.op_timeout)
        wall1 = time.time()
        st = ck.status()["remote"]
        if drained is not True:
            raise RuntimeError(f"{rm.kind}: step {STEP} was not drained ({drained!r}): {st}")
        return m.record(
            st["bytes_uploaded"],
            concurrency=c,
            part_concurrency=ck.drain_options.part_concurrency,
            files=st["files_uploaded"],
            files_already_there=st["files_already_there"],
            requests=st.get("requests"),
            retries=st.get("retries"),
            last_drain_s=st.get("last_drain_s"),
            save_durable_s=hd.timings.get("durable_s"),
            cache_dropped=dropped,
            phases=drain_phases(tap, wall0, wall1),
        )
    finally:
        ck.close()
        rm.close_tier(ck.remote)


def run_plain_upload(rm: Remote, how: str, step_root: Path, prefix: str) -> dict[str, Any]:
    """``fs.put(recursive=True)`` (the client's concurrent upload) or a sequential read + ``pipe_file``
    loop; for ``file://`` every file and directory is fsync'd inside the timing, as tiercheck does."""
    files, target = local_files(step_root), rm.path(prefix)
    dropped = rm.prepare()
    with rm.meter() as m:
        if how == "put":
            rm.fs.put(str(step_root) + "/", target + "/", recursive=True)
        else:
            for rel in sorted(files):
                data = (step_root / rel).read_bytes()
                if rm.kind == "file":
                    os.makedirs(os.path.dirname(f"{target}/{rel}"), exist_ok=True)
                rm.fs.pipe_file(f"{target}/{rel}", data)
        if rm.kind == "file":
            h.fsync_tree(target)
            h.fsync_dir(Path(target).parent)
    there = rm.sizes(target)
    wrong = [f for f, n in files.items() if there.get(f) != n]
    if wrong:
        raise Mismatch(f"{rm.kind}: {how} left {len(wrong)} files missing or of the wrong size: {wrong[:3]}")
    return m.record(sum(files.values()), files=len(files), cache_dropped=dropped)


def measure_remote_limits(rm: Remote, nbytes: int) -> dict[str, Any]:
    """One big object up (``pipe_file``) and down (``cat_file``), small requests through tiercheck's
    RemoteTier, and one chunk file by ``RemoteTier.write`` vs one ``pipe_file``."""
    out: dict[str, Any] = {}
    path, data = rm.path("limit/big.bin"), os.urandom(nbytes)
    if rm.kind == "file":
        w = h.measure_disk_write(rm.dir / "pfs", nbytes)
        out["put_big"] = w | {"what": "fsync'd write", "s": w["durable_s"], "mib_s": nbytes / MiB / w["durable_s"]}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
    else:
        rm.prepare()
        with rm.meter() as m:
            rm.fs.pipe_file(path, data)
        out["put_big"] = m.record(nbytes, what="one pipe_file, client defaults")
    del data
    rm.prepare()
    with rm.meter() as m:
        got = rm.fs.cat_file(path)
    out["get_big"] = m.record(len(got), what="one cat_file")
    del got
    out["requests"] = small_request_latency(rm)
    if rm.kind != "file":
        out["one_chunk"] = one_chunk_file(rm)
    return out


def one_chunk_file(rm: Remote, rounds: int = 2) -> dict[str, Any]:
    """64 MiB + 4 B as the drain uploads it (S3: 16 MiB parts, 4 at a time; Azure: 4 MiB blocks)
    and as one ``pipe_file`` with the client's defaults, after a warm-up request; median of ``rounds``."""
    data, tier = os.urandom(D * D * 4 + 4), rm.tier("chunk")
    out: dict[str, list[dict[str, Any]]] = {"tiercheck_write": [], "pipe_file": []}
    try:
        tier.list_dir("")  # the client's first request (~0.3 s on S3) is not part of an upload
        for r in range(rounds):
            for what, fn in (
                ("tiercheck_write", lambda r=r: tier.write(f"t{r}", [data])),
                ("pipe_file", lambda r=r: rm.fs.pipe_file(rm.path(f"chunk/p{r}"), data)),
            ):
                h.settle(rm.args.settle_max_s)
                with rm.meter() as m:
                    fn()
                out[what].append(m.record(len(data)))
    finally:
        rm.close_tier(tier)
    return {k: {"s": statistics.median(x["s"] for x in v), "runs": v} for k, v in out.items()}


def small_request_latency(rm: Remote, n: int = 20) -> dict[str, float]:
    """Median ms of small requests through tiercheck's tier, as the drain makes them."""
    tier, payload = rm.tier("latency"), os.urandom(1024)
    try:
        for i in range(40):  # so that listings return something
            tier.write(f"d/o{i:03d}", [payload])
        ms: dict[str, list[float]] = {}
        for i in range(n):
            for what, fn in (
                ("put_1k", lambda i=i: tier.write(f"x/o{i:03d}", [payload])),
                ("get_1k", lambda i=i: tier.read(f"d/o{i:03d}")),
                ("exists", lambda i=i: tier.exists(f"d/o{i:03d}")),
                ("list_dir", lambda: tier.list_dir("d")),
                ("sizes_40", lambda: tier.sizes("d")),
            ):
                ms.setdefault(what, []).append(1000 * h.timed(fn)[0])
        return {k: statistics.median(v) for k, v in ms.items()}
    finally:
        rm.close_tier(tier)


# ---------------------------------------------------------------------------------------------
# Restores


Method = tuple[str, Callable[[], dict[str, Any]]]


def read_methods(rm: Remote, state: dict[str, Any], local: Path, prefix: str) -> tuple[list[Method], list[str]]:
    """tiercheck's restores and the plain client's reads of the step drained to ``prefix`` (each
    checked bit for bit), and the paths of the step's objects."""
    import tiercheck

    nbytes = sum(t.nbytes for t in tensors(state))
    target, url = zeros_like_state(state), rm.url(prefix)
    src = rm.path(f"{prefix}/{STEP_REL}")
    want = local_files(local / STEP_REL)
    paths = [f"{src}/{rel}" for rel in sorted(rm.sizes(src))]
    counter = [0]

    def restore(empty: bool, pc: int | None = None, in_place: bool = False) -> dict[str, Any]:
        counter[0] += 1
        where, label = (rm.dir / f"empty-local-{counter[0]}", "empty local dir") if empty else (local, "local dir")
        for t in tensors(target):
            t.zero_()
        target["progress"] = zeros_like_state(state["progress"])
        ck: Any = None
        dropped = rm.prepare()
        try:  # what a restarting job pays: the Checkpointer (and its fresh client) and restore()
            with rm.meter() as m:
                ck = tiercheck.Checkpointer(
                    target, local=where, remote=url, remote_options=rm.options, drain=drain_options(8, pc)
                )
                open_s = time.perf_counter() - m.t0
                got = ck.restore(in_place=in_place)
            stats = ck.stats()
        finally:
            if ck is not None:
                ck.close()
                rm.close_tier(ck.remote)
        if got != STEP:
            raise Mismatch(f"{rm.kind}: restore ({label}) restored step {got}, expected {STEP}")
        reads = stats.get("restore_remote_reads")
        if bool(reads) != empty:
            raise Mismatch(f"{rm.kind}: restore ({label}) read {reads} chunks from the remote")
        rec = m.record(
            stats.get("restore_bytes_read", nbytes),
            open_s=open_s,
            remote_reads=reads,
            fallbacks=stats.get("restore_fallbacks"),
            verified_tensors=verify(state, target, f"{rm.kind}: restore ({label})"),
            cache_dropped=dropped,
        )
        if empty:
            rec["local_files_after"] = len(local_files(where)) if where.exists() else 0
        return rec

    def load() -> dict[str, Any]:
        dropped = rm.prepare()
        with rm.meter() as m:
            loaded = tiercheck.load(url, storage_options=rm.options)
        n = verify(state, loaded, f"{rm.kind}: tiercheck.load")
        del loaded
        gc.collect()
        return m.record(nbytes, verified_tensors=n, cache_dropped=dropped)

    def plain(how: str) -> dict[str, Any]:
        counter[0] += 1
        dst = rm.dir / f"fs-get-{counter[0]}"
        dropped = rm.prepare()
        with rm.fresh_fs() as fs, rm.meter() as m:  # a fresh client, as load() and restore() get
            blobs = fs.get(src + "/", str(dst) + "/", recursive=True) if how == "get" else fs.cat(paths)
        total = 0
        for rel in sorted(want):
            data = (dst / rel).read_bytes() if how == "get" and (dst / rel).is_file() else None
            data = blobs.get(f"{src}/{rel}") if how == "cat" else data
            if data is None or data != (local / STEP_REL / rel).read_bytes():
                raise Mismatch(f"{rm.kind}: fs.{how}: {rel} is missing or differs from the local file")
            total += len(data)
        return m.record(total, files=len(want), cache_dropped=dropped)

    methods: list[Method] = [
        ("restore_local", lambda: restore(False)),
        ("restore_remote", lambda: restore(True, main_pc(rm.args))),
        *((f"restore_remote pc={pc}", functools.partial(restore, True, pc)) for pc in rm.args.part_concurrency[1:]),
        ("restore_remote in_place=True", functools.partial(restore, True, main_pc(rm.args), True)),
        ("load", load),
        ("fs_get", lambda: plain("get")),
        ("fs_cat", lambda: plain("cat")),
    ]
    return methods, paths


def run_restores(
    rm: Remote, state: dict[str, Any], keep: tuple[Path, str] | None, peers: Peers
) -> dict[str, list[dict[str, Any]]]:
    """Each read method ``--n`` times, the order reversed every other round, each checked bit for bit;
    with ``--peers only`` tiercheck's restore into an empty local dir and the peers' downloads only.
    A method that raises is recorded with its error (a tiercheck restore that reads wrong data stops all)."""
    methods, paths = read_methods(rm, state, *keep) if keep is not None else ([], [])
    if rm.args.peers == "only":
        methods = [m for m in methods if m[0].startswith("restore_remote")]
    methods += [(k, functools.partial(peers.run, k)) for k in peers.downloads()]
    with rm.fresh_fs() as fs:  # untimed: a server's first reads after a burst of uploads cost it more
        if paths:
            fs.cat(paths)
    peers.warm()
    out: dict[str, list[dict[str, Any]]] = {k: [] for k, _ in methods}
    for r in range(rm.args.n):
        for key, fn in methods if r % 2 == 0 else methods[::-1]:
            out[key].append(attempt(rm.kind, key, fn))
    return out


def attempt(kind: str, key: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``'s record, or the record of its failure (``Mismatch`` still stops the run); logged."""
    try:
        rec = fn()
    except Mismatch:
        raise
    except Exception as e:
        h.log(f"{kind}: {key} FAILED: {type(e).__name__}: {e}")
        traceback.print_exc()
        rec = failure(e)
    if "error" not in rec:
        h.log(f"{kind}: {key}: {rec['s']:.2f} s, {rec['mib_s'] or 0:.0f} MiB/s, client CPU {rec['client_cpu_s']:.2f} s")
    return rec


def main_pc(args: argparse.Namespace) -> int | None:
    """The ``DrainOptions(part_concurrency=)`` of the main rows (None: the library's default)."""
    return args.part_concurrency[0] if args.part_concurrency else None


def run_uploads(
    rm: Remote, state: dict[str, Any], tap: LogTap, peers: Peers
) -> tuple[dict[str, list[dict[str, Any]]], tuple[Path, str] | None]:
    """The default drain, the plain uploads and the peers' uploads alternate (--n rounds); then the
    other concurrencies (not with ``--peers only``, which runs no plain uploads either). The first
    good drain's local step directory and prefix are returned for the plain uploads and restores."""
    args = rm.args
    extra = tuple(f"drain-pc{pc}" for pc in args.part_concurrency[1:])  # more DrainOptions(part_concurrency=)
    per_round = ("drain", *extra) if args.peers == "only" else ("drain", *extra, "put", "pipe")
    plan = [(w, 8) for _ in range(args.n) for w in (*per_round, *peers.uploads())]
    plan += [("drain", c) for c in args.concurrency if c != 8 and args.peers != "only"]
    ups: dict[str, list[dict[str, Any]]] = {}
    keep: tuple[Path, str] | None = None
    for i, (what, c) in enumerate(plan):
        pc = int(what[len("drain-pc") :]) if what.startswith("drain-pc") else main_pc(args)
        key = f"drain c={c}" if what == "drain" else f"drain c=8 pc={pc}" if what.startswith("drain-pc") else what
        prefix = f"{what}-{i}"

        def one(what: str = what, c: int = c, prefix: str = prefix, pc: int | None = pc) -> dict[str, Any]:
            nonlocal keep
            if what.startswith("drain"):
                local = rm.dir / f"local-{prefix}"
                rec = run_drain(rm, state, local, prefix, c, tap, pc)
                keep = keep or (local, prefix)
                return rec
            if what in UPLOAD_LABELS:
                if keep is None:
                    raise RuntimeError("no drained step to upload: every drain so far failed")
                return run_plain_upload(rm, what, keep[0] / STEP_REL, prefix)
            return peers.run(what, prefix)

        ups.setdefault(key, []).append(attempt(rm.kind, key, one))
    return ups, keep


def run_remote(
    kind: str, state: dict[str, Any], scratch: Path, args: argparse.Namespace, tap: LogTap
) -> dict[str, Any]:
    rm = Remote(kind, scratch, args)
    res: dict[str, Any] = {"name": REMOTE_NAMES[kind]}
    load = h.ForeignCpu()
    try:
        rm.start()
        res["server_start_s"] = rm.server.start_seconds if rm.server is not None else None
        peers = Peers(rm, state, tensors, verify, zeros_like_state)
        if args.peers != "only":
            lim = res["limits"] = measure_remote_limits(rm, args.limit_mib * MiB)
            h.log(
                f"{kind}: big put {lim['put_big']['mib_s']:.0f} MiB/s, get {lim['get_big']['mib_s']:.0f} MiB/s; "
                + ", ".join(f"{k} {v:.1f} ms" for k, v in lim["requests"].items())
            )
        res["uploads"], keep = run_uploads(rm, state, tap, peers)
        if keep is not None:
            files = local_files(keep[0] / STEP_REL)
            res["step_files"], res["step_bytes"] = len(files), sum(files.values())
        res["restores"] = run_restores(rm, state, keep, peers)
        peers.close()
    finally:
        rm.stop()
    res["foreign_load"] = load.stop()
    res["foreign_top"] = res["foreign_load"]["top_foreign"]
    # Nothing is deleted while timing: deletions make servers collect garbage in the background
    # and, on this discard-mounted disk, make the host steal CPU.
    shutil.rmtree(rm.dir, ignore_errors=True)
    os.sync()
    h.settle(10.0)
    return res


# ---------------------------------------------------------------------------------------------
# Main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mib", type=float, default=None, help="fp32 MiB of the state (default 512; quick 128)")
    p.add_argument("--remotes", nargs="+", choices=REMOTES, default=list(REMOTES))
    p.add_argument("--n", type=int, default=0, help="rounds of drain / fs.put / pipe loop (default 2; quick 1)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 4, 1], help="DrainOptions(concurrency=) values")
    p.add_argument(
        "--part-concurrency",
        type=int,
        nargs="+",
        default=[],
        help="DrainOptions(part_concurrency=) of tiercheck's drains and remote restores: the first in the main rows "
        "(default: the library's), each other one in rows of its own in the same rounds",
    )
    p.add_argument("--limit-mib", type=int, default=0, help="size of the big-object probe (default 256; quick 128)")
    p.add_argument("--op-timeout", type=float, default=300.0, help="seconds any one drain or awscrt request may take")
    p.add_argument("--from-json", metavar="PATH", help="only re-print the tables from a saved JSON")
    g = p.add_argument_group("peers (bench/remote_peers.py)")
    g.add_argument(
        "--peers",
        choices=("on", "off", "only"),
        default="on",
        help="on: also run the peers (S3: raw awscrt, s3torchconnector DCP; Azure: raw adlfs), interleaved\n"
        "with the drain and restore; off: not; only: tiercheck's drain c=8 and empty-dir restore and the peers",
    )
    g.add_argument("--peer-concurrency", type=int, default=8, help="adlfs max_concurrency of the raw Azure rows")
    g.add_argument("--peer-part-mib", type=int, default=8, help="awscrt / s3torchconnector part size (their default 8)")
    g.add_argument("--peer-gbps", type=float, default=10.0, help="awscrt / s3torchconnector throughput target")
    g.add_argument("--s3tc-threads", type=int, default=1, help="S3StorageWriter(thread_count=) (DCP's default 1)")
    h.common_args(p, settle_s=3.0)  # --quick: 128 MiB, one round, smaller probes
    args = p.parse_args(argv)
    args.size_mib = args.size_mib or (128.0 if args.quick else 512.0)
    args.n = args.n or (1 if args.quick else 2)
    args.limit_mib = args.limit_mib or (128 if args.quick else 256)
    args.concurrency = [8, *(c for c in args.concurrency if c != 8)]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        print(render(json.loads(Path(args.from_json).read_text())))
        return 0
    t_start, loadavg_start = time.perf_counter(), h.loadavg()
    tap = LogTap()
    tc_log = logging.getLogger("tiercheck")
    tc_log.setLevel(logging.INFO)
    tc_log.addHandler(tap)
    loud = logging.StreamHandler(sys.stderr)
    loud.setLevel(logging.WARNING)
    tc_log.addHandler(loud)
    tc_log.propagate = False
    failed = False
    with h.scratch_dir(args.dir, "remote-", args.keep) as scratch:
        import torch

        import tiercheck

        torch.set_num_threads(os.cpu_count() or 1)
        state = build_state(args.size_mib)
        ts = tensors(state)
        nbytes = sum(t.nbytes for t in ts)
        h.log(f"state {nbytes / MiB:.0f} MiB, {len(ts)} tensors; scratch {scratch}")
        limits: dict[str, Any] = {"tcp_loopback": measure_tcp_loopback((512 if args.quick else 1024) * MiB)}
        h.prepare(not args.no_drop_caches, args.settle_max_s)
        limits["disk_write"] = h.measure_disk_write(scratch, args.limit_mib * MiB)
        probe = scratch / "probe"  # the local tier's cold read of a step
        with tiercheck.Checkpointer(state, local=probe) as ck:
            ck.save(STEP).wait()
        files = sorted(p for p in (probe / STEP_REL).rglob("*") if p.is_file())
        limits["cold_read"] = h.measure_cold_read(files, not args.no_drop_caches)
        shutil.rmtree(probe, ignore_errors=True)
        remotes: dict[str, Any] = {}
        try:
            for kind in args.remotes:
                try:
                    remotes[kind] = run_remote(kind, state, scratch, args, tap)
                except Mismatch:
                    raise
                except Exception as e:
                    failed = True
                    h.log(f"{kind} FAILED: {type(e).__name__}: {e}")
                    traceback.print_exc()
                    remotes[kind] = {"name": REMOTE_NAMES[kind], "error": f"{type(e).__name__}: {e}"}
        except Mismatch as e:
            h.log(f"VERIFICATION FAILED: {e}")
            return 3
        config = {
            k: getattr(args, k)
            for k in ("size_mib", "quick", "n", "concurrency", "part_concurrency", "limit_mib", "settle_max_s")
        }
        config |= {
            k: getattr(args, k) for k in ("peers", "peer_concurrency", "peer_part_mib", "peer_gbps", "s3tc_threads")
        }
        config |= {"state_bytes": nbytes, "n_tensors": len(ts), "drop_caches": h.drop_caches(not args.no_drop_caches)}
        config["big_tensors"] = sum(1 for k in state["model"] if k.endswith("mlp.weight"))
        report = {"machine": h.machine_info(scratch), "config": config, "limits": limits, "remotes": remotes}
        report |= {"loadavg_start": loadavg_start, "loadavg_end": h.loadavg()}
        report["elapsed_s"] = time.perf_counter() - t_start
    report["table"] = render(report)
    path = h.write_json(args.json or h.RESULTS_DIR / "remote_bench.json", report)
    print(report["table"])
    h.log(f"JSON: {path}")
    methods_failed = [
        f"{kind} {key}"
        for kind, res in report["remotes"].items()
        for part in ("uploads", "restores")
        for key, recs in res.get(part, {}).items()
        if any("error" in r for r in recs)
    ]
    if methods_failed:
        h.log(f"FAILED methods (recorded with their errors): {', '.join(methods_failed)}")
    return 1 if failed or methods_failed else 0


if __name__ == "__main__":
    sys.exit(main())
