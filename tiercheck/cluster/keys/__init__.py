"""Every store key tiercheck uses, in one place: the vocabulary of its wire between ranks.

A store key is ``tiercheck/<namespace>/<scope>/<segments...>``. The namespace is a Checkpointer's
(``job_namespace``) or, in a node's store, that Checkpointer's node's (``node_namespace``). A *scope*
names one run of one exchange (``plan3``, ``save/120/0``, ``restore2/reads``); the coordinator's
patterns (``Coordinator.arrive``, ``post``, ``report``, ``finish``) and ``cluster.hierarchy`` hang
their keys under a scope they are given. A family here that takes ``on`` (a coordinator: anything
with a ``namespace``) returns a whole key; ``*_scope`` and ``*_bucket`` families return a scope.

No module builds a key or a scope any other way (``tests/test_protocol_keys.py`` scans for one), and
``docs/protocol.md`` says, for every family, which rank writes it, who reads it, in which round of
which exchange, its encoding and its bound. Each family's docstring says the same in brief: *W* who
writes, *R* who reads, *value* its encoding where it is not one of the exchange's messages, *bound*
how many exist at once. Node keys live in a node's store, the others in the job's (rank 0's).

The families live by exchange: ``keys.nodes`` (joining, channels, the lock), ``keys.save`` (the save
plan, the vote), ``keys.restore`` and ``keys.tiering``; ``keys._core`` holds the join, the digest,
the namespaces and the keys of the coordinator's patterns, re-exported here.
"""

from tiercheck.cluster.keys import nodes, restore, save, tiering
from tiercheck.cluster.keys._core import (
    DIGEST_BYTES,
    DIGEST_HEX,
    FAMILIES,
    ROOT,
    Namespaced,
    all_left_key,
    answer_key,
    arrived_key,
    bucket_item_key,
    bucket_n_key,
    digest,
    error_key,
    finished_key,
    job_namespace,
    left_key,
    node_in_scope,
    node_namespace,
    open_key,
    out_key,
    scope_key,
    up_key,
)

__all__ = [
    "DIGEST_BYTES",
    "DIGEST_HEX",
    "FAMILIES",
    "ROOT",
    "Namespaced",
    "all_left_key",
    "answer_key",
    "arrived_key",
    "bucket_item_key",
    "bucket_n_key",
    "digest",
    "error_key",
    "finished_key",
    "job_namespace",
    "left_key",
    "node_in_scope",
    "node_namespace",
    "nodes",
    "open_key",
    "out_key",
    "restore",
    "save",
    "scope_key",
    "tiering",
    "up_key",
]
