"""What restoring ranks send each other through the store (``restore.messages``): each message goes
out and comes back the same, its JSON is what the plan always sent, and one that is not what it
should be fails with ``CoordinationError`` naming where and which field, on every rank."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.test_coordination import agreed_manifest, job, save
from tiercheck.cluster.assign import Need, Route, Source
from tiercheck.cluster.coordination import Coordinator, Failure, dumps, lockstep
from tiercheck.cluster.job import Job
from tiercheck.cluster.keys import scope_key
from tiercheck.cluster.keys.restore import groups_scope
from tiercheck.cluster.ranksets import RankSet
from tiercheck.errors import CheckpointNotFoundError, CoordinationError
from tiercheck.format.layout import chunk_at
from tiercheck.restore.agree import choose_step
from tiercheck.restore.members import (
    listed_node,
    node_entry,
    offsets_entry,
    parse_nodes,
    parse_register,
    parse_signatures,
    signature_entry,
)
from tiercheck.restore.messages import (
    ArrayShape,
    Held,
    HeldSteps,
    HolderClaim,
    NeedsPost,
    NodeHolds,
    RouteWork,
    StepDecision,
    loads,
)
from tiercheck.restore.plan import ReadRequest, plan_restore

MESSAGES: list[Any] = [
    HeldSteps({3: Held(4, ((0, 3),), ((0, 2),)), 7: Held(8, ((0, 2), (4, 8)), ((0, 2),))}),
    StepDecision(3, remote=True),
    StepDecision(None),
    StepDecision(None, error="no step"),
    NodeHolds((0, 1), (1,)),
    HolderClaim((4, 5, 6, 7)),
    HolderClaim((4, 5, 6, 7), "9f3a0c1d2e4b5a6c"),  # with its node's host key, for shared memory
    NeedsPost("9f3a", (Need("model/w", (0, 4), (8, 4)),)),
    NeedsPost("0", ()),
]

W = ArrayShape("model/w", "bfloat16", "tensor", (16, 8), (8, 8))
REPLICAS = frozenset(range(3, 1024, 128)) | frozenset(range(4, 1024, 128))  # two ranks of each of 8 replicas
WORK = RouteWork(
    routes=(
        (Route("model/w", chunk_at((16, 8), (8, 8), (1, 0)), 3, REPLICAS, (
            Source(3, False, None, frozenset({4})),
            Source(131, True, frozenset({132}), frozenset({132})),
        )), 17),
    ),
    records=(W,),
)  # fmt: skip


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_message_comes_back_as_it_was_sent(message: Any) -> None:
    raw = dumps(message.to_json())
    assert type(message).from_json(loads(raw.encode(), where="k"), where="k") == message


def test_route_work_comes_back_as_it_was_sent() -> None:
    raw = dumps(WORK.to_json())
    assert RouteWork.from_json(loads(raw.encode(), where="k"), where="k", world=1024) == WORK


def test_the_wire_is_what_the_plan_always_sent() -> None:
    # The store carries these once per group and coordinator: their size is each rank's cost.
    assert NeedsPost("d", (Need("w", (0,), (4,)),)).to_json() == {"digest": "d", "needs": [["w", [0], [4]]]}
    # A node's first rank registers the node's members of a group as offsets from it: in the group's
    # register where a rank of the node posted the group first, else in its signature at the
    # coordinator, with every group it joined there; its node joins the signature's list.
    assert offsets_entry(8, [8, 9, 10, 11, 13]) == "0-3,5"
    assert node_entry(8, "8", "0-3,5") == "8:8:0-3,5;" and node_entry(3, None, "0") == "3::0;"
    assert parse_register(b"8:8:0-3,5;3::0;", where="k", world=16) == [(8, "8", [0, 1, 2, 3, 5]), (3, None, [0])]
    a, b = "a" * 24, "b" * 24
    assert signature_entry(a, True, {b: "1", a: "0-1"}) == f"{a}:s:{a}/0-1|{b}/1;"
    assert parse_signatures(f"{a}:s:{a}/0-1|{b}/1;{b}::{a}/3;".encode(), where="k", world=16) == [
        (a, True, {a: [0, 1], b: [1]}), (b, False, {a: [3]})
    ]  # fmt: skip
    # A node in a signature's list costs its first rank, and its host only where another node's is.
    assert listed_node(8, "8") == "8," and listed_node(8, None) == "8," and listed_node(12, "8") == "12:8,"
    assert parse_nodes(b"8,12:8,", where="k", world=16) == [(8, "8"), (12, "8")]
    # Eight replicas' routes cost the same as two: every set of ranks is a few runs.
    assert WORK.to_json() == {
        "sets": [[[4, 1, 1, 1]], [[132, 1, 1, 1]], [[3, 2, 128, 8]]],
        "chunks": [["model/w", [1, 0], 3, 17, 2, [[3, False, -1, 0], [131, True, 1, 1]]]],
        "records": [W.to_json()],
    }


@pytest.mark.parametrize(
    "ranks",
    [[], [5], [0, 1, 2, 3], [1, 3, 5, 7], [0, 1, 8, 9, 16, 17, 40], list(range(3, 131072, 128)), [2, 9, 10, 11]],
)
def test_a_set_of_ranks_comes_back_from_its_runs(ranks: list[int]) -> None:
    got = RankSet.from_json(RankSet.of(ranks).to_json(), where="k", field="s", world=131072)
    assert list(got) == ranks and len(got) == len(ranks)
    assert all(r in got for r in ranks) and not any(r in got for r in set(range(50)) - set(ranks))
    assert len(RankSet.of(ranks).runs) <= 3  # replicas at any stride: one run


def _work(**change: Any) -> dict[str, Any]:
    doc = WORK.to_json()
    for key, value in change.items():
        doc[key] = value
    return doc


@pytest.mark.parametrize(
    ("cls", "doc", "field"),
    [
        (NeedsPost, {"digest": 0, "needs": []}, "digest"),
        (NeedsPost, {"digest": "d", "needs": [["w", [0]]]}, "needs[0]"),
        (NodeHolds, {"here": [0], "written": None}, "written"),
        (StepDecision, {"step": 1.5, "remote": False}, "step"),
        (HeldSteps, {"x": [1, [[0, 1]], [[0, 1]]]}, "held"),
        (HeldSteps, {"3": [1, [[0, 2], [1, 3]], [[0, 1]]]}, "held['3'][1][1]"),
        (HeldSteps, {"3": [1, [[0, 1]], [[2, 2]]]}, "held['3'][2][0]"),
        (HolderClaim, [0, True], "holder ranks[1]"),
    ],
)
def test_a_malformed_message_names_its_key_and_field(cls: Any, doc: object, field: str) -> None:
    with pytest.raises(CoordinationError, match="^" + re.escape(f"t/reads/work/3: field {field!r}")):
        cls.from_json(doc, where="t/reads/work/3")


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (_work(records=[["model/w", "f4", "tensor", [4], [-1]]]), "records[0][4][0]"),
        (_work(sets=[[[4, 1, 1, 1]], [[132, 1, 1, 1]], [[3, 2, 128, 9]]]), "sets[2][0]"),  # past the world's last rank
        (_work(sets=[[[3, 2, 1, 8]]]), "sets[0][0]"),  # blocks that overlap
        (_work(chunks=[["model/w", [1, 0], 3, 17, 5, [[3, False, -1, -1]]]]), "chunks[0][4]"),
        (_work(chunks=[["model/w", [1, 0], 3, 17, -1, [[3, False, -1, -1]]]]), "chunks[0]"),
        (_work(chunks=[["model/w", [1, 0], 3, 17, 0, [[131, True, 0, -1], [3, False, -1, -1]]]]), "chunks[0]"),
        (_work(chunks=[["model/w", [1, 0], 3, 17, 0, [[3, "no", -1, -1]]]]), "chunks[0][5][0][1]"),
        (_work(chunks=[["b", [0], 3, 17, 0, [[3, False, -1, -1]]]]), "chunks[0][1]"),
        (_work(chunks=[["model/w", [1, 0], 3, 17, 0]]), "chunks[0]"),
    ],
)
def test_malformed_route_work_names_its_key_and_field(doc: dict[str, Any], field: str) -> None:
    with pytest.raises(CoordinationError, match="^" + re.escape(f"t/reads/route/3: field {field!r}")):
        RouteWork.from_json(doc, where="t/reads/route/3", world=1024)


SIG = b"a" * 24


@pytest.mark.parametrize(
    "raw",
    [b"3", b"3::;", b"x::0;", b"3:h:2-1;", b"3:h:0-99;", b"3:h:0-1-2;", b"16::0;", b"3:a b:0;", b"15::1;",
     b"0::0-9;0::0-9;", b"\xff"],
)  # fmt: skip
def test_a_garbled_register_of_needers_names_its_key(raw: bytes) -> None:
    with pytest.raises(CoordinationError, match=re.escape("t/reads/needs/3/d/ranks: field 'members")):
        parse_register(raw, where="t/reads/needs/3/d/ranks", world=16)


@pytest.mark.parametrize(
    "raw",
    [SIG + b"::;", SIG + b":h:" + SIG + b"/0;", SIG[:-1] + b"::" + SIG + b"/0;", SIG + b"::" + SIG + b"/16;",
     SIG + b"::" + SIG + b"/0|;", SIG + b"::" + SIG + b"/0-1-2;", SIG + b"::" + SIG + b"/0-9|" + SIG + b"/0-9;",
     b"\xff"],
)  # fmt: skip
def test_a_garbled_signature_names_its_key(raw: bytes) -> None:
    with pytest.raises(CoordinationError, match=re.escape("t/reads/sigs/3: field 'signatures")):
        parse_signatures(raw, where="t/reads/sigs/3", world=16)


@pytest.mark.parametrize("raw", [b"x,", b"16,", b"3:,", b"3:a b,", b"3:" + b"h" * 65 + b",", b"\xff"])
def test_a_garbled_list_of_a_signatures_nodes_names_its_key(raw: bytes) -> None:
    with pytest.raises(CoordinationError, match=re.escape("t/reads/sig/3/a: field 'nodes")):
        parse_nodes(raw, where="t/reads/sig/3/a", world=16)


def test_nodes_holdings_fold_into_spans_and_a_gap_names_the_missing_ranks() -> None:
    a = HeldSteps.of_node((0, 1), {"5": [[0, 1], 8, [0, 1]], "6": [[0, 1], 8, [0, 1]]})
    b = HeldSteps.of_node((2, 3), {"5": [[2, 3], 8, [2, 3]]})
    c = HeldSteps.of_node((4, 5, 6, 7), {"5": [[4, 5, 6, 7], 8, [4, 5, 6, 7]], "6": [[6, 7], 8, [6, 7]]})
    folded = HeldSteps.merge([a, HeldSteps.merge([b, c])])
    assert folded.steps[5] == Held(8, ((0, 8),), ((0, 8),))  # a whole step is one span, at any size
    assert folded.steps[6] == Held(8, ((0, 2), (6, 8)), ((0, 2), (4, 8)))
    assert choose_step(folded, None, set(), world=8, where="w") == 5
    with pytest.raises(
        CheckpointNotFoundError,
        match=re.escape(
            "step 6: the files of saving rank(s) 2-5 are on no rank's local tier (restoring rank(s) 2-3 have no copy"
        ),
    ):
        choose_step(folded, 6, set(), world=8, where="w")


def test_bytes_that_are_not_json_name_their_key() -> None:
    with pytest.raises(CoordinationError, match="^t/reads/needs/0: not a JSON message"):
        loads(b"\xff{", where="t/reads/needs/0")


def test_a_garbled_needs_post_fails_every_rank_instead_of_leaving_them_waiting(tmp_path: Path) -> None:
    world, target = 8, 3
    per_rank = save(world, 2, tmp_path)
    coords, tiers, nodes = job(world, tmp_path)

    def one(c: Coordinator) -> Any:
        rank_job = Job(coord=c, nodes=nodes[c.rank], tier=tiers[c.rank])
        st, manifest = yield from agreed_manifest(rank_job)
        if c.rank == 0:  # posted before any coordinator collects its bucket
            c.post(f"r/reads/needs/{target}", json.dumps({"digest": "d", "needs": [["w", [0], "x"]]}))
        needs = [Need(d.path, d.offsets, d.shape) for d in per_rank[c.rank]]
        return (
            yield from plan_restore(
                rank_job, "r", st, ReadRequest(needs=needs, records=manifest.arrays, read_once=False)
            )
        )

    outcomes = lockstep([one(c) for c in coords], capture=True)
    assert all(isinstance(o, CoordinationError) for o in outcomes), outcomes
    assert str(outcomes[target]).startswith(f"r/reads/needs/{target}: field 'needs[0][2]'")
    assert f"rank {target} failed" in str(outcomes[0])


@pytest.mark.parametrize("said", ["7:abc:5:;", "x:abc:1:f;", "7:abc:1;", "7:abc:1:x;"])
def test_a_garbled_word_to_a_nodes_first_rank_fails_every_rank(tmp_path: Path, said: str) -> None:
    """A node's ranks tell their first rank their groups in the node's store; what it cannot read
    (here: a rank not of its node, or no rank) fails the plan on every rank, not just that node."""
    world = 8
    per_rank = save(world, 2, tmp_path)
    coords, tiers, nodes = job(world, tmp_path)

    def one(c: Coordinator) -> Any:
        rank_job = Job(coord=c, nodes=nodes[c.rank], tier=tiers[c.rank])
        st, manifest = yield from agreed_manifest(rank_job)
        if c.rank == 1:  # said before the node's first rank reads it (rank 5 is on another node)
            assert c.node is not None
            c.node.append(scope_key(c.node, groups_scope("r/reads")), said)
        needs = [Need(d.path, d.offsets, d.shape) for d in per_rank[c.rank]]
        return (
            yield from plan_restore(
                rank_job, "r", st, ReadRequest(needs=needs, records=manifest.arrays, read_once=False)
            )
        )

    outcomes = lockstep([one(c) for c in coords], capture=True)
    assert all(isinstance(o, CoordinationError) for o in outcomes), outcomes
    assert "r/reads/groups: field 'groups[0]' is not coordinator:digest:rank of this node:'f' where first" in str(
        outcomes[5]
    )


def test_a_reported_failure_reads_back_as_it_was_and_a_garbled_one_names_its_key() -> None:
    failed = Failure(5, "CorruptCheckpointError", "node1: step 1: bad")
    assert Failure.from_json(dumps(failed.to_json()).encode(), where="k") == failed
    with pytest.raises(CoordinationError, match=re.escape("t/r/error: field 'failure' is not [rank, kind, text]")):
        Failure.from_json(b'[true, "X", "y"]', where="t/r/error")
