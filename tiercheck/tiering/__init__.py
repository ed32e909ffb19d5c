"""Moving committed steps between tiers: ``drain`` (local to remote, in the background),
``replication`` (to peers' local tiers), ``transfer`` (one step's files from one tier to another)
and ``retention`` (which local steps to keep)."""
