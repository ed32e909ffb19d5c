"""TODO docstring: tiercheck/dist."""
