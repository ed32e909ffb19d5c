#!/usr/bin/env python
"""Hugging Face export benchmark: ``tiercheck export`` (``tiercheck.integrations.hf.export``) against DCP's
``HuggingFaceStorageWriter`` and ``consolidate_safetensors_files`` on the same state, in one run. bench/README.md
("Hugging Face export benchmark") has the details.

    .venv/bin/python bench/hf_bench.py            # ~1 GiB of fp32 Llama-shaped weights, 3 repeats
    .venv/bin/python bench/hf_bench.py --quick    # ~0.25 GiB, 1 repeat

The state is a Llama-shaped model's weights (embedding, attention and MLP matrices, norms, lm_head), fp32. A
first worker saves it once as a tiercheck step and once as DCP's sharded safetensors (``HuggingFaceStorageWriter``,
``save_distributed=True``: what each rank of a job writes). Then, each in a fresh process, page cache dropped
first (root), rounds alternating:

- ``tiercheck export``: the step -> a safetensors directory (chunks verified, shards fsync'd, renamed whole);
- ``DCP consolidate``: the DCP sharded directory -> a safetensors directory (``consolidate_safetensors_files``),
  then an fsync of what it wrote (it syncs nothing itself; the fsync is timed apart and included);
- ``DCP save+consolidate``: ``dcp.save`` of the in-memory state with ``enable_consolidation=True`` (the sharded
  files, then the consolidated ones), plus the same fsync: the way DCP hands a job's state to inference.

Peak memory is the worker's VmHWM over its RSS just before the timed call. Limit, same run: an fsync'd sequential
write of the output's size, and the same write beside a cold read of the step (a copy on one disk cannot beat
it), once a round (medians); ``-warm`` rows read their source once first, so they only write. Every method's
output is checked bit for bit against the state. Import: ``load_pretrained`` of the tiercheck export into zeroed tensors (fresh process, caches dropped), against a
sequential cold read of the same files. Tables on stdout.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import harness as h
import torch

GiB, MiB = h.GiB, h.MiB
SCRIPT = Path(__file__).resolve()
METHODS = {
    "tiercheck": ("tiercheck_export", "tiercheck export"),
    "tiercheck-warm": ("tiercheck_export", "tiercheck export, source in page cache"),
    "dcp-consolidate": ("dcp_consolidate", "DCP consolidate_safetensors_files"),
    "dcp-consolidate-warm": ("dcp_consolidate", "DCP consolidate_safetensors_files, source in page cache"),
    "dcp-save": ("dcp_save_consolidate", "DCP HuggingFaceStorageWriter + consolidation"),
}


def llama_state(size_gib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 weights named as a Llama's: hidden 2048, MLP 5504, vocab 32000, as many layers as ``size_gib`` takes."""
    hidden, mlp, vocab = 2048, 5504, 32000
    g = torch.Generator().manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    layer = 4 * hidden * hidden + 3 * hidden * mlp
    layers = max(1, round((size_gib * GiB / 4 - 2 * vocab * hidden) / layer))
    for i in range(layers):
        p = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}.self_attn.{name}.weight"] = (hidden, hidden)
        shapes[f"{p}.mlp.gate_proj.weight"] = (mlp, hidden)
        shapes[f"{p}.mlp.up_proj.weight"] = (mlp, hidden)
        shapes[f"{p}.mlp.down_proj.weight"] = (hidden, mlp)
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return {k: torch.rand(s, generator=g) for k, s in shapes.items()}


def prepare(root: str, size_gib: float) -> dict[str, Any]:
    """Save the state as a tiercheck step and as DCP's sharded safetensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    import tiercheck

    h.init_one_rank()
    state = llama_state(size_gib)
    with tiercheck.Checkpointer({"model": state}, local=f"{root}/tiercheck") as ck:
        ck.save(1).wait()
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(f"{root}/dcp", save_distributed=True))
    h.fsync_tree(root)
    return {"bytes": sum(t.numel() * t.element_size() for t in state.values()), "tensors": len(state)}


def _timed(fn: Any, out: str) -> dict[str, Any]:
    rss0 = h.rss_bytes()
    h.reset_hwm()
    t0 = time.perf_counter()
    fn()
    t_write = time.perf_counter() - t0
    h.fsync_tree(out)  # a no-op's cost for tiercheck, which synced every file itself
    total = time.perf_counter() - t0
    return {"s": total, "sync_s": total - t_write, "peak_over_rss": h.hwm_bytes() - rss0, "peak": h.hwm_bytes()}


def tiercheck_export(root: str, out: str) -> dict[str, Any]:
    from tiercheck.integrations import hf

    return _timed(lambda: hf.export(f"{root}/tiercheck", out), out)


def dcp_consolidate(root: str, out: str) -> dict[str, Any]:
    from safetensors import safe_open
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    mapping: dict[str, int] = {}
    for f in sorted(Path(root, "dcp").glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            mapping.update(dict.fromkeys(handle.keys(), 1))  # one output file, as tiercheck writes at 5GB
    Path(out).mkdir()  # it writes into an existing directory
    return _timed(lambda: consolidate_safetensors_files(f"{root}/dcp", out, mapping), out)


def dcp_save_consolidate(root: str, out: str, size_gib: float) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    h.init_one_rank()
    state = llama_state(size_gib)
    mapping = dict.fromkeys(state, 1)
    writer = HuggingFaceStorageWriter(out, fqn_to_index_mapping=mapping, save_distributed=True, enable_consolidation=True)
    return _timed(lambda: dcp.save(state, storage_writer=writer), out)


def tiercheck_import(directory: str, size_gib: float) -> dict[str, Any]:
    """``load_pretrained`` of an exported directory into zeroed tensors of the state's shapes (its default:
    read straight into the live tensors, as a job's first load; before f491da8, into new memory first)."""
    from tiercheck.integrations import hf

    state = {k: torch.zeros_like(v) for k, v in llama_state(size_gib).items()}
    rss0 = h.rss_bytes()
    h.reset_hwm()
    t0 = time.perf_counter()
    hf.load_pretrained(directory, state)
    s = time.perf_counter() - t0
    ok = all(torch.equal(state[k], v) for k, v in llama_state(size_gib).items())
    return {"s": s, "peak_over_rss": h.hwm_bytes() - rss0, "identical": ok}


def read_while_writing(scratch: Path, nbytes: int, drop: bool) -> float:
    """Seconds until both a cold sequential read of the tiercheck step's files and an fsync'd write of
    ``nbytes`` running at once are done: what a copy from and to the same disk cannot beat."""
    import threading

    files = [f for f in sorted((scratch / "tiercheck").rglob("*")) if f.is_file()]
    h.drop_caches(drop, files)
    t0 = time.perf_counter()
    reader = threading.Thread(target=h.measure_cold_read, args=(files, False))
    reader.start()
    h.measure_disk_write(scratch, nbytes)
    reader.join()
    return time.perf_counter() - t0


def check(out: Path, size_gib: float) -> bool:
    """Whether the safetensors files in ``out`` hold exactly the state."""
    from safetensors.torch import load_file

    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    state = llama_state(size_gib)
    return got.keys() == state.keys() and all(torch.equal(got[k], v) for k, v in state.items())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    h.common_args(p, settle_s=5.0)
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    size, repeats = (0.25, 1) if args.quick else (args.size_gib, args.repeats)
    machine = h.machine_info(args.dir or ".")
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    with h.scratch_dir(args.dir, "hf-", keep=args.keep) as scratch:
        h.log(f"saving {size} GiB as a tiercheck step and as DCP sharded safetensors")
        prep = h.run_worker(SCRIPT, "prepare", {"root": str(scratch), "size_gib": size})
        if "error" in prep:
            print(prep.get("traceback", prep["error"]), file=sys.stderr)
            return 1
        disks, bounds, identical = [], [], {}
        reads: list[dict[str, Any]] = []
        loads: list[dict[str, Any]] = []
        for r in range(repeats):
            disks.append(h.measure_disk_write(scratch, prep["bytes"])["durable_s"])
            bounds.append(read_while_writing(scratch, prep["bytes"], not args.no_drop_caches))
            for m, (func, _label) in METHODS.items():
                out = scratch / f"out-{m}-{r}"
                kwargs: dict[str, Any] = {"root": str(scratch), "out": str(out)}
                if m == "dcp-save":  # from memory: nothing to read
                    kwargs["size_gib"] = size
                warm = m.endswith("-warm")
                dropped = h.prepare(not args.no_drop_caches and not warm, args.settle_max_s, [scratch])
                if warm:  # the source read once, so the method only writes
                    source = scratch / ("tiercheck" if m.startswith("tiercheck") else "dcp")
                    h.measure_cold_read([f for f in sorted(source.rglob("*")) if f.is_file()], drop=False)
                res = h.run_worker(SCRIPT, func, kwargs)
                res["dropped"] = dropped
                if "error" in res:
                    print(res.get("traceback", res["error"]), file=sys.stderr)
                    return 1
                h.log(f"round {r} {m}: {res['s']:.2f} s, peak +{h.fmt_bytes(res['peak_over_rss'])}")
                results[m].append(res)
                if r == 0:
                    identical[m] = check(out, size)
                if m == "tiercheck":  # read back: load_pretrained, and a plain cold read of the same files
                    reads.append(h.measure_cold_read(sorted(out.glob("*.safetensors")), not args.no_drop_caches))
                    h.prepare(not args.no_drop_caches, args.settle_max_s, [scratch])
                    loads.append(h.run_worker(SCRIPT, "tiercheck_import", {"directory": str(out), "size_gib": size}))
                    if "error" in loads[-1]:
                        print(loads[-1].get("traceback", loads[-1]["error"]), file=sys.stderr)
                        return 1
                    h.log(f"round {r} load_pretrained: {loads[-1]['s']:.2f} s, cold read {reads[-1]['s']:.2f} s")
                shutil.rmtree(out, ignore_errors=True)
    disk_s = h.median(disks)
    assert disk_s is not None
    rate = prep["bytes"] / disk_s
    bound_s = h.median(bounds)
    assert bound_s is not None
    rows = []
    for m, (_func, label) in METHODS.items():
        s = h.median([x["s"] for x in results[m]])
        assert s is not None
        rows.append([
            label, f"{s:.2f}", h.fmt(h.median([x["sync_s"] for x in results[m]])),
            f"{prep['bytes'] / s / GiB:.2f}", f"{prep['bytes'] / s / rate:.2f}",
            "" if m.endswith("-warm") or m == "dcp-save" else f"{bound_s / s:.2f}",
            h.fmt_bytes(h.median([x["peak_over_rss"] for x in results[m]]) or 0), "yes" if identical[m] else "NO",
        ])  # fmt: skip
    print(h.machine_line(machine))
    print(f"\nstate: {h.fmt_bytes(prep['bytes'])} fp32 in {prep['tensors']} tensors; fsync'd sequential write of "
          f"that size: {disk_s:.2f} s ({rate / GiB:.2f} GiB/s); the same write while a cold read of the same size runs "
          f"(read+write, the bound of a copy on one disk): {bound_s:.2f} s; medians of {repeats}, caches dropped: "
          f"{results['tiercheck'][0]['dropped'] or 'no'}\n")  # fmt: skip
    headers = ["method", "s (to durable)", "of it fsync s", "GiB/s", "x disk write", "x read+write", "peak memory",
               "bit-identical"]  # fmt: skip
    print(h.table(headers, rows))
    read_s, load_s = h.median([x["s"] for x in reads]), h.median([x["s"] for x in loads])
    assert read_s is not None and load_s is not None
    print(f"\nload_pretrained of the tiercheck export (plain tensors, local, caches dropped): {load_s:.2f} s "
          f"({prep['bytes'] / load_s / GiB:.2f} GiB/s, {read_s / load_s:.2f}x a sequential cold read of the same files: "
          f"{read_s:.2f} s), peak memory {h.fmt_bytes(h.median([x['peak_over_rss'] for x in loads]) or 0)}, "
          f"bit-identical: {'yes' if all(x['identical'] for x in loads) else 'NO'}")  # fmt: skip
    if args.json:
        h.write_json(args.json, {"machine": machine, "prepare": prep, "disk_s": disks, "read_write_s": bounds, "results": results,
                                 "cold_read": reads, "load_pretrained": loads})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
