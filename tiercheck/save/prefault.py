"""Pre-faulting the staging pool: before a single process's first save, fault in the host memory
its plan needs on a background thread, so that the first save copies at the speed of the ones
after it (``StagingOptions.prefault``). Whatever fails there (the state changing under it
included) is left for the first save to meet."""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable

from tiercheck.state.staging import HostPool

log = logging.getLogger("tiercheck")

_PREFAULTING: dict[threading.Thread, threading.Event] = {}  # pre-faulting threads, and how to stop each


class Prefaulter:
    """One Checkpointer's pre-faulting thread: ``start`` it with a function that plans under the
    Checkpointer's lock and says which pool to fault in how far (None: nothing to do); ``stop``
    it before a restore or a close."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def start(self, prepare: Callable[[threading.Event], tuple[HostPool, int] | None]) -> None:
        stop = threading.Event()
        self._thread = threading.Thread(target=_run, args=(prepare, stop), name="tiercheck-prefault", daemon=True)
        _PREFAULTING[self._thread] = stop
        self._thread.start()

    @property
    def thread(self) -> threading.Thread | None:
        """The thread started last, until ``stop``."""
        return self._thread

    def give_back(self, pool: HostPool | None) -> None:
        """Before a restore (or a close): stop pre-faulting and give ``pool`` (None: a pool in use
        by a save, kept) back until a save needs it. A restore at the start of a job reads into as
        much new memory; both at once cost it time and raised its peak by one snapshot."""
        if self.stop() and pool is not None:
            pool.drop()

    def stop(self) -> bool:
        """Stop pre-faulting and wait for the thread; whether one was started since the last stop."""
        if self._thread is None:
            return False
        stop = _PREFAULTING.get(self._thread)  # gone once the thread is done
        if stop is not None:
            stop.set()
        self._thread.join()
        self._thread = None
        return True


def _run(prepare: Callable[[threading.Event], tuple[HostPool, int] | None], stop: threading.Event) -> None:
    try:
        target = prepare(stop)
        if target is not None:
            pool, nbytes = target
            pool.reserve(nbytes, touch=stop)
    except Exception as e:
        log.debug("not pre-faulting the staging pool: %r", e)
    finally:
        _PREFAULTING.pop(threading.current_thread(), None)


def _stop_prefaulting_at_exit() -> None:
    """A daemon thread still in torch's zero_() when the interpreter finalizes aborts the process
    (it cannot take the GIL back): stop pre-faulting (within one piece) before that."""
    for thread, stop in list(_PREFAULTING.items()):
        stop.set()
        thread.join()


# Run at threading's shutdown, before the atexit callbacks: zarr's callback stops the event loop
# that a save plan's zarr documents are made on, and a pre-faulting thread still planning then
# waited on it forever, so the process never exited (1 exit in 6 in the DeepSpeed disk-full test).
# concurrent.futures stops its workers the same way; plain atexit where this Python lacks it.
getattr(threading, "_register_atexit", atexit.register)(_stop_prefaulting_at_exit)
