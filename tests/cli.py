"""The ``tiercheck`` command run in the test's own process, through click's ``CliRunner``: what a subprocess
gives (exit status, stdout, stderr apart) without starting an interpreter and importing torch for each command.

A subprocess is left only where the process boundary is the point: the console-script entry point, a copy
killed with SIGKILL, a command that must not import torch.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from click.testing import CliRunner

from tests.servers import SeaweedS3
from tiercheck.cli import main

# click 8.2 keeps stderr apart by default and dropped ``mix_stderr``; 8.1 (the floor in pyproject.toml) mixes it
# into stdout unless told not to.
_APART: dict[str, Any] = {"mix_stderr": False} if "mix_stderr" in inspect.signature(CliRunner).parameters else {}


@dataclass(frozen=True)
class Ran:
    """A finished command, named as ``subprocess.CompletedProcess`` names it."""

    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


def run(*args: str, check: bool = True, env: Mapping[str, str | None] | None = None) -> Ran:
    """``tiercheck ARGS...``; ``check``: fail the test on a non-zero exit. ``env`` sets (a value) or unsets
    (``None``) environment variables for this command only. An exception the command does not turn into its
    one-line error propagates, traceback and all, as it would end the process."""
    result = CliRunner(**_APART).invoke(main, list(args), prog_name="tiercheck", env=env, catch_exceptions=False)
    ran = Ran(args, result.exit_code, result.stdout, result.stderr)
    if check and ran.returncode != 0:
        raise AssertionError(f"tiercheck {' '.join(args)} exited {ran.returncode}:\n{ran.stdout}\n{ran.stderr}")
    return ran


def s3_args(server: SeaweedS3) -> list[str]:
    """The ``-o`` options that point the command at ``server`` with its credentials."""
    return ["-o", f"endpoint_url={server.endpoint_url}", "-o", f"key={server.key}", "-o", f"secret={server.secret}"]
