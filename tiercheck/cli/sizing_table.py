"""``tiercheck plan``: its options, and the table it prints. The arithmetic is ``cli.sizing``,
imported when the command runs."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import click
from rich.table import Table

from tiercheck.cli.common import (
    AT_LEAST_ONE,
    Context,
    ParameterCount,
    err,
    errors_as_one_line,
    human,
    non_negative_number,
    out,
    pass_context,
    positive_number,
    remote_options,
    typed_options,
)
from tiercheck.humanize import plural
from tiercheck.tiers.remote import redact

_PRECISION = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


@click.command("plan")
@click.option(
    "--params",
    type=ParameterCount(),
    default=None,
    help="Total parameters (e.g. 7B, 70e9, 1.5T); or give the layer sizes.",
)
@click.option("--layers", type=AT_LEAST_ONE, default=None)
@click.option("--hidden", type=AT_LEAST_ONE, default=None)
@click.option("--vocab", type=AT_LEAST_ONE, default=None)
@click.option("--ffn", type=AT_LEAST_ONE, default=None, help="MLP width (default 4 x hidden).")
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
@click.option("--tp", type=AT_LEAST_ONE, default=1, show_default=True)
@click.option("--pp", type=AT_LEAST_ONE, default=1, show_default=True)
@click.option("--dp", type=AT_LEAST_ONE, default=1, show_default=True)
@click.option("--gpus-per-node", type=AT_LEAST_ONE, default=8, show_default=True)
@click.option(
    "--node-mtbf-hours",
    type=float,
    default=5000.0,
    show_default=True,
    callback=positive_number,
    help="Mean time between failures of one node; the job's is this divided by the node count.",
)
@click.option(
    "--crash-mtbf-hours",
    type=float,
    default=None,
    callback=positive_number,
    help="Mean time between process crashes on one node that stays up (an exception, an OOM, a NCCL timeout); "
    "the job's is this divided by the node count. With it (or --job-mtbf-hours): the intervals per tier, the "
    "memory tier first.",
)
@click.option(
    "--job-mtbf-hours",
    type=float,
    default=None,
    callback=positive_number,
    help="Mean time between losses of every node's memory and disks at once (the allocation lost): recovered "
    "from the shared tier only (default: never).",
)
@click.option(
    "--memory-gbps",
    metavar="WRITE_GBPS[:READ_GBPS]",
    default=None,
    help="The memory tier's copy per GPU, in GB/s (default: the host copy's 25, stated).",
)
@click.option(
    "--slots", type=click.IntRange(min=2), default=2, show_default=True, help="Snapshots the memory tier keeps a rank."
)
@click.option(
    "--replicas",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Other nodes holding a copy of each node's memory and disk checkpoints: a node loss is recovered from them.",
)
@click.option(
    "--parity",
    metavar="DATA,PARITY",
    default=None,
    help="Reed-Solomon parity over groups of DATA + PARITY nodes in place of whole copies (ParityOptions): RAM and "
    "network per node per step against --replicas copies (or PARITY copies), and the node losses each survives.",
)
@click.option(
    "--tmpfs-gb",
    type=float,
    default=None,
    callback=positive_number,
    help="The memory tier's tmpfs size per node, in GB (default: this machine's /dev/shm, where there is one).",
)
@click.option(
    "--step-s",
    type=float,
    default=None,
    callback=positive_number,
    help="Seconds per training step: intervals in whole steps, and the options that give them.",
)
@click.option(
    "--restart-s",
    type=float,
    default=None,
    callback=non_negative_number,
    help="Time to restart the job (default: the tier's restore time).",
)
@click.option(
    "--tier",
    "tiers",
    multiple=True,
    metavar="NAME:WRITE_GBPS:READ_GBPS:node|shared[:JOB_GBPS]",
    help="A tier's bandwidth in GB/s per node, the node's own or shared by the job (then at most JOB_GBPS for "
    "the whole job, where given); repeatable (default: typical figures).",
)
@click.option(
    "--measure",
    "measured",
    multiple=True,
    metavar="DIR_OR_URL",
    help="Measure a tier with a short real write and read (256 MiB); repeatable.",
)
@click.option(
    "--link-gbps",
    type=float,
    default=None,
    callback=positive_number,
    help="A node's network link in Gb/s (bits: 400 = 50 GB/s): how long replacing a lost node takes, its restore "
    "from its peers' memory (measured figures of bench/results/replace_node.json where found, else stated).",
)
@click.option(
    "--replace-figures",
    metavar="PATH|stated",
    default=None,
    help="With --link-gbps: bench/replace_node.py's JSON to take the restore's figures from, or 'stated'.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@remote_options
@pass_context
def plan_command(ctx: Context, **kw: Any) -> None:
    """Size a model's checkpoints: bytes in total, per rank and per node, save and restore time on
    each tier, and the checkpoint interval that loses the least work (Young / Daly). With failure rates by
    kind (--crash-mtbf-hours, --job-mtbf-hours, and --node-mtbf-hours), the interval per tier with the memory
    tier first (the multi-level model of SCR), and the memory that tier needs on a node.

    Example: tiercheck plan --layers 96 --hidden 12288 --vocab 50257 --tp 8 --pp 16 --dp 8
    """  # fmt: skip
    from tiercheck.cli import sizing

    missing = [name for name in ("layers", "hidden", "vocab") if kw[name] is None]
    if kw["params"] is None and missing:  # a usage error (exit status 2), as a missing required option is
        raise click.UsageError(
            f"give --params, or --layers, --hidden and --vocab (missing: {', '.join('--' + m for m in missing)})"
        )
    with errors_as_one_line():
        spec = sizing.ModelSpec(
            params=kw["params"],
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
        several = kw["crash_mtbf_hours"] is not None or kw["job_mtbf_hours"] is not None
        if several:
            table.update(_multilevel(spec, tiers or sizing.DEFAULT_TIERS, kw))
        if kw["link_gbps"] is not None:
            table["replace"] = _replace(spec, kw)
        if kw["parity"] is not None or kw["replicas"] > 0:
            table["protection"] = _protection(spec, kw)
        if kw["as_json"]:
            click.echo(json.dumps(table, indent=2))
            return
        _print_plan(table, defaults=not tiers)
        if several:
            _print_multilevel(table)
        if "replace" in table:
            _print_replace(table["replace"])
        if "protection" in table:
            _print_protection(table["protection"])


def _protection(spec: Any, kw: dict[str, Any]) -> dict[str, Any]:
    """What copies and parity cost a node per step, and the losses each survives (``cli.protection``)."""
    from tiercheck.cli import protection, sizing

    z = sizing.size(spec)
    parity = None if kw["parity"] is None else protection.parse_parity(kw["parity"])
    snapshot = z.per_rank_bytes * min(spec.gpus_per_node, z.ranks)
    return protection.protection(snapshot_bytes=snapshot, slots=kw["slots"], nodes=z.nodes, replicas=kw["replicas"],
                                 parity=parity, link_gbps=kw["link_gbps"])  # fmt: skip


def _print_protection(p: dict[str, Any]) -> None:
    snap = human(p["snapshot_bytes"])
    out.print(f"peers' protection of the memory tier, per node ({p['slots']} slots x {snap} snapshot):", markup=False)
    columns: dict[str, list[str]] = {
        "scheme": [r["scheme"] for r in p["rows"]],
        "RAM": [f"{human(r['ram_bytes'])} ({p['slots']} + {r['extra_snapshots']:.2f} x)" for r in p["rows"]],
        "RAM peak": [human(r["peak_ram_bytes"]) for r in p["rows"]],
        "sent/step": [human(r["sent_bytes"]) for r in p["rows"]],
        "received/step": [human(r["received_bytes"]) for r in p["rows"]],
        "survives": [r["survives"] for r in p["rows"]],
    }
    if p["link_gbps"] is not None:
        columns[f"send at {p['link_gbps']:g} Gb/s"] = [_dur(r["send_s"]) for r in p["rows"]]
    table = Table(box=None, pad_edge=False)
    for name in columns:
        table.add_column(name, justify="left" if name in ("scheme", "survives") else "right")
    for cells in zip(*columns.values(), strict=True):
        table.add_row(*cells)
    out.print(table)


def _replace(spec: Any, kw: dict[str, Any]) -> dict[str, Any]:
    """A replaced node's restart from its peers' memory over a link of ``--link-gbps`` (``cli.replacing``)."""
    from pathlib import Path

    from tiercheck.cli import replacing, sizing

    z = sizing.size(spec)
    where = kw["replace_figures"]
    figures = (replacing.default_figures() if where is None else replacing.STATED if where == "stated"
               else replacing.load_figures(Path(where)))  # fmt: skip
    nbytes = replacing.bytes_in(weights=z.weights_bytes, optimizer=z.optimizer_bytes, tp=spec.tp, pp=spec.pp,
                                dp=spec.dp, ranks_on_node=min(spec.gpus_per_node, z.ranks))  # fmt: skip
    return replacing.replace_node(nbytes=nbytes, link_gbps=kw["link_gbps"], figures=figures)


def _print_replace(r: dict[str, Any]) -> None:
    f = r["figures"]
    said = "stated" if f["source"] == "stated" else f"measured: {f['source']}"
    out.print(
        f"replacing a node (its memory lost, restored from its peers' memory): {_dur(r['replace_s'])} = "
        f"{_dur(r['transfer_s'])} transfer ({human(r['bytes_in'])} in over {r['link_gbps']:g} Gb/s x "
        f"{f['transfer_ratio']:.2f}) + {_dur(r['fixed_s'])} agree, plan, verify, place ({said})",
        markup=False,
    )


def _multilevel(spec: Any, tiers: list[Any], kw: dict[str, Any]) -> dict[str, Any]:
    """The multi-level part of the plan: failure rates for the job, the memory tier's figures, the tmpfs."""
    from tiercheck.cli import multilevel, sizing

    sizes = sizing.size(spec)
    per_job = 3600.0 / sizes.nodes  # a rate per node in hours -> the job's in seconds

    def rate(hours: float | None, scale: float) -> float:
        return 0.0 if hours is None else 1 / (hours * scale)

    rates = {"crash": rate(kw["crash_mtbf_hours"], per_job), "node": rate(kw["node_mtbf_hours"], per_job),
             "job": rate(kw["job_mtbf_hours"], 3600.0)}  # fmt: skip
    memory = sizing.HOST_MEMORY_TIER
    if kw["memory_gbps"] is not None:
        memory = _parse_memory(kw["memory_gbps"])
    tmpfs = None if kw["tmpfs_gb"] is None else round(kw["tmpfs_gb"] * 1e9)
    source = "given"
    if tmpfs is None and os.path.isdir("/dev/shm"):
        st = os.statvfs("/dev/shm")
        tmpfs, source = st.f_blocks * st.f_frsize, "this machine's /dev/shm"
    table = multilevel.multilevel_table(
        sizes, tiers, memory, rates_per_s=rates, ranks_per_node=min(spec.gpus_per_node, sizes.ranks),
        replicas=kw["replicas"], slots=kw["slots"], tmpfs_bytes=tmpfs, step_s=kw["step_s"],
    )  # fmt: skip
    table["memory"]["tmpfs_source"] = None if tmpfs is None else source
    return table


def _parse_memory(text: str) -> Any:
    from tiercheck.cli import sizing

    try:
        figures = [float(x) for x in text.split(":")]
        if not 1 <= len(figures) <= 2 or not all(math.isfinite(x) and x > 0 for x in figures):
            raise ValueError
    except ValueError:
        raise click.BadParameter(
            f"expected WRITE_GBPS[:READ_GBPS] above 0, got {text!r}", param_hint="'--memory-gbps'"
        ) from None
    write, read = figures[0] * 1e9, figures[-1] * 1e9
    return sizing.TierProfile("memory", write, read, shared=False)


def _parse_tier(text: str) -> Any:
    from tiercheck.cli import sizing

    try:
        name, w, r, kind, *ceiling = text.split(":")
        figures = [float(x) for x in (w, r, *ceiling)]
        if kind not in ("node", "shared") or len(ceiling) > (kind == "shared"):
            raise ValueError
        if not all(math.isfinite(x) and x > 0 for x in figures):
            raise ValueError
    except ValueError:
        raise click.BadParameter(
            f"expected NAME:WRITE_GBPS:READ_GBPS:node|shared[:JOB_GBPS] with bandwidths above 0 (JOB_GBPS: a shared "
            f"tier's ceiling for the whole job), got {text!r}",
            param_hint="'--tier'",
        ) from None
    job = figures[2] * 1e9 if ceiling else None
    return sizing.TierProfile(name, figures[0] * 1e9, figures[1] * 1e9, shared=kind == "shared", job_bytes_per_s=job)


def _ceiling(job_bytes_per_s: float | None) -> str:
    """A shared tier's ceiling for the job, or "-" (a node's own tier, or none known)."""
    return "-" if job_bytes_per_s is None else _cells([job_bytes_per_s / 1e9])[0]


def _dur(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


_UNITS = (("s", 1.0), ("min", 60.0), ("h", 3600.0))


def _column(values: list[float], units: tuple[tuple[str, float], ...] = _UNITS) -> tuple[str, list[str]]:
    """A column of durations in one unit, the one ``_dur`` picks for its smallest (no "0.16 min"
    above "4.07 min"): "49.0 s" above "3.2 min" read as the smaller. Returns the unit and the cells."""
    low = min(values, default=0.0)
    unit, scale = units[0] if low < 120 else units[1] if low < 7200 else units[2]
    return unit, _cells([v / scale for v in values])


def _cells(values: list[float]) -> list[str]:
    """Numbers to three figures or so, without an exponent: 0.0123, 4.56, 78.9, 1234."""
    return [f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}" if v >= 0.1 else f"{v:.3g}"
            for v in values]  # fmt: skip


def _count(n: int) -> str:
    """A parameter count in words: "B" would read as bytes, and 1e6 parameters as "0.00 B"."""
    for size, word in ((1e12, "trillion"), (1e9, "billion"), (1e6, "million")):
        if n >= size:
            return f"{n / size:.2f} {word}"
    return f"{n:,}"


def _print_plan(t: dict[str, Any], *, defaults: bool) -> None:
    m, z = t["model"], t["sizes"]
    out.print(
        f"model: {_count(m['n_params'])} parameters, {m['weight_bytes']} B/param weights, optimizer {m['optimizer']}; "
        f"TP={m['tp']} PP={m['pp']} DP={m['dp']} on {plural(z['ranks'], 'GPU')}, {plural(z['nodes'], 'node')}"
    )
    dec = {k: human(z[k]) for k in ("total_bytes", "weights_bytes", "optimizer_bytes",
                                                    "per_rank_bytes", "per_node_bytes")}  # fmt: skip
    out.print(
        f"checkpoint: {dec['total_bytes']} in all (weights {dec['weights_bytes']}, optimizer "
        f"{dec['optimizer_bytes']}); written per rank {dec['per_rank_bytes']}, per node {dec['per_node_bytes']}"
    )
    out.print(f"job MTBF: {_dur(t['job_mtbf_s'])} ({t['node_mtbf_hours']:.0f} h per node)")
    rows = t["tiers"]
    asyncs = [r.get("async") or {} for r in rows]
    save_unit, saves = _column([r["save_s"] for r in rows])
    restore_unit, restores = _column([r["restore_s"] for r in rows])
    daly_unit, dalys = _column([r["daly_interval_s"] for r in rows])
    async_unit, async_intervals = _column([a["interval_s"] for a in asyncs if a])
    async_cells = iter(async_intervals)
    columns = {
        "tier": [r["tier"]["name"] for r in rows],
        "kind": ["shared" if r["tier"]["shared"] else "node's own" for r in rows],
        "figures": [r["tier"]["source"] for r in rows],
        "write/node (GB/s)": _cells([r["tier"]["write_bytes_per_s"] / 1e9 for r in rows]),
        "read/node (GB/s)": _cells([r["tier"]["read_bytes_per_s"] / 1e9 for r in rows]),
        "job max (GB/s)": [_ceiling(r["tier"]["job_bytes_per_s"]) for r in rows],
        f"save ({save_unit})": saves,
        f"restore ({restore_unit})": restores,
        f"Daly interval ({daly_unit})": dalys,
        "lost work (%)": [f"{100 * r['waste_fraction_daly']:.1f}" for r in rows],
        f"async interval ({async_unit})": [next(async_cells) if a else "-" for a in asyncs],
        "async lost (%)": [f"{100 * a['waste_fraction']:.1f}" if a else "-" for a in asyncs],
    }
    table = Table(box=None, pad_edge=False)
    for name in columns:
        table.add_column(name, justify="left" if name in ("tier", "kind", "figures") else "right")
    for cells in zip(*columns.values(), strict=True):
        table.add_row(*cells)
    out.print(table)
    staging = t["staging"] or {}
    out.print(
        "Daly interval: the optimum for a blocking checkpoint of that tier; async: tiercheck blocks only for each "
        f"GPU's copy of its share to host memory, at {staging.get('write_bytes_per_s', 0) / 1e9:.0f} GB/s per GPU "
        f"({staging.get('source', '-')}), and writes in the background."
    )
    if defaults:
        out.print("bandwidths are typical figures (stated), not measurements: give --tier or --measure for yours.")


def _print_multilevel(t: dict[str, Any]) -> None:
    """The intervals per tier (the multi-level model in ``cli.multilevel``) and the memory the tier needs."""
    ml, need = t["multilevel"], t["memory"]
    rates = ml["rates_per_s"]
    said = [f"{what} every {_dur(1 / rates[kind])}" for kind, what in
            (("crash", "a crash"), ("node", "a node lost"), ("job", "the job lost")) if rates[kind] > 0]  # fmt: skip
    out.print(f"several tiers, for the job: {', '.join(said)}; {plural(ml['replicas'], 'replica')} on other nodes")
    rows = ml["levels"]
    written = [r for r in rows if r["interval_s"] is not None]
    unit, cells = _column([r["interval_s"] for r in written])
    interval_cells = iter(cells)
    save_unit, saves = _column([r["save_s"] for r in rows])
    restore_unit, restores = _column([r["restore_s"] for r in rows])
    recovers = {name: [k for k, v in ml["recovers"].items() if v == name] for name in (r["name"] for r in rows)}
    columns = {
        "level": [r["name"] for r in rows],
        "survives": [", ".join(r["survives"]) for r in rows],
        f"save ({save_unit})": saves,
        f"restore ({restore_unit})": restores,
        "recovers": [", ".join(recovers[r["name"]]) or "-" for r in rows],
        f"interval ({unit})": [next(interval_cells) if r["interval_s"] is not None else "never" for r in rows],
        "every": [_every(rows, i) for i in range(len(rows))],
    }
    if ml["step_s"] is not None:
        columns["steps"] = ["-" if r["steps"] is None else str(r["steps"]) for r in rows]
    table = Table(box=None, pad_edge=False)
    for name in columns:
        table.add_column(name, justify="left" if name in ("level", "survives", "recovers", "every") else "right")
    for row in zip(*columns.values(), strict=True):
        table.add_row(*row)
    out.print(table)
    without = ml["without_memory"]
    out.print(
        f"goodput {100 * ml['goodput']:.1f} % (lost {100 * ml['waste_fraction']:.1f} %)"
        + ("" if without is None else f"; without the memory tier {100 * without['goodput']:.1f} %")
        + " (first order: Young 1974, Daly 2006; SCR's levels, Moody et al. SC10; saves taken as blocking)"
    )
    if ml["step_s"] is not None and len(rows) == 3 and rows[0]["steps"]:
        persist, drain = rows[1]["steps"], rows[2]["steps"]
        if need["fits"] is False:  # the last line says why: no option is advised that cannot start
            out.print("options: none advised: the memory tier does not fit its tmpfs (below)")
        else:
            out.print(
                f"options: save every {rows[0]['steps']} steps, MemoryOptions(persist_every={persist})"
                + ("" if drain is None else f", DrainOptions(every={drain})")
            )
    fits = "fits" if need["fits"] else "does not fit"
    where = (
        "a tmpfs of unknown size"
        if need["tmpfs_bytes"] is None
        else f"{human(need['tmpfs_bytes'])} ({need['tmpfs_source']}): {fits}"
    )
    peers = f" + {plural(need['replicas'], 'replica')} {human(need['peer_bytes'])}" if need["replicas"] else ""
    out.print(
        f"memory tier per node: {need['slots']} slots x {human(need['own_bytes'] / need['slots'])} "
        f"({human(need['per_rank_bytes'])} per rank){peers} = {human(need['node_bytes'])} against {where}"
    )


def _every(rows: list[dict[str, Any]], i: int) -> str:
    """How often a level is written, against the level below it: "63 x memory"."""
    multiple = rows[i]["multiple"]
    return "-" if i == 0 or multiple is None else f"{multiple} x {rows[i - 1]['name']}"
