"""Sets of ranks in a few numbers, whatever their size: the ranks a message names (who needs a
chunk, who receives it) travel in one message to every rank concerned, and the regular layouts of
a training job make them regular.

A set is a list of runs ``(start, length, stride, count)``: ``count`` blocks of ``length``
consecutive ranks, the first at ``start``, each ``stride`` after the last. The data-parallel
replicas of one shard (ranks ``r, r + 128, r + 256, ...``) are one run; the eight tensor-parallel
ranks of every replica (``8`` consecutive ranks every ``128``) are one run too. An irregular set
costs a run per block of consecutive ranks, never more than the ranks themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from tiercheck.cluster.wire import as_list, as_rank, bad

Run = tuple[int, int, int, int]  # start, length, stride, count


@dataclass(frozen=True, slots=True)
class RankSet:
    """A set of ranks as runs (see the module docstring); made by ``of``, read back by ``from_json``."""

    runs: tuple[Run, ...] = ()

    @classmethod
    def of(cls, ranks: Iterable[int]) -> RankSet:
        blocks: list[tuple[int, int]] = []  # maximal runs of consecutive ranks
        for r in sorted(set(ranks)):
            if blocks and blocks[-1][0] + blocks[-1][1] == r:
                blocks[-1] = (blocks[-1][0], blocks[-1][1] + 1)
            else:
                blocks.append((r, 1))
        runs: list[Run] = []
        for start, length in blocks:
            if runs:
                s, n, stride, count = runs[-1]
                if n == length and (start == s + stride * count if count > 1 else True):
                    runs[-1] = (s, n, start - s if count == 1 else stride, count + 1)
                    continue
            runs.append((start, length, length, 1))
        return cls(tuple(runs))

    def __iter__(self) -> Iterator[int]:
        for start, length, stride, count in self.runs:
            for k in range(count):
                yield from range(start + k * stride, start + k * stride + length)

    def __len__(self) -> int:
        return sum(length * count for _, length, _, count in self.runs)

    def __contains__(self, rank: object) -> bool:
        if not isinstance(rank, int):
            return False
        for start, length, stride, count in self.runs:
            if rank >= start:
                k = min((rank - start) // stride, count - 1)
                if rank < start + k * stride + length:
                    return True
        return False

    def to_json(self) -> list[list[int]]:
        return [list(run) for run in self.runs]

    @classmethod
    def from_json(cls, doc: object, *, where: str, field: str, world: int) -> RankSet:
        """The set a message names, each run checked: blocks that do not overlap, and every rank
        below ``world`` (which bounds what the set can cost to expand)."""
        runs: list[Run] = []
        for i, item in enumerate(as_list(doc, where, field)):
            f = f"{field}[{i}]"
            values = as_list(item, where, f, 4)
            start, length, stride, count = (as_rank(v, where, f"{f}[{j}]") for j, v in enumerate(values))
            if length < 1 or count < 1 or stride < length or start + stride * (count - 1) + length > world:
                raise bad(where, f, f"a run of ranks below {world}", item)
            runs.append((start, length, stride, count))
        return cls(tuple(runs))
