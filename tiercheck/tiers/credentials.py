"""Where each object store's client looks for credentials, for an error that found none: the storage
options and environment variables it reads, which of them are set (by name: never a value), and the
files and services it tries after them.

``tiercheck ls s3://bucket/run`` with no credentials said ``listing /: NoCredentialsError``: nothing
about which bucket, nor what to set.
"""


from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice

from tiercheck.tiers.transient import causes


@dataclass(frozen=True, kw_only=True, slots=True)
class _Sources:
    options: tuple[str, ...]  # storage_options keys (the CLI's -o KEY=VALUE)
    env: tuple[str, ...]  # environment variables the client reads
    then: str  # what the client tries after them


_S3 = _Sources(
    options=("key", "secret", "token", "profile", "anon"),
    env=("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
         "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"),
    then="~/.aws/credentials and ~/.aws/config, and the instance's or container's role",
)  # fmt: skip
_AZURE = _Sources(
    options=("account_name", "account_key", "sas_token", "connection_string", "credential", "anon",
             "tenant_id", "client_id", "client_secret"),
    env=("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY",
         "AZURE_STORAGE_SAS_TOKEN", "AZURE_TENANT_ID", "AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET"),
    then="DefaultAzureCredential (a managed identity, `az login`) for an account name given without a key",
)  # fmt: skip
_BY_SCHEME = {"s3": _S3, "s3a": _S3, "az": _AZURE, "abfs": _AZURE, "abfss": _AZURE}

# The clients' errors for "no credentials found" (botocore; azure-identity, whose ClientAuthenticationError
# without an HTTP status is a token it could not get), by class name: no import.
_MISSING = frozenset({"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "ProfileNotFound",
                      "CredentialUnavailableError", "ClientAuthenticationError"})  # fmt: skip


def missing_credentials(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it, four deep at most) says the client found no usable credentials."""
    return any(t.__name__ in _MISSING for e in islice(causes(exc), 4) for t in type(e).__mro__)


def credential_sources(scheme: str, given: Iterable[str]) -> str:
    """What the client for ``scheme`` looked for, and which of it was there (``given``: the storage
    options' keys); empty for a scheme that takes no credentials (a local path)."""
    sources = _BY_SCHEME.get(scheme)
    if sources is None:
        return ""
    options = sorted(k for k in given if k in sources.options)
    env = [name for name in sources.env if os.environ.get(name)]
    return (
        f"credentials are looked for in storage options ({', '.join(sources.options)}; the CLI's -o KEY=VALUE: "
        f"{', '.join(options) or 'none'} given), in the environment ({', '.join(sources.env)}: "
        f"{', '.join(env) or 'none'} set), then {sources.then}"
    )
