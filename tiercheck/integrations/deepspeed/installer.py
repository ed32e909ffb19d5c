"""``install()``: a DeepSpeed engine checkpoints through a :class:`TiercheckCheckpointEngine`.

On an engine: its ``checkpoint_engine`` is replaced and its ``save_checkpoint`` / ``load_checkpoint`` are
wrapped (``save_checkpoint`` stages the step before it returns; ``load_checkpoint`` restores through tiercheck
first). On a config dict: ``DeepSpeedEngine._configure_checkpointing`` is patched, once per process, so that
the engine ``deepspeed.initialize`` builds from that very dict gets the same, without building DeepSpeed's own
writer first.
"""


from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from tiercheck.integrations.deepspeed.compat import DeepSpeedEngine
from tiercheck.integrations.deepspeed.engine import TiercheckCheckpointEngine
from tiercheck.integrations.deepspeed.files import refuse_universal

__all__ = ["install"]


_configs: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (DeepSpeed config dict, install options)


def install(engine_or_config: Any, **options: Any) -> Any:
    """Make DeepSpeed checkpoint through tiercheck; call it once, before or after ``deepspeed.initialize``.

    With a ``DeepSpeedEngine``: its ``checkpoint_engine`` becomes a :class:`TiercheckCheckpointEngine`
    and its ``load_checkpoint`` is wrapped (see ``tiercheck.integrations.deepspeed``); returns the checkpoint engine.
    With a config dict: the engine ``deepspeed.initialize`` later builds from this very dict gets
    the same; returns the dict. Keyword arguments: ``local``, ``remote``, ``allow_pickle``,
    ``safe_globals``, and :class:`tiercheck.Checkpointer`'s options.
    """
    if isinstance(engine_or_config, DeepSpeedEngine):
        return _attach(engine_or_config, options)
    if isinstance(engine_or_config, dict):
        _patch_configure_checkpointing()
        _configs.append((engine_or_config, options))
        return engine_or_config
    raise TypeError(
        "install() takes a DeepSpeedEngine or the config dict given to deepspeed.initialize, "
        f"not {type(engine_or_config).__qualname__} (load a JSON config file into a dict first)"
    )


def _attach(engine: Any, options: dict[str, Any]) -> TiercheckCheckpointEngine:
    current = getattr(engine, "checkpoint_engine", None)
    if isinstance(current, TiercheckCheckpointEngine):
        raise RuntimeError("tiercheck is already installed on this DeepSpeed engine")
    if current is not None and current.is_decoupled():
        current.cleanup()
    ours = TiercheckCheckpointEngine(engine, **options)
    engine.checkpoint_engine = ours
    # DeepSpeed asked the engine it built, at initialize, whether this rank writes model states.
    engine.save_non_zero_checkpoint = True
    ignored = _writer_settings(getattr(engine, "_config", None))
    if ignored:
        warnings.warn(
            "tiercheck writes DeepSpeed's checkpoints, so these DeepSpeed config settings have no effect: "
            f"{', '.join(ignored)} (tiercheck's own are its Checkpointer options, e.g. "
            "write=tiercheck.WriteOptions(io_threads=..., direct_io=...), given to install())",
            UserWarning,
            stacklevel=3,
        )
    original_save, original = engine.save_checkpoint, engine.load_checkpoint

    @functools.wraps(original_save)
    def save_checkpoint(save_dir: str, *args: Any, **kwargs: Any) -> Any:
        with ours.saving(save_dir):
            out = original_save(save_dir, *args, **kwargs)
        # Copy the state now, not at DeepSpeed's decoupled commit in the next engine.step():
        # the pipeline engine steps its optimizer without that commit, so the fence is not everywhere.
        ours.stage()
        return out

    @functools.wraps(original)
    def load_checkpoint(load_dir: str, tag: str | None = None, *args: Any, **kwargs: Any) -> Any:
        if getattr(engine, "load_universal_checkpoint", bool)():  # DeepSpeed reads universal checkpoints itself
            ours.flush()
            refuse_universal(load_dir, tag)
            return original(load_dir, tag, *args, **kwargs)
        tag = ours.prepare_load(load_dir, tag)
        if tag is None and not os.path.isfile(os.path.join(load_dir, "latest")):
            return None, None  # nothing to restore: a fresh start
        try:
            return original(load_dir, tag, *args, **kwargs)
        finally:
            ours.finish_load()

    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint
    return ours


@functools.cache
def _patch_configure_checkpointing() -> None:
    original = DeepSpeedEngine._configure_checkpointing

    @functools.wraps(original)
    def configure(self: Any, *args: Any, **kwargs: Any) -> Any:
        given = getattr(self._config, "_param_dict", None)
        options = next((o for config, o in _configs if config is given), None)
        if options is None:
            return original(self, *args, **kwargs)
        # DeepSpeed's own writer (FastPersist, decoupled, DataStates) would only be built to be
        # replaced: its I/O buffers allocated, and on CPU its parallel-writer setup fails. The plain
        # engine stands in while DeepSpeed decides which ranks save what.
        with _plain_engine_while_configuring():
            out = original(self, *args, **kwargs)
        _attach(self, options)
        return out

    DeepSpeedEngine._configure_checkpointing = configure


_DATASTATES_KEY = "datastates_ckpt"


def _writer_settings(config: Any) -> list[str]:
    """The DeepSpeed config settings of a checkpoint writer that tiercheck replaces, as dotted
    names: ``checkpoint.writer.*`` (FastPersist, decoupled), ``checkpoint.checkpoint_serialization``
    (torch.save's zip format) and ``datastates_ckpt`` (enabled unless it is ``false``, as DeepSpeed reads it)."""
    raw = getattr(config, "_param_dict", None)
    if not isinstance(raw, Mapping):
        return []
    names: list[str] = []
    section = raw.get("checkpoint")
    section = section if isinstance(section, Mapping) else {}
    writer = section.get("writer")
    if isinstance(writer, Mapping):
        names += [f"checkpoint.writer.{k}" for k in writer] or ["checkpoint.writer"]
    if "checkpoint_serialization" in section:
        names.append("checkpoint.checkpoint_serialization")
    if raw.get(_DATASTATES_KEY, False) is not False:
        names.append(_DATASTATES_KEY)
    return names


@contextlib.contextmanager
def _plain_engine_while_configuring() -> Iterator[None]:
    from deepspeed.runtime import engine as engine_module
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    original = engine_module.create_checkpoint_engine
    engine_module.create_checkpoint_engine = lambda config_params, **_: TorchCheckpointEngine(config_params)
    try:
        yield
    finally:
        engine_module.create_checkpoint_engine = original
