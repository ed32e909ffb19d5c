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
from tiercheck.cluster.assign import Need
from tiercheck.cluster.coordination import Coordinator, Failure, dumps, lockstep
from tiercheck.cluster.job import Job
from tiercheck.errors import CheckpointNotFoundError, CoordinationError
from tiercheck.restore.agree import choose_step
from tiercheck.restore.messages import (
    ArrayShape,
    AssignedMove,
    AssignedRead,
    Held,
    HeldSteps,
    HolderClaim,
    NeedsPost,
    NodeHolds,
    ReadWork,
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
    NeedsPost(2, (Need("model/w", (0, 4), (8, 4)),), node=0, host="h1"),
    NeedsPost(0, ()),
    ReadWork(
        reads=(AssignedRead("model/w", (1, 0), False, 3),),
        moves=(AssignedMove("model/w", (1, 0), 2, 5, 17, shared=True), AssignedMove("b", (0,), 2, 9, 18)),
        records=(ArrayShape("model/w", "bfloat16", "tensor", (16, 8), (8, 8)),),
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_message_comes_back_as_it_was_sent(message: Any) -> None:
    raw = dumps(message.to_json())
    assert type(message).from_json(loads(raw.encode(), where="k"), where="k") == message


def test_the_wire_is_what_the_plan_always_sent() -> None:
    # The store carries these once per rank and coordinator: their size is each rank's cost.
    assert NeedsPost(2, (Need("w", (0,), (4,)),), node=2).to_json() == {"rank": 2, "needs": [["w", [0], [4]]]}
    assert NeedsPost(2, (), node=0, host="h").to_json() == {"rank": 2, "needs": [], "node": 0, "host": "h"}
    work = ReadWork((AssignedRead("w", (1,), True, 3),), (AssignedMove("w", (1,), 0, 1, 7, shared=True),))
    assert work.to_json() == {"reads": [["w", [1], True, 3]], "moves": [["w", [1], 0, 1, 7, 1]], "records": []}


@pytest.mark.parametrize(
    ("cls", "doc", "field"),
    [
        (ReadWork, {"reads": [["w", [0], "yes", 1]], "moves": [], "records": []}, "reads[0][2]"),
        (ReadWork, {"reads": [], "moves": [["w", [0], 0, 1]], "records": []}, "moves[0]"),
        (ReadWork, {"reads": [], "moves": [], "records": [["w", "f4", "tensor", [4], [-1]]]}, "records[0][4][0]"),
        (ReadWork, {"reads": [], "moves": []}, "records"),
        (NeedsPost, {"rank": "0", "needs": []}, "rank"),
        (NeedsPost, {"rank": 0, "needs": [["w", [0]]]}, "needs[0]"),
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


def test_nodes_holdings_fold_into_spans_and_a_gap_names_the_missing_ranks() -> None:
    a = HeldSteps.of_node((0, 1), {"5": [[0, 1], 8, [0, 1]], "6": [[0, 1], 8, [0, 1]]})
    b = HeldSteps.of_node((2, 3), {"5": [[2, 3], 8, [2, 3]]})
    c = HeldSteps.of_node((4, 5, 6, 7), {"5": [[4, 5, 6, 7], 8, [4, 5, 6, 7]], "6": [[6, 7], 8, [6, 7]]})
    folded = HeldSteps.merge([a, HeldSteps.merge([b, c])])
    assert folded.steps[5] == Held(8, ((0, 8),), ((0, 8),))  # a whole step is one span, at any size
    assert folded.steps[6] == Held(8, ((0, 2), (6, 8)), ((0, 2), (4, 8)))
    assert choose_step(folded, None, set(), world=8, where="w") == 5
    with pytest.raises(CheckpointNotFoundError, match=re.escape("step 6: the files of saving rank(s) 2-5 are on no "
                                                                "rank's local tier (restoring rank(s) 2-3 have no copy")):
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
            c.post(f"r/reads/needs/{target}", json.dumps({"rank": 0, "needs": [["w", [0], "x"]]}))
        needs = [Need(d.path, d.offsets, d.shape) for d in per_rank[c.rank]]
        return (yield from plan_restore(rank_job, "r", st, ReadRequest(needs=needs, records=manifest.arrays, read_once=False)))

    outcomes = lockstep([one(c) for c in coords], capture=True)
    assert all(isinstance(o, CoordinationError) for o in outcomes), outcomes
    assert str(outcomes[target]).startswith(f"r/reads/needs/{target}: field 'needs[0][2]'")
    assert f"rank {target} failed" in str(outcomes[0])


def test_a_reported_failure_reads_back_as_it_was_and_a_garbled_one_names_its_key() -> None:
    failed = Failure(5, "CorruptCheckpointError", "node1: step 1: bad")
    assert Failure.from_json(dumps(failed.to_json()).encode(), where="k") == failed
    with pytest.raises(CoordinationError, match=re.escape("t/r/error: field 'failure' is not [rank, kind, text]")):
        Failure.from_json(b'[true, "X", "y"]', where="t/r/error")
