"""Draw the performance page's plots from the committed benchmark JSON (bench/results/).

Run by the MkDocs hook (docs/hooks.py) at every build, so a plot always shows what the JSON holds;
by hand: ``python docs/plots.py OUT_DIR`` writes the PNGs there. Every number drawn is read from
the files in ``SOURCES``; nothing is typed in here.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "bench/results/gpu-nvidia-h200.json"
REMOTE = ROOT / "bench/results/remote-parts.json"
SOURCES = (GPU, REMOTE)  # tests/test_docs.py checks each is tracked by git

METHODS = ("tiercheck.lazy", "tiercheck.eager", "dcp.async_save", "torch_checkpointing")
COLORS = {"tiercheck.lazy": "#1f77b4", "tiercheck.eager": "#6baed6", "dcp.async_save": "#ff7f0e",
          "torch_checkpointing": "#2ca02c"}  # fmt: skip


def _median_s(runs: list[dict[str, Any]]) -> float:
    return statistics.median(r["s"] for r in runs)


def _bars(ax: Any, labels: list[str], values: list[float], colors: list[str], fmt: str = "{:.2f} s") -> None:
    bars = ax.barh(labels, values, color=colors)
    for bar, v in zip(bars, values, strict=True):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + fmt.format(v), va="center", fontsize=8)
    ax.invert_yaxis()
    if ax.get_xscale() == "linear":
        ax.set_xlim(0, max(values) * 1.18)
    ax.spines[["top", "right"]].set_visible(False)


def _legend(ax: Any) -> None:
    """The legend in a row of its own below the last bar, where it covers no bar's value."""
    bottom, top = ax.get_ylim()  # inverted: the last bar is at the bottom
    ax.set_ylim(bottom + 1, top)
    ax.legend(fontsize=8, loc="lower right")


def gpu_plots(out: Path, plt: Any) -> list[str]:
    d = json.loads(GPU.read_text())
    title = f"{d['device']}, {d['methods']['tiercheck.lazy']['state_bytes'] / 2**30:.2f} GiB of fp32 state"
    methods = [m for m in METHODS if m in d["methods"] and "summary" in d["methods"][m]]
    summary = {m: d["methods"][m]["summary"] for m in methods}
    colors = [COLORS[m] for m in methods]
    limits = d["limits"]
    step_s = statistics.median(limits["step_s"])
    names = []

    # 1. What one checkpoint adds to the training loop (log scale: 3 ms to 4 s).
    fig, ax = plt.subplots(figsize=(7, 2.6))
    added = [max(summary[m]["added_per_ckpt_s"], 1e-4) for m in methods]
    ax.set_xscale("log")
    _bars(ax, methods, added, colors, "{:.3f} s")
    ax.set_xlim(min(added) / 2, max(added) * 8)
    ax.axvline(step_s, color="grey", ls="--", lw=1, label=f"one training step ({step_s * 1000:.0f} ms)")
    _legend(ax)
    ax.set_xlabel("time added to the training loop per checkpoint, s (log)")
    ax.set_title(f"Stall per checkpoint: {title}", fontsize=10)
    fig.tight_layout()
    names.append(_save(fig, out / "gpu-stall.png", plt))

    # 2. From save() to durable, against the disk's own fsync'd write of the same bytes.
    fig, ax = plt.subplots(figsize=(7, 2.6))
    durable = [summary[m]["durable_s"] for m in methods]
    labels = [m + (" (no fsync)" if m == "torch_checkpointing" else "") for m in methods]
    _bars(ax, labels, durable, colors)
    write_s = limits["disk"]["write"]["durable_s"]
    ax.axvline(write_s, color="black", ls="--", lw=1, label=f"raw fsync'd write of the state ({write_s:.2f} s)")
    _legend(ax)
    ax.set_xlabel("save() call to durable on the local disk, s (median of the loop's saves)")
    ax.set_title(f"Time to durable: {title}", fontsize=10)
    fig.tight_layout()
    names.append(_save(fig, out / "gpu-durable.png", plt))

    # 3. Restores: in the process that saved, and in a fresh process; the cold read is the floor.
    fig, ax = plt.subplots(figsize=(7, 3.0))
    labels, values, cols = [], [], []
    for m in methods:
        labels.append(f"{m}, in process")
        values.append(summary[m]["restore_s"])
        cols.append(COLORS[m])
        fresh = d.get("fresh_restores", {}).get(m)
        if fresh and "restore_s" in fresh:
            labels.append(f"{m}, fresh process")
            values.append(fresh["restore_s"])
            cols.append(COLORS[m])
    _bars(ax, labels, values, cols)
    read_s = limits["disk"]["cold_read"]["s"]
    ax.axvline(read_s, color="black", ls="--", lw=1, label=f"cold read of the state's bytes ({read_s:.2f} s)")
    _legend(ax)
    ax.set_xlabel("restore from a dropped page cache, s")
    ax.set_title(f"Restore: {title}", fontsize=10)
    fig.tight_layout()
    names.append(_save(fig, out / "gpu-restore.png", plt))
    return names


def remote_plot(out: Path, plt: Any) -> list[str]:
    d = json.loads(REMOTE.read_text())
    rows = [  # (remote, label, runs) of what moved the same 512 MiB step, up and down
        ("s3", "up: tiercheck drain", ("uploads", "drain c=8")),
        ("s3", "up: s3torchconnector dcp.save", ("uploads", "s3tc_save")),
        ("s3", "up: raw awscrt PUT", ("uploads", "crt_put")),
        ("s3", "up: fs.put", ("uploads", "put")),
        ("s3", "down: tiercheck restore (empty local dir)", ("restores", "restore_remote")),
        ("s3", "down: s3torchconnector dcp.load", ("restores", "s3tc_load")),
        ("s3", "down: raw awscrt GET", ("restores", "crt_get")),
        ("s3", "down: fs.get", ("restores", "fs_get")),
        ("azure", "up: tiercheck drain", ("uploads", "drain c=8")),
        ("azure", "up: raw adlfs pipe_file", ("uploads", "az_put")),
        ("azure", "up: fs.put", ("uploads", "put")),
        ("azure", "down: tiercheck restore (empty local dir)", ("restores", "restore_remote")),
        ("azure", "down: raw adlfs cat_file", ("restores", "az_get")),
        ("azure", "down: fs.get", ("restores", "fs_get")),
    ]
    fig, axes = plt.subplots(2, 1, figsize=(7.5, 6.2))
    for ax, remote in zip(axes, ("s3", "azure"), strict=True):
        r = d["remotes"][remote]
        picked = [(label, r[kind][key]) for rem, label, (kind, key) in rows if rem == remote and key in r[kind]]
        labels = [label for label, _ in picked]
        values = [_median_s(runs) for _, runs in picked]
        colors = ["#1f77b4" if "tiercheck" in label else "#bbbbbb" for label in labels]
        _bars(ax, labels, values, colors)
        ax.set_title(r["name"], fontsize=10)
        ax.set_xlabel("seconds for the 512 MiB step (median)")
    fig.suptitle("Remote tier on loopback servers, 2 vCPUs (bench/results/remote-parts.json)", fontsize=10)
    fig.tight_layout()
    return [_save(fig, out / "remote.png", plt)]


def _save(fig: Any, path: Path, plt: Any) -> str:
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path.name


def draw(out: Path) -> list[str]:
    """Write every plot into ``out``; returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    return gpu_plots(out, plt) + remote_plot(out, plt)


if __name__ == "__main__":
    print("\n".join(draw(Path(sys.argv[1] if len(sys.argv) > 1 else "site/img"))))
