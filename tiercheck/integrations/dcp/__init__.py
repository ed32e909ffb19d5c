"""PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``, DCP) through tiercheck's tiers.

    import torch.distributed.checkpoint as dcp
    from tiercheck.integrations.dcp import TiercheckReader, TiercheckWriter

    writer = TiercheckWriter(local="/nvme/ckpt/run1", remote="s3://bucket/run1")   # every rank, once
    dcp.save(state_dict, storage_writer=writer, checkpoint_id=100)                 # step 100
    dcp.load(state_dict, storage_reader=TiercheckReader(local="/nvme/ckpt/run1"))   # the newest committed step
    writer.close()                                                                 # waits for the drain

DCP plans what is written (its planner flattens the state dict, picks one rank per replicated item and builds
the global ``Metadata``); these classes store it as one tiercheck step per save, ``checkpoint_id`` its number.
DCP's call order (``storage.py``), and what each call does here:

Saving: ``reset(checkpoint_id)`` (all ranks: the step) -> ``set_up_storage_writer`` (all) ->
``prepare_local_plan`` (all; as is) -> ``prepare_global_plan`` (coordinator: notes whether any rank's share
changed, and says so to every rank in ``storage_data``) -> ``write_data`` (all: the rank's items become one
Checkpointer state, tensors as ``Shard`` pieces, DCP's pickled objects as ``bytes``; ``save`` stages, writes with
CRCs and commits once every rank's part is durable, and the future completes then) -> ``finish``
(coordinator: the step is committed already; the drain to the remote tier runs on in the background).

Loading: ``reset`` (all, only with a ``checkpoint_id``) -> ``read_metadata`` (all: agree on the step,
rebuild ``Metadata`` from its JSON) -> ``set_up_storage_reader`` / ``prepare_*_plan`` (as is) ->
``read_data`` (all: one collective ``Checkpointer.restore`` of the box each tensor's read items cover,
every chunk from the fastest valid tier and verified first; then the regions go to the planner).

One Checkpointer per local directory and process serves its writers and readers (tiercheck allows one
writer per directory: a second Checkpointer would get ``DirectoryInUseError``). The writers, one for every
save or a new one per call (DCP's idiom), share it, host pool and save plan with it, until one's ``close()``
or interpreter exit; a reader without a writer opens one for ``read_data``.

Modules: ``writer`` (:class:`TiercheckWriter`), ``reader`` (:class:`TiercheckReader`) and ``regions`` (what a
read item covers), ``metadata`` (DCP's ``Metadata`` as JSON), ``shared`` (the Checkpointer per directory).
"""


from __future__ import annotations

from tiercheck.integrations.dcp.reader import TiercheckReader
from tiercheck.integrations.dcp.writer import TiercheckWriter

__all__ = ["TiercheckReader", "TiercheckWriter"]
