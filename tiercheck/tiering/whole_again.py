"""A step restored from memory made whole again on every node: a replaced node's files back in its
own memory, and every node's copies back on ``replicas`` peers.

A replaced node (its tmpfs empty) restores its files of a step from a peer's memory copy; until it
holds them again, that peer is their only holder. After every restore from memory each node's leader
runs ``make_whole`` on its memory tier's replication thread, in its turn among the steps it copies
(``Replicator.in_turn``: every leader queues it at the same place, after the restore), over the same
pairs of leaders:

1. Each leader posts to the store what its memory holds of the step (``Holding``: its own files,
   committed, and whose copies) and reads the posts of the nodes it pairs with (``plan``, the same
   answer on both ends of each pair).
2. A node lacking its own files gets them from the first of its copies' holders that holds them whole
   (its ``targets``, in placement order): the holder sends the files its replica marker names, the
   step's ``manifest.json`` and its own commit marker; the node writes them into its memory step, each
   file's CRC32C checked against the sender's (and the manifest's against the commit marker's), and
   commits the step there with the same marker naming its own ranks, written last. The same save,
   chunks and CRCs as its ranks wrote: ``tiercheck verify`` checks it like any memory step.
3. Every node sends its own files to each of its copies' holders that lacks them (the replicas the
   replaced node held for its peers), as a save's replication does; a node with nothing to send says so
   (an empty header), and the pair goes on.
4. The replaced node persists its files to its local directory (``tiering.persisting``, started by
   ``Memory.after_restore``, waits for step 2) and says when it is whole again; the holders of its
   copies wait for that (at most the pair timeout) before their copy of the step counts as done, so
   their memory steps are neither withdrawn nor their slots reused before (``MemoryPeers``).

A peer that dies ends the copies with it at the pair's timeout; each failure is said, and the step
stays restorable from wherever it still is whole.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from tiercheck.cluster.coordination import Coordinator
from tiercheck.cluster.keys.tiering import whole_done_key, whole_holding_key, whole_left_key
from tiercheck.cluster.wire import as_dict, as_int, as_list, as_rank, as_ranks, as_str, loads
from tiercheck.errors import CorruptCheckpointError, TiercheckError
from tiercheck.format.files import files_of_ranks
from tiercheck.format.manifest import CommitMarker
from tiercheck.format.paths import COMMIT_FILE, MANIFEST_FILE, step_dir
from tiercheck.format.replicas import MAX_FILES_PER_RANK, placement, read_replicas
from tiercheck.format.steps import read_marker
from tiercheck.options import ReplicationOptions
from tiercheck.tiering.replication import ReplicaHeader, Replicator, _Pair, replica_files

log = logging.getLogger("tiercheck")


@dataclass(frozen=True, slots=True, kw_only=True)
class Holding:
    """What a node's memory holds of the step being made whole, as its leader posts it: its node
    number, its first rank (which names its files' replicas), whether its own files are committed
    there, and the first ranks of the peers whose checked replicas it holds."""

    node: int
    first: int
    own: bool
    holds: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "first": self.first, "own": self.own, "holds": list(self.holds)}

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> Holding:
        d = as_dict(doc, where, "holding")
        own = d.get("own")
        if not isinstance(own, bool):
            raise CorruptCheckpointError(f"{where}: own is {own!r}, not true or false")
        return cls(node=as_rank(d.get("node"), where, "node"), first=as_rank(d.get("first"), where, "first"),
                   own=own, holds=as_ranks(d.get("holds"), where, "holds"))  # fmt: skip


def holding(rep: Replicator, step: int, *, node: int, first: int) -> Holding:
    """What ``rep``'s tier holds of ``step``: its own files where it is committed there (their first
    saving rank then as its marker names it, else ``first``, the node's first rank)."""
    try:
        first, own = read_marker(rep.tier, step).ranks[0], True
    except (TiercheckError, OSError):
        own = False
    holds = tuple(sorted(r.ranks[0] for r in read_replicas(rep.tier, step, checked=True))) if own else ()
    return Holding(node=node, first=first, own=own, holds=holds)


@dataclass(frozen=True, slots=True)
class Plan:
    """One leader's part: the node it gets its own files from (``fetch``), the sources it gives
    theirs back to (``give``), the targets it sends its own to (``send``) and the sources whose
    replica it receives (``take``)."""

    fetch: int | None
    give: tuple[int, ...]
    send: tuple[int, ...]
    take: tuple[int, ...]


def needed(me: int, count: int, options: ReplicationOptions) -> list[int]:
    """The nodes whose posts ``plan`` reads for node ``me``: itself, its targets and sources, and
    its sources' targets (who else may give a source its files back)."""
    targets, sources = placement(me, count, options)
    around = [t for s in sources for t in placement(s, count, options)[0]]
    return sorted({me, *targets, *sources, *around})


def plan(me: int, posts: dict[int, Holding], count: int, options: ReplicationOptions) -> Plan:
    """Node ``me``'s part in making the step whole (``posts``: those ``needed`` names)."""

    def giver(n: int) -> int | None:  # the first holder of n's copy, in placement order
        return next((t for t in placement(n, count, options)[0] if posts[n].first in posts[t].holds), None)

    targets, sources = placement(me, count, options)
    mine = posts[me]
    return Plan(
        fetch=None if mine.own else giver(me),
        give=tuple(s for s in sources if not posts[s].own and giver(s) == me),
        send=tuple(t for t in targets if mine.first not in posts[t].holds),
        take=tuple(s for s in sources if posts[s].first not in mine.holds),
    )


class MakeWhole:
    """One leader's run of the steps in the module's docstring, for ``step``, on ``rep``'s thread.
    ``rebuilt`` gets whether this node's own files are (again) in its memory; ``persisted`` waits for
    this node's background persist of the step (True: committed on its local directory); ``owner``
    names the memory directory's lineage before a step rebuilt there is committed."""

    def __init__(self, rep: Replicator, coord: Coordinator, step: int, scope: str, *, node: int, first: int,
                 count: int, rebuilt: Future[bool], persisted: Callable[[], bool],
                 owner: Callable[[str | None], None]) -> None:  # fmt: skip
        self.rep, self.coord, self.step, self.node, self.first, self.count = rep, coord, step, node, first, count
        self.scope, self.rebuilt, self.persisted, self.owner = scope, rebuilt, persisted, owner
        self.seconds: float | None = None
        self.whole: bool | None = None  # None: running
        self._posts: dict[int, Holding] = {}


    def __call__(self) -> bool:
        t0 = time.perf_counter()
        try:
            self.whole = self._run()
        finally:
            if not self.rebuilt.done():
                self.rebuilt.set_result(False)
            self.whole = bool(self.whole)
            self.seconds = time.perf_counter() - t0
        return self.whole

    def _run(self) -> bool:
        options, timeout = self.rep.options, self.rep.options.timeout_s
        mine = holding(self.rep, self.step, node=self.node, first=self.first)
        self.coord.set(whole_holding_key(self.coord, self.scope, self.node), json.dumps(mine.to_json()))
        nodes = needed(self.node, self.count, options)
        keys = [whole_holding_key(self.coord, self.scope, n) for n in nodes]
        self.coord.wait(keys, what=f"the peers to say what their memory holds of step {self.step}", timeout_s=timeout)
        where = f"store: step {self.step}: what a peer's memory holds"
        posts = {n: Holding.from_json(loads(raw, where=where), where=where)
                 for n, raw in zip(nodes, self.coord.multi_get(keys), strict=True)}  # fmt: skip
        self._posts = posts
        todo = plan(self.node, posts, self.count, options)
        if mine.own:
            self.rebuilt.set_result(True)
        elif todo.fetch is None:
            log.warning("step %d: no peer holds this node's files of it whole in its memory: it is not made whole "
                        "again on this node", self.step)  # fmt: skip
        ok = self._first(todo)
        if not self.rebuilt.done():
            self.rebuilt.set_result(self._has_own())
        ok = self._second(todo) and ok
        if not mine.own:  # its persist (beside this thread) waited for the first round
            whole = self.rebuilt.result() and self.persisted() and ok
            self.coord.set(whole_done_key(self.coord, self.scope, self.node), "1" if whole else "0")
            ok = whole
        ok = self._wait_whole([s for s in placement(self.node, self.count, options)[1]
                               if not posts[s].own and posts[s].first in mine.holds]) and ok  # fmt: skip
        self._leave()
        return ok

    def _has_own(self) -> bool:
        try:
            read_marker(self.rep.tier, self.step)
        except (TiercheckError, OSError):
            return False
        return True

    def _pairs(self, kind: str, peers: tuple[int, ...]) -> list[_Pair]:
        pairs = {p.peer: p for p in (self.rep.targets if kind == "targets" else self.rep.sources)}
        return [pairs[n] for n in peers if n in pairs and pairs[n].broken is None]

    def _together(self, jobs: Sequence[tuple[str, _Pair, Callable[[_Pair], None]]]) -> bool:
        """Run the pair operations ``jobs`` at once (each end posts them in the same order); a failed
        pair is said and left out from now on, as a step's replication leaves it."""
        if not jobs:
            return True
        with ThreadPoolExecutor(len(jobs), thread_name_prefix="tiercheck-whole") as pool:
            running = [(what, pair, pool.submit(fn, pair)) for what, pair, fn in jobs]
        ok = True
        for what, pair, fut in running:
            error = fut.exception()
            if error is None:
                continue
            ok = False
            pair.broken = f"{type(error).__name__}: {error}"
            log.warning("step %d: %s node %d failed, and that pair is left out from now on: %s", self.step, what,
                        pair.peer, pair.broken)  # fmt: skip
        return ok

    # ------------------------------------------------------------ a replaced node's own files back

    def _first(self, todo: Plan) -> bool:
        fetch = self._pairs("targets", () if todo.fetch is None else (todo.fetch,))
        jobs: list[tuple[str, _Pair, Callable[[_Pair], None]]]
        jobs = [("getting this node's files back from", p, self._get_own) for p in fetch]
        jobs += [("giving its files back to", p, self._give) for p in self._pairs("sources", todo.give)]
        return self._together(jobs)

    def _give(self, pair: _Pair) -> None:
        """Send the peer ``pair.peer`` its own files of the step, from the replica of them held here."""
        d, tier = step_dir(self.step), self.rep.tier
        held = read_replicas(tier, self.step, checked=True)
        replica = next((r for r in held if r.ranks[0] == self._posts[pair.peer].first), None)
        if replica is None:
            pair.send_bytes(b"")  # held no more (withdrawn meanwhile): the peer learns at once
            return
        marker = read_marker(tier, self.step)
        files = [(n, s) for n, (s, _) in sorted(replica.files.items())] + [(MANIFEST_FILE, marker.manifest_size)]
        header = {"step": self.step, "ranks": list(replica.ranks), "world_size": replica.world_size,
                  "files": [[n, s] for n, s in files], "commit": marker.to_bytes().decode()}  # fmt: skip
        pair.send_bytes(json.dumps(header).encode())
        self.rep.send_files(pair, d, files)
        log.info("step %d: gave node %d its files back from its copy in this node's memory", self.step, pair.peer)

    def _get_own(self, pair: _Pair) -> None:
        """Receive this node's own files of the step from the holder of their copy, and commit them."""
        d, tier = step_dir(self.step), self.rep.tier
        where = f"{tier.url}: step {self.step}: this node's files from node {pair.peer}"
        raw = pair.recv_bytes(1 << 20)
        if not raw:
            log.warning("%s: the peer no longer holds them", where)
            return
        doc = as_dict(loads(raw, where=where), where, "header")
        ranks = list(as_ranks(doc.get("ranks"), where, "ranks"))
        files: list[tuple[str, int]] = []
        for i, f in enumerate(as_list(doc.get("files"), where, "files")):
            name, size = as_list(f, where, f"files[{i}]", 2)
            files.append((as_str(name, where, f"files[{i}][0]"), as_rank(size, where, f"files[{i}][1]")))
        marker = CommitMarker.from_bytes(as_str(doc.get("commit"), where, "commit").encode(), where=where)
        world = as_int(doc.get("world_size"), where, "world_size")
        named = {n: s for n, s in files if n != MANIFEST_FILE}
        problem = None
        if as_int(doc.get("step"), where, "step") != self.step or marker.step != self.step:
            problem = "the peer sent another step"
        elif not ranks or ranks[0] != self.first or marker.world_size != world or max(ranks) >= world:
            problem = f"ranks {ranks} are not this node's"
        elif files_of_ranks(named, ranks) != named or len(named) > MAX_FILES_PER_RANK * len(ranks):
            problem = "the peer named files that are not this node's ranks' files"
        elif dict(files).get(MANIFEST_FILE) != marker.manifest_size or len(named) + 1 != len(files):
            problem = "the peer's manifest is not the one its commit marker pins"
        keep = problem is None
        if keep:
            tier.delete(f"{d}/{COMMIT_FILE}")  # whatever a crash left here counts for nothing until committed
        written: list[str] = []
        try:
            crcs, bad = self.rep.receive_files(pair, d, tuple(files), keep, written)
            if keep and (bad or crcs[MANIFEST_FILE] != marker.manifest_crc32c):
                problem, keep = f"CRC32C mismatch in {', '.join(bad) or MANIFEST_FILE}", False
            if keep:
                tier.sync_dirs(d)
                self.owner(marker.lineage)
                tier.publish(f"{d}/{COMMIT_FILE}", replace(marker, ranks=tuple(ranks)).to_bytes())
        except BaseException:
            self.rep._discard(d, written)
            raise
        if not keep:
            self.rep._discard(d, written)
            log.warning("%s: not kept: %s", where, problem)
        pair.send(torch.tensor([1 if keep else 0], dtype=torch.int64))
        if keep:
            log.info("step %d: this node's files are back in its memory (%s), from node %d's copy", self.step,
                     tier.url, pair.peer)  # fmt: skip

    # --------------------------------------------------------------- every node's copies again

    def _second(self, todo: Plan) -> bool:
        jobs: list[tuple[str, _Pair, Callable[[_Pair], None]]]
        jobs = [("sending its files again to", p, self._send_own) for p in self._pairs("targets", todo.send)]
        jobs += [("receiving a copy again from", p, self._take) for p in self._pairs("sources", todo.take)]
        return self._together(jobs)

    def _send_own(self, pair: _Pair) -> None:
        tier = self.rep.tier
        if not self._has_own():
            pair.send_bytes(b"")  # nothing of its own to copy: the peer goes on
            return
        marker = read_marker(tier, self.step)
        files = replica_files(tier, self.step, marker.ranks)
        header = ReplicaHeader(step=self.step, ranks=tuple(marker.ranks), world_size=marker.world_size,
                               node=self.rep.node, files=tuple(files))  # fmt: skip
        self.rep._send(pair, step_dir(self.step), header)

    def _take(self, pair: _Pair) -> None:
        where = f"{self.rep.tier.url}: step {self.step}: replica from node {pair.peer}"
        raw = pair.recv_bytes(1 << 20)
        if not raw:
            log.warning("%s: the peer has no files of its own of the step to copy", where)
            return
        header = ReplicaHeader.from_json(loads(raw, where=where), where=where)
        try:  # this node's saving ranks: no peer's copy may name one
            own = set(read_marker(self.rep.tier, self.step).ranks)
        except (TiercheckError, OSError):
            own = {self._posts[self.node].first}  # none committed here: the copy is not kept anyway
        self.rep.receive_replica(pair, self.step, own, header)

    def _wait_whole(self, replaced: list[int]) -> bool:
        """Wait (at most the pair timeout) until each node in ``replaced`` whose copy this node holds
        says it is whole again: this node's copy of its files stays until then."""
        if not replaced:
            return True
        keys = [whole_done_key(self.coord, self.scope, n) for n in replaced]
        try:
            self.coord.wait(keys, what=f"node(s) {replaced} to be whole again", timeout_s=self.rep.options.timeout_s)
        except TiercheckError as e:
            log.warning("step %d: %s; this node's copies of their files count as done from now on", self.step, e)
            return False
        return all(v == b"1" for v in self.coord.multi_get(keys))

    def _leave(self) -> None:
        """The last leader to leave deletes the posts (each was read by the time its reader left)."""
        left = whole_left_key(self.coord, self.scope)
        if self.coord.add(left, 1) == self.count:
            families = (whole_holding_key, whole_done_key)
            posts = [f(self.coord, self.scope, n) for f in families for n in range(self.count)]
            self.coord.delete(left, *posts)


NOT_WHOLE: dict[str, Any] = {"memory_rereplicate": None, "memory_rereplicated_step": None, "memory_rereplicate_s": None}
"""``WholeAgain.stats()`` where no restore from memory had copies to make whole."""


class WholeAgain:
    """Where a node's ``MakeWhole`` of ``step`` stands (``done``: its result, from the copies' thread):
    for ``Checkpointer.wait()`` and ``stats()`` (``memory_rereplicate``: ``"pending"``, ``"done"``,
    ``"failed"``; ``memory_rereplicated_step``; ``memory_rereplicate_s``), and the log."""

    def __init__(self, job: MakeWhole, done: Future[bool], *, replaced: bool, where: str) -> None:
        self.step, self.job, self.replaced, self.where = job.step, job, replaced, where
        self._done = threading.Event()
        self.ok: bool | None = None
        done.add_done_callback(self._ended)

    def _ended(self, done: Future[bool]) -> None:
        self.ok = done.result()
        if not self.job.rebuilt.done():  # never run (the copies' thread was closed): its persist learns it
            self.job.rebuilt.set_result(False)
        if self.ok and self.replaced:
            log.info("step %d is whole again on this node: memory and %s", self.step, self.where)
        elif self.ok:
            log.info("step %d: its copies on this node and its peers are whole again", self.step)
        else:
            log.warning("step %d is not made whole again on every node (see the warnings above): it stays "
                        "restorable from wherever it is whole", self.step)  # fmt: skip
        self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def stats(self) -> dict[str, Any]:
        if not self._done.is_set():
            return {"memory_rereplicate": "pending", "memory_rereplicated_step": None, "memory_rereplicate_s": None}
        return {"memory_rereplicate": "done" if self.ok else "failed",
                "memory_rereplicated_step": self.step if self.ok else None,
                "memory_rereplicate_s": self.job.seconds}  # fmt: skip
