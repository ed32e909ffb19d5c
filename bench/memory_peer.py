"""The memory benchmark's restart from a peer's memory (``memory_bench.py``, issue 52): two ranks, each
a node of its own (its own local directory and tmpfs directory), data-parallel replicas of one state,
each node's memory steps copied to the other's; then node 1's tmpfs is emptied (a replaced node) and
both restart, node 1 getting every byte from node 0's memory over the process group (gloo on
loopback). Limits in the same worker: loopback TCP (``sendall`` to a thread) and gloo send/recv."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import harness as h
import limits

GiB, MiB = h.GiB, h.MiB


def _peer_rank(rank: int, world: int, gib: float, local: str, shm: str, phase: str) -> dict[str, Any]:
    """One of two ranks, each a node of its own (its own local directory and tmpfs directory), with the
    same state (data-parallel replicas: each node writes half the chunks) and its memory steps copied
    to the other node's memory. "save": one step, in memory only (the clean close's persisted copy is
    removed after). "restore": node 1's tmpfs is gone, so every byte it restores is read from node 0's
    memory (its own half and node 1's copy) and sent over the process group (gloo on loopback)."""
    import torch.distributed as dist
    from memory_bench import NEVER, build, digest, leaves

    from tiercheck import Checkpointer, DistributedOptions, MemoryOptions, ReplicationOptions

    said = Said()
    logging.getLogger("tiercheck").addHandler(said)
    model, opt = build(gib)
    if phase == "restore":
        for t in leaves(model, opt):
            t.zero_()
    memory = MemoryOptions(path=f"{shm}/shm{rank}", persist_every=NEVER, keep_at_close=True)
    dist.barrier()
    t0 = time.perf_counter()
    # The restore runs without replication: what is timed is the restart, not the copies back into node
    # 1's memory that would follow it. Nor through shared memory, as ranks of one host would pass chunks:
    # over the process group, as between two hosts.
    replication = ReplicationOptions(replicas=1) if phase == "save" else None
    with Checkpointer({"model": model, "optim": opt}, local=f"{local}/node{rank}", memory=memory,
                      replication=replication, distributed=DistributedOptions(share_memory=False)) as ck:  # fmt: skip
        if phase == "save":
            ck.save(1).wait()
            return {"digest": digest(model, opt)}  # the close waits for the copies to the peer's memory
        step = ck.restore()
        s = time.perf_counter() - t0
        stats = ck.stats()
    # After the close: the replication's copies (node 0's memory step back into node 1's) run on the
    # process group from a thread of their own until then, and a collective beside them would cross them.
    p2p = _gloo_p2p(rank, 256 * MiB)
    nbytes = sum(t.numel() * t.element_size() for t in leaves(model, opt))
    return {"rank": rank, "step": step, "s": s, "digest": digest(model, opt), "gloo": p2p, "state_bytes": nbytes,
            "chunks_received": stats.get("restore_chunks_received"), "chunks_shared": stats.get("restore_chunks_shared"),
            "bytes_read": stats.get("restore_bytes_read"), "said": said.messages}  # fmt: skip


class Said(logging.Handler):
    """What tiercheck warned of (a failed attempt's reason)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:400])


def _gloo_p2p(rank: int, nbytes: int) -> dict[str, float]:
    """gloo send/recv of ``nbytes`` from rank 0 to rank 1 over loopback, the restore's transport (best of 3)."""
    import torch
    import torch.distributed as dist

    buf, best = torch.ones(nbytes, dtype=torch.uint8), float("inf")
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        (dist.send if rank == 0 else dist.recv)(buf, 1 - rank)
        dist.barrier()
        best = min(best, time.perf_counter() - t0)
    return {"bytes": nbytes, "s": best, "gib_s": nbytes / GiB / best}


def tcp_loopback(nbytes: int, block: int = 4 * MiB) -> dict[str, float]:
    """The loopback TCP ceiling (``harness.tcp_loopback``, remote_bench's measure), best of 3."""
    return limits.tcp_loopback(nbytes, block, repeats=3)


def peer_restart(gib: float, local: str, shm: str, timeout: float, attempts: int = 2) -> dict[str, Any]:
    """Restart from a peer's memory (``_peer_rank``), up to ``attempts`` times, each from a fresh save;
    and the loopback TCP limit, in one worker. An attempt that does not restore the step from the peer's
    memory, bit-identical on both ranks, is recorded with what the ranks said (``failures``)."""
    from tests.distributed import run_ranks

    out: dict[str, Any] = {"failures": []}
    for n in range(attempts):
        at_local, at_shm = f"{local}/a{n}", f"{shm}/a{n}"
        saved = run_ranks(_peer_rank, 2, gib, at_local, at_shm, "save", timeout=timeout, pg_timeout=timeout)
        shutil.rmtree(f"{at_shm}/shm1")  # node 1 was replaced: its tmpfs is empty
        for rank in (0, 1):  # persisted at close: only memory holds the step now
            for step in Path(f"{at_local}/node{rank}").glob("step-*"):
                shutil.rmtree(step)
        got = run_ranks(_peer_rank, 2, gib, at_local, at_shm, "restore", timeout=timeout, pg_timeout=timeout)
        shutil.rmtree(at_shm, ignore_errors=True)  # its slots: RAM
        identical = all(r["digest"] == saved[0]["digest"] for r in got)
        ranks = [{k: v for k, v in r.items() if k != "digest"} for r in got]
        if all(r["step"] == 1 for r in got) and identical:
            out |= {"state_bytes": got[1]["state_bytes"], "ranks": ranks, "bit_identical": identical}
            break
        out["failures"].append({"attempt": n, "steps": [r["step"] for r in got], "bit_identical": identical,
                                "said": sorted({m for r in got for m in r["said"]})})  # fmt: skip
    return out | {"tcp_loopback": tcp_loopback(1 * GiB)}


def peer_summary(peer: dict[str, Any] | None) -> dict[str, Any]:
    """The restart from a peer's memory: the replaced node's restore (rank 1: every byte from its peer),
    its rate over the state's bytes against loopback TCP and gloo send/recv; and the slower rank's
    (node 0's restore also persists the memory-only step to its local directory before it returns)."""
    if not peer or "ranks" not in peer:
        return {"peer_failures": len(peer.get("failures", ())) if peer else None}
    s = peer["ranks"][1]["s"]
    gib_s = peer["state_bytes"] / GiB / s
    return {
        "peer_restore_s": s, "peer_gib_s": gib_s, "peer_job_s": max(r["s"] for r in peer["ranks"]),
        "peer_vs_tcp_loopback": h.ratio(gib_s, peer["tcp_loopback"]["gib_s"]),
        "peer_vs_gloo": h.ratio(gib_s, peer["ranks"][0]["gloo"]["gib_s"]),
        "peer_bit_identical": peer["bit_identical"], "peer_failures": len(peer["failures"]),
    }  # fmt: skip


def peer_rows(s: dict[str, Any], peer: dict[str, Any]) -> tuple[list[Any], list[list[Any]]]:
    """The restart table's row for the peer's memory, and its limit rows (loopback TCP, gloo)."""
    if "peer_restore_s" in s:
        row = [f"peer memory (2 nodes: the replaced node, every byte from its peer; the job: {s['peer_job_s']:.3f} s)",
               h.fmt(s["peer_restore_s"], ".3f"), h.fmt(s["peer_gib_s"], ".2f"), "peer memory", s["peer_bit_identical"]]  # fmt: skip
    else:
        failed = f"every attempt failed ({s['peer_failures']}; JSON: peer.failures)" if s.get("peer_failures") else "not measured"
        row = ["peer memory", "-", "-", failed, "-"]
    limits = []
    if "tcp_loopback" in peer:
        tcp = peer["tcp_loopback"]
        limits.append(["limit: loopback TCP (sendall, 1 GiB)", h.fmt(tcp["s"], ".3f"), h.fmt(tcp["gib_s"], ".2f"), "-", "-"])
    else:
        limits.append(["limit: loopback TCP", "-", "-", "not measured in this run", "-"])
    if "peer_restore_s" in s:
        gloo = peer["ranks"][0]["gloo"]
        limits.append(["limit: gloo send/recv over loopback (256 MiB)", h.fmt(gloo["s"], ".3f"), h.fmt(gloo["gib_s"], ".2f"), "-", "-"])
    return row, limits
