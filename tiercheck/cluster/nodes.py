"""Nodes: the ranks that share a node-local directory, numbered, with a channel of their own.

The job's store is one server (rank 0's TCPStore) that every rank of the job talks to. What the
ranks of one node must agree on among themselves (that all of them wrote their part of a save,
what their leader learned from the other nodes) goes through their node's own store, served by
the node's first rank (its leader) on the node: the job's store then sees only the leaders,
O(nodes) requests where it saw O(ranks) (``cluster.hierarchy``).

``join_nodes`` learns a rank's node once per job: its members, its number (0 to nodes - 1 in the
order of the nodes' first ranks: node 0 holds rank 0), its host (as the first rank of the host's
first node, so that ranks name their host in a few digits: ``Nodes.host``), and the job's run id.
``open_channel`` then connects the node's ranks to their leader's store. Both cost each rank a few
requests to the job's store, once; rank 0 numbers the nodes (one entry per node).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from tiercheck.cluster.coordination import Barrier, Coordinator, Exchange, lockstep
from tiercheck.cluster.keys import bucket_item_key, bucket_n_key, node_namespace
from tiercheck.cluster.keys.nodes import (
    CHANNEL,
    NODES,
    channel_key,
    channel_tried_key,
    channel_whole_key,
    leaders_bucket,
    node_members_bucket,
    node_number_key,
    nodes_count_key,
    nodes_scope,
    run_key,
)
from tiercheck.cluster.wire import Entry, optional, read_rank, read_token, tallied, tally
from tiercheck.format.paths import NODE_FILE
from tiercheck.tiers.refusals import storage_error

log = logging.getLogger("tiercheck")


@dataclass(frozen=True, slots=True)
class Nodes:
    """Which ranks share this rank's node-local directory, and how many nodes there are."""

    ranks: tuple[int, ...]  # of this node, ascending
    count: int
    run: str = ""  # random, the same on every rank of the job: save ids are made from it
    number: int = 0  # this node's, 0 to count - 1 in the order of the nodes' first ranks
    first_on_host: int | None = None  # the first rank of the first node on this node's host, where that is another node

    @property
    def leader(self) -> int:
        return self.ranks[0]

    @property
    def host(self) -> int:
        """This node's host, as the first rank of its first node: nodes on one host (a job's
        simulated nodes, containers) have the same; on a cluster every node has its leader's."""
        return self.leader if self.first_on_host is None else self.first_on_host


def join_nodes(coord: Coordinator, node: str, host: str | None = None) -> Exchange[Nodes]:
    """Learn this node's ranks, number and host: each rank reads its own node's members, never
    every rank's; rank 0 reads one entry per node to number them. ``host``: a key equal on the
    ranks of one host (``restore.share.host_key``; None: unknown, a host of its own)."""
    bucket = node_members_bucket(node)
    mine = coord.post(bucket, str(coord.rank))
    if mine == 1:
        coord.add(nodes_count_key(coord), 1)
    if coord.rank == 0:
        coord.set(run_key(coord), uuid.uuid4().hex)
    yield coord.arrive(nodes_scope("joined"), what="every rank to name its node directory")
    members = sorted(int(v) for v in coord.collect(bucket, forget=False))
    count = coord.add(nodes_count_key(coord), 0)
    run = coord.get(run_key(coord)).decode()
    if coord.rank == members[0]:
        coord.post(leaders_bucket(), LeaderWord(coord.rank, host or None).entry())
    yield coord.arrive(nodes_scope("read"), what="every rank to read its node's members")
    coord.delete(bucket_item_key(coord, bucket, mine), *([bucket_n_key(coord, bucket)] if mine == 1 else []))
    if coord.rank == 0:
        coord.delete(nodes_count_key(coord), run_key(coord))
        numbers = _numbers(coord.collect(leaders_bucket()), coord.world_size)
        coord.multi_set({node_number_key(coord, r): v for r, v in numbers.items()})
    key = node_number_key(coord, members[0])
    raw = yield Barrier(key, "rank 0 to number the nodes", coord, fetch=True)
    said = NodeNumber.one(raw, where=key, field="number", world=coord.world_size)
    yield coord.arrive(nodes_scope("numbered"), what="every rank to learn its node's number")
    if coord.rank == members[0]:
        coord.delete(key)
    coord.finish(NODES)
    return Nodes(tuple(members), count, run, said.number, said.first_on_host)


@dataclass(frozen=True, slots=True)
class LeaderWord(Entry):
    """A node's first rank, said to rank 0 to number the nodes, with its host where it knows one."""

    rank: int
    host: str | None = None

    FIELDS = (("rank", read_rank), ("host", optional(read_token)))


@dataclass(frozen=True, slots=True)
class NodeNumber(Entry):
    """Rank 0's word to a node: its number, and the first rank of its host's first node where that
    is another node."""

    number: int
    first_on_host: int | None = None

    FIELDS = (("number", read_rank), ("first_on_host", optional(read_rank)))


def _numbers(said: list[bytes], world: int) -> dict[int, str]:
    """Rank 0: each node's number (its place among the leaders), with the first node of its host
    where that is another node."""
    hosts: dict[int, str | None] = {}
    for v in said:
        w = LeaderWord.one(v, where=leaders_bucket(), field="leader", world=world)
        hosts[w.rank] = w.host
    first: dict[str, int] = {}
    out: dict[int, str] = {}
    for i, r in enumerate(sorted(hosts)):
        h = hosts[r]
        on = r if h is None else first.setdefault(h, r)
        out[r] = NodeNumber(i, None if on == r else on).entry()
    return out


# ---------------------------------------------------------------------------------- channels

Serve = Callable[[], tuple[Any, str]]  # a leader's new store server, and the address its node's ranks reach it at
Connect = Callable[[str], Any]  # a client of the store at an address


def tcp_serve(timeout_s: float) -> Serve:
    """A TCPStore on a free port of this host, for the node's ranks (on this host by definition)."""

    def serve() -> tuple[Any, str]:
        import torch.distributed as dist

        store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        return store, f"{socket.gethostname()}:{store.port}"

    return serve


CONNECT_S = 10.0  # how long a rank tries to reach its node's store before the node does without it


def tcp_connect(timeout_s: float) -> Connect:
    def connect(address: str) -> Any:
        import torch.distributed as dist

        host, _, port = address.rpartition(":")
        if host == socket.gethostname():
            host = "127.0.0.1"  # the leader is on this host: no name lookup, no route off it
        client = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=min(timeout_s, CONNECT_S)))  # fmt: skip
        client.set_timeout(timedelta(seconds=timeout_s))
        return client

    return connect


def open_channel(coord: Coordinator, nodes: Nodes, serve: Serve, connect: Connect) -> Exchange[Coordinator]:
    """The coordinator of this rank's node: its ranks (numbered from 0, the leader) over the store
    the leader serves. A node of one rank keeps its node's keys in its own process; the node of a
    job of one node keeps them in a namespace of the job's store (its only node is the job), and so
    does a node whose ranks cannot all reach their leader's store (containers of one host, each with
    a network of its own, sharing the directory): it works as before, through the job's store."""
    local = nodes.ranks.index(coord.rank)
    namespace = node_namespace(coord.namespace, nodes.number)
    if len(nodes.ranks) == 1:  # its node's store is this process's alone
        import torch.distributed as dist

        node = coord.fork(dist.HashStore(), rank=local, world_size=1, namespace=namespace)
        node.owns_client = True
        return node
    shared = coord.fork(coord.store, rank=local, world_size=len(nodes.ranks), namespace=namespace)
    shared.owns_client = coord.owns_client
    if nodes.count == 1:
        return shared
    key = channel_key(coord, nodes.number)
    tried_key, whole_key = channel_tried_key(coord, nodes.number), channel_whole_key(coord, nodes.number)
    store: Any = None
    if local == 0:
        try:
            store, address = serve()
        except (RuntimeError, OSError) as e:  # no port to listen on: the node meets in the job's store
            log.warning("rank %d cannot serve its node's store (%s): the node's ranks meet in the job's store",
                        coord.rank, e)  # fmt: skip
            address = ""
        coord.set(key, address)
    else:
        address = (yield Barrier(key, "the node's leader to serve its store", coord, fetch=True)).decode()
        try:
            store = connect(address) if address else None
        except (RuntimeError, ValueError) as e:  # DistNetworkError is a RuntimeError
            log.warning("rank %d cannot reach its node's store at %s (%s): the node's ranks meet in the job's "
                        "store instead", coord.rank, address, str(e).splitlines()[0] if str(e) else e)  # fmt: skip
    # Whether every rank reached it: the ranks that tried, and those that failed, in one tally.
    tried, failed = tallied(coord.add(tried_key, tally(failed=store is None)))
    if tried == len(nodes.ranks):
        coord.set(whole_key, "0" if failed else "1")
    whole = (yield Barrier(whole_key, "the node's ranks to reach its store", coord, fetch=True)) == b"1"
    yield shared.arrive(CHANNEL, what="every rank of the node to learn how it meets")
    shared.finish(CHANNEL, keys=(tried_key, whole_key, key))
    if not whole:
        return shared
    node = coord.fork(store, rank=local, world_size=len(nodes.ranks), namespace=namespace)
    node.owns_client = True
    return node


def node_id(local: str | os.PathLike[str]) -> str:
    """The identity of a node-local directory: ranks that see the same directory share its id."""
    path = Path(local) / NODE_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    tmp = path.with_name(f"{NODE_FILE}.{uuid.uuid4().hex}")
    try:
        try:
            tmp.write_text(uuid.uuid4().hex + "\n")
            os.link(tmp, path)  # atomic, and fails if another rank got there first
        except FileExistsError:
            pass
        finally:
            with suppress(FileNotFoundError):  # not even created, on a read-only directory
                tmp.unlink()
    except OSError as e:  # a full or read-only directory: no half-written name left behind either
        raise storage_error(e, local, "write its node name file") from e
    return path.read_text().strip()


def local_channel() -> tuple[Serve, Connect]:
    """Node stores inside this process (``torch.distributed.HashStore``): for simulating many nodes
    in one process (``bench/scale_sim.py``) and for tests."""
    import torch.distributed as dist

    stores: dict[str, Any] = {}

    def serve() -> tuple[Any, str]:
        address = f"local:{len(stores)}"
        stores[address] = dist.HashStore()
        return stores[address], address

    return serve, stores.__getitem__


def join_in_lockstep(
    coords: list[Coordinator], node_names: list[str], hosts: list[str | None] | None = None
) -> list[Nodes]:
    """Every simulated rank joins its node (``node_names[rank]``, on host ``hosts[rank]``: by
    default each node a host of its own) and opens its node's channel, all in this process
    (``lockstep`` over ``local_channel`` stores): for ``bench/scale_sim.py`` and tests. Sets each
    coordinator's ``node``."""
    nodes = lockstep([join_nodes(c, node_names[c.rank], None if hosts is None else hosts[c.rank]) for c in coords])
    serve, connect = local_channel()
    channels = lockstep([open_channel(c, nodes[c.rank], serve, connect) for c in coords])
    for c, node in zip(coords, channels, strict=True):
        c.node = node
    return nodes
