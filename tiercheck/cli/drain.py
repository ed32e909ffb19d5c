"""``tiercheck drain``: finish the drains of a node's local tier to the remote tier; and ``drain_steps``,
the upload it and ``persist --remote`` share."""


from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

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
    step_bytes,
    step_value,
)
from tiercheck.format.steps import list_steps, read_manifest
from tiercheck.tiering.drain import pending_steps
from tiercheck.tiering.upload import upload_step
from tiercheck.tiers.base import Tier


@click.command("drain")
@click.argument("local", metavar="DIR")
@click.option("--to", "remote", required=True, metavar="URL", help="The remote tier.")
@click.option(
    "--step",
    default=None,
    callback=step_value,
    help="Drain this step (default: every committed step whose save the remote does not hold).",
)
@click.option("--threads", default=8, show_default=True, type=THREADS, help="Files uploaded at once.")
@click.option(
    "--take-over",
    is_flag=True,
    help="Drain even where the remote prefix holds steps of another lineage (another run's), making it DIR's.",
)
@remote_options
@pass_context
def drain_command(ctx: Context, local: str, remote: str, step: str | None, threads: int, take_over: bool) -> None:
    """Finish drains from a node's local tier to the remote tier (e.g. after a job ended early).

    Uploads what is missing (a pack already there is skipped when its parts' checksums match)
    and commits the step on the remote once every saving rank's files are there; with several
    nodes, run it on each. Steps go by save: one the remote holds another save of (a rollback's)
    is drained. The prefix must belong to DIR's lineage (or hold no step): one holding another
    run's steps is refused, unless --take-over.
    """
    with errors_as_one_line():
        src = ctx.tier(local)
        assert src.local_path is not None
        dst = ctx.tier(remote, must_exist=False)
        # By save: a step of the same number there from another save (a rollback's) is replaced.
        steps = [pick_step(src, step)] if step is not None else pending_steps(src, list_steps(src).committed, dst)
        if not steps:
            out.print(f"nothing to drain: {dst.url} holds the save of every step of {src.url}")
            return
        drain_steps(ctx, src, dst, steps, threads=threads, take_over=take_over)


def drain_steps(ctx: Context, src: Tier, dst: Tier, steps: list[int], *, threads: int, take_over: bool = False) -> None:
    """Upload ``steps`` from the local tier ``src`` to the remote ``dst`` (what the remote holds
    already is skipped), printing each step's result (``drain``, ``persist --remote``)."""
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for n in steps:
            total = step_bytes(read_manifest(src, n))
            done = 0
            with progress(ctx, f"step {n}", total) as report:

                def on_file(nbytes: int, report: Callable[[int, int], None] = report, total: int = total) -> None:
                    nonlocal done
                    done += nbytes
                    report(done, total)

                # A local directory (the callers' own); upload_step's annotation asks for the class,
                # though it uses nothing beyond Tier.
                result = upload_step(src, dst, n, pool=pool, on_file=on_file, take_over=take_over)
            state = (
                "already committed there" if result.was_committed
                else "committed" if result.committed
                else "uploaded; waiting for the other nodes' files before it can commit"
            )  # fmt: skip
            out.print(
                f"step {n} -> {dst.url}: {result.files_uploaded} files ({human(result.bytes_uploaded)}), "
                f"{result.files_already_there} already there; {state}"
            )
