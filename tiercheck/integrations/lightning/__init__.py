"""PyTorch Lightning checkpoints through tiercheck's tiers: a ``CheckpointIO`` plugin.

    from tiercheck.integrations.lightning import TiercheckCheckpointIO

    trainer = Trainer(plugins=[TiercheckCheckpointIO(local="/nvme/ckpt/run1", remote="s3://bucket/run1")],
                      callbacks=[ModelCheckpoint(dirpath="ckpts", save_top_k=2, monitor="val_loss", save_last=True)])
    trainer.fit(model, ckpt_path="last")        # resumes from last.ckpt if there is one; a fresh start otherwise

Each Lightning save becomes tiercheck step ``global_step`` (staged before ``save_checkpoint`` returns, written and
drained in the background); the file Lightning names (``ckpts/epoch=3-step=400.ckpt``, ``last.ckpt``) is a small
JSON pointer to it (``pointer``), naming the step's save, written once the step is committed. Loading a pointer whose
step holds another save now (saved again after a rollback) is refused; else it restores its step through
the ``Checkpointer`` on global rank 0, which continues the run's lineage (tiercheck's ``LineageError`` guards a
directory against a second run that did not restore from it). Retention is tiercheck's, and keeps the steps
pointers still name: ``save_top_k``'s deletions remove pointers, never the newest restorable step.

Supported: Lightning 2.x as ``lightning`` or ``pytorch_lightning`` (``compat``), tested with 2.6.
Modules: ``checkpoint_io`` (:class:`TiercheckCheckpointIO`), ``pointer`` (the files Lightning sees), ``compat``.
"""


from __future__ import annotations

from tiercheck.integrations.lightning.checkpoint_io import TiercheckCheckpointIO
from tiercheck.integrations.lightning.compat import LIGHTNING_VERSION

__all__ = ["LIGHTNING_VERSION", "TiercheckCheckpointIO"]
