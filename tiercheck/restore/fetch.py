"""Round 2 of a restore's planning (``restore.plan``): the manifest files each rank needs, and no
others, from this node's directory, the remote tier, or the store, where the node holding a file
posts it on request (``restore.needed`` asks for them)."""

from __future__ import annotations

from tiercheck.cluster.coordination import Exchange
from tiercheck.cluster.job import Job
from tiercheck.cluster.keys.restore import fetch_round_scope, fetch_scope, manifest_file_key, want_key
from tiercheck.errors import CorruptCheckpointError, TiercheckError
from tiercheck.format.manifest import ManifestIndex, parse_manifest_doc
from tiercheck.format.paths import step_dir
from tiercheck.restore.holders import FileId, Step, holders_of, read_manifest_file


def fetch(job: Job, root: str, st: Step, wanted: set[FileId], *, what: str) -> Exchange[dict[FileId, bytes]]:
    """Round 2 (run once per kind of file a rank wants, ``what``): the manifest files in ``wanted``,
    as stored.

    A shard that does not exist (its rank coordinated nothing) comes back empty. A file that
    cannot be read fails every rank (the reader with its own error, the others quoting it)."""
    coord, tier, nodes, remote = job.coord, job.tier, job.nodes, job.remote
    name = fetch_scope(root, what)
    d = step_dir(st.step)
    got: dict[FileId, bytes] = {}
    away = sorted(f for f in wanted if f[1] not in st.here)
    own: TiercheckError | None = None
    try:
        for f in sorted(wanted - set(away)):
            got[f] = read_manifest_file(tier, d, f)
        if st.from_remote and remote is not None:  # from a node where one holds them (a peer's copy too)
            held = holders_of(coord, root, {f[1] for f in away}, remote=True)
            for f in [f for f in away if f[1] not in held]:
                got[f] = read_manifest_file(remote, d, f)
            away = [f for f in away if f[1] in held]
    except TiercheckError as e:
        own, away = e, []
        coord.report(name, e)
    coord.multi_set({want_key(coord, name, *f): "1" for f in away})
    yield coord.arrive(fetch_round_scope(name, "wanted"), what="every rank to ask for the manifest files it needs")
    served: list[str] = []
    if coord.rank == nodes.leader:
        claimed = holders_of(coord, root, st.here, remote=st.from_remote)
        for w in sorted(st.here):
            if claimed.get(w) != list(nodes.ranks):
                continue  # another node serves this rank's files
            for kind in ("rank", "arrays"):
                want = want_key(coord, name, kind, w)
                if coord.has(want):
                    file_key = manifest_file_key(coord, name, kind, w)
                    try:
                        data = read_manifest_file(tier, d, (kind, w))
                    except TiercheckError as e:  # still answer: the asking rank must not wait forever
                        own, data = own or e, b""
                        coord.report(name, e)
                    coord.set(file_key, data)
                    served += [want, file_key]
    yield coord.arrive(fetch_round_scope(name, "served"), what="the nodes holding the step to share manifest files")
    coord.check(name, own, shared=(CorruptCheckpointError,))
    files = [manifest_file_key(coord, name, *f) for f in away]
    if files:  # served before the barrier; a file no node served fails within timeout_s, not the store's
        coord.wait(files, what="the manifest files this rank asked other nodes for")
    for f, value in zip(away, coord.multi_get(files), strict=True):
        got[f] = value
    yield coord.arrive(fetch_round_scope(name, "fetched"), what="every rank to read the manifest files it asked for")
    coord.delete(*served)
    return got


def index_of(st: Step, *, where: str) -> ManifestIndex:
    return ManifestIndex.from_doc(parse_manifest_doc(st.index, where=where), where=where)
