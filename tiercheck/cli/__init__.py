"""The ``tiercheck`` command: ``main`` is the click group (``commands``), ``common`` its shared
options, output and errors, ``sizing`` the arithmetic behind ``tiercheck plan``."""

from tiercheck.cli.commands import main

__all__ = ["main"]
