"""The remote tier: any fsspec URL (``s3://`` through s3fs, ``az://`` / ``abfs://`` through adlfs).

Object stores have no directories and no rename, but a PUT is atomic: an object is visible whole
or not at all, which is all ``publish`` needs. Every call is retried with exponential backoff and
jitter (tenacity) while the error is transient (throttling, 5xx, resets, timeouts, a server that
is down); a permanent one (no such bucket, access denied) is raised at once. Credentials live in
the fsspec filesystem object only: never in a URL we log, a message we raise, or a checkpoint.

A ``file://`` URL (a parallel filesystem mount) is served by :class:`LocalTier`, which fsyncs and
renames atomically; fsspec's local filesystem does neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import fsspec
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    stop_when_event_set,
)
from tenacity.wait import wait_random_exponential

from tiercheck.errors import RemoteStorageError, UnsafeCheckpointError
from tiercheck.options import RetryOptions
from tiercheck.tiers.base import Buffer, Tier
from tiercheck.tiers.local import LocalTier

log = logging.getLogger("tiercheck")

T = TypeVar("T")

# Error codes object stores use for "slow down / try again" and for their own failures.
_TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable", "ServerBusy",
    "OperationTimedOut", "InternalServerError", "BadGateway", "GatewayTimeout",
    "500", "502", "503", "504", "429", "408",
}  # fmt: skip
_TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
                     errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EAGAIN, errno.EBUSY}  # fmt: skip
_TRANSIENT_NAMES = {
    # botocore, aiohttp and azure-core connection-level failures
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
    "ClientConnectionError", "ClientConnectorError", "ServerDisconnectedError", "ClientOSError",
    "ClientPayloadError", "ServerTimeoutError", "ServiceRequestError", "ServiceResponseError",
    "IncompleteReadError", "ResponseStreamingError",
}  # fmt: skip


# The optional backends, by URL scheme: the package and the extra of ours that installs it.
_EXTRAS = {
    "s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"),
    "az": ("adlfs", "azure"), "abfs": ("adlfs", "azure"), "abfss": ("adlfs", "azure"), "adl": ("adlfs", "azure"),
}  # fmt: skip


def is_transient(exc: BaseException) -> bool:
    """Whether retrying ``exc`` may succeed: throttling, server errors, resets, timeouts."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, FileNotFoundError | PermissionError | FileExistsError | IsADirectoryError):
            return False  # no such bucket / key, access denied: the same answer next time
        if isinstance(e, ConnectionError | TimeoutError | asyncio.TimeoutError):
            return True
        if type(e).__name__ in _TRANSIENT_NAMES or any(c.__name__ in _TRANSIENT_NAMES for c in type(e).__mro__):
            return True
        code = _error_code(e)
        if code is not None:
            return code in _TRANSIENT_CODES
        status = getattr(e, "status_code", None) or getattr(e, "status", None)
        if isinstance(status, int):
            return status in (408, 429) or status >= 500
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        e = e.__cause__ or e.__context__
    return False


def _error_code(e: BaseException) -> str | None:
    response = getattr(e, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        if code:
            return str(code)
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return str(status) if status else None
    code = getattr(e, "error_code", None)  # azure-core HttpResponseError
    return str(code) if code else None


def _past_the_end(e: BaseException) -> bool:
    """Whether a ranged read failed only because it starts past the object's end (HTTP 416)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if _status(cur) == 416 or _error_code(cur) in ("InvalidRange", "InvalidRangeHeader"):
            return True
        if "range is not satisfiable" in str(cur).lower() or "range not satisfiable" in str(cur).lower():
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _status(e: BaseException) -> int | None:
    status = getattr(e, "status_code", None)
    if isinstance(status, int):
        return status
    response = getattr(e.__cause__, "response", None) or getattr(e, "response", None)
    if isinstance(response, dict):
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return int(code) if code else None
    return None


def redact(url: str) -> str:
    """The URL without any user or password part (what we log and put in messages)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    return urlunsplit((parts.scheme, host + (f":{parts.port}" if parts.port else ""), parts.path, "", ""))


def open_tier(
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    retry: RetryOptions | None = None,
    part_bytes: int = 16 * 2**20,
) -> Tier:
    """The tier for ``url``: a local directory for plain paths and ``file://``, fsspec otherwise."""
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme in ("", "file", "local"):
        return LocalTier(url[len("file://") :] if url.startswith("file://") else url, fsync=True)
    if scheme in _EXTRAS and not parts.netloc:  # s3:/bucket or s3:bucket: fsspec would list nothing, silently
        raise ValueError(f"{redact(url)}: not a URL fsspec can list; write {scheme}://bucket/prefix (two slashes)")
    return RemoteTier(url, storage_options=storage_options, retry=retry, part_bytes=part_bytes)


class RemoteTier(Tier):
    """An fsspec filesystem under a root prefix, with retries. Thread-safe."""

    durable = True

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        retry: RetryOptions | None = None,
        part_bytes: int = 16 * 2**20,
        part_concurrency: int = 4,
    ) -> None:
        self.url = redact(url).rstrip("/")
        self.retry = retry or RetryOptions()
        self.part_bytes = part_bytes
        self.part_concurrency = part_concurrency
        options = {"skip_instance_cache": True, "use_listings_cache": False, **(storage_options or {})}
        if urlsplit(url).scheme in ("s3", "s3a"):
            # One attempt per call in botocore and in s3fs: the retries (and their count) are ours,
            # with our limits and jitter. Set them in storage_options to have it otherwise.
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("retries", {"total_max_attempts": 1})
            options["config_kwargs"] = config
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **options)
        except ImportError as e:
            extra = _EXTRAS.get(urlsplit(url).scheme)
            if extra is None:
                raise RemoteStorageError(f"cannot open {self.url}: {e}") from None
            package, name = extra
            raise RemoteStorageError(
                f"cannot open {self.url}: {package} is not installed; pip install 'tiercheck[{name}]' "
                f"(or 'tiercheck[all]') ({e})"
            ) from None
        except ValueError as e:
            raise RemoteStorageError(f"cannot open {self.url}: {e}") from None
        self.root = root.rstrip("/")
        if urlsplit(url).scheme in ("s3", "s3a") and hasattr(self.fs, "retries"):
            self.fs.retries = 1  # s3fs's own retry loop (a class attribute, not an option)
        self.counters = {"requests": 0, "retries": 0, "bytes_up": 0, "bytes_down": 0}
        self._lock = threading.Lock()
        self._aborted = threading.Event()

    def abort(self) -> None:
        self._aborted.set()

    def _p(self, path: str) -> str:
        if path.startswith("/") or "\\" in path or ".." in path.split("/"):
            raise UnsafeCheckpointError(f"path {path!r} would leave the checkpoint root {self.url}")
        return f"{self.root}/{path}" if path else self.root

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        r = self.retry

        def count_retry(state: RetryCallState) -> None:
            with self._lock:
                self.counters["retries"] += 1
            exc = state.outcome.exception() if state.outcome else None
            # What is retried, for how long so far and until when: a silent retry loop looks like a hang.
            log.warning(
                "%s: %s: attempt %d of %d failed after %.1f s (%s); retrying in %.1f s, for up to %.0f s in all",
                self.url,
                what,
                state.attempt_number,
                r.attempts,
                state.seconds_since_start or 0.0,
                _brief(exc),
                state.upcoming_sleep,
                r.deadline_s,
            )

        retrying = Retrying(
            retry=retry_if_exception(is_transient),
            wait=wait_random_exponential(multiplier=r.initial_backoff_s, max=r.max_backoff_s),
            stop=stop_after_attempt(r.attempts) | stop_after_delay(r.deadline_s) | stop_when_event_set(self._aborted),
            before_sleep=count_retry,
            reraise=True,
        )
        with self._lock:
            self.counters["requests"] += 1
        try:
            return retrying(fn)
        except (FileNotFoundError, UnsafeCheckpointError, RemoteStorageError, _SourceError):
            raise
        except Exception as e:  # botocore / azure-core errors are not all OSErrors: one type for callers
            if is_transient(e):
                stats = retrying.statistics
                why = "the tier was closed" if self._aborted.is_set() else "retry limits"
                raise RemoteStorageError(
                    f"{self.url}: {what}: gave up after {stats.get('attempt_number', 1)} attempt(s) in "
                    f"{stats.get('delay_since_first_attempt', 0.0):.0f} s ({why}: {r.attempts} attempts / "
                    f"{r.deadline_s:.0f} s): {_brief(e)}"
                ) from e
            status = _status(e)
            if isinstance(e, PermissionError) or status in (401, 403):
                raise RemoteStorageError(f"{self.url}: {what}: access denied ({_brief(e)})") from e
            if status == 404:  # azure: a missing container on write comes back as a bare 404
                raise RemoteStorageError(f"{self.url}: {what}: no such bucket or container ({_brief(e)})") from e
            raise RemoteStorageError(f"{self.url}: {what}: {_brief(e)}") from e

    # ------------------------------------------------------------------------------ Tier API

    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        # bytes, not bytearray: azure-storage takes a bytearray for an iterable of ints. join returns a
        # lone bytes part itself, uncopied: what copies between tiers pass (from read_bytes).
        data = b"".join(parts)
        kwargs: dict[str, Any] = {}
        if len(data) >= 2 * self.part_bytes:  # big objects: a multipart upload, parts in parallel
            kwargs = {"chunksize": self.part_bytes, "max_concurrency": self.part_concurrency}
            if "adlfs" in type(self.fs).__module__:
                kwargs = {"max_concurrency": self.part_concurrency}
        target = self._p(path)
        try:
            self._call(f"writing {path}", lambda: self.fs.pipe_file(target, data, **kwargs))
        except FileNotFoundError as e:  # writes create keys: only the bucket / container can be missing
            raise RemoteStorageError(f"{self.url}: writing {path}: no such bucket or container ({_brief(e)})") from e
        with self._lock:
            self.counters["bytes_up"] += len(data)

    def write_stream(self, path: str, pieces: Callable[[], Iterable[Buffer]]) -> None:
        """Stream into one object: a multipart upload (S3) or staged blocks (Azure) of
        ``part_bytes`` each, committed when the last piece is in. A transient failure starts the
        object over (an unfinished upload is never visible)."""
        target = self._p(path)
        sent = 0

        def upload() -> None:
            nonlocal sent
            sent = 0
            f = self.fs.open(target, "wb", block_size=max(self.part_bytes, 5 * 2**20))
            try:
                source = iter(pieces())
                while True:
                    try:
                        piece = next(source)
                    except StopIteration:
                        break
                    except BaseException as e:  # the source failed (a rotten chunk): not ours to retry
                        raise _SourceError(e) from None
                    f.write(piece)
                    sent += len(piece)
            except BaseException:
                # Not close(): that would complete the upload with what was sent so far.
                with contextlib.suppress(Exception):
                    f.discard()  # s3fs aborts the multipart upload; Azure drops uncommitted blocks
                f.closed = True  # and not on garbage collection either (fsspec's __del__ closes)
                raise
            f.close()

        try:
            self._call(f"writing {path}", upload)
        except _SourceError as e:
            raise e.args[0] from None
        except FileNotFoundError as e:
            raise RemoteStorageError(f"{self.url}: writing {path}: no such bucket or container ({_brief(e)})") from e
        with self._lock:
            self.counters["bytes_up"] += sent

    def read_bytes(self, path: str) -> bytes:
        target = self._p(path)
        data: bytes = self._call(f"reading {path}", lambda: self.fs.cat_file(target))
        with self._lock:
            self.counters["bytes_down"] += len(data)
        return data

    def read(self, path: str) -> bytearray:
        return bytearray(self.read_bytes(path))  # writable, as tensors made from it must be

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        target = self._p(path)

        def get() -> bytes:
            try:
                got: bytes = self.fs.cat_file(target, start=offset, end=offset + length)
            except Exception as e:
                if offset > 0 and _past_the_end(e):  # as a file ends early: nothing there, not an error
                    return b""
                raise
            return got

        data: bytes = self._call(f"reading {path} [{offset}, {offset + length})", get)
        with self._lock:
            self.counters["bytes_down"] += len(data)
        return data

    def read_into(self, path: str, out: memoryview, *, offset: int = 0, length: int | None = None) -> tuple[int, bytes]:
        data = self.read_bytes(path) if length is None else self.read_range(path, offset, length)
        if length is None and offset:
            data = data[offset:]
        n = min(len(data), len(out))
        out[:n] = memoryview(data)[:n]  # one copy, not two (read() copies into a writable bytearray)
        return n, data[n:]

    def exists(self, path: str) -> bool:
        target = self._p(path)
        return bool(self._call(f"checking {path}", lambda: self.fs.exists(target)))

    def list_dir(self, path: str = "") -> list[str]:
        target = self._p(path)

        def ls() -> list[str]:
            try:
                entries = self.fs.ls(target, detail=False)
            except FileNotFoundError:
                return []
            return sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries if str(e).rstrip("/") != target})

        return self._call(f"listing {path or '/'}", ls)

    def sizes(self, path: str) -> dict[str, int]:
        """Every object under ``path`` with its size, keyed by path relative to ``path``."""
        target = self._p(path)

        def find() -> dict[str, int]:
            try:
                found = self.fs.find(target, detail=True)
            except FileNotFoundError:
                return {}
            prefix = target + "/"
            return {k[len(prefix) :]: int(v.get("size") or 0) for k, v in found.items() if k.startswith(prefix)}

        return self._call(f"listing {path}", find)

    def publish(self, path: str, data: bytes) -> None:
        self.write(path, [data])  # a PUT is atomic: readers see the whole object or none

    def delete(self, path: str) -> None:
        target = self._p(path)

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(target)

        self._call(f"deleting {path}", rm)

    def delete_tree(self, path: str) -> None:
        target = self._p(path)

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(target, recursive=True)

        self._call(f"deleting {path}/", rm)

    def sync_dirs(self, path: str) -> None:
        """Object stores have no directories; an acknowledged PUT is durable."""


class _SourceError(Exception):
    """What ``write_stream``'s source raised, carried past the retries unchanged."""


def _brief(exc: BaseException | None) -> str:
    if exc is None:
        return "no error"
    code = _error_code(exc) or (exc.__cause__ is not None and _error_code(exc.__cause__))
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}{f' {code}' if code else ''}: {text}"
