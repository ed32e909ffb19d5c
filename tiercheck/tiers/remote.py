"""The remote tier: an object store through fsspec (``s3://`` through s3fs, ``az://`` / ``abfs://`` through adlfs).

Object stores have no directories and no rename, but a PUT is atomic: an object is visible whole
or not at all, which is all ``publish`` needs. Every call is retried with exponential backoff and
jitter (tenacity) while the error is transient (throttling, 5xx, resets, timeouts, a server that
is down); a permanent one (no such bucket, access denied) is raised at once. Credentials live in
the fsspec filesystem object only: never in a URL we log, a message we raise, or a checkpoint.

A ``file://`` URL (a parallel filesystem mount) is served by :class:`LocalTier`, which fsyncs and
renames atomically; fsspec's local filesystem does neither.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

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
from tiercheck.tiers import transient
from tiercheck.tiers.base import Buffer, Tier, pass_read
from tiercheck.tiers.credentials import credential_sources, missing_credentials
from tiercheck.tiers.inflight import Inflight, SourceError, sourced
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.parts import (
    MIN_PART_BYTES,
    PartUpload,
    composite_crc32c,
    get_into,
    part_size,
    part_upload,
    unfinished,
)
from tiercheck.tiers.transient import brief, is_transient, past_the_end, redact, status_of, store_place
from tiercheck.tiers.urls import EXTRAS, LOCAL_SCHEMES, local_path, tier_url

log = logging.getLogger("tiercheck")

T = TypeVar("T")

def open_tier(
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    retry: RetryOptions | None = None,
    part_bytes: int = 8 * 2**20,
    part_concurrency: int = 16,
) -> Tier:
    """The tier for ``url``: a local directory for plain paths and ``file://``, fsspec for the object
    stores; ``InvalidArgumentError`` for any other scheme (``urls.tier_url``), before anything is opened."""
    url = tier_url(url)
    if urlsplit(url).scheme in LOCAL_SCHEMES:
        return LocalTier(local_path(url), fsync=True)
    return RemoteTier(
        url, storage_options=storage_options, retry=retry, part_bytes=part_bytes, part_concurrency=part_concurrency
    )


class RemoteTier(Tier):
    """An fsspec filesystem under a root prefix, with retries. Thread-safe."""

    durable = True
    vectored_reads = True  # a run of chunks: a few ranged GETs in parallel, straight into its buffers

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        retry: RetryOptions | None = None,
        part_bytes: int = 8 * 2**20,
        part_concurrency: int = 16,
    ) -> None:
        self.url = redact(url).rstrip("/")
        self.retry = retry or RetryOptions()
        self.part_bytes = part_bytes
        self.part_concurrency = part_concurrency
        self._scheme = urlsplit(url).scheme
        self._option_keys = tuple(storage_options or {})  # named in a credentials error (their values never)
        options = {"skip_instance_cache": True, "use_listings_cache": False, **(storage_options or {})}
        if urlsplit(url).scheme in ("s3", "s3a"):
            # One attempt per call in botocore and in s3fs: the retries (and their count) are ours,
            # with our limits and jitter. Set them in storage_options to have it otherwise.
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("retries", {"total_max_attempts": 1})
            # Parts go out as views of the memory they were read into, uncopied: botocore's checks
            # of parameters take only bytes or bytearray (aiohttp sends any buffer).
            config.setdefault("parameter_validation", False)
            # No SHA-256 of every body (botocore signs payloads over plain HTTP, and over HTTPS
            # unless it added the checksum itself): 0.8 s of CPU per GiB. Parts carry their CRC32C
            # in a signed header, which the store checks; other PUTs botocore's own checksum.
            config["s3"] = {"payload_signing_enabled": False, **(config.get("s3") or {})}
            options["config_kwargs"] = config
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **options)
        except ImportError as e:
            extra = EXTRAS.get(urlsplit(url).scheme)
            if extra is None:
                raise RemoteStorageError(f"cannot open {self.url}: {e}") from None
            package, name = extra
            raise RemoteStorageError(
                f"cannot open {self.url}: {package} is not installed; pip install 'tiercheck[{name}]' "
                f"(or 'tiercheck[all]') ({e})"
            ) from None
        except ValueError as e:  # adlfs: no account or credentials
            hint = credential_sources(self._scheme, self._option_keys)
            raise RemoteStorageError(f"cannot open {self.url}: {e}{f'; {hint}' if hint else ''}") from None
        self.root = root.rstrip("/")
        if urlsplit(url).scheme in ("s3", "s3a") and hasattr(self.fs, "retries"):
            self.fs.retries = 1  # s3fs's own retry loop (a class attribute, not an option)
        self.counters = {"requests": 0, "retries": 0, "bytes_up": 0, "bytes_down": 0, "parts": 0,
                         "part_bytes_in_flight": 0, "part_bytes_peak": 0}  # fmt: skip
        self._lock = threading.Lock()
        self._aborted = threading.Event()
        # Every upload of this tier shares one bound: parts in flight, and parts read ahead of them.
        self.inflight = Inflight(part_concurrency, self.counters, self._lock)

    @property
    def part_buffer_bytes(self) -> int:
        """The most memory uploads hold in parts at once: parts in flight and read ahead of them."""
        return self.part_concurrency * self.part_bytes

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
                brief(exc),
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
        except (FileNotFoundError, UnsafeCheckpointError, RemoteStorageError, SourceError):
            raise
        except Exception as e:  # botocore / azure-core errors are not all OSErrors: one type for callers
            if is_transient(e):
                stats = retrying.statistics
                why = "the tier was closed" if self._aborted.is_set() else "retry limits"
                raise RemoteStorageError(
                    f"{self.url}: {what}: gave up after {stats.get('attempt_number', 1)} attempt(s) in "
                    f"{stats.get('delay_since_first_attempt', 0.0):.0f} s ({why}: {r.attempts} attempts / "
                    f"{r.deadline_s:.0f} s): {brief(e)}"
                ) from e
            unresolved = transient.unresolved_host(e)
            if unresolved is not None:
                raise RemoteStorageError(f"{self.url}: {what}: {unresolved}") from e
            status = status_of(e)
            if isinstance(e, PermissionError) or status in (401, 403):
                raise RemoteStorageError(f"{self.url}: {what}: access denied ({brief(e)})") from e
            if status == 404:  # azure: a missing container on write comes back as a bare 404
                raise RemoteStorageError(f"{self.url}: {what}: no such bucket or container ({brief(e)})") from e
            if missing_credentials(e):
                hint = credential_sources(self._scheme, self._option_keys)
                raise RemoteStorageError(f"{self.url}: {what}: no credentials found ({brief(e)}); {hint}") from e
            raise RemoteStorageError(f"{self.url}: {what}: {brief(e)}") from e

    # ------------------------------------------------------------------------------ Tier API

    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        # bytes, not bytearray: azure-storage takes a bytearray for an iterable of ints. join returns a
        # lone bytes part itself, uncopied: what copies between tiers pass (from read_bytes).
        data = b"".join(parts)
        target = self._p(path)
        upload = part_upload(self.fs, target) if len(data) >= 2 * self.part_bytes else None
        if upload is not None:  # big objects: in parts, in flight under the tier's bound, as streams go
            self._write_parts(path, upload, lambda: [data], part_size(self.part_bytes, len(data)))
            return
        try:
            self._call(f"writing {path}", lambda: self.fs.pipe_file(target, data))
        except FileNotFoundError as e:  # writes create keys: only the bucket / container can be missing
            raise RemoteStorageError(f"{self.url}: writing {path}: no such bucket or container ({brief(e)})") from e
        with self._lock:
            self.counters["bytes_up"] += len(data)

    def piece_bytes(self, size: int) -> int:
        """Pieces of the part size: each goes out as one part, uncopied."""
        return part_size(self.part_bytes, size)

    def write_stream(self, path: str, pieces: Callable[[], Iterable[Buffer]], *, size: int | None = None) -> None:
        """Stream into one object with up to ``part_concurrency`` parts in flight: a multipart
        upload (S3) or staged blocks and a block list (Azure), each part retried on its own and
        the upload completed when the last part is in. ``pieces`` is called once and runs ahead
        of the uploads by at most the free slots of the tier's bound (``part_buffer_bytes``), all
        uploads of the tier sharing it. A failure aborts the upload: nothing becomes visible,
        no parts are left behind. Objects under two parts, and filesystems without parts, go as
        one request or one stream."""
        target = self._p(path)
        upload = part_upload(self.fs, target)
        if upload is None:
            self._write_stream_file(path, target, pieces)
        elif size is not None and size < 2 * self.part_bytes:
            self.write(path, list(pieces()))
        else:
            self._write_parts(path, upload, pieces, part_size(self.part_bytes, size))

    def _write_parts(self, path: str, upload: PartUpload, pieces: Callable[[], Iterable[Buffer]], part: int) -> None:
        try:
            self._send_parts(path, upload, sourced(pieces), part)
        except SourceError as e:  # the source's own failure (a rotten chunk, a file gone), as raised
            raise e.args[0] from None
        except FileNotFoundError as e:  # writes create keys: only the bucket / container can be missing
            if transient.no_such_upload(e):  # ... or the upload, aborted by another run's drain or a lifecycle rule
                raise RemoteStorageError(f"{self.url}: writing {path}: its {upload.kind} was aborted by another client "
                                         f"(another run writing to this prefix?) ({brief(e)})") from e  # fmt: skip
            raise RemoteStorageError(f"{self.url}: writing {path}: no such bucket or container ({brief(e)})") from e

    def _send_parts(self, path: str, upload: PartUpload, pieces: Callable[[], Iterable[Buffer]], part: int) -> None:
        what = f"writing {path}"
        self._call(f"{what}: starting its {upload.kind}", upload.start)

        def put(number: int, data: Buffer) -> Any:
            return self._call(f"{what}: part {number}", lambda: upload.put(number, data))

        try:
            tokens = self.inflight.send(pieces(), part, put)
            if not tokens:  # nothing to send: an empty object, which a multipart upload cannot be
                self._abort_upload(upload, what)
                self.write(path, [])
                return
            self._call(f"{what}: completing its {upload.kind} of {len(tokens)} parts", lambda: upload.complete(tokens))
        except BaseException:
            self._abort_upload(upload, what)
            raise

    def _abort_upload(self, upload: PartUpload, what: str) -> bool:
        """Drop an upload's parts; False (logged) where that failed too: ``discard_unfinished``
        finds it again when the copy resumes or its step is deleted."""
        try:
            self._call(f"{what}: aborting its {upload.kind}", upload.abort)
            return True
        except Exception as e:
            log.warning("%s: %s: could not abort the %s (%s); it is dropped when the copy resumes", self.url, what,
                        upload.kind, e)  # fmt: skip
            return False

    def part_checksums(self, path: str) -> tuple[str, int] | None:
        target = self._p(path)
        return self._call(f"looking up {path}'s checksums", lambda: composite_crc32c(self.fs, target))

    def discard_unfinished(self, path: str, names: set[str] | None = None) -> int:
        """Abort the uploads under ``path`` that were started and never completed (a crash, a
        killed job): of the objects ``names`` (relative to ``path``), or all of them. Returns
        how many there were. Credentials that may not list uploads (S3's
        ``s3:ListBucketMultipartUploads``) leave them, with a warning: the store's lifecycle rules
        (``AbortIncompleteMultipartUpload``) or Azure's one-week expiry of uncommitted blocks
        drop them then."""
        prefix = self._p(path)
        what = f"listing unfinished uploads under {path}"
        try:
            found = self._call(what, lambda: list(unfinished(self.fs, prefix, names)))
        except FileNotFoundError as e:
            raise RemoteStorageError(f"{self.url}: {what}: no such bucket or container ({brief(e)})") from e
        except RemoteStorageError as e:
            cause = e.__cause__
            if not (isinstance(cause, PermissionError) or (cause is not None and status_of(cause) in (401, 403))):
                raise
            log.warning("%s: %s: not allowed (%s); unfinished uploads there stay until the store expires them",
                        self.url, what, brief(cause))  # fmt: skip
            return 0
        for upload in found:
            self._abort_upload(upload, f"an unfinished upload under {path}")
        if found:
            log.info("%s: dropped %d unfinished upload(s) under %s", self.url, len(found), path)
        return len(found)

    def _write_stream_file(self, path: str, target: str, pieces: Callable[[], Iterable[Buffer]]) -> None:
        """A filesystem without parts: one stream, started over on a transient failure."""
        sent = 0

        def upload() -> None:
            nonlocal sent
            sent = 0
            f = self.fs.open(target, "wb", block_size=max(self.part_bytes, MIN_PART_BYTES))
            try:
                for piece in sourced(pieces)():  # a failed source (a rotten chunk) is not ours to retry
                    f.write(piece)
                    sent += len(piece)
            except BaseException:
                # Not close(): that would complete the upload with what was sent so far.
                with contextlib.suppress(Exception):
                    f.discard()
                f.closed = True  # and not on garbage collection either (fsspec's __del__ closes)
                raise
            f.close()

        try:
            self._call(f"writing {path}", upload)
        except SourceError as e:
            raise e.args[0] from None
        except FileNotFoundError as e:
            raise RemoteStorageError(f"{self.url}: writing {path}: no such bucket or container ({brief(e)})") from e
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

    def _get(self, path: str, target: str, offset: int, length: int) -> bytes:
        """One ranged GET, retried: fewer bytes (none) where the object ends first."""
        if length <= 0:
            return b""

        def get() -> bytes:
            try:
                got: bytes = self.fs.cat_file(target, start=offset, end=offset + length)
            except Exception as e:
                # As a file ends early: nothing there, not an error (the reader finds the object short:
                # the step's damage). At offset 0 too: an empty object answers any range with a 416.
                if past_the_end(e):
                    return b""
                raise
            return got

        data: bytes = self._call(f"reading {path} [{offset}, {offset + length})", get)
        with self._lock:
            self.counters["bytes_down"] += len(data)
        return data

    def _get_into(self, path: str, target: str, offset: int, view: memoryview) -> int:
        """``_get`` into ``view``, copied there as the bytes arrive."""

        def get() -> int:
            try:
                n = get_into(self.fs, target, offset, view)
            except Exception as e:
                if past_the_end(e):
                    return 0
                raise
            if n is None:  # a filesystem without ranged reads into buffers
                data = self.fs.cat_file(target, start=offset, end=offset + len(view))
                n = len(data)
                view[:n] = data
            return n

        n: int = self._call(f"reading {path} [{offset}, {offset + len(view)})", get)
        with self._lock:
            self.counters["bytes_down"] += n
        return n

    def read_range(self, path: str, offset: int, length: int) -> bytes | bytearray:
        if length < 2 * self.part_bytes:
            return self._get(path, self._p(path), offset, length)
        length = min(length, self._size_after(path, offset))  # a hostile length allocates nothing
        out = bytearray(length)
        with memoryview(out) as view:
            n, _ = self.read_into(path, view, offset=offset, length=length)
        del out[n:]
        return out

    def _size_after(self, path: str, offset: int) -> int:
        target = self._p(path)
        info = self._call(f"looking up {path}", lambda: self.fs.info(target))
        return max(0, int(info.get("size") or 0) - offset)

    def read_into(self, path: str, out: memoryview, *, offset: int = 0, length: int | None = None) -> tuple[int, bytes]:
        """Large ranges are read as ``part_bytes`` ranged GETs, ``part_concurrency`` in flight,
        each copied into ``out`` as it lands (the bytes past ``len(out)`` are returned, as many
        as the object holds)."""
        if length is None or length < 2 * self.part_bytes:
            data = self.read_bytes(path) if length is None else self._get(path, self._p(path), offset, length)
            if length is None and offset:
                data = data[offset:]
            n = min(len(data), len(out))
            out[:n] = memoryview(data)[:n]  # one copy, not two (read() copies into a writable bytearray)
            return n, data[n:]
        if length - len(out) > self.part_bytes:  # a hostile length: bounded by the object, not allocated
            length = min(length, self._size_after(path, offset))
        rest = bytearray(max(0, length - len(out)))  # past the end of ``out``: a chunk's checksum
        n, _ = self.read_vectored(path, offset, [out[:length], memoryview(rest)])
        return min(n, len(out)), bytes(rest[: max(0, n - len(out))])

    def read_vectored(
        self,
        path: str,
        offset: int,
        views: Sequence[memoryview],
        *,
        direct: bool = False,
        each: Callable[[memoryview], None] | None = None,
    ) -> tuple[int, bool]:
        """Fill ``views`` from ``path`` at ``offset`` on with ranged GETs of about ``part_bytes``,
        ``part_concurrency`` in flight (``Inflight.fill``: a restore's run of chunks, a large
        chunk). Returns the bytes read (fewer where the object ends first) and False: there is
        no page cache to bypass. ``each`` is passed the bytes read once all are (GETs land out of order)."""
        target = self._p(path)

        def get(at: int, view: memoryview) -> int:
            return self._get_into(path, target, offset + at, view)

        n = self.inflight.fill(views, self.part_bytes, get)
        return n, pass_read(views, n, each)

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

        return self._call(f"listing {path or store_place(self._scheme, self.root)}", ls)

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
        try:  # and what uploads cut short left there, which no listing of objects shows
            self.discard_unfinished(path)
        except RemoteStorageError as e:
            log.warning("%s: could not look for unfinished uploads under %s: %s", self.url, path, e)

    def sync_dirs(self, path: str) -> None:
        """Object stores have no directories; an acknowledged PUT is durable."""
