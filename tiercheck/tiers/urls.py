"""Which URLs name a tier: a local directory (a path, ``file://``), an S3 bucket (``s3://``) or an Azure
container (``az://``, ``abfs://``). Checked before anything is created, listed or connected to, so that
a URL of any other scheme (``http://``, ``gs://``, ``hdfs://``, a typo) is refused at once, naming the
schemes that work: fsspec would have opened most of them and failed later, with a retry loop, a hint
about credentials, or a package to install for a backend tiercheck was never tested against.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from tiercheck.errors import InvalidArgumentError
from tiercheck.tiers.transient import redact

LOCAL_SCHEMES = ("", "file", "local")  # a directory, served by LocalTier (fsync, rename): never fsspec's

# The object stores, by URL scheme: the package that serves it and the extra of ours that installs it.
EXTRAS = {
    "s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"),
    "az": ("adlfs", "azure"), "abfs": ("adlfs", "azure"), "abfss": ("adlfs", "azure"), "adl": ("adlfs", "azure"),
}  # fmt: skip

WHAT_WORKS = (
    "tiercheck stores checkpoints in a local directory, file://PATH, s3://BUCKET/PREFIX, az://CONTAINER/PREFIX "
    "or abfs://CONTAINER/PREFIX"
)


def tier_url(url: str) -> str:
    """``url`` as a tier opens it, its scheme in lower case (schemes are case-insensitive: ``S3://`` is
    ``s3://``). ``InvalidArgumentError`` naming the schemes that work for any other scheme, and for an
    object store's URL fsspec would list nothing at (``s3:/bucket``, ``s3:bucket``)."""
    parts = urlsplit(url)
    scheme = parts.scheme  # urlsplit gives it in lower case
    if scheme not in LOCAL_SCHEMES and scheme not in EXTRAS:
        if "://" not in url:  # a relative path with a colon in its first name reads as a scheme
            raise InvalidArgumentError(
                f"{redact(url)}: reads as a URL of scheme {scheme!r}; {WHAT_WORKS} (for a local path, write ./{url})"
            )
        raise InvalidArgumentError(f"{redact(url)}: no {scheme}:// here; {WHAT_WORKS}")
    if scheme in EXTRAS and not parts.netloc:  # s3:/bucket or s3:bucket: fsspec would list nothing, silently
        raise InvalidArgumentError(
            f"{redact(url)}: not a URL fsspec can list; write {scheme}://bucket/prefix (two slashes)"
        )
    return scheme + url[len(scheme) :] if scheme else url


def local_path(url: str) -> str:
    """The directory a local tier's ``url`` (checked by ``tier_url``) names."""
    scheme = urlsplit(url).scheme
    if not scheme:
        return url
    rest = url[len(scheme) + 1 :]
    return rest[2:] if rest.startswith("//") else rest
