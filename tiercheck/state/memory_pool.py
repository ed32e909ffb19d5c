"""The memory tier's host memory: slot files on a tmpfs, mapped shared, and the bound checked at start.

With ``MemoryOptions``, a rank stages each save into one of its slot files (``state.memory_slots``),
mapped shared: the snapshot a save stages is written into the file's pages, so it outlives the
process without a second copy. A file is reserved in full (``posix_fallocate``) before it is mapped,
so a tmpfs too small fails there with ``ENOSPC`` rather than with a SIGBUS on the first write to a
page it cannot give. ``check_bound`` runs before any of it: the tier's bytes against the tmpfs's
free space and the cgroup's memory limit (tmpfs pages are charged to the cgroup of the process that
touches them).

The directory id names the node-local directory, not the lineage: a run's lineage is settled only
once it restores or saves (``tiering.lineage``). Binding the memory's steps to the lineage is the
``OWNER`` file's job (``tiercheck.memory``).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import stat
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiercheck.errors import InvalidArgumentError, MemoryTierError, UnsafeCheckpointError
from tiercheck.format.paths import SLOT_FILES, memory_dir
from tiercheck.libc import RAMFS_MAGIC, TMPFS_MAGIC, filesystem_type
from tiercheck.options import MemoryOptions
from tiercheck.state.flatten import tensor_sizes
from tiercheck.state.staging import align_up
from tiercheck.tiers.local import open_no_follow
from tiercheck.tiers.private import check_levels

log = logging.getLogger("tiercheck")

CGROUP_ROOT = "/sys/fs/cgroup"  # tests point these two at a fake cgroup directory and file
SELF_CGROUP = "/proc/self/cgroup"
_LIMIT_FILES = (("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes"))  # v2, v1
_READ_LIMIT = 4096  # a cgroup file holds one number: never read more


def pool_dir(options: MemoryOptions, local: str) -> Path:
    """Where the slot files and steps of the ranks that save to ``local`` live (``paths.memory_dir``)."""
    return memory_dir(options.path, local)


@dataclass(frozen=True, slots=True)
class MemoryTier:
    """A Checkpointer's memory tier: its options and its directory (``state.memory_slots``)."""

    options: MemoryOptions
    directory: Path


def start(
    options: MemoryOptions | None,
    local: str | os.PathLike[str],
    state: Mapping[str, Any],
) -> MemoryTier | None:
    """The memory tier of a Checkpointer saving ``state`` to ``local`` (None without ``options``), once
    its directories, where they exist, proved private to this user (``tiers.private.check_levels``:
    ``UnsafeCheckpointError``, or ``MemoryTierError`` for a file) and ``check_bound`` found room for it
    (``MemoryTierError`` otherwise). Creates nothing: the pool file is made with the pool."""
    if options is None:
        return None
    if not isinstance(options, MemoryOptions):
        raise InvalidArgumentError(f"memory must be a MemoryOptions or None, not {type(options).__qualname__}")
    directory = pool_dir(options, os.path.abspath(local))
    check_levels(options.path, directory)
    bound = pool_bound(state)
    check_bound(options, directory, bound, local_ranks())
    warn_unless_memory(Path(os.fspath(options.path)))
    every = options.persist_every
    log.info("memory tier at %s: every save commits there (%d slots of %.1f MiB for this rank); %s to %s too",
             directory, options.slots, bound / 2**20,
             "each" if every == 1 else f"those of a step divisible by {every}", local)  # fmt: skip
    return MemoryTier(options, directory)


def warn_unless_memory(path: Path) -> None:
    """Warn where ``MemoryOptions.path`` (or the nearest directory above it that exists) is not on a
    tmpfs: the tier still works, but its slot files are a disk's, written back to it, so a save to
    "memory" goes at the disk's pace, and the bound checked is the disk's free space."""
    existing = path.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    kind = filesystem_type(os.fspath(existing))
    if kind is not None and kind not in (TMPFS_MAGIC, RAMFS_MAGIC):
        log.warning(
            "MemoryOptions.path %s is not on a tmpfs (%s is on a filesystem of type %#x): the memory tier's files "
            "are written back to that disk, at its pace; give it a directory on a tmpfs, such as /dev/shm",
            path, existing, kind,
        )  # fmt: skip


def pool_bound(state: Mapping[str, Any]) -> int:
    """A slot's size for the start-up check: this rank's tensors as they are now, each rounded to a
    page. A slot holds a whole snapshot (the pack's image), whatever ``StagingOptions.max_host_bytes``
    bounds the ring pool to. An estimate: chunks padded at an edge, and optimizer state made at its
    first step, take more; the slot file's reservation is the exact check, still before a byte is
    written."""
    return sum(align_up(n) for n in tensor_sizes(state))


def local_ranks() -> int:
    """Ranks on this node, whose pools share its tmpfs: torchrun's ``LOCAL_WORLD_SIZE``, else 1."""
    try:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


def _read_number(path: Path) -> int | None:
    """The integer in a cgroup file; None where it says ``max``, is missing or cannot be read."""
    try:
        with open(path, "rb") as f:
            text = f.read(_READ_LIMIT).decode("ascii", "replace").strip()
    except OSError:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _own_cgroups(base: Path) -> list[Path]:
    """The directories under ``base`` that may hold this process's memory limits, innermost first:
    its own cgroup and each parent (a parent's limit binds too), then ``base`` itself (inside a
    container, ``/proc/self/cgroup`` names a path of the host's that the container's view lacks)."""
    try:
        with open(SELF_CGROUP, "rb") as f:
            lines = f.read(_READ_LIMIT * 4).decode("utf-8", "replace").splitlines()
    except OSError:
        lines = []
    out: list[Path] = []
    for line in lines:  # v2: "0::/a/b"; v1: "4:memory:/a/b"
        _, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if controllers and "memory" not in controllers.split(","):
            continue
        under = base if controllers == "" else base / "memory"
        parts = Path(rel.strip() or "/").relative_to("/").parts
        out.extend(under.joinpath(*parts[:n]) for n in range(len(parts), 0, -1))
    return [*out, base, base / "memory"]


def cgroup_room(root: str | os.PathLike[str] | None = None) -> tuple[int | None, int]:
    """(the memory limit that leaves this process the least room, that cgroup's usage); (None, 0)
    where no limit is set. cgroup v2's ``memory.max`` and ``memory.current``, else v1's ``memory.limit_in_bytes`` and
    ``memory.usage_in_bytes``, in this process's cgroup and its parents under ``root`` (default
    ``CGROUP_ROOT``). v1 says "no limit" with a huge number (a page short of 2**63), taken as None."""
    best: tuple[int | None, int] = (None, 0)
    for directory in _own_cgroups(Path(CGROUP_ROOT if root is None else root)):
        for limit_name, usage_name in _LIMIT_FILES:
            limit = _read_number(directory / limit_name)
            if limit is None or limit >= 1 << 62:
                continue
            usage = _read_number(directory / usage_name) or 0
            if best[0] is None or limit - usage < best[0] - best[1]:
                best = (limit, usage)
    return best


def _existing_bytes(directory: Path) -> int:
    """Bytes the pool files already in ``directory`` hold (reused: they need no new room)."""
    try:
        return sum(p.lstat().st_blocks * 512 for p in directory.glob(SLOT_FILES))  # a link: 0, not its target
    except OSError:
        return 0


def check_bound(
    options: MemoryOptions, directory: Path, pool_bytes: int, ranks: int, *, cgroup_root: str | None = None
) -> None:
    """Refuse with ``MemoryTierError`` where the node's ``ranks`` pools of ``slots x pool_bytes`` each
    do not fit the tmpfs at ``options.path`` or the cgroup's memory limit. Creates nothing."""
    need = options.slots * pool_bytes * ranks
    probe = Path(os.fspath(options.path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # the tmpfs the directory will be made on
    reused = _existing_bytes(directory)
    st = os.statvfs(probe)
    free = st.f_bavail * st.f_frsize + reused
    limit, usage = cgroup_room(cgroup_root)
    room = None if limit is None else max(limit - usage, 0) + reused
    if need <= free and (room is None or need <= room):
        return
    why = (
        f"the tmpfs at {probe} has {free:,} bytes free"
        if need > free
        else f"the cgroup's memory limit of {limit:,} bytes ({usage:,} in use) leaves {room:,}"
    )
    raise MemoryTierError(
        errno.ENOSPC,
        f"the memory tier at {os.fspath(options.path)} needs {need:,} bytes ({options.slots} slots x "
        f"{pool_bytes:,} bytes x {ranks} rank(s) on this node) but {why} (tmpfs free: {free:,} bytes; "
        f"cgroup limit: {'none' if limit is None else f'{limit:,} bytes'}). Give it more memory (a "
        "bigger --shm-size, an emptyDir of medium Memory with a bigger sizeLimit, a higher memory "
        "limit), or need less: fewer MemoryOptions.slots, or less state per rank (each slot holds a whole snapshot)",
    )


def mapped_empty(path: Path, nbytes: int, *, pin: bool) -> torch.Tensor:
    """``nbytes`` of uint8 memory mapped shared from ``path`` (created, or grown, and reserved in
    full: ``MemoryTierError`` where the tmpfs cannot give them), page-locked with
    ``cudaHostRegister`` when ``pin`` and CUDA is there. The file's bytes already there stay: it is
    the snapshot a later run may restore. Unmapped (and unregistered) with the last reference.

    The file is opened without following a link, must be a regular file of this user's, and is made
    0600 (``tiers.private``): ``UnsafeCheckpointError`` otherwise, never a mapping of what a link names."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # the memory tier made and checked it already
    created = not os.path.lexists(path)
    fd = _open_own(path)
    try:
        try:
            if os.fstat(fd).st_size < nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            if created:
                path.unlink(missing_ok=True)  # leave no empty pool file a later run would take for one
            raise MemoryTierError(
                e.errno, f"cannot reserve {nbytes:,} bytes for the memory tier's pool file {path}: {e.strerror}"
            ) from e
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping holds the file
    view = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(view)
    del view  # an exported buffer would keep the mapping from being closed
    cudart = torch.cuda.cudart() if pin and torch.cuda.is_available() else None
    registered = False
    if cudart is not None:
        status = cudart.cudaHostRegister(address, nbytes, 0)
        registered = int(getattr(status, "value", status)) == 0
        if not registered:
            log.warning("could not page-lock the memory tier's %d bytes with cudaHostRegister (%s)", nbytes, status)
    memory = (ctypes.c_char * nbytes).from_address(address)
    weakref.finalize(memory, _unmap, mapping, cudart if registered else None, address).atexit = False
    log.info("memory tier: %.1f MiB mapped from %s", nbytes / 2**20, path)
    return torch.frombuffer(memory, dtype=torch.uint8)  # holds ``memory``


def _open_own(path: Path) -> int:
    """``path`` opened for reading and writing (made 0600 where missing): a regular file of this user's."""
    try:
        fd = open_no_follow(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeCheckpointError(f"{path} is a symbolic link; the memory tier never maps what one names") from e
        raise MemoryTierError(e.errno, f"cannot open the memory tier's slot file {path}: {e.strerror}") from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise UnsafeCheckpointError(
            f"{path} is not a regular file of this user's (owner uid {st.st_uid}, {stat.filemode(st.st_mode)}): "
            "the memory tier maps only its own slot files"
        )
    os.fchmod(fd, 0o600)  # whatever the umask made it
    return fd


def _unmap(mapping: mmap.mmap, cudart: Any, address: int) -> None:
    if cudart is not None:
        cudart.cudaHostUnregister(address)
    mapping.close()  # the file stays, and its pages with it
