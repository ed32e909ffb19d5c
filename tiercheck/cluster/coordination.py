"""Agreement between ranks through torch's key-value store, never through the training's collectives.

Background threads commit saves, and a collective issued off the training thread could interleave
with the training's own and deadlock it. So ranks meet in the store that ``torch.distributed``
already runs (a TCPStore: rank 0 serves it, everyone is a client); background threads open their
own client connection to it. A single process uses an in-memory store and the same code.

Every key lives under ``tiercheck/<namespace>/``; a namespace is one Checkpointer of the job. Keys
and scopes are built by ``cluster.keys`` only, one function per family (``docs/protocol.md``).

Cost stays flat per rank as the job grows: no protocol here has a rank read every rank's keys.
Ranks meet at counting barriers (one ``add`` each; the last to arrive sets one key everyone waits
for), post into buckets that one rank collects (``post`` / ``collect``), and hand work to chosen
ranks under keys both sides can name. The protocols built on these (``save.plan``, ``save.vote``,
``restore.protocol``) are generators that yield a :class:`Barrier` wherever a rank must wait for the
others: :func:`drive` runs one rank's protocol against the store, and a simulation can run the
same generators of thousands of simulated ranks in lockstep over one store (``bench/scale_sim.py``).

A rank also has a coordinator of its node (``Coordinator.node``: the store its node's leader serves,
``cluster.nodes``), so that what a node's ranks agree on among themselves never reaches the job's
store; ``cluster.hierarchy`` builds the two-level protocols on both.
"""



from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
import zlib
from collections import defaultdict
from collections.abc import Generator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from tiercheck.cluster.keys import (
    arrived_key,
    bucket_item_key,
    bucket_n_key,
    error_key,
    finished_key,
    job_namespace,
    open_key,
)
from tiercheck.errors import CoordinationError

log = logging.getLogger("tiercheck")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Failure:
    """One rank's failure at a point of a protocol, as every rank reads it (``report``, ``check``):
    the rank, its exception's class name, and its message."""

    rank: int
    kind: str
    text: str

    def to_json(self) -> list[object]:
        return [self.rank, self.kind, self.text]

    @classmethod
    def from_json(cls, raw: bytes, *, where: str) -> Failure:
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        match doc:
            case [int(rank), str(kind), str(text)] if not isinstance(rank, bool):
                return cls(rank, kind, text)
        raise CoordinationError(f"{where}: field 'failure' is not [rank, kind, text]: {raw[:80]!r}")


@dataclass(frozen=True, slots=True)
class Barrier:
    """A point a protocol waits at: until ``key`` exists in ``on``'s store (None: the store of the
    coordinator driving the protocol). With ``fetch``, the wait is the key's read: one blocking
    request, and the protocol is sent the value."""

    key: str
    what: str
    on: Coordinator | None = None
    fetch: bool = False


# One rank's side of a protocol, sans I/O: a generator that yields the barriers it waits at and
# returns its result (``drive`` runs it against the store, ``lockstep`` runs many ranks' at once).
Exchange = Generator[Barrier, Any, T]


class Coordinator:
    def __init__(self, store: Any, *, rank: int, world_size: int, namespace: str, timeout_s: float) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.deadline: float | None = None  # time.monotonic() by which every wait ends (set at interpreter exit)
        # What this rank moved through the store: requests, bytes sent (keys and values), bytes received.
        self.counters = {"store_ops": 0, "store_bytes_out": 0, "store_bytes_in": 0}
        self._barriers: list[str] = []  # passed since the scope they belong to began (see finish)
        # This rank's node: its ranks meet there without the job's store (cluster.nodes.open_channel).
        self.node: Coordinator | None = None
        self.owns_client = False  # whether its store client is this coordinator's alone (see fetch)
        self.later: list[str] = []  # keys a protocol deletes at its next run, once every rank is past them

    @classmethod
    def single(cls, timeout_s: float) -> Coordinator:
        import torch.distributed as dist  # commands that only list or inspect never load torch

        store = dist.HashStore()
        store.set_timeout(timedelta(seconds=timeout_s))  # a read of a key never set waits this long, not 300 s
        coord = cls(store, rank=0, world_size=1, namespace="local", timeout_s=timeout_s)
        coord.owns_client = True
        return coord

    def connect_again(self) -> Coordinator:
        """The same coordinator over a client connection of its own, for use from another thread
        (its node's too)."""
        store = _own_client(self.store, self.timeout_s)
        coord = Coordinator(
            store, rank=self.rank, world_size=self.world_size, namespace=self.namespace, timeout_s=self.timeout_s
        )
        coord.owns_client = store is not self.store or self.owns_client
        coord.node = self.node.connect_again() if self.node is not None else None
        return coord

    @property
    def store_bytes(self) -> int:
        return self.counters["store_bytes_out"] + self.counters["store_bytes_in"]

    def _count(self, out: int = 0, into: int = 0, ops: int = 1) -> None:
        c = self.counters
        c["store_ops"] += ops
        c["store_bytes_out"] += out
        c["store_bytes_in"] += into

    # ---------------------------------------------------------------------------- primitives

    def wait(self, keys: list[str], *, what: str, timeout_s: float | None = None) -> None:
        timeout = self._timeout(timeout_s)
        self._count(out=sum(map(len, keys)))
        try:
            self.store.wait(keys, timedelta(seconds=timeout))
        except RuntimeError as e:  # a timeout, or the store's server (rank 0) is gone (DistError is one)
            missing = [k for k in keys if not self.has(k)]
            raise CoordinationError(
                f"rank {self.rank}: gave up waiting for {what} after {timeout:.0f} s "
                f"({len(missing)} of {len(keys)} keys missing, e.g. {missing[:1]}): {e}"
            ) from None

    def _timeout(self, timeout_s: float | None = None) -> float:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if self.deadline is not None:
            timeout = max(0.001, min(timeout, self.deadline - time.monotonic()))
        return timeout

    def fetch(self, key: str, *, what: str) -> bytes:
        """Wait for ``key`` and read it: one request where this coordinator's store client is its
        own (its timeout may then be set per call), else a wait and a get."""
        if not self.owns_client:
            self.wait([key], what=what)
            return self.get(key)
        timeout = self._timeout()
        try:
            self.store.set_timeout(timedelta(seconds=timeout))
            value = bytes(self.store.get(key))
        except RuntimeError as e:  # a timeout (DistStoreError), or the store's server is gone
            raise CoordinationError(
                f"rank {self.rank}: gave up waiting for {what} after {timeout:.0f} s ({key} missing): {e}"
            ) from None
        self._count(out=len(key), into=len(value))
        return value

    def waited(self, key: str) -> None:
        """Count a wait for ``key`` that ``lockstep`` passed: the one request it is in ``drive``."""
        self._count(out=len(key))

    def fork(self, store: Any, *, rank: int, world_size: int, namespace: str) -> Coordinator:
        """A coordinator of this rank over another store (its node's), with this one's timeout."""
        return type(self)(store, rank=rank, world_size=world_size, namespace=namespace, timeout_s=self.timeout_s)

    def has(self, key: str) -> bool:
        self._count(out=len(key))
        try:
            return bool(self.store.check([key]))
        except RuntimeError:  # torch's DistError is one
            return False

    @contextmanager
    def _reaching(self, what: str) -> Iterator[None]:
        """The store's failures as ``CoordinationError``: torch raises ``DistNetworkError`` (a
        ``RuntimeError``) when the process hosting the store (rank 0's, or the launcher's) is gone."""
        try:
            yield
        except RuntimeError as e:
            raise CoordinationError(
                f"rank {self.rank}: could not {what} in the job's store: the process hosting it (rank 0, or "
                f"the launcher) is gone or unreachable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            ) from e

    def decide(self, key: str, proposal: str) -> str:
        """First proposal wins; everyone learns the same outcome."""
        with self._reaching(f"decide {key}"):
            got = bytes(self.store.compare_set(key, "", proposal)).decode()
        self._count(out=len(key) + len(proposal), into=len(got))
        return got

    def get(self, key: str) -> bytes:
        """A key's value; the protocols ask only for keys set before a barrier they passed. One
        that is not there waits the store's own timeout (not ``timeout_s``): where a key may be
        missing, ``wait`` for it first."""
        try:
            value = bytes(self.store.get(key))
        except RuntimeError as e:  # torch's DistStoreError is one: the store's timeout, or it is gone
            raise CoordinationError(f"rank {self.rank}: could not read {key} from the store: {e}") from None
        self._count(out=len(key), into=len(value))
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Several keys' values at once (see ``get``)."""
        if not keys:
            return []
        try:
            values = [bytes(v) for v in self.store.multi_get(keys)]
        except RuntimeError as e:
            raise CoordinationError(
                f"rank {self.rank}: could not read {len(keys)} key(s) from the store, e.g. {keys[0]}: {e}"
            ) from None
        self._count(out=sum(map(len, keys)), into=sum(map(len, values)))
        return values

    def set(self, key: str, value: str | bytes) -> None:
        with self._reaching(f"set {key}"):
            self.store.set(key, value)
        self._count(out=len(key) + len(value))

    def multi_set(self, items: Mapping[str, str | bytes]) -> None:
        if not items:
            return
        with self._reaching(f"set {len(items)} key(s)"):
            self.store.multi_set(list(items), list(items.values()))
        self._count(out=sum(len(k) + len(v) for k, v in items.items()))

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to ``key``'s value (creating it): many ranks register at one key."""
        with self._reaching(f"append to {key}"):
            self.store.append(key, value)
        self._count(out=len(key) + len(value))

    def add(self, key: str, n: int) -> int:
        with self._reaching(f"add to {key}"):
            value = int(self.store.add(key, n))
        self._count(out=len(key) + 8, into=8)
        return value

    def delete(self, *keys: str) -> None:
        for key in keys:
            self._count(out=len(key))
            try:
                self.store.delete_key(key)
            except RuntimeError:  # torch's DistError is one
                log.debug("could not delete %s from the store", key)

    # ---------------------------------------------------------------------------- patterns

    def arrive(self, name: str, *, what: str, count: int | None = None, record: bool = True) -> Barrier:
        """Count this rank in at barrier ``name``; the last of ``count`` (default: every rank) to
        arrive opens it. Yield the result to wait there. ``record``: for ``finish`` to delete (else
        the protocol deletes its keys itself)."""
        done = open_key(self, name)
        if record:
            self._barriers.append(name)
        if self.add(arrived_key(self, name), 1) == (self.world_size if count is None else count):
            self.set(done, "1")
        return Barrier(done, what, self)

    def finish(self, scope: str, *, keys: tuple[str, ...] = (), count: int | None = None) -> None:
        """Leave a protocol whose barriers are all named ``scope/...``, after its last barrier:
        the last rank to leave deletes the barriers' keys (and any failures reported at them, and
        ``keys``, the protocol's others), so the store does not grow with the saves and restores
        of a long job. ``count``: how many ranks take part (default: every rank)."""
        names = [n for n in self._barriers if n == scope or n.startswith(f"{scope}/")]
        self._barriers = [n for n in self._barriers if n not in names]
        if self.add(finished_key(self, scope), 1) == (self.world_size if count is None else count):
            barriers = [f(self, n) for n in dict.fromkeys(names) for f in (arrived_key, open_key, error_key)]
            self.delete(finished_key(self, scope), error_key(self, scope), *barriers, *keys)

    def report(self, name: str, error: BaseException) -> None:
        """Record that this rank failed at ``name`` (the first report wins); every rank learns of
        it with ``check(name)`` after the next barrier."""
        self.decide(error_key(self, name), dumps(Failure(self.rank, type(error).__name__, str(error)).to_json()))

    def check(self, name: str, own: BaseException | None = None, *, shared: tuple[type[Exception], ...] = ()) -> None:
        """Raise this rank's own failure, else the first failure any rank reported at ``name``: as
        the same error where its type is one of ``shared`` (a verdict every rank reaches, like a
        layout that cannot be planned), else as ``CoordinationError`` naming the failed rank."""
        if own is not None:
            raise own
        key = error_key(self, name)
        if self.has(key):
            self.raise_failure(self.get(key), where=key, shared=shared)

    def raise_failure(self, raw: bytes, *, where: str, shared: tuple[type[Exception], ...] = ()) -> None:
        """Raise the failure another rank reported (``report``), as ``check`` does."""
        failed = Failure.from_json(raw, where=where)
        for cls in shared:
            if cls.__name__ == failed.kind:
                raise cls(failed.text)
        stops = f"rank {failed.rank} failed, so rank {self.rank} stops too"
        raise CoordinationError(f"{stops}: {failed.kind}: {failed.text}")

    def post(self, bucket: str, value: str | bytes) -> int:
        """Put ``value`` into ``bucket``, for the rank that ``collect``s it after a barrier; returns
        how many values the bucket holds with this one."""
        i = self.add(bucket_n_key(self, bucket), 1)
        self.set(bucket_item_key(self, bucket, i), value)
        return i

    def collect(self, bucket: str, *, forget: bool = True) -> list[bytes]:
        """Everything posted into ``bucket`` (in no particular order); with ``forget``, removed."""
        n = self.add(bucket_n_key(self, bucket), 0)
        keys = [bucket_item_key(self, bucket, i) for i in range(1, n + 1)]
        values = self.multi_get(keys)
        if forget:
            self.delete(bucket_n_key(self, bucket), *keys)
        return values


def store_traffic(coords: list[Coordinator]) -> dict[str, int]:
    """What these coordinators of one rank (one per thread) moved so far, through the job's store
    and through the rank's node's (``stats()``)."""
    nodes = [c.node for c in coords if c.node is not None and c.node.store is not c.store]
    return {
        "store_ops": sum(c.counters["store_ops"] for c in coords),
        "store_bytes": sum(c.store_bytes for c in coords),
        "node_store_ops": sum(c.counters["store_ops"] for c in nodes),
        "node_store_bytes": sum(c.store_bytes for c in nodes),
    }


def drive(coord: Coordinator, protocol: Exchange[T]) -> T:
    """Run one rank's protocol to its end, waiting in the store at each barrier it yields. A wait
    that times out is raised inside the protocol, at its ``yield``."""
    try:
        barrier = next(protocol)
        while True:
            on = barrier.on or coord
            try:
                got = on.fetch(barrier.key, what=barrier.what) if barrier.fetch else None
                if not barrier.fetch:
                    on.wait([barrier.key], what=barrier.what)
            except CoordinationError as e:  # the protocol may tell the others before it gives up
                barrier = protocol.throw(e)
            else:
                barrier = protocol.send(got)
    except StopIteration as stop:
        value: T = stop.value  # what the protocol returned: an Exchange[T] returns a T
        return value


def shard_of(path: str, shards: int) -> int:
    """The rank that coordinates array ``path`` among ``shards`` ranks (the same on every rank and
    in every process: CRC-32 of the name, not Python's salted ``hash``)."""
    return zlib.crc32(path.encode()) % shards


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _own_client(store: Any, timeout_s: float) -> Any:
    """A new TCPStore client to the server behind ``store`` (other stores are shared as they are)."""
    import torch.distributed as dist

    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        return dist.TCPStore(
            base.host, base.port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
    return store


_namespaces: dict[tuple[int, ...], itertools.count[int]] = defaultdict(itertools.count)
# One namespace per Checkpointer of a group: its ranks create them in the same order.


def namespace_of(group: Any) -> str:
    """Store keys of a Checkpointer: distinct per process group, and per Checkpointer in a group."""
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
    members = "-".join(map(str, ranks)) if len(ranks) <= 8 else hashlib.sha1(repr(ranks).encode()).hexdigest()[:12]
    return job_namespace(members, next(_namespaces[ranks]))


def default_store() -> Any:
    """The key-value store of the default process group; every rank of every group is its client."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def lockstep(protocols: list[Exchange[T]], *, capture: bool = False) -> list[T]:
    """Run the protocols of many ranks in one thread: a rank goes past a barrier once its key is
    in the barrier's store (every barrier a protocol yields names its coordinator: ``Barrier.on``),
    so no wait ever blocks. For simulating a job of thousands of ranks with the real protocol code
    over real stores (``bench/scale_sim.py``) and for tests. Each wait is counted as the one store
    request it is in ``drive``. With ``capture``, a rank whose protocol raised gets the exception as
    its result (the others go on); a round in which no rank can move is a deadlock, raised."""
    results: list[Any] = [None] * len(protocols)
    waiting: dict[int, Barrier | None] = dict.fromkeys(range(len(protocols)))
    while waiting:
        moved = False
        for i, barrier in list(waiting.items()):
            value: bytes | None = None
            if barrier is not None:
                on = barrier.on
                if on is None:
                    raise CoordinationError(f"lockstep: barrier {barrier.key} names no coordinator")
                if not on.store.check([barrier.key]):
                    continue
                if barrier.fetch:
                    value = on.get(barrier.key)
            moved = True
            try:
                barrier = waiting[i] = protocols[i].send(value) if barrier is not None else next(protocols[i])
                if not barrier.fetch and barrier.on is not None:
                    barrier.on.waited(barrier.key)
            except StopIteration as stop:
                results[i] = stop.value
                del waiting[i]
            except Exception as e:
                if not capture:
                    raise
                results[i] = e
                del waiting[i]
        if not moved:
            stuck = next(iter(waiting.values()))
            raise CoordinationError(f"lockstep: {len(waiting)} rank(s) wait forever, e.g. for {stuck}")
    return results
