"""What saving ranks send each other (``save.messages``, the pieces they post: ``LeafDesc``) and the header one node leader sends
another with a replica (``tiering.replication.ReplicaHeader``): each message goes out and comes
back the same, its JSON bytes are what the protocols always sent (built here as the code before
these types built them), and one that is not what it should be fails with ``CoordinationError``
naming where and which field."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch.distributed as dist

from tests.test_planner import megatron_like
from tiercheck.cluster.assign import LeafDesc
from tiercheck.cluster.coordination import Coordinator, dumps, lockstep, shard_of
from tiercheck.cluster.wire import RankSet, loads
from tiercheck.errors import CoordinationError
from tiercheck.format.manifest import ArrayRecord
from tiercheck.save.messages import (
    ArrayOffer,
    ChunkOffer,
    CommitMeta,
    Holders,
    HolderWord,
    PiecesPost,
    Shift,
    TookPost,
    holders_entry,
    parse_holders,
)
from tiercheck.save.patterns import apply_shift
from tiercheck.save.plan import plan_save
from tiercheck.tiering.replication import ReplicaHeader

OFFER = ChunkOffer(
    arrays={
        "model/w": ArrayOffer(
            dtype="bfloat16",
            kind="tensor",
            shape=(16, 8),
            grid=(8, 8),
            chunks=(
                ((0, 0), RankSet.of(range(0, 8, 2))),
                ((1, 0), RankSet.of((1, 5))),
                ((0, 1), RankSet.of(r for d in range(0, 8192, 128) for r in (d, d + 1))),
            ),
        ),
        "step": ArrayOffer(dtype="int64", kind="scalar", shape=(), grid=(), chunks=()),
    }
)
MESSAGES: list[Any] = [
    LeafDesc("model/w", "bfloat16", "tensor", (16, 8), (8, 0), (8, 8), False),
    PiecesPost("0a1b", (LeafDesc("model/w", "bfloat16", "tensor", (16, 8), (8, 0), (8, 8), False),)),
    PiecesPost("0a1c", (LeafDesc("model/w", "bfloat16", "tensor", (16, 8), (0, 0), (8, 8), False),), pattern=True),
    OFFER,
    ChunkOffer(
        arrays={
            "o": ArrayOffer(
                dtype="f4",
                kind="tensor",
                shape=(64,),
                grid=(8,),
                chunks=(((0,), RankSet.of((3,))),),
                shift=Shift(0, 0, 1, 2),
            )
        }
    ),
    TookPost(rank=3, took={"model/w": ((0, 0), (1, 0)), "b": ((2,),)}),
    CommitMeta(metadata={"loss": 1.5, "tags": ["a"]}, created=1764370000.25),
    CommitMeta(metadata=None, created=12.0),
    ReplicaHeader(step=7, ranks=(8, 9), world_size=16, node="node1", files=(("__0_0.pack", 4096), ("__0.part", 12))),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_message_comes_back_as_it_was_sent(message: Any) -> None:
    raw = json.dumps(message.to_json())
    world = {"world": 8192} if isinstance(message, ChunkOffer) else {}
    assert type(message).from_json(loads(raw.encode(), where="k"), where="k", **world) == message


@pytest.mark.parametrize(
    "entry",
    [
        HolderWord(3, "0a1b", 5),
        HolderWord(3, "0a1b", 5, 2),
        Holders(RankSet.of(range(16, 24)), 0, 1),
        Holders(RankSet.of([4])),
    ],
)
def test_an_entry_comes_back_as_it_was_said(entry: Any) -> None:
    assert type(entry).read(entry.entry().encode(), where="k", field="f", world=64) == [entry]


def test_the_wire_is_what_the_protocols_always_sent() -> None:
    # An offer: [short, [[coords, holders], ...]] by path, each group of holders a set of ranks.
    short = ["bfloat16", "tensor", [16, 8], [8, 8]]
    groups = [[[0, 0], "0/2x4"], [[1, 0], "1,5"], [[0, 1], "0+2/128x64"]]
    before = {"model/w": [short, groups], "step": [["int64", "scalar", [], []], []]}
    assert dumps(OFFER.to_json()) == dumps(before)
    # A node's ranks tell its first rank what they hold, one entry each (the block: of a pattern).
    assert HolderWord(3, "0a1b", 5).entry() == "3:0a1b:5;" and HolderWord(3, "0a1b", 5, 2).entry() == "3:0a1b:5:2;"
    took = {"model/w": [[0, 0], [1, 0]], "b": [[2]]}
    assert dumps(TookPost(rank=3, took={"model/w": ((0, 0), (1, 0)), "b": ((2,),)}).to_json()) == dumps(
        {"rank": 3, "took": took}
    )
    # save.vote sets the commit's metadata with json.dumps' default separators.
    meta = CommitMeta(metadata={"loss": 1.5}, created=1764370000.25)
    assert json.dumps(meta.to_json()) == json.dumps({"metadata": {"loss": 1.5}, "created": 1764370000.25})
    # The replica header went out as a dict with the files as (name, size) pairs.
    files = [("__0_0.pack", 4096), ("__0.part", 12)]
    header = {"step": 7, "ranks": [8, 9], "world_size": 16, "node": "node1", "files": files}
    sent = ReplicaHeader(step=7, ranks=(8, 9), world_size=16, node="node1", files=tuple(files))
    assert json.dumps(sent.to_json()) == json.dumps(header)


def test_an_offer_decodes_to_the_record_the_coordinator_laid_out() -> None:
    rec = ArrayRecord(path="model/w", dtype="bfloat16", kind="tensor", shape=(16, 8), chunks=(8, 8))
    assert OFFER.arrays["model/w"].record("model/w") == rec
    assert ArrayOffer.of(rec, ()) == ArrayOffer(dtype="bfloat16", kind="tensor", shape=(16, 8), grid=(8, 8), chunks=())


@pytest.mark.parametrize(
    ("cls", "doc", "field"),
    [
        (LeafDesc, ["w", "f4", "tensor", [4], [0], [4], "no"], "leaf[6]"),
        (LeafDesc, ["w", "f4", "tensor", [4], [0], [4]], "leaf"),
        (LeafDesc, ["w", "f4", "tensor", [4], [0.5], [4], False], "leaf[4][0]"),
        (PiecesPost, ["d", [["w", "f4", "tensor", [4], [0], [4], "no"]]], "pieces[0][6]"),
        (PiecesPost, "d|[]", "post"),
        (PiecesPost, [3, []], "digest"),
        (PiecesPost, ["d", [], 2], "post"),
        (ChunkOffer, {"w": [["f4", "tensor", [4], [4]], [], [0, 0, 1]]}, "w[2]"),
        (ChunkOffer, {"w": [["f4", "tensor", [4], [4]], [], [1, 0, 1, 1]]}, "w[2]"),
        (ChunkOffer, {"w": [["f4", "tensor", [4], [4]], [], [0, 0, 1, -1]]}, "w[2][3]"),
        (ChunkOffer, {"w": [["f4", "tensor", [4], [4]]]}, "w"),
        (ChunkOffer, {"w": [["f4", "tensor", [4]], []]}, "w[0]"),
        (ChunkOffer, {"w": [["f4", "tensor", [4], [-4]], []]}, "w[0][3][0]"),
        (ChunkOffer, {"w": [["f4", 4, [4], [4]], []]}, "w[0][1]"),
        (ChunkOffer, {"w": [["f4", "tensor", [4], [4]], [[[0], [0, 1]]]]}, "w[1][0][1]"),
        (ChunkOffer, {"w": [["f4", "tensor", [4], [4]], [[[0], "1,x"]]]}, "w[1][0][1]"),
        (ChunkOffer, {"w": [["f4", "tensor", [4], [4]], [[[0], "0+2/128x64"]]]}, "w[1][0][1]"),  # past the world
        (ChunkOffer, [], "offer"),
        (TookPost, {"rank": -1, "took": {}}, "rank"),
        (TookPost, {"rank": 0, "took": {"w": [[0], [1, None]]}}, "took['w'][1][1]"),
        (TookPost, {"rank": 0}, "took"),
        (CommitMeta, {"metadata": None, "created": "now"}, "created"),
        (CommitMeta, {"metadata": None, "created": True}, "created"),
        (CommitMeta, {"created": 1.0}, "metadata"),
        (ReplicaHeader, {"step": 1, "ranks": [0], "world_size": 2, "node": "n", "files": [["a", -1]]}, "files[0][1]"),
        (ReplicaHeader, {"step": 1, "ranks": [0], "world_size": 2, "node": "n", "files": [["a"]]}, "files[0]"),
        (ReplicaHeader, {"step": "1", "ranks": [0], "world_size": 2, "node": "n", "files": []}, "step"),
        (ReplicaHeader, {"step": 1, "ranks": 0, "world_size": 2, "node": "n", "files": []}, "ranks"),
        (ReplicaHeader, {"step": 1, "ranks": [0], "world_size": 2, "node": 3, "files": []}, "node"),
    ],
)
def test_a_malformed_message_names_its_key_and_field(cls: Any, doc: object, field: str) -> None:
    world = {"world": 1024} if cls is ChunkOffer else {}
    with pytest.raises(CoordinationError, match="^" + re.escape(f"t/plan0/took/3: field {field!r}")):
        cls.from_json(doc, where="t/plan0/took/3", **world)


def test_a_garbled_took_post_fails_its_coordinator_naming_the_key() -> None:
    world = 4
    per_rank = megatron_like(world, 2)
    store = dist.HashStore()
    coords = [Coordinator(store, rank=r, world_size=world, namespace="t", timeout_s=5) for r in range(world)]
    protocols = [plan_save(c, 0, per_rank[c.rank], target_chunk_bytes=256) for c in coords]
    for _ in range(3):  # posted, offered, chosen: every rank told the coordinators what it took
        for p in protocols:
            next(p)
    coords[0].post("plan0/took/1", dumps({"rank": 0, "took": {"w": "all"}}))
    with pytest.raises(CoordinationError, match="^" + re.escape("plan0/took/1: field \"took['w']\" is not a list")):
        next(protocols[1])


def test_a_chunk_of_one_holder_is_its_own_and_a_claim_by_another_rank_fails_every_rank() -> None:
    """Ranks tell a coordinator only what they took of chunks held by several: a distributed
    optimizer's slice is its holder's. A rank claiming one anyway is caught, not recorded."""
    world = 4
    per_rank = megatron_like(world, 2)
    store = dist.HashStore()
    coords = [Coordinator(store, rank=r, world_size=world, namespace="t", timeout_s=5) for r in range(world)]
    protocols = [plan_save(c, 0, per_rank[c.rank], target_chunk_bytes=256) for c in coords]
    for _ in range(3):  # posted, offered, chosen
        for p in protocols:
            next(p)
    c = shard_of("optim/tp0", world)  # held in two slices, by ranks 0 and 2
    coords[1].post(f"plan0/took/{c}", dumps({"rank": 1, "took": {"optim/tp0": [[0]]}}))
    outcomes = lockstep(protocols, capture=True)
    assert all(isinstance(o, CoordinationError) for o in outcomes), outcomes
    assert "array 'optim/tp0' chunk c.0: taken by rank 1, which does not hold it" in str(outcomes[0])


@pytest.mark.parametrize(
    ("members", "entry"),
    [
        ([(3, None), (0, None), (7, None)], "0;3;7;"),
        ([(8, None), (9, None), (10, None), (11, None)], "8+4;"),  # a node's ranks holding a norm
        ([(16 + t, t) for t in range(8)], "16+8:0:1;"),  # a node's eight TP blocks
        ([(5, 2), (6, 2), (9, 0)], "5+2:2;9:0;"),  # two replicas of block 2, then another rank
        ([(4, 3), (5, 1)], "4+2:3:-2;"),
    ],
)
def test_a_nodes_holders_are_a_few_runs_and_read_back_whole(members: list[tuple[int, int | None]], entry: str) -> None:
    assert holders_entry(members) == entry
    pattern = members[0][1] is not None
    want = sorted((r, 0 if k is None else k) for r, k in members)
    assert sorted(parse_holders(entry.encode(), where="k", world=64, pattern=pattern)) == want


@pytest.mark.parametrize(
    ("raw", "pattern", "field"),
    [
        (b"3;x;", False, "ranks[1]"),
        (b"3;-1;", False, "ranks[1]"),
        (b"3:0;", False, "ranks[0]"),  # a block where the digest is no pattern
        (b"3;", True, "ranks[0]"),  # no block where it is one
        (b"60+5;", False, "ranks[0]"),  # a run past the world
        (b"0+100000000000;", False, "ranks[0]"),  # never expanded
        (b"0+64;0+64;", False, "ranks"),  # more holders than ranks: never expanded either
        (b"4+3:1:-1;", True, "ranks[0]"),  # blocks below 0
        (b"\xff", False, "ranks"),
    ],
)
def test_a_bad_register_entry_names_its_field_and_is_never_expanded(raw: bytes, pattern: bool, field: str) -> None:
    with pytest.raises(CoordinationError, match="^" + re.escape(f"k: field {field!r}")):
        parse_holders(raw, where="k", world=64, pattern=pattern)


@pytest.mark.parametrize(("block", "what"), [(9, "lies outside the array"), (1, "lies outside the array or the job")])
def test_a_patterns_chunk_moved_outside_the_array_or_the_job_is_refused(block: int, what: str) -> None:
    """A holder applies the offer's shift to its block: a chunk landing past the grid, or held by a
    rank past the world, is a bad offer naming its key, never a task or a rank out of range."""
    offer = ArrayOffer(
        dtype="f4", kind="tensor", shape=(64,), grid=(8,), chunks=(((0,), RankSet.of((3,))),), shift=Shift(0, 0, 1, 7)
    )
    world = 16 if block == 9 else 8
    with pytest.raises(CoordinationError, match=re.escape(f"t/offer/3: a pattern's chunk [0] moved to block {block}")):
        apply_shift(offer, [((0,), (3,))], block, world=world, where="t/offer/3")
    assert apply_shift(offer, [((0,), (3,))], 1, world=16, where="k") == [((1,), (10,))]


@pytest.mark.parametrize(
    "ranks",
    [
        (3,),
        (0, 5),
        (1, 3, 5, 7),
        (0, 1, 128, 129, 256, 257),
        tuple(r for d in range(0, 131072, 128) for r in range(d, d + 8)),
    ],
)
def test_a_group_of_holders_is_a_few_bytes_and_comes_back_whole(ranks: tuple[int, ...]) -> None:
    text = RankSet.of(ranks).to_json()
    assert len(text) <= 14  # every TP rank of every replica: "0+8/128x1024"
    assert tuple(RankSet.from_json(text, where="k", field="holders", world=131072)) == ranks


def test_a_group_of_holders_past_the_world_names_its_key() -> None:
    with pytest.raises(
        CoordinationError, match=re.escape("t/offer/3: field 'holders' is not a set of ranks below 1024")
    ):
        RankSet.from_json("0+8/128x9", where="t/offer/3", field="holders", world=1024)
