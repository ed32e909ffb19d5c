"""A fault-injecting HTTP/1.1 proxy for loopback tests, placed between a storage client and a real server.

The client uses the proxy's address as its endpoint (``proxy.url``). Each request is read from the client
and, by a seeded random draw, either

* forwarded byte for byte to the upstream server (request line, headers including ``Host`` and the
  signature, body) with the response relayed back byte for byte; S3 SigV4 signs the ``Host`` header the
  client sent, which is the proxy's, and the upstream server checks it against the ``Host`` it receives,
  which is that same header, so signatures stay valid;
* answered by the proxy itself with a throttling error: ``503 SlowDown`` (S3 flavour) or
  ``503 ServerBusy`` with ``x-ms-error-code: ServerBusy`` (Azure flavour), without reaching the server;
* reset: the connection is closed with an RST (``SO_LINGER`` 0) without any response, before the request
  reaches the server;
* or, with ``drop_response``, forwarded to the server (so it takes effect) and then reset instead of
  relaying the response: the client cannot tell whether the request was applied.

Faults can be limited to some methods (``methods=("PUT", "POST")``) and changed at run time with
:meth:`FaultProxy.set_faults` (0 turns a fault off). Counters say what happened to each request.

It runs an asyncio loop in a background thread; ``start()`` returns once it listens and ``stop()`` closes
every connection and joins the thread. Upstream connections are opened per client connection and kept
alive while both sides allow it; ``Expect: 100-continue`` and chunked bodies are relayed as they come.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import socket
import struct
import threading
import time
import uuid
import warnings
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any, Literal
from urllib.parse import urlsplit

_HEAD_LIMIT = 1 << 20  # largest request/response head accepted
_COPY_CHUNK = 256 << 10

Flavor = Literal["s3", "azure"]
Outcome = Literal["forwarded", "throttled", "reset", "dropped", "upstream_error", "client_error"]


class _Closed(Exception):
    """The connection cannot carry another request."""


@dataclass
class _Head:
    raw: bytes
    first: str  # request line or status line
    headers: dict[str, str] = field(default_factory=dict)  # lower-cased names; repeated ones joined with ","

    def get(self, name: str, default: str = "") -> str:
        return self.headers.get(name, default)

    @property
    def chunked(self) -> bool:
        return "chunked" in self.get("transfer-encoding").lower()

    @property
    def content_length(self) -> int | None:
        v = self.get("content-length").strip()
        if not v:
            return None
        n = int(v.split(",")[0])
        if n < 0:
            raise ValueError(f"bad Content-Length {v!r}")
        return n

    def wants_close(self) -> bool:
        return "close" in self.get("connection").lower()


def _parse_head(raw: bytes) -> _Head:
    lines = raw.decode("latin-1").split("\r\n")
    head = _Head(raw=raw, first=lines[0])
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"bad header line {line!r}")
        key = name.strip().lower()
        value = value.strip()
        head.headers[key] = f"{head.headers[key]},{value}" if key in head.headers else value
    return head


async def _read_head(reader: asyncio.StreamReader) -> _Head | None:
    """The next head, or None on a clean end of stream before any byte of it."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial.strip():
            return None
        raise _Closed("stream ended inside a head") from e
    except asyncio.LimitOverrunError as e:
        raise _Closed("head too large") from e
    return _parse_head(raw)


async def _copy_exact(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None, n: int) -> None:
    while n > 0:
        chunk = await reader.read(min(n, _COPY_CHUNK))
        if not chunk:
            raise _Closed(f"stream ended with {n} body bytes missing")
        n -= len(chunk)
        if writer is not None:
            writer.write(chunk)
            await writer.drain()


async def _copy_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None) -> None:
    async def line() -> bytes:
        try:
            data = await reader.readuntil(b"\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            raise _Closed("stream ended inside a chunked body") from e
        if writer is not None:
            writer.write(data)
        return data

    while True:
        size = int((await line()).split(b";", 1)[0].strip(), 16)
        if size == 0:
            while await line() != b"\r\n":  # trailers, then the empty line
                pass
            if writer is not None:
                await writer.drain()
            return
        await _copy_exact(reader, writer, size)
        await line()  # CRLF after the chunk data


async def _copy_until_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None) -> None:
    while chunk := await reader.read(_COPY_CHUNK):
        if writer is not None:
            writer.write(chunk)
            await writer.drain()


async def _copy_request_body(head: _Head, reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None) -> None:
    if head.chunked:
        await _copy_chunked(reader, writer)
    else:
        n = head.content_length
        if n:
            await _copy_exact(reader, writer, n)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST rather than a FIN: the peer sees ECONNRESET."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _close(writer: asyncio.StreamWriter | None) -> None:
    if writer is None:
        return
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()


@dataclass
class RequestRecord:
    method: str
    target: str
    outcome: Outcome
    status: int | None = None  # the status relayed (forwarded) or sent (throttled)


class _Tracked(asyncio.StreamReaderProtocol):
    """``asyncio.start_server``'s protocol, recording each accepted connection's transport the moment
    it is made (before any handler runs), so that ``stop`` closes every one of them."""

    def __init__(self, reader: asyncio.StreamReader, cb: Any, seen: set[asyncio.BaseTransport]) -> None:
        super().__init__(reader, cb)
        self._seen = seen

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._seen.add(transport)
        self._transport_seen = transport
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._seen.discard(self._transport_seen)
        super().connection_lost(exc)


class FaultProxy:
    """Fault-injecting HTTP/1.1 proxy on ``127.0.0.1``.

    ``upstream``: ``"http://127.0.0.1:PORT"`` (any path is ignored) or ``"host:port"``.
    ``throttle``, ``reset``, ``drop_response``: probabilities per request (their sum at most 1).
    ``methods``: apply faults only to these HTTP methods (all if None).
    ``flavor``: ``"s3"`` (503 SlowDown) or ``"azure"`` (503 ServerBusy).
    """

    def __init__(
        self,
        upstream: str,
        *,
        throttle: float = 0.0,
        reset: float = 0.0,
        drop_response: float = 0.0,
        methods: Iterable[str] | None = None,
        flavor: Flavor = "s3",
        seed: int = 0,
        port: int = 0,
    ) -> None:
        target = upstream if "://" in upstream else f"http://{upstream}"
        parts = urlsplit(target)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream must be http://host:port, not {upstream!r}")
        if flavor not in ("s3", "azure"):
            raise ValueError(f"flavor must be 's3' or 'azure', not {flavor!r}")
        self.upstream_host: str = parts.hostname
        self.upstream_port: int = parts.port
        self.flavor: Flavor = flavor
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._throttle = self._reset_p = self._drop = 0.0
        self._methods: frozenset[str] | None = None
        self.set_faults(throttle=throttle, reset=reset, drop_response=drop_response, methods=methods)
        self._port = port
        self.forwarded = 0  # requests relayed to the server whose response was relayed back
        self.throttled = 0  # requests answered 503 by the proxy
        self.reset = 0  # requests answered with a connection reset, not sent upstream
        self.dropped = 0  # requests sent upstream whose response was replaced by a reset
        self.upstream_errors = 0  # requests that could not be sent upstream (server down): connection reset
        self.client_errors = 0  # client connections that broke mid-request
        self.connections = 0  # client connections accepted
        self.history: deque[RequestRecord] = deque(maxlen=10_000)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._accepted: set[asyncio.BaseTransport] = set()  # every connection the listener took
        self._tasks: set[asyncio.Task[None]] = set()

    # --- control (any thread) -----------------------------------------------------------------------

    _UNCHANGED: Any = object()

    def set_faults(
        self,
        throttle: float | None = None,
        reset: float | None = None,
        drop_response: float | None = None,
        methods: Iterable[str] | None = _UNCHANGED,
    ) -> None:
        """Change fault probabilities (None keeps one) and the methods they apply to (None: all)."""
        with self._lock:
            t = self._throttle if throttle is None else float(throttle)
            r = self._reset_p if reset is None else float(reset)
            d = self._drop if drop_response is None else float(drop_response)
            if min(t, r, d) < 0 or t + r + d > 1 + 1e-9:
                raise ValueError(f"fault probabilities must be >= 0 and sum to <= 1: {t}, {r}, {d}")
            self._throttle, self._reset_p, self._drop = t, r, d
            if methods is not self._UNCHANGED:
                self._methods = None if methods is None else frozenset(m.upper() for m in methods)

    def clear_faults(self) -> None:
        self.set_faults(throttle=0, reset=0, drop_response=0)

    def stats(self) -> dict[str, int]:
        return {
            "forwarded": self.forwarded,
            "throttled": self.throttled,
            "reset": self.reset,
            "dropped": self.dropped,
            "upstream_errors": self.upstream_errors,
            "client_errors": self.client_errors,
            "connections": self.connections,
        }

    def reset_counters(self) -> None:
        with self._lock:
            self.forwarded = self.throttled = self.reset = self.dropped = 0
            self.upstream_errors = self.client_errors = self.connections = 0
            self.history.clear()

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError("proxy not started")
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def upstream_url(self) -> str:
        return f"http://{self.upstream_host}:{self.upstream_port}"

    def start(self) -> FaultProxy:
        if self._thread is not None:
            raise RuntimeError("proxy already started")
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name=f"faultproxy->{self.upstream_port}", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._listen(), loop).result(timeout=30)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Close the listener and every connection, stop the loop and join its thread. Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=30)
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        if not loop.is_running():
            loop.close()
        self._loop = self._thread = None
        with warnings.catch_warnings():  # what the closed loop still held goes now, not in a later test
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the loop's side ----------------------------------------------------------------------------

    async def _listen(self) -> None:
        def protocol() -> _Tracked:
            return _Tracked(asyncio.StreamReader(limit=_HEAD_LIMIT), self._client, self._accepted)

        self._server = await asyncio.get_running_loop().create_server(protocol, "127.0.0.1", self._port)
        self._port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        # A connection accepted just before the close has its handler scheduled, not yet running (it
        # registers itself first thing): let those run, or their sockets outlive the loop unclosed and
        # surface as a ResourceWarning in whatever test collects the garbage. Each hop (accept ->
        # connection_made -> the handler's task) is one pass of the loop.
        for _ in range(3):
            await asyncio.sleep(0)
        for w in list(self._writers):
            w.transport.abort()  # every handler then ends on a connection error
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=5)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for t in list(self._accepted):  # handler never run, or closing: close waits on bytes a gone client never reads
            t.abort()
        await asyncio.sleep(0)  # the aborts' connection_lost callbacks run: the sockets are closed
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    def _decide(self, method: str) -> Literal["forward", "throttle", "reset", "drop"]:
        with self._lock:
            if self._methods is not None and method.upper() not in self._methods:
                return "forward"
            x = self._rng.random()
            if x < self._throttle:
                return "throttle"
            if x < self._throttle + self._reset_p:
                return "reset"
            if x < self._throttle + self._reset_p + self._drop:
                return "drop"
            return "forward"

    def _record(self, head: _Head, outcome: Outcome, status: int | None = None) -> None:
        method, _, rest = head.first.partition(" ")
        target = rest.rsplit(" ", 1)[0]
        with self._lock:
            if outcome == "forwarded":
                self.forwarded += 1
            elif outcome == "throttled":
                self.throttled += 1
            elif outcome == "reset":
                self.reset += 1
            elif outcome == "dropped":
                self.dropped += 1
            elif outcome == "upstream_error":
                self.upstream_errors += 1
            else:
                self.client_errors += 1
            self.history.append(RequestRecord(method, target, outcome, status))

    def _throttle_response(self, req: _Head) -> bytes:
        method = req.first.split(" ", 1)[0].upper()
        request_id = uuid.uuid4().hex[:16].upper()
        if self.flavor == "s3":
            reason = "Slow Down"
            body = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
                f"<RequestId>{request_id}</RequestId><HostId>faultproxy</HostId></Error>"
            ).encode()
            extra = [f"x-amz-request-id: {request_id}"]
        else:
            reason = "The server is busy."
            now = time.strftime("%Y-%m-%dT%H:%M:%S.0000000Z", time.gmtime())
            body = (
                '\ufeff<?xml version="1.0" encoding="utf-8"?><Error><Code>ServerBusy</Code>'
                f"<Message>The server is busy.\nRequestId:{uuid.uuid4()}\nTime:{now}</Message>"
                "</Error>"
            ).encode()
            extra = ["x-ms-error-code: ServerBusy", f"x-ms-request-id: {uuid.uuid4()}"]
            if req.get("x-ms-version"):
                extra.append(f"x-ms-version: {req.get('x-ms-version')}")
        lines = [
            f"HTTP/1.1 503 {reason}",
            f"Date: {formatdate(usegmt=True)}",
            "Content-Type: application/xml",
            f"Content-Length: {len(body)}",
            *extra,
        ]
        if req.get("expect").lower() == "100-continue" or req.wants_close():
            lines.append("Connection: close")
        out = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        return out if method == "HEAD" else out + body

    async def _client(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        self._writers.add(cwriter)
        with self._lock:
            self.connections += 1
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                try:
                    req = await _read_head(creader)
                except (_Closed, ValueError, ConnectionError):
                    break
                if req is None:
                    break
                method = req.first.split(" ", 1)[0].upper()
                action = self._decide(method)
                if action == "reset":
                    self._record(req, "reset")
                    _reset(cwriter)
                    return
                if action == "throttle":
                    if req.get("expect").lower() == "100-continue":
                        # answer before the body, as a server does, then close (the body never comes)
                        self._record(req, "throttled", 503)
                        cwriter.write(self._throttle_response(req))
                        with contextlib.suppress(Exception):
                            await cwriter.drain()
                            cwriter.write_eof()
                            # read what the client may still send, so that closing does not turn into an RST
                            await asyncio.wait_for(_copy_until_eof(creader, None), 5)
                        return
                    try:
                        await _copy_request_body(req, creader, None)
                    except (_Closed, ConnectionError, ValueError):
                        self._record(req, "client_error")
                        return
                    self._record(req, "throttled", 503)
                    cwriter.write(self._throttle_response(req))
                    await cwriter.drain()
                    if req.wants_close():
                        return
                    continue
                # forward (and maybe drop the response)
                if upstream is None:
                    try:
                        upstream = await asyncio.open_connection(
                            self.upstream_host, self.upstream_port, limit=_HEAD_LIMIT
                        )
                    except OSError:
                        self._record(req, "upstream_error")
                        _reset(cwriter)
                        return
                    self._writers.add(upstream[1])
                ureader, uwriter = upstream
                client_ok, upstream_ok = await self._exchange(
                    req, method, creader, cwriter, ureader, uwriter, drop=action == "drop"
                )
                if not upstream_ok:
                    self._writers.discard(uwriter)
                    uwriter.transport.abort()
                    upstream = None
                if not client_ok:
                    return
        except (asyncio.CancelledError, ConnectionError):
            pass
        finally:
            if upstream is not None:
                self._writers.discard(upstream[1])
                upstream[1].transport.abort()
            self._writers.discard(cwriter)
            cwriter.close()  # no await here: a handler task must not end cancelled (3.11 logs an error)
            self._tasks.discard(task)  # type: ignore[arg-type]

    async def _exchange(
        self,
        req: _Head,
        method: str,
        creader: asyncio.StreamReader,
        cwriter: asyncio.StreamWriter,
        ureader: asyncio.StreamReader,
        uwriter: asyncio.StreamWriter,
        *,
        drop: bool,
    ) -> tuple[bool, bool]:
        """Relay one request and its response. Returns whether the client and the upstream connection
        can carry another request."""
        try:
            uwriter.write(req.raw)
            await uwriter.drain()
        except ConnectionError:
            self._record(req, "upstream_error")
            _reset(cwriter)
            return False, False
        body = asyncio.ensure_future(_copy_request_body(req, creader, uwriter))
        got_head: list[int] = []  # the final status, once its head has arrived (and been counted)
        resp = asyncio.ensure_future(self._relay_response(req, method, ureader, cwriter, drop=drop, got_head=got_head))
        try:
            done, _ = await asyncio.wait({body, resp}, return_when=asyncio.FIRST_COMPLETED)
            if body in done and body.exception() is not None:
                # the client broke off mid-body: the upstream connection is out of step too
                self._record(req, "client_error")
                return False, False
            try:
                upstream_closes, client_closes = await resp
            except (_Closed, ConnectionError, ValueError):
                if not got_head:
                    self._record(req, "upstream_error")
                _reset(cwriter)
                return False, False
            if not body.done():
                # a final response before the whole body (an early error): neither side is in step
                upstream_closes = client_closes = True
            elif body.exception() is not None:
                client_closes = upstream_closes = True
            if drop:
                _reset(cwriter)  # (recorded as dropped when its head arrived)
                return False, not upstream_closes
            return not (client_closes or req.wants_close()), not upstream_closes
        finally:
            for t in (body, resp):
                if not t.done():
                    t.cancel()
            await asyncio.gather(body, resp, return_exceptions=True)

    async def _relay_response(
        self,
        req: _Head,
        method: str,
        ureader: asyncio.StreamReader,
        cwriter: asyncio.StreamWriter,
        *,
        drop: bool,
        got_head: list[int],
    ) -> tuple[bool, bool]:
        """Relay interim responses and the final one.

        Returns whether the upstream connection closes after it and whether the client's must."""
        while True:
            head = await _read_head(ureader)
            if head is None:
                raise _Closed("upstream closed before a response")
            status = int(head.first.split(" ", 2)[1])
            if 100 <= status < 200 and status != 101:
                cwriter.write(head.raw)  # 100 Continue and the like always reach the client
                await cwriter.drain()
                continue
            # counted before the client can see it, so that counters are up to date when a call returns
            self._record(req, "dropped" if drop else "forwarded", status)
            got_head.append(status)
            out = None if drop else cwriter
            if out is not None:
                out.write(head.raw)
            closes = head.wants_close() or head.first.startswith("HTTP/1.0")
            client_closes = closes
            if method == "HEAD" or status in (204, 304):
                pass
            elif head.chunked:
                await _copy_chunked(ureader, out)
            elif head.content_length is not None:
                await _copy_exact(ureader, out, head.content_length)
            else:
                await _copy_until_eof(ureader, out)  # delimited by the end of the stream
                closes = client_closes = True
            if out is not None:
                await out.drain()
            return closes, client_closes
