"""The order point-to-point transfers are posted in, and the process group's device and ranks.

gloo matches a send to a receive by its tag; NCCL does not: between two ranks it matches them in
the order they are posted, whatever their tags. A rank posts its sends as chunks are verified, from
its read threads and its serving thread (``restore.serve``), in no fixed order; over NCCL a chunk
could then land in the buffer posted for another of the same size, unseen. So where the group is
NCCL's, each rank receives in ascending tag order (``receive_order``) and posts its sends to each
rank in ascending tag order too (``SendOrder``): a chunk ready early waits, already on the GPU, for
the ones before it to that rank.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def matches_by_order(group: Any) -> bool:
    """Whether ``group`` matches sends to receives by the order they are posted (NCCL), not by tag."""
    return comm_device(group).type == "cuda"


def comm_device(group: Any) -> torch.device:
    """Where ``group`` moves the bytes it sends: this rank's GPU for NCCL, else host memory."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_rank(group: Any, rank: int) -> int:
    """``rank`` of ``group`` (None: the default group) as the default group numbers it."""
    return rank if group is None else dist.get_global_rank(group, rank)


def receive_order(transfers: Sequence[T], tag: Callable[[T], int], *, ordered: bool) -> Iterable[T]:
    """``transfers`` in the order their receives are posted: ascending tags where ``ordered``."""
    return sorted(transfers, key=tag) if ordered else transfers


class SendOrder:
    """Sends posted to each destination in ascending tag order where ``ordered`` (else at once).
    ``tags``: every (destination, tag) this rank sends, so it knows which comes next."""

    def __init__(self, tags: Iterable[tuple[int, int]], *, ordered: bool) -> None:
        self.ordered = ordered
        self._lock = threading.Lock()
        self._next: dict[int, deque[int]] = {}
        self._ready: dict[int, dict[int, Callable[[], None]]] = {}
        if ordered:
            for dst, tag in sorted(set(tags)):
                self._next.setdefault(dst, deque()).append(tag)
                self._ready.setdefault(dst, {})

    def post(self, dst: int, tag: int, send: Callable[[], None]) -> None:
        """``send()`` now, or once every send to ``dst`` of a lower tag is posted."""
        if not self.ordered:
            send()
            return
        with self._lock:
            ready, due = self._ready[dst], self._next[dst]
            ready[tag] = send
            while due and due[0] in ready:
                ready.pop(due.popleft())()
