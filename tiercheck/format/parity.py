"""The memory tier's parity: which nodes code together, how a node's files are cut into pieces, and
the Reed-Solomon arithmetic over them (``zfec``). Pure: no torch, no I/O.

**Groups.** Nodes (numbered by their first rank) are dealt into groups of ``data + parity`` nodes,
``jump`` apart (``groups``): with ``jump`` nodes per rack, a group's nodes are in different racks,
as peer copies are placed. A node count that is not a multiple of the group size leaves a rest; the
last group takes it (``n`` nodes, ``n - parity`` data pieces per stripe).

**Stripes.** In a group of ``n`` nodes that survives ``m`` losses, each node's *region* (its files of
the step, one after another) is cut into ``d = n - m`` pieces of ``piece`` bytes (the group's largest
region over ``d``, rounded up; the tail zero-filled). There are ``n`` stripes, one per rotation:
stripe ``r`` holds, at position ``j``, the shard of member ``(r + j) % n``; positions ``j < d`` are
data (that member's piece ``j``), positions ``d + p`` parity ``p`` of the stripe, computed from its
``d`` data shards. Every member is data in ``d`` stripes and parity in ``m``: it keeps its region and
``m`` parity pieces, ``m / d`` of its region. Any ``m`` members lost leave every stripe ``d`` shards,
from which ``decode`` gives back each lost shard, data or parity.

**Record.** ``ParityRecord``: what every member of a group writes beside its parity pieces once the
group's parity is committed and checked (``PARITY.json``, last): the group, the piece size, and each
member's files (name, size, CRC32C) and commit marker. A replaced member rebuilds its files from it.
Every field is checked before it is used (``cluster.wire`` rules: bounds before allocation).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from tiercheck.errors import CorruptCheckpointError, InvalidArgumentError
from tiercheck.format.paths import MANIFEST_FILE, rank_files
from tiercheck.format.values import crc32c_value, file_offset, nonneg_int, positive_int, world_size_of

PARITY_RECORD = "PARITY.json"
MAX_RECORD_BYTES = 64 << 20  # a group's record: its members' file lists and commit markers
MAX_GROUP = 256  # GF(2^8): at most 256 shards a stripe
MAX_FILES_PER_MEMBER = 6  # per saving rank: its manifest part, arrays shard, owners, refs and pack; and the manifest


def parity_file(stripe: int) -> str:
    """The name of this node's parity piece of ``stripe`` in its memory step directory."""
    return f"parity-{stripe}.bin"


def is_parity_file(name: str) -> bool:
    """Whether ``name`` (in a memory step directory) is named as a parity piece (``parity_file``)."""
    return name.startswith("parity-") and name.endswith(".bin")


def groups(count: int, size: int, parity: int, jump: int = 1) -> list[list[int]]:
    """The coding groups of ``count`` nodes: ``size``-node groups (``data + parity``), each node's
    fellows ``jump`` apart where the count allows; the last group takes the rest. A job of fewer
    than ``size`` nodes is one group; ``InvalidArgumentError`` where it has ``parity`` nodes or fewer."""
    if count <= parity:
        raise InvalidArgumentError(
            f"parity over {count} node(s) cannot survive {parity} lost: it needs more than {parity} nodes"
        )
    jump = max(1, jump)
    order = sorted(range(count), key=lambda n: (n % jump, n // jump))  # racks apart, as copies are placed
    full = max(1, count // size)
    out = [order[i * size : (i + 1) * size] for i in range(full)]
    out[-1] = out[-1] + order[full * size :]
    return [sorted(g) for g in out]


def group_of(node: int, count: int, size: int, parity: int, jump: int = 1) -> list[int]:
    """The group (its nodes, ascending) that ``node`` codes with."""
    return next(g for g in groups(count, size, parity, jump) if node in g)


@dataclass(frozen=True, slots=True)
class Stripes:
    """The stripes of a group of ``n`` members surviving ``m`` losses (members numbered 0..n-1)."""

    n: int
    m: int

    def __post_init__(self) -> None:
        if not 0 < self.m < self.n <= MAX_GROUP:
            raise InvalidArgumentError(f"a parity group of {self.n} node(s) cannot survive {self.m} lost")

    @property
    def d(self) -> int:
        return self.n - self.m

    def holder(self, stripe: int, position: int) -> int:
        """The member holding ``position`` of ``stripe``."""
        return (stripe + position) % self.n

    def position(self, stripe: int, member: int) -> int:
        return (member - stripe) % self.n

    def data_of(self, member: int) -> list[tuple[int, int]]:
        """``(stripe, piece)``: where each of ``member``'s ``d`` pieces lies (its position is the piece)."""
        return [((member - j) % self.n, j) for j in range(self.d)]

    def parity_of(self, member: int) -> list[tuple[int, int]]:
        """``(stripe, p)``: the stripes whose parity ``p`` ``member`` holds."""
        return [((member - self.d - p) % self.n, p) for p in range(self.m)]

    def piece_bytes(self, regions: Sequence[int]) -> int:
        """The piece size for regions of these sizes: the largest over ``d``, rounded up (at least 1)."""
        return max(1, math.ceil(max(regions, default=0) / self.d))


@cache
def _encoder(d: int, n: int) -> Any:
    import zfec

    return zfec.Encoder(d, n)


@cache
def _decoder(d: int, n: int) -> Any:
    import zfec

    return zfec.Decoder(d, n)


def encode(stripes: Stripes, data: Sequence[Any], parity: Sequence[int]) -> list[bytes]:
    """Parity pieces ``parity`` (each ``p`` in ``0..m-1``) of a stripe from its ``d`` data shards
    (equal-sized buffers, in position order)."""
    if len(data) != stripes.d or len({len(memoryview(b)) for b in data}) > 1:
        raise InvalidArgumentError(f"a stripe codes {stripes.d} equal data shards, not {len(data)}")
    return list(_encoder(stripes.d, stripes.n).encode(list(data), [stripes.d + p for p in parity]))


def decode(stripes: Stripes, shards: Mapping[int, Any], want: Sequence[int]) -> dict[int, bytes]:
    """The shards at positions ``want`` of a stripe, from ``d`` of its shards by position (any mix of
    data and parity, equal-sized)."""
    if len(shards) < stripes.d:
        raise CorruptCheckpointError(f"a stripe needs {stripes.d} shards to decode, {len(shards)} are left")
    have = sorted(shards)[: stripes.d]
    blocks = [shards[p] for p in have]
    data = blocks if have == list(range(stripes.d)) else list(_decoder(stripes.d, stripes.n).decode(blocks, have))
    out: dict[int, bytes] = {}
    lost_parity = [w - stripes.d for w in want if w >= stripes.d]
    for w in want:
        if w < stripes.d:
            out[w] = bytes(data[w])
    if lost_parity:
        for p, piece in zip(lost_parity, encode(stripes, data, lost_parity), strict=True):
            out[stripes.d + p] = piece
    return out


# ---------------------------------------------------------------------------------- the record


@dataclass(frozen=True, slots=True, kw_only=True)
class Member:
    """One member of a parity group, as the record names it: its node number, its saving ranks and
    the job's world size, its files of the step in region order (name, size, CRC32C: only its ranks'
    files, ``paths.rank_files``, and the step's manifest), its parity
    pieces' CRC32Cs (by stripe) and its commit marker (the bytes, as committed)."""

    node: int
    ranks: tuple[int, ...]
    world_size: int
    files: tuple[tuple[str, int, int], ...]
    parity: tuple[tuple[int, int], ...]
    commit: str

    @property
    def region(self) -> int:
        return sum(size for _, size, _ in self.files)

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "ranks": list(self.ranks), "world_size": self.world_size,
                "files": [list(f) for f in self.files], "parity": [list(p) for p in self.parity],
                "commit": self.commit}  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class ParityRecord:
    """A group's parity of one step (``PARITY.json``): the step and save, the members in group order
    (member ``i`` is ``nodes[i]``), ``m``, and the piece size."""

    step: int
    save_id: str
    m: int
    piece: int
    members: tuple[Member, ...]

    @property
    def stripes(self) -> Stripes:
        return Stripes(len(self.members), self.m)

    def index(self, node: int) -> int:
        """The member number of ``node`` (``KeyError`` where it is not one)."""
        for i, member in enumerate(self.members):
            if member.node == node:
                return i
        raise KeyError(node)

    def to_bytes(self) -> bytes:
        doc = {"step": self.step, "save_id": self.save_id, "m": self.m, "piece": self.piece,
               "members": [m.to_json() for m in self.members]}  # fmt: skip
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, *, where: str) -> ParityRecord:
        """A record read back, every field checked (``CorruptCheckpointError`` naming the field)."""
        if len(raw) > MAX_RECORD_BYTES:
            raise CorruptCheckpointError(f"{where}: {len(raw)} bytes, more than a parity record holds")
        field = "the document"
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError("not an object")
            field = "members"
            members = doc["members"]
            if not isinstance(members, list) or not 1 < len(members) <= MAX_GROUP:
                raise ValueError(f"{type(members).__name__} of {len(members) if isinstance(members, list) else 0}")
            parsed = tuple(_member(m, where=f"{where}: members[{i}]") for i, m in enumerate(members))
            field = "m"
            m = positive_int(doc["m"])
            Stripes(len(parsed), m)
            field = "piece"
            piece = positive_int(file_offset(doc["piece"]))  # bounded: a rebuild allocates pieces of it
            field = "step"
            step = nonneg_int(doc["step"])
            field = "save_id"
            save = doc["save_id"]
            if not isinstance(save, str) or len(save) > 256:
                raise ValueError(repr(save)[:80])
        except CorruptCheckpointError:
            raise
        except (ValueError, TypeError, KeyError, RecursionError, InvalidArgumentError) as e:
            raise CorruptCheckpointError(f"{where}: parity record field {field!r} is damaged ({e})") from None
        if len({x.node for x in parsed}) != len(parsed):
            raise CorruptCheckpointError(f"{where}: parity record names a node twice")
        stripes = Stripes(len(parsed), m)
        for i, x in enumerate(parsed):
            if x.region > piece * stripes.d:
                raise CorruptCheckpointError(f"{where}: members[{i}]'s files exceed its {stripes.d} pieces")
            if sorted(s for s, _ in x.parity) != sorted(s for s, _ in stripes.parity_of(i)):
                raise CorruptCheckpointError(f"{where}: members[{i}] names parity of stripes it does not hold")
        return cls(step=step, save_id=save, m=m, piece=piece, members=parsed)


def _member(doc: object, *, where: str) -> Member:
    field = "the entry"
    try:
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        field = "node"
        node = nonneg_int(doc["node"])
        field = "world_size"
        world = world_size_of(doc["world_size"])
        field = "ranks"
        ranks = doc["ranks"]
        if not isinstance(ranks, list) or not 0 < len(ranks) <= world:
            raise ValueError("not a list of ranks of the job")
        ranks_t = tuple(nonneg_int(r) for r in ranks)
        if max(ranks_t) >= world:
            raise ValueError(f"rank {max(ranks_t)} of {world}")
        field = "files"
        files = doc["files"]
        if not isinstance(files, list) or len(files) > MAX_FILES_PER_MEMBER * len(ranks_t):
            raise ValueError("not a list of this member's files")
        files_t = tuple(_file(f) for f in files)
        allowed = {f for r in ranks_t for f in rank_files(r)} | {MANIFEST_FILE}
        names = [name for name, _, _ in files_t]
        if not set(names) <= allowed or len(set(names)) != len(names):
            raise ValueError("it names a file that is not its ranks' (or names one twice)")
        field = "parity"
        parity = doc["parity"]
        if not isinstance(parity, list) or len(parity) > MAX_GROUP:
            raise ValueError("not a list of stripes")
        parity_t = tuple((nonneg_int(p[0]), crc32c_value(p[1])) for p in parity if _pair(p))
        if len(parity_t) != len(parity):
            raise ValueError("an entry is not [stripe, crc32c]")
        field = "commit"
        commit = doc["commit"]
        if not isinstance(commit, str) or len(commit) > 1 << 20:
            raise ValueError("not a commit marker")
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise CorruptCheckpointError(f"{where}: field {field!r} is damaged ({e})") from None
    return Member(node=node, ranks=ranks_t, world_size=world, files=files_t, parity=parity_t, commit=commit)


def _pair(p: object) -> bool:
    return isinstance(p, list) and len(p) == 2


def _file(f: object) -> tuple[str, int, int]:
    if not isinstance(f, list) or len(f) != 3 or not isinstance(f[0], str):
        raise ValueError(f"{f!r:.80} is not [name, size, crc32c]")
    return f[0], file_offset(f[1]), crc32c_value(f[2])
