"""``tiercheck export``: a committed step out of tiercheck's format, as a Hugging Face safetensors
directory that inference servers and ``from_pretrained`` load (``tiercheck.integrations.hf``), or as a DCP
checkpoint that ``dcp.load`` reads (``tiercheck.integrations.dcp.export``)."""


from __future__ import annotations

import resource
from typing import Any

import click

from tiercheck.cli.common import (
    THREADS,
    Context,
    errors_as_one_line,
    human,
    out,
    pass_context,
    pick_step,
    progress,
    remote_options,
    step_value,
    typed_options,
)


def _shard_size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    """``--max-shard-size`` checked as the command line is read: a usage error (exit status 2) naming it."""
    from tiercheck.integrations.hf.files import parse_size

    try:
        return parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e), ctx, param) from None


@click.command("export")
@click.argument("source", metavar="SRC")
@click.option("--to", "target", required=True, metavar="DIR", help="A new (or empty) directory to write.")
@click.option("--step", default="latest", show_default=True, callback=step_value, help="Step number, or 'latest'.")
@click.option(
    "--format", "fmt", type=click.Choice(["safetensors", "dcp"]), default="safetensors", show_default=True,
    help="What to write: Hugging Face safetensors shards and their index; or a DCP checkpoint (dcp.load's).",
)  # fmt: skip
@click.option(
    "--only", multiple=True, metavar="ENTRY",
    help="A top-level entry of the saved state to export; repeatable. [default: model; every entry for dcp]",
)  # fmt: skip
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), help="Convert floating tensors.")
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    metavar="SIZE",
    callback=_shard_size,
    help="e.g. 5GB, 500MB, 2GiB.",
)
@click.option("--drop-prefix", metavar="PREFIX", help="Strip this from the start of every name (e.g. '_orig_mod.').")
@click.option(
    "--names", "names_file", metavar="MAP.json", type=click.Path(exists=True, dir_okay=False),
    help="JSON object: training name -> Hugging Face name (null leaves a tensor out).",
)  # fmt: skip
@click.option(
    "--include", multiple=True, metavar="FILE", type=click.Path(exists=True, dir_okay=False),
    help="Copy this file in beside the shards (config.json, tokenizer files); repeatable.",
)  # fmt: skip
@click.option("--threads", type=THREADS, default=4, show_default=True, help="Concurrent chunk reads.")
@remote_options
@pass_context
def export_command(
    ctx: Context,
    source: str,
    target: str,
    step: str,
    fmt: str,
    only: tuple[str, ...],
    dtype: str | None,
    max_shard_size: int,
    drop_prefix: str | None,
    names_file: str | None,
    include: tuple[str, ...],
    threads: int,
) -> None:
    """Write a committed step as a Hugging Face safetensors directory, for inference.

    SRC must hold every rank's chunks: a remote URL, a single node's directory, or one filled by
    `tiercheck restore`. Writes DIR/model-0000k-of-0000n.safetensors and
    DIR/model.safetensors.index.json (or DIR/model.safetensors), every chunk verified on the way;
    DIR appears only once whole. Names are the state's keys below the exported entry: a model
    saved as {"model": model} gives its own state_dict names. from_pretrained also needs the
    model's config.json: pass it with --include.

    With --format dcp, writes DIR as a DCP checkpoint (its .distcp files and .metadata) that
    dcp.load and torchtitan's own manager read without tiercheck: the whole state (or the --only
    entries), DCP's flattened names, tensors whole.
    """  # fmt: skip
    with errors_as_one_line():
        n = pick_step(ctx.tier(source), step)
        if fmt == "dcp":
            _export_dcp(ctx, source, target, n, only=only, threads=threads,
                        safetensors_only={"--dtype": dtype, "--drop-prefix": drop_prefix, "--names": names_file,
                                          "--include": include})  # fmt: skip
            return
        from tiercheck.integrations import hf  # torch: not imported for the other commands
        from tiercheck.integrations.hf.names import read_name_map

        names = read_name_map(names_file) if names_file else None
        options: dict[str, Any] | None = typed_options(ctx.options) or None
        with progress(ctx, f"step {n} -> {target}", 1) as report:
            result = hf.export(
                source, target, step=n, only=only or ("model",), dtype=dtype, max_shard_size=max_shard_size,
                drop_prefix=drop_prefix, names=names, include=include, storage_options=options,
                io_threads=threads, progress=report,
            )  # fmt: skip
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        rate = result.total_size / max(result.seconds, 1e-9)
        out.print(
            f"exported step {n}: {result.tensors} tensors, {human(result.total_size)} in {len(result.files)} "
            f"file(s) to {result.directory} in {result.seconds:.1f} s ({human(rate)}/s); buffers "
            f"{human(result.buffer_bytes)}, peak RSS {human(peak)}"
        )



def _export_dcp(
    ctx: Context, source: str, target: str, n: int, *, only: tuple[str, ...], threads: int,
    safetensors_only: dict[str, Any],
) -> None:  # fmt: skip
    given = [name for name, value in safetensors_only.items() if value]
    if given:
        raise click.UsageError(f"{', '.join(given)}: safetensors' options, not --format dcp's")
    from tiercheck.integrations.dcp.export import export_dcp  # torch: not imported for the other commands

    result = export_dcp(source, target, step=n, only=only, storage_options=typed_options(ctx.options) or None,
                        io_threads=threads)  # fmt: skip
    out.print(
        f"exported step {n} as a DCP checkpoint: {result.tensors} tensors, {human(result.nbytes)} to "
        f"{result.directory} in {result.seconds:.1f} s"
    )
