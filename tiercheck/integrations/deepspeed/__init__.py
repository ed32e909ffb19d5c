"""DeepSpeed: ``engine.save_checkpoint`` / ``engine.load_checkpoint`` through tiercheck's tiers.

    import tiercheck.integrations.deepspeed as tiercheck_ds

    engine, *_ = deepspeed.initialize(model=model, config=config, ...)
    tiercheck_ds.install(engine, local="/nvme/ckpt", remote="s3://bucket/run1")
    ...
    engine.save_checkpoint("checkpoints")   # returns once the state is in host memory
    engine.load_checkpoint("checkpoints")   # the newest step every rank can get, from the fastest tier

:func:`install` replaces the engine's checkpoint engine with :class:`TiercheckCheckpointEngine`
and wraps ``engine.load_checkpoint``. DeepSpeed still decides what goes into its files
(``mp_rank_00_model_states.pt``, ``zero_pp_rank_N_..._optim_states.pt``, ...); instead of one
``torch.save`` per file, every rank's files of one ``save_checkpoint`` become one tiercheck step,
numbered by ``engine.global_steps`` and committed only when every rank's part is durable:

* ``save_checkpoint`` records DeepSpeed's state dicts without cloning them and, before it
  returns, copies their tensors into tiercheck's reusable host buffers. Writing, fsync and the
  commit happen in the background. The engine is "decoupled" (DeepSpeed's term), so DeepSpeed
  leaves ``latest`` to it: ``latest`` and the small pointer files in ``<save_dir>/<tag>/`` are
  written once the step is committed, so ``latest`` never names a step that is not there.
  (DeepSpeed's own decoupled commit, at the next ``engine.step()``, is not where the copy is
  made: the pipeline engine steps its optimizer without it.) Every data-parallel replica hands
  over the model-state files and each chunk is written once, the writing spread over the replicas.
* ``load_checkpoint(dir)`` without a tag restores the newest step that every rank can get (from
  node-local directories, another rank's node, or the remote tier), not what ``latest`` says.
  Each rank reads only the files it will load (its own ZeRO partition, its model-parallel rank's
  model states). Checkpoints DeepSpeed wrote itself (``torch.save`` files) still load.
* Plain objects DeepSpeed stores (its loss scaler, ``torch.Size``, ...) are kept with
  ``torch.save`` and read back with ``torch.load(weights_only=True)``, which only rebuilds an
  allow-list of types (DeepSpeed's loss scalers and ``safe_globals``); anything else needs
  ``allow_pickle=True``.
* :func:`export` writes a step back as DeepSpeed's own files, to switch back at any time, or to
  convert with DeepSpeed's ``ds_to_universal``: universal checkpoints are read by DeepSpeed itself.

Modules: ``engine`` (:class:`TiercheckCheckpointEngine`), ``installer`` (:func:`install`), ``files`` (packed
state dicts, pointer files, :func:`export`), ``source`` (``tiercheck import`` of DeepSpeed's own checkpoints),
``compat`` (what is imported from DeepSpeed).
"""


from __future__ import annotations

from tiercheck.integrations.deepspeed.engine import TiercheckCheckpointEngine
from tiercheck.integrations.deepspeed.files import export
from tiercheck.integrations.deepspeed.installer import install

__all__ = ["TiercheckCheckpointEngine", "export", "install"]
