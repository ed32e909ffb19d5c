"""The wire between ranks: every message's checked readers, the one codec for a set of ranks and the
one codec for compact entries. Nothing outside this module parses a message's text.

A message comes from a rank of the same job (so the same library), but through the store or a
socket: one that is not what it should be fails with ``CoordinationError`` naming where it came
from (its store key, or its peer) and the field, never with a ``KeyError`` or ``TypeError`` from
deep inside the protocol that reads it, and never after allocating what a hostile number asked for.

**JSON messages** (``restore.messages``, ``save.messages``, ``tiering.replication.ReplicaHeader``)
are frozen dataclasses whose ``from_json`` is made of the readers here (``as_int``, ``as_list``...).

**A set of ranks** (``RankSet``) is written, wherever a message holds one (a JSON string inside a
JSON message, a field of an entry), in one grammar::

    set  = [run *("," run)]
    run  = start ["+" length] ["/" stride "x" count]      ; decimal numbers

A run is ``count`` blocks of ``length`` consecutive ranks, the first at ``start``, each ``stride``
after the last (``length`` and ``count`` default to 1): ``5`` is rank 5, ``0+4`` ranks 0-3,
``3/128x1024`` the data-parallel replicas of one shard at 131,072 ranks, ``0+8/128x1024`` the
eight tensor-parallel ranks of every replica. Runs ascend: each starts after the last rank of the
one before, and every rank is below the bound the reader gives (the world size), so a set read
from a message holds at most that many ranks; the bound is checked from the numbers, before a
single rank is expanded.

**An entry** is the compact form of a small typed message appended to a register in the store
(``Entry``: the holders of a save's pieces, a node's members of a group, a node's number)::

    entries = *(entry ";")
    entry   = field *(":" field)       ; trailing empty fields left out

A field is a decimal number (a rank: below the world size), a signed decimal, a token
(``[0-9A-Za-z_.-]``, 1 to 64: a digest, a host), a flag (``1``, or empty), a set of ranks (above),
or empty for a value that is absent. Each entry type lists its fields once (``Entry.FIELDS``);
a type may end in a group of fields repeated any number of times (``Entry.REPEAT``).

**A tally** (``tally``, ``tallied``) counts ranks and their failures in one store counter: ``ranks
+ failures * 2**20``, each rank adding once (fewer than 2**20 ranks count in one tally).
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, fields
from dataclasses import field as _field
from functools import lru_cache
from typing import Any, ClassVar, TypeVar

from tiercheck.errors import CoordinationError


def loads(raw: bytes | str, *, where: str) -> object:
    """A message's JSON, or ``CoordinationError`` naming ``where`` (its store key)."""
    try:
        doc: object = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CoordinationError(f"{where}: not a JSON message from another rank ({e})") from None
    return doc


def bad(where: str, field: str, what: str, value: object) -> CoordinationError:
    shown = repr(value)
    return CoordinationError(f"{where}: field {field!r} is not {what}: {shown[:80]}")


def as_int(v: object, where: str, field: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(where, field, "an integer", v)
    return v


def as_rank(v: object, where: str, field: str) -> int:
    n = as_int(v, where, field)
    if n < 0:
        raise bad(where, field, "a rank", v)
    return n


def as_float(v: object, where: str, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad(where, field, "a number", v)
    return float(v)


def as_str(v: object, where: str, field: str) -> str:
    if not isinstance(v, str):
        raise bad(where, field, "a string", v)
    return v


def as_bool(v: object, where: str, field: str) -> bool:
    if not isinstance(v, bool):
        raise bad(where, field, "true or false", v)
    return v


def as_list(v: object, where: str, field: str, n: int | None = None) -> list[object]:
    if not isinstance(v, list) or (n is not None and len(v) != n):
        raise bad(where, field, "a list" if n is None else f"a list of {n}", v)
    return v


def as_ranks(v: object, where: str, field: str) -> tuple[int, ...]:
    """A list of ranks (or of other non-negative integers: sizes, grid positions)."""
    return tuple(as_rank(x, where, f"{field}[{i}]") for i, x in enumerate(as_list(v, where, field)))


def as_fields(doc: object, where: str, field: str, parsers: Sequence[Callable[[object, str, str], Any]]) -> list[Any]:
    """A positional message (a JSON list), each item checked by its parser, named ``field[i]``."""
    items = as_list(doc, where, field, len(parsers))
    return [parse(v, where, f"{field}[{i}]") for i, (parse, v) in enumerate(zip(parsers, items, strict=True))]


def as_dict(v: object, where: str, field: str) -> dict[str, object]:
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise bad(where, field, "an object", v)
    return v


# -------------------------------------------------------------------------------- sets of ranks

Run = tuple[int, int, int, int]  # start, length, stride, count
_PAST = 1 << 63  # above any length: a bisection key that sorts after every run starting at a rank
_RUN = re.compile(r"([0-9]{1,18})(?:\+([0-9]{1,18}))?(?:/([0-9]{1,18})x([0-9]{1,18}))?")


@dataclass(frozen=True, slots=True, eq=False)
class RankSet(AbstractSet[int]):
    """A set of ranks as ascending runs (see the module docstring); made by ``of`` (or ``of_blocks``),
    read back by ``parse`` (``from_json``). ``of`` makes the same runs for the same ranks, and
    ``parse`` gives back the runs ``text`` wrote.

    It is a ``collections.abc.Set`` that is never expanded to be asked about: ``rank in s`` is a
    binary search of its runs and arithmetic in one, ``len(s)`` a sum over its runs, so a rank told
    of 1,024 replicas pays for their few runs, not for their ranks; only iterating (a rank sending
    to every one of them) walks its ranks. It equals any set of the same ranks (a ``frozenset``
    too), and hashes as one (computed once per set: a message's sets are parsed once, ``parse``)."""

    runs: tuple[Run, ...] = ()
    _hashed: int | None = _field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, ranks: Iterable[int]) -> RankSet:
        rs = sorted(set(ranks))
        if len(rs) > 1:  # evenly spaced ranks (replicas, a block), as the loop below makes them, faster
            stride = rs[1] - rs[0]
            if rs == list(range(rs[0], rs[-1] + 1, stride)):
                return cls(((rs[0], len(rs), len(rs), 1),) if stride == 1 else ((rs[0], 1, stride, len(rs)),))
        blocks: list[tuple[int, int]] = []  # maximal blocks of consecutive ranks
        for r in rs:
            if blocks and blocks[-1][0] + blocks[-1][1] == r:
                blocks[-1] = (blocks[-1][0], blocks[-1][1] + 1)
            else:
                blocks.append((r, 1))
        return cls.of_blocks(blocks)

    @classmethod
    def of_blocks(cls, blocks: Iterable[tuple[int, int]]) -> RankSet:
        """The set of ascending, disjoint blocks ``(start, length)``."""
        runs: list[Run] = []
        for start, length in blocks:
            _extend(runs, start, length)
        return cls(tuple(runs))

    def blocks(self) -> Iterator[tuple[int, int]]:
        """Its maximal blocks of consecutive ranks, ascending."""
        at, n = -1, 0
        for start, length, stride, count in self.runs:
            for k in range(count):
                s = start + k * stride
                if s == at + n:
                    n += length
                    continue
                if n:
                    yield at, n
                at, n = s, length
        if n:
            yield at, n

    def __iter__(self) -> Iterator[int]:
        for start, length, stride, count in self.runs:
            if length == 1:
                yield from range(start, start + stride * count, stride)
                continue
            for k in range(count):
                yield from range(start + k * stride, start + k * stride + length)

    def __len__(self) -> int:
        return sum(length * count for _, length, _, count in self.runs)

    def __contains__(self, rank: object) -> bool:
        if not isinstance(rank, int):
            return False
        i = bisect.bisect_right(self.runs, (rank, _PAST, 0, 0)) - 1  # the last run starting at or below it
        if i < 0:
            return False
        start, length, stride, count = self.runs[i]
        k = min((rank - start) // stride, count - 1)
        return rank < start + k * stride + length

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RankSet):
            return self.runs == other.runs or (len(self) == len(other) and list(self.blocks()) == list(other.blocks()))
        if isinstance(other, AbstractSet):
            return len(self) == len(other) and all(r in other for r in self)
        return NotImplemented

    def __hash__(self) -> int:
        if self._hashed is None:
            object.__setattr__(self, "_hashed", hash(frozenset(self)))  # as the frozenset of its ranks
        assert self._hashed is not None
        return self._hashed

    @classmethod
    def _from_iterable(cls, ranks: Iterable[int]) -> RankSet:  # type: ignore[override]  # of ranks only
        """What ``collections.abc.Set``'s operators (``&``, ``|``, ``-``) make of their ranks."""
        return cls.of(ranks)

    @property
    def last(self) -> int:
        """Its highest rank (-1: it has none)."""
        if not self.runs:
            return -1
        start, length, stride, count = self.runs[-1]
        return start + stride * (count - 1) + length - 1

    def union(self, other: RankSet) -> RankSet:
        merged: list[tuple[int, int]] = []
        for start, length in sorted([*self.blocks(), *other.blocks()]):
            if merged and start <= merged[-1][0] + merged[-1][1]:
                last = merged[-1]
                merged[-1] = (last[0], max(last[1], start + length - last[0]))
            else:
                merged.append((start, length))
        return RankSet.of_blocks(merged)

    def missing(self, n: int) -> RankSet:
        """The ranks below ``n`` this set leaves out (its blocks, never its ranks, are walked)."""
        out, at = [], 0
        for start, length in self.blocks():
            if start >= n:
                break
            if start > at:
                out.append((at, start - at))
            at = start + length
        if at < n:
            out.append((at, n - at))
        return RankSet.of_blocks(out)

    def describe(self) -> str:
        """For people: ``0-2, 5`` (``none`` for no rank)."""
        spans = (str(s) if n == 1 else f"{s}-{s + n - 1}" for s, n in self.blocks())
        return ", ".join(spans) or "none"

    def text(self) -> str:
        """The set in the grammar of the module docstring: each run in the shorter of its forms."""
        out = []
        for start, length, stride, count in self.runs:
            block = str(start) if length == 1 else f"{start}+{length}"
            whole = block if count == 1 else f"{block}/{stride}x{count}"
            if count > 1 and count <= 3:  # two or three blocks may cost less one by one
                each = ",".join(str(s) if length == 1 else f"{s}+{length}"
                                for s in range(start, start + stride * count, stride))  # fmt: skip
                whole = each if len(each) < len(whole) else whole
            out.append(whole)
        return ",".join(out)

    def to_json(self) -> str:
        return self.text()

    @classmethod
    def parse(cls, text: str, *, where: str, field: str, world: int) -> RankSet:
        """The set ``text`` names, every rank below ``world``: ``CoordinationError`` naming ``where``
        and ``field`` otherwise, checked from the runs' numbers before any rank is expanded."""
        try:
            return _parse_set(text, world)
        except ValueError as e:
            raise bad(where, field, f"a set of ranks below {world} ({e})", text) from None

    @classmethod
    def from_json(cls, doc: object, *, where: str, field: str, world: int) -> RankSet:
        return cls.parse(as_str(doc, where, field), where=where, field=field, world=world)


def _extend(runs: list[Run], start: int, length: int) -> None:
    """Add a block after every run's blocks: it extends the last run where it continues its
    progression (or is the second block of a run of one), else it starts a run."""
    if runs:
        s, n, stride, count = runs[-1]
        if n == length and (start == s + stride * count if count > 1 else True):
            runs[-1] = (s, n, start - s if count == 1 else stride, count + 1)
            return
    runs.append((start, length, length, 1))


@lru_cache(maxsize=4096)  # a plan's messages name the same few groups of replicas over and over
def _parse_set(text: str, world: int) -> RankSet:
    runs: list[Run] = []
    last = -1
    for i, item in enumerate(text.split(",") if text else ()):
        m = _RUN.fullmatch(item)
        if m is None:
            raise ValueError(f"run {i} is not start[+length][/stride x count]")
        start, length = int(m[1]), int(m[2] or 1)
        count = int(m[4] or 1)
        stride = int(m[3]) if m[3] else length
        if length < 1 or count < 1 or (count > 1 and stride < length):
            raise ValueError(f"run {i} is empty or its blocks overlap")
        end = start + stride * (count - 1) + length  # past the run's last rank
        if start <= last:
            raise ValueError(f"run {i} is not after the one before")
        if end > world:
            raise ValueError(f"run {i} reaches past rank {world - 1}")
        last = end - 1
        if count == 1:
            _extend(runs, start, length)
        else:
            runs.append((start, length, stride, count))
    return RankSet(tuple(runs))


# ---------------------------------------------------------------------------------------- entries

Reader = Callable[[str, int], Any]  # a field's text and the world size -> its value, or ValueError
_NUMBER = re.compile(r"[0-9]{1,18}")
_SIGNED = re.compile(r"-?[0-9]{1,18}")
_TOKEN = re.compile(r"[0-9A-Za-z_.-]{1,64}")


def read_number(text: str, world: int) -> int:
    if not _NUMBER.fullmatch(text):
        raise ValueError("a number")
    return int(text)


def read_rank(text: str, world: int) -> int:
    n = read_number(text, world)
    if n >= world:
        raise ValueError(f"a rank below {world}")
    return n


def read_signed(text: str, world: int) -> int:
    if not _SIGNED.fullmatch(text):
        raise ValueError("a signed number")
    return int(text)


def read_token(text: str, world: int) -> str:
    if not _TOKEN.fullmatch(text):
        raise ValueError("letters, digits, '_', '.' or '-', 1 to 64 of them")
    return text


def read_flag(text: str, world: int) -> bool:
    if text not in ("", "1"):
        raise ValueError("1 or empty")
    return text == "1"


def read_ranks(text: str, world: int) -> RankSet:
    return _parse_set(text, world)


def optional(read: Reader) -> Reader:
    """A field that may be empty (None)."""

    def read_optional(text: str, world: int) -> Any:
        return None if text == "" else read(text, world)

    return read_optional


def is_token(text: str) -> bool:
    return _TOKEN.fullmatch(text) is not None


E = TypeVar("E", bound="Entry")


class Entry:
    """A typed message in one entry (see the module docstring). A subclass is a frozen dataclass
    whose fields are ``FIELDS``, in order, and, where it has ``REPEAT``, a last field holding the
    repeated groups as tuples."""

    __slots__ = ()
    FIELDS: ClassVar[tuple[tuple[str, Reader], ...]]
    REPEAT: ClassVar[tuple[tuple[str, Reader], ...]] = ()

    def entry(self) -> str:
        values = [getattr(self, f.name) for f in fields(self)]  # type: ignore[arg-type]
        groups = values.pop() if self.REPEAT else ()
        texts = [_field_text(v) for v in values]
        while texts and texts[-1] == "" and not groups:  # a repeated group's fields all stay
            texts.pop()
        texts += (_field_text(v) for group in groups for v in group)
        return ":".join(texts) + ";"

    @classmethod
    def grammar(cls) -> str:
        head = ":".join(name for name, _ in cls.FIELDS)
        return head + (f"[:{':'.join(name for name, _ in cls.REPEAT)}]..." if cls.REPEAT else "")

    @classmethod
    def read(cls: type[E], raw: bytes | str, *, where: str, field: str, world: int) -> list[E]:
        """The entries of a register (``raw``, as stored), each checked: ``CoordinationError``
        naming ``where`` and ``field[i]``, the entry's place, where one is not of this type."""
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("ascii")
            except UnicodeDecodeError:
                raise bad(where, field, "ASCII entries", raw) from None
        out = []
        for i, text in enumerate(raw.removesuffix(";").split(";") if raw else ()):
            out.append(cls._read_one(text, where, f"{field}[{i}]", world))
        return out

    @classmethod
    def one(cls: type[E], raw: bytes | str, *, where: str, field: str, world: int) -> E:
        """A message that is one entry (``raw``: the entry, as stored)."""
        got = cls.read(raw, where=where, field=field, world=world)
        if len(got) != 1:
            raise bad(where, field, f"one entry {cls.grammar()};", raw)
        return got[0]

    @classmethod
    def _read_one(cls: type[E], text: str, where: str, field: str, world: int) -> E:
        parts = text.split(":")
        n, k = len(cls.FIELDS), len(cls.REPEAT)
        if len(parts) > n and (not k or (len(parts) - n) % k):
            raise bad(where, field, cls.grammar(), text)
        parts += [""] * (n - len(parts))
        values: list[Any] = []
        groups: list[tuple[Any, ...]] = []
        schema = [*cls.FIELDS, *(cls.REPEAT * ((len(parts) - n) // k if k else 0))]
        for (name, read), part in zip(schema, parts, strict=True):
            try:
                values.append(read(part, world))
            except ValueError as e:
                raise bad(where, field, f"{cls.grammar()} ({name}: {e})", text) from None
        for j in range(n, len(values), k or 1):
            groups.append(tuple(values[j : j + k]))
        return cls(*values[:n], *([tuple(groups)] if k else []))


def _field_text(v: object) -> str:
    if v is None or v is False or v == "":
        return ""
    if v is True:
        return "1"
    if isinstance(v, RankSet):
        return v.text()
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str) and is_token(v):
        return v
    raise ValueError(f"a field of an entry is a number, a set of ranks or a token, not {v!r}")


# ------------------------------------------------------------------------------------------ tally

_TALLY = 1 << 20


def tally(failed: bool) -> int:
    """What one rank adds to a tally (see the module docstring)."""
    return 1 + (_TALLY if failed else 0)


def tallied(total: int) -> tuple[int, int]:
    """A tally's ranks and failures."""
    return total % _TALLY, total // _TALLY
