"""A step restored from the memory tier, persisted to the local directory beside training (invariant 15).

The step is committed in memory (by its save's vote) before the restore reads it: the copy to the
node-local directory protects it against a reboot, not against the crash the restart recovers from,
so nothing in it is on the restart's critical path. ``Persisting`` runs that copy on a thread of its
own, started by ``Memory.after_restore`` once ``restore()`` has its answer. Until it ends:

* the memory step it copies stays: a save that would reuse its slot waits for it
  (``MemorySlots.before_reuse``, as for the copies to peers), and a save of its step number is refused;
* the local tier (its retention, ``LocalSteps``) learns of the step only once it is committed there;
* ``Checkpointer.wait()`` and ``close()`` wait for it; ``stats()`` says where it stands
  (``memory_persist``: ``"pending"``, ``"done"`` or ``"failed"``; ``memory_persisted_step``;
  ``restore_persist_s``), and the log says when the step is on the local directory (or why not).

A kill while it runs leaves the memory step committed and restorable, and at most a partial step in
the local directory, which the next start removes (``LocalSteps``) or a copy of the same save resumes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("tiercheck")

NOT_STARTED: dict[str, Any] = {"memory_persist": None, "memory_persisted_step": None, "restore_persist_s": None}
"""``Persisting.stats()`` where no restore from memory had a step to persist."""


class Persisting:
    """The copy of memory step ``step`` to the local directory, by ``copy`` (True: committed there;
    False: not, said by ``copy`` in the log), on a thread named ``tiercheck-persist``."""

    def __init__(self, step: int, copy: Callable[[], bool]) -> None:
        self.step = step
        self.seconds: float | None = None
        self.persisted: bool | None = None  # None: still running
        self._done = threading.Event()
        # Not a daemon: an interpreter that exits first waits for it (its Checkpointer's close at exit
        # would, too), instead of killing a copy halfway through a file.
        self._thread = threading.Thread(target=self._run, args=(copy,), name="tiercheck-persist")
        self._thread.start()

    def _run(self, copy: Callable[[], bool]) -> None:
        t0 = time.perf_counter()
        ok = False
        try:
            ok = copy()
        except Exception as e:  # the restore succeeded: a failed copy costs only the next reboot's restart
            log.error("could not persist step %d from the memory tier to the local directory (it stays in "
                      "memory, and a clean close tries again): %s: %s", self.step, type(e).__name__, e)  # fmt: skip
        finally:
            self.seconds = time.perf_counter() - t0
            self.persisted = ok
            self._done.set()

    def pending(self) -> bool:
        """Whether the copy is still running."""
        return not self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the copy has ended (committed or not); False: still running after ``timeout`` s."""
        return self._done.wait(timeout)

    def stats(self) -> dict[str, Any]:
        """Where the copy stands, for ``Checkpointer.stats()`` (see the module's docstring)."""
        if self.pending():
            return {"memory_persist": "pending", "memory_persisted_step": None, "restore_persist_s": None}
        return {
            "memory_persist": "done" if self.persisted else "failed",
            "memory_persisted_step": self.step if self.persisted else None,
            "restore_persist_s": self.seconds,
        }
