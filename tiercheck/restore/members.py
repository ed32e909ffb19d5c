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
  members as offsets from its first rank (``node_entry``);
- the groups it joined (posted first elsewhere) it describes together, each group's digest with the
  node's offsets, and names the description by a digest, the node's **signature** at that
  coordinator: the replicas of one stage have the same. It appends its first rank (and its host,
  where it is not its own: ``Nodes.host``) to the signature's list of nodes (``listed_node``); the
  first node to do so also appends the description to the coordinator's signatures
  (``signature_entry``).

A coordinator then reads, per signature (one, or a few where the race for first went several ways),
its description once and five to seven bytes per node: the eight slices of a weight cost what one
did, and a node's entry is its first rank, not its first rank, host and offsets per group.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tiercheck.cluster.coordination import Coordinator
from tiercheck.cluster.keys import DIGEST_HEX, digest
from tiercheck.cluster.keys.restore import needs_ranks_key, sig_key, sig_n_key, signatures_key
from tiercheck.cluster.ranksets import RankSet
from tiercheck.cluster.wire import bad


@dataclass(frozen=True, slots=True)
class Member:
    """A rank of a group of needers: its node (its first rank) and host (``Nodes.host`` as said by
    ``restore.read.share_key``; None: it shares no memory)."""

    rank: int
    node: int
    host: str | None = None


_HOST = r"[0-9A-Za-z_.-]{1,64}"
_SPANS = r"[0-9]+(?:-[0-9]+)?(?:,[0-9]+(?:-[0-9]+)?)*"
_NODE_ENTRY = re.compile(rf"([0-9]+):({_HOST})?:({_SPANS})")
_LISTED = re.compile(rf"([0-9]+)(?::({_HOST}))?")
_HOST_ONLY = re.compile(_HOST)
_DIGEST = rf"[0-9a-f]{{{DIGEST_HEX}}}"
_SIGNATURE = re.compile(rf"({_DIGEST}):(s?):((?:{_DIGEST}/{_SPANS}\|)*{_DIGEST}/{_SPANS})")


def offsets_entry(leader: int, ranks: Sequence[int]) -> str:
    """A node's members of a group as offsets from its first rank, in spans: ``0-3,5``."""
    spans = []
    for start, length, stride, count in RankSet.of(r - leader for r in ranks).runs:
        for k in range(count):
            a = start + k * stride
            spans.append(f"{a}-{a + length - 1}" if length > 1 else f"{a}")
    return ",".join(spans)


def _host(host: str | None) -> str:
    if host is not None and not _HOST_ONLY.fullmatch(host):
        raise ValueError(f"a host is letters, digits, '_', '.' or '-', 1 to 64 of them, not {host!r}")
    return host or ""


def node_entry(leader: int, host: str | None, offsets: str) -> str:
    """A node's part in a group's register: its first rank, host ('': it shares no memory) and members."""
    return f"{leader}:{_host(host)}:{offsets};"


def listed_node(leader: int, host: str | None) -> str:
    """A node in its signature's list: its first rank, and its host where that is not its first
    rank's own number (``Nodes.host``: where nodes share a host)."""
    return f"{leader}," if host is None or host == str(leader) else f"{leader}:{_host(host)},"


def signature_entry(signature: str, shares: bool, groups: Mapping[str, str]) -> str:
    """A signature among a coordinator's: the groups its nodes joined (digest, offsets); ``shares``:
    its nodes share memory (their hosts are in its list of nodes)."""
    return f"{signature}:{'s' if shares else ''}:{'|'.join(f'{d}/{o}' for d, o in sorted(groups.items()))};"


# By coordinator and digest: the node's members of the group, and whether a rank of the node was its first.
Groups = Mapping[tuple[int, str], tuple[list[int], bool]]


def sign(coord: Coordinator, name: str, leader: int, host: str | None, groups: Groups) -> None:
    """On a node's first rank: register the node's ``groups`` (see the module docstring)."""
    joined: dict[int, dict[str, str]] = defaultdict(dict)
    for (c, d), (ranks, first) in sorted(groups.items()):
        offsets = offsets_entry(leader, ranks)
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
    keys it then deletes."""
    rank, world = coord.rank, coord.world_size
    registers = [needs_ranks_key(coord, name, rank, d) for d in wanted]
    sigs_key = signatures_key(coord, name, rank)
    *raws, sigs_raw = coord.multi_get([*registers, sigs_key]) if coord.has(sigs_key) else [
        *coord.multi_get(registers), b""]  # fmt: skip
    out: dict[str, list[Member]] = {}
    for d, key, raw in zip(wanted, registers, raws, strict=True):
        out[d] = [Member(n + o, n, h) for n, h, offsets in parse_register(raw, where=key, world=world) for o in offsets]
    signatures = parse_signatures(sigs_raw, where=sigs_key, world=world)
    lists = [sig_key(coord, name, rank, s) for s, _, _ in signatures]
    for (s, shares, joined), key, raw in zip(signatures, lists, coord.multi_get(lists), strict=True):
        nodes = parse_nodes(raw, where=key, world=world)
        for d, offsets in joined.items():
            if d not in out:
                raise bad(sigs_key, s, f"groups posted to rank {rank}", d)
            if len(out[d]) + len(nodes) * len(offsets) > world or any(n + offsets[-1] >= world for n, _ in nodes):
                raise bad(key, "nodes", f"at most {world} members of group {d}, each below rank {world}", raw[:80])
            out[d] += [Member(n + o, n, h if shares else None) for n, h in nodes for o in offsets]
    counts = [sig_n_key(coord, name, rank, s) for s, _, _ in signatures]
    coord.delete(*registers, sigs_key, *lists, *counts)
    return out


def _offsets(spans: str, where: str, field: str, world: int, left: int) -> list[int]:
    """Offsets in spans, each below ``world``, and no more than ``left`` of them: a rank is a member
    of one group per coordinator, so a register or signature names at most ``world`` in all."""
    bounds = [[int(x) for x in span.split("-")] for span in spans.split(",")]
    if any(b[0] > b[-1] or b[-1] >= world for b in bounds) or sum(b[-1] - b[0] + 1 for b in bounds) > left:
        raise bad(where, field, f"at most {world} offsets in all, each below {world}", spans)
    return sorted({o for b in bounds for o in range(b[0], b[-1] + 1)})


def _entries(raw: bytes, where: str, field: str, end: str) -> list[str]:
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise bad(where, field, "ASCII entries", raw) from None
    return text.removesuffix(end).split(end) if text else []


def parse_register(raw: bytes, *, where: str, world: int) -> list[tuple[int, str | None, list[int]]]:
    """A group's register (``node_entry`` after ``node_entry``): each node's first rank, host (None:
    it shares no memory) and the offsets of its members (checked before they are expanded)."""
    out = []
    left = world
    for i, entry in enumerate(_entries(raw, where, "members", ";")):
        m = _NODE_ENTRY.fullmatch(entry)
        if m is None or int(m[1]) >= world:
            raise bad(where, f"members[{i}]", f"a node's first rank below {world}, its host and offsets", entry)
        offsets = _offsets(m[3], where, f"members[{i}]", world, left)
        left -= len(offsets)
        if int(m[1]) + offsets[-1] >= world:
            raise bad(where, f"members[{i}]", f"members below rank {world}", entry)
        out.append((int(m[1]), m[2], offsets))
    return out


def parse_signatures(raw: bytes, *, where: str, world: int) -> list[tuple[str, bool, dict[str, list[int]]]]:
    """A coordinator's signatures (``signature_entry`` after ``signature_entry``): each with whether
    its nodes share memory, and the offsets of their members in each group they joined."""
    out = []
    for i, entry in enumerate(_entries(raw, where, "signatures", ";")):
        m = _SIGNATURE.fullmatch(entry)
        if m is None:
            raise bad(where, f"signatures[{i}]", "a signature, whether it shares memory, and digest/offsets", entry)
        joined, left = {}, world
        for d, o in (g.split("/") for g in m[3].split("|")):
            joined[d] = _offsets(o, where, f"signatures[{i}]", world, left)
            left -= len(joined[d])
        out.append((m[1], m[2] == "s", joined))
    return out


def parse_nodes(raw: bytes, *, where: str, world: int) -> list[tuple[int, str]]:
    """A signature's list of nodes (``listed_node`` after ``listed_node``): each node's first rank and host."""
    out = []
    for i, entry in enumerate(_entries(raw, where, "nodes", ",")):
        m = _LISTED.fullmatch(entry)
        if m is None or int(m[1]) >= world:
            raise bad(where, f"nodes[{i}]", f"a first rank below {world}, and its host", entry)
        out.append((int(m[1]), m[2] or m[1]))
    if len(out) > world:
        raise bad(where, "nodes", f"at most {world} nodes", len(out))
    return out
