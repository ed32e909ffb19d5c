"""``tiercheck import``: another framework's checkpoint (a DCP directory, torchtitan's ``step-N/``, a
``torch.save`` file, Lightning's ``.ckpt``, a DeepSpeed tag) as a step of a new lineage
(``tiercheck.integrations.importer``)."""


from __future__ import annotations

import shutil
import tempfile

import click

from tiercheck.cli.common import Context, errors_as_one_line, human, out, pass_context, remote_options, typed_options
from tiercheck.tiers.urls import tier_url


@click.command("import")
@click.argument("source", metavar="SRC", type=click.Path(exists=True))
@click.option(
    "--to", "target", required=True, metavar="DIR_OR_URL",
    help="The run's local directory; or a remote URL, where the step is drained (through a temporary directory).",
)  # fmt: skip
@click.option(
    "--step", type=click.IntRange(min=0), default=None,
    help="The step to write. [default: a DeepSpeed checkpoint's global_steps; else the last number in SRC's name, "
    "else 0]",
)  # fmt: skip
@click.option(
    "--tag", default=None, metavar="TAG",
    help="A DeepSpeed checkpoint's tag, SRC being its save_dir. [default: the tag SRC/latest names]",
)  # fmt: skip
@click.option(
    "--allow-pickle", is_flag=True,
    help="Unpickle beyond torch.load(weights_only=True) and DCP's metadata classes (only checkpoints you trust).",
)  # fmt: skip
@remote_options
@pass_context
def import_command(ctx: Context, source: str, target: str, step: int | None, tag: str | None,
                   allow_pickle: bool) -> None:
    """Write another framework's checkpoint as a tiercheck step, to continue the run under tiercheck.

    SRC is a DCP checkpoint directory (dcp.save's, torchtitan's step-N/: read with DCP's own
    reader, every tensor whole however many ranks saved it), a torch.save file (a .pt, Lightning's
    .ckpt: read with torch.load(weights_only=True)) or a DeepSpeed checkpoint (its save_dir, or a
    tag's folder: its files read with torch.load(weights_only=True) and DeepSpeed's allow-listed
    types, the step numbered by its global_steps). The step is written in one process, every
    chunk checksummed and committed, as the first step of a new lineage: Checkpointer.restore()
    (or dcp.load with a TiercheckReader, for a DCP source; engine.load_checkpoint with the DeepSpeed
    plugin, for a DeepSpeed one) resumes from it, resharding as usual.
    """  # fmt: skip
    with errors_as_one_line():
        from tiercheck.integrations.importer import import_checkpoint  # torch: not imported for the other commands

        url = tier_url(target)
        options = typed_options(ctx.options) or None
        remote = None if _is_local(url) else url
        staging = tempfile.mkdtemp(prefix="tiercheck-import-") if remote else url
        try:
            done = import_checkpoint(source, staging, step=step, remote=remote, remote_options=options,
                                     allow_pickle=allow_pickle, tag=tag)  # fmt: skip
        finally:
            if remote:
                shutil.rmtree(staging, ignore_errors=True)
        rate = done.nbytes / max(done.seconds, 1e-9)
        out.print(
            f"imported {source} ({_what(done.kind, done.tag)}) as step {done.step} "
            f"of {target}: {done.tensors} tensors, {human(done.nbytes)} in {done.seconds:.1f} s ({human(rate)}/s)"
        )


def _what(kind: str, tag: str | None) -> str:
    if kind == "deepspeed":
        return f"DeepSpeed checkpoint {tag!r}"
    return "DCP checkpoint" if kind == "dcp" else "torch.save file"


def _is_local(url: str) -> bool:
    """A plain path is the run's local directory; any URL (``file://`` too) is a remote tier to drain to."""
    return "://" not in url
