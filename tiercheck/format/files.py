"""Which files of a step directory belong to a set of saving ranks: the one rule that drain
(``tiering.upload``), copy (``tiering.transfer``) and peer replication (``tiering.replication``)
all select by, so that a file is never uploaded by one and left behind by another.

No torch here, and no I/O: the callers list the directory and pass the listing and the ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tiercheck.format.paths import rank_files


def files_of_ranks(listing: Mapping[str, int], ranks: Iterable[int]) -> dict[str, int]:
    """The files of saving ranks ``ranks`` among a step directory's ``listing`` (path inside the
    step -> size), with their sizes, in rank order and, within a rank, in ``paths.rank_files``'s.

    A file counts only if its path is exactly one of the five names ``paths.rank_files`` gives
    one of these ranks: its manifest part, arrays shard, owners file, reference map and pack, the
    names the manifest index spells as its ``parts``. That is the one name pattern trusted here;
    nothing is matched by a looser one (a prefix, a glob), and being in the directory makes nothing
    a rank's file. A file so named that the listing lacks is not returned (a rank writes no owners
    file when it coordinated no array, say): whether it must be there is the caller's check.

    Everything else in the directory is excluded, whatever its name, and stays where it is: the
    commit marker and ``manifest.json`` (each caller writes those itself, last), the tier's own
    bookkeeping (``__drained.*``, ``__copying.*``, peer ``REPLICA-*`` markers), temporaries of a
    write in flight (``.name.tmp-*``), the files of other ranks (a peer's replica here is its
    own node's to drain), a file named like a chunk (no step of this format has one: every chunk
    is in its writer's pack), and anything else put there. None of them is drained,
    copied or replicated; they go when the step directory is deleted.
    """
    named = [f for r in sorted(set(ranks)) for f in rank_files(r)]
    return {f: listing[f] for f in named if f in listing}
