"""The ``tiercheck`` command: pre-stage restores, list, inspect, verify, drain, persist memory, collect garbage, plan.

Every subcommand takes local directories and remote URLs alike (``s3://``, ``az://``, ``file://``);
``-o key=value`` passes fsspec options (endpoint, credentials) for remote URLs, which otherwise come
from the environment as s3fs / adlfs read it. Errors end the command with one line on stderr and
exit status 1; nothing committed is ever deleted or overwritten except by ``gc`` without
``--dry-run``, which never deletes the newest committed step.

This module is the group, ``main``, and its options; the subcommands are in ``steps`` (ls, inspect,
verify), ``copy`` (restore, export-deepspeed, gc), ``drain``, ``memory`` (persist), ``adopt`` (import), ``hf``
(export) and ``plan``.
"""


from __future__ import annotations

import sys

import click

from tiercheck.cli.adopt import import_command
from tiercheck.cli.common import Context, OneLineGroup, configure_logging, parse_options, positive_number
from tiercheck.cli.copy import export_deepspeed_command, gc_command, restore_command
from tiercheck.cli.drain import drain_command
from tiercheck.cli.hf import export_command
from tiercheck.cli.memory import persist_command
from tiercheck.cli.sizing_table import plan_command
from tiercheck.cli.steps import inspect_command, ls_command, verify_command
from tiercheck.options import RetryOptions
from tiercheck.version import __version__


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="tiercheck")
@click.option(
    "-o",
    "--option",
    "options",
    multiple=True,
    metavar="KEY=VALUE",
    help="fsspec option for remote URLs (e.g. -o endpoint_url=http://... -o key=...); repeatable; also "
    "after the subcommand.",
)
@click.option(
    "--retry-deadline",
    type=float,
    default=120.0,
    callback=positive_number,
    show_default=True,
    metavar="SECONDS",
    help="Give up on a remote request that keeps failing transiently after this long.",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
@click.option("-v", "--verbose", is_flag=True, help="Log what tiercheck does (to stderr).")
@click.pass_context
def main(ctx: click.Context, options: tuple[str, ...], retry_deadline: float, quiet: bool, verbose: bool) -> None:
    """Checkpoints on local disks and in object stores: inspect them, move them, size them.

    URL_OR_DIR is a local directory, or a remote URL: s3://bucket/prefix, az://container/prefix,
    abfs://..., file:///path (credentials from -o options or the environment).
    """  # fmt: skip
    ctx.call_on_close(configure_logging(verbose))
    retry = RetryOptions(attempts=50, initial_backoff_s=0.2, max_backoff_s=10.0, deadline_s=retry_deadline)
    ctx.obj = Context(parse_options(options), retry, quiet or not sys.stderr.isatty())


for command in (
    ls_command,
    inspect_command,
    verify_command,
    restore_command,
    drain_command,
    persist_command,
    import_command,
    export_command,
    export_deepspeed_command,
    gc_command,
    plan_command,
):
    main.add_command(command)


if __name__ == "__main__":
    main()
