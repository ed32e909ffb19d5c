"""The one codec for what ranks send each other (``cluster.wire``): a set of ranks and a compact entry
each go out and come back the same, a text outside their grammar fails naming its key and field, and
a set whose numbers reach past the world size is refused before a single rank is expanded."""

from __future__ import annotations

import re
import tracemalloc
from dataclasses import dataclass

import pytest

from tiercheck.cluster.wire import (
    Entry,
    RankSet,
    optional,
    read_flag,
    read_rank,
    read_ranks,
    read_signed,
    read_token,
    tallied,
    tally,
)
from tiercheck.errors import CoordinationError

SETS = [
    [],
    [5],
    [0, 1, 2, 3],
    [1, 3, 5, 7],
    [0, 5],
    [0, 1, 8, 9, 16, 17, 40],
    list(range(3, 131072, 128)),
    [r for d in range(0, 131072, 128) for r in range(d, d + 8)],
    [2, 9, 10, 11],
    [0, 1, 2, 100, 101, 102, 131000],
]


@pytest.mark.parametrize("members", SETS, ids=lambda m: str(len(m)))
def test_a_set_of_ranks_comes_back_from_its_text_as_the_same_runs(members: list[int]) -> None:
    sent = RankSet.of(members)
    got = RankSet.parse(sent.text(), where="k", field="s", world=131072)
    assert got == sent and list(got) == members and len(got) == len(members)
    assert all(r in got for r in members) and not any(r in got for r in set(range(200)) - set(members))
    assert len(sent.runs) <= 4  # replicas at any stride, or every TP rank of every replica: one run


def test_the_grammar_of_a_set_of_ranks() -> None:
    assert RankSet.of([5]).text() == "5"
    assert RankSet.of(range(8, 12)).text() == "8+4"
    assert RankSet.of([8, 9, 10, 11, 13]).text() == "8+4,13"
    assert RankSet.of([0, 5]).text() == "0,5"  # two ranks cost less one by one
    assert RankSet.of(range(3, 131072, 128)).text() == "3/128x1024"
    assert RankSet.of(r for d in range(0, 1024, 128) for r in range(d, d + 8)).text() == "0+8/128x8"
    assert RankSet.of([]).text() == ""
    # Non-canonical texts (blocks listed one by one, a run of one block) name the same runs.
    assert RankSet.parse("3,131,259,387", where="k", field="s", world=512) == RankSet.of(range(3, 512, 128))
    assert RankSet.parse("4/9x1", where="k", field="s", world=8) == RankSet.of([4])


def test_sets_of_ranks_unite_and_say_what_they_leave_out_without_expanding() -> None:
    a, b = RankSet.of([0, 1, 6, 7]), RankSet.of([2, 3, 9])
    assert a.union(b) == RankSet.of([0, 1, 2, 3, 6, 7, 9])
    assert a.union(b).missing(12) == RankSet.of([4, 5, 8, 10, 11])
    assert a.union(b).missing(12).describe() == "4-5, 8, 10-11"
    assert RankSet.of(range(8)).missing(8).describe() == "none"
    whole = RankSet.of_blocks([(0, 2**40)])  # a job's ranks as one block: nothing walks them
    assert whole.union(RankSet.of([3])) == whole and whole.missing(2**40) == RankSet() and len(whole) == 2**40


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("x", "run 0 is not start"),
        ("1,", "run 1 is not start"),
        ("-1", "run 0 is not start"),
        ("1+0", "run 0 is empty"),
        ("0+4/2x3", "run 0 is empty or its blocks overlap"),
        ("5,3", "run 1 is not after the one before"),
        ("0+4,2", "run 1 is not after the one before"),
        ("15+2", "run 0 reaches past rank 15"),
        ("0/128x2", "run 0 reaches past rank 15"),
        ("1 ", "run 0 is not start"),
        ("9" * 19, "run 0 is not start"),
    ],
)
def test_a_text_outside_the_grammar_of_sets_names_its_key_and_field(text: str, why: str) -> None:
    with pytest.raises(
        CoordinationError, match="^" + re.escape("t/offer/3: field 'holders' is not a set of ranks below 16 (" + why)
    ):
        RankSet.parse(text, where="t/offer/3", field="holders", world=16)


@pytest.mark.parametrize("text", ["0+1099511627776", "0/1x1099511627776", "0+8/128x1099511627776", "0,1+1099511627776"])
def test_a_run_of_2_to_the_40_ranks_is_refused_before_any_is_expanded(text: str) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(CoordinationError, match=re.escape("field 'sets[0]' is not a set of ranks below 131072")):
            RankSet.parse(text, where="k", field="sets[0]", world=131072)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize("members", SETS, ids=lambda m: str(len(m)))
def test_a_set_of_ranks_is_a_set_equal_to_the_frozenset_of_its_ranks(members: list[int]) -> None:
    got, plain = RankSet.parse(RankSet.of(members).text(), where="k", field="s", world=131072), frozenset(members)
    assert got == plain and plain == got and hash(got) == hash(plain) and {got: 1}[plain] == 1
    assert [r in got for r in range(-1, 300)] == [r in plain for r in range(-1, 300)]
    assert got - {5} == plain - {5} and isinstance(got - {5}, RankSet) and (got <= plain) and not (got < plain)
    assert (got == RankSet.of([*members, 131071])) is False and got != [*members]


def test_sets_of_the_same_ranks_in_different_runs_are_equal() -> None:
    listed = RankSet.parse("0,1", where="k", field="s", world=4)  # a run of two blocks of one, not one of two
    pair = RankSet.of([0, 1])
    assert listed.runs != pair.runs and listed == pair and hash(listed) == hash(pair)
    assert listed != RankSet.of([0, 2]) and RankSet() == frozenset() and not RankSet()


def test_a_set_read_from_a_message_holds_at_most_the_world() -> None:
    got = RankSet.parse("0+8/128x1024", where="k", field="s", world=131072)
    assert len(got) == 8192 and max(got) == 131071 - 120
    with pytest.raises(CoordinationError):
        RankSet.parse("0+8/128x1025", where="k", field="s", world=131072)


def test_a_set_in_a_json_message_must_be_a_string() -> None:
    with pytest.raises(CoordinationError, match=re.escape("k: field 'sets[1]' is not a string: [[0, 1, 1, 1]]")):
        RankSet.from_json([[0, 1, 1, 1]], where="k", field="sets[1]", world=8)


@dataclass(frozen=True, slots=True)
class _Said(Entry):
    leader: int
    offsets: RankSet
    host: str | None = None

    FIELDS = (("leader", read_rank), ("offsets", read_ranks), ("host", optional(read_token)))


@dataclass(frozen=True, slots=True)
class _Signed(Entry):
    digest: str
    shares: bool
    step: int
    groups: tuple[tuple[str, RankSet], ...]

    FIELDS = (("digest", read_token), ("shares", read_flag), ("step", read_signed))
    REPEAT = (("digest", read_token), ("offsets", read_ranks))


def test_entries_come_back_as_they_were_said_with_trailing_empty_fields_left_out() -> None:
    said = [_Said(8, RankSet.of([0, 1, 2, 3, 5]), "8"), _Said(3, RankSet.of([0]))]
    raw = "".join(e.entry() for e in said)
    assert raw == "8:0+4,5:8;3:0;"
    assert _Said.read(raw.encode(), where="k", field="members", world=16) == said
    signed_ = [
        _Signed("ab", True, -2, (("cd", RankSet.of([0, 1])), ("ef", RankSet.of([1])))),
        _Signed("ab", False, 0, ()),
    ]
    raw = "".join(e.entry() for e in signed_)
    assert raw == "ab:1:-2:cd:0+2:ef:1;ab::0;"
    assert _Signed.read(raw, where="k", field="signatures", world=16) == signed_
    assert _Said.read(b"", where="k", field="members", world=16) == []
    empty_last = _Signed("ab", False, 0, (("cd", RankSet()),))  # a group's empty field is said, not left out
    assert empty_last.entry() == "ab::0:cd:;" and _Signed.read(empty_last.entry(), where="k", field="s", world=4) == [
        empty_last
    ]


@pytest.mark.parametrize(
    ("raw", "field", "why"),
    [
        (b"3:0-3", "members[0]", "leader:offsets:host (offsets: run 0 is not start"),
        (b"3:0;x:0;", "members[1]", "leader:offsets:host (leader: a number)"),
        (b"16:0;", "members[0]", "leader:offsets:host (leader: a rank below 16)"),
        (b"3:0:a b;", "members[0]", "leader:offsets:host (host: letters, digits"),
        (b"3:0:h:x;", "members[0]", "leader:offsets:host: '3:0:h:x'"),
        (b"3:0+99;", "members[0]", "leader:offsets:host (offsets: run 0 reaches past rank 15"),
        (b"\xff", "members", "ASCII entries"),
    ],
)
def test_an_entry_outside_its_grammar_names_its_key_field_and_place(raw: bytes, field: str, why: str) -> None:
    with pytest.raises(CoordinationError, match="^" + re.escape(f"t/needs/3: field {field!r} is not {why}")):
        _Said.read(raw, where="t/needs/3", field="members", world=16)


def test_a_repeated_group_must_be_whole() -> None:
    with pytest.raises(
        CoordinationError, match=re.escape("field 'signatures[0]' is not digest:shares:step[:digest:offsets]...")
    ):
        _Signed.read("ab:1:0:cd;", where="k", field="signatures", world=16)


def test_an_entry_refuses_to_say_a_field_its_grammar_cannot_read_back() -> None:
    with pytest.raises(ValueError, match="a set of ranks or a token"):
        _Said(3, RankSet.of([0]), "a:b").entry()


def test_a_tally_counts_ranks_and_failures_in_one_counter() -> None:
    total = sum(tally(failed) for failed in (False, True, False, True, True))
    assert tallied(total) == (5, 3)
    assert tallied(tally(False) * 8) == (8, 0)
