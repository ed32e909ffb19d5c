"""Keys of the tiers' background work: the lineage (``tiering.lineage``), draining to the remote
(``tiering.drain``, ``tiering.suppliers``), setting steps aside (``tiering.retention``), and copies
to peers (``tiering.replication``, ``tiering.memory_peers``)."""

from __future__ import annotations

from tiercheck.cluster.keys._core import Namespaced, family, join

LINEAGE = "lineage"  # scope of settling the lineage before the first save (a ``verdict``)


# ---------------------------------------------------------------------------------- lineage


@family
def lineage_restored_key(on: Namespaced, restore: int) -> str:
    """``lineage/restored/<restore>``: the lineage the job continues after its ``restore``-th restore.
    W: each leader, compare-and-set, the lineage it read; the first stands. R: the leaders. Bound:
    one; rank 0 deletes it after its verdict. Also the base of the next two."""
    return join(on, LINEAGE, "restored", restore)


@family
def lineage_agreed_key(node: Namespaced, restored: str) -> str:
    """Node ``<lineage_restored_key>/agreed`` (the whole job key, under the node's namespace). W: the
    node's leader, the agreed lineage. R: the node's ranks. Bound: one per node; the leader deletes it."""
    return join(node, restored, "agreed")


@family
def lineage_found_scope(restored: str) -> str:
    """Scope ``<lineage_restored_key>/found`` (the whole job key as a scope): the leaders' barrier
    once every leader that found a lineage proposed it (``arrive``/``finish``, counted by nodes)."""
    return f"{restored}/found"


@family
def lineage_read_scope(restored: str) -> str:
    """Scope ``<lineage_restored_key>/read`` (the whole job key as a scope): the verdict of every rank
    once all learned the lineage."""
    return f"{restored}/read"


# ----------------------------------------------------------------------------------- drain


@family
def drain_decision_key(on: Namespaced, step: int) -> str:
    """``drain/<step>/decision``: whether the nodes drain ``step`` or skip it for a newer one (backlog
    ``newest``). W: each node's uploading rank, compare-and-set, ``go`` or ``skip``; the first stands
    and every node reads it in the reply. Bound: one per step considered; never deleted."""
    return join(on, "drain", step, "decision")


@family
def drain_node_key(on: Namespaced, step: int, leader: int) -> str:
    """``drain/<step>/node/<leader>``: how the node's upload of ``step`` went. W: the node's uploading
    rank (its leader), ``ok`` or ``error: ...``. R: the node's other ranks. Bound: one per node of
    several ranks and step drained; never deleted."""
    return join(on, "drain", step, "node", leader)


@family
def remote_commit_key(on: Namespaced, step: int) -> str:
    """``drain/<step>/remote-commit``: the remote's commit of ``step``. W: the node whose upload
    committed it, ``ok``; a node whose upload failed, compare-and-set, why. R: the uploading nodes
    that did not commit it wait for it. Bound: one per step drained; never deleted."""
    return join(on, "drain", step, "remote-commit")


@family
def drain_aside_key(on: Namespaced, step: int, save: str) -> str:
    """``drain/<step>/<save>/aside``: rank 0 set aside the remote's step ``step`` of another save
    before this run's drains. W: rank 0, ``ok`` or ``error: ...``. R: the uploading nodes that find
    the other save in the way. Bound: one per step of this run drained; never deleted."""
    return join(on, "drain", step, save, "aside")


@family
def held_key(on: Namespaced, step: int, save: str | None) -> str:
    """``drain/<step>/<save>/held``: the saving ranks the nodes' directories hold of a save (``None``:
    a step whose marker names no save, which no node posts). W: each node's uploading rank, as the
    job starts, appends a JSON list of ranks and a newline. R: an uploading rank before it waits for
    the remote commit of a step it resumed draining. Bound: a line per node and local step; never
    deleted."""
    return join(on, "drain", step, save, "held")


@family
def held_count_key(on: Namespaced) -> str:
    """``drain/held``. W: each node's uploading rank adds 1 once it posted its ``held_key`` lines.
    Value: a counter. Bound: one per job."""
    return join(on, "drain", "held")


@family
def held_all_key(on: Namespaced) -> str:
    """``drain/held/all``. W: the last node to post, ``ok``. R: an uploading rank waits for it before it
    reads ``held_key``. Bound: one per job."""
    return join(on, "drain", "held", "all")


# --------------------------------------------------------------------------------- retention


@family
def set_aside_key(on: Namespaced, restore: int, step: int, leader: int) -> str:
    """``aside/<restore>/<step>/<leader>``: the node's leader set aside the local step a restore passed
    over. W: the leader, ``ok`` or the error. R: the node's other ranks. Bound: one per node of several
    ranks and step set aside; never deleted."""
    return join(on, "aside", restore, step, leader)


# ------------------------------------------------------------------------------- replication


@family
def pair_prefix(on: Namespaced, scope: str, sender: int, receiver: int) -> str:
    """``<scope>/pair/<sender>-<receiver>`` (node numbers): the prefix of a pair's gloo rendezvous
    (``PrefixStore``), whose keys torch writes. ``scope``: ``replicate`` (the local tier's),
    ``memory-replicate`` (the memory tier's). Bound: per node, its ``ReplicationOptions.peers`` pairs."""
    return f"{join(on, scope, 'pair')}/{sender}-{receiver}"


@family
def parity_group_prefix(on: Namespaced, scope: str, first: int) -> str:
    """``<scope>/group/<first node>``: the prefix of a parity group's gloo rendezvous (``PrefixStore``,
    torch's keys), named by the group's first node. ``scope``: ``memory-parity``. Bound: one per group."""
    return join(on, scope, "group", first)


@family
def copies_done_key(on: Namespaced, scope: str, leader: int, step: int) -> str:
    """``<scope>/done/<leader>/<step>``: the node's copies of a memory step are over. W: the node's
    leader, ``1``. R: the node's ranks, before a slot of the step is reused. Bound: one per node and
    step in memory; the last reader deletes it."""
    return join(on, scope, "done", leader, step)


@family
def copies_seen_key(on: Namespaced, scope: str, leader: int, step: int) -> str:
    """``<scope>/done/<leader>/<step>/seen``. W: each rank of the node adds 1 once it read
    ``copies_done_key``; the last deletes both. Value: a counter."""
    return f"{copies_done_key(on, scope, leader, step)}/seen"


# ----------------------------------------------------------------------------- whole again

WHOLE = "memory-whole"  # scope of making a restored memory step whole again (``tiering.whole_again``)


@family
def whole_holding_key(on: Namespaced, restore: str, node: int) -> str:
    """``memory-whole/<restore>/holding/<node>``: what node ``node``'s memory holds of the step
    restored (``Holding``, JSON). W: the node's leader. R: the leaders it pairs with. Bound: one per
    node and restore from memory; the last leader to leave deletes it."""
    return join(on, WHOLE, restore, "holding", node)


@family
def whole_done_key(on: Namespaced, restore: str, node: int) -> str:
    """``memory-whole/<restore>/whole/<node>``: whether replaced node ``node`` holds its files of the
    step again, in memory and its local directory (``1`` or ``0``). W: its leader. R: the holders of
    its copies, before their copy counts as done. Bound and deletion: as ``whole_holding_key``."""
    return join(on, WHOLE, restore, "whole", node)


@family
def whole_left_key(on: Namespaced, restore: str) -> str:
    """``memory-whole/<restore>/left``: a counter of the leaders done with the restore's copies; the
    last deletes it and the two keys above."""
    return join(on, WHOLE, restore, "left")
