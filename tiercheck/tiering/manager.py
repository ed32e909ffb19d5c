"""The tiers above a node's local one, as one Checkpointer runs them: the remote tier's drain,
peer replication, and copying a step restored from the remote tier back to the local one. Each
committed step is handed here (``committed``); retention asks which steps these still need
(``pinned``); ``close`` stops them and says which steps were not drained."""

from __future__ import annotations

import logging
import socket
import threading
from concurrent.futures import Future
from typing import Any

from tiercheck.cluster.coordination import Coordinator
from tiercheck.cluster.nodes import Nodes
from tiercheck.errors import InvalidArgumentError, RemoteStorageError
from tiercheck.humanize import fmt_steps
from tiercheck.options import DrainOptions, ReplicationOptions
from tiercheck.tiering.drain import Drainer
from tiercheck.tiering.replication import Replicator
from tiercheck.tiering.retention import LocalSteps
from tiercheck.tiering.transfer import copy_step
from tiercheck.tiers.base import Tier
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.remote import open_tier

log = logging.getLogger("tiercheck")


class TierManager:
    """Drain to ``remote`` (a URL or a Tier; None: no remote tier) and replicate to peers
    (``replication``; None: off) the steps committed on ``tier``, this node's local tier. Only the
    node's leader uploads and copies; every rank learns the outcome."""

    def __init__(
        self,
        tier: LocalTier,
        local: LocalSteps,
        *,
        remote: str | Tier | None,
        remote_options: dict[str, Any] | None,
        drain: DrainOptions,
        replication: ReplicationOptions | None,
        coord: Coordinator,
        nodes: Nodes,
        take_over: bool = False,
    ) -> None:
        leader = nodes.leader == coord.rank  # the node's first rank uploads and copies
        self.tier, self.local, self.options, self.leader = tier, local, drain, leader
        self.remote: Tier | None = None
        self.drainer: Drainer | None = None
        self.replicator: Replicator | None = None
        self._populate: threading.Thread | None = None
        self._failures_seen = 0
        if remote is not None:
            self.remote = (
                remote
                if isinstance(remote, Tier)
                else open_tier(
                    remote,
                    storage_options=remote_options,
                    retry=drain.retry,
                    part_bytes=drain.part_bytes,
                    part_concurrency=drain.part_concurrency,
                )
            )
            self.drainer = Drainer(
                tier,
                self.remote,
                drain,
                coord=coord.connect_again(),
                nodes=nodes,
                on_settled=local.retain,
                take_over=take_over,
            )
            if leader:
                self.drainer.resume(local.sorted())
        if replication is not None and nodes.count > 1:
            where = f"{socket.gethostname()}:{tier.root}"  # named in the replicas it sends
            self.replicator = Replicator(tier, replication, coord=coord, nodes=nodes, node=where)
        elif replication is not None:
            log.warning("replication is off: it needs two nodes or more, and this job has one")
        local.pinned = self.pinned

    def pinned(self) -> set[int]:
        """Steps local retention keeps for now: still to be drained or replicated."""
        pinned = self.drainer.pinned() if self.drainer is not None else set()
        return pinned | (self.replicator.pinned() if self.replicator is not None else set())

    def committed(self, step: int, replicated: Future[bool], drained: Future[bool], *, save: str | None = None) -> None:
        """``step`` is committed locally: replicate and drain it (or say that nothing will).
        ``save``: this run saved it (``own``)."""
        if self.replicator is not None:
            self.replicator.submit(step, replicated)
        else:
            replicated.set_result(False)
        if self.drainer is not None:
            if save is not None:
                self.drainer.own(step, save)
            self.drainer.submit(step, drained)
        else:
            drained.set_result(False)

    def persisted(self, step: int, drained: Future[bool]) -> None:
        """``step``, restored from the memory tier, is now committed locally on this node alone (each
        node persists its own, when it can): drained by policy, never replicated to peers' local
        tiers. Replication pairs every leader's steps in one order; a step that only some nodes
        commit, or at different times, would leave a peer waiting on a copy never sent. Its copies
        on peers are its memory tier's (``tiering.memory_peers``, made whole after a replacement)."""
        if self.drainer is not None:
            self.drainer.submit(step, drained)
        else:
            drained.set_result(False)

    def own(self, step: int, save: str | None) -> None:
        """This run restored ``step`` (the save ``save``): it is its lineage's (``Drainer.own``)."""
        if self.drainer is not None:
            self.drainer.own(step, save)

    def populate(self, step: int) -> None:
        """Copy ``step``, restored from the remote tier, into the local tier in the background,
        so that the next restart reads it locally."""
        self._populate = threading.Thread(target=self._populate_run, args=(step,), name="tiercheck-populate")
        self._populate.daemon = True
        self._populate.start()

    def _populate_run(self, step: int) -> None:
        assert self.remote is not None
        try:
            copy_step(self.remote, self.tier, step, concurrency=self.options.concurrency)
        except Exception as e:  # the restore succeeded; a failed copy only costs the next restart
            log.error("could not copy step %d from %s to %s: %s", step, self.remote.url, self.tier.url, e)
            return
        self.local.add(step)

    def part_stats(self) -> dict[str, int]:
        """The remote tier's bound on memory held in parts (uploads, ranged reads) and its peak."""
        bound = getattr(self.remote, "part_buffer_bytes", None)
        if bound is None:  # no remote tier, or one that does not move objects in parts
            return {}
        peak = getattr(self.remote, "counters", {}).get("part_bytes_peak", 0)
        return {"drain_part_buffer_bytes": bound, "drain_part_bytes_peak": peak}

    def wait_drained(self, timeout: float | None) -> dict[str, Any]:
        """See ``Checkpointer.drain``."""
        if self.drainer is None:
            raise InvalidArgumentError("this Checkpointer has no remote tier (pass remote=URL)")
        if not self.drainer.wait(timeout):
            raise TimeoutError(f"drains still running after {timeout} s")
        status = self.drainer.snapshot()
        if status["failed"] > self._failures_seen:
            self._failures_seen = status["failed"]
            raise RemoteStorageError(f"draining to {status['url']} failed: {status['last_error']}")
        return status

    def status(self) -> dict[str, Any]:
        return {
            "remote": self.drainer.snapshot() if self.drainer is not None else None,
            "replication": dict(self.replicator.status) if self.replicator is not None else None,
        }

    def close(self, *, drain: bool, timeout: float | None) -> list[int]:
        """Stop the background work (see ``Checkpointer.close``); the committed steps not drained."""
        if self._populate is not None:
            self._populate.join(timeout)
        if self.replicator is not None:
            self.replicator.close(timeout)
        undrained = self.drainer.close(drain=drain, timeout=timeout) if self.drainer is not None else []
        if undrained and drain and self.remote is not None:
            log.warning(
                "closing with step(s) %s not drained to %s; they stay in %s, and the next run with this "
                "remote tier (or `tiercheck drain %s %s`) drains them",
                fmt_steps(undrained),
                self.remote.url,
                self.tier.url,
                self.tier.url,
                self.remote.url,
            )
        return undrained
