"""A ``Checkpointer``'s start: join the job's ranks, create and lock the node's local directory,
remove the partial steps a crash left, open the tiers.

It either returns holding the directory, or raises holding nothing (no lock, no open file). Where
one node's directory cannot be created, named or locked (a full disk, a read-only snapshot, another
job's lock), every rank of the job raises at the lock, instead of waiting for the failed one for
``DistributedOptions.timeout_s``. A directory that cannot be written raises ``StorageError``: a
Checkpointer writes even to restore (the lock, the removal of partial steps), so a read-only copy is
read with ``tiercheck.load``, or copied to a writable directory with ``tiercheck restore --to``
first. Serving restores from a read-only directory instead would take a read-only mode through
every start-up, restore and housekeeping path, each new write a new way to break it.

At interpreter exit, the Checkpointers still open are closed, all within one bound
(``unclosed``, ``exit_deadline``)."""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (before the exit hook below is registered: see there)
import logging
import os
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from tiercheck.cluster.coordination import Coordinator, default_store, drive, namespace_of
from tiercheck.cluster.lock import DirectoryLock, lock_node
from tiercheck.cluster.nodes import Nodes, join_nodes, node_id, open_channel, tcp_connect, tcp_serve
from tiercheck.errors import InvalidArgumentError, NotADirectoryTierError, StorageError, TiercheckError
from tiercheck.options import DistributedOptions, DrainOptions, ReplicationOptions, RetentionOptions, WriteOptions
from tiercheck.restore.share import host_key
from tiercheck.tiering.manager import TierManager
from tiercheck.tiering.retention import LocalSteps
from tiercheck.tiers.base import Tier
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.refusals import storage_error
from tiercheck.tiers.urls import tier_url

log = logging.getLogger("tiercheck")


@dataclass(frozen=True, kw_only=True)
class Started:
    """What a started Checkpointer holds: its place in the job, and its node's locked directory."""

    rank: int
    world_size: int
    coord: Coordinator
    nodes: Nodes
    tier: LocalTier
    lock: DirectoryLock
    local: LocalSteps
    tiers: TierManager


def start(
    local: str | os.PathLike[str],
    *,
    process_group: Any,
    skip_if_busy: bool,
    write: WriteOptions,
    retention: RetentionOptions,
    distributed: DistributedOptions,
    drain: DrainOptions,
    replication: ReplicationOptions | None,
    remote: str | Tier | None,
    remote_options: dict[str, Any] | None,
) -> Started:
    """Every rank of the job calls it, as its Checkpointer starts."""
    if isinstance(remote, str):
        tier_url(remote)  # a URL no tier is opened for is refused before the directory is created
    if os.path.exists(local) and not os.path.isdir(local):
        raise NotADirectoryTierError(f"local tier {os.fspath(local)!r} exists and is not a directory")
    rank, world_size, coord = _join(process_group, distributed)
    if world_size > 1 and skip_if_busy:
        raise InvalidArgumentError(
            "StagingOptions(if_busy='skip') works in a single process only: ranks would decide differently"
        )
    tier = LocalTier(local, fsync=write.fsync, direct_io=write.direct_io)
    failure: StorageError | None = None
    try:
        tier.create()
        # Ranks that see the same local directory are one node; its first rank commits and deletes there.
        me = node_id(tier.root) if world_size > 1 else "local"
    except StorageError as e:  # joins as a node of its own, locks nothing, and tells the others at the lock
        failure, me = e, f"unprepared-{uuid.uuid4().hex}"
    nodes: Nodes = drive(coord, join_nodes(coord, me, host_key()))
    timeout = distributed.timeout_s
    coord.node = drive(coord, open_channel(coord, nodes, tcp_serve(timeout), tcp_connect(timeout)))
    # One writer per directory: before anything here is listed, removed or written.
    lock = DirectoryLock(tier.root)
    drive(coord, lock_node(coord, nodes.leader, lock, failure=failure))
    leader = nodes.leader == rank
    try:
        try:
            steps = LocalSteps(tier, retention, leader=leader)
        except TiercheckError:
            raise
        except OSError as e:  # removing a crash's partial steps: a full copy-on-write disk refuses even that
            raise storage_error(e, tier.root, "remove the partial steps a crash left there") from e
        tiers = TierManager(
            tier,
            steps,
            remote=remote,
            remote_options=remote_options,
            drain=drain,
            replication=replication,
            coord=coord,
            nodes=nodes,
            take_over=write.take_over,
        )
    except BaseException:
        lock.release()
        raise
    return Started(
        rank=rank, world_size=world_size, coord=coord, nodes=nodes, tier=tier, lock=lock, local=steps, tiers=tiers
    )


def _join(process_group: Any, options: DistributedOptions) -> tuple[int, int, Coordinator]:
    """This rank, the job's world size, and the coordinator over the job's store (or a process alone)."""
    cooperate = options.enabled is not False and dist.is_available() and dist.is_initialized()
    if options.enabled and not cooperate:
        raise InvalidArgumentError("DistributedOptions(enabled=True) but torch.distributed is not initialized")
    if cooperate:
        rank, world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        coord = Coordinator(
            default_store(),
            rank=rank,
            world_size=world_size,
            namespace=namespace_of(process_group),
            timeout_s=options.timeout_s,
        )
        return rank, world_size, coord
    if process_group is not None:
        raise InvalidArgumentError("process_group was given, but this Checkpointer does not cooperate with other ranks")
    return 0, 1, Coordinator.single(options.timeout_s)


class Closable(Protocol):
    """A Checkpointer, as the exit hook sees it."""

    tier: LocalTier
    _pid: int  # the process that opened it

    def _close_at_exit(self) -> None: ...


unclosed: weakref.WeakSet[Closable] = weakref.WeakSet()  # open Checkpointers: closed at interpreter exit
_exit_started: float | None = None


def exit_deadline(timeout_s: float) -> float:
    """At interpreter exit: when waiting must end, ``timeout_s`` after the first of tiercheck's exit hooks began
    (the Checkpointers' and an integration's share one bound, not one each)."""
    global _exit_started
    if _exit_started is None:
        _exit_started = time.monotonic()
    return _exit_started + timeout_s


def _close_open() -> None:
    """Close every Checkpointer left open (never closed, or a rank raised before its ``close()``): wait for its
    saves and drains, for at most its ``DistributedOptions.timeout_s`` in all, and say what was abandoned. Left
    to themselves, a commit waiting for a rank that failed, and the commits queued behind it, each waited
    ``timeout_s`` while the interpreter joined their threads."""
    for ckpt in list(unclosed):
        if ckpt._pid != os.getpid():  # the parent's, inherited by a fork: its threads are not here
            continue
        try:
            ckpt._close_at_exit()
        except Exception:
            log.exception("closing the Checkpointer of %s at exit failed", ckpt.tier.url)


# At threading's shutdown, before concurrent.futures joins its workers (the commit and upload threads): registered
# after it (imported above), so called before it.
getattr(threading, "_register_atexit", atexit.register)(_close_open)
