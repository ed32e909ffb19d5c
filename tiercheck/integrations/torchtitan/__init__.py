"""torchtitan's checkpointing through tiercheck's tiers: a ``CheckpointManager`` to select in a config module.

    from tiercheck.integrations.torchtitan import TiercheckCheckpointManager

    config = llama3_debugmodel()                       # any torchtitan Trainer.Config
    config.checkpoint = TiercheckCheckpointManager.Config(
        enable=True, interval=500, async_mode="async", keep_latest_k=3,
        remote="s3://bucket/run1",                     # local: the checkpoint folder, unless local=... says
    )

Every step is a tiercheck step saved by ``dcp.save`` / ``dcp.async_save`` through
:class:`~tiercheck.integrations.dcp.TiercheckWriter` and loaded by ``dcp.load`` through
:class:`~tiercheck.integrations.dcp.TiercheckReader`. A (re)start resumes from the newest step every rank can
restore, from the local tier or the remote (a new node restores from the remote alone), which continues the run's
lineage. Without a tiercheck step yet (a run moved over mid-way), it continues from torchtitan's own newest
``step-N/`` in the folder; another framework's checkpoints there stop the start (``ForeignCheckpointError``, naming
``tiercheck import``); only a directory holding none is a fresh start. ``initial_load_path`` may name a DCP
checkpoint (torchtitan's own, loaded by DCP) or another run's tiercheck step directory (restored by tiercheck).
Retention is tiercheck's: ``keep_latest_k`` is the local tier's ``keep_last``, ``remote_keep_last`` the remote's;
torchtitan's purge never runs. ``close()`` waits for the drain.

Supported: torchtitan 0.3 (the ``torchtitan.components.checkpointer`` package, ``CheckpointManager.Config``),
checked by what the installed torchtitan has (``compat``), not by its version string. ``async_mode``:
``"disabled"`` (the save returns once committed), ``"async"`` (DCP's thread saves; the step commits in the
background), ``"async_with_pinned_mem"`` (DCP's asynchronous stager, then DCP's thread: DCP's separate
process would pickle the writer away from this process's Checkpointer; it needs CUDA, and is refused when the
manager is built without it: use ``"async"`` there).

Modules: ``manager`` (:class:`TiercheckCheckpointManager`), ``compat`` (what is taken from torchtitan).
"""


from __future__ import annotations

from tiercheck.integrations.torchtitan.compat import TORCHTITAN_VERSION
from tiercheck.integrations.torchtitan.manager import TiercheckCheckpointManager

__all__ = ["TORCHTITAN_VERSION", "TiercheckCheckpointManager"]
