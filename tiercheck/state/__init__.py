"""TODO docstring: tiercheck/state."""
