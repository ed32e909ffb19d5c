"""The join every key goes through, the digest, the namespaces, and the keys of the coordinator's
patterns (``cluster.coordination``) and of the two-level exchanges (``cluster.hierarchy``)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol, TypeVar

ROOT = "tiercheck"
DIGEST_BYTES = 12  # of a group's description (blake2b): a collision would merge two groups
DIGEST_HEX = 2 * DIGEST_BYTES  # its width on the wire, in lowercase hex digits


class Namespaced(Protocol):
    """A coordinator, for the namespace its keys live in (``Coordinator.namespace``)."""

    @property
    def namespace(self) -> str: ...


F = TypeVar("F", bound=Callable[..., str])
FAMILIES: dict[str, Callable[..., str]] = {}  # every family, by name: each is named in docs/protocol.md


def family(fn: F) -> F:
    """Register a key family (a function that names one kind of key, scope or bucket)."""
    FAMILIES[fn.__name__] = fn
    return fn


def join(on: Namespaced, *parts: object) -> str:
    """The one join of a key's segments: ``tiercheck/<namespace>/<parts...>``."""
    return "/".join([ROOT, on.namespace, *map(str, parts)])


def digest(body: str) -> str:
    """The name of a description (a save plan's group of pieces, a restore's group of needs, a node
    signature): ``DIGEST_HEX`` hex digits, equal for equal descriptions on every rank."""
    return hashlib.blake2b(body.encode(), digest_size=DIGEST_BYTES).hexdigest()


# ------------------------------------------------------------------------------------ namespaces


@family
def job_namespace(members: str, n: int) -> str:
    """``g<members>/ckpt<n>``: the namespace of the ``n``-th Checkpointer of a process group; ``members``:
    its ranks joined by ``-`` (at most 8 ranks), else 12 hex digits of their SHA-1."""
    return f"g{members}/ckpt{n}"


@family
def node_namespace(job: str, number: int) -> str:
    """``<job namespace>/node<number>``: the namespace of node ``number``'s keys, in the node's store
    (or in the job's, where the node meets there)."""
    return f"{job}/node{number}"


# ------------------------------------------------------------------- patterns (cluster.coordination)


@family
def arrived_key(on: Namespaced, scope: str) -> str:
    """``<scope>/arrived``. W: each rank at barrier ``scope`` adds 1 (``arrive``); the adder reads the
    sum. Value: a counter. Bound: one per barrier, deleted at ``finish`` (or by the protocol)."""
    return join(on, scope, "arrived")


@family
def open_key(on: Namespaced, scope: str) -> str:
    """``<scope>/open``. W: the last rank to arrive, ``1``. R: every rank of the barrier waits for it.
    Bound: one per barrier, deleted at ``finish`` (or by the protocol)."""
    return join(on, scope, "open")


@family
def error_key(on: Namespaced, scope: str) -> str:
    """``<scope>/error``: the first failure reported at ``scope``. W: a failing rank, compare-and-set
    (``report``). R: every rank after the next barrier (``check``); a ``verdict``'s leaders. Value:
    JSON ``[rank, kind, text]``. Bound: one per scope, deleted at ``finish``."""
    return join(on, scope, "error")


@family
def finished_key(on: Namespaced, scope: str) -> str:
    """``<scope>/finished``. W: each rank leaving the protocol adds 1 (``finish``); the last deletes
    the scope's barriers, failures and the keys it names. Value: a counter. Bound: one per scope."""
    return join(on, scope, "finished")


@family
def bucket_n_key(on: Namespaced, bucket: str) -> str:
    """``<bucket>/n``. W: each poster adds 1 (``post``). R: the collector, an add of 0, after a
    barrier (``collect``). Value: a counter. Bound: one per bucket, deleted by ``collect``."""
    return join(on, bucket, "n")


@family
def bucket_item_key(on: Namespaced, bucket: str, i: int) -> str:
    """``<bucket>/<i>``: the ``i``-th value posted (from 1). W: its poster. R: the collector. Value:
    the bucket's. Bound: the bucket's posts, deleted by ``collect``."""
    return join(on, bucket, i)


# -------------------------------------------------------------------- two levels (cluster.hierarchy)


@family
def node_in_scope(scope: str) -> str:
    """Scope ``<scope>/in``, in a node's store: the node's ranks count in at their node (a
    ``verdict``, a vote) before their leader counts the node in at the job's store."""
    return f"{scope}/in"


@family
def out_key(node: Namespaced, scope: str) -> str:
    """Node ``<scope>/out``: a ``verdict`` at the node. W: its leader, the job's failure at ``scope``
    as read there, or ``-``. R: the node's other ranks. Bound: one per node, deleted by the leader."""
    return join(node, scope, "out")


@family
def left_key(node: Namespaced, scope: str) -> str:
    """Node ``<scope>/left``. W: each rank but the leader adds 1 as it leaves (``leave_node``). Value:
    a counter. Bound: one per node and scope, deleted by the leader."""
    return join(node, scope, "left")


@family
def all_left_key(node: Namespaced, scope: str) -> str:
    """Node ``<scope>/left/all``. W: the last rank to leave, ``1``. R: the leader waits for it before it
    deletes the node's keys of ``scope``. Bound: one per node and scope."""
    return join(node, scope, "left", "all")


@family
def scope_key(on: Namespaced, scope: str) -> str:
    """``<scope>`` itself as a key. In a node's store: what the node's ranks tell their leader
    (``gather_at_leader``); W each rank appends its ASCII entries, each ending in ``;``; R the leader
    after the node's barrier at ``scope``, which deletes it; bound: the node's ranks' entries. Also
    names a bucket in errors."""
    return join(on, scope)


@family
def up_key(on: Namespaced, scope: str, node: int) -> str:
    """``<scope>/up/<node>``: node ``node``'s fold of its subtree (``fold``). W: its leader. R: its
    parent's leader, node ``(node - 1) // FAN_IN``, which deletes it. Value: the scope's. Bound: one
    per node but node 0."""
    return join(on, scope, "up", node)


@family
def answer_key(on: Namespaced, scope: str) -> str:
    """``<scope>/answer``, job and node (``tell``). W: node 0's leader in the job's store; every leader
    in its node's. R: every leader; the node's ranks. Bound: one per scope and node. Node 0's leader
    deletes the job's at its next fold or vote (``Coordinator.later``), each leader its node's."""
    return join(on, scope, "answer")
