"""A process of its own that dies by SIGKILL, as a crashed training job does: forked from the fork
server (torch and tiercheck imported, ``tests.distributed.fork_server``) rather than a fresh
interpreter, so a test's crash costs a fraction of a second instead of an import of torch."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable
from typing import Any

from tests.distributed import fork_server


def die(target: Callable[..., None], *args: Any, announces: bool = False, timeout: float = 300) -> None:
    """Run ``target(*args)`` in a process of its own that must end by SIGKILL: its own (it kills
    itself), or, with ``announces``, ours once it sends a word through the pipe end it is given as
    its last argument (the moment of the crash is then the child's to choose)."""
    ctx = fork_server()
    announced, announce = ctx.Pipe(duplex=False) if announces else (None, None)
    child = ctx.Process(target=target, args=(*args, announce) if announces else args, daemon=True)
    child.start()
    try:
        if announced is not None and announce is not None:
            announce.close()  # the child's copy is the only one left: its death ends the pipe
            if announced.poll(timeout=timeout):
                with contextlib.suppress(EOFError):  # it died first: the exit code below says how
                    announced.recv()
            child.kill()
        child.join(timeout=timeout)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        if announced is not None:
            announced.close()
    assert child.exitcode == -signal.SIGKILL, f"the child ended with {child.exitcode}, not killed by SIGKILL"
