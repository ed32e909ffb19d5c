"""Keys of joining the nodes, opening their channels (``cluster.nodes``) and locking their
directories (``cluster.lock``): once per job, a few requests per rank."""

from __future__ import annotations

from typing import Literal

from tiercheck.cluster.keys._core import Namespaced, family, join

NODES = "nodes"  # scope of ``join_nodes``: its barriers, ``finish`` and keys hang under it
CHANNEL = "channel"  # scope in a node's namespace (of the job's store): the node's ranks learn how they meet
LOCK = "lock"  # scope of ``take_lock``: failures are reported at ``lock``, every rank arrives at ``lock/taken``


@family
def nodes_scope(r: Literal["joined", "read", "numbered"]) -> str:
    """Scope ``nodes/<r>``: the three barriers of ``join_nodes``, of every rank, in order."""
    return f"{NODES}/{r}"


@family
def node_members_bucket(node_id: str) -> str:
    """Bucket ``nodes/<node id>`` (``node_id``: 32 hex digits, the directory's). W: each rank of the node
    posts its rank (decimal). R: each of them after ``nodes/joined``. Bound: the node's ranks; each
    deletes its own entry (and the first poster the count) after ``nodes/read``."""
    return f"{NODES}/{node_id}"


@family
def leaders_bucket() -> str:
    """Bucket ``nodes/leaders``. W: each node's leader posts its rank, or JSON ``[rank, host]`` where
    it knows its host. R: rank 0 after ``nodes/read``, to number the nodes. Bound: one per node."""
    return f"{NODES}/leaders"


@family
def nodes_count_key(on: Namespaced) -> str:
    """``nodes/count``. W: each node's first poster adds 1. R: every rank after ``nodes/joined`` (an add
    of 0). Value: a counter. Bound: one; rank 0 deletes it after ``nodes/read``."""
    return join(on, NODES, "count")


@family
def run_key(on: Namespaced) -> str:
    """``nodes/run``: the job's run id. W: rank 0, 32 hex digits. R: every rank after
    ``nodes/joined``. Bound: one; rank 0 deletes it after ``nodes/read``."""
    return join(on, NODES, "run")


@family
def node_number_key(on: Namespaced, leader: int) -> str:
    """``nodes/number/<leader>``: the number of the node whose first rank is ``leader``. W: rank 0,
    ``number`` or JSON ``[number, first rank of its host]``. R: the node's ranks. Bound: one per node;
    the leader deletes it after ``nodes/numbered``."""
    return join(on, NODES, "number", leader)


@family
def channel_key(on: Namespaced, number: int) -> str:
    """``nodes/channel/<number>``: where node ``number``'s store listens. W: its leader, the address
    (empty: it serves none). R: the node's ranks. Bound: one per node of several ranks, in a job of
    several nodes; deleted at ``channel``'s finish."""
    return join(on, NODES, "channel", number)


@family
def channel_tried_key(on: Namespaced, number: int) -> str:
    """``nodes/channel/<number>/tried``. W: each rank of the node adds 1, and ``1 << 20`` more where
    it could not reach the store. Value: a counter. Bound: as ``channel_key``."""
    return join(on, NODES, "channel", number, "tried")


@family
def channel_whole_key(on: Namespaced, number: int) -> str:
    """``nodes/channel/<number>/whole``. W: the last rank to try, ``1`` where every rank reached the
    node's store, else ``0`` (the node meets in the job's store). R: the node's ranks. Bound: as
    ``channel_key``."""
    return join(on, NODES, "channel", number, "whole")


@family
def lock_scope() -> str:
    """Scope ``lock/taken``: the barrier of every rank once each node's leader tried to lock its
    directory (failures reported at scope ``lock``)."""
    return f"{LOCK}/taken"
