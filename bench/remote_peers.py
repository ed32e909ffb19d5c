"""Peers of tiercheck's remote tier, run by bench/remote_bench.py on the same server, interleaved
with tiercheck's drain and restore (round 1 of every method, then round 2, ...):

* S3, the raw limit: one object of the state's bytes up with awscrt's ``S3Client`` (multipart,
  parts in flight together) and down with it (ranged GETs in flight together) into a buffer;
* S3, ``s3torchconnector[dcp]``: ``dcp.save(state, storage_writer=S3StorageWriter(...))`` and
  ``dcp.load(zeros, storage_reader=S3StorageReader(...))``, checked bit for bit;
* Azure, raw: the same bytes as one blob, ``fs.pipe_file(path, data, max_concurrency=N)`` up and
  ``fs.cat_file(path, max_concurrency=N)`` down (adlfs over azure-storage-blob's block upload and
  chunked download).

A method that fails (not installed, refused by the server) is recorded with its error; the others
run on. Method and columns: bench/README.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import harness as h
from harness import GiB, MiB

REGION = "us-east-1"
UPLOADS = {"s3": ("crt_put", "s3tc_save"), "azure": ("az_put",), "file": ()}
DOWNLOADS = {"s3": ("crt_get", "s3tc_load"), "azure": ("az_get",), "file": ()}
SOURCE = {"crt_get": "crt_put", "s3tc_load": "s3tc_save", "az_get": "az_put"}  # what each download reads
TIERCHECK_UP, TIERCHECK_DOWN = "drain c=8", "restore_remote"
LABELS = {
    TIERCHECK_UP: "tiercheck drain (concurrency=8, part_concurrency as configured)",
    TIERCHECK_DOWN: "tiercheck restore(), empty local dir",
    "crt_put": "raw: awscrt S3Client PUT (multipart)",
    "crt_get": "raw: awscrt S3Client GET (ranged parts)",
    "s3tc_save": "s3torchconnector dcp.save",
    "s3tc_load": "s3torchconnector dcp.load",
    "az_put": "raw: adlfs pipe_file, one blob",
    "az_get": "raw: adlfs cat_file, one blob",
}


def label(key: str) -> str:
    """A row's method: the peers' by name, tiercheck's variants (``drain c=8 pc=8``) by their options."""
    if key in LABELS:
        return LABELS[key]
    return f"tiercheck {'drain' if key.startswith('drain') else 'restore(), empty local dir'}, {key.split()[-1]}"


def failure(exc: BaseException) -> dict[str, Any]:
    """The record of a method that raised."""
    return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc(limit=8)}


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """``os.environ`` with ``values`` set, restored afterwards (botocore reads AWS_ENDPOINT_URL too)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Peers:
    """The peer methods of one remote, what each uploaded (for the downloads) and their failures.

    ``state``/``tensors``/``verify``/``zeros_like`` come from remote_bench.py (the same state tiercheck
    saves, and its bit-for-bit check)."""

    def __init__(
        self,
        rm: Any,
        state: dict[str, Any],
        tensors: Callable[[Any], list[Any]],
        verify: Callable[..., int],
        zeros_like: Callable[[Any], Any],
    ) -> None:
        self.rm, self.args, self.state = rm, rm.args, state
        self.tensors, self.verify, self.zeros_like = tensors, verify, zeros_like
        self.nbytes = sum(t.nbytes for t in tensors(state))
        self.enabled = self.args.peers != "off"
        self.where: dict[str, str] = {}  # upload method -> the object or DCP directory it wrote first
        self.sticky: dict[str, str] = {}  # methods that cannot work (not installed): skipped in later rounds
        self._blob: bytes | None = None
        self._buf: bytearray | None = None
        self._target: Any = None

    def uploads(self) -> tuple[str, ...]:
        return UPLOADS[self.rm.kind] if self.enabled else ()

    def downloads(self) -> tuple[str, ...]:
        return DOWNLOADS[self.rm.kind] if self.enabled else ()

    def run(self, key: str, prefix: str = "") -> dict[str, Any]:
        """One timed run of ``key`` (uploads to ``prefix``); never raises, a failure is a record."""
        if key in self.sticky:
            return {"error": f"skipped: {self.sticky[key]}"}
        try:
            if key in SOURCE and SOURCE[key] not in self.where:
                raise RuntimeError(f"nothing to read: {SOURCE[key]} uploaded nothing")
            fn = getattr(self, key)
            return fn(prefix) if key in self.uploads() else fn()
        except Exception as e:
            rec = failure(e)
            if isinstance(e, ImportError):
                self.sticky[key] = rec["error"]
            h.log(f"{self.rm.kind}: {key} FAILED: {rec['error']}")
            return rec

    def warm(self) -> None:
        """Untimed: read back what the peers uploaded once, as run_restores does tiercheck's step."""
        for key in self.uploads():
            with contextlib.suppress(Exception):
                if key == "s3tc_save" and key in self.where:
                    base = self.rm.path(self.where[key])
                    self.rm.fs.cat([f"{base}/{rel}" for rel in self.rm.sizes(base)])
                elif key in self.where:
                    self.rm.fs.cat_file(self.rm.path(self.where[key]))

    def close(self) -> None:
        self._blob = self._buf = self._target = None

    # -- data -------------------------------------------------------------------------------------

    def blob(self) -> bytes:
        """The state's tensor bytes, end to end: what the raw clients move."""
        if self._blob is None:
            self._blob = b"".join(memoryview(t.numpy()).cast("B") for t in self.tensors(self.state))
        return self._blob

    def buffer(self) -> bytearray:
        """A buffer of the state's size, allocated once, zeroed before each download (untimed)."""
        if self._buf is None:
            self._buf = bytearray(self.nbytes)
        ctypes.memset((ctypes.c_char * len(self._buf)).from_buffer(self._buf), 0, len(self._buf))
        return self._buf

    def target(self) -> Any:
        """Zeros shaped like the state, allocated once, zeroed before each load, as restore()'s."""
        if self._target is None:
            self._target = self.zeros_like(self.state)
        for t in self.tensors(self._target):
            t.zero_()
        self._target["progress"] = self.zeros_like(self.state["progress"])
        return self._target

    def check_size(self, rel: str, want: int) -> None:
        self.rm.fs.invalidate_cache()
        got = self.rm.fs.size(self.rm.path(rel))
        if got != want:
            raise AssertionError(f"{self.rm.kind}: {rel} holds {got} bytes, {want} were uploaded")

    # -- S3: awscrt -------------------------------------------------------------------------------

    def crt_client(self) -> Any:
        """awscrt's S3 client over plain HTTP to the server, path style, SigV4 (unsigned payload)."""
        from awscrt.auth import AwsCredentialsProvider
        from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
        from awscrt.s3 import S3Client, S3RequestTlsMode, create_default_s3_signing_config

        opts = self.rm.options or {}
        elg = EventLoopGroup()
        creds = AwsCredentialsProvider.new_static(opts["key"], opts["secret"])
        return S3Client(
            bootstrap=ClientBootstrap(elg, DefaultHostResolver(elg)),
            region=REGION,
            signing_config=create_default_s3_signing_config(region=REGION, credential_provider=creds),
            tls_mode=S3RequestTlsMode.DISABLED,
            part_size=self.args.peer_part_mib * MiB,
            throughput_target_gbps=self.args.peer_gbps,
        )

    def crt_timed(self, rel: str, body: bytes | None = None, into: bytearray | None = None) -> tuple[Any, int, str]:
        """(meter, bytes, cache dropped) of one request by a new client (made and shut down untimed)."""
        client = self.crt_client()
        done = client.shutdown_event
        try:
            dropped = self.rm.prepare()
            with self.rm.meter() as m:
                n = self.crt_request(client, rel, body=body, into=into)
        finally:
            del client  # the last reference: the client shuts down
            done.wait(10)
        return m, n, dropped

    def crt_request(self, client: Any, rel: str, body: bytes | None = None, into: bytearray | None = None) -> int:
        """One PUT_OBJECT (``body``) or GET_OBJECT (into ``into``) of ``/bucket/rel``; the bytes moved."""
        from awscrt.http import HttpHeaders, HttpRequest
        from awscrt.s3 import S3RequestType

        headers = [("Host", urlsplit((self.rm.options or {})["endpoint_url"]).netloc)]
        if body is not None:
            headers += [("Content-Length", str(len(body))), ("Content-Type", "application/octet-stream")]
        stream = io.BytesIO(body) if body is not None else None
        request = HttpRequest(
            "PUT" if body is not None else "GET", "/" + self.rm.path(rel), HttpHeaders(headers), stream
        )
        got = [0]
        mv = memoryview(into) if into is not None else None

        def on_body(chunk: Any, offset: int, **_: Any) -> None:
            n = len(chunk)
            if mv is None or offset + n > len(mv):
                raise ValueError(f"{n} bytes at {offset}: past the {len(mv or b'')}-byte buffer")
            mv[offset : offset + n] = chunk
            got[0] += n

        kind = S3RequestType.PUT_OBJECT if body is not None else S3RequestType.GET_OBJECT
        req = client.make_request(type=kind, request=request, on_body=on_body if body is None else None)
        req.finished_future.result(timeout=self.args.op_timeout)
        return len(body) if body is not None else got[0]

    def crt_put(self, prefix: str) -> dict[str, Any]:
        rel, data = f"{prefix}/state.bin", self.blob()
        m, _, dropped = self.crt_timed(rel, body=data)
        self.check_size(rel, len(data))
        self.where.setdefault("crt_put", rel)
        return m.record(len(data), objects=1, part_size=self.args.peer_part_mib * MiB, cache_dropped=dropped)

    def crt_get(self) -> dict[str, Any]:
        rel, buf = self.where["crt_put"], self.buffer()
        m, got, dropped = self.crt_timed(rel, into=buf)
        if got != len(buf) or buf != self.blob():
            raise AssertionError(f"{self.rm.kind}: awscrt GET of {rel}: {got} bytes, differs from what was put")
        return m.record(got, objects=1, part_size=self.args.peer_part_mib * MiB, cache_dropped=dropped)

    # -- S3: s3torchconnector ---------------------------------------------------------------------

    def s3tc(self) -> tuple[Any, Any]:
        """(S3ClientConfig, environ): the env vars are its only way to an endpoint and credentials."""
        from s3torchconnector import S3ClientConfig

        opts = self.rm.options or {}
        env = environ(
            AWS_ENDPOINT_URL=opts["endpoint_url"],
            AWS_ACCESS_KEY_ID=opts["key"],
            AWS_SECRET_ACCESS_KEY=opts["secret"],
            AWS_REGION=REGION,
        )
        cfg = S3ClientConfig(
            force_path_style=True, part_size=self.args.peer_part_mib * MiB, throughput_target_gbps=self.args.peer_gbps
        )
        return cfg, env

    def s3tc_save(self, prefix: str) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector.dcp import S3StorageWriter

        cfg, env = self.s3tc()
        with env, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
            writer = S3StorageWriter(
                REGION, f"s3://{self.rm.path(prefix)}/", s3client_config=cfg, thread_count=self.args.s3tc_threads
            )
            dropped = self.rm.prepare()
            with self.rm.meter() as m:
                dcp.save(self.state, storage_writer=writer)
        files = self.rm.sizes(self.rm.path(prefix))
        if not any(f.endswith(".distcp") for f in files) or ".metadata" not in files:
            raise AssertionError(f"{self.rm.kind}: dcp.save left {sorted(files)[:5]}")
        self.where.setdefault("s3tc_save", prefix)
        return m.record(
            self.nbytes,
            objects=len(files),
            object_bytes=sum(files.values()),
            thread_count=self.args.s3tc_threads,
            cache_dropped=dropped,
        )

    def s3tc_load(self) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector.dcp import S3StorageReader

        prefix, target = self.where["s3tc_save"], self.target()
        cfg, env = self.s3tc()
        with env, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
            dropped = self.rm.prepare()
            with self.rm.meter() as m:  # the reader (and its client) is built inside, as a restarting job's
                reader = S3StorageReader(REGION, f"s3://{self.rm.path(prefix)}/", s3client_config=cfg)
                dcp.load(target, storage_reader=reader)
        n = self.verify(self.state, target, f"{self.rm.kind}: s3torchconnector dcp.load")
        return m.record(self.nbytes, verified_tensors=n, cache_dropped=dropped)

    # -- Azure: adlfs -----------------------------------------------------------------------------

    def az_put(self, prefix: str) -> dict[str, Any]:
        rel, data, c = f"{prefix}/state.bin", self.blob(), self.args.peer_concurrency
        dropped = self.rm.prepare()
        with self.rm.meter() as m:
            self.rm.fs.pipe_file(self.rm.path(rel), data, max_concurrency=c)
        self.check_size(rel, len(data))
        self.where.setdefault("az_put", rel)
        return m.record(len(data), objects=1, max_concurrency=c, cache_dropped=dropped)

    def az_get(self) -> dict[str, Any]:
        rel, c = self.where["az_put"], self.args.peer_concurrency
        dropped = self.rm.prepare()
        with self.rm.fresh_fs() as fs, self.rm.meter() as m:  # a fresh client, as fs_get's
            data = fs.cat_file(self.rm.path(rel), max_concurrency=c)
        if data != self.blob():
            raise AssertionError(f"{self.rm.kind}: adlfs cat_file of {rel} differs from what was put")
        return m.record(len(data), objects=1, max_concurrency=c, cache_dropped=dropped)


# ---------------------------------------------------------------------------------------------
# Table

PEER_HEAD = "remote|way|method|MiB|s|MiB/s|tiercheck s / this s|client CPU s|client CPU s/GiB|server CPU s|runs"


def _med(recs: list[dict[str, Any]], key: str) -> float | None:
    return h.median([r.get(key) for r in recs])


def _rows(name: str, way: str, recs_by_key: dict[str, list[dict[str, Any]]], keys: tuple[str, ...]) -> list[list[Any]]:
    """One row per method in ``keys`` (tiercheck's first: the ratios are to it)."""
    ours_s = _med([r for r in recs_by_key.get(keys[0], []) if "error" not in r], "s")
    rows = []
    for key in (k for k in keys if k in recs_by_key):
        recs = recs_by_key[key]
        ok = [r for r in recs if "error" not in r]
        if not ok:
            rows.append([name, way, label(key), "FAILED: " + recs[-1]["error"][:160], *["-"] * 6, len(recs)])
            continue
        s, nbytes = _med(ok, "s"), _med(ok, "bytes")
        per_gib = [r["client_cpu_s"] / (r["bytes"] / GiB) for r in ok if r.get("bytes")]
        row = [name, way, label(key), h.fmt(nbytes and nbytes / MiB, ".0f"), h.fmt(s), h.fmt(_med(ok, "mib_s"), ".0f")]
        row += [h.fmt(h.ratio(ours_s, s)), h.fmt(_med(ok, "client_cpu_s")), h.fmt(h.median(per_gib))]
        fails = f" ({len(recs) - len(ok)} failed)" if len(ok) < len(recs) else ""
        rows.append([*row, h.fmt(_med(ok, "server_cpu_s"), ".1f"), f"{len(ok)}{fails}"])
    return rows


def render_peers(report: dict[str, Any]) -> str:
    """The peers table (empty string when no remote ran peers)."""
    rows: list[list[Any]] = []
    for kind, res in report["remotes"].items():
        if "error" in res or not (UPLOADS.get(kind) and any(k in res.get("uploads", {}) for k in UPLOADS[kind])):
            continue
        ups, downs = res.get("uploads", {}), res.get("restores", {})
        ours_up = sorted(k for k in ups if k.startswith(f"{TIERCHECK_UP} pc="))
        ours_down = sorted(k for k in downs if k.startswith(f"{TIERCHECK_DOWN} "))
        rows += _rows(res["name"], "up", ups, (TIERCHECK_UP, *ours_up, *UPLOADS[kind]))
        rows += _rows(res["name"], "down", downs, (TIERCHECK_DOWN, *ours_down, *DOWNLOADS[kind]))
    if not rows:
        return ""
    cfg = report["config"]
    return "\n".join(
        [
            f"**Against the peers** (same server, same run, rounds interleaved, medians; raw rows move the "
            f"state's {cfg['state_bytes'] / MiB:.0f} MiB as one object; awscrt and s3torchconnector: "
            f"{cfg.get('peer_part_mib')} MiB parts, {cfg.get('peer_gbps')} Gbps target; s3torchconnector "
            f"thread_count={cfg.get('s3tc_threads')}; adlfs max_concurrency={cfg.get('peer_concurrency')}. "
            "tiercheck s / this s > 1: tiercheck is slower; client CPU = this process, every thread)",
            "",
            h.table(PEER_HEAD.split("|"), rows),
        ]
    )
