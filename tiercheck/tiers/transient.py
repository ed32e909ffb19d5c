"""Which errors of an object store are worth retrying, and how they are worded for people.

Object stores and their clients fail in many shapes: botocore ``ClientError`` codes, azure-core
``HttpResponseError`` status codes, aiohttp connection errors, plain ``OSError`` errnos. This
module reads each shape once, so that the remote tier's retry policy (``RemoteTier._call``) and its
messages say the same thing whichever client raised.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

# Error codes object stores use for "slow down / try again" and for their own failures.
_TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable", "ServerBusy",
    "OperationTimedOut", "InternalServerError", "BadGateway", "GatewayTimeout",
    "BadDigest", "Md5Mismatch", "Crc64Mismatch",
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


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then what caused it (``__cause__``, else ``__context__``), and so on down the chain:
    each exception once, so a chain that loops back on itself ends."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def is_transient(exc: BaseException) -> bool:
    """Whether retrying ``exc`` may succeed: throttling, server errors, resets, timeouts. Not a host
    name that does not resolve (``unresolved_host``), though its clients wrap it as a connection error."""
    if unresolved_host(exc) is not None:
        return False
    for e in causes(exc):
        if isinstance(e, FileNotFoundError | PermissionError | FileExistsError | IsADirectoryError):
            return False  # no such bucket / key, access denied: the same answer next time
        if isinstance(e, ConnectionError | TimeoutError | asyncio.TimeoutError):
            return True
        if type(e).__name__ in _TRANSIENT_NAMES or any(c.__name__ in _TRANSIENT_NAMES for c in type(e).__mro__):
            return True
        code = error_code(e)
        if code is not None:
            return code in _TRANSIENT_CODES
        status = getattr(e, "status_code", None) or getattr(e, "status", None)
        if isinstance(status, int):
            return status in (408, 429) or status >= 500
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
    return False


def unresolved_host(exc: BaseException) -> str | None:
    """Why ``exc`` (or what caused it) is a host name that does not resolve, naming the host where the
    client says it: the resolver's answer (no such name, no address), the same on every retry. None
    otherwise, and for ``EAI_AGAIN``, the resolver's own "try again" (a DNS server under load says it)."""
    host = None
    for e in causes(exc):
        host = host or getattr(e, "host", None)  # aiohttp's ClientConnectorError names it
        if isinstance(e, socket.gaierror) and e.errno != socket.EAI_AGAIN:
            named = f"host name {host!r}" if isinstance(host, str) else "the store's host name"
            return f"{named} does not resolve ({e.strerror or e}): check the URL and endpoint_url"
    return None


def error_code(e: BaseException) -> str | None:
    response = getattr(e, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        if code:
            return str(code)
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return str(status) if status else None
    code = getattr(e, "error_code", None)  # azure-core HttpResponseError
    return str(code) if code else None


def past_the_end(e: BaseException) -> bool:
    """Whether a ranged read failed only because it starts past the object's end (HTTP 416)."""
    for cur in causes(e):
        if status_of(cur) == 416 or error_code(cur) in ("InvalidRange", "InvalidRangeHeader"):
            return True
        if "range is not satisfiable" in str(cur).lower() or "range not satisfiable" in str(cur).lower():
            return True
    return False


def no_such_upload(e: BaseException) -> bool:
    """Whether ``e`` (s3fs's FileNotFoundError of a part or a completion) says the multipart
    upload is gone (aborted by another client), not the bucket."""
    return any(error_code(cur) == "NoSuchUpload" or type(cur).__name__ == "NoSuchUpload" for cur in causes(e))


def status_of(e: BaseException) -> int | None:
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


def store_place(scheme: str, root: str) -> str:
    """A tier's root as its object store names it, for messages ("listing /" said neither which
    bucket nor which prefix): "bucket 'b' prefix 'run'" (a container on Azure), else "/"."""
    if scheme not in ("s3", "s3a", "az", "abfs", "abfss", "adl"):
        return "/"
    bucket, _, prefix = root.partition("/")
    return f"{'container' if scheme in ('az', 'abfs', 'abfss', 'adl') else 'bucket'} {bucket!r} prefix {prefix!r}"


def brief(exc: BaseException | None) -> str:
    if exc is None:
        return "no error"
    code = error_code(exc) or (exc.__cause__ is not None and error_code(exc.__cause__))
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}{f' {code}' if code else ''}: {text}"
