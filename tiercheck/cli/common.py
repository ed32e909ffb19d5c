"""What every ``tiercheck`` subcommand shares: the consoles, the context holding fsspec options and
retry limits, one-line errors, option validation, choosing a step, progress bars and human-readable
numbers.

No torch and no zarr here: ``tiercheck --help``, ``ls``, ``inspect`` and ``plan`` answer without them.
"""


from __future__ import annotations

import functools
import json
import logging
import math
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import IO, Any, ClassVar, NoReturn

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

from tiercheck.errors import CheckpointNotFoundError, NotADirectoryTierError, TiercheckError
from tiercheck.format.codec import chunk_nbytes
from tiercheck.format.manifest import Manifest
from tiercheck.format.paths import step_of
from tiercheck.format.steps import list_steps
from tiercheck.humanize import fmt_steps
from tiercheck.options import RetryOptions
from tiercheck.tiers.base import Tier
from tiercheck.tiers.remote import open_tier

# Piped output (scripts, logs, tests) gets wide lines rather than tables wrapped at 80 columns.
# No emoji codes: ":-1:" in a tier's spec or a path would print as a thumbs-down.
out = Console(highlight=False, emoji=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False, emoji=False, soft_wrap=True, width=None if sys.stderr.isatty() else 200)


class Context:
    def __init__(self, options: dict[str, str], retry: RetryOptions, quiet: bool) -> None:
        self.options = options
        self.retry = retry
        self.quiet = quiet

    def tier(self, url: str, *, must_exist: bool = True) -> Tier:
        tier = open_tier(url, storage_options=typed_options(self.options) or None, retry=self.retry)
        root = tier.local_path
        if root is None:  # an object store: nothing to check before the first request
            return tier
        if root.exists() and not root.is_dir():
            raise NotADirectoryTierError(f"not a directory: {root} is a file; give a checkpoint directory")
        if must_exist and not root.is_dir():
            raise CheckpointNotFoundError(f"no such directory: {root}")
        if step_of(root.name) is not None and root.is_dir():
            raise CheckpointNotFoundError(
                f"{root} is the directory of one step; give the checkpoint directory that holds it: {root.parent}"
            )
        return tier


def typed_options(options: dict[str, str]) -> dict[str, Any]:
    """``-o key=value`` strings as JSON where they parse (numbers, booleans), else strings."""
    typed: dict[str, Any] = {}
    for k, v in options.items():
        try:
            typed[k] = json.loads(v)
        except ValueError:
            typed[k] = v
    return typed


pass_context = click.make_pass_decorator(Context)


def pick_step(tier: Tier, step: str) -> int:
    """The committed step ``--step`` names: a number, or ``latest``."""
    committed = list_steps(tier).committed
    if not committed:
        raise CheckpointNotFoundError(f"{tier.url} holds no committed step")
    if step == "latest":
        return committed[-1]
    try:
        n = int(step)
    except ValueError:
        raise click.BadParameter(f"expected a step number or 'latest', got {step!r}", param_hint="--step") from None
    if n not in committed:
        raise CheckpointNotFoundError(f"step {n} is not committed in {tier.url} (committed: {fmt_steps(committed)})")
    return n


def step_bytes(manifest: Manifest) -> int:
    """The bytes of a step's chunks, every rank's."""
    return sum(len(rec.checksums) * chunk_nbytes(rec) for rec in manifest.arrays.values())


def fail(message: str) -> NoReturn:
    err.print(f"tiercheck: error: {message}", markup=False)
    sys.exit(1)


@contextmanager
def errors_as_one_line() -> Iterator[None]:
    try:
        yield
    except (TiercheckError, OSError, ValueError, OverflowError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        fail("interrupted; run the same command again to resume")


class _OneLineUsageError(click.UsageError):
    """A bad option or argument as one line on stderr (exit status 2), like every other error."""

    def show(self, file: IO[Any] | None = None) -> None:
        hint = f" (see '{self.ctx.command_path} --help')" if self.ctx is not None else ""
        err.print(f"tiercheck: error: {self.format_message()}{hint}", markup=False)


def _one_line(e: click.UsageError) -> _OneLineUsageError:
    return _OneLineUsageError(e.format_message(), e.ctx)


#: Words a user may try for a subcommand, and the one that does it (the README says the command "sizes").
SYNONYMS = {"size": "plan", "sizes": "plan", "list": "ls", "check": "verify", "copy": "restore", "upload": "drain"}


class OneLineGroup(click.Group):
    """Click's usage errors (a usage block, a blank line, then the error) as one line; no arguments at all
    show the help (exit status 0), and a word for a subcommand names the subcommand."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except _OneLineUsageError:
            raise
        except click.exceptions.NoArgsIsHelpError as e:
            assert e.ctx is not None
            click.echo(e.ctx.get_help())
            e.ctx.exit(0)
        except click.UsageError as e:
            raise _one_line(e) from None

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as e:
            name = args[0] if args else ""
            if name in SYNONYMS:
                raise click.UsageError(
                    f"No such command {name!r}. Did you mean {SYNONYMS[name]!r}?", ctx
                ) from None
            raise e

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except _OneLineUsageError:
            raise
        except click.UsageError as e:
            raise _one_line(e) from None


def parse_options(values: tuple[str, ...]) -> dict[str, str]:
    options = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected key=value, got {item!r}", param_hint="-o/--option")
        options[key] = value
    return options


_OPTION_HELP = "fsspec option for remote URLs (e.g. -o endpoint_url=http://... -o key=...); repeatable."


def _add_options(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> None:
    obj = ctx.find_object(Context)
    if values and obj is not None:
        obj.options.update(parse_options(values))


def remote_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``-o key=value`` on a subcommand too (``tiercheck ls s3://... -o endpoint_url=...``): merged
    over the ones given before the subcommand."""
    return click.option(
        "-o",
        "--option",
        "options",
        multiple=True,
        metavar="KEY=VALUE",
        expose_value=False,
        callback=_add_options,
        help=_OPTION_HELP,
    )(f)


def positive_number(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A finite number above zero (``-1``, ``nan``, ``inf`` and ``1e400`` are refused by name)."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise click.BadParameter(f"expected a finite number above 0, got {value}", ctx, param)
    return value


def non_negative_number(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A finite number, zero or more (``-1``, ``nan`` and ``inf`` are refused by name)."""
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise click.BadParameter(f"expected a finite number of 0 or more, got {value}", ctx, param)
    return value


class ParameterCount(click.ParamType):
    """``plan --params``: a count as people write it (``7B``, ``70e9``, ``1.5T``, ``350M``, ``125k``),
    from 1 to 1e16 (ten thousand times today's largest models)."""

    name = "COUNT"
    _SCALE: ClassVar[dict[str, float]] = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    _TEXT = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e([+-]?[0-9]+))?\s*([kmbgt]?)", re.IGNORECASE)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            n = float(value)
        else:
            m = self._TEXT.fullmatch(str(value).strip().replace("_", ""))
            if m is None:
                self.fail(f"expected a parameter count such as 7B, 70e9 or 1.5T, got {value!r}", param, ctx)
            try:
                n = float(m[1]) * 10.0 ** int(m[2] or 0) * self._SCALE[m[3].lower()]
            except OverflowError:  # 1e400
                n = math.inf
        if not (math.isfinite(n) and 1 <= n <= 1e16):
            self.fail(f"expected a parameter count from 1 to 1e16, got {value}", param, ctx)
        return round(n)


#: Counts of things (layers, ranks, steps to keep): one at least.
AT_LEAST_ONE = click.IntRange(min=1)

#: ``--threads``: at least one (0 threads would copy or check nothing, and waited forever or said "intact").
THREADS = click.IntRange(1, 1024)

ASCII_INT = re.compile(r"-?[0-9]+")


def step_value(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``latest`` or a non-negative step number."""
    if value is None or value == "latest":
        return value
    if not ASCII_INT.fullmatch(value.strip()):  # int() takes '1_0' and other scripts' digits too
        raise click.BadParameter(f"expected a step number or 'latest', got {value!r}", ctx, param)
    n = int(value)
    if n < 0:
        raise click.BadParameter(f"a step is a non-negative number, got {n}", ctx, param)
    return str(n)


class _ConsoleHandler(logging.Handler):
    """Log records as plain lines on the stderr console: above a live progress bar, not through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            err.print(f"{record.levelname}: {self.format(record)}", markup=False, highlight=False)
        except Exception:
            self.handleError(record)


def configure_logging(verbose: bool) -> Callable[[], None]:
    """The ``tiercheck`` logger's WARNINGs (retries, skipped steps) show by default, INFO with ``-v``.
    Returns the undo, for when the command ends: a process that runs ``main`` in itself (tests,
    ``CliRunner``) gets its logger back as it was."""
    logger = logging.getLogger("tiercheck")
    handler, level = _ConsoleHandler(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)

    def undo() -> None:
        logger.removeHandler(handler)
        logger.setLevel(level)

    return undo


def human(n: float, *, binary: bool = True) -> str:
    """Bytes with a unit: KiB, MiB... (``binary``) or kB, MB... (decimal, as bandwidths are quoted)."""
    base, units = (
        (1024, ("B", "KiB", "MiB", "GiB", "TiB", "PiB")) if binary else (1000, ("B", "kB", "MB", "GB", "TB", "PB"))
    )
    for unit in units:
        if abs(n) < base or unit == units[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= base
    raise AssertionError


def age(created: float) -> str:
    s = max(0.0, time.time() - created)
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.1f} {unit}"
    return f"{s:.0f} s"


@contextmanager
def progress(ctx: Context, what: str, total: int) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr (none with ``-q``, when stderr is not a terminal, or for 0 bytes)."""
    if ctx.quiet or total == 0:
        yield lambda done, total: None
        return
    columns = ("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=err, transient=False) as bar:
        task = bar.add_task(what, total=total)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def step_progress(ctx: Context, step: int) -> Callable[[int], AbstractContextManager[Callable[[int, int], None]]]:
    """A progress bar for checking a step, opened once the bytes to read are known (``verify_step``)."""
    return functools.partial(progress, ctx, f"step {step}")
