"""Keys of a restore (``restore.protocol``): agreeing on the step (``restore.agree``), finding its
holders (``restore.holders``), fetching manifest files (``restore.fetch``, ``restore.needed``), and
planning the reads (``restore.plan``, ``restore.members``). Every scope hangs under the attempt's."""

from __future__ import annotations

from typing import Literal

from tiercheck.cluster.keys._core import Namespaced, family, join

# ----------------------------------------------------------------------------------------- attempts

# The scopes under an attempt's at which every rank settles (``restore.agree.settle``: a ``verdict``),
# or of its parts: ``step`` (agreeing), ``holders``/``replicas``/``copies`` (barriers of finding holders),
# ``reads`` (the read plan), ``tree``/``paths``/``manifest`` (after each fetch), ``foreign``, ``prepared``
# and ``read`` (after reading).
Part = Literal["foreign", "step", "holders", "replicas", "copies", "tree", "paths", "manifest", "prepared",
               "read", "reads"]  # fmt: skip


@family
def restore_scope(n: int) -> str:
    """Scope ``restore<n>``: the ``n``-th restore of a Checkpointer (its first attempt)."""
    return f"restore{n}"


@family
def retry_scope(restore: str, n: int) -> str:
    """Scope ``<restore>.<n>``: the restore's ``n``-th attempt after its first (an older step, or the
    same step's damaged files read from another copy)."""
    return f"{restore}.{n}"


@family
def memory_scope(restore: str, n: int) -> str:
    """Scope ``<restore>/m`` (``n`` 0), else ``<restore>/m<n>``: restoring the memory tier's steps,
    newest first (``Memory``)."""
    return f"{restore}/m{n or ''}"


@family
def memory_choice_scope(restore: str, n: int) -> str:
    """Scope ``<restore>/memory`` (``n`` 0), else ``<restore>/memory<n>``: agreeing on the memory tier's
    newest whole step (``restore.agree``, over the memory tier)."""
    return f"{restore}/memory{n or ''}"


@family
def disk_scope(restore: str) -> str:
    """Scope ``<restore>/disk``: agreeing on the newest step of the other tiers, before a memory step."""
    return f"{restore}/disk"


@family
def part_scope(attempt: str, part: Part) -> str:
    """Scope ``<attempt>/<part>``: one part of a restore attempt (see ``Part``)."""
    return f"{attempt}/{part}"


@family
def agree_scope(name: str, which: Literal["held", "step"]) -> str:
    """Scope ``<attempt>/step/held``: the fold of the steps each node holds (``fold``: JSON
    ``HeldSteps``) up to rank 0; ``<attempt>/step/step``: rank 0's choice (``tell``: JSON
    ``StepDecision``), read by every leader and told to its node."""
    return f"{name}/{which}"


@family
def copies_bucket(restore: str, step: int) -> str:
    """Node bucket ``<restore>/copies/<step>``. W: a rank that found chunks damaged in its node's copy
    posts JSON ``[saving rank, ...]``. R: the node's leader, before it claims holders again. Bound:
    one per rank and damaged copy."""
    return f"{restore}/copies/{step}"


# ------------------------------------------------------------------------------ holders (restore.holders)


@family
def step_index_key(on: Namespaced, attempt: str) -> str:
    """``<attempt>/index``: the step's index. W: each leader whose node holds the step,
    compare-and-set, its node's copy (JSON); the first stands. R: every rank after ``replicas``.
    Bound: one per attempt, deleted as the attempt ends."""
    return join(on, attempt, "index")


@family
def holder_key(on: Namespaced, attempt: str, saving: int) -> str:
    """``<attempt>/holder/<saving>``: the node that serves saving rank ``saving``'s files. W: each
    leader holding them, compare-and-set, JSON ``HolderClaim``. R: ranks fetching manifest files and
    the read plan's coordinators. Bound: one per saving rank, deleted as the attempt ends."""
    return join(on, attempt, "holder", saving)


@family
def node_holds_key(on: Namespaced, attempt: str, leader: int) -> str:
    """``<attempt>/node/<leader>``: what of the step the node uses. W: its leader, JSON ``NodeHolds``.
    R: the node's other ranks after ``holders``. Bound: one per node of several ranks."""
    return join(on, attempt, "node", leader)


# -------------------------------------------------------------------------------- fetch (restore.fetch)


@family
def fetch_scope(attempt: str, what: str) -> str:
    """Scope ``<attempt>/<what>``: one fetch of manifest files (``tree``, ``trees``, ``arrays``)."""
    return f"{attempt}/{what}"


@family
def fetch_round_scope(fetch: str, r: Literal["wanted", "served", "fetched"]) -> str:
    """Scope ``<fetch>/<r>``: the barriers of every rank after asking, serving and reading."""
    return f"{fetch}/{r}"


@family
def want_key(on: Namespaced, fetch: str, kind: str, saving: int) -> str:
    """``<fetch>/want/<kind>/<saving>``: some rank wants that manifest file. W: the wanting ranks,
    ``1``. R: the leader serving ``saving``'s files, after ``wanted``. Bound: one per file wanted
    from another node; the server deletes it after ``fetched``."""
    return join(on, fetch, "want", kind, saving)


@family
def manifest_file_key(on: Namespaced, fetch: str, kind: str, saving: int) -> str:
    """``<fetch>/file/<kind>/<saving>``: a manifest file, as stored (empty where it could not be
    read). W: the leader serving it, before ``served``. R: the ranks that wanted it. Bound: as
    ``want_key``."""
    return join(on, fetch, "file", kind, saving)


# ------------------------------------------------------------------ read plan (restore.plan, .members)


@family
def reads_round_scope(reads: str, r: Literal["posted", "planned", "done"]) -> str:
    """Scope ``<attempt>/reads/<r>``: the barriers of every rank closing the plan's rounds 1-3."""
    return f"{reads}/{r}"


@family
def needs_bucket(reads: str, coordinator: int) -> str:
    """Bucket ``<reads>/needs/<coordinator>``, round 1. W: the first rank of each group of needers
    posts JSON ``NeedsPost``. R: the coordinator in round 2. Bound: one per group it coordinates."""
    return f"{reads}/needs/{coordinator}"


@family
def needs_n_key(on: Namespaced, reads: str, coordinator: int, digest: str) -> str:
    """``<reads>/needs/<coordinator>/<digest>/n``, round 1. W: each member adds 1; the first posts.
    R: also a rank reading alone, whether its replicas posted. Value: a counter. Bound: one per group;
    the coordinator deletes it in round 2."""
    return join(on, reads, "needs", coordinator, digest, "n")


@family
def needs_ranks_key(on: Namespaced, reads: str, coordinator: int, digest: str) -> str:
    """``<reads>/needs/<coordinator>/<digest>/ranks``: the group's register, round 1. W: each leader
    whose node had the group's first rank appends a ``NodeEntry`` (``leader:offsets[:host];``). R: the
    coordinator in round 2, which deletes it. Bound: one entry per such node."""
    return join(on, reads, "needs", coordinator, digest, "ranks")


@family
def groups_scope(reads: str) -> str:
    """Scope ``<reads>/groups``, in a node's store, round 1 (``gather_at_leader``): each rank says
    ``coordinator:digest:rank:f;`` per group (``f``: it posted first); the leader registers them."""
    return f"{reads}/groups"


@family
def sig_key(on: Namespaced, reads: str, coordinator: int, signature: str) -> str:
    """``<reads>/sig/<coordinator>/<signature>``: the nodes of one signature. W: each leader appends
    a ``ListedNode`` (``leader[:host];``). R: the coordinator in round 2, which deletes it. Bound: one
    entry per node."""
    return join(on, reads, "sig", coordinator, signature)


@family
def sig_n_key(on: Namespaced, reads: str, coordinator: int, signature: str) -> str:
    """``<reads>/sig/<coordinator>/<signature>/n``. W: each leader adds 1; the first appends the
    signature's description. Value: a counter. Bound: one per signature; the coordinator deletes it."""
    return join(on, reads, "sig", coordinator, signature, "n")


@family
def signatures_key(on: Namespaced, reads: str, coordinator: int) -> str:
    """``<reads>/sigs/<coordinator>``: the coordinator's signatures. W: each signature's first leader
    appends a ``Signature`` (``signature:shares[:digest:offsets]...;``). R: the coordinator in round 2,
    which deletes it. Bound: one entry per signature (a few per stage)."""
    return join(on, reads, "sigs", coordinator)


@family
def route_key(on: Namespaced, reads: str, coordinator: int, digest: str) -> str:
    """``<reads>/route/<coordinator>/<digest>``, round 2: the group's work. W: the coordinator, JSON
    ``RouteWork``. R: the group's members in round 3. Bound: one per group; the coordinator deletes
    it after ``done``."""
    return join(on, reads, "route", coordinator, digest)


@family
def work_bucket(reads: str, rank: int) -> str:
    """Bucket ``<reads>/work/<rank>``, round 2: reads a rank makes for other groups than its own. W:
    each coordinator with such reads posts JSON ``RouteWork``. R: ``rank`` in round 3. Bound: one
    value per coordinator."""
    return f"{reads}/work/{rank}"
