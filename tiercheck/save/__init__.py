"""TODO docstring: tiercheck/save."""
