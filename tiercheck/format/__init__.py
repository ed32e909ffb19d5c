"""TODO docstring: tiercheck/format."""
