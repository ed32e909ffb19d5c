"""Objects moved in parts, many in flight (invariant 12, docs/design.md): the object stores' own protocols.

One stream to S3 or Azure moves ~100-300 MB/s; a node's link and the store take several GB/s
with tens of parts in flight. An upload here is a multipart upload (S3) or staged blocks plus a
block list (Azure): each part is its own request, retried on its own (``RemoteTier`` drives them
from a pool of threads), with its checksum sent along so that the store refuses a part damaged on
the way (S3 ``x-amz-checksum-crc32c``, Azure ``Content-MD5``). Nothing is visible until the upload
completes; an upload that fails or is cut short by a crash is aborted (``abort``) or found later
(``unfinished``) and aborted then, so no parts are left behind to be billed.

Which protocol a filesystem speaks is told by what it has (s3fs's ``call_s3``, adlfs's
``service_client``), not by its class; any other fsspec filesystem gets ``None`` and is written as
one stream.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any, TypeVar

from awscrt import checksums

from tiercheck.tiers.base import Buffer

T = TypeVar("T")

MiB = 2**20
MAX_PARTS = 10_000  # S3's limit on parts of one upload (Azure's on blocks: 50,000)
MIN_PART_BYTES = 5 * MiB  # S3's smallest part but the last
_AZURE_META = {"is_directory": "false"}  # what adlfs writes on every blob it uploads


def part_size(part_bytes: int, size: int | None) -> int:
    """The part size for an object of ``size`` bytes: ``part_bytes``, or more (whole MiB) where
    the object would otherwise need more than ``MAX_PARTS`` parts."""
    if size is None or size <= part_bytes * MAX_PARTS:
        return part_bytes
    return -(-size // (MAX_PARTS * MiB)) * MiB


class PartUpload(ABC):
    """One object uploaded in parts. Call order, from any threads: ``start`` once; ``put`` for each
    part, concurrently, numbered from 1 in the object's order; then ``complete`` with what each
    ``put`` returned, in part order, or ``abort``. Each call is one request (the caller retries)."""

    #: The store's words for the upload, for messages ("multipart upload", "block list").
    kind: str

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def put(self, number: int, data: Buffer) -> Any:
        """Send part ``number``; returns what ``complete`` needs of it."""

    @abstractmethod
    def complete(self, tokens: list[Any]) -> None: ...

    @abstractmethod
    def abort(self) -> None:
        """Drop every part sent (no error when there is nothing to drop)."""


def _store(fs: Any) -> str | None:
    """Which store's protocol ``fs`` speaks, by what it has: s3fs's ``call_s3``, adlfs's
    ``service_client`` (both on fsspec's event loop)."""
    if callable(getattr(fs, "call_s3", None)):
        return "s3"
    if getattr(fs, "service_client", None) is not None and hasattr(fs, "loop"):
        return "azure"
    return None


def part_upload(fs: Any, target: str) -> PartUpload | None:
    """The upload in parts of ``target`` (``bucket/key``) through ``fs``; None where the
    filesystem has no such protocol."""
    store = _store(fs)
    return S3Upload(fs, target) if store == "s3" else AzureUpload(fs, target) if store == "azure" else None


def unfinished(fs: Any, prefix: str, names: set[str] | None) -> Iterator[PartUpload]:
    """Uploads under ``prefix`` (``bucket/path``) started and never completed (a crash, a killed
    job): those of the objects ``names`` (relative to ``prefix``), or all with None."""
    store = _store(fs)
    if store == "s3":
        yield from S3Upload.unfinished(fs, prefix, names)
    elif store == "azure":
        yield from AzureUpload.unfinished(fs, prefix, names)


def parts_of(pieces: Iterable[Buffer], size: int) -> Iterator[Buffer]:
    """``pieces`` as parts of ``size`` bytes (the last may be shorter, and one gathered from small
    pieces a little longer): a piece of that size passes uncopied (what ``RemoteTier.piece_bytes``
    asks the sources for), a larger one as views of ``size``-byte slices, smaller ones gathered."""
    pending = bytearray()
    for piece in pieces:
        if not pending and len(piece) >= size:
            view = memoryview(piece).cast("B")
            whole = len(view) - len(view) % size
            yield from (view[at : at + size] for at in range(0, whole, size))
            if whole == len(view):
                continue
            piece = view[whole:]
        pending += piece
        if len(pending) >= size:
            yield pending
            pending = bytearray()
    if pending:
        yield pending


def get_into(fs: Any, target: str, offset: int, view: memoryview) -> int | None:
    """One ranged GET of ``len(view)`` bytes of ``target`` from ``offset``, copied into ``view``
    as they arrive from the network (no bytes object of the range in between); the bytes read,
    fewer where the object ends first. None where the filesystem has no such call."""
    from fsspec.asyn import sync

    store = _store(fs)
    if not len(view):
        return 0
    if store == "s3":
        bucket, key, _ = fs.split_path(target)
        rng = f"bytes={offset}-{offset + len(view) - 1}"

        async def s3() -> int:
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=rng)
            body = resp["Body"]
            try:
                pos = 0
                while pos < len(view):
                    n = await body.readinto(view[pos:])
                    if not n:
                        break
                    pos += n
                return pos
            finally:
                body.close()

        return int(sync(fs.loop, s3))
    if store == "azure":
        container, blob, _ = fs.split_path(target)

        async def azure() -> int:
            from azure.core.exceptions import ResourceNotFoundError

            async with fs.service_client.get_blob_client(container, blob) as bc:
                try:
                    stream = await bc.download_blob(offset=offset, length=len(view), max_concurrency=1)
                except ResourceNotFoundError as e:
                    raise FileNotFoundError(target) from e
                into = _Into(view)
                await stream.readinto(into)
                return into.pos

        return int(sync(fs.loop, azure))
    return None


class _Into:
    """A writable stream over a buffer, for clients that write what they download into one."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.pos = 0

    def write(self, data: Buffer) -> int:
        n = len(data)
        if self.pos + n > len(self.view):
            raise ValueError(f"the store sent more than the {len(self.view)} bytes asked for")
        self.view[self.pos : self.pos + n] = data
        self.pos += n
        return n

    def seekable(self) -> bool:
        return False


def composite_crc32c(fs: Any, target: str) -> tuple[str, int] | None:
    """What S3 kept of a multipart object's checksums (``x-amz-checksum-crc32c`` of type
    COMPOSITE: ``base64-N``, the CRC32C of the parts' CRC32Cs) and the size of its first part
    (the parts are cut the same but the last); None where the store kept none, or no parts."""
    if _store(fs) != "s3":
        return None
    bucket, key, _ = fs.split_path(target)
    head = fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    crc = head.get("ChecksumCRC32C")
    if not isinstance(crc, str) or "-" not in crc:
        return None
    first = fs.call_s3("head_object", Bucket=bucket, Key=key, PartNumber=1)
    return crc, int(first["ContentLength"])


def composite_of(crcs: list[int]) -> str:
    """The composite checksum S3 keeps for parts with these CRC32Cs (``composite_crc32c``)."""
    folded = checksums.crc32c(b"".join(c.to_bytes(4, "big") for c in crcs))
    return f"{base64.b64encode(folded.to_bytes(4, 'big')).decode()}-{len(crcs)}"


def crc32c_b64(data: Buffer) -> str:
    """A part's CRC32C as S3 takes it: big-endian, base64 (awscrt: the GIL released)."""
    return base64.b64encode(checksums.crc32c(data).to_bytes(4, "big")).decode()


class S3Upload(PartUpload):
    """An S3 multipart upload through s3fs's client (``call_s3``: aiobotocore on fsspec's loop)."""

    kind = "multipart upload"

    def __init__(self, fs: Any, target: str, upload_id: str | None = None) -> None:
        self.fs = fs
        self.bucket, self.key, _ = fs.split_path(target)
        self.upload_id = upload_id

    def start(self) -> None:
        out = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key, ChecksumAlgorithm="CRC32C")
        self.upload_id = out["UploadId"]

    def put(self, number: int, data: Buffer) -> dict[str, Any]:
        crc = crc32c_b64(data)
        out = self.fs.call_s3(
            "upload_part",
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            PartNumber=number,
            Body=data,
            ChecksumCRC32C=crc,
        )
        return {"PartNumber": number, "ETag": out["ETag"], "ChecksumCRC32C": crc}

    def complete(self, tokens: list[Any]) -> None:
        self.fs.call_s3(
            "complete_multipart_upload",
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": tokens},
        )
        self.fs.invalidate_cache(f"{self.bucket}/{self.key}")

    def abort(self) -> None:
        if self.upload_id is None:
            return
        with contextlib.suppress(FileNotFoundError):  # NoSuchUpload: already gone
            self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)

    @classmethod
    def unfinished(cls, fs: Any, prefix: str, names: set[str] | None) -> Iterator[S3Upload]:
        bucket, key, _ = fs.split_path(prefix)
        key_prefix = f"{key}/" if key else ""
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": key_prefix}
        while True:
            out = fs.call_s3("list_multipart_uploads", **kwargs)
            for u in out.get("Uploads") or []:
                rel = str(u.get("Key", ""))[len(key_prefix) :]
                if names is None or rel in names:
                    yield cls(fs, f"{bucket}/{u['Key']}", upload_id=u["UploadId"])
            if not out.get("IsTruncated"):
                return
            kwargs["KeyMarker"] = out.get("NextKeyMarker")
            kwargs["UploadIdMarker"] = out.get("NextUploadIdMarker")


class AzureUpload(PartUpload):
    """Staged blocks and a block list through adlfs's client (azure-storage-blob's aio client on
    fsspec's loop). Block ids are this upload's own (a random prefix and the part number), so two
    uploads of one blob never take each other's blocks."""

    kind = "block list"

    def __init__(self, fs: Any, target: str) -> None:
        self.fs = fs
        self.container, self.blob, _ = fs.split_path(target)
        self._prefix = uuid.uuid4().hex[:16]

    def _run(self, make: Callable[[Any], Coroutine[Any, Any, T]]) -> T:
        from fsspec.asyn import sync

        async def go() -> T:
            async with self.fs.service_client.get_blob_client(self.container, self.blob) as bc:
                return await make(bc)

        return sync(self.fs.loop, go)

    def _id(self, number: int) -> str:
        return f"{self._prefix}{number:08d}"  # the client base64-encodes it

    def start(self) -> None:
        """Blocks need no upload to belong to."""

    def put(self, number: int, data: Buffer) -> str:
        block = self._id(number)
        # Content-MD5 of our own (hashlib releases the GIL): the client's validate_content takes
        # only bytes, and parts are views of the memory they were read into.
        md5 = hashlib.md5(data).digest()
        self._run(lambda bc: bc.stage_block(block, data, length=len(data), transactional_content_md5=md5))
        return block

    def complete(self, tokens: list[Any]) -> None:
        from azure.storage.blob import BlobBlock

        blocks = [BlobBlock(block_id=t) for t in tokens]
        self._run(lambda bc: bc.commit_block_list(blocks, metadata=_AZURE_META))
        self.fs.invalidate_cache(f"{self.container}/{self.blob}")

    def abort(self) -> None:
        """Uncommitted blocks cannot be deleted one by one: committing a block list drops every
        uncommitted block of the blob. A blob that exists keeps its committed blocks; one that
        did not is created empty and deleted again."""

        async def drop(bc: Any) -> None:
            from azure.core.exceptions import ResourceNotFoundError
            from azure.storage.blob import BlobBlock

            try:
                committed, uncommitted = await bc.get_block_list("all")
            except ResourceNotFoundError:
                return
            if not uncommitted:
                return
            if committed:
                await bc.commit_block_list([BlobBlock(block_id=b.id) for b in committed], metadata=_AZURE_META)
                return
            await bc.commit_block_list([])
            with contextlib.suppress(ResourceNotFoundError):
                await bc.delete_blob()

        self._run(drop)

    @classmethod
    def unfinished(cls, fs: Any, prefix: str, names: set[str] | None) -> Iterator[AzureUpload]:
        """Blobs under ``prefix`` with uncommitted blocks only (listed with ``uncommittedblobs``
        and not without). A committed blob holding an unfinished upload's blocks beside its own
        is left: the copy that resumes replaces or deletes it, which drops them too."""
        from fsspec.asyn import sync

        container, path, _ = fs.split_path(prefix)
        blob_prefix = f"{path}/" if path else ""

        async def listed() -> set[str]:
            async with fs.service_client.get_container_client(container) as cc:
                every = {
                    b.name async for b in cc.list_blobs(name_starts_with=blob_prefix, include=["uncommittedblobs"])
                }
                return every - {b.name async for b in cc.list_blobs(name_starts_with=blob_prefix)}

        for name in sorted(sync(fs.loop, listed)):
            if names is None or name[len(blob_prefix) :] in names:
                yield cls(fs, f"{container}/{name}")
