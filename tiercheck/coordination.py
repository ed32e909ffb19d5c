"""Agreement between ranks through torch's key-value store, never through the training's collectives.

Background threads commit saves, and a collective issued off the training thread could interleave
with the training's own and deadlock it. So ranks meet in the store that ``torch.distributed``
already runs (a TCPStore: rank 0 serves it, everyone is a client); background threads open their
own client connection to it. A single process uses an in-memory store and the same code.

Every key lives under ``tiercheck/<namespace>/``; a namespace is one Checkpointer of the job.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .errors import CoordinationError

log = logging.getLogger("tiercheck")

NODE_FILE = ".tiercheck-node"


class Coordinator:
    def __init__(self, store: Any, *, rank: int, world_size: int, namespace: str, timeout_s: float) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.namespace = namespace
        self.timeout_s = timeout_s

    @classmethod
    def single(cls, timeout_s: float) -> Coordinator:
        return cls(dist.HashStore(), rank=0, world_size=1, namespace="local", timeout_s=timeout_s)

    def key(self, *parts: object) -> str:
        return "/".join(["tiercheck", self.namespace, *map(str, parts)])

    def connect_again(self) -> Coordinator:
        """The same coordinator over a client connection of its own, for use from another thread."""
        return Coordinator(
            _own_client(self.store, self.timeout_s),
            rank=self.rank,
            world_size=self.world_size,
            namespace=self.namespace,
            timeout_s=self.timeout_s,
        )

    # ---------------------------------------------------------------------------- primitives

    def wait(self, keys: list[str], *, what: str, timeout_s: float | None = None) -> None:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            self.store.wait(keys, timedelta(seconds=timeout))
        except (RuntimeError, dist.DistError) as e:  # a timeout, or the store's server (rank 0) is gone
            missing = [k for k in keys if not self._has(k)]
            raise CoordinationError(
                f"rank {self.rank}: gave up waiting for {what} after {timeout:.0f} s "
                f"({len(missing)} of {len(keys)} keys missing, e.g. {missing[:1]}): {e}"
            ) from None

    def _has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except (RuntimeError, dist.DistError):
            return False

    def exchange(self, name: str, value: Any, *, what: str) -> list[Any]:
        """All-gather a JSON value: every rank's, in rank order."""
        self.store.set(self.key(name, self.rank), json.dumps(value, separators=(",", ":")))
        keys = [self.key(name, r) for r in range(self.world_size)]
        self.wait(keys, what=what)
        return [json.loads(self.store.get(k)) for k in keys]

    def decide(self, key: str, proposal: str) -> str:
        """First proposal wins; everyone learns the same outcome."""
        return bytes(self.store.compare_set(key, "", proposal)).decode()

    def get(self, key: str) -> bytes:
        return bytes(self.store.get(key))

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(key, value)

    def add(self, key: str, n: int) -> int:
        return int(self.store.add(key, n))

    def delete(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except (RuntimeError, dist.DistError):
            log.debug("could not delete %s from the store", key)


def _own_client(store: Any, timeout_s: float) -> Any:
    """A new TCPStore client to the server behind ``store`` (other stores are shared as they are)."""
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        return dist.TCPStore(
            base.host, base.port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
    return store


def default_store() -> Any:
    """The key-value store of the default process group; every rank of every group is its client."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def node_id(local: str | os.PathLike[str]) -> str:
    """The identity of a node-local directory: ranks that see the same directory share its id."""
    path = Path(local) / NODE_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    tmp = path.with_name(f"{NODE_FILE}.{uuid.uuid4().hex}")
    tmp.write_text(uuid.uuid4().hex + "\n")
    try:
        os.link(tmp, path)  # atomic, and fails if another rank got there first
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_text().strip()
