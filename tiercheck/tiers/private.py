"""The memory tier's root: a directory of its user alone, in a place every user of the node shares
(``/dev/shm``, invariant 14).

Anyone on the node may create names in ``/dev/shm``: a fixed path there can be planted in advance
(a link, a directory of theirs), and a directory made with the usual umask (0755) lets every user
read the model and optimizer state in it. So, from ``MemoryOptions.path`` down to the memory tier's
files:

* every directory the tier uses (the path and each directory it makes under it) is refused, with
  ``UnsafeCheckpointError`` naming the path, its owner and its mode, where it is a symbolic link, is
  owned by another user, or may be written by its group or by others; one of the user's own that
  others may only read is made 0700;
* what the tier creates is 0700 (directories) and 0600 (files), whatever the umask;
* every file is opened without following a symbolic link (``O_NOFOLLOW``), and every directory level
  under the root is checked (``LocalTier._abs``): a link planted there is refused, never followed;
* the refusals of its storage (the directory removed while a job runs, a read-only mount over it,
  a full tmpfs) are ``MemoryTierError`` naming the directory and what to do, not a raw ``OSError``.

Once the root is private, only its user (and root) can change what is under it: the checks of the
levels below it guard against what that user's own earlier runs or tools left there.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from tiercheck.errors import MemoryTierError, TiercheckError, UnsafeCheckpointError
from tiercheck.tiers.base import Buffer
from tiercheck.tiers.local import LocalTier, PackWriter, open_no_follow
from tiercheck.tiers.refusals import FULL, free_space

log = logging.getLogger("tiercheck")

DIR_MODE = 0o700
FILE_MODE = 0o600


def levels(top: str | os.PathLike[str], directory: str | os.PathLike[str]) -> list[Path]:
    """``top`` (``MemoryOptions.path``) and each directory from it down to ``directory``, absolute."""
    top_path, here = Path(os.path.abspath(top)), Path(os.path.abspath(directory))
    if not here.is_relative_to(top_path):  # not under it (never so today): both are checked all the same
        return [top_path, here]
    rel = here.relative_to(top_path).parts
    return [top_path, *(top_path.joinpath(*rel[: n + 1]) for n in range(len(rel)))]


def check_dir(path: Path) -> os.stat_result | None:
    """``path``'s status where it is a directory of this user's that no one else may write (None where
    nothing is there); refused otherwise: ``UnsafeCheckpointError``, or ``MemoryTierError`` (``ENOTDIR``)
    for a file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    me, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCheckpointError(
            f"{path} is a symbolic link (to {os.readlink(path)}): the memory tier never follows one in a place "
            "every user of the node may write; give MemoryOptions(path=) the directory itself"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise MemoryTierError(
            errno.ENOTDIR,
            f"{path} is a file, not a directory: the memory tier keeps its steps in a directory there. Remove "
            "the file, or give MemoryOptions(path=) another directory",
        )
    if st.st_uid != me:
        raise UnsafeCheckpointError(
            f"{path} is owned by uid {st.st_uid}, not by this process's uid {me} (mode {oct(mode)}): the memory "
            "tier keeps the model's state only where no other user may read it or plant files. Give "
            "MemoryOptions(path=) a directory of your own (the default, /dev/shm/tiercheck-<uid>, is one)"
        )
    if mode & 0o022:
        raise UnsafeCheckpointError(
            f"{path} (owner uid {st.st_uid}, mode {oct(mode)}) may be written by its group or by other users, who "
            f"could plant files or links in it: `chmod 700 {path}` if it is yours alone, or give "
            "MemoryOptions(path=) a directory of your own (the default, /dev/shm/tiercheck-<uid>, is one)"
        )
    return st


def check_levels(top: str | os.PathLike[str], directory: str | os.PathLike[str]) -> None:
    """Refuse (see ``check_dir``) any of the memory tier's directories from ``top`` down that exists
    and is not private to this user. Creates and changes nothing."""
    for level in levels(top, directory):
        if check_dir(level) is None:
            return


def _make_level(path: Path) -> None:
    """``path`` made 0700 (its parent exists), or checked and made 0700 where it was there already."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        st = check_dir(path)
        if st is not None and stat.S_IMODE(st.st_mode) != DIR_MODE:
            log.info("memory tier: made %s private (mode %s -> 0o700)", path, oct(stat.S_IMODE(st.st_mode)))
            os.chmod(path, DIR_MODE, follow_symlinks=False)
        return
    os.chmod(path, DIR_MODE)  # the umask may have taken bits away; none is added


def refusal(e: OSError, root: Path, doing: str) -> OSError:
    """``e``, raised while the memory tier tried ``doing`` (a phrase: "withdraw step 3") in its
    directory ``root``, as the library's error to raise ``from e`` (a tiercheck error as it is)."""
    if isinstance(e, TiercheckError):
        return e  # said already
    if not os.path.lexists(root):
        why = ("it was removed while this job ran: its steps are gone (the local directory's are not); the next "
               "Checkpointer started with MemoryOptions makes it again")  # fmt: skip
    elif e.errno == errno.EROFS:
        why = "it is read-only (a read-only mount over it?). Make it writable, or give MemoryOptions(path=) a tmpfs"
    elif e.errno in FULL:
        why = f"its tmpfs is full ({free_space(root)}). Give it more memory, or use fewer MemoryOptions.slots"
    else:
        why = f"{e.strerror or e}{f' ({e.filename})' if e.filename else ''}"
    return MemoryTierError(e.errno, f"the memory tier's directory {root}: could not {doing}: {why}")


class PrivateTier(LocalTier):
    """The memory tier's directory (``root``) under ``MemoryOptions.path`` (``top``): a ``LocalTier``
    without fsync (a tmpfs) that creates what it writes privately and says its refusals as
    ``MemoryTierError`` (see the module's docstring)."""

    def __init__(self, root: str | os.PathLike[str], *, top: str | os.PathLike[str]) -> None:
        super().__init__(root, fsync=False)
        self.top = Path(os.path.abspath(top))

    def create(self) -> None:
        """Make (0700) or check each directory from ``top`` down to the root; those above ``top`` that
        are missing are made 0700 too."""
        missing = [p for p in [self.top, *self.top.parents] if not os.path.lexists(p)]
        with self.refusals("create it"):
            for level in [*reversed(missing[1:]), *levels(self.top, self.root)]:
                _make_level(level)

    def path(self, rel: str) -> Path:
        """``rel`` under the root, each level below it checked: ``UnsafeCheckpointError`` for a link."""
        return self._abs(rel)

    def make_dirs(self, rel: str) -> Path:
        """The directory ``rel`` under the root, each missing level made 0700 (never the root: a root
        removed is ``MemoryTierError``), each existing one refused where it is a link or no directory."""
        here = self.root
        with self.refusals(f"make {rel}"):
            for part in Path(rel).parts:
                here = here / part
                try:
                    os.mkdir(here, DIR_MODE)
                except FileExistsError:
                    self._abs(str(here.relative_to(self.root)))  # a link: UnsafeCheckpointError
                    if not here.is_dir():
                        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(here)) from None
                else:
                    os.chmod(here, DIR_MODE)
        return here

    @contextlib.contextmanager
    def refusals(self, doing: str) -> Iterator[None]:
        """Raise what fails inside as ``refusal`` says."""
        try:
            yield
        except TiercheckError:
            raise
        except OSError as e:
            raise refusal(e, self.root, doing) from e

    def _make_parent(self, target: Path) -> None:
        self.make_dirs(str(target.parent.relative_to(self.root)))

    def _create(self, target: Path, flags: int) -> int:
        fd = open_no_follow(target, flags, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)  # whatever the umask; a file of an earlier run made private too
        except BaseException:
            os.close(fd)
            raise
        return fd

    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        with self.refusals(f"write {path}"):
            super().write(path, parts)

    def publish(self, path: str, data: bytes) -> None:
        with self.refusals(f"write {path}"):
            super().publish(path, data)

    def write_stream(self, path: str, pieces: Callable[[], Iterable[Buffer]], *, size: int | None = None) -> None:
        with self.refusals(f"write {path}"):
            super().write_stream(path, pieces, size=size)

    def open_pack(self, path: str) -> PackWriter:
        with self.refusals(f"write {path}"):
            return super().open_pack(path)

    def delete(self, path: str) -> None:
        with self.refusals(f"delete {path}"):
            super().delete(path)

    def delete_tree(self, path: str) -> None:
        with self.refusals(f"delete {path}"):
            super().delete_tree(path)
