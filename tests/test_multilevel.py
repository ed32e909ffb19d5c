"""The multi-level interval model (``tiercheck.cli.multilevel``): its optimum against Young's closed form in
the one-level limit, against the per-level closed forms where they are whole multiples of each other, and
against a brute-force search over whole multiples and intervals; the memory the tier needs.

Every expected number is hand-computed; the arithmetic is in the comments.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Callable

import pytest

from tests.cli import run
from tiercheck.cli.multilevel import (
    KINDS,
    Level,
    memory_need,
    optimal_pattern,
    recovery_levels,
    waste_fraction,
)
from tiercheck.cli.sizing import young_daly_interval

MEMORY = frozenset({"crash"})
NODE = frozenset({"crash", "node"})
ALL = frozenset(KINDS)


def levels(*costs: tuple[float, float], survives: tuple[frozenset[str], ...] = (MEMORY, NODE, ALL)) -> list[Level]:
    return [Level(name=f"L{i + 1}", save_s=c, restore_s=r, survives=s)
            for i, ((c, r), s) in enumerate(zip(costs, survives, strict=False))]  # fmt: skip


# --------------------------------------------------------------------------- closed forms


def test_one_level_is_youngs_interval_and_waste() -> None:
    # C = 60 s, M = 86400 s: Young sqrt(2 · 60 · 86400) = 3219.9379 s; waste sqrt(2 · 60 / 86400) + R/M
    #   = 0.0372678 + 300/86400 (0.0034722) = 0.0407400
    one = levels((60, 300), survives=(ALL,))
    pattern = optimal_pattern(one, {"node": 1 / 86400})
    assert pattern.intervals_s[0] == pytest.approx(young_daly_interval(60, 86400), rel=1e-12)
    assert pattern.intervals_s[0] == pytest.approx(3219.937887599697, rel=1e-12)
    assert pattern.waste_fraction == pytest.approx(math.sqrt(2 * 60 / 86400) + 300 / 86400, rel=1e-12)
    assert pattern.goodput == pytest.approx(1 - 0.04074002, abs=1e-8)
    # Every kind recovered from the one level: the rates add up (1/172800 · 2 = 1/86400), the same optimum.
    split = optimal_pattern(one, {"crash": 1 / 172800, "job": 1 / 172800})
    assert split.intervals_s[0] == pytest.approx(pattern.intervals_s[0], rel=1e-12)
    assert split.recovers == {"crash": "L1", "job": "L1"}


def test_levels_at_whole_ratios_take_each_their_own_young_interval() -> None:
    # The waste is Σ C_i/P_i + Λ_i·P_i/2 + ..., each level's term least at sqrt(2·C_i/Λ_i):
    #   memory C = 1, crash every 200 s: sqrt(2 · 1 · 200) = 20 s
    #   disk C = 16, node loss every 800 s: sqrt(2 · 16 · 800) = 160 s = 8 · 20
    #   remote C = 92.16, job loss every 80,000 s: sqrt(2 · 92.16 · 80000) = sqrt(14,745,600) = 3840 s = 24 · 160
    three = levels((1, 2), (16, 10), (92.16, 60))
    rates = {"crash": 1 / 200, "node": 1 / 800, "job": 1 / 80000}
    pattern = optimal_pattern(three, rates)
    assert pattern.intervals_s == pytest.approx((20, 160, 3840), rel=1e-9)
    assert pattern.multiples == (1, 8, 24)
    assert pattern.recovers == {"crash": "L1", "node": "L2", "job": "L3"}
    # W = Σ 2·C_i/P_i (at each optimum C/P = Λ·P/2) + Σ Λ_i·R_i
    #   = 2/20 + 32/160 + 184.32/3840 + 2/200 + 10/800 + 60/80000
    #   = 0.1 + 0.2 + 0.048 + 0.01 + 0.0125 + 0.00075 = 0.37125
    assert pattern.waste_fraction == pytest.approx(0.37125, rel=1e-9)
    assert waste_fraction(three, rates, [20, 160, 3840]) == pytest.approx(0.37125, rel=1e-12)


def test_a_level_no_failure_needs_goes_with_the_level_above_or_never() -> None:
    three = levels((1, 2), (16, 10), (92.16, 60))
    # No node losses: the disk is written only with the remote, its cost joining the remote's (16 + 92.16):
    #   remote alone: sqrt(2 · 108.16 · 80000) = 4160 s; memory: sqrt(2 · 1 · 200) = 20 s, 4160 / 20 = 208
    pattern = optimal_pattern(three, {"crash": 1 / 200, "job": 1 / 80000})
    assert pattern.multiples[2] == 1 and pattern.intervals_s[1] == pattern.intervals_s[2]
    assert pattern.multiples[1] == 208
    assert pattern.intervals_s == pytest.approx((20, 4160, 4160), rel=1e-9)
    assert pattern.recovers == {"crash": "L1", "job": "L3"}
    # No job losses: the remote is never written (nothing is recovered from it).
    pattern = optimal_pattern(three, {"crash": 1 / 200, "node": 1 / 800})
    assert pattern.intervals_s == pytest.approx((20, 160, None))
    assert pattern.multiples == (1, 8, None)


def test_whole_steps() -> None:
    # One level, C = 2, M = 10,000: Young sqrt(40,000) = 200 s; with 30 s steps, 6 steps (180 s) or 7 (210 s):
    #   W(180) = 2/180 + 90/10000 = 0.020111; W(210) = 2/210 + 105/10000 = 0.020024, so 7 steps.
    one = levels((2, 0), survives=(ALL,))
    pattern = optimal_pattern(one, {"node": 1e-4}, step_s=30)
    assert pattern.intervals_s == (210,)
    assert pattern.waste_fraction == pytest.approx(2 / 210 + 105 / 10000, rel=1e-12)
    # A step longer than the optimum: every step.
    assert optimal_pattern(one, {"node": 1e-4}, step_s=1000).intervals_s == (1000,)


def test_refusals() -> None:
    mem_only = levels((1, 1), survives=(MEMORY,))
    with pytest.raises(ValueError, match="no level survives a node loss"):
        recovery_levels(mem_only, {"crash": 1e-3, "node": 1e-4})
    with pytest.raises(ValueError, match="every failure rate is 0"):
        optimal_pattern(mem_only, {"crash": 0.0})
    with pytest.raises(ValueError, match="unknown failure kinds"):
        optimal_pattern(mem_only, {"meteor": 1e-3})
    with pytest.raises(ValueError, match="finite number of 0 or more"):
        optimal_pattern(mem_only, {"crash": -1.0})
    two = levels((1, 1), (5, 5))
    with pytest.raises(ValueError, match="not a whole multiple"):
        waste_fraction(two, {"crash": 1e-3, "node": 1e-4}, [10, 25])
    with pytest.raises(ValueError, match="never written"):
        waste_fraction(two, {"crash": 1e-3, "node": 1e-4}, [10, None])
    with pytest.raises(ValueError, match="save_s"):
        Level(name="x", save_s=0, restore_s=1, survives=ALL)
    with pytest.raises(ValueError, match="step_s"):
        optimal_pattern(two, {"crash": 1e-3}, step_s=0)


# --------------------------------------------------------------------------- brute force


def brute_force(
    lv: list[Level], rates: dict[str, float], top: int, step_s: float | None = None
) -> tuple[float, list[float | None]]:
    """The least waste over every multiple up to ``top`` at each level after the first, and for each, the first
    interval by ternary search on the waste (convex in it), or over whole steps: nothing from the model's
    closed forms. Levels nothing is recovered from may also be never written, or written with any multiple."""
    choices: list[list[int | None]] = [[None, *range(1, top + 1)] for _ in lv[1:]]
    best: tuple[float, list[float | None]] = (math.inf, [])
    for multiples in itertools.product(*choices):

        def intervals(t: float, multiples: tuple[int | None, ...] = multiples) -> list[float | None]:
            out: list[float | None] = [t]
            for n in multiples:
                last = out[-1]
                out.append(None if n is None or last is None else last * n)
            return out

        def waste(t: float, intervals: Callable[[float], list[float | None]] = intervals) -> float:
            try:
                return waste_fraction(lv, rates, intervals(t))
            except ValueError:  # a level that recovers a failure never written
                return math.inf

        if math.isinf(waste(1.0)):
            continue
        if step_s is None:
            lo, hi = 1e-3, 1e7
            for _ in range(100):
                a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
                lo, hi = (lo, b) if waste(a) <= waste(b) else (a, hi)
            t = (lo + hi) / 2
        else:
            t = min((s * step_s for s in range(1, 400)), key=waste)
        if waste(t) < best[0]:
            best = (waste(t), intervals(t))
    return best


@pytest.mark.parametrize("seed", range(15))
def test_the_optimum_matches_a_brute_force_search(seed: int) -> None:
    rng = random.Random(seed)
    n = 1 + seed % 3
    lv = levels(*[(rng.uniform(1, 2) * 2**i, rng.uniform(0, 20)) for i in range(n)])
    kinds = KINDS if n == 3 else ("crash", "node") if n == 2 else ("crash",)
    rates = {k: rng.uniform(1, 2) / (300 * 3**i) for i, k in enumerate(kinds)}
    if seed % 4 == 3:
        rates[kinds[-2 if n > 1 else -1]] = 0.0  # a level that nothing is recovered from (or the only one)
        if not any(rates.values()):
            rates[kinds[-1]] = 1e-3
    step_s = 7.0 if seed % 5 == 4 else None
    pattern = optimal_pattern(lv, rates, step_s=step_s)
    assert all(m is None or m <= 12 for m in pattern.multiples), pattern  # within the brute force's reach
    least, at = brute_force(lv, rates, 14, step_s)
    assert pattern.waste_fraction == pytest.approx(least, rel=1e-9), (pattern, at)
    assert pattern.waste_fraction <= least * (1 + 1e-12)
    assert pattern.waste_fraction == pytest.approx(waste_fraction(lv, rates, list(pattern.intervals_s)), rel=1e-12)


# --------------------------------------------------------------------------- memory


def test_memory_need() -> None:
    # 8 ranks of 2.5 GB each on a node, 2 slots: 2 · 8 · 2.5e9 = 40e9; one replica: another 8 · 2.5e9 = 20e9.
    need = memory_need(per_rank_bytes=2_500_000_000, ranks_per_node=8, slots=2, replicas=1, tmpfs_bytes=64 * 10**9)
    assert (need.own_bytes, need.peer_bytes, need.node_bytes) == (40 * 10**9, 20 * 10**9, 60 * 10**9)
    assert need.fits is True
    assert memory_need(per_rank_bytes=10, ranks_per_node=1, slots=3, replicas=0, tmpfs_bytes=29).fits is False
    assert memory_need(per_rank_bytes=10, ranks_per_node=1, slots=2, replicas=0, tmpfs_bytes=None).fits is None
    with pytest.raises(ValueError, match="slots"):
        memory_need(per_rank_bytes=10, ranks_per_node=1, slots=1, replicas=0, tmpfs_bytes=None)


# --------------------------------------------------------------------------- the command


def test_plan_prints_the_multilevel_intervals_and_memory() -> None:
    args = ["plan", "--params", "7B", "--dp", "16", "--crash-mtbf-hours", "100", "--job-mtbf-hours", "2000"]
    result = json.loads(run(*args, "--tmpfs-gb", "64", "--json").stdout)
    multi = result["multilevel"]
    # 7e9 · 14 B = 98e9 B over 16 ranks: 6.125e9 B per rank, 8 ranks (49e9 B) per node on 2 nodes.
    # memory: 6.125e9 / 25e9 = 0.245 s per GPU; local NVMe 49e9 / 2e9 = 24.5 s; S3 max(49e9/2.5e9, 98e9/10e9) = 19.6 s
    names = [level["name"] for level in multi["levels"]]
    assert names == ["memory", "local-nvme", "s3"]
    assert [level["save_s"] for level in multi["levels"]] == pytest.approx([0.245, 24.5, 19.6], rel=1e-12)
    # crash: 2 nodes / 100 h; node loss: 2 / 5000 h (not replicated, so from S3); job: 1 / 2000 h
    rates = multi["rates_per_s"]
    assert rates == pytest.approx({"crash": 2 / 360000, "node": 2 / 18_000_000, "job": 1 / 7_200_000}, rel=1e-12)
    assert multi["recovers"] == {"crash": "memory", "node": "s3", "job": "s3"}
    # the local disk recovers nothing without replicas: written only with S3, its 24.5 s joining S3's 19.6 s
    # Alone, each level would take Young's interval: memory sqrt(2 · 0.245 · 180000) = 296.98 s; S3 (with the disk)
    # sqrt(2 · 44.1 / (2/18e6 + 1/7.2e6)) = sqrt(88.2 / 2.5e-7) = 18,782.97 s = 63.25 x 296.98: 63 is a whole multiple.
    intervals = [level["interval_s"] for level in multi["levels"]]
    assert [level["multiple"] for level in multi["levels"]] == [1, 63, 1] and intervals[1] == intervals[2]
    assert intervals[0] == pytest.approx(296.98, rel=0.01) and intervals[2] == pytest.approx(18783, rel=0.01)
    assert multi["goodput"] > multi["without_memory"]["goodput"]
    memory = result["memory"]
    # 2 slots · 49e9 = 98e9 B on a node against 64e9 B: does not fit
    assert memory["node_bytes"] == 98 * 10**9 and memory["fits"] is False and memory["tmpfs_bytes"] == 64 * 10**9
    table = run(*args, "--tmpfs-gb", "64").stdout
    assert "memory" in table and "does not fit" in table and "goodput" in table, table
    replicated = json.loads(run(*args, "--replicas", "1", "--tmpfs-gb", "200", "--json").stdout)
    assert replicated["multilevel"]["recovers"] == {"crash": "memory", "node": "memory", "job": "s3"}
    assert replicated["memory"]["node_bytes"] == 147 * 10**9 and replicated["memory"]["fits"] is True
    # with steps of 10 s: the memory level every whole number of steps, and the options that give the pattern
    stepped = run(*args, "--tmpfs-gb", "100", "--step-s", "10").stdout
    assert "save every 30 steps, MemoryOptions(persist_every=1890), DrainOptions(every=1890)" in stepped, stepped
    # where the last line says the memory tier does not fit its tmpfs, no MemoryOptions is advised
    cramped = run(*args, "--tmpfs-gb", "64", "--step-s", "10").stdout
    assert "MemoryOptions" not in cramped and "does not fit" in cramped.splitlines()[-1], cramped
    assert "options: none advised: the memory tier does not fit its tmpfs" in cramped, cramped
    refused = run(*args, "--memory-gbps", "fast", check=False)
    assert refused.returncode == 2 and "--memory-gbps" in refused.stderr, refused.stderr
    # a crash with neither a disk nor a shared tier to recover a node loss: one line, naming the kind
    alone = run(*args, "--tier", "nvme:2:3:node", check=False)
    assert alone.returncode == 1 and "no level survives a node loss" in alone.stderr, alone.stderr
