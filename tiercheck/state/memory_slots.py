"""The memory tier's slots: where a save stages when the memory tier is on, and how a staged save
becomes a step of the memory tier without a copy.

A rank has ``MemoryOptions.slots`` slot files, ``<memory dir>/slots/rank-NNNNNN.K`` (``format.paths.slot_file``),
each mapped shared for the life of the process. A save takes one slot and stages into it each chunk at its
place in the rank's pack (the pack's own image, checksum trailers included), then the slot is
hard-linked into the memory tier's step directory as that rank's pack: the memory tier is a
directory of the same format as the node-local one, on a tmpfs, committed by the same vote, read by
the same restore. A hard link, not a rename: the slot keeps its own name, so withdrawing a step
(deleting its directory) never loses the slot.

The order that keeps a crash at any instant from restoring a torn slot (invariant 13): a slot is
taken only once the step it held is withdrawn (its commit marker deleted first, then its
directory), and its new step is committed only after every byte is staged and checksummed. The
slot of the newest committed memory step is never taken: with two slots, the next save stages
into the other one, or waits for it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tiercheck.errors import MemoryTierError, TiercheckError
from tiercheck.format.paths import COMMIT_FILE, PACKS_DIR, SLOTS_DIR, pack_file, slot_file, step_dir
from tiercheck.format.steps import list_steps
from tiercheck.state.memory_pool import MemoryTier, mapped_empty
from tiercheck.state.staging import ALIGN, Region, align_up
from tiercheck.tiers.private import PrivateTier, refusal

log = logging.getLogger("tiercheck")


class SlotPool:
    """One save's staging memory: its slot, where each run lands at its place in the pack (the
    pipeline's pool interface, without a ring: nothing is reused within a save)."""

    def __init__(self, buf: torch.Tensor) -> None:
        self._buf = buf

    @property
    def capacity(self) -> int:
        return self._buf.numel()

    def region(self, offset: int, nbytes: int) -> Region:
        """The region from ``offset`` in the slot (a run's place in the pack, less its lead)."""
        if offset < 0 or offset + nbytes > self.capacity:
            where = f"a run at {offset:,} of {nbytes:,} bytes"
            raise MemoryTierError(0, f"{where} is outside the {self.capacity:,}-byte slot of the memory tier")
        return Region(offset, nbytes)

    def view(self, region: Region, nbytes: int, start: int = 0) -> torch.Tensor:
        return self._buf[region.offset + start : region.offset + start + nbytes]

    def release(self, region: Region) -> None:
        region.freed = True  # the slot holds the bytes: they are the memory step's


@dataclass(eq=False)
class Slot:
    path: Path
    buf: torch.Tensor | None = None
    step: int | None = None  # the memory step whose pack is this slot (committed, or being saved)
    busy: bool = False  # a save in flight stages into it
    ident: tuple[int, int] | None = None  # (device, inode) of the file ``buf`` maps


class MemorySlots:
    """One rank's slots, and its part of the memory tier's steps (``root``: the memory directory)."""

    def __init__(self, memory: MemoryTier, rank: int, *, pin: bool = False) -> None:
        self.rank = rank
        self.pin = pin
        self.root = PrivateTier(memory.directory, top=memory.options.path)  # 0700/0600, no link followed
        self.root.create()
        # A link at any level (slots/, a slot file) is refused here, never mapped.
        self.slots = [Slot(self.root.path(slot_file(rank, k))) for k in range(memory.options.slots)]
        self._cond = threading.Condition()
        self.wait_s = memory.options.slot_wait_s
        self.before_reuse: Callable[[int], None] = lambda step: None  # waits for the copies of a step to peers
        self._adopt()

    def _adopt(self) -> None:
        """Learn which committed memory step each of this rank's slot files holds (a run before
        this one saved them): those are what a restart may restore, and the newest stays intact."""
        by_inode = {}
        for slot in self.slots:
            try:
                by_inode[os.lstat(slot.path).st_ino] = slot
            except FileNotFoundError:
                continue
        for step in list_steps(self.root).committed:
            try:
                inode = os.lstat(self.root.local_path / step_dir(step) / pack_file(self.rank)).st_ino
            except (FileNotFoundError, NotADirectoryError):
                continue
            if inode in by_inode:
                by_inode[inode].step = step

    def _holds(self, slot: Slot) -> bool:
        """Whether ``slot``'s step is still a committed memory step whose pack of this rank is this
        slot: a step withdrawn since (by a restore that passed over it, by the node's first rank, by
        an operator) holds no slot, whatever this process last knew."""
        if slot.step is None:
            return False
        d = step_dir(slot.step)
        try:
            os.lstat(self.root.path(f"{d}/{COMMIT_FILE}"))
            pack = os.lstat(self.root.path(f"{d}/{pack_file(self.rank)}"))
            mine = os.lstat(slot.path)
        except (OSError, TiercheckError):
            return False
        return (pack.st_dev, pack.st_ino) == (mine.st_dev, mine.st_ino)

    def _refresh(self) -> None:
        """Forget the step of every idle slot that no longer holds it (``_holds``)."""
        for slot in self.slots:
            if not slot.busy and slot.step is not None and not self._holds(slot):
                slot.step = None

    @property
    def newest(self) -> int | None:
        """The newest committed memory step an idle slot of this rank holds: kept intact (a restart
        restores it) while the next save stages into another slot."""
        held = [s.step for s in self.slots if not s.busy and s.step is not None]
        return max(held, default=None)

    def _free(self) -> Slot | None:
        """The slot a new save may take: one holding no step, else the one of the oldest step that
        is neither in flight nor the newest committed."""
        newest = self.newest
        idle = [s for s in self.slots if not s.busy and (s.step is None or s.step != newest)]
        if not idle:
            return None
        return min(idle, key=lambda s: -1 if s.step is None else s.step)  # steps are >= 0

    def _wait_free(self, step: int) -> Slot:
        """The slot ``_free`` names once there is one (under ``_cond``), waiting while a save in flight
        may give one back; ``MemoryTierError`` where none can come (no save in flight) or none came
        within ``MemoryOptions.slot_wait_s``: a save never blocks for ever."""
        self._refresh()
        deadline = time.monotonic() + self.wait_s
        while (slot := self._free()) is None:
            left = deadline - time.monotonic()
            if not any(s.busy for s in self.slots) or left <= 0:
                held = ", ".join(f"{s.path.name}: {'a save in flight' if s.busy else f'step {s.step}'}"
                                 for s in self.slots)  # fmt: skip
                why = "no save in flight can give one back" if left > 0 else f"none was given back in {self.wait_s:g} s"
                raise MemoryTierError(
                    errno.EBUSY,
                    f"no slot of the memory tier at {self.root.root} is free for the save of step {step} ({held}): "
                    f"{why}. The newest committed step keeps its slot; give the tier more slots "
                    "(MemoryOptions.slots) or wait for the saves in flight (Checkpointer.wait())",
                )
            self._cond.wait(timeout=left)
            self._refresh()
        return slot

    def take(self, step: int, nbytes: int) -> SlotPool:
        """A slot of at least ``nbytes`` for the save of ``step``, linked into the memory tier as
        this rank's pack of it; waits (``_wait_free``) while every slot is in flight or holds the
        newest step."""
        with self._cond:
            slot = self._wait_free(step)
            slot.busy = True
            old, slot.step = slot.step, None
        withdrawn = old is None
        try:
            if old is not None:
                self.before_reuse(old)
                self.withdraw(old)
                withdrawn = True
            for loose in self._loose():
                self.before_reuse(loose)
                self.withdraw(loose)
            # A step of this number already here (a try that failed, a run that did not restore it) stops
            # counting before a byte of this save lands in it. Its marker only: the node's other ranks
            # are linking their slots into the same directory.
            self.root.delete(f"{step_dir(step)}/{COMMIT_FILE}")
            buf = self._map(slot, align_up(max(nbytes, ALIGN)))
            self._link(slot, step)
            slot.step = step
            return SlotPool(buf)
        except BaseException as e:
            with self._cond:
                slot.busy = False
                if not withdrawn:  # its step is still committed: the slot still holds it
                    slot.step = old
                self._cond.notify_all()
            if isinstance(e, OSError) and not isinstance(e, TiercheckError):
                raise refusal(e, self.root.root, f"stage step {step} into its slot {slot.path.name}") from e
            raise

    def _loose(self) -> list[int]:
        """Committed memory steps older than the newest one this rank's slots hold, whose pack of
        this rank is no slot of its own (a replaced node's step, its files given back by its peers
        and written, not staged; a slot a run with more slots left): withdrawn as a slot's step
        would be, once a newer step holds a slot."""
        newest = self.newest
        if newest is None:
            return []
        mine = set()
        for slot in self.slots:
            with contextlib.suppress(OSError):
                st = os.lstat(slot.path)
                mine.add((st.st_dev, st.st_ino))
        loose = []
        for step in list_steps(self.root).committed:
            if step >= newest:
                break
            try:
                pack = os.lstat(self.root.local_path / step_dir(step) / pack_file(self.rank))
            except (FileNotFoundError, NotADirectoryError):
                continue  # none of this rank's: not this rank's to judge
            if (pack.st_dev, pack.st_ino) not in mine:
                loose.append(step)
        return loose

    def _map(self, slot: Slot, capacity: int) -> torch.Tensor:
        """Map ``slot`` (again) where it is unmapped, smaller than ``capacity``, or no longer its file as
        mapped: a file truncated under this process (its pages past the end would be a SIGBUS at the first
        store), replaced or removed. Checked with ``lstat`` before a byte is staged."""
        if slot.buf is not None:
            try:
                st: os.stat_result | None = os.lstat(self.root.path(f"{SLOTS_DIR}/{slot.path.name}"))
            except FileNotFoundError:
                st = None
            if st is None or (st.st_dev, st.st_ino) != slot.ident or st.st_size < slot.buf.numel():
                what = "removed" if st is None else "replaced" if (st.st_dev, st.st_ino) != slot.ident else "truncated"
                log.warning("the memory tier's slot file %s was %s under this process: mapped again", slot.path, what)
                slot.buf = None
        if slot.buf is None or slot.buf.numel() < capacity:
            slot.buf = None  # unmap before mapping again at the new size
            self.root.make_dirs(SLOTS_DIR)  # a link, or the root removed: refused, never made anew
            slot.buf = mapped_empty(slot.path, capacity, pin=self.pin)
            st = os.lstat(slot.path)
            slot.ident = (st.st_dev, st.st_ino)
        return slot.buf

    def _link(self, slot: Slot, step: int) -> None:
        """Link ``slot`` into the memory tier's ``step`` as this rank's pack (each level checked, no link followed)."""
        self.root.make_dirs(f"{step_dir(step)}/{PACKS_DIR}")
        target = self.root.path(f"{step_dir(step)}/{pack_file(self.rank)}")
        target.unlink(missing_ok=True)
        os.link(slot.path, target, follow_symlinks=False)

    def withdraw(self, step: int) -> None:
        """Remove a memory step: its commit marker first, then the rest (the slots stay)."""
        self.root.delete(f"{step_dir(step)}/{COMMIT_FILE}")
        self.root.delete_tree(step_dir(step))
        with self._cond:
            for slot in self.slots:
                if slot.step == step and not slot.busy:
                    slot.step = None  # it holds no step now: the next save may take it
            self._cond.notify_all()

    def done(self, step: int, *, committed: bool) -> None:
        """The save of ``step`` committed to memory, or failed (its memory step withdrawn)."""
        if not committed:
            try:
                self.root.delete(f"{step_dir(step)}/{COMMIT_FILE}")
                self.root.delete(f"{step_dir(step)}/{pack_file(self.rank)}")
            except OSError as e:  # the save's own failure is what its handle reports; this one is said
                log.warning("could not remove the failed save of step %d from the memory tier: %s", step, e)
        with self._cond:
            for slot in self.slots:
                if slot.step == step:
                    slot.busy = False
                    if not committed:
                        slot.step = None
            self._cond.notify_all()

    def unmap(self) -> None:
        """Give up this process's mappings (unmapped with the last reference: a save in flight keeps its own)."""
        with self._cond:
            for slot in self.slots:
                slot.buf = None

    def remove(self) -> None:
        """Delete this rank's slot files (a step linking one keeps its bytes until it is withdrawn),
        then ``slots/`` and the memory directory where nothing else is left in them: the node's last
        rank to close leaves no empty directory behind (one still in use is not empty)."""
        with self._cond, self.root.refusals("remove its slot files"):
            for slot in self.slots:
                slot.step = None
                slot.path.unlink(missing_ok=True)
            for directory in (self.root.root / SLOTS_DIR, self.root.root):
                with contextlib.suppress(OSError):  # not empty (another rank's, a step kept), or gone
                    os.rmdir(directory)

    def held(self) -> int:
        """Bytes this rank's slots hold mapped."""
        return sum(s.buf.numel() for s in self.slots if s.buf is not None)
