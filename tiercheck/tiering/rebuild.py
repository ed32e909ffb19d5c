"""A replaced node's memory step rebuilt from its parity group (``tiering.parity``), before the
restore chooses its step: the node then restores from its own memory like any other.

Every leader runs ``rebuild`` at the start of a restore from memory, on its group's thread, in turn:

1. Each leader posts what its memory holds: the steps whose own files are committed there, and those
   of them its group protected (a ``PARITY.json`` that names this node as its member, the same save
   as its commit marker, and a step its lineage may restore: ``format.memory_steps.doubt``), each
   with its record's SHA-256.
2. Every leader makes the same choice from the posts (``choose``): the newest protected step that a
   member lacks, offered with one record by at least ``d`` members, none of them lacking it, and
   lacked by at most ``m``; where none can be, the newest a member lacks (its members then say why,
   and the restore finds its step elsewhere). None: every member holds the newest protected step.
3. Each offering member checks its files and parity of that step against the record (CRC32C, read
   back); one that fails is passed over. The lacking members get the record from the first
   offering one and check it against the digest the others posted.
4. In rounds, for each stripe holding a lacking member's data piece, the first ``d`` checked shards
   are sent to it; it decodes its piece and writes it to its memory step.
5. The rebuilt node checks each file against the record's CRC32C and its manifest against its
   commit marker, writes its commit marker (the one it committed, naming its ranks) last, and checks
   every chunk (``format.verify``); a step that fails is withdrawn. Then the restore chooses its step,
   and this node restores from its own memory like the others.
6. After the restore, in the background (``Rebuild.parity``, in turn on every member of the group),
   the rebuilt nodes' parity pieces come back the same way, each checked against the record, and each
   writes the record again: the group protects the step again (``stats()``'s
   ``memory_protected_step``). The restore persists the step to the node's local directory beside it
   (``memory.Memory.after_restore``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tiercheck.errors import CorruptCheckpointError, TiercheckError
from tiercheck.format.manifest import CommitMarker
from tiercheck.format.parity import MAX_RECORD_BYTES, PARITY_RECORD, ParityRecord, Stripes, decode, parity_file
from tiercheck.format.paths import COMMIT_FILE, step_dir
from tiercheck.format.steps import list_steps, read_marker, read_small
from tiercheck.format.verify import verify_step
from tiercheck.tiering.parity import ParityGroup, chunk_bytes
from tiercheck.tiering.parity_wire import Region, file_crc

log = logging.getLogger("tiercheck")

Trust = Callable[[int, CommitMarker], "str | None"]
MAX_OFFER_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Offer:
    """A member's post: steps with its own files committed, and ``(step, save, digest)`` protected."""

    own: frozenset[int]
    protected: tuple[tuple[int, str, str], ...]


@dataclass(frozen=True, slots=True)
class Choice:
    """The step to rebuild, its record's digest, the members lacking it and those offering it."""

    step: int
    save: str
    digest: str
    lost: tuple[int, ...]
    offering: tuple[int, ...]


def choose(posts: Sequence[Offer], stripes: Stripes, requested: int | None = None) -> Choice | None:
    """The same answer on every member (see the module's docstring, step 2)."""
    keys = sorted({key for p in posts for key in p.protected}, reverse=True)
    lacking: list[Choice] = []
    for step, save, digest in keys:
        if requested is not None and step != requested:
            continue
        lost = tuple(i for i, p in enumerate(posts) if step not in p.own)
        if not lost:
            break
        offering = tuple(i for i, p in enumerate(posts) if (step, save, digest) in p.protected)
        lacking.append(Choice(step, save, digest, lost, offering))
        if len(offering) >= stripes.d and len(lost) <= stripes.m:
            return lacking[-1]
    return lacking[0] if lacking else None  # none can be: the newest, for the lacking members to say why


def offer(group: ParityGroup, trust: Trust) -> tuple[Offer, dict[int, bytes]]:
    """This member's post, and the records it offers (by step)."""
    tier, own, protected, records = group.tier, set(), [], {}
    for step in list_steps(tier).committed:
        try:
            marker = read_marker(tier, step)
        except (TiercheckError, OSError):
            continue
        own.add(step)
        where = f"{tier.url}: step {step}: {PARITY_RECORD}"
        try:
            raw = read_small(tier, f"{step_dir(step)}/{PARITY_RECORD}", where=where)
            record = ParityRecord.from_bytes(raw, where=where)
        except FileNotFoundError:
            continue
        except (TiercheckError, OSError) as e:
            log.warning("parity: %s", e)
            continue
        member = record.members[group.me] if group.me < len(record.members) else None
        why = trust(step, marker)
        if member is None or member.node != group.number or tuple(marker.ranks) != member.ranks:
            log.warning("parity: %s does not name this node as member %d: passed over", where, group.me)
        elif record.save_id != marker.save_id or [m.node for m in record.members] != group.nodes:
            log.warning("parity: %s is another save's, or another group's: passed over", where)
        elif why is not None:
            log.info("parity: step %d is not offered for a rebuild: %s", step, why)
        else:
            protected.append((step, record.save_id, hashlib.sha256(raw).hexdigest()))
            records[step] = raw
    return Offer(frozenset(own), tuple(protected)), records


def _parse_offer(raw: bytes, member: int) -> Offer:
    try:
        doc = json.loads(raw)
        own = frozenset(int(s) for s in doc["own"] if isinstance(s, int) and s >= 0)
        protected = tuple((int(s), str(v), str(h)) for s, v, h in doc["protected"]
                          if isinstance(s, int) and isinstance(v, str) and isinstance(h, str))  # fmt: skip
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise CorruptCheckpointError(f"parity group member {member}'s offer is damaged ({e})") from None
    return Offer(own, protected)


@dataclass
class Rebuild:
    """A rebuild this member takes part in: ``step``, and whether this node rebuilt its files of it
    (``here``). ``parity()``, run later on the group's thread in turn on every member (after the
    restore: ``Memory.after_restore``), rebuilds the lost members' parity pieces, and the group
    protects the step again."""

    step: int
    here: bool
    parity: Callable[[], bool]


def rebuild(group: ParityGroup, trust: Trust, owner: Callable[[str | None], None],
            requested: int | None = None) -> Rebuild | None:  # fmt: skip
    """Run on ``group``'s thread by every leader (see the module's docstring): the lost members' data
    pieces back, their files committed. None: no rebuild was needed, or none can be (said)."""
    assert group.group is not None
    start = time.monotonic()
    mine, records = offer(group, trust)
    doc = {"own": sorted(mine.own), "protected": [list(p) for p in mine.protected]}
    raws = group.group.allgather(json.dumps(doc).encode(), limit=MAX_OFFER_BYTES, what="an offer")
    posts = [_parse_offer(raw, i) for i, raw in enumerate(raws)]
    choice = choose(posts, group.stripes, requested)
    if choice is None:
        return None
    lost = group.me in choice.lost
    ok = not lost and _checked(group, choice.step, records[choice.step]) if group.me in choice.offering else False
    flags = group.group.allgather(b"1" if ok else b"0", limit=1, what="a check")
    checked = tuple(i for i in choice.offering if flags[i] == b"1")
    first = checked[0] if checked else -1
    raw = group.group.allgather(records[choice.step] if group.me == first else b"", limit=MAX_RECORD_BYTES,
                                what="a parity record")[first] if checked else b""  # fmt: skip
    if len(checked) < group.stripes.d:
        if lost:
            log.error("parity: step %d cannot be rebuilt on this node: %d of its group's nodes hold it checked, %d "
                      "are needed; it is restored from another tier, or an older step", choice.step, len(checked),
                      group.stripes.d)  # fmt: skip
        return None
    if hashlib.sha256(raw).hexdigest() != choice.digest:
        raise CorruptCheckpointError(f"parity: step {choice.step}: the record sent is not the one its holders posted")
    record = ParityRecord.from_bytes(raw, where=f"step {choice.step}: the group's parity record")
    t0 = time.monotonic()
    _transfer(group, record, choice.lost, checked, parity=False)
    t1 = time.monotonic()
    done = _commit(group, record, owner) if lost else False
    flags = group.group.allgather(b"1" if done else b"0", limit=1, what="a rebuild's result")
    rebuilt = tuple(i for i in choice.lost if flags[i] == b"1")
    if lost and done:
        end = time.monotonic()
        log.info("parity: step %d rebuilt in this node's memory from its group %s in %.2f s (offers and checks "
                 "%.2f, transfer and decode %.2f, files checked and committed %.2f)", choice.step, group.nodes,
                 end - start, t0 - start, t1 - t0, end - t1)  # fmt: skip
    elif not lost:
        log.info("parity: step %d rebuilt on node(s) %s, not on %s", choice.step, [group.nodes[i] for i in rebuilt],
                 [group.nodes[i] for i in choice.lost if i not in rebuilt])  # fmt: skip

    def parity() -> bool:
        return _reprotect(group, record, rebuilt, checked)

    return Rebuild(choice.step, lost and done, parity)


def _reprotect(group: ParityGroup, record: ParityRecord, rebuilt: tuple[int, ...], checked: tuple[int, ...]) -> bool:
    """The rebuilt members' parity pieces back, checked, and their record written: the step is
    protected again (every member calls it in turn)."""
    assert group.group is not None
    if not rebuilt:
        return False
    t0, step, d = time.monotonic(), record.step, step_dir(record.step)
    _transfer(group, record, rebuilt, checked, parity=True)
    ok = True
    if group.me in rebuilt:
        bad = _mismatches(group, record, files=False, parity=True)
        ok = not bad and group.tier.exists(f"{d}/{COMMIT_FILE}")
        if ok:
            group.tier.publish(f"{d}/{PARITY_RECORD}", record.to_bytes())
        else:
            why = f"CRC32C mismatch in {', '.join(bad)}" if bad else "the step was withdrawn meanwhile"
            log.error("parity: step %d: this node's rebuilt parity is not kept: %s", step, why)
    flags = group.group.allgather(b"1" if ok else b"0", limit=1, what="a parity rebuild's result")
    whole = all(flags[i] == b"1" for i in rebuilt)
    if whole:
        group.protected = max(group.protected or step, step)
        log.info("parity: step %d is protected again: its group %s is whole (parity rebuilt in %.2f s)", step,
                 group.nodes, time.monotonic() - t0)  # fmt: skip
    else:
        log.warning("parity: step %d: the parity of node(s) %s is not rebuilt: the step is not protected", step,
                    [group.nodes[i] for i in rebuilt])  # fmt: skip
    return whole


def _checked(group: ParityGroup, step: int, raw: bytes) -> bool:
    """Whether this member's files and parity of ``step`` match its record (read back)."""
    record = ParityRecord.from_bytes(raw, where=f"step {step}: {PARITY_RECORD}")
    bad = _mismatches(group, record, files=True, parity=True)
    if bad:
        log.warning("parity: %s: this node's copy is damaged, and is passed over in the rebuild: step %d: CRC32C "
                    "differs from its parity record in %s", group.tier.url, step, ", ".join(bad))  # fmt: skip
    return not bad


def _mismatches(group: ParityGroup, record: ParityRecord, *, files: bool, parity: bool) -> list[str]:
    """This member's files (``files``) and parity pieces (``parity``) of the record's step whose CRC32C,
    read back, is not the record's; one that cannot be read is named with why. Never raises: every
    member reaches the group's next exchange."""
    member, d, size = record.members[group.me], step_dir(record.step), group.options.piece_bytes
    wanted = list(member.files) if files else []
    wanted += [(parity_file(s), record.piece, crc) for s, crc in member.parity] if parity else []
    bad = []
    for name, length, crc in wanted:
        try:
            if file_crc(group.tier, f"{d}/{name}", length, size) != crc:
                bad.append(name)
        except (TiercheckError, OSError) as e:
            bad.append(f"{name} ({e})")
    return bad


def _transfer(group: ParityGroup, record: ParityRecord, lost_members: tuple[int, ...], checked: tuple[int, ...],
              *, parity: bool) -> None:  # fmt: skip
    """The rounds of step 4: sources send their shards' slices, lacking members decode theirs (their
    data pieces, or with ``parity`` their parity pieces)."""
    assert group.group is not None
    st, me, piece, d = record.stripes, group.me, record.piece, step_dir(record.step)
    lost = set(lost_members)
    member = record.members[me]
    region = Region(group.tier, d, [(n, s) for n, s, _ in member.files])
    plan = []  # (stripe, source positions, lacking positions)
    for stripe in range(st.n):
        lacking = [j for j in range(st.n) if st.holder(stripe, j) in lost and (j >= st.d) == parity]
        if lacking:
            plan.append((stripe, [j for j in range(st.n) if st.holder(stripe, j) in checked][: st.d], lacking))
    chunk = chunk_bytes(group.options, st, piece)
    bufs: dict[tuple[int, int], torch.Tensor] = {}
    writers = {}
    if me in lost and parity:
        writers = {s: group.tier.open_pack(f"{d}/{parity_file(s)}") for s, _ in st.parity_of(me)}
    elif me in lost:
        group.tier.delete(f"{d}/{COMMIT_FILE}")
        group.tier.delete(f"{d}/{PARITY_RECORD}")
        region.open()
    try:
        for offset in range(0, piece, chunk):
            n = min(chunk, piece - offset)
            works = []
            for stripe, sources, lacking in plan:
                for j in sources:
                    if st.holder(stripe, j) == me:
                        t = bufs.setdefault((stripe, j), torch.empty(chunk, dtype=torch.uint8))[:n]
                        _read_shard(group, region, d, piece, stripe, j, offset, t)
                        for k in lacking:
                            works.append(group.group.send(t, st.holder(stripe, k), stripe * st.n + j))
                    elif me in lost and st.position(stripe, me) in lacking:
                        t = bufs.setdefault((stripe, j), torch.empty(chunk, dtype=torch.uint8))[:n]
                        works.append(group.group.recv(t, st.holder(stripe, j), stripe * st.n + j))
            for w in works:
                w.wait()
            if me in lost:
                for stripe, sources, lacking in plan:
                    j = st.position(stripe, me)
                    if j not in lacking:
                        continue
                    out = decode(st, {k: bufs[stripe, k][:n].numpy() for k in sources}, [j])[j]
                    if j < st.d:
                        region.write(j * piece + offset, memoryview(out))
                    else:
                        writers[stripe].write_at(offset, [out])
    finally:
        if me in lost and not parity:
            region.close()
        for w in writers.values():
            w.close()


def _read_shard(group: ParityGroup, region: Region, d: str, piece: int, stripe: int, j: int, offset: int,
                t: torch.Tensor) -> None:  # fmt: skip
    view = memoryview(t.numpy())  # type: ignore[arg-type]
    if j < group.stripes.d:
        region.read(j * piece + offset, view)
        return
    got, _ = group.tier.read_into(f"{d}/{parity_file(stripe)}", view, offset=offset, length=len(view))
    if got != len(view):
        raise CorruptCheckpointError(f"{group.tier.url}: {d}/{parity_file(stripe)} is shorter than its record says")


def _commit(group: ParityGroup, record: ParityRecord, owner: Callable[[str | None], None]) -> bool:
    """Step 5 on the rebuilt node: check its files, write its commit marker, verify."""
    tier, step, d = group.tier, record.step, step_dir(record.step)
    member = record.members[group.me]
    where = f"{tier.url}: step {step} rebuilt from its parity group"
    problem = None
    try:
        marker = CommitMarker.from_bytes(member.commit.encode(), where=where)
        bad = _mismatches(group, record, files=True, parity=False)
        if bad:
            problem = f"CRC32C mismatch in {', '.join(bad)}"
        elif marker.step != step or marker.save_id != record.save_id or tuple(marker.ranks) != member.ranks:
            problem = "its commit marker is not this node's of that save"
    except (TiercheckError, OSError) as e:
        problem = str(e)
    if problem is None:
        tier.sync_dirs(d)
        owner(marker.lineage)
        tier.publish(f"{d}/{COMMIT_FILE}", marker.to_bytes())
        problems = verify_step(tier, step, threads=2)
        problem = "; ".join(problems[:3]) if problems else None
    if problem is not None:
        log.error("parity: %s: not kept: %s", where, problem)
        tier.delete(f"{d}/{COMMIT_FILE}")
        tier.delete_tree(d)
        return False
    return True


def vouched(rebuilt: dict[int, str | None], trust: Trust, step: int, marker: CommitMarker) -> str | None:
    """A step this node rebuilt from its parity group (that save) is restorable: the group's nodes
    offered it as their lineage's (a replaced node's empty local directory names none). Any other
    step is judged by ``trust``."""
    return None if rebuilt.get(step) == marker.save_id else trust(step, marker)
