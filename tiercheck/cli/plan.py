"""``tiercheck plan``: its options, and the table it prints. The arithmetic is ``cli.sizing``,
imported when the command runs."""


from __future__ import annotations

import json
from typing import Any

import click
from rich.table import Table

from tiercheck.cli.common import (
    Context,
    err,
    errors_as_one_line,
    human,
    out,
    parameter_count,
    pass_context,
    positive_number,
    remote_options,
    typed_options,
)
from tiercheck.tiers.remote import redact

_PRECISION = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


@click.command("plan")
@click.option(
    "--params",
    type=float,
    default=None,
    callback=parameter_count,
    help="Total parameters (e.g. 7e9); or give the layer sizes.",
)
@click.option("--layers", type=int, default=None)
@click.option("--hidden", type=int, default=None)
@click.option("--vocab", type=int, default=None)
@click.option("--ffn", type=int, default=None, help="MLP width (default 4 x hidden).")
@click.option(
    "--precision", type=click.Choice(sorted(_PRECISION)), default="bf16", show_default=True, help="Weight precision."
)
@click.option(
    "--optimizer",
    type=click.Choice(["adam", "sgd", "none"]),
    default="adam",
    show_default=True,
    help="adam: fp32 master weights + 2 moments (12 B/param more); sgd: 8; none: 0.",
)
@click.option("--tp", type=int, default=1, show_default=True)
@click.option("--pp", type=int, default=1, show_default=True)
@click.option("--dp", type=int, default=1, show_default=True)
@click.option("--gpus-per-node", type=int, default=8, show_default=True)
@click.option(
    "--node-mtbf-hours",
    type=float,
    default=5000.0,
    show_default=True,
    callback=positive_number,
    help="Mean time between failures of one node; the job's is this divided by the node count.",
)
@click.option(
    "--restart-s", type=float, default=None, help="Time to restart the job (default: the tier's restore time)."
)
@click.option(
    "--tier",
    "tiers",
    multiple=True,
    metavar="NAME:WRITE_GBPS:READ_GBPS:node|shared",
    help="A tier's bandwidth in GB/s, per node or shared by the job; repeatable (default: typical figures).",
)
@click.option(
    "--measure",
    "measured",
    multiple=True,
    metavar="DIR_OR_URL",
    help="Measure a tier with a short real write and read (256 MiB); repeatable.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@remote_options
@pass_context
def plan_command(ctx: Context, **kw: Any) -> None:
    """Size a model's checkpoints: bytes in total, per rank and per node, save and restore time on
    each tier, and the checkpoint interval that loses the least work (Young / Daly).

    Example: tiercheck plan --layers 96 --hidden 12288 --vocab 50257 --tp 8 --pp 16 --dp 8
    """  # fmt: skip
    from tiercheck.cli import sizing

    with errors_as_one_line():
        params = kw["params"]
        spec = sizing.ModelSpec(
            params=int(params) if params is not None else None,
            layers=kw["layers"], hidden=kw["hidden"], vocab=kw["vocab"], ffn=kw["ffn"],
            weight_bytes=_PRECISION[kw["precision"]], optimizer=kw["optimizer"],
            tp=kw["tp"], pp=kw["pp"], dp=kw["dp"], gpus_per_node=kw["gpus_per_node"],
        )  # fmt: skip
        tiers = [_parse_tier(t) for t in kw["tiers"]]
        for loc in kw["measured"]:
            if not ctx.quiet:
                err.print(f"measuring {redact(loc)} ...", markup=False)
            tiers.append(sizing.measure(loc, storage_options=typed_options(ctx.options) or None))
        table = sizing.plan_table(
            spec,
            tiers or sizing.DEFAULT_TIERS,
            node_mtbf_hours=kw["node_mtbf_hours"],
            restart_s=kw["restart_s"],
            staging=sizing.HOST_MEMORY_TIER,
        )
        if kw["as_json"]:
            click.echo(json.dumps(table, indent=2))
            return
        _print_plan(table, defaults=not tiers)


def _parse_tier(text: str) -> Any:
    from tiercheck.cli import sizing

    try:
        name, w, r, kind = text.split(":")
        if kind not in ("node", "shared"):
            raise ValueError
        return sizing.Tier(name, float(w) * 1e9, float(r) * 1e9, shared=kind == "shared")
    except ValueError:
        raise click.BadParameter(f"expected NAME:WRITE_GBPS:READ_GBPS:node|shared, got {text!r}") from None


def _dur(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _count(n: int) -> str:
    """A parameter count in words: "B" would read as bytes, and 1e6 parameters as "0.00 B"."""
    for size, word in ((1e12, "trillion"), (1e9, "billion"), (1e6, "million")):
        if n >= size:
            return f"{n / size:.2f} {word}"
    return f"{n:,}"


def _print_plan(t: dict[str, Any], *, defaults: bool) -> None:
    m, z = t["model"], t["sizes"]
    out.print(
        f"model: {_count(m['n_params'])} parameters, {m['weight_bytes']} B/param weights, "
        f"optimizer {m['optimizer']}; TP={m['tp']} PP={m['pp']} DP={m['dp']} on {z['ranks']} GPUs, {z['nodes']} node(s)"
    )
    dec = {k: human(z[k]) for k in ("total_bytes", "weights_bytes", "optimizer_bytes",
                                                    "per_rank_bytes", "per_node_bytes")}  # fmt: skip
    out.print(
        f"checkpoint: {dec['total_bytes']} in all (weights {dec['weights_bytes']}, optimizer "
        f"{dec['optimizer_bytes']}); written per rank {dec['per_rank_bytes']}, per node {dec['per_node_bytes']}"
    )
    out.print(f"job MTBF: {_dur(t['job_mtbf_s'])} ({t['node_mtbf_hours']:.0f} h per node)")
    table = Table(box=None, pad_edge=False)
    for col in (
        "tier",
        "write",
        "read",
        "save",
        "restore",
        "interval (Daly)",
        "lost work",
        "async interval",
        "async lost",
    ):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for row in t["tiers"]:
        tier = row["tier"]
        per = "shared" if tier["shared"] else "/node"
        a = row.get("async") or {}
        table.add_row(
            tier["name"], f"{tier['write_bytes_per_s'] / 1e9:.2f} GB/s {per}",
            f"{tier['read_bytes_per_s'] / 1e9:.2f} GB/s",
            _dur(row["save_s"]), _dur(row["restore_s"]), _dur(row["daly_interval_s"]),
            f"{100 * row['waste_fraction_daly']:.1f} %",
            _dur(a["interval_s"]) if a else "-", f"{100 * a['waste_fraction']:.1f} %" if a else "-",
        )  # fmt: skip
    out.print(table)
    out.print(
        "interval: Daly's optimum for a blocking checkpoint of that tier; async: tiercheck blocks only for the "
        "copy to host memory and writes in the background."
    )
    if defaults:
        out.print("bandwidths are typical figures, not measurements: give --tier or --measure for yours.")
