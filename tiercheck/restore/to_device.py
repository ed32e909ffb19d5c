"""Copying host-staged data up to GPU tensors through a ring of page-locked buffers.

An all-or-nothing restore on a GPU too full to stage the state there stages it in ordinary host
memory, and copies it up once every chunk is verified. A copy from ordinary (pageable) memory goes
through the driver's own small bounce buffer, one piece at a time, at 7 GB/s on an H200 host;
from page-locked memory the copy engine reads host memory itself at the link's speed. Page-locking
the whole staged state costs more than the copy it would speed up (1-3 GB/s), so the data goes up
through a few page-locked buffers instead: each is filled with a CPU copy (torch's, on its
intra-op threads) while the copy engine empties the one before, on a stream of its own.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from tiercheck.errors import TiercheckError
from tiercheck.state.staging import pinned_empty

log = logging.getLogger("tiercheck")

RING_PIECE = 16 << 20  # bytes of each page-locked buffer
RING_BUFFERS = 4  # page-locked buffers per GPU: one filled on the CPU while the others go up


class Ring:
    """The page-locked buffers host-staged data goes up to one GPU through. ``put`` copies a
    tensor's bytes up (small tensors share a buffer); ``close`` makes the device's current stream
    wait for every copy, and the buffers are free once that stream has passed them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        # The live tensors' pending work (a job's initialisation) comes before the copies into them.
        self.stream.wait_stream(torch.cuda.current_stream(device))
        self.made = 0
        self._most = RING_BUFFERS  # fewer once page-locked memory is refused
        self.copied = 0  # bytes put
        self._lent: deque[tuple[torch.Tensor, torch.cuda.Event]] = deque()  # filled, their copies queued
        self._buf: torch.Tensor | None = None
        self._pos = 0

    def put(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` (host memory) into ``dst`` (this GPU's): both contiguous, of one dtype and
        size."""
        down = src.reshape(-1).view(torch.uint8)
        up = dst.reshape(-1).view(torch.uint8)
        n, lo = down.numel(), 0
        while lo < n:
            if self._buf is None or self._pos == RING_PIECE:
                self._next()
            if self._buf is None:  # no page-locked memory to be had: straight from ordinary memory
                up[lo:].copy_(down[lo:])
                break
            m = min(n - lo, RING_PIECE - self._pos)
            part = self._buf[self._pos : self._pos + m]
            part.copy_(down[lo : lo + m])
            with torch.cuda.stream(self.stream):
                up[lo : lo + m].copy_(part, non_blocking=True)
            self._pos += m
            lo += m
        self.copied += n

    def _next(self) -> None:
        """Hand the buffer being filled to the copy engine, and take the next: a new one while
        fewer than ``RING_BUFFERS`` are made, else the oldest, once its copies are done. None
        where page-locked memory is refused before any is made: the verified data must still
        reach every live tensor, so a restore never stops half copied in for want of it."""
        self._hand_over()
        self._pos = 0
        if self.made < self._most:
            try:
                self._buf = pinned_empty(RING_PIECE)
                self.made += 1
                return
            except (RuntimeError, TiercheckError) as e:
                log.warning("no more page-locked memory to copy a restore up through (%s); going on with %s",
                            e, f"the {self.made} buffer(s) made" if self.made else "copies from ordinary memory")
                self._most = self.made  # fmt: skip
        if self._lent:
            self._buf, done = self._lent.popleft()
            done.synchronize()

    def _hand_over(self) -> None:
        if self._buf is not None:
            done = torch.cuda.Event()
            done.record(self.stream)
            self._lent.append((self._buf, done))
            self._buf = None

    def close(self) -> None:
        """Every copy put is ordered before what the device's current stream does next."""
        self._hand_over()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


def ring_worthy(live: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether ``buf`` (staged) goes up to ``live`` through a ``Ring``: a contiguous GPU tensor
    from ordinary host memory of its dtype and shape (page-locked memory, the save pool's, is
    copied from directly)."""
    return (
        live.is_cuda
        and buf.device.type == "cpu"
        and live.dtype == buf.dtype
        and live.shape == buf.shape
        and live.is_contiguous()
        and buf.is_contiguous()
        and live.numel() > 0
        and not buf.is_pinned()
    )
