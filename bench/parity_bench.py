#!/usr/bin/env python
"""The memory tier's parity against whole copies, on nodes: memory held, the time to protect a save, and a
replaced node's restore, in one run.

Usage::

    .venv/bin/python bench/parity_bench.py --json               # 64 MiB per node; bench/results/parity_bench.json
    .venv/bin/python bench/parity_bench.py --mib 1 --steps 2    # a smoke run (tests/test_parity_bench_nodes.py)

Each rank is a node of its own (real gloo processes on loopback, each its own tmpfs directory under
``--shm`` and its own local directory), its state ``--mib`` MiB of float32 tensors of its own
(``per_rank``). Two jobs of 6 nodes, each in a fresh worker process:

- ``parity``: ``ReplicationOptions(parity=ParityOptions(data=4, parity=2))``;
- ``replicas``: ``ReplicationOptions(replicas=2)`` (whole copies in two peers' memory).

Each job saves ``--steps`` steps (``MemoryOptions(slots=2)``, memory only), each ``save(step).wait()`` (the
step committed in memory) then ``Checkpointer.wait()`` (its parity coded, or its copies made): the second
span is the time to protect it. Then each node walks its memory directory (its tmpfs directory, every file
counted once by inode: the slots and the committed steps' packs are hard links) and sums the slots, the
parity pieces and the rest (peers' copies, manifests, markers). Beside them, in the same run: memcpy +
CRC32C of a node's bytes on one rank while the others wait, and on every rank at once (the 6 nodes share
this machine's cores as their coding does), the same for zfec's encode of a node's share of the coding and
decode of a lost node's share of the rebuild (``parity_limits``), and gloo send/recv of those bytes between two ranks.

Then the job closes (its newest step persisted to each local directory), loses nodes and restarts:
``parity`` loses nodes 0 and 1 (tmpfs and local directory emptied), ``replicas`` loses node 1; every node's
local copy of the step is removed, so memory alone holds it. The lost nodes rebuild their files from their
group's data and parity (``tiering.rebuild``), or restore from a peer's copy (``tiering.memory_peers``).
Every node checks the state it restored against the digest (CRC32C of each tensor) it saved: bit-identical
or the run fails. Method and results: bench/README.md ("Parity on nodes").
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import harness as h
from parity_limits import DATA, LOST, NODES, PARITY, busiest, limits

MiB, GiB = h.MiB, h.GiB
REPLICAS = 2
SLOTS = 2
JOBS = ("parity", "replicas")
NEVER = 10**9  # persist_every: the saves stay in memory (the close persists the newest)
TENSOR_MIB = 16  # the state's tensors, each at most this
REBUILT = re.compile(r"parity: step (\d+) rebuilt in this node's memory from its group .* in ([0-9.]+) s \(offers "
                     r"([0-9.]+), rounds, file checks and commit ([0-9.]+).*; ([0-9.]+) MiB received\)")


# ------------------------------------------------------------------------------------------
# A rank (a node of its own)
# ------------------------------------------------------------------------------------------


def _replication(kind: str) -> Any:
    from tiercheck import ParityOptions, ReplicationOptions

    if kind == "parity":
        return ReplicationOptions(parity=ParityOptions(data=DATA, parity=PARITY))
    return ReplicationOptions(replicas=REPLICAS)


def _tensors(rank: int, mib: float) -> list[Any]:
    """This node's own state: float32 tensors of ``mib`` MiB in all, random, its own seed."""
    import torch

    total = max(1, int(mib * MiB) // 4)
    per = TENSOR_MIB * MiB // 4
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.rand(min(per, total - at), generator=g) for at in range(0, total, per)]


def _digest(tensors: list[Any]) -> list[int]:
    import torch

    from tiercheck.format.codec import checksum

    return [checksum(t.contiguous().view(torch.uint8).numpy().data) for t in tensors]


def _checkpointer(rank: int, kind: str, root: str, shm: str, state: dict[str, Any]) -> Any:
    from tiercheck import Checkpointer, DistributedOptions, MemoryOptions

    memory = MemoryOptions(path=f"{shm}/shm{rank}", slots=SLOTS, persist_every=NEVER, keep_at_close=True)
    # Not through shared memory, as ranks of one host would pass chunks: over the process group, as between hosts.
    return Checkpointer(state, local=f"{root}/node{rank}", memory=memory, replication=_replication(kind),
                        distributed=DistributedOptions(share_memory=False))  # fmt: skip


def memory_walk(directory: str) -> dict[str, int]:
    """Bytes a node's memory directory takes on its tmpfs (blocks allocated), each file once (by inode):
    ``slots`` (the files under a ``slots`` directory, and every link to them), ``parity`` (``parity-*``)
    and ``other`` (peers' copies, manifests, markers, records); ``apparent``: the files' sizes."""
    kinds: dict[tuple[int, int], str] = {}
    sizes: dict[tuple[int, int], tuple[int, int]] = {}
    for dirpath, _, files in os.walk(directory):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            key = (st.st_dev, st.st_ino)
            kind = "slots" if Path(dirpath).name == "slots" else "parity" if name.startswith("parity-") else "other"
            if kinds.get(key) != "slots":  # a slot's link in a step directory is still the slot
                kinds[key] = kind
            sizes[key] = (st.st_blocks * 512, st.st_size)
    out = {"slots": 0, "parity": 0, "other": 0, "files": len(kinds), "apparent": 0}
    for key, kind in kinds.items():
        out[kind] += sizes[key][0]
        out["apparent"] += sizes[key][1]
    out["total"] = out["slots"] + out["parity"] + out["other"]
    return out


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def node(rank: int, world: int, kind: str, mib: float, steps: int, root: str, shm: str, phase: str) -> dict[str, Any]:
    """One rank, a node of its own: ``save`` or ``restore`` (see the module's docstring)."""
    from tiercheck import per_rank

    tensors = _tensors(rank, mib)
    state = {f"t{i}": per_rank(t) for i, t in enumerate(tensors)}
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if phase == "save":
        return _save(rank, kind, steps, root, shm, tensors, state, nbytes)
    return _restore(rank, kind, root, shm, tensors, state, nbytes)


def _save(rank: int, kind: str, steps: int, root: str, shm: str, tensors: list[Any], state: dict[str, Any],
          nbytes: int) -> dict[str, Any]:  # fmt: skip
    import torch.distributed as dist

    saves, digests = [], {}
    t_open = time.perf_counter()
    with _checkpointer(rank, kind, root, shm, state) as ck:
        opened = time.perf_counter() - t_open
        for step in range(1, steps + 1):
            for t in tensors:
                t.add_(1.0)
            digests[step] = _digest(tensors)
            dist.barrier()
            t0 = time.perf_counter()
            ck.save(step).wait()
            t1 = time.perf_counter()
            ck.wait()
            t2 = time.perf_counter()
            saves.append({"step": step, "commit_s": t1 - t0, "protect_s": t2 - t1})
        dist.barrier()  # every node's copies and parity are in place
        held = memory_walk(f"{shm}/shm{rank}")
        stats = ck.stats()
        measured = limits(rank, nbytes, kind)
        t_close = time.perf_counter()
    timings = {"open_s": opened, "close_s": time.perf_counter() - t_close}
    return {"rank": rank, "state_bytes": nbytes, "saves": saves, "digests": digests, "held": held, **measured, **timings,
            "memory_held_bytes": stats.get("memory_held_bytes"),
            "memory_parity_held_bytes": stats.get("memory_parity_held_bytes")}  # fmt: skip


def _restore(rank: int, kind: str, root: str, shm: str, tensors: list[Any], state: dict[str, Any],
             nbytes: int) -> dict[str, Any]:  # fmt: skip
    import torch.distributed as dist

    for t in tensors:
        t.zero_()
    said = _Said()
    logger = logging.getLogger("tiercheck")
    logger.addHandler(said)
    logger.setLevel(logging.INFO)
    dist.barrier()
    t_open = time.perf_counter()
    with _checkpointer(rank, kind, root, shm, state) as ck:
        t_opened = time.perf_counter()
        dist.barrier()  # the restore timed from when every node has opened its Checkpointer (they start unevenly)
        t0 = time.perf_counter()
        step = ck.restore()
        wall = time.perf_counter() - t0
        stats = dict(ck.stats())
        digest = _digest(tensors)
        t1 = time.perf_counter()
        ck.wait()  # the background work after it (persist, copies made again)
        t2 = time.perf_counter()
    timings = {"open_s": t_opened - t_open, "background_s": t2 - t1, "close_s": time.perf_counter() - t2}
    logger.removeHandler(said)
    rebuilt = [[float(x) for x in m.groups()[1:]] for m in map(REBUILT.search, said.messages) if m]
    return {"rank": rank, "state_bytes": nbytes, "step": step, "digest": digest, "restore_wall_s": wall, **timings,
            "restore_s": stats.get("restore_s"), "phases": {p: stats.get(f"restore_{p}_s") for p in
                                                             ("agree", "plan", "transfer", "verify", "place")},
            "from_memory": stats.get("restore_from_memory"), "rebuilt_step": stats.get("memory_rebuilt_step"),
            "rebuild_s": rebuilt[0][0] if rebuilt else None,
            "rebuild_phases_s": {"offers": rebuilt[0][1], "rounds": rebuilt[0][2]} if rebuilt else None,
            "rebuild_received_bytes": int(rebuilt[0][3] * MiB) if rebuilt else None,
            "chunks_received": stats.get("restore_chunks_received")}  # fmt: skip


# ------------------------------------------------------------------------------------------
# A job (in a worker of its own): save, lose nodes, restore
# ------------------------------------------------------------------------------------------


def job(kind: str, mib: float, steps: int, root: str, shm: str, timeout: float) -> dict[str, Any]:
    from tests.distributed import run_ranks

    kw = {"timeout": timeout, "pg_timeout": min(timeout, 600)}
    try:
        saved = run_ranks(node, NODES, kind, mib, steps, root, shm, "save", **kw)
        for rank in LOST[kind]:  # replaced: its tmpfs and its local directory are empty
            shutil.rmtree(f"{shm}/shm{rank}")
            shutil.rmtree(f"{root}/node{rank}")
        for rank in range(NODES):  # persisted at close: only memory holds the step now
            for d in Path(f"{root}/node{rank}").glob("step-*"):
                shutil.rmtree(d)
        got = run_ranks(node, NODES, kind, mib, steps, root, shm, "restore", **kw)
    finally:
        shutil.rmtree(shm, ignore_errors=True)  # its slots: RAM
    for r in got:
        want = saved[r["rank"]]["digests"].get(r["step"])
        r["bit_identical"] = r.pop("digest") == want
    for s in saved:
        s.pop("digests")
    return {"kind": kind, "nodes": NODES, "lost": list(LOST[kind]), "steps": steps, "saved": saved, "restored": got}


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    """Per job: memory held over the snapshot, the time to protect a save against memcpy + CRC32C (and
    zfec's encode) of the same bytes, the lost nodes' restores against their floors; every restore
    bit-identical and from memory."""
    saved, got = run["saved"], run["restored"]
    nbytes, zero = saved[0]["state_bytes"], saved[0]
    held = [s["held"]["total"] / s["state_bytes"] for s in saved]
    later = [x["protect_s"] for s in saved for x in s["saves"][1:] or s["saves"]]
    protect = statistics.median(later)
    lost = [r for r in got if r["rank"] in run["lost"]]
    restore = max(r["restore_s"] for r in lost)
    out = {
        "state_bytes": nbytes,
        "held_vs_snapshot": statistics.median(held),
        "held_vs_snapshot_max": max(held),
        **{f"{k}_vs_snapshot": statistics.median(s["held"][k] / s["state_bytes"] for s in saved)
           for k in ("slots", "parity", "other")},
        "protect_s": protect,
        "first_protect_s": statistics.median(s["saves"][0]["protect_s"] for s in saved),
        "protect_gib_s": nbytes / GiB / protect,
        "gloo_s": zero["gloo_s"],
        "lost_restore_s": restore,
        "lost_restore_wall_s": max(r["restore_wall_s"] for r in lost),
        "others_restore_s": max(r["restore_s"] for r in got if r["rank"] not in run["lost"]),
        "lost_restore_vs_gloo": h.ratio(restore, zero["gloo_s"]),
        "restored_steps": sorted({r["step"] for r in got}, key=str),
        "restored_newest": all(r["step"] == run["steps"] for r in got),
        "all_from_memory": all(r["from_memory"] == 1 for r in got),
        "all_bit_identical": all(r["bit_identical"] for r in got),
    }  # fmt: skip
    for name in ("memcpy_crc", "encode", "decode"):
        if f"{name}_together_s" in zero:
            out[f"{name}_alone_s"] = zero[f"{name}_alone_s"]
            out[f"{name}_together_s"] = statistics.median(s[f"{name}_together_s"] for s in saved)
            out[f"protect_vs_{name}_alone"] = h.ratio(protect, out[f"{name}_alone_s"])
            out[f"protect_vs_{name}_together"] = h.ratio(protect, out[f"{name}_together_s"])
    if run["kind"] == "parity":
        rebuild = max(r["rebuild_s"] or 0.0 for r in lost)
        # Before the restore the busiest lost node receives its pieces (d shards of S/d for each stripe it
        # decodes, one for each the other decodes) over gloo, and decodes its stripes.
        pieces = busiest()[2]
        floor = out["decode_alone_s"] + pieces / DATA * zero["gloo_s"]
        slowest = max(lost, key=lambda r: r["rebuild_s"] or 0.0)
        out |= {"lost_rebuild_s": rebuild, "lost_rebuild_phases_s": slowest["rebuild_phases_s"],
                "lost_received_bytes": max(r["rebuild_received_bytes"] or 0 for r in lost),
                "busiest_pieces_received": pieces, "rebuild_floor_s": floor,
                "rebuild_vs_floor": h.ratio(rebuild, floor),
                "lost_restore_vs_floor": h.ratio(restore, floor),
                "rebuilt_as_expected": all((r["rebuilt_step"] is not None) == (r["rank"] in run["lost"]) for r in got)}  # fmt: skip
    return out


def compare(jobs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Parity against copies, this run's numbers."""
    p, c = jobs["parity"]["summary"], jobs["replicas"]["summary"]
    return {
        "held_parity_vs_snapshot": p["held_vs_snapshot"],
        "held_replicas_vs_snapshot": c["held_vs_snapshot"],
        "held_bound": SLOTS + PARITY / DATA,
        "held_parity_within_bound": p["held_vs_snapshot_max"] <= (SLOTS + PARITY / DATA) * 1.01,
        "protect_parity_vs_replicas": h.ratio(p["protect_s"], c["protect_s"]),
        "rebuild_vs_replica_restore": h.ratio(p["lost_restore_s"], c["lost_restore_s"]),
        "all_bit_identical": p["all_bit_identical"] and c["all_bit_identical"],
    }


# ------------------------------------------------------------------------------------------
# The parent: jobs, table, JSON
# ------------------------------------------------------------------------------------------


def _x(summary: dict[str, Any], key: str) -> str:
    return h.fmt(summary.get(key)) + ("x" if summary.get(key) is not None else "")


def _rows(jobs: dict[str, Any]) -> tuple[list[list[Any]], list[list[Any]]]:
    """The save table's rows and the restore table's, a job each."""
    label = {"parity": f"parity {DATA}+{PARITY}", "replicas": f"replicas={REPLICAS}"}
    saves, restores = [], []
    for kind, j in jobs.items():
        s, name = j.get("summary"), f"{label[kind]}, lost {j.get('lost', LOST[kind])}"
        if s is None:
            saves.append([name, str(j.get("error", "?"))[:80], *["-"] * 5])
            restores.append([name, *["-"] * 6])
            continue
        held = (f"{s['held_vs_snapshot']:.2f}x ({s['slots_vs_snapshot']:.2f} + {s['parity_vs_snapshot']:.2f} + "
                f"{s['other_vs_snapshot']:.2f})")  # fmt: skip
        saves.append([name, held, f"{s['protect_s']:.3f} ({s['first_protect_s']:.3f})", h.fmt(s["protect_gib_s"], ".3f"),
                      _x(s, "protect_vs_memcpy_crc_alone"), _x(s, "protect_vs_memcpy_crc_together"),
                      _x(s, "protect_vs_encode_together")])  # fmt: skip
        restores.append([name, f"{s['lost_restore_s']:.3f}", h.fmt(s.get("lost_rebuild_s"), ".3f"),
                         f"{s['others_restore_s']:.3f}", _x(s, "lost_restore_vs_gloo"), _x(s, "lost_restore_vs_floor"),
                         s["all_bit_identical"]])  # fmt: skip
    return saves, restores


def render(report: dict[str, Any]) -> str:
    saves, restores = _rows(report["jobs"])
    lines = [h.machine_line(report["machine"]), f"{NODES} nodes (one gloo rank each, loopback), "
             f"{h.fmt_bytes(report['state_bytes'])} of state per node, slots={SLOTS}, {report['steps']} saves.", ""]  # fmt: skip
    lines += [h.table(["job", "memory held / snapshot (slots + parity + other)", "protect s (first save)",
                       "protect GiB/s a node", "protect / memcpy+CRC32C alone", "protect / memcpy+CRC32C, 6 at once",
                       "protect / zfec encode, 6 at once"], saves), ""]  # fmt: skip
    lines += [h.table(["job", "lost nodes' restore s", "of it, rebuild s", "other nodes' restore s",
                       "lost restore / gloo send/recv of S", "lost restore / rebuild floor", "bit-identical"],
                      restores), ""]  # fmt: skip
    if "compare" in report:
        c, p = report["compare"], report["jobs"]["parity"]["summary"]
        lines += [
            "Ratios, this run:",
            f"- memory held / snapshot: parity {c['held_parity_vs_snapshot']:.2f}x (slots + m/k = "
            f"{c['held_bound']:.2f}x; within 1%: {c['held_parity_within_bound']}), replicas={REPLICAS} "
            f"{c['held_replicas_vs_snapshot']:.2f}x",
            f"- time to protect a save, parity / copies: {h.fmt(c['protect_parity_vs_replicas'])}x; parity "
            f"{p['protect_gib_s']:.3f} GiB/s a node (memcpy + CRC32C of a node's bytes: {p['memcpy_crc_alone_s']:.4f} s "
            f"alone, {p['memcpy_crc_together_s']:.4f} s 6 at once; zfec encode of a node's parity "
            f"{p['encode_alone_s']:.3f} s alone, {p['encode_together_s']:.3f} s 6 at once)",
            f"- a lost node's restore, 2 nodes rebuilt from parity / 1 node from a peer's copy: "
            f"{h.fmt(c['rebuild_vs_replica_restore'])}x (target <= 2x); rebuild / its floor (zfec decode of the "
            f"busiest lost node's stripes alone, {p['decode_alone_s']:.3f} s, + {p['busiest_pieces_received'] / DATA:.2f}"
            f" x gloo send/recv of S for its {p['busiest_pieces_received']} pieces of S/{DATA}, "
            f"{p['rebuild_floor_s']:.3f} s in all): {h.fmt(p['rebuild_vs_floor'])}x; a lost node received at most "
            f"{p['lost_received_bytes'] / p['state_bytes']:.2f} S",
            f"- every restore bit-identical: {c['all_bit_identical']}",
        ]
    lines.append("protect: from save(step).wait() returning (committed in memory) to Checkpointer.wait() returning "
                 "(parity coded / copies made), median over nodes and saves after the first. restore s: "
                 "Checkpointer.stats() restore_s (the rebuild included, in agree), the slowest node.")  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=64, help="state per node, MiB (default 64)")
    ap.add_argument("--steps", type=int, default=3, help="saves per job (default 3)")
    ap.add_argument("--dir", help="scratch directory for the local tiers (default: a temporary one)")
    ap.add_argument("--shm", default="/dev/shm", help="tmpfs for the memory tiers (default /dev/shm)")
    ap.add_argument("--worker-timeout", type=float, default=900)
    ap.add_argument("--json", nargs="?", const=str(h.RESULTS_DIR / "parity_bench.json"), metavar="PATH",
                    help="write the measurements to PATH (default bench/results/parity_bench.json)")  # fmt: skip
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    report: dict[str, Any] = {"machine": h.machine_info(args.dir or "."), "mib": args.mib, "steps": args.steps,
                              "nodes": NODES, "code": [DATA, PARITY], "replicas": REPLICAS, "slots": SLOTS,
                              "jobs": {}}  # fmt: skip
    with h.scratch_dir(args.dir or tempfile.gettempdir(), "parity-bench-") as root, \
            h.scratch_dir(args.shm, "parity-bench-shm-") as shm:  # fmt: skip
        for kind in JOBS:
            h.log(f"{kind}: {NODES} nodes, {args.steps} saves, lose nodes {LOST[kind]}, restart")
            kw = {"kind": kind, "mib": args.mib, "steps": args.steps, "root": str(root / kind),
                  "shm": str(shm / kind), "timeout": args.worker_timeout}  # fmt: skip
            run = h.run_worker(__file__, "job", kw, timeout=args.worker_timeout + 60)
            if "error" not in run:
                run["summary"] = summarise(run)
            report["jobs"][kind] = run
    report["state_bytes"] = next((j["summary"]["state_bytes"] for j in report["jobs"].values() if "summary" in j), 0)
    if all("summary" in j for j in report["jobs"].values()):
        report["compare"] = compare(report["jobs"])
    report["wall_s"] = time.perf_counter() - t0
    report["table"] = render(report)
    print(report["table"])
    if args.json:
        h.log(f"wrote {h.write_json(args.json, report)} in {report['wall_s']:.0f} s")
    failed = [k for k, j in report["jobs"].items()
              if "error" in j or not (j["summary"]["all_bit_identical"] and j["summary"]["restored_newest"])]  # fmt: skip
    for k in failed:
        j = report["jobs"][k]
        why = j.get("error") or "a restore not bit-identical, or not of the newest step"
        print(f"{k}: {why}\n{j.get('traceback', '')}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
