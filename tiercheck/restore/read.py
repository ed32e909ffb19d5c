"""Moving a committed step's bytes: verified chunk reads into destination tensors, across ranks.

Callers plan first (match every stored array to a destination and check shapes and dtypes, then
the read plan, ``restore.plan.plan_restore``, says who reads and who sends each chunk) and move bytes
second, so an incompatible state is refused before a single byte is overwritten. A destination is
any box of a global array: a whole tensor, a tensor-parallel shard, a ZeRO partition. Each chunk
read is copied into the part of every destination it overlaps; a chunk some rank needs but does
not read (its file is on another node, or another rank of its node reads it) arrives from the rank
that reads it: through shared memory from a rank of the same host (``restore.share``), else
point-to-point over the process group. All or nothing, a live CPU tensor whose every chunk is in
shared memory is filled from there only once every rank has verified every chunk (``deferrable``,
``fill_deferred``); in place (a job start), as each chunk is verified.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tiercheck.cluster.assign import Read, Transfer
from tiercheck.cluster.nodes import Nodes
from tiercheck.errors import CorruptCheckpointError, TiercheckError
from tiercheck.format.codec import CHECKSUM_BYTES, chunk_nbytes, verify_parts
from tiercheck.format.layout import Chunk, chunks_in_box, overlap
from tiercheck.format.manifest import ArrayRecord
from tiercheck.format.paths import step_dir
from tiercheck.format.verify import read_stored_chunk
from tiercheck.restore.order import SendOrder, comm_device, global_rank, matches_by_order, receive_order
from tiercheck.restore.plan import RestorePlan
from tiercheck.restore.runs import Folded, RunLayout, Slot, read_runs
from tiercheck.restore.serve import TransferError, serve, to_serve, transfer_error
from tiercheck.restore.share import HEADER, Sharing, host_key, unshared
from tiercheck.restore.stage import Bounce, ReadItem, direct_target, run_span, whole_blocks
from tiercheck.state.flatten import torch_dtype
from tiercheck.tiers.base import Tier

log = logging.getLogger("tiercheck")


def read_chunk(tier: Tier, step: int, rec: ArrayRecord, c: Chunk, into: memoryview | None = None) -> memoryview:
    """One chunk's data (full chunk size, padding included), its checksum verified. With ``into``,
    the chunk's first ``len(into)`` bytes (all its data, or all but an edge chunk's trailing
    padding) are read there, and ``into`` is returned; when the chunk turns out damaged, ``into``
    holds what was read."""
    key = c.key
    where = f"{tier.url}: step {step}: array {rec.path!r} chunk {key}"
    if key not in rec.checksums:
        raise CorruptCheckpointError(f"{where}: the manifest has no checksum for this chunk")
    if key not in rec.offsets:  # a part gives both; only a record made by hand lacks one
        raise CorruptCheckpointError(f"{where}: the manifest gives this chunk no offset in its writer's pack")
    file, offset = rec.location(key)
    try:
        data = read_stored_chunk(
            tier, step, file, offset, nbytes=chunk_nbytes(rec), crc=rec.checksums[key], where=where, into=into
        )
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: pack file is missing") from None
    except TiercheckError:
        raise
    except OSError as e:  # unreadable (EIO, a directory in its place, ...): as damaged as a bad checksum
        raise CorruptCheckpointError(f"{where}: cannot read {step_dir(step)}/{file}: {e.strerror or e}") from None
    # Writable: tensors are made from what this returns.
    return memoryview(bytearray(data)) if data.readonly else data


def fill(
    rec: ArrayRecord, c: Chunk, data: torch.Tensor, items: Iterable[ReadItem], *, non_blocking: bool = False
) -> None:
    """Copy the part of chunk ``c`` (``data``: its bytes, uint8) that each destination covers;
    ``non_blocking`` from page-locked ``data`` into GPU memory, on the current stream."""
    dtype = torch_dtype(rec.dtype)
    if data.storage_offset() % dtype.itemsize:  # a chunk after an odd-sized one in its pack, read with it
        data = data.clone()
    src = data.view(dtype).view(rec.chunks)
    for item in items:
        stops = tuple(o + n for o, n in zip(item.offsets, item.dest.shape, strict=True))
        box = overlap(c.starts, c.stops, item.offsets, stops)
        if box is None:
            continue
        lo, hi = box
        dst_idx = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, item.offsets, strict=True))
        src_idx = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, c.starts, strict=True))
        item.dest[dst_idx].copy_(src[src_idx], non_blocking=non_blocking)


def deferrable(items: Sequence[ReadItem], transfers: Sequence[Transfer], rank: int) -> list[bool]:
    """Which of a rank's destinations can be filled straight from shared memory once every chunk is
    verified, with no staging memory of their own: live CPU tensors whose every chunk this rank
    receives through shared memory, or reads into its own shared memory to pass on. Data-parallel
    replicas of one host then hold the checkpoint's bytes once between them, as a page cache would."""
    shared = {(t.path, t.chunk.coords) for t in transfers if t.shared and rank in (t.src, t.dst)}
    if not shared:
        return [False] * len(items)
    out = []
    for item in items:
        rec = item.record
        out.append(
            not item.fresh
            and item.dest.device.type == "cpu"
            and item.dest.numel() > 0
            and all(
                (rec.path, c.coords) in shared
                for c in chunks_in_box(rec.shape, rec.chunks, item.offsets, tuple(item.dest.shape))
            )
        )
    return out


def fill_deferred(sharing: Sharing) -> None:
    """Fill the live tensors ``deferrable`` kept out of staging, from shared memory: once every
    rank has verified every chunk."""
    with torch.no_grad():
        for rec, c, data, items in sharing.later:
            fill(rec, c, data, items)
    sharing.later.clear()


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadSource:
    """Where and how one rank reads a committed step (``move_chunks``): ``step`` on ``tier``, and
    what is missing or damaged there on ``remote`` when given; as restoring ``rank`` of ``group``
    (the process group transfers go through; None: the default one), on up to ``io_threads``."""

    tier: Tier
    step: int
    rank: int = 0
    group: Any = None
    remote: Tier | None = None
    io_threads: int = 4


def move_chunks(
    source: ReadSource,
    plan: RestorePlan,
    items: Sequence[ReadItem],
    *,
    counts: ReadCounts | None = None,
    sharing: Sharing | None = None,
) -> int:
    """Carry out this rank's part of a read ``plan``: its reads and the transfers it sends or
    receives: read, send, receive, fill into ``items``. Returns the bytes read.

    A chunk missing or damaged on the local tier is read from ``source.remote`` instead, when
    given. ``shared`` transfers pass through ``sharing``'s memory (``restore.share``), which the
    caller closes only once every rank is done moving chunks. What the reads count is added to
    ``counts``.
    """
    tier, records, reads = source.tier, plan.records, plan.reads
    moves = _Moves(source, plan, items, sharing)
    if counts is not None:
        moves.counts = counts
    # Chunks read only for other ranks are served from the tier's memory on a thread of their own
    # (``restore.serve``), beside the reads of the chunks this rank places.
    served, reads = to_serve(reads, moves.sends, moves.by_path, records) if tier.lends_memory else ([], reads)
    runs = read_runs(tier, records, reads, remote=source.remote, max_bytes=READ_RUN_BYTES, max_chunks=READ_RUN_CHUNKS)
    # Threads overlap reads, but each chunk also costs Python (its slot, its checksum) under the
    # GIL: many small chunks go no faster on more threads, and slower as the threads trade the GIL
    # (20,000 chunks of 1 KiB: 0.6 s on 4 threads, 0.3 s on one). A thread per run's worth of bytes.
    nbytes = sum(chunk_nbytes(records[r.path]) for r in reads)
    threads = max(1, min(source.io_threads, len(runs), -(-nbytes // READ_RUN_BYTES)))
    moves.bounce = Bounce.for_runs(tier, records, items, runs, threads)
    # A thread of its own, not a pool's: when this rank fails for another reason, it is left
    # waiting (within the process group's timeout) and never holds up the process's exit.
    receiver = threading.Thread(target=moves.receive_all, name="tiercheck-receive", daemon=True)
    if moves.recvs:
        receiver.start()
    server = threading.Thread(target=moves.serve_all, args=(served,), name="tiercheck-serve", daemon=True)
    if served:
        server.start()
    total, start = 0, time.perf_counter()
    with ThreadPoolExecutor(threads, thread_name_prefix="tiercheck-read") as pool:
        for done, direct_bytes in pool.map(moves.read_and_share, runs):
            moves.counts.direct_bytes += direct_bytes
            for path, c, data in done:
                total += data.numel()
                moves.send(path, c, data)
    if reads:
        moves.counts.own_placed_s = time.perf_counter() - start
    if moves.bounce is not None:  # what follows on this thread's stream (copy_in) comes after the copies up
        torch.cuda.current_stream(moves.bounce.device).wait_stream(moves.bounce.stream)
    if moves.recvs:
        receiver.join()
    if served:
        server.join()
        total += moves.served
    for op, dst, what in moves.ops:
        try:
            op.wait()
        except RuntimeError as e:  # gloo's and NCCL's errors (DistError is one)
            moves.errors.insert(0, transfer_error(dist.get_rank(), dst, what, True, e))
    if moves.errors:  # a transfer's first: a rank is gone, and no verdict can come
        raise next((e for e in moves.errors if isinstance(e, TransferError)), moves.errors[0])
    return total


Placed = tuple[str, Chunk, torch.Tensor]  # a chunk read: its array, the chunk, its verified bytes


@dataclass(slots=True)
class ReadCounts:
    """What one rank's reads of a restore counted (``move_chunks`` adds to them as it reads)."""

    remote_reads: int = 0  # chunks read from the remote tier
    fallbacks: int = 0  # of those, chunks read there after a bad copy on the local tier
    direct_bytes: int = 0  # bytes read from the local tier around the page cache (O_DIRECT)
    damaged: set[int] = field(default_factory=set)  # saving ranks with a chunk bad in this node's copy (and remote)
    own_placed_s: float | None = None  # from the start of the reads until those this rank places were placed


class _Moves:
    """One rank's part of a read plan in flight (``move_chunks``): what it reads and fills, the
    chunks it sends to other ranks (through the process group, or the host's shared memory) and
    those it receives, and the first error of any of them (raised once every transfer is over:
    a rank waiting for a chunk always gets the bytes it expects, or it would hang)."""

    def __init__(
        self, source: ReadSource, plan: RestorePlan, items: Sequence[ReadItem], sharing: Sharing | None
    ) -> None:
        records, transfers, rank, group = plan.records, plan.transfers, source.rank, source.group
        self.tier, self.step, self.records, self.remote, self.sharing, self.group = (
            source.tier, source.step, records, source.remote, sharing, group
        )  # fmt: skip
        self.counts = ReadCounts()
        self.by_path: dict[str, list[ReadItem]] = defaultdict(list)
        for item in items:
            self.by_path[item.record.path].append(item)
        self.sends: dict[tuple[str, tuple[int, ...]], list[tuple[int, int, bool]]] = defaultdict(list)
        self.recvs: list[tuple[Transfer, torch.Tensor, Any, bool]] = []  # and whether it lands in place
        self.ops: list[tuple[Any, int, str]] = []  # sends: to which global rank, of what
        self.keep: list[torch.Tensor] = []  # sent buffers stay alive until the sends complete
        self.errors: list[BaseException] = []
        self.bounce: Bounce | None = None
        self.served = 0  # bytes served from the tier's memory (``serve_all``)
        self.device = comm_device(group) if transfers else torch.device("cpu")
        if any(t.shared for t in transfers) and sharing is None:
            raise AssertionError("transfers through shared memory, and no sharing to pass them through")
        ordered = matches_by_order(group) if transfers else False
        for t in receive_order(transfers, lambda t: t.tag, ordered=ordered):
            if t.dst == rank:
                n = HEADER if t.shared else chunk_nbytes(records[t.path])
                # Straight into its destination where the whole chunk lies in one (no new memory to fault
                # in, no copy after), else into a buffer of its own, filled from as it lands.
                into = None if t.shared or self.device.type != "cpu" else self.receivable(t, n)
                buf = torch.empty(n, dtype=torch.int64 if t.shared else torch.uint8, device=self.device) \
                    if into is None else into  # fmt: skip
                op = dist.irecv(buf, src=global_rank(group, t.src), group=group, tag=t.tag)
                self.recvs.append((t, buf, op, into is not None))
            elif t.src == rank:
                self.sends[(t.path, t.chunk.coords)].append((t.dst, t.tag, t.shared))
        self.order = SendOrder(((d, tag) for to in self.sends.values() for d, tag, _ in to), ordered=ordered)
        self.shared_out = {k for k, to in self.sends.items() if any(shared for _, _, shared in to)}
        self.outbox = None
        if self.shared_out:
            assert sharing is not None
            try:
                self.outbox = sharing.open_outbox({k: chunk_nbytes(records[k[0]]) for k in sorted(self.shared_out)})
            except TiercheckError as e:  # the receivers still get a header, saying so (they would hang otherwise)
                self.errors.append(e)

    def receivable(self, t: Transfer, nbytes: int) -> torch.Tensor | None:
        """The destination memory a chunk sent to this rank is received straight into: where the whole
        chunk (``nbytes``, padding included, as it is sent) lies within one (``direct_target``)."""
        target = direct_target(self.records[t.path], t.chunk, self.by_path.get(t.path, ()), whole=True)
        return target if target is not None and target.numel() == nbytes else None

    def place(
        self, rec: ArrayRecord, c: Chunk, data: torch.Tensor, dests: Sequence[ReadItem], *, reused: bool = False
    ) -> None:
        """``fill`` the destinations, but those ``deferrable`` only once all is verified
        (``fill_deferred``): ``data`` is then shared memory, or kept until then (a copy, where it
        is memory that is ``reused``: a bounce buffer, ``non_blocking`` copies to the GPU)."""
        now = [i for i in dests if not i.deferred]
        if now:
            fill(rec, c, data, now, non_blocking=reused)
        if len(now) < len(dests):
            assert self.sharing is not None
            self.sharing.later.append((rec, c, data.clone() if reused else data, [i for i in dests if i.deferred]))

    def read_and_fill(self, job: Read) -> Placed:
        path, c = job.path, job.chunk
        rec = self.records[path]
        target = direct_target(rec, c, self.by_path.get(path, ()), whole=(path, c.coords) in self.sends)
        into = None if target is None else target.numpy().data
        try:
            if job.remote:
                assert self.remote is not None
                self.counts.remote_reads += 1
                raw = read_chunk(self.remote, self.step, rec, c, into)
            else:
                try:
                    raw = read_chunk(self.tier, self.step, rec, c, into)
                except (CorruptCheckpointError, OSError) as e:
                    if self.remote is None:
                        raise
                    log.warning("%s; reading it from %s instead", e, self.remote.url)
                    self.counts.fallbacks += 1
                    raw = read_chunk(self.remote, self.step, rec, c, into)
        except (TiercheckError, OSError) as e:
            # Ranks waiting for this chunk still get the bytes they expect (they would hang
            # otherwise); the error reaches every rank once the transfers are over.
            self.errors.append(e)
            if not job.remote and c.key in rec.offsets:  # another node's copy of its writer's files may be whole
                self.counts.damaged.add(rec.owner(c.key))
            filler = torch.zeros(chunk_nbytes(rec) if (path, c.coords) in self.sends else 0, dtype=torch.uint8)
            return path, c, filler
        if target is not None:
            return path, c, target  # read in place: nothing to copy
        data = torch.frombuffer(raw, dtype=torch.uint8)
        self.place(rec, c, data, self.by_path.get(path, ()))
        return path, c, data

    def read_run(self, run: list[Read]) -> tuple[list[Placed], int]:
        """Chunks that lie together in one pack, read with one vectored read straight into their
        destinations (``RunLayout``), then each verified; and the bytes read around the page
        cache. A chunk that fails, or a run the file cuts short, is read again on its own: that
        path falls back to the remote tier or reports the chunk. A run planned from the remote
        tier is read from there (ranged GETs in parallel), into host memory."""
        records, by_path = self.records, self.by_path
        if len(run) == 1 and (run[0].remote or run[0].chunk.key not in records[run[0].path].offsets):
            return [self.read_and_fill(run[0])], 0  # one chunk, or one the manifest does not place (reported)
        src = self.remote if run[0].remote else self.tier
        assert src is not None
        to_device = any(i.dest.is_cuda for job in run for i in by_path.get(job.path, ()))
        if src is self.tier and self.bounce is not None and to_device:
            return self.read_run_to_device(run, self.bounce)
        slots = []
        for job in run:
            rec = records[job.path]
            _, offset = rec.location(job.chunk.key)
            key = (job.path, job.chunk.coords)
            if self.outbox is not None and key in self.shared_out:
                # Read straight into the memory the ranks of this host take it from, then filled from
                # there, its own destinations too: a copy out of that memory costs less than one into
                # it (its pages are new), and this reader's copy overlaps the other ranks'.
                slots.append(Slot(job, offset, chunk_nbytes(rec), self.outbox.slot(key), filled=False))
            else:
                target = direct_target(rec, job.chunk, by_path.get(job.path, ()), whole=key in self.sends)
                slots.append(Slot(job, offset, chunk_nbytes(rec), target))
        file, _ = records[run[0].path].location(run[0].chunk.key)
        layout = (RunLayout.unbuffered(slots) if src.direct_io else None) or RunLayout.buffered(slots)
        # Through the page cache (a tmpfs: the memory tier), each chunk's checksum is folded piece by
        # piece as the read copies them, while they are in the CPU's cache: one pass over memory fewer
        # than a checksum of the destination once the whole run is read. Not around it: the device
        # writes memory, not the CPU, and it reads faster in big requests.
        fold = None if layout.direct else Folded(records, slots, layout.start, src.url)
        try:
            path = f"{step_dir(self.step)}/{file}"
            n, direct = src.read_vectored(path, layout.start, layout.views, direct=layout.direct, each=fold)
            whole = n >= layout.end - layout.start
        except OSError:
            whole = False
        if not whole:
            return [self.read_and_fill(job) for job in run], 0
        if src is self.remote:
            self.counts.remote_reads += len(run)
        for into, scratch in layout.copies:
            into[:] = scratch
        verified = fold is not None and fold.whole()
        out = []
        for slot, (data, rest, chunk) in zip(slots, layout.parts, strict=True):
            job, c = slot.job, slot.job.chunk
            rec = records[job.path]
            try:  # a run the fold found damaged: each chunk checked on its own, to know which
                if not verified:
                    verify_parts(data, rest, expected_crc=rec.checksums[c.key], nbytes=slot.nbytes, where=src.url)
            except CorruptCheckpointError:  # read again alone, which names the chunk in its error
                out.append(self.read_and_fill(job))
                continue
            if slot.target is not None:
                if not slot.filled:
                    self.place(rec, c, slot.target, by_path.get(job.path, ()))
                out.append((job.path, c, slot.target))
                continue
            assert chunk is not None
            self.place(rec, c, chunk, by_path.get(job.path, ()))
            out.append((job.path, c, chunk))
        return out, n if direct else 0

    def read_run_to_device(self, run: list[Read], bounce: Bounce) -> tuple[list[Placed], int]:
        """A run bound for GPU memory: read whole (around the page cache where it can) into a
        page-locked buffer, its last checksum's block into the buffer's tail, each chunk verified,
        then copied up on the bounce stream while the next runs are read. The buffer is reused
        once those copies are done."""
        span = run_span(self.records, run)
        assert span is not None
        file, start, end = span
        body = whole_blocks(end - CHECKSUM_BYTES - start)  # every chunk's data lies in here
        with bounce.lend() as (buf, tail):
            views = [buf[:body].numpy().data, tail[: whole_blocks(end - start) - body].numpy().data]
            try:
                n, direct = self.tier.read_vectored(f"{step_dir(self.step)}/{file}", start, views, direct=True)
            except OSError:
                n, direct = 0, False
            if n < end - start:  # cut short: each chunk alone, which reports it
                return [self.read_and_fill(job) for job in run], 0
            out = []
            where = self.tier.url
            with torch.cuda.stream(bounce.stream):
                for job in run:
                    rec = self.records[job.path]
                    c, nbytes = job.chunk, chunk_nbytes(rec)
                    _, offset = rec.location(c.key)
                    lo = offset - start
                    data = buf[lo : lo + nbytes]
                    rest: memoryview | bytes = views[0][lo + nbytes : lo + nbytes + CHECKSUM_BYTES]
                    if len(rest) < CHECKSUM_BYTES:  # the last checksum, past the body
                        rest = bytes(rest) + bytes(views[1][: lo + nbytes + CHECKSUM_BYTES - body])
                    try:
                        crc = rec.checksums[c.key]
                        verify_parts(data.numpy().data, rest, expected_crc=crc, nbytes=nbytes, where=where)
                    except CorruptCheckpointError:  # read again alone, which names the chunk in its error
                        out.append(self.read_and_fill(job))
                        continue
                    self.place(rec, c, data, self.by_path.get(job.path, ()), reused=True)
                    out.append((job.path, c, data.clone() if (job.path, c.coords) in self.sends else data))
        return out, n if direct else 0

    def receive_all(self) -> None:
        """Fill each chunk as it arrives, in posting order, beside the reads."""
        try:
            if self.device.type == "cuda":  # a new thread starts on GPU 0
                torch.cuda.set_device(self.device)
            for t, buf, op, in_place in self.recvs:
                try:
                    op.wait()
                except RuntimeError as e:
                    what = f"array {t.path!r} chunk {t.chunk.key}"
                    raise transfer_error(dist.get_rank(), global_rank(self.group, t.src), what, False, e) from None
                if self.errors or in_place:
                    continue  # every message is still taken in: no sender waits on this rank
                data = buf  # on the GPU for NCCL: filled there, never through host memory
                if t.shared:
                    assert self.sharing is not None
                    where = f"{self.tier.url}: step {self.step}: array {t.path!r} chunk {t.chunk.key}"
                    data = self.sharing.inbox.view(buf.cpu(), where=where)
                self.place(self.records[t.path], t.chunk, data, self.by_path[t.path])
        except BaseException as e:  # raised on the calling thread; the receives posted still land
            self.errors.append(e)

    def serve_all(self, jobs: list[Read]) -> None:
        """Serve ``jobs`` (``restore.serve``), on a thread of its own; its failure raised on the calling thread."""
        try:
            setup = (lambda: torch.cuda.set_device(self.device)) if self.device.type == "cuda" else None
            self.served = serve(self, jobs, setup)
        except BaseException as e:
            self.errors.append(e)

    def read_and_share(self, run: list[Read]) -> tuple[list[Placed], int]:
        """A run read, and its chunks for ranks on this host copied out, on the reading thread."""
        done, direct_bytes = self.read_run(run)
        if self.outbox is not None:
            for path, c, data in done:
                if (path, c.coords) in self.shared_out:
                    self.outbox.put((path, c.coords), data)
        return done, direct_bytes

    def send(self, path: str, c: Chunk, data: torch.Tensor) -> None:
        """Post the sends of a chunk read to the ranks that need it (on the calling thread)."""
        up = data if self.device.type == "cpu" else None  # on the group's GPU: copied up once, sent to all
        for dst, tag, shared in self.sends.get((path, c.coords), ()):
            if shared:
                out = (self.outbox.header((path, c.coords)) if self.outbox else unshared()).to(self.device)
            else:
                out = up = data.to(self.device) if up is None else up
            self.keep.append(out)
            self.order.post(dst, tag, functools.partial(self._isend, out, dst, tag, f"array {path!r} chunk {c.key}"))

    def _isend(self, out: torch.Tensor, dst: int, tag: int, what: str) -> None:
        peer = global_rank(self.group, dst)
        try:
            self.ops.append((dist.isend(out, dst=peer, group=self.group, tag=tag), peer, what))
        except RuntimeError as e:  # the connection to ``peer`` is known to be gone already
            raise transfer_error(dist.get_rank(), peer, what, True, e) from None


READ_RUN_BYTES = 64 << 20  # chunks that lie together in a pack are read together, up to this many bytes
READ_RUN_CHUNKS = 256  # and this many chunks (each its data and checksum buffers, and a gap: < 1024)


def share_key(group: Any, nodes: Nodes) -> str | None:
    """This rank's host for passing chunks through shared memory (``restore.share``): its node's
    ``Nodes.host``, a few digits, the same on every node of its host. None where it cannot share
    (no ``memfd_create``), or where the process group moves chunks in GPU memory (NCCL passes
    them between a host's GPUs itself)."""
    if dist.is_available() and dist.is_initialized() and comm_device(group).type != "cpu":
        return None
    return None if host_key() is None else str(nodes.host)

