"""``tiercheck plan --replicas R --parity K,M``: what whole copies and Reed-Solomon parity cost a node in RAM and
network per step, and the node losses each survives (``cli.protection``). Apart from tests/test_sizing.py, which
is near the size a module may have."""

from __future__ import annotations

import json

import pytest

from tests.cli import run
from tiercheck.cli.protection import parse_parity, protection
from tiercheck.errors import InvalidArgumentError
from tiercheck.options import ParityOptions

GiB = 1 << 30


def test_parity_costs_m_over_d_of_a_snapshot_in_ram_and_m_snapshots_of_network_as_m_copies_do() -> None:
    got = protection(snapshot_bytes=10 * GiB, slots=2, nodes=12, replicas=2, parity=ParityOptions(data=4, parity=2),
                     link_gbps=400)  # fmt: skip
    copies, parity = got["rows"]
    assert copies["scheme"] == "copies (replicas=2)" and copies["survives"] == "any 2 node(s) lost"
    assert (copies["ram_bytes"], copies["peak_ram_bytes"]) == (60 * GiB, 60 * GiB)  # 2 slots x (1 + 2 copies)
    assert (copies["sent_bytes"], copies["received_bytes"]) == (20 * GiB, 20 * GiB)
    assert (
        parity["scheme"] == "parity 4+2 (groups of 6 nodes)"
        and parity["survives"] == "any 2 node(s) lost per group of 6"
    )
    assert (parity["extra_snapshots"], parity["peak_snapshots"]) == (0.5, 1.0)
    assert (parity["ram_bytes"], parity["peak_ram_bytes"]) == (25 * GiB, 30 * GiB)  # 2 + 2/4, and 2 + 2 x 2/4
    assert (parity["sent_bytes"], parity["received_bytes"]) == (20 * GiB, 20 * GiB)  # m x snapshot, as 2 copies
    assert parity["send_s"] == copies["send_s"] == 20 * GiB / 50e9  # 400 Gb/s = 50 GB/s


def test_parity_where_the_nodes_do_not_fill_groups_costs_the_smallest_groups_share_and_copies_default_to_m() -> None:
    # 7 nodes in groups of 6: one group of 7 (d = 5): 2/5 of a snapshot; no --replicas: compared with 2 copies.
    got = protection(snapshot_bytes=1000, slots=2, nodes=7, replicas=0, parity=ParityOptions(data=4, parity=2))
    copies, parity = got["rows"]
    assert copies["scheme"] == "copies (replicas=2)" and copies["send_s"] is None
    assert parity["scheme"] == "parity 4+2 (groups of 7 nodes)" and parity["extra_snapshots"] == 2 / 5
    assert parity["ram_bytes"] == 2400 and parity["peak_ram_bytes"] == 2800
    # 13 nodes: groups of 6 and 7; the group of 6 (d = 4) is the worst node's.
    got = protection(snapshot_bytes=1000, slots=2, nodes=13, replicas=1, parity=ParityOptions(data=4, parity=2))
    assert got["rows"][0]["scheme"] == "copies (replicas=1)"
    assert got["rows"][1]["scheme"] == "parity 4+2 (groups of 6, 7 nodes)" and got["rows"][1]["ram_bytes"] == 2500
    # 4 nodes surviving 2 losses: the information bound, m / (n - m) = 1 snapshot, 3 with two slots.
    four = protection(snapshot_bytes=1000, slots=2, nodes=4, replicas=0, parity=ParityOptions(data=4, parity=2))
    assert four["rows"][1]["ram_bytes"] == 3000 and four["rows"][1]["survives"] == "any 2 node(s) lost"
    assert protection(snapshot_bytes=1000, slots=2, nodes=4, replicas=0, parity=None)["rows"] == []


def test_parity_over_too_few_nodes_or_a_bad_parity_is_refused_by_name() -> None:
    with pytest.raises(InvalidArgumentError, match="parity over 2 node\\(s\\) cannot survive 2 lost"):
        protection(snapshot_bytes=1, slots=2, nodes=2, replicas=0, parity=ParityOptions(data=4, parity=2))
    assert parse_parity("8,3") == ParityOptions(data=8, parity=3)
    for bad, why in (("4", "two whole numbers"), ("4,2,1", "two whole numbers"), ("a,b", "two whole numbers"),
                     ("4,0", "ParityOptions.parity must be a positive integer"),
                     ("250,7", "ParityOptions: data \\+ parity must be at most 256")):  # fmt: skip
        with pytest.raises(
            InvalidArgumentError, match=f"--parity expects DATA,PARITY \\(e.g. 4,2\\), got '{bad}': {why}"
        ):
            parse_parity(bad)


def test_plan_prints_copies_against_parity_per_node() -> None:
    # 7e9 params, bf16 + Adam: 98 GB over 32 ranks = 3.0625 GB a rank, 8 a node: 24.5 GB a node's snapshot, 4 nodes.
    args = ("plan", "--params", "7e9", "--dp", "32", "--parity", "4,2", "--replicas", "1", "--link-gbps", "400",
            "--replace-figures", "stated")  # fmt: skip
    got = json.loads(run(*args, "--json").stdout)["protection"]
    snapshot = 8 * 3_062_500_000
    assert got["snapshot_bytes"] == snapshot and got["nodes"] == 4 and got["slots"] == 2
    copies, parity = got["rows"]
    assert copies["ram_bytes"] == 4 * snapshot  # 2 slots x (1 + 1 copy)
    assert parity["ram_bytes"] == 3 * snapshot  # 4 nodes: 2/(4-2) = 1x
    assert parity["sent_bytes"] == 2 * snapshot and parity["peak_ram_bytes"] == 4 * snapshot
    text = run(*args).stdout
    assert "peers' protection of the memory tier, per node (2 slots x 22.8 GiB snapshot):" in text
    assert "copies (replicas=1)" in text and "parity 4+2 (groups of 4 nodes)" in text, text
    assert "any 2 node(s) lost" in text and "send at 400 Gb/s" in text
    assert "protection" not in json.loads(run("plan", "--params", "7e9", "--json").stdout)
    bad = run("plan", "--params", "7e9", "--parity", "4,2", check=False)  # one node
    assert bad.returncode == 1 and "parity over 1 node(s) cannot survive 2 lost" in bad.stderr
