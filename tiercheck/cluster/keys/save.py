"""Keys of making a save plan (``save.plan``: once per layout) and of committing a save
(``save.vote``: once per save and tier)."""

from __future__ import annotations

from typing import Literal

from tiercheck.cluster.keys._core import Namespaced, family, join

# ------------------------------------------------------------------------------- save plan (save.plan)


@family
def plan_scope(generation: int) -> str:
    """Scope ``plan<generation>``: one save plan; a new layout plans again with the next generation.
    Failures are reported here (``error_key``); ``finish`` deletes its barriers."""
    return f"plan{generation}"


@family
def plan_round_scope(plan: str, r: Literal["posted", "offered", "chosen", "done"]) -> str:
    """Scope ``<plan>/<r>``: the barrier of every rank closing round 1 (``posted``), 2 (``offered``),
    3 (``chosen``) or 4 (``done``)."""
    return f"{plan}/{r}"


@family
def pieces_bucket(plan: str, coordinator: int) -> str:
    """Bucket ``<plan>/in/<coordinator>``, round 1. W: the first holder of each group posts JSON
    ``PiecesPost``. R: the coordinator in round 2. Bound: one value per distinct group it coordinates."""
    return f"{plan}/in/{coordinator}"


@family
def pieces_n_key(on: Namespaced, plan: str, coordinator: int, digest: str) -> str:
    """``<plan>/in/<coordinator>/<digest>/n``, round 1. W: each holder of the group adds 1; the first
    posts the pieces. Value: a counter. Bound: one per group; the coordinator deletes it in round 2."""
    return join(on, plan, "in", coordinator, digest, "n")


@family
def holders_key(on: Namespaced, plan: str, coordinator: int, digest: str) -> str:
    """``<plan>/in/<coordinator>/<digest>/ranks``: the group's register, round 1. W: each node's leader
    appends its node's holders (``holders_entry``: ``rank[+run][:block[+step]],``); a rank alone on its
    node its own. R: the coordinator in round 2, which deletes it. Bound: an entry or a few per node."""
    return join(on, plan, "in", coordinator, digest, "ranks")


@family
def plan_holders_scope(plan: str) -> str:
    """Scope ``<plan>/holders``, in a node's store, round 1 (``gather_at_leader``): each rank says
    ``coordinator:digest:rank:block;`` per group it holds; the leader registers them."""
    return f"{plan}/holders"


@family
def offer_key(on: Namespaced, plan: str, coordinator: int, digest: str, block: int | None = None) -> str:
    """``<plan>/offer/<coordinator>/<digest>[/<block>]``, round 2. W: the coordinator, JSON
    ``ChunkOffer`` (for an uneven block pattern, ``EACH`` there and one offer per block beside it). R:
    the group's holders in round 3. Bound: one per group (per block); the coordinator deletes them
    after ``chosen``."""
    return join(on, plan, "offer", coordinator, digest) if block is None else join(
        on, plan, "offer", coordinator, digest, block)  # fmt: skip


@family
def took_bucket(plan: str, coordinator: int) -> str:
    """Bucket ``<plan>/took/<coordinator>``, round 3. W: each rank that took chunks of several holders
    of the coordinator's arrays posts JSON ``TookPost``. R: the coordinator in round 4. Bound: one
    value per such rank."""
    return f"{plan}/took/{coordinator}"


# ------------------------------------------------------------------------------------ vote (save.vote)

VoteKey = Literal["meta", "outcome", "arrived", "nodes", "committed"]
VOTE_KEYS: tuple[VoteKey, ...] = ("meta", "outcome", "arrived", "nodes", "committed")  # node 0's leader deletes
NodeVoteKey = Literal["outcome", "committed"]


@family
def vote_scope(vote: str, step: int, attempt: int) -> str:
    """Scope ``<vote>/<step>/<attempt>``: one commit of one save (``vote``: ``save``, or the memory
    tier's ``memory``; ``attempt``: how many saves of ``step`` this Checkpointer started before)."""
    return f"{vote}/{step}/{attempt}"


@family
def vote_key(on: Namespaced, vote: str, what: VoteKey) -> str:
    """``<vote>/<what>`` in the job's store. ``meta``: W rank 0, JSON ``CommitMeta``; R the last leader
    to arrive. ``arrived``, ``nodes``: W each leader adds 1 (its node wrote its parts; its node
    committed); a counter. ``outcome``, ``committed``: W compare-and-set, ``ok:<meta>`` / ``ok:`` or why
    not; R every leader. Bound: five per vote; node 0's leader deletes them at the next vote."""
    return join(on, vote, what)


@family
def vote_node_key(node: Namespaced, vote: str, what: NodeVoteKey) -> str:
    """Node ``<vote>/<what>``: the job's decision at ``vote_key(what)``. W: the node's leader. R: the
    node's other ranks. Bound: two per node and vote; the leader deletes them as it leaves."""
    return join(node, vote, what)
