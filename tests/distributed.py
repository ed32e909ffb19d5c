"""Run a test body in N real processes joined by a gloo ``torch.distributed`` process group (CPU only).

``fn`` must be a module-level function importable from the tests package (e.g. ``tests.test_x._body``); it is called
as ``fn(rank, world_size, *args, **kwargs)`` in each rank's process and its return value comes back pickled.

The rendezvous TCPStore is hosted by the calling (pytest) process, as torchrun's agent hosts it, so it outlives any
rank, and no port is picked and then released (no race for a free port). Each rank writes its outcome to a file in a
temporary directory before it exits; the parent waits on the process sentinels, so there is no polling and no sleep.

Ranks fork from a fork server (``start_method="forkserver"``, the default) that imported torch, torch._dynamo,
DCP and tiercheck's save and restore modules once (``tests/rank_preload.py``; its first launch ~4.5 s of CPU; later
launches ~0.2 s for 8 ranks). ``start_method="spawn"`` starts each rank as a fresh interpreter, importing torch in
every rank (~2.5 s of CPU each: 4 ranks ~6 s, 8 ranks ~12.5 s on 2 cores): pass it only where a
test needs ranks that share nothing with the fork server. Fork-server ranks inherit the environment of the fork
server, not the current one, so pass environment variables through ``env``.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import get_context
from multiprocessing.connection import wait
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

__all__ = ["RankFailed", "RankOutcome", "fork_server", "run_ranks"]


class RankFailed(AssertionError):
    """A rank raised, died without a result, or the launch timed out."""


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    result: Any = None
    error: str | None = None  # the child's formatted traceback, or why it has no result
    exitcode: int | None = None  # None only for a rank still running when the others' failure ended the launch

    @property
    def ok(self) -> bool:
        return self.error is None


def _child(
    rank: int,
    world_size: int,
    port: int,
    pg_timeout: float,
    env: Mapping[str, str],
    out: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=pg_timeout))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout)
        )
        payload = pickle.dumps(("ok", fn(rank, world_size, *args, **kwargs), time.time()))
    except BaseException:
        payload = pickle.dumps(("error", traceback.format_exc(), time.time()))
    tmp = Path(out).with_suffix(".tmp")
    tmp.write_bytes(payload)
    tmp.replace(out)  # the parent never sees half a file; written before this rank's sockets close
    status = pickle.loads(payload)[0]
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(0 if status == "ok" else 1)


def _outcome(rank: int, proc: BaseProcess, out: Path) -> tuple[RankOutcome, float]:
    """The rank's outcome (from its file, else from its exit code) and when it was reached."""
    exitcode = None if proc.is_alive() else proc.exitcode
    if out.exists():
        status, value, when = pickle.loads(out.read_bytes())
        if status == "ok":
            return RankOutcome(rank, result=value, exitcode=exitcode), when
        return RankOutcome(rank, error=value, exitcode=exitcode), when
    # A death is the likeliest root cause (its peers' errors follow from it): rank it before every error.
    return RankOutcome(
        rank, error=f"rank {rank} died without a result (exit code {exitcode})", exitcode=exitcode
    ), float("-inf")


def _failure(outcomes: list[tuple[RankOutcome, float]], world_size: int) -> RankFailed:
    """Blame the rank that failed first (a rank's error often just echoes a peer's death), list the others."""
    failed = sorted((when, o.rank, o) for o, when in outcomes if not o.ok)
    first = failed[0][2]
    code = "" if first.exitcode is None else f" (exit code {first.exitcode})"
    others = "".join(f"\n  then rank {o.rank}: {(o.error or '').strip().splitlines()[-1]}" for _, _, o in failed[1:])
    return RankFailed(
        f"rank {first.rank} of {world_size} failed first{code}:\n{first.error}"
        + (f"other ranks that failed:{others}" if others else "")
    )


def fork_server() -> ForkServerContext:
    """The multiprocessing context of the fork server ranks are forked from, with torch and tiercheck imported
    (``tests/rank_preload.py``): a process from it starts in a fraction of a second instead of importing them.
    The preload has no effect once the server runs: the first use in a pytest run starts it."""
    ctx = get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", __name__, "tests.rank_preload"])
    return ctx


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120,
    pg_timeout: float = 60,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    start_method: Literal["spawn", "forkserver"] = "forkserver",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` processes; return results by rank.

    ``check=True``: the first rank that raises or dies ends the launch (the others are killed) with
    :class:`RankFailed` naming the rank and carrying its traceback / exit code. ``check=False``: wait for every rank
    and return a :class:`RankOutcome` per rank instead of raising, so a test may have a rank die on purpose.
    ``timeout`` bounds the whole launch: ranks still running are killed and :class:`RankFailed` is raised (with
    ``check=False`` too, listing what each rank had done). ``pg_timeout`` is the store's and process group's timeout,
    so that a collective waiting on a dead peer fails instead of hanging until ``timeout``.
    """
    ctx = fork_server() if start_method == "forkserver" else get_context("spawn")
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        outs = [Path(tmp) / f"rank{r}.pkl" for r in range(world_size)]
        procs = [
            ctx.Process(
                target=_child,
                name=f"rank{r}",
                daemon=True,
                args=(r, world_size, store.port, pg_timeout, dict(env or {}), str(outs[r]), fn, args, kwargs),
            )
            for r in range(world_size)
        ]
        outcomes: dict[int, RankOutcome] = {}
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            running = dict(enumerate(procs))
            while running:
                ready = wait([p.sentinel for p in running.values()], timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    break
                for rank, p in list(running.items()):
                    if p.sentinel in ready:
                        p.join()
                        del running[rank]
                        outcomes[rank] = _outcome(rank, p, outs[rank])[0]
                if check and not all(o.ok for o in outcomes.values()):
                    # Ranks still running may have failed too, and earlier: their files say so.
                    raise _failure(
                        [_outcome(r, p, outs[r]) for r, p in enumerate(procs) if r in outcomes or outs[r].exists()],
                        world_size,
                    )
            if running:
                done = "\n".join(
                    f"  rank {o.rank}: " + ("ok" if o.ok else (o.error or "").strip().splitlines()[-1])
                    for o in sorted(outcomes.values(), key=lambda o: o.rank)
                )
                raise RankFailed(
                    f"timed out after {timeout:g}s; ranks {sorted(running)} still running were killed"
                    + (f"; finished:\n{done}" if done else "")
                )
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                if p.pid is not None:
                    p.join()
                    p.close()
        del store
    ordered = [outcomes[r] for r in range(world_size)]
    return ordered if not check else [o.result for o in ordered]
