#!/usr/bin/env python
"""Coordination cost per rank as the world grows: a simulation with the real planning code.

Usage::

    .venv/bin/python bench/scale_sim.py --before --layout gpt3 --ranks 1024
    .venv/bin/python bench/scale_sim.py --before --layout all --json

Every simulated rank of a Megatron GPT-3 175B, a torchtitan Llama-3 405B (TP x PP x HSDP; ``llama405-padded``:
its vocabulary padded for even pieces) or an FSDP2 Llama-70B layout runs tiercheck's own
protocol generators ("after", always) or the previous design's planning ("--before"), in one
process, without tensors or chunk data. Method and columns: bench/README.md ("Scale simulation").
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import harness as h  # puts the repository first on sys.path
import scale_after
import torch.distributed as dist
from scale_after import tree as _tree
from scale_layouts import Layout, worlds

from tiercheck import __version__
from tiercheck.cluster.assign import LeafDesc, Need, WriteAssignment, assign_all_reads, assign_writes
from tiercheck.format.codec import zarr_documents
from tiercheck.format.manifest import Manifest
from tiercheck.format.saveid import new_save_id

TARGET_CHUNK_BYTES = 64 << 20
RANKS_PER_NODE = 8
COLUMNS = (
    "layout",
    "world_size",
    "leaves",
    "nodes",
    "store_bytes_max_rank",
    "store_ops_max_rank",
    "store_ops_server_per_save",
    "rank0_coord_peak_bytes",
    "plan_s_max_rank",
    "commit_s",
    "find_latest_s",
    "second_save_store_bytes",
    "objects_per_step",
    "manifest_bytes_read_max_rank",
    "restore_store_bytes_max_rank",
    "gen_s",
)

# ---------------------------------------------------------------------------- before: today's


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _commit_parts(descs_per_rank: Layout, plan: WriteAssignment, rng: random.Random) -> list[dict[str, Any]]:
    """What each rank posts to the store when its writes are durable (``Checkpointer._commit``)."""
    parts = []
    for rank, tasks in enumerate(plan.tasks):
        crc: dict[str, dict[str, int]] = {}
        for t in tasks:
            crc.setdefault(descs_per_rank[rank][t.leaf].path, {})[t.chunk.key] = rng.getrandbits(32)
        parts.append({"crc": crc, "tree": _tree(descs_per_rank[rank]), "metadata": None, "created": time.time()})
    return parts


def _manifest(plan: WriteAssignment, parts: list[dict[str, Any]], n: int) -> Manifest:
    """The manifest the node leaders write (``Checkpointer._manifest``), from the posted parts."""
    checksums: dict[str, dict[str, int]] = {path: {} for path in plan.records}
    for p in parts:
        for path, crcs in p["crc"].items():
            checksums[path].update(crcs)
    trees: list[Any] = []
    index: dict[str, int] = {}
    tree_of_rank: dict[int, int] = {}
    for r, p in enumerate(parts):
        text = _json(p["tree"])
        if text not in index:
            index[text] = len(trees)
            trees.append(p["tree"])
        tree_of_rank[r] = index[text]
    nodes = [f"{random.Random(r // RANKS_PER_NODE).getrandbits(128):032x}" for r in range(n)]
    records = {
        path: replace(rec, checksums=dict(sorted(checksums[path].items()))) for path, rec in plan.records.items()
    }
    return Manifest(
        step=1000,
        library_version=__version__,
        created_unix=parts[0]["created"],
        trees=trees,
        tree_of_rank=tree_of_rank,
        world_size=n,
        arrays=records,
        topology={"world_size": n, "nodes": nodes},
        save_id=new_save_id("scale-sim", 1000, 0),
    )


def _whole_manifest(manifest: Manifest) -> bytes:
    """The whole manifest as one document, as the design before manifest parts wrote it (the
    library reads and writes it in parts only): what every rank would have read back."""
    doc = {
        "format": "tiercheck",
        "format_version": 2,
        "library_version": manifest.library_version,
        "step": manifest.step,
        "created_unix": manifest.created_unix,
        "topology": manifest.topology,
        "metadata": manifest.metadata,
        "arrays": {path: rec.to_json() for path, rec in manifest.arrays.items()},
        "trees": manifest.trees,
        "tree_of_rank": [manifest.tree_of_rank.get(r, -1) for r in range(manifest.world_size)],
    }
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()


def simulate_before(name: str, descs_per_rank: Layout, args: argparse.Namespace) -> dict[str, Any]:
    """Today's path, measured with tiercheck's own code (see bench/README.md)."""
    n = len(descs_per_rank)
    values = [_json([d.to_json() for d in descs]) for descs in descs_per_rank]  # what each rank sets
    sizes = [len(v.encode()) for v in values]
    t0 = time.perf_counter()
    everyone = [[LeafDesc.from_json(d, where="all-gather") for d in json.loads(v)] for v in values]  # what each rank does with them
    decode_s = time.perf_counter() - t0
    del values
    t0 = time.perf_counter()
    plan = assign_writes(everyone, target_chunk_bytes=args.chunk_bytes)
    plan_s = time.perf_counter() - t0
    del everyone

    parts = [_json(p) for p in _commit_parts(descs_per_rank, plan, random.Random(0))]
    part_sizes = [len(p.encode()) for p in parts]
    nodes = -(-n // RANKS_PER_NODE)
    manifest = _manifest(plan, [json.loads(p) for p in parts], n)
    del parts
    manifest_bytes = len(_whole_manifest(manifest))
    n_docs = len(zarr_documents(manifest.arrays.values()))

    needs = [[Need(d.path, d.offsets, d.shape) for d in descs] for descs in descs_per_rank]
    needs_sizes = [len(_json({"needs": [[x.path, list(x.offsets), list(x.shape)] for x in r]})) for r in needs]
    restore_s: float | None = None
    note = None
    if n <= args.restore_max_ranks:
        on_node = [frozenset(range(i, min(i + RANKS_PER_NODE, n))) for i in range(0, n, RANKS_PER_NODE)]
        readable = [on_node[r // RANKS_PER_NODE] for r in range(n)]
        t0 = time.perf_counter()
        assign_all_reads(manifest.arrays, needs, readable, read_once=False)
        restore_s = time.perf_counter() - t0
    else:
        note = f"restore plan skipped: too slow (world {n} > --restore-max-ranks {args.restore_max_ranks})"
    return {
        "store_bytes_total": n * sum(sizes) + sum(sizes),
        "store_bytes_max_rank": sum(sizes) + max(sizes),
        "plan_s_max_rank": plan_s,
        "decode_s_max_rank": decode_s,
        "commit_store_bytes_per_save": sum(part_sizes) + nodes * sum(part_sizes),
        "manifest_bytes_read_max_rank": manifest_bytes,
        "restore_plan_s_max_rank": restore_s,
        "objects_per_step": sum(len(t) for t in plan.tasks) + nodes * (n_docs + 2),
        "arrays": len(plan.records),
        "chunks": sum(len(t) for t in plan.tasks),
        "desc_bytes_per_rank_max": max(sizes),
        "commit_part_bytes_max": max(part_sizes),
        "restore_store_bytes_total": (n + 1) * sum(needs_sizes),  # the restore's all-gather of needs
        "note": note,
    }


# ----------------------------------------------------------------------------- after: the new


def simulate_after(name: str, descs_per_rank: Layout, args: argparse.Namespace) -> dict[str, Any]:
    """The new coordination, every protocol run by tiercheck's own code (bench/scale_after.py)."""
    # One process holds every simulated rank's objects: a collection pass would walk all of them
    # and be charged to whichever rank ran at the time. A real rank's heap holds its own.
    gc.disable()
    try:
        row = scale_after.simulate_after(descs_per_rank, args)
    finally:
        gc.enable()
    rate = args.server_ops_per_s
    row["server_ops_per_s"] = rate
    row["commit_server_bound_s"] = row["store_ops_server_per_save"] / rate
    row["find_latest_server_bound_s"] = row["find_latest_server_ops"] / rate
    return row


def store_rate(ops: int = 20_000) -> float:
    """Requests per second one client gets from a TCPStore on loopback (``add``), measured now:
    the job's store serves about this many, whoever asks."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
    t0 = time.perf_counter()
    for i in range(ops):
        client.add(f"k{i % 64}", 1)
    return ops / (time.perf_counter() - t0)


def _fmt(key: str, v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if key.endswith("_s") or "_s_" in key:
        return f"{v:.3f}" if v < 100 else f"{v:.0f}"
    if "bytes" in key:
        return h.fmt_bytes(v)
    return f"{v:,}"


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ("mode", *COLUMNS)
    print(h.table(cols, [[_fmt(c, row.get(c)) for c in cols] for row in rows], right=False))
    print(
        f"\nbefore: the previous design's all-gather, commit ({RANKS_PER_NODE} ranks per node) and restore planning; "
        "after: tiercheck's protocols for every simulated rank in lockstep over one store. Per-rank columns are the "
        "most any rank paid; what each counts: bench/README.md (Scale simulation). '-': not measured."
    )
    for row in rows:
        if row.get("note"):
            print(f"{row['layout']} world {row['world_size']} {row['mode']}: {row['note']}")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", help="world sizes (gpt3: TP8 x PP16 x DP=ranks/128)")
    ap.add_argument("--layout", choices=("gpt3", "llama405", "llama405-padded", "llama", "all"), default="all")
    ap.add_argument("--json", action="store_true", help="one JSON object per (layout, world size, mode)")
    ap.add_argument("--before", action="store_true", help="measure today's path too")
    ap.add_argument("--before-max-ranks", type=int, default=2048, help="skip 'before' above this world size")
    ap.add_argument(
        "--restore-max-ranks", type=int, default=1024, help="skip the restore plan ('before') above this world size"
    )
    ap.add_argument("--chunk-bytes", type=int, default=TARGET_CHUNK_BYTES, help=argparse.SUPPRESS)
    ap.add_argument("--rtt-ms", type=float, default=0.2, help="a store request's round trip in the time model")
    ap.add_argument(
        "--full", action="store_true",
        help="gpt3, llama405*: plan for every rank, not one pipeline stage and its coordinators",
    )
    ap.add_argument(
        "--replace",
        type=int,
        default=0,
        metavar="REPLICAS",
        help="after: also restore with one node replaced, its files in REPLICAS peers' memory (bench/scale_replace.py)",
    )
    args = ap.parse_args(argv)
    args.server_ops_per_s = store_rate()
    print(f"a TCPStore on loopback serves {args.server_ops_per_s:,.0f} requests/s here", file=sys.stderr)

    rows: list[dict[str, Any]] = []
    after_missing: str | None = None
    all_layouts = ("gpt3", "llama405", "llama405-padded", "llama")
    for layout in all_layouts if args.layout == "all" else (args.layout,):
        for n, generate in worlds(layout, args.ranks, stage=None if args.full else 0):
            gc.disable()  # millions of small objects: collections would only slow generation down
            t0 = time.perf_counter()
            descs = generate()
            gen_s = time.perf_counter() - t0
            gc.enable()
            gc.freeze()  # one rank holds only its own descriptions: keep the others out of its collections
            base = {"layout": layout, "world_size": n, "leaves": sum(map(len, descs)), "gen_s": gen_s}
            print(f"{layout} world {n}: {base['leaves']:,} leaves generated in {gen_s:.2f} s", file=sys.stderr)
            modes: list[tuple[str, Callable[[str, Layout, argparse.Namespace], dict[str, Any]]]] = []
            if args.before:
                modes.append(("before", simulate_before))
            modes.append(("after", simulate_after))
            for mode, simulate in modes:
                row: dict[str, Any] = {"mode": mode, **base, **dict.fromkeys(COLUMNS[3:-1])}
                if mode == "before" and n > args.before_max_ranks:
                    row["note"] = f"skipped: too slow (world {n} > --before-max-ranks {args.before_max_ranks})"
                    print(f"{layout} world {n}: before {row['note']}", file=sys.stderr)
                else:
                    try:
                        t0 = time.perf_counter()
                        row.update(simulate(layout, descs, args))
                        row["sim_s"] = time.perf_counter() - t0
                    except NotImplementedError as e:
                        after_missing = str(e)
                        continue
                row["peak_rss_mib"] = h.hwm_bytes() / h.MiB
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
                elif "sim_s" in row:
                    print(f"{layout} world {n} {mode}: done in {row['sim_s']:.1f} s", file=sys.stderr)
            del descs
            gc.unfreeze()
    if not args.json:
        print_table(rows)
        if args.replace:
            from scale_replace import table_rows

            print(f"\nnode 1 replaced, its files in {args.replace} peers' memory (with / without the replacement):")
            print(h.table(*table_rows(rows), right=False))
    if after_missing:
        print(f"\n{after_missing}", file=sys.stderr if args.json else sys.stdout)
    print(f"peak RSS {h.hwm_bytes() / h.MiB:.0f} MiB", file=sys.stderr if args.json else sys.stdout)


if __name__ == "__main__":
    main()
