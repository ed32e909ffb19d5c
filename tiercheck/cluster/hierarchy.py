"""Agreement in two levels, so that neither the job's store nor any one rank hears from every rank.

A node's ranks meet in their node's store (``Coordinator.node``, served by the node's leader:
``cluster.nodes.open_channel``); only the leaders meet in the job's store. Where the leaders must
pool what each node knows (the steps each holds, for a restore), they fold it up a tree over their
node numbers, ``FAN_IN`` children to a parent, to node 0's leader (rank 0): no rank reads more than
``FAN_IN`` values, and the farthest of 16,384 nodes is three hops from rank 0. The answer comes back
down in one key every leader reads, and each leader tells its node.

Per node and per use, the job's store sees a few requests (a barrier: two; a fold: a value set, read
and deleted; an answer: one read), so its load grows with the nodes, not the ranks; a rank's own
traffic stays the same at any size. Keys a protocol leaves in the job's store are deleted by node 0's
leader at the next fold or vote, once every leader is known to be past them (``Coordinator.later``);
a node's by its leader once its ranks are done (``leave_node``), never before: its process serves
the node's store.
"""

from __future__ import annotations

from collections.abc import Callable

from tiercheck.cluster.coordination import Barrier, Coordinator, Exchange
from tiercheck.cluster.keys import (
    all_left_key,
    answer_key,
    arrived_key,
    error_key,
    left_key,
    node_in_scope,
    open_key,
    out_key,
    scope_key,
    up_key,
)
from tiercheck.cluster.nodes import Nodes
from tiercheck.errors import CoordinationError

FAN_IN = 32  # children per parent in a fold: 3 hops to rank 0 from 16,384 nodes, 4 from a million


def node_of(coord: Coordinator) -> Coordinator:
    """This rank's node's coordinator (set as the job starts)."""
    if coord.node is None:
        raise CoordinationError(f"rank {coord.rank}: no channel to its node (cluster.nodes.open_channel)")
    return coord.node


def verdict(
    coord: Coordinator,
    nodes: Nodes,
    name: str,
    failure: BaseException | None,
    *,
    what: str,
    shared: tuple[type[Exception], ...] = (),
) -> Exchange[None]:
    """A barrier of every rank of the job that also tells each whether any rank failed before it:
    the first failure is raised on all (as ``Coordinator.check`` does). The node's ranks count in at
    their node, its leader at the job's store once all of them have; the leader then reads whether
    a failure was reported and tells its node. Only a failing rank writes to the job's store."""
    node = node_of(coord)
    if failure is not None:
        coord.report(name, failure)
    here = node.arrive(node_in_scope(name), what=f"this node's ranks: {what}", record=False)
    out = out_key(node, name)
    if coord.rank == nodes.leader:
        yield here
        yield coord.arrive(name, what=f"every node: {what}", count=nodes.count)
        error = error_key(coord, name)
        raw = coord.get(error) if coord.has(error) else b""
        node.set(out, raw or b"-")
        yield from leave_node(node, nodes, name, keys=(out, *_barrier_keys(node, node_in_scope(name))), wait=True)
        coord.finish(name, count=nodes.count)
    else:
        raw = bytes((yield Barrier(out, what, node, fetch=True)))
        yield from leave_node(node, nodes, name, keys=(), wait=False)
    if failure is not None:
        raise failure
    if raw not in (b"", b"-"):
        coord.raise_failure(raw, where=error_key(coord, name), shared=shared)


def leave_node(node: Coordinator, nodes: Nodes, name: str, *, keys: tuple[str, ...], wait: bool) -> Exchange[None]:
    """The end of a protocol at a node. Its other ranks count themselves out (their last request to
    the node's store); the leader, whose process serves that store and may exit next, waits for them
    (``wait``: not where one of them is known to be gone) and deletes the protocol's ``keys`` there."""
    left, all_left = left_key(node, name), all_left_key(node, name)
    if node.rank != 0:
        if node.add(left, 1) == len(nodes.ranks) - 1:
            node.set(all_left, "1")
        return
    if wait and len(nodes.ranks) > 1:
        yield Barrier(all_left, "this node's ranks to be done", node)
    node.delete(left, all_left, *keys)


def gather_at_leader(node: Coordinator, scope: str, entries: str, *, what: str) -> Exchange[bytes | None]:
    """Every rank of a node (``node``: its coordinator, rank 0 its leader) says ``entries``
    (``cluster.wire.Entry``), appended under ``scope`` in the node's store. The leader, once every
    rank of the node has, gets all of them, as stored (to read with ``Entry.read``), and deletes
    the scope's keys; the others get None at once (they need not wait)."""
    said = scope_key(node, scope)
    if entries:
        node.append(said, entries)
    here = node.arrive(scope, what=what, record=False)
    if node.rank != 0:
        return None
    yield here
    raw = node.get(said) if node.has(said) else b""
    node.delete(said, *_barrier_keys(node, scope))
    return raw


def _barrier_keys(node: Coordinator, name: str) -> tuple[str, str]:
    return arrived_key(node, name), open_key(node, name)


def fold(
    coord: Coordinator, nodes: Nodes, name: str, value: bytes, merge: Callable[[list[bytes]], bytes], *, what: str
) -> Exchange[bytes | None]:
    """Leaders only: every node's ``value`` folded with ``merge`` (over a list: the node's own
    first, then its children's, each already folded) up the tree to node 0's leader, which gets
    the fold of all of them; the other leaders get None."""
    k = nodes.number
    values = [value]
    for child in range(FAN_IN * k + 1, min(FAN_IN * (k + 1), nodes.count - 1) + 1):
        key = up_key(coord, name, child)
        values.append(bytes((yield Barrier(key, what, coord, fetch=True))))
        coord.delete(key)
    folded = merge(values) if len(values) > 1 else value
    if k == 0:
        return folded
    coord.set(up_key(coord, name, k), folded)
    return None


def tell(coord: Coordinator, nodes: Nodes, name: str, answer: bytes | None, *, what: str) -> Exchange[bytes]:
    """Every rank learns node 0's leader's ``answer`` (given there only): each leader reads it from
    the job's store, the node's other ranks from their leader. Node 0's leader deletes it at its
    next fold (``forget_later``)."""
    node = node_of(coord)
    key, here = answer_key(coord, name), answer_key(node, name)
    if coord.rank == nodes.leader:
        if nodes.number == 0:
            if answer is None:
                raise CoordinationError(f"rank {coord.rank}: node 0's leader has no answer to tell at {name}")
            coord.set(key, answer)
            coord.later.append(key)
            got = answer
        else:
            got = bytes((yield Barrier(key, what, coord, fetch=True)))
        if len(nodes.ranks) > 1:
            node.set(here, got)
    else:
        got = bytes((yield Barrier(here, what, node, fetch=True)))
    yield from leave_node(node, nodes, name, keys=(here,), wait=True)
    return got


def forget_later(coord: Coordinator, *, keep: list[str] | None = None) -> None:
    """Node 0's leader, where every leader is known to be past the keys it kept for later (it
    heard from all of them since): delete them, but ``keep`` (those still being read)."""
    kept = keep or []
    coord.delete(*(k for k in coord.later if k not in kept))
    coord.later = list(kept)
