"""``python -m tiercheck``: the same as the ``tiercheck`` command."""

from tiercheck.cli import main

main()
