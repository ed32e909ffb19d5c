"""The memory tier's parity: each node's committed memory steps protected by Reed-Solomon parity
held by the other nodes of its group (``ReplicationOptions(parity=ParityOptions(...))``), instead of
whole copies on peers. The layout (groups, rotated stripes, the record) is ``format.parity``'s.

After a save commits in memory, each node's leader codes the step on its background thread, in turn
with the other leaders of its group (every leader submits the same steps in the same order):

1. The leaders post the step, its save and the size of their region (their files of the step and the
   step's manifest, one after another); every one must hold the same save committed, else the step
   is not coded (said, and the previous protected step stays protected).
2. In rounds of at most ``ReplicationOptions.piece_bytes`` per leader, each leader sends each of its
   ``d`` pieces' slice to the ``m`` holders of its stripe's parity, and each holder codes its parity
   slice from the ``d`` slices it received (``zfec``, on the host: the slots are host memory) and
   writes it to its memory step (``parity-<stripe>.bin``). Memory in flight: ``(1 + m)`` rounds.
3. Each leader reads its parity back and checks it against the CRC32C it coded; the leaders post
   their part of the record (files, CRC32Cs, parity CRC32Cs, commit marker). Where every part is
   there and checked, each writes the group's record (``PARITY.json``) last: the step is protected.
   Only then is the parity of older steps deleted, so a kill while coding leaves the last protected
   step as it was, and the tier holds one step's parity (``m / d`` of a snapshot) between saves.

A slot is reused only once the coding of the step it holds is over (``tiering.memory_peers``). A
replaced node rebuilds its files from its group at restore (``tiering.rebuild``).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch

from tiercheck.cluster.coordination import Coordinator, _own_client
from tiercheck.cluster.keys.tiering import parity_group_prefix
from tiercheck.cluster.nodes import Nodes
from tiercheck.errors import CorruptCheckpointError, TiercheckError
from tiercheck.format.codec import checksum
from tiercheck.format.manifest import CommitMarker
from tiercheck.format.parity import (
    PARITY_RECORD,
    Member,
    ParityRecord,
    Stripes,
    encode,
    group_of,
    is_parity_file,
    parity_file,
)
from tiercheck.format.paths import MANIFEST_FILE, step_dir
from tiercheck.format.steps import list_steps, read_marker
from tiercheck.options import ParityOptions, ReplicationOptions
from tiercheck.tiering.parity_wire import Group, Region, file_crc
from tiercheck.tiering.replication import replica_files
from tiercheck.tiering.turns import Turns
from tiercheck.tiers.local import LocalTier

log = logging.getLogger("tiercheck")

NAME = "memory-parity"  # the store keys' scope
MAX_POST_BYTES = 1 << 16  # a leader's post of a step: its step, save and region size
MAX_PART_BYTES = 16 << 20  # a leader's part of the record: its files and commit marker


def step_files(tier: LocalTier, step: int) -> tuple[CommitMarker, list[tuple[str, int]]]:
    """This node's committed ``step``: its commit marker and its region's files (its ranks' files,
    then the step's manifest)."""
    marker = read_marker(tier, step)
    return marker, [*replica_files(tier, step, marker.ranks), (MANIFEST_FILE, marker.manifest_size)]


def chunk_bytes(options: ReplicationOptions, stripes: Stripes, piece: int) -> int:
    """The slice of each piece a round moves: ``piece_bytes`` over a leader's ``d`` pieces."""
    return max(1, min(piece, max(1 << 16, options.piece_bytes // stripes.d)))


class ParityGroup(Turns):
    """One per rank; only a node's leader codes. ``submit`` each step as it commits in memory."""

    what = "parity"

    def __init__(self, tier: LocalTier, options: ReplicationOptions, *, coord: Coordinator, nodes: Nodes) -> None:
        super().__init__(every=options.every)
        assert options.parity is not None
        self.tier, self.options, self.code = tier, options, options.parity
        self.leader = coord.rank == nodes.leader
        self.number = nodes.number
        size = self.code.data + self.code.parity
        self.nodes = group_of(nodes.number, nodes.count, size, self.code.parity, options.jump or 1)
        self.me = self.nodes.index(nodes.number)
        self.stripes = Stripes(len(self.nodes), self.code.parity)
        self.protected: int | None = None  # the newest step this node's group protected (this run)
        self.broken: str | None = None  # the group's gloo group failed (a member died): no more coding
        self.status: dict[str, Any] = {
            "parity": f"{self.stripes.d}+{self.stripes.m}",
            "group": list(self.nodes),
            "coded": 0,
            "failed": 0,
            "last_protected": None,
            "bytes_sent": 0,
            "bytes_received": 0,
            "last_coding_s": None,
            "last_error": None,
        }
        self.group: Group | None = None
        if not self.leader:
            return
        prefix = parity_group_prefix(coord, NAME, self.nodes[0])
        self.group = Group(_own_client(coord.store, options.timeout_s), prefix, self.me, len(self.nodes),
                           options.timeout_s)  # fmt: skip
        self._start("tiercheck-parity")

    # ------------------------------------------------------------------------------- coding

    def _work(self, step: int) -> bool:
        start = time.monotonic()
        if self.broken is not None:  # said once; every step after it is unprotected until a restart
            self.status["failed"] += 1
            return False
        try:
            ok = self._code(step)
        except BaseException as e:
            self.status["failed"] += 1
            self.status["last_error"] = self.broken = f"step {step}: {type(e).__name__}: {e}"
            log.warning("parity: the group of nodes %s failed while coding step %d; no later step is "
                        "protected until the job restarts (those before stay as they are): %s", self.nodes, step,
                        e)  # fmt: skip
            raise
        self.status["last_coding_s"] = time.monotonic() - start
        if ok:
            self.status["coded"] += 1
            self.status["last_protected"] = self.protected = step
            log.info("parity: step %d is protected (group of nodes %s, %d+%d) in %.2f s", step, self.nodes,
                     self.stripes.d, self.stripes.m, time.monotonic() - start)  # fmt: skip
        else:
            self.status["failed"] += 1
        return ok

    def _code(self, step: int) -> bool:
        assert self.group is not None
        d, tier = step_dir(step), self.tier
        try:
            marker, files = step_files(tier, step)
            hello = {"step": step, "save": marker.save_id, "region": sum(s for _, s in files)}
        except (TiercheckError, OSError) as e:
            log.warning("parity: step %d is not committed in this node's memory (%s): it is not protected", step, e)
            marker, files, hello = None, [], {"step": step, "save": None, "region": -1}
        posts = [
            _post(raw, member)
            for member, raw in enumerate(
                self.group.allgather(json.dumps(hello).encode(), limit=MAX_POST_BYTES, what="a post")
            )
        ]
        if any(p != (step, hello["save"]) for p, _ in posts) or marker is None:
            log.warning("parity: step %d is not the same save committed on every node of the group %s: it is "
                        "not protected", step, self.nodes)  # fmt: skip
            return False
        piece = self.stripes.piece_bytes([size for _, size in posts])
        tier.delete(f"{d}/{PARITY_RECORD}")  # a step coded again counts only once its record is written again
        region = Region(tier, d, files)
        crcs = self._rounds(region, d, piece)
        size = self.options.piece_bytes
        mine: Member | None = None
        try:  # its parity read back against what it coded, and its files' CRC32Cs for the record
            held = [s for s, _ in self.stripes.parity_of(self.me)]
            bad = [s for s in held if file_crc(tier, f"{d}/{parity_file(s)}", piece, size) != crcs[s]]
            if bad:
                raise CorruptCheckpointError(f"{tier.url}: step {step}: parity of stripe(s) {bad} differs read back")
            mine = Member(node=self.number, ranks=tuple(marker.ranks), world_size=marker.world_size,
                          files=tuple((n, s, c) for (n, s), c in zip(files, region.crcs(size), strict=True)),
                          parity=tuple((s, crcs[s]) for s in held), commit=marker.to_bytes().decode())  # fmt: skip
        except (TiercheckError, OSError) as e:  # said; every member still reaches the exchange below
            log.warning("parity: %s", e)
        part = json.dumps({"ok": mine is not None, "member": mine and mine.to_json()}).encode()
        parts = [json.loads(raw) for raw in self.group.allgather(part, limit=MAX_PART_BYTES, what="a record part")]
        if not all(isinstance(p, dict) and p.get("ok") is True for p in parts):
            log.warning("parity: step %d: a node of the group %s could not code or check its parity: it is not "
                        "protected", step, self.nodes)  # fmt: skip
            return False
        raw = json.dumps({"step": step, "save_id": marker.save_id, "m": self.stripes.m, "piece": piece,
                          "members": [p["member"] for p in parts]}, sort_keys=True).encode()  # fmt: skip
        record = ParityRecord.from_bytes(raw, where=f"{tier.url}: step {step}: the group's parity record")
        if record.members[self.me] != mine:
            raise CorruptCheckpointError(f"step {step}: the group's record does not hold this node's part")
        tier.publish(f"{d}/{PARITY_RECORD}", record.to_bytes())
        self._forget_older(step)
        return True

    def _rounds(self, region: Region, d: str, piece: int) -> dict[int, int]:
        """Send this node's pieces to their parity holders and code the parity it holds, round by
        round; returns each parity piece's CRC32C, by stripe."""
        assert self.group is not None
        st, me = self.stripes, self.me
        step_chunk = chunk_bytes(self.options, st, piece)
        mine = {j: torch.empty(step_chunk, dtype=torch.uint8) for _, j in st.data_of(me)}
        held = st.parity_of(me)
        got = {(r, j): torch.empty(step_chunk, dtype=torch.uint8) for r, _ in held for j in range(st.d)}
        writers = {r: self.tier.open_pack(f"{d}/{parity_file(r)}") for r, _ in held}
        crcs = dict.fromkeys(writers, 0)
        try:
            for offset in range(0, piece, step_chunk):
                n = min(step_chunk, piece - offset)
                works = []
                for stripe, j in st.data_of(me):
                    region.read(j * piece + offset, memoryview(mine[j].numpy())[:n])  # type: ignore[arg-type]
                    for p in range(st.m):
                        works.append(self.group.send(mine[j][:n], st.holder(stripe, st.d + p), stripe * st.n + j))
                        self.status["bytes_sent"] += n
                for stripe, _ in held:
                    for j in range(st.d):
                        works.append(self.group.recv(got[stripe, j][:n], st.holder(stripe, j), stripe * st.n + j))
                        self.status["bytes_received"] += n
                for w in works:
                    w.wait()
                for stripe, p in held:
                    out = encode(st, [got[stripe, j][:n].numpy() for j in range(st.d)], [p])[0]
                    writers[stripe].write_at(offset, [out])
                    crcs[stripe] = checksum(out, crcs[stripe])
        finally:
            for w in writers.values():
                w.close()
        return crcs

    def _forget_older(self, step: int) -> None:
        """Delete the parity of this node's memory steps older than ``step`` (now protected)."""
        for older in list_steps(self.tier).committed:
            if older >= step:
                continue
            d = step_dir(older)
            try:
                self.tier.delete(f"{d}/{PARITY_RECORD}")
                for name in self.tier.list_dir(d):
                    if is_parity_file(name):
                        self.tier.delete(f"{d}/{name}")
            except OSError as e:  # withdrawn meanwhile: its directory went with its parity
                log.debug("parity: step %d's parity: %s", older, e)

    def held_bytes(self) -> int:
        """Bytes of parity this node's memory holds (its leader's count; 0 on other ranks)."""
        if not self.leader:
            return 0
        total = 0
        for step in list_steps(self.tier).committed:
            try:
                sizes = self.tier.sizes(step_dir(step))
            except OSError:
                continue
            total += sum(s for n, s in sizes.items() if is_parity_file(n))
        return total


def _post(raw: bytes, member: int) -> tuple[tuple[int, str | None], int]:
    """A member's post: ``((step, save), region size)``, checked."""
    where = f"parity group member {member}'s post"
    try:
        doc = json.loads(raw)
        step, save, region = doc["step"], doc["save"], doc["region"]
        if not isinstance(step, int) or not isinstance(region, int) or not (save is None or isinstance(save, str)):
            raise ValueError("a field of the wrong type")
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where} is damaged ({e})") from None
    if region < 0 or region >= 1 << 62:
        return (step, None), 0
    return (step, save), region


def parity_of(options: ReplicationOptions | None) -> ParityOptions | None:
    """The parity options where the memory tier codes its steps (None: copies, or no replication)."""
    return None if options is None else options.parity
