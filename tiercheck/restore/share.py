"""Chunks passed between ranks of one host through shared memory, not the process group.

A chunk read by one rank and needed by others on the same host (data-parallel replicas, the
tensor-parallel ranks of a node after a reshard) would otherwise cross the process group: over
gloo that is a TCP loopback, several copies and a kernel round trip per chunk. Here the reading
rank copies each such chunk once into a memory file (``Outbox``, a ``memfd``), whatever the number
of ranks on its host that need it, and sends each of them only where it lies: ``HEADER`` int64s
over the process group, with the same tag the bytes would have had. A receiving rank
maps the sender's file once (``Inbox``, through ``/proc/<pid>/fd/<fd>``) and copies from it.

Ranks use this path with each other only when they share a host key (``host_key``): the same
kernel boot, the same PID namespace (so ``/proc/<pid>`` names the sender) and the same user. The
memory belongs to no name: it is freed when the sender and every rank that mapped it have let go
of it, so a killed restore leaves nothing behind in ``/dev/shm``.

Call order, per restore attempt: the sender creates its ``Outbox`` with a place for every chunk it
shares, ``put``s each chunk there once and sends each receiver its ``header``; receivers ``view``
the chunk by that header. The sender closes its outbox only after every rank has finished moving
its chunks (the restore's next meeting point), so no receiver opens a file that is gone.
"""


from __future__ import annotations

import contextlib
import functools
import hashlib
import mmap
import os
from collections.abc import Hashable, Mapping

import torch

from tiercheck.errors import TiercheckError
from tiercheck.format.layout import Chunk
from tiercheck.format.manifest import ArrayRecord
from tiercheck.restore.stage import ReadItem
from tiercheck.state.staging import align_up


@functools.cache
def host_key() -> str | None:
    """Ranks whose keys are equal can map each other's memory files; None where this process
    cannot share them (not Linux, no ``memfd_create``)."""
    if not hasattr(os, "memfd_create"):
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    # Short: every rank posts it with what it needs, to each coordinator of its arrays.
    return hashlib.blake2b(f"{boot}/{pid_ns}/{os.geteuid()}".encode(), digest_size=8).hexdigest()


HEADER = 4  # int64s: sender pid, its file descriptor, the chunk's offset in the file, its bytes


def unshared() -> torch.Tensor:
    """The header a sender sends in place of a chunk it could not share (its memory file could not
    be made): the receiver fails the chunk, and the sender's own error says why."""
    return torch.tensor([os.getpid(), -1, 0, 0], dtype=torch.int64)


class Outbox:
    """The memory file one rank copies the chunks it shares with ranks on its host into, each once,
    at a place fixed up front (so reading threads copy chunks in side by side)."""

    def __init__(self, sizes: Mapping[Hashable, int]) -> None:
        self._slots: dict[Hashable, tuple[int, int]] = {}
        pos = 0
        for key, n in sizes.items():
            self._slots[key] = (pos, n)
            pos += align_up(n)  # each chunk starts on a page of the file: its dtype view is aligned
        self.nbytes = max(pos, 1)
        self._fd = os.memfd_create("tiercheck-restore", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, self.nbytes)
            # Pages are allocated as chunks are copied in, by the threads reading them: populating
            # all of them here first would hold every read back (0.5 s for 512 MiB on 2 cores).
            self._map: mmap.mmap | None = mmap.mmap(self._fd, self.nbytes, flags=mmap.MAP_SHARED)
        except OSError as e:
            os.close(self._fd)
            raise TiercheckError(
                f"cannot set up {self.nbytes:,} bytes of shared memory for the chunks this rank sends to "
                f"ranks on its host: {e}; DistributedOptions(share_memory=False) sends them over the process group"
            ) from e
        self._memory = torch.frombuffer(self._map, dtype=torch.uint8)

    def slot(self, key: Hashable) -> torch.Tensor:
        """Chunk ``key``'s place (uint8), to read the chunk straight into."""
        start, n = self._slots[key]
        return self._memory[start : start + n]

    def put(self, key: Hashable, data: torch.Tensor) -> None:
        """Copy chunk ``key``'s bytes (uint8) into its place, unless they were read there; once,
        from any thread."""
        place = self.slot(key)
        if data.numel() != place.numel():
            raise AssertionError(f"shared chunk {key}: {data.numel():,} bytes, not the {place.numel():,} of its place")
        if data.data_ptr() != place.data_ptr():
            place.copy_(data)

    def header(self, key: Hashable) -> torch.Tensor:
        """Where chunk ``key`` lies, to send to each rank receiving it (once it is ``put``)."""
        start, n = self._slots[key]
        return torch.tensor([os.getpid(), self._fd, start, n], dtype=torch.int64)

    def close(self) -> None:
        if self._map is None:
            return
        del self._memory
        with contextlib.suppress(BufferError):  # a view still held elsewhere: unmapped with it
            self._map.close()
        self._map = None
        os.close(self._fd)


class Inbox:
    """The memory files of the senders on this host, each mapped once, read from as chunks arrive."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], tuple[mmap.mmap, torch.Tensor]] = {}

    def view(self, header: torch.Tensor, *, where: str) -> torch.Tensor:
        """The chunk a header names, as uint8 in the sender's memory (valid until ``close``)."""
        pid, fd, start, n = (int(x) for x in header.tolist())
        if fd < 0:
            raise TiercheckError(f"{where}: the rank process {pid} that read it could not share it (it says why)")
        mapped = self._maps.get((pid, fd))
        if mapped is None:
            path = f"/proc/{pid}/fd/{fd}"
            try:
                with open(path, "r+b", buffering=0) as f:
                    size = os.fstat(f.fileno()).st_size
                    m = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED)
            except OSError as e:
                raise TiercheckError(
                    f"{where}: cannot map the shared memory of rank process {pid} on this host ({path}): {e}; "
                    "DistributedOptions(share_memory=False) receives chunks over the process group"
                ) from e
            mapped = self._maps[(pid, fd)] = (m, torch.frombuffer(m, dtype=torch.uint8))
        m, memory = mapped
        if not 0 <= start <= start + n <= len(m):
            raise TiercheckError(f"{where}: shared chunk [{start}, {start + n}) is past the {len(m):,} bytes shared")
        return memory[start : start + n]

    def close(self) -> None:
        while self._maps:
            _, (m, memory) = self._maps.popitem()
            del memory
            with contextlib.suppress(BufferError):  # a view still held elsewhere: unmapped with it
                m.close()


class Sharing:
    """One restore attempt's shared memory: this rank's outbox (made once it knows its size) and
    its inbox. Closed only once every rank is done moving chunks (see the module's call order)."""

    def __init__(self) -> None:
        self.inbox = Inbox()
        self.outbox: Outbox | None = None
        # Chunks in shared memory (this rank's outbox or another's) for live tensors, filled in
        # only once every rank has verified every chunk: (chunk's record, chunk, its bytes, items).
        self.later: list[tuple[ArrayRecord, Chunk, torch.Tensor, list[ReadItem]]] = []

    def open_outbox(self, sizes: Mapping[Hashable, int]) -> Outbox:
        assert self.outbox is None
        self.outbox = Outbox(sizes)
        return self.outbox

    def __enter__(self) -> Sharing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.later.clear()
        self.inbox.close()
        if self.outbox is not None:
            self.outbox.close()
