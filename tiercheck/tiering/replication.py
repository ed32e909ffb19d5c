"""Peer replication: each node's committed local step, copied to ``replicas`` other nodes' local tiers.

At scale the common failure is one lost node. Its ranks' files then exist only on the remote tier, the
slowest and most shared one. With replication, the first rank of each node (its leader) sends the files its
node wrote for a step, once the step is committed, to the leaders of ``replicas`` other nodes, chosen
``jump`` nodes apart (as NVIDIA resiliency-ext's ``replication_jump``: with nodes numbered by their first
rank, a jump of the number of nodes per rack puts every copy in another rack). A receiving node stores them
in its own directory of that step, under their own names (each saving rank's manifest parts and pack, as
written: the same chunks and CRCs), and makes them count with a marker of their own,
``REPLICA-<first rank>.json``, written last, once every file is durable and its CRC32C checked against the
sender's. A step directory thus holds its node's files, plus the peers' whose markers it holds; restore
counts both (``held_steps``) and prefers a node's own files, then a peer's copy, then the remote tier.

Transport: leaders talk over gloo process groups of tiercheck's own, one per sending and receiving pair of
nodes (made from the store at start, never the training's group), from a background thread; every leader
replicates the same committed steps in the same order, so the pairs stay in step: only the steps every node
commits together (a save's vote) are submitted, never a step one node commits alone (a step persisted from
memory: ``TierManager.persisted``), and work of the pairs' own (``in_turn``: a restored step made whole
again, ``tiering.whole_again``) is queued by every leader at the same place. Memory: one piece
(``piece_bytes``) per pair in flight, read from and written to disk. A pair that fails (a peer died, a
timeout) is reported and left out for the rest of the run; the step stays committed and restorable from
its own node or the remote tier. Steps committed before a restart are not replicated again.

Nodes are numbered once per job, as they join (``cluster.nodes.join_nodes``); each leader knows only its own
``replicas`` peers each way.
"""


from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tiercheck.cluster.coordination import Coordinator, _own_client
from tiercheck.cluster.keys.tiering import pair_prefix
from tiercheck.cluster.nodes import Nodes
from tiercheck.cluster.wire import as_dict, as_int, as_list, as_rank, as_ranks, as_str, loads
from tiercheck.errors import CorruptCheckpointError, TiercheckError
from tiercheck.format.codec import checksum
from tiercheck.format.files import files_of_ranks
from tiercheck.format.paths import COMMIT_FILE, replica_marker, step_dir
from tiercheck.format.replicas import MAX_FILES_PER_RANK, Replica, placement
from tiercheck.format.steps import read_marker
from tiercheck.options import ReplicationOptions
from tiercheck.tiering.transfer import _Ring
from tiercheck.tiering.turns import Turns
from tiercheck.tiers.local import LocalTier

log = logging.getLogger("tiercheck")


def replica_files(tier: LocalTier, step: int, ranks: Iterable[int]) -> list[tuple[str, int]]:
    """The files of saving ranks ``ranks`` of ``step`` that a replica of them carries, by name and
    size: the ranks' files as the manifest names them (``files.files_of_ranks``), nothing else."""
    return list(files_of_ranks(tier.sizes(step_dir(step)), ranks).items())


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaHeader:
    """What a sending leader tells a receiving one before a step's files: the step, the saving ranks
    whose files they are and the job's world size, the sending node, and each file by name and size
    (in the order they follow). Checked field by field (``cluster.wire``) before anything is kept."""

    step: int
    ranks: tuple[int, ...]
    world_size: int
    node: str
    files: tuple[tuple[str, int], ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "ranks": list(self.ranks),
            "world_size": self.world_size,
            "node": self.node,
            "files": [[n, s] for n, s in self.files],
        }

    @classmethod
    def from_json(cls, doc: object, *, where: str) -> ReplicaHeader:
        d = as_dict(doc, where, "replica header")
        files = []
        for i, f in enumerate(as_list(d.get("files"), where, "files")):
            name, size = as_list(f, where, f"files[{i}]", 2)
            files.append((as_str(name, where, f"files[{i}][0]"), as_rank(size, where, f"files[{i}][1]")))
        return cls(
            step=as_int(d.get("step"), where, "step"),
            ranks=as_ranks(d.get("ranks"), where, "ranks"),
            world_size=as_int(d.get("world_size"), where, "world_size"),
            node=as_str(d.get("node"), where, "node"),
            files=tuple(files),
        )


class _Pair:
    """A gloo group of two leaders: rank 0 sends a step's files to rank 1, which acknowledges them."""

    def __init__(self, store: Any, name: str, rank: int, timeout_s: float, peer: int) -> None:
        self.peer = peer  # the other node's number
        self.broken: str | None = None
        prefix = dist.PrefixStore(name, store)
        self.group = dist.ProcessGroupGloo(prefix, rank, 2, timedelta(seconds=timeout_s))
        self.other = 1 - rank

    def send(self, t: torch.Tensor) -> None:
        self.group.send([t], self.other, 0).wait()  # type: ignore[attr-defined]

    def recv(self, t: torch.Tensor) -> None:
        self.group.recv([t], self.other, 0).wait()  # type: ignore[attr-defined]

    def send_bytes(self, data: bytes) -> None:
        self.send(torch.tensor([len(data)], dtype=torch.int64))
        if data:
            self.send(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def recv_bytes(self, limit: int) -> bytes:
        n = torch.empty(1, dtype=torch.int64)
        self.recv(n)
        size = int(n.item())
        if not 0 <= size <= limit:
            raise CorruptCheckpointError(f"node {self.peer} announced {size} bytes of header (at most {limit})")
        buf = torch.empty(size, dtype=torch.uint8)
        if size:
            self.recv(buf)
        return buf.numpy().tobytes()


class Replicator(Turns):
    """One per rank; only a node's leader sends and receives. ``submit`` each step as it commits."""

    what = "replication"

    def __init__(
        self,
        tier: LocalTier,
        options: ReplicationOptions,
        *,
        coord: Coordinator,
        nodes: Nodes,
        node: str,
        name: str = "replicate",
    ) -> None:
        super().__init__(every=options.every)
        self.tier = tier
        self.options = options
        self.node = node
        self.leader = coord.rank == nodes.leader
        number = nodes.number if self.leader else None
        self.number = number
        self.targets: list[_Pair] = []
        self.sources: list[_Pair] = []
        self.status: dict[str, Any] = {
            "replicas": options.replicas,
            "node": number,
            "to": [],
            "from": [],
            "replicated": 0,
            "received": 0,
            "failed": 0,
            "last_replicated": None,
            "last_error": None,
            "bytes_sent": 0,
            "bytes_received": 0,
            "last_replication_s": None,
        }
        if not self.leader or number is None:
            return
        targets, sources = placement(number, nodes.count, options)
        self.status["to"], self.status["from"] = targets, sources
        wanted = [(pair_prefix(coord, name, number, t), 0, t) for t in targets] + [
            (pair_prefix(coord, name, s, number), 1, s) for s in sources]  # fmt: skip

        def connect(w: tuple[str, int, int]) -> _Pair:  # a store client each: they are not shared between threads
            return _Pair(_own_client(coord.store, options.timeout_s), w[0], w[1], options.timeout_s, w[2])

        # Each group's rendezvous waits for its peer: make them all at once, so no order can deadlock.
        with ThreadPoolExecutor(len(wanted), thread_name_prefix="tiercheck-replica-connect") as pool:
            pairs = list(pool.map(connect, wanted))
        self.targets, self.sources = pairs[: len(targets)], pairs[len(targets) :]
        self._start("tiercheck-replicate")

    # ---------------------------------------------------------------------------- one step

    def _work(self, step: int) -> bool:
        start = time.monotonic()
        d = step_dir(step)
        marker = read_marker(self.tier, step)
        files = replica_files(self.tier, step, marker.ranks)
        header = ReplicaHeader(
            step=step, ranks=tuple(marker.ranks), world_size=marker.world_size, node=self.node, files=tuple(files)
        )
        pairs = [p for p in self.targets + self.sources if p.broken is None]
        own = set(marker.ranks)
        with ThreadPoolExecutor(max(1, len(pairs)), thread_name_prefix="tiercheck-replica") as pool:
            sends = [(p, pool.submit(self._send, p, d, header)) for p in self.targets if p.broken is None]
            recvs = [(p, pool.submit(self._receive, p, step, own)) for p in self.sources if p.broken is None]
        ok = True
        for kind, jobs in (("sending to", sends), ("receiving from", recvs)):
            for pair, job in jobs:
                error = job.exception()
                if error is None:
                    continue
                ok = False
                pair.broken = f"{type(error).__name__}: {error}"
                self._count("failed", 1)
                self.status["last_error"] = f"step {step}: {kind} node {pair.peer}: {pair.broken}"
                log.warning(
                    "replication: step %d: %s node %d failed, and that pair is left out from now on: %s",
                    step,
                    kind,
                    pair.peer,
                    pair.broken,
                )
        if ok and sends:
            self.status["replicated"] += 1
            self.status["last_replicated"] = step
        self.status["last_replication_s"] = time.monotonic() - start
        log.info("replication: step %d %s in %.2f s", step, "done" if ok else "incomplete", time.monotonic() - start)
        return ok and bool(sends)

    def _send(self, pair: _Pair, d: str, header: ReplicaHeader) -> None:
        pair.send_bytes(json.dumps(header.to_json()).encode())
        self.send_files(pair, d, header.files)

    def send_files(self, pair: _Pair, d: str, files: Iterable[tuple[str, int]]) -> None:
        """Send ``files`` of step directory ``d`` (name, size) in pieces, then their CRC32Cs; wait
        for the peer's acknowledgement (``TiercheckError`` where it kept nothing)."""
        buf = torch.empty(self.options.piece_bytes, dtype=torch.uint8)
        view = memoryview(buf.numpy())  # type: ignore[arg-type]
        crcs = []
        for name, size in files:
            crc = 0
            for offset in range(0, size, len(view)):
                n = min(len(view), size - offset)
                got, _ = self.tier.read_into(f"{d}/{name}", view[:n], offset=offset, length=n)
                if got != n:
                    raise CorruptCheckpointError(f"{self.tier.url}: {d}/{name} shrank while it was replicated")
                crc = checksum(view[:n], crc)
                pair.send(buf[:n])
                self._count("bytes_sent", n)
            crcs.append(crc)
        pair.send(torch.tensor(crcs or [0], dtype=torch.int64))
        ack = torch.zeros(1, dtype=torch.int64)
        pair.recv(ack)
        if ack.item() != 1:
            raise TiercheckError(f"node {pair.peer} could not keep the copy (its log says why)")

    def _receive(self, pair: _Pair, step: int, own: set[int]) -> None:
        where = f"{self.tier.url}: step {step}: replica from node {pair.peer}"
        header = ReplicaHeader.from_json(loads(pair.recv_bytes(1 << 20), where=where), where=where)
        self.receive_replica(pair, step, own, header)

    def receive_replica(self, pair: _Pair, step: int, own: set[int], header: ReplicaHeader) -> None:
        """Receive the files ``header`` names (its ranks' replica of ``step``), keep them where
        they check out (with their replica marker, written last), and acknowledge."""
        d = step_dir(step)
        where = f"{self.tier.url}: step {step}: replica from node {pair.peer}"
        ranks, world, files = list(header.ranks), header.world_size, header.files
        named = {n: s for n, s in files}
        problem = None
        if header.step != step:
            problem = f"the peer sent step {header.step}"
        elif not ranks or not all(0 <= r < world for r in ranks) or own & set(ranks):
            problem = f"ranks {ranks} are out of range or this node's own"
        elif files_of_ranks(named, ranks) != named or len(files) > MAX_FILES_PER_RANK * len(ranks):
            problem = "the peer named files that are not its ranks' files"
        elif not self.tier.exists(f"{d}/{COMMIT_FILE}"):
            problem = "the step is not committed here (deleted, or its save failed on this node)"
        keep = problem is None
        written: list[str] = []
        try:
            crcs, bad = self.receive_files(pair, d, files, keep, written)
            if keep and bad:
                problem, keep = f"CRC32C mismatch in {', '.join(bad)}", False
            if keep:
                self.tier.sync_dirs(d)
                replica = Replica(step, tuple(ranks), world, {n: (s, crcs[n]) for n, s in files}, header.node)
                self.tier.publish(f"{d}/{replica_marker(ranks[0])}", replica.to_bytes())
                self._count("received", 1)
        except BaseException:
            self._discard(d, written)
            raise
        if not keep:
            self._discard(d, written)
            log.warning("%s: not kept: %s", where, problem)
        pair.send(torch.tensor([1 if keep else 0], dtype=torch.int64))

    def receive_files(
        self, pair: _Pair, d: str, files: tuple[tuple[str, int], ...], keep: bool, written: list[str]
    ) -> tuple[dict[str, int], list[str]]:
        """Receive ``files`` (name, size) into step directory ``d`` where ``keep`` (each named in
        ``written`` once begun; else take the bytes and keep nothing), then the sender's CRC32Cs.
        Returns the CRC32C of each file received, and the files whose CRC32C the sender's differs from."""
        # A piece is received into memory the file's writer no longer holds: ``write_stream`` writes
        # up to two pieces while the next is received, and a single buffer received into again
        # changed a piece under its write after its CRC32C was folded (a replica marked whole, and
        # damaged).
        ring = _Ring(self.options.piece_bytes)
        crcs: dict[str, int] = {}
        for name, size in files:
            pieces = self._pieces(pair, ring, size)
            if keep:
                crcs[name] = 0

                def stream(name: str = name, pieces: Iterator[memoryview] = pieces) -> Iterator[memoryview]:
                    for piece in pieces:
                        crcs[name] = checksum(piece, crcs[name])
                        yield piece

                self.tier.write_stream(f"{d}/{name}", stream)
                written.append(name)
            else:
                for _ in pieces:  # the protocol goes on: take the bytes, keep nothing
                    pass
        sent = torch.zeros(max(1, len(files)), dtype=torch.int64)
        pair.recv(sent)
        bad = [n for (n, _), c in zip(files, sent.tolist(), strict=False) if keep and crcs[n] != c]
        return crcs, bad

    def _pieces(self, pair: _Pair, ring: _Ring, size: int) -> Iterator[memoryview]:
        for offset in range(0, size, ring.size):
            n = min(ring.size, size - offset)
            view = ring.take()[:n]
            pair.recv(torch.frombuffer(view, dtype=torch.uint8))
            self._count("bytes_received", n)
            yield view

    def _count(self, key: str, n: int) -> None:
        """Add to a status counter: the sending and receiving threads of a step count at once."""
        with self._cond:
            self.status[key] += n

    def _discard(self, d: str, written: list[str]) -> None:
        for name in written:
            try:
                self.tier.delete(f"{d}/{name}")
            except OSError as e:
                log.warning("replication: could not remove %s/%s: %s", d, name, e)
