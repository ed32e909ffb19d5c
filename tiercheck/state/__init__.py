"""The training state as both save and restore see it: ``flatten`` (a state to named tensors and a
JSON tree, and back), ``sharding`` (which slice of a global tensor a rank holds) and ``staging``
(the reusable host memory snapshots are copied into)."""
