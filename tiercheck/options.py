"""Option groups, one frozen keyword-only dataclass per concern; one option, one meaning."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tiercheck.errors import InvalidArgumentError

MiB = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class StagingOptions:
    """How a save copies device state into host memory.

    Attributes:
        mode:
            ``"eager"``: ``save()`` returns once every tensor is copied to host memory.
            ``"lazy"``: ``save()`` returns at once; the copy of parameters and optimizer state
            overlaps the next forward/backward, and any ``optimizer.step()`` (or
            :meth:`Checkpointer.wait_staged`) blocks until the copy is complete. Plain tensors and
            module buffers (which a forward pass may change, e.g. BatchNorm statistics) are still
            copied before ``save()`` returns.
            ``"auto"``: lazy when the state holds a ``torch.optim.Optimizer`` (the hook that makes
            lazy safe needs one), eager otherwise.
        max_host_bytes:
            Upper bound on the host staging pool. ``None`` sizes it to one snapshot of the state.
            A smaller bound still works: staging then waits for chunks to be written out, so
            ``save()`` (or the next ``optimizer.step()`` in lazy mode) blocks longer.
        if_busy:
            What a ``save()`` does while an earlier save is still being written: ``"wait"``
            queues it (and may block for pool memory), ``"skip"`` drops it with a warning and
            returns a handle whose ``skipped`` is True.
        pin_memory:
            Page-lock the pool. ``None``: when the state holds CUDA tensors.
        prefault:
            In a single process, allocate the pool and touch every page of it on a background thread,
            so the first save does not pay for the page faults (about 0.5 s per GiB on a VM): when the
            Checkpointer is built, or where its local directory holds committed steps, once
            ``restore()`` is done (a restore reads into as much new memory; both at once slowed it).
            Sized to the state as it is then: an optimizer whose state appears at its first step grows
            the pool at the first save.
    """

    mode: Literal["auto", "lazy", "eager"] = "auto"
    max_host_bytes: int | None = None
    if_busy: Literal["wait", "skip"] = "wait"
    pin_memory: bool | None = None
    prefault: bool = True

    def lazy_for(self, has_optimizer: bool) -> bool:
        """Whether saves of a state copy lazily: ``"lazy"``, or ``"auto"`` where the state holds
        an optimizer (its ``step()`` is the hook a lazy copy waits at)."""
        return self.mode == "lazy" or (self.mode == "auto" and has_optimizer)

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "lazy", "eager"):
            raise InvalidArgumentError(f"StagingOptions.mode must be 'auto', 'lazy' or 'eager', not {self.mode!r}")
        if self.if_busy not in ("wait", "skip"):
            raise InvalidArgumentError(f"StagingOptions.if_busy must be 'wait' or 'skip', not {self.if_busy!r}")
        if self.max_host_bytes is not None and self.max_host_bytes <= 0:
            raise InvalidArgumentError(f"StagingOptions.max_host_bytes must be positive, not {self.max_host_bytes}")


@dataclass(frozen=True, kw_only=True, slots=True)
class WriteOptions:
    """How staged bytes are laid out and persisted.

    Attributes:
        chunk_bytes: target size of one zarr chunk (and of one staging/write unit).
        io_threads: concurrent chunk writes and reads.
        fsync: fsync every file and directory before commit. Turning it off forfeits crash safety
            and exists only for measurements.
        direct_io: write large chunks to the local tier with O_DIRECT, straight from the staging
            pool to the device. This skips the kernel's copy into the page cache (CPU time the
            training loop would otherwise lose) and keeps checkpoints from evicting useful cache.
            A restore reads big chunks back with O_DIRECT too, where the page cache does not hold
            them. Where the filesystem refuses O_DIRECT, tiercheck falls back to buffered I/O.
        nice: niceness added to tiercheck's I/O threads (Linux), which checksum and write chunks and
            have until the next save to do it: when CPU is short the training loop's threads win.
            0 (the default) runs them at the training's priority: on the 2-core benchmark machine,
            where training saturates every core, 10 did not lower the stall and made saves durable
            later. Worth trying where data loaders or host-side work compete for the CPU. The
            staging copy is never niced: training waits for it.
        take_over: write into a local directory or remote prefix that holds another lineage's steps
            (another run's, which this one did not restore from), making it this run's. Without it the
            first ``save()`` refuses with ``LineageError``. Its steps stay until retention deletes them;
            steps this run saves under the same numbers replace them on the remote.
    """

    chunk_bytes: int = 64 * MiB
    io_threads: int = 4
    fsync: bool = True
    direct_io: bool = True
    nice: int = 0
    take_over: bool = False

    def __post_init__(self) -> None:
        if self.chunk_bytes < 4096:
            raise InvalidArgumentError(f"WriteOptions.chunk_bytes must be at least 4096, not {self.chunk_bytes}")
        if not 0 <= self.nice <= 19:
            raise InvalidArgumentError(f"WriteOptions.nice must be between 0 and 19, not {self.nice}")
        if self.io_threads < 1:
            raise InvalidArgumentError(f"WriteOptions.io_threads must be at least 1, not {self.io_threads}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RetentionOptions:
    """Which committed steps a tier keeps. The newest committed step is never deleted.

    Attributes:
        keep_last: keep this many newest committed steps (``None``: keep all).
        keep_every: additionally keep every step that is a multiple of this forever.
        keep: called before each pass over a node's local steps: steps to keep besides (a
            framework's own records still name them, say Lightning's checkpoint files).
    """

    keep_last: int | None = 3
    keep_every: int | None = None
    keep: Callable[[], Iterable[int]] | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise InvalidArgumentError(f"RetentionOptions.keep_last must be at least 1 or None, not {self.keep_last}")
        if self.keep_every is not None and self.keep_every < 1:
            raise InvalidArgumentError(f"RetentionOptions.keep_every must be at least 1 or None, not {self.keep_every}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DistributedOptions:
    """How the ranks of a ``torch.distributed`` job cooperate.

    Attributes:
        timeout_s: how long a rank waits for the others (to agree on a save plan, to finish writing
            a step, to agree on a restore) before it gives the step up with ``CoordinationError``.
            A rank that died mid-save is noticed after this long: no step it was part of commits.
        read_once: on restore, each needed chunk is read from storage by one rank in the whole job
            and sent to every other rank needing it, instead of once by each node that needs it and
            holds it (the default): less storage traffic, more network traffic. Either way the ranks
            of one node never read a chunk twice.
        share_memory: on restore, ranks of one host pass chunks to each other through shared memory
            (an anonymous memory file each reading rank reads its chunks into, once) instead of
            through the process group; only a small header crosses the group, and a live tensor whose
            every chunk is in such memory is copied into from there, with no staging memory of its
            own. Used with CPU process groups (gloo); a NCCL group passes chunks between a host's GPUs
            itself. Ranks of one host must share a PID namespace and user.
        enabled: None (default): cooperate with the other ranks whenever torch.distributed is
            initialized. False: this process checkpoints alone even then (say, rank 0 saving a
            consolidated copy); its tensors are then all its own.
    """

    timeout_s: float = 900.0
    read_once: bool = False
    share_memory: bool = True
    enabled: bool | None = None

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise InvalidArgumentError(f"DistributedOptions.timeout_s must be positive, not {self.timeout_s}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryOptions:
    """Retries of remote-tier requests that failed transiently (throttling such as SlowDown, 5xx,
    connection resets, timeouts, a server that is down), with exponential backoff and full jitter.
    Permanent failures (no such bucket, access denied) are never retried.

    Attributes:
        attempts: tries per request, the first included.
        initial_backoff_s: the first backoff; it grows from there to at most ``max_backoff_s``.
        max_backoff_s: the longest backoff between two tries.
        deadline_s: give a request up after this long, whatever ``attempts`` says.
    """

    attempts: int = 10
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    deadline_s: float = 900.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise InvalidArgumentError(f"RetryOptions.attempts must be at least 1, not {self.attempts}")
        if not (0 < self.initial_backoff_s <= self.max_backoff_s) or not self.deadline_s > 0:
            raise InvalidArgumentError("RetryOptions: need 0 < initial_backoff_s <= max_backoff_s and deadline_s > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class DrainOptions:
    """How committed local steps are copied to the remote tier, in the background.

    Attributes:
        every: drain only steps divisible by this (1: every step).
        backlog: what to do when newer steps commit locally while a drain is still running:
            ``"newest"`` drains only the newest waiting step and skips the others (reported in
            ``status()`` and on their handles); ``"all"`` drains every waiting step in order.
        concurrency: files uploaded at once per node (the packs of a node's ranks, side by side).
        part_concurrency: parts in flight at once per node, all its files together: each large file
            goes as a multipart upload (S3) or staged blocks (Azure), each part retried on its own, and
            a reader runs ahead of the uploads by the free slots. The node's upload memory is bounded
            by ``part_concurrency x part_bytes`` (128 MiB by default; ``stats()["drain_part_buffer_bytes"]``).
            16 parts keep a node's link busy at 100-300 MB/s per stream (2-5 GB/s in all) as object
            stores serve it; remote restores read with as many ranged GETs in flight.
        part_bytes: multipart part size for large files (larger where an object needs more than
            10,000 parts, S3's limit), and the size of a remote restore's ranged GETs. 8 MiB is the
            AWS CRT's and boto3's default; on SeaweedFS it cost the client 24% and the server 9% less
            CPU per GiB uploaded than 16 MiB.
        retention: which remote steps to keep; the newest committed one is never deleted.
        retry: retries of each request.
    """

    every: int = 1
    backlog: Literal["newest", "all"] = "newest"
    concurrency: int = 8
    part_concurrency: int = 16
    part_bytes: int = 8 * MiB
    retention: RetentionOptions = RetentionOptions(keep_last=None)
    retry: RetryOptions = RetryOptions()

    def __post_init__(self) -> None:
        if self.every < 1:
            raise InvalidArgumentError(f"DrainOptions.every must be at least 1, not {self.every}")
        if self.backlog not in ("newest", "all"):
            raise InvalidArgumentError(f"DrainOptions.backlog must be 'newest' or 'all', not {self.backlog!r}")
        if self.concurrency < 1:
            raise InvalidArgumentError(f"DrainOptions.concurrency must be at least 1, not {self.concurrency}")
        if self.part_concurrency < 1:
            raise InvalidArgumentError(f"DrainOptions.part_concurrency must be at least 1, not {self.part_concurrency}")
        if self.part_bytes < 5 * MiB:
            raise InvalidArgumentError(
                f"DrainOptions.part_bytes must be at least 5 MiB (the S3 minimum), not {self.part_bytes}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ParityOptions:
    """Parity in place of whole copies for the memory tier's steps: Reed-Solomon coding over groups of
    ``data + parity`` nodes (``tiering.parity``). Each node keeps its own snapshot and ``parity / data``
    of it in parity, and its group survives any ``parity`` of its nodes lost at once: a replaced node
    rebuilds its files from the others' data and parity. With ``data=4, parity=2`` a node holds 1.5x
    its snapshot (plus its other slots) where two whole copies hold 3x, and survives two losses where
    one copy survives one. Nodes are grouped ``ReplicationOptions.jump`` apart (each group across
    failure domains, as copies are placed); where the node count is not a multiple of the group size,
    the last group takes the rest (more data per stripe: less parity each), and a job of fewer nodes
    is one group (it needs more than ``parity`` nodes).

    Attributes:
        data: data pieces per stripe (``k``): each node's snapshot is cut into this many pieces.
        parity: parity pieces per stripe (``m``): the node losses a group survives.
    """

    data: int = 4
    parity: int = 2

    def __post_init__(self) -> None:
        for name in ("data", "parity"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"ParityOptions.{name} must be a positive integer, not {value!r}")
        if self.data + self.parity > 256:
            raise InvalidArgumentError(
                f"ParityOptions: data + parity must be at most 256 (Reed-Solomon over GF(2^8)), "
                f"not {self.data + self.parity}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicationOptions:
    """Copies of each node's committed local steps on other nodes' local tiers (peer replication), so
    that a lost node restores from its peers instead of the remote tier.

    Attributes:
        replicas: how many other nodes hold a copy of each node's files of a step.
        jump: nodes between a node and the first holder of its copies, and between holders (NVIDIA
            resiliency-ext's ``replication_jump``, counted in nodes numbered by their first rank). Set it to
            the number of nodes in a failure domain (a rack, a power domain) so that the copies land in other
            domains. ``None``: 1 (every node its own domain).
        every: replicate only steps divisible by this.
        piece_bytes: bytes read, sent and written at a time per peer; a receiving leader holds up to three
            pieces per peer while they are written (the memory replication holds about that).
        timeout_s: how long a leader waits on a peer (to connect, for one piece) before it leaves that peer out.
        parity: the memory tier's steps protected by parity over groups of nodes (``ParityOptions``)
            instead of ``replicas`` whole copies; the local tier keeps its copies. ``None``: copies.
    """

    replicas: int = 1
    jump: int | None = None
    every: int = 1
    piece_bytes: int = 16 * MiB
    timeout_s: float = 300.0
    parity: ParityOptions | None = None

    def __post_init__(self) -> None:
        if self.parity is not None and not isinstance(self.parity, ParityOptions):
            raise InvalidArgumentError(
                f"ReplicationOptions.parity must be a ParityOptions or None, not {self.parity!r}"
            )
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise InvalidArgumentError(f"ReplicationOptions.replicas must be a positive integer, not {self.replicas!r}")
        if self.jump is not None and (not isinstance(self.jump, int) or self.jump < 1):
            raise InvalidArgumentError(f"ReplicationOptions.jump must be a positive integer or None, not {self.jump!r}")
        if self.every < 1:
            raise InvalidArgumentError(f"ReplicationOptions.every must be at least 1, not {self.every}")
        if self.piece_bytes < 1 << 16:
            raise InvalidArgumentError(
                f"ReplicationOptions.piece_bytes must be at least 64 KiB, not {self.piece_bytes}"
            )
        if not self.timeout_s > 0:
            raise InvalidArgumentError(f"ReplicationOptions.timeout_s must be positive, not {self.timeout_s}")


# Per user (effective uid): /dev/shm is every user's, and a fixed name there could be planted in advance.
DEFAULT_MEMORY_PATH = f"/dev/shm/tiercheck-{os.geteuid()}"


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryOptions:
    """The memory tier: saves staged into files on a tmpfs that outlive the process, committed there,
    so a crash of the training process (a SIGKILL included) restarts from RAM. Opt-in:
    ``Checkpointer(memory=None)`` (the default) stages into ordinary process memory.

    Each rank has ``slots`` slot files under ``<path>/<directory id>/slots/``, mapped shared (and
    page-locked where CUDA tensors are staged). A save stages straight into one, as the image of its
    pack, and is committed to the memory tier (a directory of the usual format, its packs hard links
    to the slots) by a vote of every rank: the staging is the copy that survives. A restart restores
    from memory where it holds the newest step every rank can get, and falls back to the local and
    remote tiers where it does not, or where its copy is damaged or another lineage's. The directory
    id names the node-local directory (a hash of its path). The bytes the tier needs (``slots`` x
    one snapshot per rank) are checked when the Checkpointer starts, before it creates anything,
    against the tmpfs's free space and the cgroup's memory limit. With ``Checkpointer(replication=)`` on
    several nodes, each node's memory steps are copied to ``replicas`` peers' memory too (a replaced
    node restores from there); a slot is reused only once its step's copies are over.

    Attributes:
        path: the tmpfs directory that holds the slot files (``/dev/shm`` is a tmpfs on Linux; a
            container's is 64 MiB unless ``--shm-size`` or an ``emptyDir`` of medium ``Memory`` says more).
            The default, ``/dev/shm/tiercheck-<uid>`` (``DEFAULT_MEMORY_PATH``), is the user's own:
            ``/dev/shm`` is shared by every user of the node. What the tier makes there is 0700/0600,
            and a path that is a link, another user's, or writable by its group or others is refused
            (``UnsafeCheckpointError``; docs/concepts/tiers.md, "Security").
        slots: snapshots the tier holds per rank (at least 2: the newest committed step stays intact
            while the next one stages; a save waits while no slot is free).
        persist_every: which saves also go to the node-local directory: those of a step that is a
            multiple of it (1: every save). The others are committed in memory only
            (``SaveHandle.persisted`` is False); the newest of them is persisted at a clean close,
            and by the run that restores it after a crash.
        keep_at_close: keep the memory tier's steps and slot files after a clean ``close()`` (a next
            job on this node then restarts from memory); False gives the memory back once the newest
            step is persisted to the local directory.
        slot_wait_s: how long a save waits for a slot while every one is in flight or holds the
            newest committed step; then the save fails with ``MemoryTierError`` (it never blocks for
            ever; it fails at once where no save in flight could give a slot back).
    """

    # str | Path, not str | os.PathLike: tyro (torchtitan's command line) can build these, and calls a field whose
    # type it cannot build "fixed" to its default. Any os.PathLike is still accepted (__post_init__).
    path: str | Path = DEFAULT_MEMORY_PATH
    slots: int = 2
    persist_every: int = 1
    keep_at_close: bool = False
    slot_wait_s: float = 600.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.slot_wait_s, bool)
            or not isinstance(self.slot_wait_s, int | float)
            or not 0 < self.slot_wait_s < float("inf")
        ):
            raise InvalidArgumentError(f"MemoryOptions.slot_wait_s must be a positive number, not {self.slot_wait_s!r}")
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise InvalidArgumentError(f"MemoryOptions.path must be a non-empty path, not {self.path!r}")
        if not isinstance(self.slots, int) or isinstance(self.slots, bool) or self.slots < 2:
            raise InvalidArgumentError(f"MemoryOptions.slots must be an integer of at least 2, not {self.slots!r}")
        if not isinstance(self.keep_at_close, bool):
            raise InvalidArgumentError(f"MemoryOptions.keep_at_close must be a bool, not {self.keep_at_close!r}")
        if not isinstance(self.persist_every, int) or isinstance(self.persist_every, bool) or self.persist_every < 1:
            raise InvalidArgumentError(
                f"MemoryOptions.persist_every must be a positive integer, not {self.persist_every!r}"
            )
