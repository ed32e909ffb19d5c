"""TODO docstring: tiercheck/tiering."""
