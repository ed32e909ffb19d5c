"""``python -m tiercheck``: the same as the ``tiercheck`` command."""

from .cli import main

main()
