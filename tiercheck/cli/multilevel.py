"""Checkpoint intervals for several tiers at once: the multi-level model, and the memory the memory tier needs.

Pure arithmetic (stdlib only). Units: seconds, failures per second, bytes.

The model. Young ("A first order approximation to the optimum checkpoint interval", CACM 17(9), 1974)
gives one level's optimum interval ``sqrt(2·C·M)`` from its first-order waste ``C/T + (T/2 + R)/M``; Daly
("A higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3), 2006) refines
it. Moody, Bronevetsky, Mohror and de Supinski ("Design, Modeling, and Evaluation of a Scalable Multi-level
Checkpointing System", SC10) model SCR's levels: each failure is recovered from the cheapest level that
survives it, and each level's checkpoint is taken every ``n``-th time of the level below it (a level-i
checkpoint is also one at every level below: here, each save commits to memory; ``persist_every`` says which
also go to the node's disk, ``DrainOptions.every`` which to the remote). They evaluate a pattern with a
Markov model and search for the best; we use the same pattern and recovery rule with Young's first-order
expectations, the form Benoit, Cavelan, Le Fèvre, Robert and Sun study ("Towards Optimal Multi-Level
Checkpointing", IEEE Transactions on Computers 66(7), 2017). With levels ``1..k``, level ``i`` taken every
``P_i`` seconds of work (``P_1 = T``, ``P_i = n_i·P_(i-1)``, ``n_i`` a whole number), its own cost ``C_i``
(the training time one checkpoint there adds beyond the levels below), its restore time ``R_i``, and
``Λ_i`` the rate of the failures whose cheapest surviving level is ``i``, the expected fraction of time lost is

    W = Σ_i C_i / P_i + Σ_i Λ_i · (P_i / 2 + R_i)

(a level-i checkpoint costs ``C_1 + ... + C_i``; summed over how often each is the highest level taken, that
is the first sum; a failure recovered from level ``i`` loses half its period on average and its restore).
With one level it is Young's waste, minimal at ``sqrt(2·C/Λ)``. For fixed multiples ``m_i = P_i/T`` it is
``A/T + B·T + Σ Λ_i·R_i`` with ``A = Σ C_i/m_i``, ``B = Σ Λ_i·m_i/2``: minimal at ``T = sqrt(A/B)``, where
``W = 2·sqrt(A·B) + Σ Λ_i·R_i``. :func:`optimal_pattern` minimises ``A·B`` over the whole multiples (the
last level's in closed form: ``A·B`` is convex in its multiple, so the best is a neighbour of the real
optimum). A level no failure is recovered from is written only with the level above it (its cost joins that
level's), or never when none above is used. Valid while ``W`` is well below 1 (intervals and restores short
against the time between failures); failures during a checkpoint or a restore are not counted.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from tiercheck.cli.sizing import Sizes, TierProfile, staging_s, times

__all__ = [
    "KINDS",
    "Level",
    "MemoryNeed",
    "Pattern",
    "memory_need",
    "multilevel_table",
    "optimal_pattern",
    "recovery_levels",
    "waste_fraction",
]

#: Failure kinds: a process crash on a node that stays up; the loss of a node (its memory and disks); the loss
#: of the whole job's nodes at once (every node-local copy gone).
KINDS = ("crash", "node", "job")

_MAX_MULTIPLE = 100_000  # a level taken less often than every 100,000th save of the one below: a mistake


@dataclass(frozen=True, kw_only=True)
class Level:
    """One level of the hierarchy, fastest first. ``save_s``: the training time one checkpoint at this level
    adds beyond the levels below it; ``restore_s``: the time to restore from it; ``survives``: the failure
    kinds (:data:`KINDS`) after which its copy is still there."""

    name: str
    save_s: float
    restore_s: float
    survives: frozenset[str]

    def __post_init__(self) -> None:
        if not (self.save_s > 0 and math.isfinite(self.save_s)):
            raise ValueError(f"level {self.name}: save_s must be a positive finite number, not {self.save_s}")
        if not (self.restore_s >= 0 and math.isfinite(self.restore_s)):
            raise ValueError(f"level {self.name}: restore_s must be a finite number of 0 or more, not {self.restore_s}")
        unknown = set(self.survives) - set(KINDS)
        if unknown:
            raise ValueError(f"level {self.name}: survives names unknown failure kinds {sorted(unknown)}")


@dataclass(frozen=True)
class Pattern:
    """The best pattern: ``intervals_s[i]``, the seconds of work between checkpoints at level ``i`` (None: never
    written, no failure needs it); ``multiples[i]``: ``intervals_s[i] / intervals_s[i-1]`` (1 for the first
    level, None where never written); ``waste_fraction``: the first-order expected fraction of time lost
    (checkpoints, lost work, restores); ``goodput``: ``1 - waste_fraction``, at least 0; ``recovers``: the
    level each failure kind with a rate above 0 is recovered from."""

    intervals_s: tuple[float | None, ...]
    multiples: tuple[int | None, ...]
    waste_fraction: float
    goodput: float
    recovers: dict[str, str]


def recovery_levels(levels: list[Level], rates_per_s: dict[str, float]) -> dict[str, int]:
    """The index of the level each failure kind with a rate above 0 is recovered from: the first (fastest)
    that survives it. A kind with a rate that no level survives is refused."""
    _check_rates(rates_per_s)
    found: dict[str, int] = {}
    for kind in KINDS:
        if rates_per_s.get(kind, 0.0) == 0:
            continue
        index = next((i for i, level in enumerate(levels) if kind in level.survives), None)
        if index is None:
            raise ValueError(f"no level survives a {kind} loss, yet its rate is {rates_per_s[kind]} per second")
        found[kind] = index
    return found


def waste_fraction(levels: list[Level], rates_per_s: dict[str, float], intervals_s: list[float | None]) -> float:
    """The first-order expected fraction of time lost (the module's ``W``) with level ``i`` taken every
    ``intervals_s[i]`` seconds of work (None: never). Each interval must be a whole multiple of the one below
    it (a checkpoint at a level is one at every level below too)."""
    if len(intervals_s) != len(levels):
        raise ValueError(f"{len(levels)} levels but {len(intervals_s)} intervals")
    below: float | None = None
    for level, interval in zip(levels, intervals_s, strict=True):
        if interval is None:
            below = math.inf
            continue
        if not (interval > 0 and math.isfinite(interval)):
            raise ValueError(f"level {level.name}: an interval must be a positive finite number, not {interval}")
        if below is not None and (below == math.inf or not _is_multiple(interval, below)):
            raise ValueError(f"level {level.name}: its interval {interval} is not a whole multiple of {below}")
        below = interval
    waste = sum(level.save_s / p for level, p in zip(levels, intervals_s, strict=True) if p is not None)
    for kind, index in recovery_levels(levels, rates_per_s).items():
        interval = intervals_s[index]
        if interval is None:
            raise ValueError(f"level {levels[index].name} recovers {kind} losses but is never written")
        waste += rates_per_s[kind] * (interval / 2 + levels[index].restore_s)
    return waste


def optimal_pattern(levels: list[Level], rates_per_s: dict[str, float], *, step_s: float | None = None) -> Pattern:
    """The intervals that minimise :func:`waste_fraction` (the most goodput), each a whole multiple of the one
    below. ``step_s``: the seconds of one training step, when saves can come only between steps: the first
    interval is then a whole number of steps (the best of the two next to the real optimum: ``W`` is convex
    in it)."""
    if not levels:
        raise ValueError("optimal_pattern needs at least one level")
    if step_s is not None and not (step_s > 0 and math.isfinite(step_s)):
        raise ValueError(f"step_s must be a positive finite number, not {step_s}")
    recovers = recovery_levels(levels, rates_per_s)
    if not recovers:
        raise ValueError("every failure rate is 0: no interval is best (checkpoint never)")
    rate = [0.0] * len(levels)
    for kind, index in recovers.items():
        rate[index] += rates_per_s[kind]
    used = [i for i, r in enumerate(rate) if r > 0]
    # a level nothing is recovered from is written only with the next used level above it: its cost joins that one's
    cost = [sum(levels[j].save_s for j in range(prev + 1, i + 1)) for prev, i in zip([-1, *used], used, strict=False)]
    first, m = _best_pattern(cost, [rate[i] for i in used], step_s)
    intervals: list[float | None] = [None] * len(levels)
    for prev, i, mi in zip([-1, *used], used, m, strict=False):
        for j in range(prev + 1, i + 1):
            intervals[j] = first * mi
    multiples: list[int | None] = [None if p is None else 1 for p in intervals]
    for j in range(1, len(levels)):
        p, q = intervals[j], intervals[j - 1]
        if p is not None and q is not None:
            multiples[j] = round(p / q)
    waste = waste_fraction(levels, rates_per_s, intervals)
    named = {kind: levels[index].name for kind, index in recovers.items()}
    return Pattern(tuple(intervals), tuple(multiples), waste, max(0.0, 1.0 - waste), named)


def _best_pattern(cost: list[float], rate: list[float], step_s: float | None) -> tuple[float, list[int]]:
    """The first interval and the multiples ``m`` (``m[0] = 1``, each a whole multiple of the one before)
    minimising ``A/T + B·T`` with ``A = Σ cost_i/m_i``, ``B = Σ rate_i·m_i/2``: at most three levels (one per
    failure kind). The middle multiple is searched up to a bound; the last is one of the two beside its real
    optimum given the others (``A·B``, and for a given ``T`` the waste, are convex in it); ``T`` is
    ``sqrt(A/B)``, or with ``step_s`` the better of the two whole steps beside it (convex in ``T``)."""
    if len(cost) > len(KINDS):
        raise AssertionError("more levels in use than failure kinds")

    def first(a: float, b: float) -> float:
        t = math.sqrt(a / b)
        if step_s is None:
            return t
        steps = max(1, math.floor(t / step_s))
        return min((s * step_s for s in (steps, steps + 1)), key=lambda u: a / u + b * u)

    if len(cost) == 1:
        return first(cost[0], rate[0] / 2), [1]
    # the multiples the levels would take alone (Young's intervals sqrt(2·C/Λ) against the first's) bound the search
    young = [math.sqrt(2 * c / r) for c, r in zip(cost, rate, strict=True)]
    bound = min(_MAX_MULTIPLE, math.ceil(4 * max(young) / min(young)) + 4)
    best: tuple[float, float, list[int]] = (math.inf, 0.0, [])
    for middle in range(1, bound + 1) if len(cost) == 3 else [1]:
        head = [1, middle][: len(cost) - 1]
        a = sum(c / mi for c, mi in zip(cost, head, strict=False))
        b = sum(r * mi / 2 for r, mi in zip(rate, head, strict=False))
        # (a + c/x)(b + r·x/2) is least at x = sqrt(2·b·c/(a·r)); for a given T, c/(T·x) + r·T·x/2 at young/T
        x = math.sqrt(2 * b * cost[-1] / (a * rate[-1]))
        beside = [x]
        if step_s is not None:  # the whole steps beside T at that x, and the last multiple best for each
            t = math.sqrt((a + cost[-1] / x) / (b + rate[-1] * x / 2))
            beside += [young[-1] / (s * step_s) for s in (max(1, math.floor(t / step_s)), math.ceil(t / step_s))]
        for n in {max(1, f(y / head[-1])) for y in beside for f in (math.floor, math.ceil)}:
            aa, bb = a + cost[-1] / (head[-1] * n), b + rate[-1] * head[-1] * n / 2
            t = first(aa, bb)
            if aa / t + bb * t < best[0]:
                best = (aa / t + bb * t, t, [*head, head[-1] * n])
    return best[1], best[2]


def _is_multiple(p: float, q: float) -> bool:
    n = round(p / q)
    return n >= 1 and math.isclose(p, n * q, rel_tol=1e-9)


def _check_rates(rates_per_s: dict[str, float]) -> None:
    unknown = set(rates_per_s) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown failure kinds {sorted(unknown)} (known: {', '.join(KINDS)})")
    for kind, rate in rates_per_s.items():
        if not (rate >= 0 and math.isfinite(rate)):
            raise ValueError(f"the {kind} failure rate must be a finite number of 0 or more, not {rate}")


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes the memory tier holds on one node: ``own_bytes`` (``slots`` snapshots of each of the node's
    ranks), ``peer_bytes`` (``replicas`` peers' newest committed snapshot), ``node_bytes`` their sum, and
    ``tmpfs_bytes`` the tmpfs's size when known, with ``fits`` (None when the size is unknown)."""

    slots: int
    replicas: int
    per_rank_bytes: int
    own_bytes: int
    peer_bytes: int
    node_bytes: int
    tmpfs_bytes: int | None
    fits: bool | None


def memory_need(
    *, per_rank_bytes: int, ranks_per_node: int, slots: int, replicas: int, tmpfs_bytes: int | None
) -> MemoryNeed:
    """What the memory tier needs on a node: ``slots`` x each local rank's snapshot, plus ``replicas`` x a
    peer node's snapshot (one committed step of each, taken as the same size as this node's)."""
    if slots < 2:
        raise ValueError(f"slots must be at least 2 (MemoryOptions.slots), not {slots}")
    if replicas < 0 or ranks_per_node < 1 or per_rank_bytes < 0:
        raise ValueError("replicas and per_rank_bytes must be 0 or more, ranks_per_node at least 1")
    if tmpfs_bytes is not None and tmpfs_bytes < 0:
        raise ValueError(f"tmpfs_bytes must be 0 or more, not {tmpfs_bytes}")
    snapshot = per_rank_bytes * ranks_per_node
    own, peers = slots * snapshot, replicas * snapshot
    fits = None if tmpfs_bytes is None else own + peers <= tmpfs_bytes
    return MemoryNeed(slots, replicas, per_rank_bytes, own, peers, own + peers, tmpfs_bytes, fits)


def multilevel_table(
    sizes: Sizes,
    tiers: list[TierProfile],
    memory: TierProfile,
    *,
    rates_per_s: dict[str, float],
    ranks_per_node: int,
    replicas: int,
    slots: int,
    tmpfs_bytes: int | None,
    step_s: float | None = None,
) -> dict[str, Any]:
    """What ``tiercheck plan`` prints for several tiers, as a JSON-serializable dict. The levels: the memory
    tier (``memory``'s bandwidth per GPU: each GPU copies its share, :func:`tiercheck.cli.sizing.staging_s`),
    the first of ``tiers`` that is a node's own (its disk) and the first shared one (the remote), each with
    its save and restore time from :func:`tiercheck.cli.sizing.times`. The memory and disk levels survive a
    crash, and a node loss too with ``replicas`` (copies on other nodes); the shared tier survives all.
    ``without_memory``: the best pattern of the slower levels alone, for comparison."""
    node_tier = next((t for t in tiers if not t.shared), None)
    shared_tier = next((t for t in tiers if t.shared), None)
    local = frozenset({"crash", "node"} if replicas > 0 else {"crash"})
    levels = [Level(name="memory", save_s=staging_s(sizes, memory),
                    restore_s=sizes.per_rank_bytes / memory.read_bytes_per_s, survives=local)]  # fmt: skip
    for tier, survives in ((node_tier, local), (shared_tier, frozenset(KINDS))):
        if tier is not None:
            save_s, restore_s = times(sizes, tier)
            levels.append(Level(name=tier.name, save_s=save_s, restore_s=restore_s, survives=survives))
    pattern = optimal_pattern(levels, rates_per_s, step_s=step_s)
    rows = [
        {**asdict(level), "survives": [k for k in KINDS if k in level.survives], "interval_s": interval,
         "multiple": multiple, "steps": None if interval is None or step_s is None else round(interval / step_s)}
        for level, interval, multiple in zip(levels, pattern.intervals_s, pattern.multiples, strict=True)
    ]  # fmt: skip
    try:
        slower = optimal_pattern(levels[1:], rates_per_s, step_s=step_s) if len(levels) > 1 else None
    except ValueError:  # a kind only the memory tier survives (a crash, with no disk tier): nothing to compare
        slower = None
    need = memory_need(per_rank_bytes=sizes.per_rank_bytes, ranks_per_node=ranks_per_node, slots=slots,
                       replicas=replicas, tmpfs_bytes=tmpfs_bytes)  # fmt: skip
    return {
        "multilevel": {
            "rates_per_s": dict(rates_per_s),
            "replicas": replicas,
            "step_s": step_s,
            "levels": rows,
            "recovers": pattern.recovers,
            "waste_fraction": pattern.waste_fraction,
            "goodput": pattern.goodput,
            "without_memory": None if slower is None else
            {"waste_fraction": slower.waste_fraction, "goodput": slower.goodput},
            "memory_tier": asdict(memory),
        },
        "memory": asdict(need),
    }
