"""What restoring ranks send each other through the store (``restore.messages``): each message goes
out and comes back the same, its JSON is what the plan always sent, and one that is not what it
should be fails with ``CoordinationError`` naming where and which field, on every rank."""

from __future__ import annotations

import json
import re
import tracemalloc
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.test_coordination import agreed_manifest, job, save
from tiercheck.cluster.assign import Need, Route, Source
from tiercheck.cluster.coordination import Coordinator, Failure, dumps, lockstep
from tiercheck.cluster.job import Job
from tiercheck.cluster.keys import scope_key
from tiercheck.cluster.keys.restore import groups_scope, needs_ranks_key, sig_key, signatures_key
from tiercheck.cluster.wire import RankSet
from tiercheck.errors import CheckpointNotFoundError, CoordinationError
from tiercheck.format.layout import chunk_at
from tiercheck.restore.agree import choose_step
from tiercheck.restore.members import (
    ListedNode,
    NodeEntry,
    Signature,
    collect,
    listed_node,
    node_entry,
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
    StepDecision(3, remote=True),
    StepDecision(None),
    StepDecision(None, error="no step"),
    NodeHolds(RankSet.of((0, 1)), RankSet.of((1,))),
    NeedsPost("9f3a", (Need("model/w", (0, 4), (8, 4)),)),
    NeedsPost("0", ()),
]
HELD = HeldSteps(
    {
        3: Held(4, RankSet.of(range(3)), RankSet.of(range(2))),
        7: Held(8, RankSet.of([0, 1, 4, 5, 6, 7]), RankSet.of([0, 1])),
    }
)

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


def test_held_steps_come_back_as_they_were_sent() -> None:
    raw = dumps(HELD.to_json())
    assert raw == '{"3":[4,"0+3","0+2"],"7":[8,"0+2,4+4","0+2"]}'
    assert HeldSteps.from_json(loads(raw.encode(), where="k"), where="k", world=8) == HELD


@pytest.mark.parametrize(
    "claim", [HolderClaim(RankSet.of((4, 5, 6, 7))), HolderClaim(RankSet.of((4, 5, 6, 7)), "9f3a0c1d2e4b5a6c")]
)
def test_a_holder_claim_is_one_entry_and_comes_back_as_it_was_sent(claim: HolderClaim) -> None:
    raw = claim.entry()
    assert raw == ("4+4;" if claim.host is None else "4+4:9f3a0c1d2e4b5a6c;")
    assert HolderClaim.one(raw.encode(), where="k", field="claim", world=8) == claim


def test_route_work_comes_back_as_it_was_sent() -> None:
    raw = dumps(WORK.to_json())
    assert RouteWork.from_json(loads(raw.encode(), where="k"), where="k", world=1024) == WORK


def test_a_route_messages_sets_stay_runs_that_a_rank_asks_without_expanding() -> None:
    # A chunk needed by 2**20 ranks: each needer learns its part from the sets' runs, in a few bytes of memory;
    # only the main source, sending to them, walks the needers.
    world = 1 << 21
    chunk = ["model/w", [1, 0], 3, 17, 0, [0, False, 1], [[1, False, 2, 2]]]
    doc = {"sets": ["0/2x1048576", "0", "2"], "chunks": [chunk], "records": [W.to_json()]}
    tracemalloc.start()
    try:
        ((route, tag),) = RouteWork.from_json(doc, where="k", world=world).routes
        needers = route.needers
        told = (len(needers), 2 in needers, 3 in needers, route.source_of(4).rank, route.source_of(2).rank)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert isinstance(route.needers, RankSet) and route.needers == frozenset(range(0, world, 2))
    assert told == (1 << 20, True, False, 0, 1) and tag == 17
    main, node = route.sources
    assert route.sends(node) == [(2, True)]
    assert route.sends(main) == [(d, False) for d in range(4, world, 2)]


def test_the_wire_is_what_the_plan_always_sent() -> None:
    # The store carries these once per group and coordinator: their size is each rank's cost.
    assert NeedsPost("d", (Need("w", (0,), (4,)),)).to_json() == {"digest": "d", "needs": [["w", [0], [4]]]}
    # A node's first rank registers the node's members of a group as offsets from it: in the group's
    # register where a rank of the node posted the group first, else in its signature at the
    # coordinator, with every group it joined there; its node joins the signature's list.
    offsets = RankSet.of([0, 1, 2, 3, 5])
    assert node_entry(8, "8", offsets) == "8:0+4,5:8;" and node_entry(3, None, RankSet.of([0])) == "3:0;"
    assert NodeEntry.read(b"8:0+4,5:8;3:0;", where="k", field="members", world=16) == [
        NodeEntry(8, offsets, "8"), NodeEntry(3, RankSet.of([0]))
    ]  # fmt: skip
    a, b = "a" * 24, "b" * 24
    assert signature_entry(a, True, {b: RankSet.of([1]), a: RankSet.of([0, 1])}) == f"{a}:1:{a}:0+2:{b}:1;"
    assert Signature.read(f"{a}:1:{a}:0+2:{b}:1;{b}::{a}:3;".encode(), where="k", field="signatures", world=16) == [
        Signature(a, True, ((a, RankSet.of([0, 1])), (b, RankSet.of([1])))), Signature(b, False, ((a, RankSet.of([3])),))
    ]  # fmt: skip
    # A node in a signature's list costs its first rank, and its host only where another node's is.
    assert listed_node(8, "8") == "8;" and listed_node(8, None) == "8;" and listed_node(12, "8") == "12:8;"
    assert ListedNode.read(b"8;12:8;", where="k", field="nodes", world=16) == [ListedNode(8), ListedNode(12, "8")]
    # Its main source serves every needer no other source does; each other source its node's.
    assert WORK.to_json() == {
        "sets": ["3+2/128x8", "4", "132"],
        "chunks": [["model/w", [1, 0], 3, 17, 0, [3, False, 1], [[131, True, 2, 2]]]],
        "records": [W.to_json()],
    }


@pytest.mark.parametrize(
    "ranks",
    [[], [5], [0, 1, 2, 3], [1, 3, 5, 7], [0, 1, 8, 9, 16, 17, 40], list(range(3, 131072, 128)), [2, 9, 10, 11]],
)
def test_a_set_of_ranks_comes_back_from_its_runs(ranks: list[int]) -> None:
    got = RankSet.from_json(RankSet.of(ranks).to_json(), where="k", field="s", world=131072)
    assert got == RankSet.of(ranks)
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
        (NodeHolds, {"here": "0", "written": None}, "written"),
        (NodeHolds, {"here": "0/2x1099511627776", "written": ""}, "here"),
        (StepDecision, {"step": 1.5, "remote": False}, "step"),
    ],
)
def test_a_malformed_message_names_its_key_and_field(cls: Any, doc: object, field: str) -> None:
    with pytest.raises(CoordinationError, match="^" + re.escape(f"t/reads/work/3: field {field!r}")):
        cls.from_json(doc, where="t/reads/work/3")


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"x": [1, "0", "0"]}, "held"),
        ({"3": [1, "0+2", "0"]}, "held['3'][1]"),  # a saving rank past its world
        ({"3": [8, "0+2,1", "0"]}, "held['3'][1]"),  # runs that overlap
        ({"3": [8, "0", "0+9"]}, "held['3'][2]"),  # a restoring rank past the world
        ({"3": [2**40, "0/2x549755813888", "0"]}, "held['3'][0]"),  # never walked
        ({"3": [8, [[0, 8]], "0"]}, "held['3'][1]"),
    ],
)
def test_malformed_held_steps_name_their_key_and_field(doc: object, field: str) -> None:
    with pytest.raises(CoordinationError, match="^" + re.escape(f"t/held/up/1: field {field!r}")):
        HeldSteps.from_json(doc, where="t/held/up/1", world=8)


@pytest.mark.parametrize(
    ("raw", "field"),
    [(b"4+4:9f:x;", "claim[0]"), (b"4+5;", "claim[0]"), (b"4;5;", "claim"), (b"", "claim"), (b'[4, "h"]', "claim[0]")],
)
def test_a_malformed_holder_claim_names_its_key(raw: bytes, field: str) -> None:
    with pytest.raises(CoordinationError, match="^" + re.escape(f"t/holder/3: field {field!r}")):
        HolderClaim.one(raw, where="t/holder/3", field="claim", world=8)


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (_work(records=[["model/w", "f4", "tensor", [4], [-1]]]), "records[0][4][0]"),
        (_work(sets=["3+2/128x9", "4", "132"]), "sets[0]"),  # past the world's last rank
        (_work(sets=["3+2/1x8"]), "sets[0]"),  # blocks that overlap
        (_work(sets=[[[3, 2, 128, 8]]]), "sets[0]"),  # not in the grammar of a set
        (_work(chunks=[["model/w", [1, 0], 3, 17, 5, [3, False, 1], []]]), "chunks[0][4]"),
        (_work(chunks=[["model/w", [1, 0], 3, 17, -1, [3, False, 1], []]]), "chunks[0][4]"),
        (_work(chunks=[["model/w", [1, 0], 3, 17, 0, [3, False, -1], []]]), "chunks[0][5][2]"),
        (_work(chunks=[["model/w", [1, 0], 3, 17, 0, [3, False, 0, 1], []]]), "chunks[0][5]"),
        (_work(chunks=[["model/w", [1, 0], 3, 17, 0, [3, False, 1], [[131, True, 2]]]]), "chunks[0][6][0]"),
        (_work(chunks=[["model/w", [1, 0], 3, 17, 0, [3, "no", 1], []]]), "chunks[0][5][1]"),
        (_work(chunks=[["b", [0], 3, 17, 0, [3, False, 1], []]]), "chunks[0][1]"),
        (_work(chunks=[["model/w", [1, 0], 3, 17, 0, [3, False, 1]]]), "chunks[0]"),
    ],
)
def test_malformed_route_work_names_its_key_and_field(doc: dict[str, Any], field: str) -> None:
    with pytest.raises(CoordinationError, match="^" + re.escape(f"t/reads/route/3: field {field!r}")):
        RouteWork.from_json(doc, where="t/reads/route/3", world=1024)


SIG = b"a" * 24


@pytest.mark.parametrize(
    "raw",
    [b"3:x;", b"x:0;", b"3:2-1;", b"3:0+99;", b"16:0;", b"3:0:a b;", b"15:1;", b"0:0+9;0:0+9;", b"3;", b"\xff"],
)
def test_a_garbled_register_of_needers_names_its_key(raw: bytes) -> None:
    with pytest.raises(CoordinationError, match=re.escape(f"t/reads/needs/3/{SIG.decode()}/ranks: field 'members")):
        collect_one(raw, b"", b"")


@pytest.mark.parametrize(
    "raw",
    [SIG + b":x:" + SIG + b":0;", SIG + b"::" + SIG + b":16;", SIG + b"::" + SIG + b";", SIG + b"::" + SIG + b":0:;",
     SIG + b"::" + SIG + b":0-1;", b"a b::" + SIG + b":0;", b"\xff"],
)  # fmt: skip
def test_a_garbled_signature_names_its_key(raw: bytes) -> None:
    with pytest.raises(CoordinationError, match=re.escape("t/reads/sigs/3: field 'signatures")):
        collect_one(b"", raw, b"0;")


@pytest.mark.parametrize("raw", [b"x;", b"16;", b"3:a b;", b"3:" + b"h" * 65 + b";", b"\xff", b"0;" * 17, b"15;"])
def test_a_garbled_list_of_a_signatures_nodes_names_its_key(raw: bytes) -> None:
    with pytest.raises(CoordinationError, match=re.escape(f"t/reads/sig/3/{SIG.decode()}: field 'nodes")):
        collect_one(b"", SIG + b"::" + SIG + b":0+2;", raw)


def collect_one(register: bytes, signatures: bytes, nodes: bytes) -> None:
    """Rank 3's ``collect`` of group ``SIG`` (posted to it) of a job of 16 ranks, from these
    stored texts: its register, rank 3's signatures, and the list of nodes of signature ``SIG``."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    coord = Coordinator(store, rank=3, world_size=16, namespace="t", timeout_s=5)
    store.set(needs_ranks_key(coord, "reads", 3, SIG.decode()), register or b"0:0;")
    for key, value in ((signatures_key(coord, "reads", 3), signatures), (sig_key(coord, "reads", 3, SIG.decode()), nodes)):
        if value:
            store.set(key, value)
    collect(coord, "reads", [SIG.decode()])


def test_nodes_holdings_fold_into_spans_and_a_gap_names_the_missing_ranks() -> None:
    a = HeldSteps.of_node((0, 1), {"5": [[0, 1], 8, [0, 1]], "6": [[0, 1], 8, [0, 1]]})
    b = HeldSteps.of_node((2, 3), {"5": [[2, 3], 8, [2, 3]]})
    c = HeldSteps.of_node((4, 5, 6, 7), {"5": [[4, 5, 6, 7], 8, [4, 5, 6, 7]], "6": [[6, 7], 8, [6, 7]]})
    folded = HeldSteps.merge([a, HeldSteps.merge([b, c])])
    assert folded.steps[5] == Held(8, RankSet.of(range(8)), RankSet.of(range(8)))  # a whole step: "0+8", at any size
    assert folded.steps[6] == Held(8, RankSet.of([0, 1, 6, 7]), RankSet.of([0, 1, 4, 5, 6, 7]))
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


@pytest.mark.parametrize(
    ("said", "why"),
    [
        ("7:abc:5;", "the word of a rank of this node"),
        ("x:abc:1:1;", "coordinator:digest:rank:first (coordinator: a number)"),
        ("7:abc;", "coordinator:digest:rank:first (rank: a number)"),
        ("7:abc:1:f;", "coordinator:digest:rank:first (first: 1 or empty)"),
    ],
)
def test_a_garbled_word_to_a_nodes_first_rank_fails_every_rank(tmp_path: Path, said: str, why: str) -> None:
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
    assert f"r/reads/groups: field 'groups[0]' is not {why}" in str(outcomes[5])


def test_a_reported_failure_reads_back_as_it_was_and_a_garbled_one_names_its_key() -> None:
    failed = Failure(5, "CorruptCheckpointError", "node1: step 1: bad")
    assert Failure.from_json(dumps(failed.to_json()).encode(), where="k") == failed
    with pytest.raises(CoordinationError, match=re.escape("t/r/error: field 'failure' is not [rank, kind, text]")):
        Failure.from_json(b'[true, "X", "y"]', where="t/r/error")
