"""Peers' memory: each node's committed memory steps copied to ``replicas`` other nodes' memory tiers,
or protected by parity over groups of nodes (``ReplicationOptions.parity``: ``tiering.parity``, the
same thread and slot rule; a replaced node rebuilds its files at restore, ``tiering.rebuild``).

The transport, the placement (``jump`` nodes apart), the checks and the markers are peer
replication's (``tiering.replication``), run by a ``Replicator`` of its own over the memory tier's
directory: a node's files of a step land in the peers' memory directories of that step, counted by
a replica marker written last, once every file is whole and its CRC32C checked. A replaced node,
whose tmpfs is empty, then restores from a peer's memory (the restore counts replica markers as it
does on the local tier); after that restore, the step is made whole again on every node
(``tiering.whole_again``, run in its turn on the same thread, over the same pairs).

A slot is never reused while the step it holds is being copied: every rank of the node waits, before
it withdraws that step, until its node's leader says the copy is over (a store key per step and
node). So the bytes the leader sends are the committed ones, and a peer's copy lands in a step its
own ranks have not withdrawn. The wait is the bound: the memory tier holds ``slots`` snapshots of its
own and ``replicas`` of its peers', and saves slow to the pace of the copies rather than outrun it.
"""

from __future__ import annotations

import functools
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tiercheck.cluster.coordination import Coordinator
from tiercheck.cluster.keys.tiering import copies_done_key, copies_seen_key
from tiercheck.cluster.nodes import Nodes
from tiercheck.options import ReplicationOptions
from tiercheck.tiering.parity import ParityGroup
from tiercheck.tiering.persisting import Persisting
from tiercheck.tiering.rebuild import Rebuild, Trust, rebuild
from tiercheck.tiering.replication import Replicator
from tiercheck.tiering.whole_again import MakeWhole, WholeAgain
from tiercheck.tiers.local import LocalTier

NO_PARITY: dict[str, Any] = {"memory_parity_held_bytes": None, "memory_protected_step": None}
NAME = "memory-replicate"  # the store keys' scope: apart from the local tier's replication


class MemoryPeers:
    """One per rank: the node's leader copies; every rank waits for the copies before reusing a slot."""

    def __init__(self, tier: LocalTier, options: ReplicationOptions, *, coord: Coordinator, nodes: Nodes) -> None:
        self.nodes = nodes
        self.leader = coord.rank == nodes.leader
        self.timeout_s = 2 * options.timeout_s + 60  # a copy that hangs ends at its pair's timeout, and says so
        where = f"{socket.gethostname()}:{tier.root}"  # named in the replicas it sends
        self.parity = options.parity is not None  # parity over groups of nodes instead of copies (tiering.parity)
        self.replicator: Replicator | ParityGroup
        if options.parity is not None:
            self.replicator = ParityGroup(tier, options, coord=coord, nodes=nodes)
        else:
            self.replicator = Replicator(tier, options, coord=coord, nodes=nodes, node=where, name=NAME)
        self._signal = coord.connect_again() if self.leader else None  # the copy's thread (or the commit's)
        self._waiter = coord.connect_again()  # the stager's thread
        self._whole_coord = coord.connect_again() if self.leader else None  # the copies' thread: whole_again
        self._restores = 0  # restores from memory: each one's keys apart
        self._lock = threading.Lock()
        self._sent: set[int] = set()  # steps this run committed whose copies a slot's reuse waits for

    def _key(self, step: int) -> str:
        return copies_done_key(self._waiter, NAME, self.nodes.leader, step)

    def committed(self, step: int) -> None:
        """``step`` is committed in memory (every rank of the node calls it): its copies begin."""
        with self._lock:
            self._sent.add(step)
        if self.leader:
            done: Future[bool] = Future()
            done.add_done_callback(functools.partial(self._copied, step))
            self.replicator.submit(step, done)

    def make_whole(self, step: int, job: Callable[[], bool] | None, done: Future[bool]) -> None:
        """After a restore of ``step`` from memory (every rank of the node calls it): the leader runs
        ``job`` (``tiering.whole_again``) in its turn on the copies' thread, and until it is over no
        rank withdraws the step or reuses its slot, as for a step's copies."""
        with self._lock:
            self._sent.add(step)
        if self.leader:
            assert job is not None
            done.add_done_callback(functools.partial(self._copied, step))
            self.replicator.in_turn(step, job, done)

    def whole_again(
        self,
        step: int,
        rebuilt: Future[bool] | None,
        persisting: Persisting | None,
        *,
        owner: Callable[[str | None], None],
        where: str,
    ) -> WholeAgain:
        """The leader's ``make_whole`` of ``step``, restored from memory: ``rebuilt`` (this node
        lacked its own files: it gets them back, then ``persisting`` copies them to ``where``, its
        local directory) or None (it held them); ``owner`` names the memory's lineage."""
        coord = self._whole_coord
        assert coord is not None and isinstance(self.replicator, Replicator)
        self._restores += 1

        def persisted() -> bool:
            return persisting is not None and persisting.wait() and bool(persisting.persisted)

        job = MakeWhole(self.replicator, coord, step, f"r{self._restores}", node=self.nodes.number,
                        first=self.nodes.leader, count=self.nodes.count, rebuilt=rebuilt or Future(),
                        persisted=persisted, owner=owner)  # fmt: skip
        done: Future[bool] = Future()
        state = WholeAgain(job, done, replaced=rebuilt is not None, where=where)
        self.make_whole(step, job, done)
        return state

    def rebuild(self, trust: Trust, owner: Callable[[str | None], None], requested: int | None) -> Rebuild | None:
        """With parity: this node's memory step rebuilt from its group where it lacks one its group
        protected (``tiering.rebuild``; every leader calls it at a restore, and waits for it). None:
        no rebuild in this node's group (and on ranks other than the leader)."""
        group = self.replicator
        if not self.leader or not isinstance(group, ParityGroup):
            return None
        done: Future[bool] = Future()
        out: list[Rebuild | None] = [None]

        def job() -> bool:
            out[0] = rebuild(group, trust, owner, requested)
            return out[0] is not None

        group.in_turn(-1, job, done)
        done.result()
        return out[0]

    def reprotect(self, step: int, pending: Rebuild | None) -> None:
        """After a restore of ``step`` from memory, with parity (every rank of the node calls it): the
        leader runs the rebuilt members' parity (``pending``, where this node's group rebuilt
        ``step``) in its turn on the group's thread, the slot of ``step`` kept until it is over."""
        job = pending.parity if pending is not None and pending.step == step else (lambda: True)
        self.make_whole(step, job if self.leader else None, Future())

    def parity_stats(self) -> dict[str, Any]:
        """``stats()``'s parity entries: the bytes of parity this node's memory holds and the newest
        step its group protected this run (its leader's; None on other ranks and without parity)."""
        group = self.replicator
        if not isinstance(group, ParityGroup) or not self.leader:
            return NO_PARITY
        return {"memory_parity_held_bytes": group.held_bytes(), "memory_protected_step": group.protected}

    def _copied(self, step: int, _: Future[bool]) -> None:
        """Copied, failed (reported by the replicator), or not one ``ReplicationOptions.every`` selects."""
        assert self._signal is not None
        with self._lock:
            self._signal.set(self._key(step), "1")

    def before_reuse(self, step: int) -> None:
        """Wait until the node's copies of ``step`` are over: its slot is about to be reused."""
        with self._lock:
            if step not in self._sent:
                return
            self._sent.discard(step)
        key = self._key(step)
        what = f"the copies of memory step {step} to peers' memory (a slot of it is reused next)"
        self._waiter.wait([key], what=what, timeout_s=self.timeout_s)
        if self._waiter.add(copies_seen_key(self._waiter, NAME, self.nodes.leader, step), 1) == len(self.nodes.ranks):
            self._waiter.delete(key, copies_seen_key(self._waiter, NAME, self.nodes.leader, step))

    def wait(self) -> None:
        """Until every copy begun is over (before a restore withdraws memory steps)."""
        self.replicator.wait()

    def close(self) -> None:
        self.replicator.close()
