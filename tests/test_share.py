"""Chunks passed between processes of one host through shared memory (``restore.share``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import zlib

import pytest
import torch

from tiercheck.errors import TiercheckError
from tiercheck.restore.share import Sharing, host_key, unshared

pytestmark = pytest.mark.skipif(host_key() is None, reason="no memfd_create or /proc on this system")

READER = """
import sys, zlib, torch
from tiercheck.restore.share import Inbox
header = torch.tensor([int(x) for x in sys.argv[1:]], dtype=torch.int64)
inbox = Inbox()
print(zlib.crc32(inbox.view(header, where="test").numpy().tobytes()))
inbox.close()
"""


def test_a_chunk_put_once_is_read_by_another_process_by_its_header() -> None:
    a = torch.arange(1000, dtype=torch.float32).view(torch.uint8)
    b = torch.randn(3001).view(torch.uint8)
    with Sharing() as sharing:
        outbox = sharing.open_outbox({"a": a.numel(), "b": b.numel()})
        outbox.put("a", a)
        outbox.slot("b").copy_(b)  # read straight into its place: put copies nothing then
        outbox.put("b", outbox.slot("b"))
        ha, hb = outbox.header("a"), outbox.header("b")
        assert hb[2] % 4096 == 0  # each chunk starts on a page: its dtype view is aligned
        out = subprocess.run(
            [sys.executable, "-c", READER, *map(str, hb.tolist())], capture_output=True, text=True, check=True
        )
        assert int(out.stdout) == zlib.crc32(b.numpy().tobytes())
        assert torch.equal(sharing.inbox.view(ha, where="test"), a)  # and in this process too
        assert "/memfd:tiercheck-restore" in memory_files()
    assert "/memfd:tiercheck-restore" not in memory_files()  # let go of with the attempt; it had no name


def memory_files() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.add(os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)"))
    return out


def test_a_header_that_names_no_memory_or_lies_past_it_is_a_clear_error() -> None:
    with Sharing() as sharing:
        outbox = sharing.open_outbox({"a": 100})
        outbox.put("a", torch.zeros(100, dtype=torch.uint8))
        header = outbox.header("a")
        bad = header.clone()
        bad[2] = 4000  # 100 bytes from 4000 run past the 4096 shared
        with pytest.raises(TiercheckError, match=r"step 1: shared chunk \[4000, 4100\) is past the 4,096 bytes shared"):
            sharing.inbox.view(bad, where="step 1")
        with pytest.raises(TiercheckError, match=rf"step 1: the rank process {os.getpid()} that read it could not share it"):
            sharing.inbox.view(unshared(), where="step 1")
        gone = header.clone()
        gone[1] = 10_000  # no such descriptor in the sender
        with pytest.raises(TiercheckError, match=rf"cannot map the shared memory of rank process {os.getpid()}.*/fd/10000"):
            sharing.inbox.view(gone, where="step 1")


def test_an_outbox_takes_each_chunk_only_at_its_size() -> None:
    with Sharing() as sharing:
        outbox = sharing.open_outbox({"a": 4000})
        with pytest.raises(AssertionError, match="10 bytes, not the 4,000 of its place"):
            outbox.put("a", torch.zeros(10, dtype=torch.uint8))
