#!/usr/bin/env python
"""Coordination cost per rank as the world grows: a simulation with the real planning code.

Usage::

    .venv/bin/python bench/scale_sim.py --before --layout gpt3 --ranks 1024
    .venv/bin/python bench/scale_sim.py --before --layout all --json

Every simulated rank of a Megatron GPT-3 175B or FSDP2 Llama-70B layout runs tiercheck's own
protocol generators ("after", always) or the previous design's planning ("--before"), in one
process, without tensors or chunk data. Method and columns: bench/README.md ("Scale simulation").
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import harness as h  # puts the repository first on sys.path
import torch.distributed as dist

from tiercheck import __version__
from tiercheck.cluster.assign import LeafDesc, Need, WriteAssignment, assign_all_reads, assign_writes
from tiercheck.cluster.coordination import Coordinator, lockstep
from tiercheck.cluster.job import Job
from tiercheck.cluster.nodes import Nodes, join_in_lockstep
from tiercheck.format.codec import chunk_nbytes, seal, zarr_documents
from tiercheck.format.manifest import Manifest, RankPart
from tiercheck.format.saveid import new_save_id
from tiercheck.format.shards import owners_bytes, shard_bytes
from tiercheck.restore.agree import agree_on_step, settle
from tiercheck.restore.holders import find_holders
from tiercheck.restore.needed import manifest_for
from tiercheck.restore.plan import ReadRequest, plan_restore
from tiercheck.save.plan import plan_save
from tiercheck.save.vote import RankOutcome, commit_save
from tiercheck.tiers.local import LocalTier

TARGET_CHUNK_BYTES = 64 << 20
RANKS_PER_NODE = 8
GPT3_TP, GPT3_PP = 8, 16
GPT3_DPS = (1, 8, 32, 128)
LLAMA_WORLDS = (128, 512, 2048)
OPT_STATES = ("fp32_param", "exp_avg", "exp_avg_sq")
COLUMNS = (
    "layout",
    "world_size",
    "leaves",
    "store_bytes_total",
    "store_bytes_max_rank",
    "plan_s_max_rank",
    "commit_store_bytes_per_save",
    "manifest_bytes_read_max_rank",
    "restore_plan_s_max_rank",
    "objects_per_step",
    "decode_s_max_rank",
    "gen_s",
)
Layout = list[list[LeafDesc]]

# ------------------------------------------------------------------------------------ layouts


def _split(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``n`` cut into ``parts`` as torch.chunk does: (offset, extent), maybe empty."""
    size = -(-n // parts)
    start = min(i * size, n)
    return start, min(start + size, n) - start


def _desc(path: str, dtype: str, shape: tuple[int, ...], dim: int | None, parts: int, i: int) -> LeafDesc:
    """Piece ``i`` of ``parts`` of a global array cut along ``dim`` (None: the whole array)."""
    offsets, local = [0] * len(shape), list(shape)
    if dim is not None:
        offsets[dim], local[dim] = _split(shape[dim], parts, i)
    return LeafDesc(path, dtype, "tensor", shape, tuple(offsets), tuple(local), False)


def gpt3(tp: int = GPT3_TP, pp: int = GPT3_PP, dp: int = 1) -> Layout:
    """GPT-3 175B under Megatron: every rank's descriptions, in Megatron's rank order.

    Column-parallel weights are cut on rows over TP, row-parallel ones on columns; biases of
    row-parallel layers and layernorms are replicated; the padded embedding sits on the first
    stage, the final layernorm on the last. bf16 parameters are replicated over DP. The
    distributed optimizer keeps, per (tp, pp) rank, three flat fp32 buffers (master weights and
    Adam moments) as long as that rank's parameters, split into DP contiguous parts.
    """
    h, layers, vocab = 12288, 96, 50257
    if layers % pp:
        raise ValueError(f"{layers} layers do not split evenly over {pp} pipeline stages")
    vocab_padded = -(-vocab // (tp * 128)) * (tp * 128)
    per_stage = layers // pp
    params: dict[tuple[int, int], list[LeafDesc]] = {}
    for p in range(pp):
        for t in range(tp):
            spec: list[tuple[str, tuple[int, ...], int | None]] = []
            if p == 0:
                spec.append(("embedding.word_embeddings.weight", (vocab_padded, h), 0))
            for layer in range(p * per_stage, (p + 1) * per_stage):
                pre = f"decoder.layers.{layer}."
                spec += [
                    (pre + "input_layernorm.weight", (h,), None),
                    (pre + "input_layernorm.bias", (h,), None),
                    (pre + "self_attention.linear_qkv.weight", (3 * h, h), 0),
                    (pre + "self_attention.linear_qkv.bias", (3 * h,), 0),
                    (pre + "self_attention.linear_proj.weight", (h, h), 1),
                    (pre + "self_attention.linear_proj.bias", (h,), None),
                    (pre + "pre_mlp_layernorm.weight", (h,), None),
                    (pre + "pre_mlp_layernorm.bias", (h,), None),
                    (pre + "mlp.linear_fc1.weight", (4 * h, h), 0),
                    (pre + "mlp.linear_fc1.bias", (4 * h,), 0),
                    (pre + "mlp.linear_fc2.weight", (h, 4 * h), 1),
                    (pre + "mlp.linear_fc2.bias", (h,), None),
                ]
            if p == pp - 1:
                spec += [("decoder.final_layernorm.weight", (h,), None), ("decoder.final_layernorm.bias", (h,), None)]
            params[p, t] = [_desc(f"model/{name}", "bfloat16", shape, dim, tp, t) for name, shape, dim in spec]
    numel = {key: sum(math.prod(d.shape) for d in descs) for key, descs in params.items()}
    ranks: Layout = []
    for r in range(tp * pp * dp):
        t, d, p = r % tp, (r // tp) % dp, r // (tp * dp)
        n = numel[p, t]
        opt = [_desc(f"optimizer/tp{t}.pp{p}/{s}", "float32", (n,), 0, dp, d) for s in OPT_STATES]
        ranks.append(params[p, t] + opt)
    return ranks


def llama70b_fsdp2(world: int) -> Layout:
    """A Llama-70B-like model under FSDP2: every parameter (bf16) and both Adam moments (fp32)
    cut on dim 0 over all ``world`` ranks, torch.chunk style; trailing ranks may hold empty pieces."""
    h, ffn, kv, vocab, layers = 8192, 28672, 1024, 128256, 80
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        pre = f"model.layers.{i}."
        shapes += [
            (pre + "self_attn.q_proj.weight", (h, h)),
            (pre + "self_attn.k_proj.weight", (kv, h)),
            (pre + "self_attn.v_proj.weight", (kv, h)),
            (pre + "self_attn.o_proj.weight", (h, h)),
            (pre + "mlp.gate_proj.weight", (ffn, h)),
            (pre + "mlp.up_proj.weight", (ffn, h)),
            (pre + "mlp.down_proj.weight", (h, ffn)),
            (pre + "input_layernorm.weight", (h,)),
            (pre + "post_attention_layernorm.weight", (h,)),
        ]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    arrays = [(f"model/{name}", "bfloat16", shape) for name, shape in shapes]
    for state in ("exp_avg", "exp_avg_sq"):
        arrays += [(f"optim/state/{name}/{state}", "float32", shape) for name, shape in shapes]
    ranks: Layout = []
    for r in range(world):
        boxes: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for shape in {shape for _, _, shape in arrays}:
            off, ext = _split(shape[0], world, r)
            boxes[shape] = ((off,) + (0,) * (len(shape) - 1), (ext, *shape[1:]))
        out = [LeafDesc(path, dtype, "tensor", shape, *boxes[shape], False) for path, dtype, shape in arrays]
        ranks.append(out)
    return ranks


def worlds(layout: str, ranks: Sequence[int] | None) -> list[tuple[int, Callable[[], Layout]]]:
    """The (world size, generator) pairs to run for ``layout``."""
    if layout == "gpt3":
        unit = GPT3_TP * GPT3_PP
        dps = GPT3_DPS if not ranks else [n // unit for n in ranks]
        for n in ranks or ():
            if n % unit:
                raise SystemExit(f"gpt3: --ranks {n} is not a multiple of TP*PP = {unit}")
        return [(unit * dp, partial(gpt3, GPT3_TP, GPT3_PP, dp)) for dp in dps]
    return [(n, partial(llama70b_fsdp2, n)) for n in (ranks or LLAMA_WORLDS)]


# ---------------------------------------------------------------------------- before: today's


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _tree(descs: Sequence[LeafDesc]) -> dict[str, Any]:
    """The state tree a rank posts, approximated: nested dicts along each path's components."""
    root: dict[str, Any] = {}
    for d in descs:
        *parents, name = d.path.split("/")
        node = root
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = {"$tensor": d.path}
    return root


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
    tree_of_rank = []
    for p in parts:
        text = _json(p["tree"])
        if text not in index:
            index[text] = len(trees)
            trees.append(p["tree"])
        tree_of_rank.append(index[text])
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
        "tree_of_rank": manifest.tree_of_rank,
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


class _CountingTier(LocalTier):
    """A node's directory that counts the bytes each simulated rank reads from it."""

    current: ClassVar[list[int]] = [0]  # the simulated rank whose protocol is running (set by _run)
    reads: ClassVar[dict[int, int]] = {}

    def read(self, path: str) -> bytearray:
        data = super().read(path)
        self.reads[self.current[0]] = self.reads.get(self.current[0], 0) + len(data)
        return data


def _run(protocols: list[Any], seconds: list[float]) -> list[Any]:
    """``lockstep`` over the ranks' protocols, timing each rank's own steps and attributing its
    reads to it."""

    def timed(i: int, protocol: Any) -> Any:
        while True:
            _CountingTier.current[0] = i
            t0 = time.perf_counter()
            try:
                barrier = next(protocol)
            except StopIteration as stop:
                seconds[i] += time.perf_counter() - t0
                return stop.value
            seconds[i] += time.perf_counter() - t0
            yield barrier

    return lockstep([timed(i, p) for i, p in enumerate(protocols)])


def _restore_plan(coord: Coordinator, tier: LocalTier, nodes: Nodes, descs: Sequence[LeafDesc]) -> Any:
    """What ``restore.protocol.restore_state`` runs before moving bytes, for a rank restoring the layout it
    saved (the live state is not built: its needs are the pieces it holds)."""
    job = Job(coord=coord, nodes=nodes, tier=tier)
    choice = yield from agree_on_step(job, "restore0/step", requested=None, remote_steps=list)
    assert choice.step is not None
    here = choice.held[str(choice.step)][0]
    st = yield from find_holders(job, "restore0", choice.step, here, from_remote=False)
    manifest = yield from manifest_for(job, "restore0", st, {}, others=False)
    yield from settle(coord, "restore0/prepared", None)
    needs = [Need(d.path, d.offsets, d.shape) for d in descs]
    plan = yield from plan_restore(job, "restore0", st, ReadRequest(needs=needs, records=manifest.arrays, read_once=False))
    return plan


def simulate_after(name: str, descs_per_rank: Layout, args: argparse.Namespace) -> dict[str, Any]:
    """The new coordination: every simulated rank runs tiercheck's own protocols (``saveplan``,
    ``commit``, ``restore``/``restoreplan``) over one in-memory store, in lockstep; the commit
    writes every rank's part of the manifest and each node's index and marker into a directory per
    simulated node (no fsync, no chunk data), and the restore plan reads them back."""
    # One process holds every simulated rank's objects: a collection pass would walk all of them
    # and be charged to whichever rank ran at the time. A real rank's heap holds its own.
    gc.disable()
    try:
        return _simulate_after(descs_per_rank, args)
    finally:
        gc.enable()


def _simulate_after(descs_per_rank: Layout, args: argparse.Namespace) -> dict[str, Any]:
    n = len(descs_per_rank)
    store = dist.HashStore()
    coords = [Coordinator(store, rank=r, world_size=n, namespace="sim", timeout_s=60) for r in range(n)]
    with tempfile.TemporaryDirectory(prefix="tiercheck-scale-") as tmp:
        tiers = [_CountingTier(Path(tmp) / f"node{k}", fsync=False) for k in range(-(-n // RANKS_PER_NODE))]
        tier_of = [tiers[r // RANKS_PER_NODE] for r in range(n)]
        nodes = join_in_lockstep(coords, [f"node{r // RANKS_PER_NODE}" for r in range(n)])
        start = [c.store_bytes for c in coords]

        plan_s = [0.0] * n
        plans = _run(
            [plan_save(c, 0, descs_per_rank[c.rank], target_chunk_bytes=args.chunk_bytes) for c in coords], plan_s
        )
        plan_bytes = [c.store_bytes - b for c, b in zip(coords, start, strict=True)]

        start = [c.store_bytes for c in coords]
        commits = []
        packs = refs = 0
        for c in coords:
            r, plan, descs = c.rank, plans[c.rank], descs_per_rank[c.rank]
            crcs: dict[str, dict[str, int]] = {}
            offsets: dict[str, dict[str, int]] = {}
            sizes: dict[str, int] = {}
            end = 0
            for t in plan.tasks:  # laid out in the pack as save.plan.pack_plan does
                path = descs[t.leaf].path
                sizes[path] = chunk_nbytes(plan.records[path])
                crcs.setdefault(path, {})[t.chunk.key] = 0
                offsets.setdefault(path, {})[t.chunk.key] = end
                end += sizes[path] + 4
            packs += bool(plan.tasks)
            refs += bool(plan.tasks or plan.shard or r == nodes[r].leader)
            commits.append(
                commit_save(
                    Job(coord=c, nodes=nodes[r], tier=tier_of[r]),
                    RankOutcome(
                        step=1,
                        attempt=0,
                        save_id=(save := new_save_id(nodes[r].run, 1, 0)),
                        part=seal(RankPart(_tree(descs), crcs, offsets, sizes, save).to_bytes()),
                        shard=seal(shard_bytes(plan.shard, save)) if plan.shard else None,
                        owners=seal(owners_bytes(plan.shard, save)) if plan.shard else None,
                        metadata={"simulated": True},
                        library_version=__version__,
                    ),
                )
            )
        _run(commits, [0.0] * n)
        commit_bytes = sum(c.store_bytes - b for c, b in zip(coords, start, strict=True))
        files = sum(len(t.sizes("step-00000001")) for t in tiers)

        start = [c.store_bytes for c in coords]
        start_in = [c.counters["store_bytes_in"] for c in coords]
        _CountingTier.reads.clear()
        restore_s = [0.0] * n
        _run([_restore_plan(c, tier_of[c.rank], nodes[c.rank], descs_per_rank[c.rank]) for c in coords], restore_s)
        restore_bytes = [c.store_bytes - b for c, b in zip(coords, start, strict=True)]
        manifest_read = [
            _CountingTier.reads.get(r, 0) + coords[r].counters["store_bytes_in"] - start_in[r] for r in range(n)
        ]
    return {
        "store_bytes_total": sum(plan_bytes),
        "store_bytes_max_rank": max(plan_bytes),
        "plan_s_max_rank": max(plan_s),
        "commit_store_bytes_per_save": commit_bytes,
        "manifest_bytes_read_max_rank": max(manifest_read),
        "restore_plan_s_max_rank": max(restore_s),
        "objects_per_step": packs + refs + files,
        "arrays": sum(len(p.shard) for p in plans),
        "chunks": sum(len(p.tasks) for p in plans),
        "plan_s_mean_rank": sum(plan_s) / n,
        "restore_store_bytes_max_rank": max(restore_bytes),
        "restore_store_bytes_total": sum(restore_bytes),
        "store_ops_max_rank": max(c.counters["store_ops"] for c in coords),
        "store_keys_left": store.num_keys(),
    }


# ------------------------------------------------------------------------------------- output


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
    ap.add_argument("--layout", choices=("gpt3", "llama", "all"), default="all")
    ap.add_argument("--json", action="store_true", help="one JSON object per (layout, world size, mode)")
    ap.add_argument("--before", action="store_true", help="measure today's path too")
    ap.add_argument("--before-max-ranks", type=int, default=2048, help="skip 'before' above this world size")
    ap.add_argument(
        "--restore-max-ranks", type=int, default=1024, help="skip the restore plan ('before') above this world size"
    )
    ap.add_argument("--chunk-bytes", type=int, default=TARGET_CHUNK_BYTES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    rows: list[dict[str, Any]] = []
    after_missing: str | None = None
    for layout in ("gpt3", "llama") if args.layout == "all" else (args.layout,):
        for n, generate in worlds(layout, args.ranks):
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
    if after_missing:
        print(f"\n{after_missing}", file=sys.stderr if args.json else sys.stdout)
    print(f"peak RSS {h.hwm_bytes() / h.MiB:.0f} MiB", file=sys.stderr if args.json else sys.stdout)


if __name__ == "__main__":
    main()
