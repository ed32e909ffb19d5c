"""Who needs what: a read plan's groups of needers reach their coordinators in a few bytes per node.

A group is the ranks needing the same boxes of one coordinator's arrays (``restore.plan``): the
data-parallel replicas of a shard, one rank on each of a thousand nodes at 131,072 ranks. A
coordinator must know every member (who receives each chunk). Its groups come in families, though:
the eight tensor-parallel slices of a weight are eight groups, with their members at the same places
on the same nodes. So each node's first rank registers the node's groups at a coordinator in two
kinds of entry:

- a group a rank of the node was the first of the job to post (its boxes came from this node: every
  group of one member, a distributed optimizer's slices, and one node's share of each replicated
  group) gets an entry of its own in the group's register: the node's first rank, its host and its
  members as offsets from its first rank (``NodeEntry``);
- the groups it joined (posted first elsewhere) it describes together, each group's digest with the
  node's offsets, and names the description by a digest, the node's **signature** at that
  coordinator: the replicas of one stage have the same. It appends its first rank (and its host,
  where it is not its own: ``Nodes.host``) to the signature's list of nodes (``ListedNode``); the
  first node to do so also appends the description to the coordinator's signatures
  (``Signature``).

Each is an entry (``cluster.wire.Entry``), its members a set of ranks (``cluster.wire.RankSet``):
``8:0+4,5:8;`` is node 8's ranks 8-11 and 13, on host 8.

A coordinator then reads, per signature (one, or a few where the race for first went several ways),
its description once and five to seven bytes per node: the eight slices of a weight cost what one
did, and a node's entry is its first rank, not its first rank, host and offsets per group.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tiercheck.cluster.coordination import Coordinator
from tiercheck.cluster.keys import digest
from tiercheck.cluster.keys.restore import needs_ranks_key, sig_key, sig_n_key, signatures_key
from tiercheck.cluster.wire import (
    Entry,
    RankSet,
    bad,
    is_token,
    optional,
    read_flag,
    read_rank,
    read_ranks,
    read_token,
)


@dataclass(frozen=True, slots=True)
class Member:
    """A rank of a group of needers: its node (its first rank) and host (``Nodes.host`` as said by
    ``restore.read.share_key``; None: it shares no memory)."""

    rank: int
    node: int
    host: str | None = None


@dataclass(frozen=True, slots=True)
class GroupWord(Entry):
    """A rank's word to its node's first rank (``restore.plan._register``): it needs with the group
    ``digest`` of coordinator ``coordinator``, and was the first rank of the job to post it."""

    coordinator: int
    digest: str
    rank: int
    first: bool = False

    FIELDS = (("coordinator", read_rank), ("digest", read_token), ("rank", read_rank), ("first", read_flag))


@dataclass(frozen=True, slots=True)
class NodeEntry(Entry):
    """A node's part in a group's register: its first rank, its members as offsets from it, and its
    host (None: it shares no memory)."""

    leader: int
    offsets: RankSet
    host: str | None = None

    FIELDS = (("leader", read_rank), ("offsets", read_ranks), ("host", optional(read_token)))


@dataclass(frozen=True, slots=True)
class ListedNode(Entry):
    """A node in its signature's list: its first rank, and its host where that is not its first
    rank's own number (``Nodes.host``: where nodes share a host)."""

    leader: int
    host: str | None = None

    FIELDS = (("leader", read_rank), ("host", optional(read_token)))


@dataclass(frozen=True, slots=True)
class Signature(Entry):
    """A signature among a coordinator's: the groups its nodes joined (digest, offsets); ``shares``:
    its nodes share memory (their hosts are in its list of nodes)."""

    signature: str
    shares: bool
    groups: tuple[tuple[str, RankSet], ...]

    FIELDS = (("signature", read_token), ("shares", read_flag))
    REPEAT = (("digest", read_token), ("offsets", read_ranks))


# By coordinator and digest: the node's members of the group, and whether a rank of the node was its first.
Groups = Mapping[tuple[int, str], tuple[list[int], bool]]


def node_entry(leader: int, host: str | None, offsets: RankSet) -> str:
    """A ``NodeEntry``, as appended to a group's register."""
    return NodeEntry(leader, offsets, host).entry()


def listed_node(leader: int, host: str | None) -> str:
    """A ``ListedNode``, its host left out where it is its first rank's own number."""
    return ListedNode(leader, None if host is None or host == str(leader) else host).entry()


def signature_entry(signature: str, shares: bool, groups: Mapping[str, RankSet]) -> str:
    """A ``Signature``, its groups in the order of their digests (the same on every node)."""
    return Signature(signature, shares, tuple(sorted(groups.items()))).entry()


def sign(coord: Coordinator, name: str, leader: int, host: str | None, groups: Groups) -> None:
    """On a node's first rank: register the node's ``groups`` (see the module docstring)."""
    if host is not None and not is_token(host):
        raise ValueError(f"a host is letters, digits, '_', '.' or '-', 1 to 64 of them, not {host!r}")
    joined: dict[int, dict[str, RankSet]] = defaultdict(dict)
    for (c, d), (ranks, first) in sorted(groups.items()):
        offsets = RankSet.of(r - leader for r in ranks)
        if first:
            coord.append(needs_ranks_key(coord, name, c, d), node_entry(leader, host, offsets))
        else:
            joined[c][d] = offsets
    shares = host is not None
    for c, items in sorted(joined.items()):
        body = signature_entry("", shares, items)
        signature = digest(body)
        coord.append(sig_key(coord, name, c, signature), listed_node(leader, host))
        if coord.add(sig_n_key(coord, name, c, signature), 1) == 1:
            coord.append(signatures_key(coord, name, c), signature_entry(signature, shares, items))


def collect(coord: Coordinator, name: str, wanted: Sequence[str]) -> dict[str, list[Member]]:
    """On a coordinator, once every node has registered: the members of each of its groups (by
    digest, ``wanted``: those posted to it), from the groups' registers and its signatures, whose
    keys it then deletes. A rank is a member of one group per coordinator: what the registers and
    signatures name comes to at most the world size, checked before any member is expanded."""
    rank, world = coord.rank, coord.world_size
    registers = [needs_ranks_key(coord, name, rank, d) for d in wanted]
    sigs_key = signatures_key(coord, name, rank)
    *raws, sigs_raw = coord.multi_get([*registers, sigs_key]) if coord.has(sigs_key) else [
        *coord.multi_get(registers), b""]  # fmt: skip
    out: dict[str, list[Member]] = {}
    left = world
    for d, key, raw in zip(wanted, registers, raws, strict=True):
        entries = NodeEntry.read(raw, where=key, field="members", world=world)
        left = _spend(left, sum(len(e.offsets) for e in entries), key, "members", world)
        for i, e in enumerate(entries):
            if not e.offsets or e.leader + e.offsets.last >= world:
                raise bad(key, f"members[{i}]", f"members below rank {world}", e.entry())
        out[d] = [Member(e.leader + o, e.leader, e.host) for e in entries for o in e.offsets]
    signatures = Signature.read(sigs_raw, where=sigs_key, field="signatures", world=world)
    lists = [sig_key(coord, name, rank, s.signature) for s in signatures]
    for s, key, raw in zip(signatures, lists, coord.multi_get(lists), strict=True):
        nodes = ListedNode.read(raw, where=key, field="nodes", world=world)
        for d, offsets in s.groups:
            if d not in out:
                raise bad(sigs_key, s.signature, f"groups posted to rank {rank}", d)
            left = _spend(left, len(nodes) * len(offsets), key, "nodes", world)
            if not offsets or any(n.leader + offsets.last >= world for n in nodes):
                raise bad(key, "nodes", f"at most {world} members of group {d}, each below rank {world}", raw[:80])
            out[d] += [Member(n.leader + o, n.leader, (n.host or str(n.leader)) if s.shares else None)
                       for n in nodes for o in offsets]  # fmt: skip
    counts = [sig_n_key(coord, name, rank, s.signature) for s in signatures]
    coord.delete(*registers, sigs_key, *lists, *counts)
    return out


def _spend(left: int, n: int, where: str, field: str, world: int) -> int:
    if n > left:
        raise bad(where, field, f"at most {world} members in all", n)
    return left - n
