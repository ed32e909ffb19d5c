"""TODO docstring: tiercheck/restore."""
