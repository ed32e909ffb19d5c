"""The ``tiercheck`` command: ``main`` is the click group (``commands``); its subcommands are in
``steps`` (ls, inspect, verify), ``copy`` (restore, export-deepspeed, gc), ``drain``, ``memory`` (persist, and gc's
``--memory``), ``hf`` (export) and ``plan``;
``common`` holds their shared options, output and errors, ``sizing`` the arithmetic behind
``tiercheck plan``."""

from tiercheck.cli.commands import main

__all__ = ["main"]
