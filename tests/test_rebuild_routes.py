"""Who sends which shard to whom in a rebuild (``tiering.rebuild_rounds.routes``): every piece the
lost members lack is decoded once, from ``d`` shards that live members hold, and the decoding is
shared among the lost members of a stripe."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from tiercheck.errors import CorruptCheckpointError
from tiercheck.format.parity import Stripes
from tiercheck.tiering.rebuild_rounds import routes

CODES = [(3, 1), (2, 2), (4, 2), (6, 2), (10, 2), (5, 3)]


def _cases() -> list[tuple[Stripes, tuple[int, ...], bool]]:
    out = []
    for d, m in CODES:
        st = Stripes(d + m, m)
        for size in range(1, m + 1):
            for lost in itertools.combinations(range(st.n), size):
                out += [(st, lost, False), (st, lost, True)]
    return out


@pytest.mark.parametrize(("st", "lost", "parity"), _cases(), ids=lambda v: str(v))
def test_every_lacking_piece_is_decoded_once_from_d_live_shards(st: Stripes, lost: tuple[int, ...],
                                                                parity: bool) -> None:  # fmt: skip
    live = [i for i in range(st.n) if i not in lost]
    plan = routes(st, lost, live, parity=parity)
    wanted = {(s, j) for s in range(st.n) for j in range(st.n) if st.holder(s, j) in lost and (j >= st.d) == parity}
    got = [(r.stripe, j) for r in plan for j in r.lacking]
    assert sorted(got) == sorted(wanted)  # each once
    for r in plan:
        assert r.decoder in r.lacking
        assert len(r.sources) == st.d and len(set(r.sources)) == st.d
        assert all(st.holder(r.stripe, j) in live for j in r.sources)
        assert not set(r.sources) & set(r.lacking)


def test_two_lost_nodes_share_the_stripes_they_both_lack() -> None:
    """4+2 on 6 nodes, nodes 0 and 1 lost: of the 5 stripes holding their data, 3 hold both's. Each
    such stripe is decoded by one of them (the one with less to decode so far), who sends the other
    its piece: they decode 5 and 3 pieces' rows (7 each if each decoded its own), and receive 13 and
    10 shards of a piece (16 each)."""
    st = Stripes(6, 2)
    plan = routes(st, (0, 1), (2, 3, 4, 5), parity=False)
    rows = Counter({0: 0, 1: 0})
    received = Counter({0: 0, 1: 0})
    for r in plan:
        decoder = st.holder(r.stripe, r.decoder)
        rows[decoder] += len(r.lacking)
        received[decoder] += st.d
        for k in r.lacking:
            if k != r.decoder:
                received[st.holder(r.stripe, k)] += 1
    assert len(plan) == 5 and sum(len(r.lacking) == 2 for r in plan) == 3
    assert sorted(rows.values()) == [3, 5]
    assert sorted(received.values()) == [10, 13]


def test_too_few_live_shards_is_said() -> None:
    st = Stripes(4, 2)
    with pytest.raises(CorruptCheckpointError, match="stripe 0 has 1 shards to decode from, 2 needed"):
        routes(st, (0,), (1,), parity=False)
