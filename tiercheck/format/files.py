"""Which files of a step directory belong to a set of saving ranks: the one rule that drain
(``tiering.upload``), copy (``tiering.transfer``) and peer replication (``tiering.replication``)
all select by, so that a file is never uploaded by one and left behind by another.

No torch here, and no I/O: the callers list the directory and pass what the manifest names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tiercheck.format.paths import rank_files


def files_of_ranks(listing: Mapping[str, int], ranks: Iterable[int]) -> dict[str, int]:
    """The files of saving ranks ``ranks`` among a step directory's ``listing`` (path inside the
    step -> size), with their sizes, in the manifest's order.

    A file counts only if the step's manifest names it as one of these ranks' files: nothing is
    trusted by its name pattern or by being there. The manifest index names each saving rank's
    files (its ``parts``: the rank's manifest part, arrays shard, owners file, reference map and
    pack, ``paths.rank_files``). A file the manifest names but the listing lacks is not returned
    (a rank writes no owners file when it coordinated no array, say): whether it must be there is
    the caller's check.

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
