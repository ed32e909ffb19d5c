#!/usr/bin/env python
"""A replaced node's restart, phase by phase: what it waits for, against the limits of its transport.

Usage::

    .venv/bin/python bench/replace_node.py --mib 128 --json bench/results/replace_node.json

Each rank is a node of its own (its own local directory and tmpfs directory), the ranks data-parallel
replicas of one state (bench/memory_bench.py's MLP with AdamW), each node's memory steps copied to
``replicas`` peers' memory (``ReplicationOptions``). One step is saved, in memory only; then one node's
tmpfs is emptied (a replaced node) and every rank restarts: the replaced node gets every byte from its
peers' memory over the process group (gloo on loopback), the others restore from their own memory. Two
jobs: 2 nodes with ``replicas=1`` and 3 nodes with ``replicas=2``.

For each rank the restore's phases, from ``Checkpointer.stats()`` (``restore.report.PHASES``): agree,
plan, transfer, verify, place, and re-replicate (``memory_rereplicate_s`` where the library reports it;
'-' where it does not). Beside them, in the same run: gloo send/recv of the replaced node's bytes from a
peer (its transport's limit), and memcpy + CRC32C of those bytes (what restoring from its own memory
would cost at least). Method and results: bench/README.md ("Replacing a node").
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import harness as h

MiB, GiB = h.MiB, h.GiB
PHASES = ("agree", "plan", "transfer", "verify", "place")
JOBS = ((2, 1), (3, 2))  # (nodes, replicas)
REPLACED = 1  # the node replaced in each job


def _rank(
    rank: int, world: int, mib: float, local: str, shm: str, replicas: int, phase: str, rereplicate: bool
) -> dict[str, Any]:
    """One rank, a node of its own. "save": one step, in memory only, copied to ``replicas`` peers' memory
    (the close waits for the copies). "restore": node ``REPLACED``'s tmpfs is gone; every rank restores
    (with replication on where ``rereplicate``, as in the job: the replaced node's copies are made again), then, after the close, measures gloo send/recv of the state's bytes from
    a peer to the replaced node, and memcpy + CRC32C of them."""
    import torch.distributed as dist
    from memory_bench import NEVER, build, digest, leaves

    from tiercheck import Checkpointer, DistributedOptions, MemoryOptions, ReplicationOptions

    model, opt = build(mib / 1024)
    if phase == "restore":
        for t in leaves(model, opt):
            t.zero_()
    memory = MemoryOptions(path=f"{shm}/shm{rank}", persist_every=NEVER, keep_at_close=True)
    replication = ReplicationOptions(replicas=replicas) if phase == "save" or rereplicate else None
    dist.barrier()
    # Not through shared memory, as ranks of one host would pass chunks: over the process group, as between hosts.
    with Checkpointer({"model": model, "optim": opt}, local=f"{local}/node{rank}", memory=memory,
                      replication=replication, distributed=DistributedOptions(share_memory=False)) as ck:  # fmt: skip
        if phase == "save":
            ck.save(1).wait()
            return {"digest": digest(model, opt)}
        t0 = time.perf_counter()
        step = ck.restore()
        wall = time.perf_counter() - t0
        stats = ck.stats()
    after = ck.stats()  # the close waited for the copies back into the replaced node's memory
    nbytes = sum(t.numel() * t.element_size() for t in leaves(model, opt))
    # After the close: the replication's copies run on the process group from a thread of their own until then.
    p2p = _gloo_p2p(rank, nbytes, src=0 if REPLACED else 1)
    out = {"rank": rank, "step": step, "restore_wall_s": wall, "digest": digest(model, opt), "state_bytes": nbytes,
           "gloo": p2p, "memcpy_crc": _memcpy_crc(nbytes) if rank == REPLACED else None,
           "phases": {p: stats.get(f"restore_{p}_s") for p in PHASES}, "restore_s": stats.get("restore_s"),
           "rereplicate_s": after.get("memory_rereplicate_s"), "from_memory": stats.get("restore_from_memory"),
           "chunks_received": stats.get("restore_chunks_received"), "bytes_read": stats.get("restore_bytes_read")}  # fmt: skip
    return out


def _gloo_p2p(rank: int, nbytes: int, *, src: int) -> dict[str, float] | None:
    """gloo send/recv of ``nbytes`` from rank ``src`` to the replaced node's rank over loopback (best of 3);
    on those two ranks (None on the others, which wait at the barriers)."""
    import torch
    import torch.distributed as dist

    ends = (src, REPLACED)
    buf, best = torch.ones(nbytes if rank in ends else 1, dtype=torch.uint8), float("inf")
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == src:
            dist.send(buf, REPLACED)
        elif rank == REPLACED:
            dist.recv(buf, src)
        dist.barrier()
        best = min(best, time.perf_counter() - t0)
    return {"bytes": nbytes, "s": best, "gib_s": nbytes / GiB / best} if rank in ends else None


def _memcpy_crc(nbytes: int) -> dict[str, float]:
    """memcpy of ``nbytes`` into memory written before, then CRC32C of the copy (format.codec.checksum), best of 3."""
    import torch

    from tiercheck.format.codec import checksum

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        checksum(dst.numpy().data)
        best = min(best, time.perf_counter() - t0)
    return {"bytes": nbytes, "s": best, "gib_s": nbytes / GiB / best}


def job(
    nodes: int, replicas: int, mib: float, local: str, shm: str, timeout: float, rereplicate: bool
) -> dict[str, Any]:
    """One job (run in a worker of its own): save, replace node ``REPLACED``, restart every rank (replication on
    only with ``rereplicate``: else the restart is timed alone, as bench/memory_peer.py times it)."""
    from tests.distributed import run_ranks

    kw = {"timeout": timeout, "pg_timeout": timeout}
    saved = run_ranks(_rank, nodes, mib, local, shm, replicas, "save", rereplicate, **kw)
    try:
        shutil.rmtree(f"{shm}/shm{REPLACED}")  # the node was replaced: its tmpfs is empty
        for rank in range(nodes):  # persisted at close: only memory holds the step now
            for step in Path(f"{local}/node{rank}").glob("step-*"):
                shutil.rmtree(step)
        got = run_ranks(_rank, nodes, mib, local, shm, replicas, "restore", rereplicate, **kw)
    finally:
        shutil.rmtree(shm, ignore_errors=True)  # its slots: RAM
    identical = all(r["digest"] == saved[0]["digest"] for r in got)
    ranks = [{k: v for k, v in r.items() if k != "digest"} for r in got]
    return {
        "nodes": nodes,
        "replicas": replicas,
        "replaced": REPLACED,
        "bit_identical": identical,
        "ranks": ranks,
        "rereplicate": rereplicate,
    }


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    """The replaced node's restore against its limits: its transfer over gloo send/recv of its bytes, its
    fixed costs (agree + plan + verify + place), and its whole restore over memcpy + CRC32C."""
    me = run["ranks"][REPLACED]
    gloo, crc = me["gloo"], me["memcpy_crc"]
    fixed = sum(me["phases"][p] or 0.0 for p in ("agree", "plan", "verify", "place"))
    return {
        "state_bytes": me["state_bytes"],
        "restore_s": me["restore_s"],
        "transfer_s": me["phases"]["transfer"],
        "fixed_s": fixed,
        "transfer_vs_gloo": h.ratio(me["phases"]["transfer"], gloo["s"]),
        "restore_vs_gloo": h.ratio(me["restore_s"], gloo["s"]),
        "restore_vs_memcpy_crc": h.ratio(me["restore_s"], crc["s"]),
        "gloo_gib_s": gloo["gib_s"],
        "memcpy_crc_gib_s": crc["gib_s"],
        "rereplicate_s": me["rereplicate_s"],
        "bit_identical": run["bit_identical"],
        "all_from_memory": all(r["from_memory"] == 1 for r in run["ranks"]),
    }


def render(report: dict[str, Any]) -> str:
    head = ["job", "rank", "role", *PHASES, "re-replicate", "restore s", "gloo send/recv s", "memcpy+CRC32C s"]
    rows = []
    for run in report["jobs"]:
        if "error" in run:
            rows.append([f"{run['nodes']} nodes", "-", run["error"][:60], *["-"] * (len(head) - 3)])
            continue
        for r in run["ranks"]:
            role = "replaced" if r["rank"] == REPLACED else "peer (own memory)"
            gloo, crc = r["gloo"], r["memcpy_crc"]
            rows.append([f"{run['nodes']} nodes, replicas={run['replicas']}", r["rank"], role,
                         *(h.fmt(r["phases"][p], ".3f") for p in PHASES), h.fmt(r["rereplicate_s"], ".3f"),
                         h.fmt(r["restore_s"], ".3f"), h.fmt(gloo["s"], ".3f") if gloo else "-",
                         h.fmt(crc["s"], ".3f") if crc else "-"])  # fmt: skip
    lines = [h.table(head, rows), ""]
    for run in report["jobs"]:
        s = run.get("summary")
        if s:
            lines.append(
                f"{run['nodes']} nodes, replicas={run['replicas']}: the replaced node restored "
                f"{h.fmt_bytes(s['state_bytes'])} in {s['restore_s']:.3f} s ({s['fixed_s']:.3f} s fixed: agree, plan, "
                f"verify, place); transfer / gloo send/recv of its bytes {h.fmt(s['transfer_vs_gloo'])}x, restore / "
                f"memcpy + CRC32C {h.fmt(s['restore_vs_memcpy_crc'])}x; bit-identical: {s['bit_identical']}"
            )
    lines.append("Per rank, its own seconds in each phase (Checkpointer.stats() restore_*_s); '-': not reported.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--mib", type=float, default=128, help="state per rank, MiB, in whole MLP blocks of 96 MiB (default 128)"
    )
    ap.add_argument(
        "--no-rereplicate",
        dest="rereplicate",
        action="store_false",
        help="restart without replication: the restart timed alone, with no re-replicate phase (by default it "
        "restarts with replication on, as a job does, and the replaced node's copies are made again)",
    )
    ap.add_argument("--dir", help="scratch directory for the local tiers (default: a temporary one)")
    ap.add_argument("--shm", default="/dev/shm", help="tmpfs for the memory tiers (default /dev/shm)")
    ap.add_argument("--worker-timeout", type=float, default=900)
    ap.add_argument("--json", metavar="PATH", help="write the measurements to PATH")
    args = ap.parse_args(argv)
    report: dict[str, Any] = {"machine": h.machine_info(args.dir or "."), "mib": args.mib, "jobs": []}
    scratch = h.scratch_dir(args.dir or tempfile.gettempdir(), "replace-node-")
    with scratch as root, h.scratch_dir(args.shm, "replace-node-shm-") as shm:
        for nodes, replicas in JOBS:
            h.log(f"{nodes} nodes, replicas={replicas}: save, replace node {REPLACED}, restart")
            kw = {"nodes": nodes, "replicas": replicas, "mib": args.mib, "local": str(root / f"j{nodes}"),
                  "shm": str(shm / f"j{nodes}"), "timeout": args.worker_timeout, "rereplicate": args.rereplicate}  # fmt: skip
            run = h.run_worker(__file__, "job", kw, timeout=args.worker_timeout + 60)
            if "error" not in run:
                run["summary"] = summarise(run)
            else:
                run.update(nodes=nodes, replicas=replicas)
            report["jobs"].append(run)
    print(render(report))
    if args.json:
        h.write_json(args.json, report)
    failed = [j for j in report["jobs"] if "error" in j or not j["summary"]["bit_identical"]]
    for j in failed:
        print(f"{j['nodes']} nodes: {j.get('error') or 'not bit-identical'}\n{j.get('traceback', '')}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
