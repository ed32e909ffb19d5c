"""format.parity: the coding groups, the stripes, Reed-Solomon over them (every choice of lost members rebuilt
bit-identically), and the group's record read back field by field (hostile records refused, naming the field)."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import pytest

from tiercheck.errors import CorruptCheckpointError, InvalidArgumentError
from tiercheck.format.parity import MAX_RECORD_BYTES, Member, ParityRecord, Stripes, decode, encode, group_of, groups
from tiercheck.format.paths import MANIFEST_FILE, rank_files

# ------------------------------------------------------------------------------------------- groups


@pytest.mark.parametrize(("count", "size", "parity", "jump"), [(n, s, p, j) for n in (3, 4, 5, 6, 7, 10, 12, 13, 33)
                                                                for s, p in ((3, 1), (4, 2), (6, 2), (10, 2))
                                                                for j in (1, 2, 3, 8) if n > p])  # fmt: skip
def test_every_node_is_in_exactly_one_group_of_the_size_and_the_last_takes_the_rest(
    count: int, size: int, parity: int, jump: int
) -> None:
    got = groups(count, size, parity, jump)
    assert sorted(itertools.chain.from_iterable(got)) == list(range(count))
    assert all(g == sorted(g) for g in got)
    full = max(1, count // size)
    assert len(got) == full
    assert [len(g) for g in got[:-1]] == [size] * (full - 1)
    assert len(got[-1]) == count - size * (full - 1)  # the rest, or the whole job where it is smaller
    assert all(len(g) > parity for g in got)
    for node in range(count):
        assert node in group_of(node, count, size, parity, jump)


def test_groups_deal_the_nodes_jump_apart_so_a_group_spans_the_racks() -> None:
    assert groups(10, 4, 2) == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]
    assert groups(8, 4, 2, jump=2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # 12 nodes, 3 a rack (rack = node // 3): each group has one node of each of 4 racks.
    got = groups(12, 4, 2, jump=3)
    assert got == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]
    assert all(len({n // 3 for n in g}) == 4 for g in got)
    assert groups(3, 6, 2) == [[0, 1, 2]]  # fewer nodes than a group: one group
    assert groups(5, 4, 2, jump=0) == groups(5, 4, 2, jump=1) == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize(("count", "parity"), [(0, 1), (1, 1), (2, 2), (1, 2), (3, 3)])
def test_a_job_of_parity_nodes_or_fewer_is_refused(count: int, parity: int) -> None:
    with pytest.raises(InvalidArgumentError, match=f"parity over {count} node\\(s\\) cannot survive {parity} lost"):
        groups(count, parity + 2, parity)


# ------------------------------------------------------------------------------------------ stripes


@pytest.mark.parametrize(("n", "m"), [(2, 1), (3, 1), (4, 2), (6, 2), (7, 3), (10, 2), (256, 4)])
def test_each_stripe_holds_every_member_once_and_each_member_is_data_d_times_and_parity_m_times(n: int, m: int) -> None:
    s = Stripes(n, m)
    assert s.d == n - m
    for stripe in range(n):
        assert sorted(s.holder(stripe, j) for j in range(n)) == list(range(n))
        assert all(s.position(stripe, s.holder(stripe, j)) == j for j in range(n))
    for member in range(n):
        data, parity = s.data_of(member), s.parity_of(member)
        assert [piece for _, piece in data] == list(range(n - m)) and [p for _, p in parity] == list(range(m))
        assert all(s.holder(stripe, piece) == member for stripe, piece in data)
        assert all(s.holder(stripe, n - m + p) == member for stripe, p in parity)
        assert sorted(stripe for stripe, _ in data + parity) == list(range(n))  # one shard in every stripe
    assert s.piece_bytes([10, 0, 7]) == -(-10 // (n - m)) and s.piece_bytes([]) == 1 and s.piece_bytes([0]) == 1


@pytest.mark.parametrize(("n", "m"), [(1, 1), (2, 2), (3, 0), (4, -1), (257, 1)])
def test_a_group_that_cannot_survive_its_losses_is_refused(n: int, m: int) -> None:
    with pytest.raises(InvalidArgumentError, match=f"a parity group of {n} node\\(s\\) cannot survive {m} lost"):
        Stripes(n, m)


# ----------------------------------------------------------------------------------- encode, decode


def _group_shards(n: int, m: int, seed: int) -> tuple[Stripes, int, list[bytes], list[list[bytes]]]:
    """A group's regions (random bytes of uneven sizes) and every stripe's shards by position, data and parity."""
    rng = random.Random(seed)
    s = Stripes(n, m)
    regions = [rng.randbytes(rng.randrange(1, 40_000)) for _ in range(n)]
    regions[rng.randrange(n)] = rng.randbytes(37_139 * s.d - 1)  # the largest: a piece of 37,139 bytes (prime)
    piece = s.piece_bytes([len(r) for r in regions])
    assert piece == 37_139
    padded = [r.ljust(piece * s.d, b"\0") for r in regions]
    stripes: list[list[bytes]] = []
    for stripe in range(n):
        data = [padded[s.holder(stripe, j)][j * piece : (j + 1) * piece] for j in range(s.d)]
        stripes.append(data + encode(s, [memoryview(b) for b in data], list(range(m))))
    return s, piece, regions, stripes


@pytest.mark.parametrize(("n", "m"), [(3, 1), (4, 2), (6, 2), (10, 2)])
def test_any_m_members_lost_are_rebuilt_bit_identically_from_the_others(n: int, m: int) -> None:
    s, piece, regions, stripes = _group_shards(n, m, seed=n * 100 + m)
    assert all(len(shard) == piece for shards in stripes for shard in shards)
    for lost in itertools.combinations(range(n), m):
        for stripe, shards in enumerate(stripes):
            have = {j: shards[j] for j in range(n) if s.holder(stripe, j) not in lost}
            want = sorted(j for j in range(n) if s.holder(stripe, j) in lost)
            assert len(have) == s.d and len(want) == m
            got = decode(s, have, want)
            assert sorted(got) == want
            assert all(got[j] == shards[j] for j in want), (lost, stripe)
        # a lost member's region, from its rebuilt data pieces, is its bytes
        for member in lost:
            pieces = []
            for stripe, j in s.data_of(member):
                have = {p: stripes[stripe][p] for p in range(n) if s.holder(stripe, p) not in lost}
                pieces.append(decode(s, have, [j])[j])
            assert b"".join(pieces)[: len(regions[member])] == regions[member]


def test_decode_takes_more_than_d_shards_and_any_subset_of_parity_and_gives_data_back_as_is() -> None:
    s, _, _, stripes = _group_shards(6, 2, seed=7)
    shards = stripes[3]
    assert encode(s, shards[:4], [1]) == [shards[5]] and encode(s, shards[:4], [1, 0]) == [shards[5], shards[4]]
    everything = dict(enumerate(shards))
    assert decode(s, everything, [0, 5]) == {0: shards[0], 5: shards[5]}
    assert decode(s, {j: shards[j] for j in (0, 1, 2, 3)}, [4, 5, 2]) == {2: shards[2], 4: shards[4], 5: shards[5]}
    assert decode(s, {j: shards[j] for j in (1, 2, 4, 5)}, []) == {}


def test_decode_with_fewer_than_d_shards_is_a_corrupt_checkpoint() -> None:
    s, _, _, stripes = _group_shards(6, 2, seed=8)
    with pytest.raises(CorruptCheckpointError, match="a stripe needs 4 shards to decode, 3 are left"):
        decode(s, {j: stripes[0][j] for j in (0, 4, 5)}, [1])


def test_encode_refuses_the_wrong_count_or_unequal_shards() -> None:
    s = Stripes(4, 2)
    with pytest.raises(InvalidArgumentError, match="a stripe codes 2 equal data shards, not 3"):
        encode(s, [b"ab", b"cd", b"ef"], [0])
    with pytest.raises(InvalidArgumentError, match="a stripe codes 2 equal data shards, not 2"):
        encode(s, [b"ab", b"cde"], [0])


# ------------------------------------------------------------------------------------------- record


def _record(n: int = 4, m: int = 2, piece: int = 1000) -> ParityRecord:
    s = Stripes(n, m)
    members = tuple(
        Member(node=10 + 3 * i, ranks=(2 * i, 2 * i + 1), world_size=2 * n,
               files=((rank_files(2 * i)[0], 100 + i, 7 * i), (rank_files(2 * i + 1)[4], 700, 2**32 - 1 - i)),
               parity=tuple((stripe, 1000 + stripe) for stripe, _ in s.parity_of(i)), commit=f'{{"step": 5, "i": {i}}}')
        for i in range(n)
    )  # fmt: skip
    return ParityRecord(step=5, save_id="save-abc", m=m, piece=piece, members=members)


def test_a_record_reads_back_as_written() -> None:
    for n, m in ((2, 1), (4, 2), (6, 2), (10, 2)):
        rec = _record(n, m)
        again = ParityRecord.from_bytes(rec.to_bytes(), where="PARITY.json")
        assert again == rec and again.to_bytes() == rec.to_bytes()
        assert again.stripes == Stripes(n, m) and [again.index(10 + 3 * i) for i in range(n)] == list(range(n))
        assert again.members[1].region == 801
    with pytest.raises(KeyError):
        _record().index(11)


def _doc() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(_record().to_bytes())
    return doc


def _refused(doc: object, match: str) -> None:
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    with pytest.raises(CorruptCheckpointError, match=match):
        ParityRecord.from_bytes(raw, where="g/PARITY.json")


def _with(path: tuple[Any, ...], value: object) -> dict[str, Any]:
    doc = _doc()
    at: Any = doc
    for key in path[:-1]:
        at = at[key]
    at[path[-1]] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        (("members",), {"0": 1}, "field 'members' is damaged"),
        (("members",), [], "field 'members' is damaged"),
        (("members",), [{}] * 257, "field 'members' is damaged"),
        (("m",), 0, "field 'm' is damaged"),
        (("m",), 4, "field 'm' is damaged"),
        (("m",), True, "field 'm' is damaged"),
        (("piece",), 0, "field 'piece' is damaged"),
        (("piece",), 2**62, "field 'piece' is damaged"),
        (("piece",), "1000", "field 'piece' is damaged"),
        (("step",), -1, "field 'step' is damaged"),
        (("save_id",), 5, "field 'save_id' is damaged"),
        (("save_id",), "x" * 257, "field 'save_id' is damaged"),
        (("members", 1), [], r"members\[1\]: field 'the entry' is damaged"),
        (("members", 1, "node"), -1, r"members\[1\]: field 'node' is damaged"),
        (("members", 1, "world_size"), 2**40, r"members\[1\]: field 'world_size' is damaged"),
        (("members", 1, "ranks"), [2, 8], r"members\[1\]: field 'ranks' is damaged \(rank 8 of 8\)"),
        (("members", 1, "ranks"), [], r"members\[1\]: field 'ranks' is damaged"),
        (("members", 1, "ranks"), 2, r"members\[1\]: field 'ranks' is damaged"),
        (("members", 1, "files", 0, 0), "a/b", r"members\[1\]: field 'files' is damaged .*not its ranks'"),
        (("members", 1, "files", 0, 0), "..", r"members\[1\]: field 'files' is damaged .*not its ranks'"),
        (("members", 1, "files", 0, 0), "../manifest.json", r"members\[1\]: field 'files' is damaged .*not its ranks'"),
        (("members", 1, "files", 0, 0), ".hidden", r"members\[1\]: field 'files' is damaged .*not its ranks'"),
        (("members", 1, "files", 0, 0), "/etc/passwd", r"members\[1\]: field 'files' is damaged .*not its ranks'"),
        (("members", 1, "files", 0, 0), "", r"members\[1\]: field 'files' is damaged .*not its ranks'"),
        (("members", 1, "files", 0, 0), rank_files(0)[0], r"members\[1\]: field 'files' .*not its ranks'"),
        (("members", 1, "files", 0, 0), rank_files(3)[4], r"members\[1\]: field 'files' .*names one twice"),
        (("members", 1, "files", 0, 0), 7, r"members\[1\]: field 'files' is damaged .*not \[name, size, crc32c\]"),
        (("members", 1, "files", 0, 1), 2**62, r"members\[1\]: field 'files' is damaged .*below 2\*\*62"),
        (("members", 1, "files", 0, 1), 2**80, r"members\[1\]: field 'files' is damaged .*below 2\*\*62"),
        (("members", 1, "files", 0, 2), 2**32, r"members\[1\]: field 'files' is damaged .*CRC32C"),
        (("members", 1, "files", 0), ["a", 1], r"members\[1\]: field 'files' is damaged"),
        (("members", 1, "files"), [["f", 1, 1]] * 13, r"members\[1\]: field 'files' is damaged"),
        (("members", 1, "parity", 0, 1), 2**32, r"members\[1\]: field 'parity' is damaged .*CRC32C"),
        (("members", 1, "parity", 0), [1], r"members\[1\]: field 'parity' is damaged"),
        (("members", 1, "parity"), "0,1", r"members\[1\]: field 'parity' is damaged"),
        (("members", 1, "commit"), None, r"members\[1\]: field 'commit' is damaged"),
        (("members", 1, "commit"), "x" * ((1 << 20) + 1), r"members\[1\]: field 'commit' is damaged"),
    ],
)
def test_a_damaged_field_is_refused_by_name(path: tuple[Any, ...], value: object, match: str) -> None:
    _refused(_with(path, value), "g/PARITY.json: .*" + match)


@pytest.mark.parametrize("key", ["members", "m", "piece", "step", "save_id"])
def test_a_missing_field_is_refused_by_name(key: str) -> None:
    doc = _doc()
    del doc[key]
    _refused(doc, f"field '{key}' is damaged")


def test_a_record_that_is_not_a_json_object_or_too_big_is_refused() -> None:
    _refused(b"\xff\xfe not json", "g/PARITY.json: parity record field 'the document' is damaged")
    _refused(b"{", "field 'the document' is damaged")
    _refused(b"[1, 2]", "field 'the document' is damaged")
    _refused(b" " * (MAX_RECORD_BYTES + 1), f"g/PARITY.json: {MAX_RECORD_BYTES + 1} bytes, more than a parity record")


def test_a_deeply_nested_record_is_refused_without_a_recursion_error() -> None:
    deep = b"[" * 200_000 + b"]" * 200_000
    _refused(deep, "field 'the document' is damaged")
    doc = _doc()
    _refused(json.dumps(doc).replace('"commit": ', '"commit": ' + "[" * 100_000 + "]" * 100_000 + ", \"x\": ", 1)
             .encode(), "field 'the document' is damaged")  # fmt: skip


def test_a_record_inconsistent_across_members_is_refused() -> None:
    doc = _doc()
    doc["members"][2]["node"] = doc["members"][0]["node"]
    _refused(doc, "g/PARITY.json: parity record names a node twice")
    doc = _doc()
    doc["members"][1]["parity"][0][0] = (doc["members"][1]["parity"][0][0] + 1) % 4  # a stripe it does not hold
    _refused(doc, r"g/PARITY.json: members\[1\] names parity of stripes it does not hold")
    doc = _doc()
    doc["members"][3]["parity"] = doc["members"][3]["parity"][:1]  # one of its two
    _refused(doc, r"members\[3\] names parity of stripes it does not hold")
    doc = _doc()
    doc["members"][0]["files"].append([MANIFEST_FILE, 2 * 1000 - 800 + 1, 0])  # region 2,001 > d x piece = 2,000
    _refused(doc, r"g/PARITY.json: members\[0\]'s files exceed its 2 pieces")
    doc["members"][0]["files"][-1][1] -= 1  # exactly d x piece: fits
    assert ParityRecord.from_bytes(json.dumps(doc).encode(), where="x").members[0].region == 2000
