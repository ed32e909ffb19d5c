"""A private directory on the real ``/dev/shm`` tmpfs for a test of the memory tier, removed after it."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def private_shm() -> Iterator[Path]:
    """``/dev/shm/tiercheck-test-<uuid>``, removed on leaving (the test is skipped without a ``/dev/shm``)."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm tmpfs on this machine")
    path = Path("/dev/shm") / f"tiercheck-test-{uuid.uuid4().hex}"
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
