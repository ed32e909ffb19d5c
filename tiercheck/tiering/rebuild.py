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
3. The lacking members get the record from the first offering member and check it against the
   digest the others posted.
4. The rounds (``tiering.rebuild_rounds``) give each lacking member its data pieces from the
   offering members' shards, as they are: each stripe decoded once, by one lacking member.
5. The rebuilt node checks each file against the record's CRC32C and its manifest against its
   commit marker, writes its commit marker (the one it committed, naming its ranks) last, and checks
   every chunk (``format.verify``); a step that fails is withdrawn. Where one failed, every offering
   member checks its copy against the record (``_verdicts``: read back), and the failed members are
   rebuilt once more from the whole copies (``_attempts``). Then the restore chooses its step, and
   this node restores from its own memory like the others.
6. After the restore, in the background (``Rebuild.parity``, in turn on every member of the group):
   the offering members check their copies (where step 5 did not), and the parity pieces of the
   rebuilt members, and of members whose parity alone is damaged, come back the same way, each
   checked against the record, which each writes again: the group protects the step again
   (``stats()``'s ``memory_protected_step``). The restore persists the step to the node's local
   directory beside it (``memory.Memory.after_restore``).

The offering members' copies are not read back before the rounds, which would read every survivor's
data and parity once more while the job waits: a damaged shard shows in the rebuilt node's checks,
which the rebuild passes only with every file and chunk as recorded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiercheck.errors import CorruptCheckpointError, TiercheckError
from tiercheck.format.manifest import CommitMarker
from tiercheck.format.parity import MAX_RECORD_BYTES, PARITY_RECORD, ParityRecord, Stripes, parity_file
from tiercheck.format.paths import COMMIT_FILE, step_dir
from tiercheck.format.steps import list_steps, read_marker, read_small
from tiercheck.format.verify import verify_step
from tiercheck.options import MiB
from tiercheck.tiering.parity import ParityGroup
from tiercheck.tiering.parity_wire import file_crc
from tiercheck.tiering.rebuild_rounds import routes, transfer

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
    if len(choice.offering) < group.stripes.d:
        if lost:
            _cannot(choice.step, len(choice.offering), group.stripes.d)
        return None
    first = choice.offering[0]
    raw = group.group.allgather(records[choice.step] if group.me == first else b"", limit=MAX_RECORD_BYTES,
                                what="a parity record")[first]  # fmt: skip
    if hashlib.sha256(raw).hexdigest() != choice.digest:
        raise CorruptCheckpointError(f"parity: step {choice.step}: the record sent is not the one its holders posted")
    record = ParityRecord.from_bytes(raw, where=f"step {choice.step}: the group's parity record")
    verdicts: dict[int, str] = {}

    def recheck() -> tuple[int, ...]:
        verdicts.update(_verdicts(group, record, choice.offering))
        return tuple(i for i in choice.offering if verdicts[i] == WHOLE)

    t0 = time.monotonic()
    rebuilt, received = _attempts(group, record, choice.lost, choice.offering, parity=False, recheck=recheck,
                                  finish=lambda last: _commit(group, record, owner, last=last))  # fmt: skip
    if lost and group.me in rebuilt:
        t1 = time.monotonic()
        log.info("parity: step %d rebuilt in this node's memory from its group %s in %.2f s (offers %.2f, rounds, "
                 "file checks and commit %.2f%s; %.1f MiB received)", choice.step, group.nodes, t1 - start,
                 t0 - start, t1 - t0, ", the group's copies checked on the way" if verdicts else "",
                 received / MiB)  # fmt: skip
    elif not lost:
        log.info("parity: step %d rebuilt on node(s) %s, not on %s", choice.step, [group.nodes[i] for i in rebuilt],
                 [group.nodes[i] for i in choice.lost if i not in rebuilt])  # fmt: skip

    def parity() -> bool:
        return _reprotect(group, record, choice.lost, rebuilt, choice.offering, verdicts)

    return Rebuild(choice.step, lost and group.me in rebuilt, parity)


def _cannot(step: int, held: int, needed: int) -> None:
    log.error("parity: step %d cannot be rebuilt on this node: %d of its group's nodes hold it checked, %d are "
              "needed; it is restored from another tier, or an older step", step, held, needed)  # fmt: skip


def _attempts(group: ParityGroup, record: ParityRecord, lacking: tuple[int, ...], sources: tuple[int, ...], *,
              parity: bool, finish: Callable[[bool], bool],
              recheck: Callable[[], tuple[int, ...]] | None) -> tuple[tuple[int, ...], int]:  # fmt: skip
    """The rounds from ``sources`` to ``lacking`` (``rebuild_rounds``), then ``finish`` on each lacking
    member (it checks what it got against the record: True, kept). With ``recheck``, the sources were
    not checked first: where a lacking member's check failed, ``recheck`` has every source check its
    copy and names the whole ones, and the rounds run once more from those to the members that
    failed. Returns the lacking members that kept their pieces, and the bytes this member received."""
    assert group.group is not None
    me, d = group.me, group.stripes.d
    received = transfer(group, record, lacking, sources, parity=parity)
    ok = finish(recheck is None) if me in lacking else False
    flags = group.group.allgather(b"1" if ok else b"0", limit=1, what="a rebuild's result")
    done = tuple(i for i in lacking if flags[i] == b"1")
    failed = tuple(i for i in lacking if i not in done)
    if not failed or recheck is None:
        return done, received
    whole = recheck()
    if len(whole) < d:
        if me in failed:
            _cannot(record.step, len(whole), d)
        return done, received
    received += transfer(group, record, failed, whole, parity=parity)
    ok = finish(True) if me in failed else False
    flags = group.group.allgather(b"1" if ok else b"0", limit=1, what="a rebuild's result")
    return tuple(sorted(done + tuple(i for i in failed if flags[i] == b"1"))), received


def _reprotect(group: ParityGroup, record: ParityRecord, lost: tuple[int, ...], rebuilt: tuple[int, ...],
               offering: tuple[int, ...], verdicts: dict[int, str]) -> bool:  # fmt: skip
    """After the restore, on every member in turn: the offering members' copies checked (where the
    rebuild did not check them), then the parity pieces of the rebuilt members and of those whose
    parity alone is damaged rebuilt from the others, checked, and the record written again: the step
    is protected again where the group is whole (every lost member rebuilt, every piece checked)."""
    assert group.group is not None
    if not rebuilt:
        return False
    t0, step = time.monotonic(), record.step
    if not verdicts:
        verdicts.update(_verdicts(group, record, offering))
    repair = tuple(sorted(set(rebuilt) | {i for i in offering if verdicts[i] == PARITY_DAMAGED}))
    sources = tuple(sorted(set(repair) | {i for i in offering if verdicts[i] == WHOLE}))
    try:
        routes(record.stripes, repair, sources, parity=True)
    except CorruptCheckpointError as e:
        log.warning("parity: step %d is not protected again: %s", step, e)
        return False
    done, _ = _attempts(group, record, repair, sources, parity=True, recheck=None,
                        finish=lambda last: _parity_kept(group, record))  # fmt: skip
    if set(repair) <= set(done) and set(lost) <= set(rebuilt):
        group.protected = max(group.protected or step, step)
        log.info("parity: step %d is protected again: its group %s is whole (parity of node(s) %s rebuilt in %.2f s)",
                 step, group.nodes, [group.nodes[i] for i in repair], time.monotonic() - t0)  # fmt: skip
        return True
    log.warning("parity: step %d: node(s) %s are not rebuilt: the step is not protected", step,
                [group.nodes[i] for i in sorted(set(repair + lost) - set(done))])  # fmt: skip
    return False


def _parity_kept(group: ParityGroup, record: ParityRecord) -> bool:
    """On a member whose parity was rebuilt: its pieces read back against the record, and the record
    written again."""
    d = step_dir(record.step)
    bad = _mismatches(group, record, files=False, parity=True)
    if not bad and group.tier.exists(f"{d}/{COMMIT_FILE}"):
        group.tier.publish(f"{d}/{PARITY_RECORD}", record.to_bytes())
        return True
    why = f"CRC32C mismatch in {', '.join(bad)}" if bad else "the step was withdrawn meanwhile"
    log.error("parity: step %d: this node's rebuilt parity is not kept: %s", record.step, why)
    return False


WHOLE, PARITY_DAMAGED, DAMAGED = "1", "p", "0"


def _verdicts(group: ParityGroup, record: ParityRecord, offering: tuple[int, ...]) -> dict[int, str]:
    """Every offering member's copy of the step checked against the record (read back), each verdict
    shared: ``WHOLE``, ``PARITY_DAMAGED`` (its files whole, a parity piece not), or ``DAMAGED``."""
    assert group.group is not None
    mine = DAMAGED
    if group.me in offering:
        bad_files = _mismatches(group, record, files=True, parity=False)
        bad_parity = _mismatches(group, record, files=False, parity=True)
        mine = PARITY_DAMAGED if bad_parity and not bad_files else WHOLE if not bad_parity else DAMAGED
        if bad_files or bad_parity:
            log.warning("parity: %s: this node's copy of step %d is damaged: CRC32C differs from its parity record "
                        "in %s; %s", group.tier.url, record.step, ", ".join(bad_files + bad_parity),
                        "its parity is rebuilt from its group" if mine == PARITY_DAMAGED
                        else "it is passed over in the rebuild")  # fmt: skip
    flags = group.group.allgather(mine.encode(), limit=1, what="a check")
    return {i: flags[i].decode("ascii", "replace") for i in offering}


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


def _commit(group: ParityGroup, record: ParityRecord, owner: Callable[[str | None], None], *, last: bool) -> bool:
    """Step 5 on the rebuilt node: check its files, write its commit marker, verify. A failure is an
    error where it is the ``last`` try; before it, the group checks its copies and tries again."""
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
        if last:
            log.error("parity: %s: not kept: %s", where, problem)
        else:
            log.warning("parity: %s: not kept: %s; its group checks its copies, and it is rebuilt again from the "
                        "whole ones", where, problem)  # fmt: skip
        tier.delete(f"{d}/{COMMIT_FILE}")
        tier.delete_tree(d)
        return False
    return True


def vouched(rebuilt: dict[int, str | None], trust: Trust, step: int, marker: CommitMarker) -> str | None:
    """A step this node rebuilt from its parity group (that save) is restorable: the group's nodes
    offered it as their lineage's (a replaced node's empty local directory names none). Any other
    step is judged by ``trust``."""
    return None if rebuilt.get(step) == marker.save_id else trust(step, marker)
